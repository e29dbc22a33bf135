"""Copies between an engine's memory and the node daemon's slab, made by the engine itself: the bytes move
by memmove between this process's memory and the mapped slab, checked against the slot headers, and the
daemon hears what happened (at most one round trip per copy).

- a store reserves a slot per block (RESERVE: blocks the daemon holds already are skipped and count as
  stored, ``skipped_existing``; blocks another engine is writing, that the slab's policy declines or
  that find no room fail: counted drops), hashes each block as it copies it in (``slab.checksum``: key,
  bytes, the slot's generation), writes the checksum into the slot header, then commits (COMMIT,
  posted: the daemon reads it before this engine's next request): a block is visible to nobody before,
  and a reservation the daemon took back (the connection closed meanwhile) commits nothing;
- a load reads each block where the daemon said it was (``NodeStorage.location``: a lookup, a pin or
  this engine's store gave it), or else pins it (PIN, the one round trip); either way it copies the
  block out, then checks that the slot header still names the block at that generation (``state``,
  ``key``, ``length``), that the bytes that arrived hash to the writer's checksum, and that the
  generation did not move during the copy (the daemon hands a slot to a new writer only with a new
  generation, before the writer hears of it; also across restarts). A block read where it was said to
  be that fails the check (evicted and reused since) is pinned and read again; one that fails after a
  pin is damaged: its load fails (the engine recomputes it) and it is dropped at the daemon (DROP). The
  daemon hears of the blocks read unpinned as uses for its policy (TOUCH), and the pins are released
  (RELEASE), all without waiting.

A sealing tier (``NodeStorage.sealing``) seals a block into its slot instead of copying it there, the
seal after the block's bytes, the block's node key bound; the header's checksum is then 0, and a load
copies the sealed block out into the caller's memory and opens it there: the seal's tag, not the
checksum, says it is the block (one that does not open is zeroed there and fails, like one that fails
its checksum). Not opened in the slab itself: any engine may write there while the cipher reads, and
the tag would then vouch for bytes other than those decrypted.

A copy runs on the backend's threads, or on the caller's own where it waits for it at once
(``caller_runs``: ``TierStack.load_now``/``store_now``), with no thread woken.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from kvtier.core.caller_runs import caller_runs_here, offer
from kvtier.core.devices import HOST_DEVICE
from kvtier.core.errors import ClosedError, StoreError, TransferError
from kvtier.core.jobs import mark_kvtier_thread
from kvtier.core.keys import tenant_of
from kvtier.core.misses import MissReason
from kvtier.core.sealing import SEAL_BYTES, TAG_BYTES, Sealer
from kvtier.core.storage import Piece, block_pieces
from kvtier.core.transfer import OnComplete, Transfer, TransferBackend
from kvtier.tiers.node.protocol import HELD, Op, is_slot_gen
from kvtier.tiers.node.slab import READY, WRITING, SlabView, checksum, memory_view
from kvtier.tiers.node.tier import NODE_DEVICE, NodeStorage

log = logging.getLogger(__name__)


class NodeBackend(TransferBackend):
    """Loads and stores between host memory ("cpu") and node slabs, ``threads`` copies at once."""

    name = "node"
    pairs = frozenset({(HOST_DEVICE, NODE_DEVICE), (NODE_DEVICE, HOST_DEVICE)})

    def __init__(self, threads: int = 2) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvtier-node", initializer=mark_kvtier_thread)
        self._lock = threading.Condition()
        self._in_flight = 0
        self._closed = False

    def submit(self, transfer: Transfer, on_complete: OnComplete) -> None:
        if not self.can_copy(transfer.src.device, transfer.dst.device):
            raise TransferError(f"the node backend cannot copy {transfer.src.device} -> {transfer.dst.device}")
        storing, node, memory, slots = transfer.keyed_side()
        if not isinstance(node, NodeStorage):
            raise TransferError(f"a node transfer needs a NodeStorage, got {type(node).__name__}")
        assert transfer.keys is not None  # (Transfer requires keys for a side addressed by key)
        copy = _store if storing else _load
        run = functools.partial(self._run, copy, node, list(transfer.keys), block_pieces(memory, slots), on_complete)
        with self._lock:
            if self._closed:
                raise ClosedError("the node transfer backend is closed")
            self._in_flight += 1
        if not caller_runs_here():
            self._pool.submit(run, transfer)
            return

        def here(until: float) -> bool:
            """Run on the waiting caller's thread, or (released: it will not wait) on the pool."""
            if until <= time.monotonic():
                self._pool.submit(run, transfer)
                return False
            run(transfer)
            return True

        offer(here)

    def _run(self, copy, node: NodeStorage, keys: list[bytes], pieces: list[list[Piece]], on_complete, keep) -> None:
        """Copy, then report; ``keep`` holds the transfer, and so both storages' memory, until then."""
        try:
            failed = copy(node, keys, pieces)
        except Exception:
            log.exception("a kvtier node copy failed")
            failed = set(range(len(keys)))
        try:
            on_complete(failed)
        finally:
            with self._lock:
                self._in_flight -= 1
                self._lock.notify_all()

    def close(self) -> None:
        """Wait for the copies in flight (each ends by the tier's timeout), then refuse new ones."""
        with self._lock:
            self._closed = True
            while self._in_flight:
                self._lock.wait()
        self._pool.shutdown(wait=True)


def _store(node: NodeStorage, keys: list[bytes], pieces: list[list[Piece]]) -> set[int]:
    """Reserve, copy and hash in, commit; the blocks that did not land."""
    names = node.node_keys(keys)
    try:
        tags = [tenant_of(key) for key in keys]
        (given,), epoch, view = node.client.call(Op.RESERVE, names, [node.stored_bytes] * len(names), tags)
    except StoreError:
        return set(range(len(keys)))
    if not isinstance(given, list) or len(given) != len(names):  # (a daemon that answers another question)
        node.client.post(Op.ABORT, epoch, names)
        return set(range(len(keys)))
    held = [
        i for i, answer in enumerate(given) if isinstance(answer, list) and len(answer) in (1, 3) and answer[-1] == HELD
    ]
    reserved = [i for i, answer in enumerate(given) if is_slot_gen(answer)]
    written: list[int] = []
    try:
        for i in reserved:
            if _write(view, given[i][0], given[i][1], names[i], pieces[i], node.sealer(keys[i])):
                written.append(i)
    except BaseException:
        written = []
        raise
    finally:  # (a reservation not written, whatever the reason, is given back now: not at the lease's end)
        unwritten = [names[i] for i in reserved if i not in written]
        if unwritten:
            node.client.post(Op.ABORT, epoch, unwritten)
    if written and not node.client.post(Op.COMMIT, epoch, [names[i] for i in written]):
        written = []  # (the connection that reserved them is gone: so are the reservations)
    landed = written + held
    node.located([keys[i] for i in landed], [names[i] for i in landed], [given[i][:2] for i in landed], view, epoch)
    if held and node.on_skipped is not None:
        node.on_skipped(len(held))
    return set(range(len(keys))) - set(landed)


def _write(view: SlabView, slot: int, gen: int, name: bytes, pieces: list[Piece], sealer: Sealer | None) -> bool:
    """Copy a block into ``slot`` reserved for it at ``gen``, hashing it on the way, and put the checksum
    in the slot header (or seal it there, the seal after it); False (nothing written) where the slot is
    not the one the daemon said."""
    if not 0 <= slot < view.geometry.slots or not _header_is(view, slot, gen, name, WRITING):
        return False
    address = view.address(slot)
    if sealer is not None:
        block = sum(size for _, size in pieces)
        # (the tag's room after the block, where the seal then goes: one piece seals in one call)
        seal = sealer.seal_into(_views(pieces), memory_view(address, block + TAG_BYTES), name)
        memory_view(address + block, SEAL_BYTES)[:] = seal
        view.checksum[slot] = 0
        view.writer[slot] = os.getpid()
        return True
    h = checksum(gen, name)
    for source, size in _chunks(pieces):
        h.update(memory_view(source, size))  # (hashed first: then the copy reads it from cache)
        ctypes.memmove(address, source, size)
        address += size
    view.checksum[slot] = h.intdigest()
    view.writer[slot] = os.getpid()
    return True


def _load(node: NodeStorage, keys: list[bytes], pieces: list[list[Piece]]) -> set[int]:
    """Read each block where it was said to be, or pin it (under each of the storage's namespaces in turn,
    for the blocks not held under the ones before); the blocks that did not arrive good."""
    read: list[bytes] = []
    unread: list[int] = []
    for i, key in enumerate(keys):
        where = node.location(key)
        if where is not None and _read(where.view, where.slot, where.gen, where.name, pieces[i], node.sealer(key)):
            read.append(where.name)
            node.failures.note(key, None)
        else:
            unread.append(i)
    epoch = node.client.epoch
    failed: set[int] = set()
    for space in node.namespaces:
        if not unread:
            break
        failed_here, unread = _pin_and_read(node, keys, pieces, unread, space)
        failed |= failed_here
    if read:
        node.client.post(Op.TOUCH, epoch, read)
    return failed | set(unread)


def _pin_and_read(
    node: NodeStorage, keys: list[bytes], pieces: list[list[Piece]], which: list[int], space: bytes
) -> tuple[set[int], list[int]]:
    """Pin blocks ``which`` under namespace ``space`` (one round trip), read and check them, release; the
    ones that failed and the ones not held there."""
    asked = node.node_keys([keys[i] for i in which], space)
    try:
        (pinned,), epoch, view = node.client.call(Op.PIN, asked, node.stored_bytes)
        if not isinstance(pinned, list) or len(pinned) != len(asked):
            raise StoreError(f"the node daemon answered a pin of {len(asked)} blocks with {pinned!r:.80}")
    except StoreError:
        for i in which:
            node.failures.note(keys[i], MissReason.REMOTE_ERROR)
        return set(which), []
    node.located([keys[i] for i in which], asked, pinned, view, epoch)
    failed: set[int] = set()
    missing: list[int] = []
    held: list[bytes] = []
    damaged: list[tuple[int, bytes, int]] = []
    try:
        for i, name, answer in zip(which, asked, pinned, strict=True):
            if not is_slot_gen(answer):
                node.failures.note(keys[i], MissReason.EVICTED)
                missing.append(i)
                continue
            held.append(name)
            if _read(view, answer[0], answer[1], name, pieces[i], node.sealer(keys[i])):
                node.failures.note(keys[i], None)
            else:
                node.failures.note(keys[i], MissReason.DAMAGED)
                damaged.append((i, name, answer[1]))
                failed.add(i)
    finally:
        node.client.post(Op.RELEASE, epoch, held)
    if damaged:
        log.warning("kvtier node tier: %d of %d blocks failed their checks and were dropped", len(damaged), len(keys))
        node.forget(keys[i] for i, _, _ in damaged)
        node.client.post(Op.DROP, epoch, [[name, gen] for _, name, gen in damaged])
    return failed, missing


def _read(view: SlabView, slot: int, gen: int, name: bytes, pieces: list[Piece], sealer: Sealer | None) -> bool:
    """Copy the block in ``slot`` (at ``gen``) out into ``pieces`` (or open it there, where it is sealed);
    whether what arrived is it."""
    block = sum(size for _, size in pieces)
    length = block + (0 if sealer is None else SEAL_BYTES)
    if not 0 <= slot < view.geometry.slots or not _header_is(view, slot, gen, name, READY, length):
        return False
    if sealer is not None:  # (copied out first, then opened in the caller's memory: see the module doc)
        address = view.address(slot)
        seal = bytes(memory_view(address + block, SEAL_BYTES))
        for (target, size), (source, _) in zip(pieces, _laid_out(address, pieces), strict=True):
            ctypes.memmove(target, source, size)
        return sealer.open(_views(pieces), _views(pieces), seal, name) and int(view.gen[slot]) == gen
    expected = int(view.checksum[slot])
    h = checksum(gen, name)
    address = view.address(slot)
    for target, size in _chunks(pieces):
        ctypes.memmove(target, address, size)
        h.update(memory_view(target, size))  # (the bytes the caller got, still in cache)
        address += size
    return h.intdigest() == expected and int(view.gen[slot]) == gen


CHUNK_BYTES = 256 << 10
"""The most bytes hashed and copied in one go: a piece stays in cache between its hash and its copy
(a 2 MiB block hashed whole, then copied, is read from memory twice: stores of 2 MiB blocks cost 0.6
of a host tier's that way, bench/node.py)."""


def _laid_out(address: int, pieces: list[Piece]) -> list[Piece]:
    """Where ``pieces`` lie in a slot starting at ``address``: back to back, in order."""
    out, at = [], address
    for _, size in pieces:
        out.append((at, size))
        at += size
    return out


def _views(pieces: list[Piece]) -> list[memoryview]:
    return [memory_view(address, size) for address, size in pieces]


def _chunks(pieces: list[Piece]) -> list[Piece]:
    """``pieces`` cut into runs of at most CHUNK_BYTES, in order."""
    return [
        (address + start, min(CHUNK_BYTES, size - start))
        for address, size in pieces
        for start in range(0, size, CHUNK_BYTES)
    ]


def _header_is(view: SlabView, slot: int, gen: int, name: bytes, state: int, length: int | None = None) -> bool:
    """Whether slot ``slot``'s header says: generation ``gen``, ``state``, key ``name`` (and ``length``)."""
    return (
        int(view.gen[slot]) == gen
        and int(view.state[slot]) == state
        and view.keys[slot].tobytes() == name
        and (length is None or int(view.length[slot]) == length)
    )
