"""What a transfer is and what moves it: the spec every transfer backend and the tier stack stand on.

A ``Transfer`` copies blocks from one storage's slots to another's. It compiles to (source address,
destination address, byte count) triples, one per fragment, merged where consecutive fragments are
adjacent on both sides (``CopyList``). A ``TransferBackend`` runs those copies and reports, once per
transfer and asynchronously, the indices of the blocks that failed, and any it must ``Quarantine``:
blocks whose memory a call that outlived its deadline may still touch (a remote store's). The
backends themselves live in ``kvtier.transfers`` (CPU memmove, CUDA, remote stores) and beside the
media that name their own (disk I/O: ``kvtier.tiers.disk.transfer``; the node slab's): this module
holds only what the stack needs to drive any of them (``TransferRegistry`` picks one per device
pair), so core/ never imports an implementation.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvtier.core.caller_runs import caller_runs_here, offer
from kvtier.core.errors import ClosedError, TransferError
from kvtier.core.storage import BlockStorage

log = logging.getLogger(__name__)


class Latch:
    """A one-way signal: ``fire`` once, and every ``when_fired`` callback runs once (at once when
    registered after). A callback that raises is logged and the others still run: each one typically
    gives memory back, and one caller's bug must not keep the others' fenced."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fired = False
        self._callbacks: list[Callable[[], None]] = []

    @property
    def fired(self) -> bool:
        with self._lock:
            return self._fired

    def fire(self) -> None:
        with self._lock:
            if self._fired:
                return
            self._fired = True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            _run(callback)

    def when_fired(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if not self._fired:
                self._callbacks.append(callback)
                return
        _run(callback)


def _run(callback: Callable[[], None]) -> None:
    try:
        callback()
    except Exception:
        log.exception("kvtier: a callback waiting for memory to be safe again failed")


class Quarantine:
    """Blocks of a finished transfer (indices into its block list) whose memory on kvtier's side a call
    that outlived its deadline may still touch: a read from a remote store may still write into them,
    a write may still read them. They failed; their memory must not be reused until ``lift`` (by the
    backend, once that call has really returned and nothing it started can touch them any more)."""

    def __init__(self, blocks: Iterable[int]) -> None:
        self.blocks = frozenset(blocks)
        self._latch = Latch()

    @property
    def lifted(self) -> bool:
        return self._latch.fired

    def lift(self) -> None:
        """The memory is safe to reuse; runs the ``when_lifted`` callbacks (once)."""
        self._latch.fire()

    def when_lifted(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once lifted (at once if it is)."""
        self._latch.when_fired(callback)


class OnComplete(Protocol):
    """Called once per submitted transfer with the indices (into the transfer's block list) that failed,
    and with the quarantine of those whose memory may still be touched, if any."""

    def __call__(self, failed: set[int], quarantine: Quarantine | None = None) -> None: ...


@dataclass(frozen=True)
class CopyList:
    """Byte copies of one transfer: ``src``, ``dst`` and ``size`` arrays, and which block each copy belongs to."""

    src: np.ndarray
    dst: np.ndarray
    size: np.ndarray
    block: np.ndarray

    @property
    def total_bytes(self) -> int:
        return int(self.size.sum())

    @functools.cached_property
    def _ends(self) -> np.ndarray:
        """Where each copy ends in the job's bytes, counted once however many copies fail."""
        return np.cumsum(self.size)

    def blocks_of(self, index: int, num_blocks: int) -> range:
        """The blocks whose bytes copy ``index`` moves.

        Copies run in block order and every block has the same byte count, so a copy's byte range in
        that order names exactly the blocks it touches (a merged copy may start or end mid-block).
        """
        ends = self._ends
        block_bytes = int(ends[-1]) // num_blocks
        start, end = int(ends[index] - self.size[index]), int(ends[index])
        return range(start // block_bytes, (end - 1) // block_bytes + 1)


@dataclass(frozen=True)
class Transfer:
    """Copy block ``src_slots[i]`` of ``src`` to block ``dst_slots[i]`` of ``dst`` for every i.

    A side whose storage is addressed by key (``BlockStorage.by_key``: a remote store, a node daemon's
    slab) has no slots; ``keys`` then name the blocks."""

    src: BlockStorage
    src_slots: Sequence[int]
    dst: BlockStorage
    dst_slots: Sequence[int]
    keys: Sequence[bytes] | None = None  # the blocks' keys, for backends that record or verify them (disk)

    def __post_init__(self) -> None:
        for side, slots, what in ((self.src, self.src_slots, "source"), (self.dst, self.dst_slots, "destination")):
            if side.by_key:
                if slots:
                    raise TransferError(f"{len(slots)} {what} slots for a storage addressed by key")
                if self.keys is None:
                    raise TransferError(f"a {what} addressed by key needs the blocks' keys")
            elif len(slots) != self.num_blocks:
                raise TransferError(f"{len(self.src_slots)} source slots but {len(self.dst_slots)} destination slots")
        if self.keys is not None and len(self.keys) != self.num_blocks:
            raise TransferError(f"{len(self.keys)} keys for {self.num_blocks} blocks")
        if self.src.layout.block_bytes != self.dst.layout.block_bytes:
            raise TransferError(
                f"block sizes differ: {self.src.layout.block_bytes} B -> {self.dst.layout.block_bytes} B"
            )

    def keyed_side(self) -> tuple[bool, BlockStorage, BlockStorage, Sequence[int]]:
        """For a copy between memory and a storage addressed by key: whether it stores (into the keyed
        side), the keyed side, the memory side and the memory side's slots."""
        storing = self.dst.by_key
        if storing:
            return True, self.dst, self.src, self.src_slots
        return False, self.src, self.dst, self.dst_slots

    @property
    def num_blocks(self) -> int:
        return len(self.dst_slots if self.src.by_key else self.src_slots)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.src.layout.block_bytes

    def copies(self) -> CopyList:
        """The fragment copies, merged where adjacent on both sides. Raises TransferError on bad slots."""
        src_layout, dst_layout = self.src.layout, self.dst.layout
        src = self.src.fragment_addresses(self.src_slots)
        dst = self.dst.fragment_addresses(self.dst_slots)
        if src_layout.fragment_bytes != dst_layout.fragment_bytes:
            # A contiguous side can follow the other side's fragment boundaries.
            if dst_layout.num_fragments == 1:
                dst, sizes = dst[:, :1] + src_layout.offsets[None, :], src_layout.sizes
            elif src_layout.num_fragments == 1:
                src, sizes = src[:, :1] + dst_layout.offsets[None, :], dst_layout.sizes
            else:
                raise TransferError("fragment layouts differ and neither side is contiguous")
        else:
            sizes = src_layout.sizes
        n, f = src.shape
        return _merge_adjacent(
            src.reshape(-1),
            dst.reshape(-1),
            np.tile(sizes, n),
            np.repeat(np.arange(n), f),
            np.concatenate((self.src.breaks, self.dst.breaks)),
        )


def _merge_adjacent(
    src: np.ndarray, dst: np.ndarray, size: np.ndarray, block: np.ndarray, breaks: np.ndarray
) -> CopyList:
    """Merge each copy into the one before it when both its source and destination follow on directly,
    unless it starts at one of the ``breaks`` (``BlockStorage.breaks``) on either side.

    Copies of different blocks merge too (a run of consecutive slots on both sides becomes one copy);
    the merged copy keeps its first block's index; a failed copy fails every block its byte range
    touches (see ``CopyList.blocks_of``).
    """
    if src.size <= 1:
        return CopyList(src, dst, size, block)
    follows = (src[1:] == src[:-1] + size[:-1]) & (dst[1:] == dst[:-1] + size[:-1])
    if breaks.size:
        follows &= ~(np.isin(src[1:], breaks) | np.isin(dst[1:], breaks))
    starts = np.concatenate(([0], np.flatnonzero(~follows) + 1))
    return CopyList(src[starts], dst[starts], np.add.reduceat(size, starts), block[starts])


class TransferBackend(ABC):
    """Moves bytes between storages and signals completion per transfer."""

    name: str
    pairs: frozenset[tuple[str, str]]
    """The (source device, destination device) pairs this backend copies between, e.g. ("cpu", "file")."""

    def can_copy(self, src_device: str, dst_device: str) -> bool:
        """Whether this backend can move bytes between memories of these devices."""
        return (src_device, dst_device) in self.pairs

    @abstractmethod
    def submit(self, transfer: Transfer, on_complete: OnComplete) -> None:
        """Start the copy and return at once; ``on_complete(failed_block_indices)`` runs exactly once, on
        another thread. Raises TransferError or ClosedError (and never calls ``on_complete``) when the
        transfer cannot be started."""

    copies_now: bool = False
    """Whether ``copy_now`` runs a transfer on the calling thread (a memmove); else it copies only
    asynchronously, through ``submit``."""

    def copy_now(self, transfer: Transfer) -> set[int]:
        """Run ``transfer`` on the calling thread and return the blocks that failed (only where
        ``copies_now``)."""
        raise NotImplementedError(f"the {self.name} backend copies only through submit")

    @abstractmethod
    def close(self) -> None:
        """Wait for copies in flight, then refuse new ones."""


class TransferRegistry:
    """The transfer backends of one stack (or one vLLM worker), by the device pair each one serves.

    Which backend moves a copy is a lookup of its (source device, destination device) pair, and a pair
    no backend serves is one TransferError that names it. Devices are storage devices ("cpu", "cuda",
    "file"), not media: a GPU tier on CPU tensors is a "cpu" storage and its copies are memmoves. A pair
    two backends serve goes to the one listed first. The registry owns its backends: ``close`` closes
    every one.
    """

    def __init__(self, backends: Iterable[TransferBackend]) -> None:
        self.backends = list(backends)
        self._by_pair: dict[tuple[str, str], TransferBackend] = {}
        for backend in self.backends:
            for pair in backend.pairs:
                self._by_pair.setdefault(pair, backend)

    def backend(self, src_device: str, dst_device: str, what: str = "") -> TransferBackend:
        """The backend that copies ``src_device`` -> ``dst_device``. Raises TransferError naming the pair,
        the backends there are, and ``what`` the copy is for, when none does."""
        backend = self._by_pair.get((src_device, dst_device))
        if backend is None:
            raise TransferError(
                f"no transfer backend ({', '.join(b.name for b in self.backends)}) can copy "
                f"{src_device} -> {dst_device} {what}".rstrip()
            )
        return backend

    def submit(self, transfer: Transfer, on_complete: OnComplete) -> None:
        """Start ``transfer`` on the backend for its devices (see ``TransferBackend.submit``)."""
        self.backend(transfer.src.device, transfer.dst.device).submit(transfer, on_complete)

    def close(self) -> None:
        """Close every backend; each waits for its copies in flight."""
        for backend in self.backends:
            backend.close()


class CopiesHere:
    """Where copies run on the thread that submits them, when their backend can run them there (a
    memmove) and they are at most ``max_bytes``; others go to their backend as usual.

    Why: a copy handed to a backend's pool costs hand-offs between threads, and in a busy interpreter
    each one waits for the GIL (up to the switch interval per thread that wants it). A copy that would
    only be waited for, or that follows from a completion on a thread with nothing else to do, is
    cheaper right there.
    """

    def __init__(self, transfers: TransferRegistry, max_bytes: int | None = None) -> None:
        self.transfers = transfers
        self._max_bytes = max_bytes

    def submit(self, transfer: Transfer, on_complete: OnComplete) -> None:
        backend = self.transfers.backend(transfer.src.device, transfer.dst.device)
        if self.runs_here(backend, transfer):
            on_complete(backend.copy_now(transfer))
        else:
            backend.submit(transfer, on_complete)

    def runs_here(self, backend: TransferBackend, transfer: Transfer) -> bool:
        """Whether ``transfer`` on ``backend`` is one this runs on the submitting thread."""
        return backend.copies_now and (self._max_bytes is None or transfer.nbytes <= self._max_bytes)


class CopiesOffered:
    """Where a caller that will wait for the copies (``TierStack.store_now``, ``load_now``) runs those
    that ``here`` would run on the submitting thread on its own, once it asks for its future's result
    (``caller_runs``): the copy's ``submit`` only offers it, no copy thread is woken, and neither the
    pool's hand-off nor the caller's wake-up is paid. Other copies (a remote store's calls, which offer
    themselves; a disk's) go to their backends at once; so does every copy where nobody collects offers.
    A copy offered to a future that is released instead (its caller will not wait after all) goes to
    its backend then."""

    def __init__(self, here: CopiesHere) -> None:
        self._here = here

    def submit(self, transfer: Transfer, on_complete: OnComplete) -> None:
        backend = self._here.transfers.backend(transfer.src.device, transfer.dst.device)
        if not (caller_runs_here() and self._here.runs_here(backend, transfer)):
            backend.submit(transfer, on_complete)
            return

        def run(until: float) -> bool:
            here = until > time.monotonic()  # (else released, or no time given: to the backend)
            try:
                if not here:
                    backend.submit(transfer, on_complete)
                    return False
                failed = backend.copy_now(transfer)
            except (TransferError, ClosedError):  # (it could not start: every block failed)
                log.exception("a kvtier copy failed to start")
                failed = set(range(transfer.num_blocks))
            on_complete(failed)
            return here

        offer(run)
