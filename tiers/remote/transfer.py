"""The remote transfer backend: blocks between host memory and a shared store's records.

A store moves one record per block: its header (``RecordFormat``: key, namespace digest, lengths,
checksum, MAC or seal), then the block's bytes straight out of or into the host slot, with no staging
copy where the client allows (sealed records go out of a buffer of the job, and are opened where they
arrive). Each transfer is one batched call of the store's client, run by the link
(``StoreLink``) on one of its workers with the tier's deadline, so a hung store costs a job its
deadline, never more:

- a store (host -> remote) first asks which records the store holds already (one batched existence
  query, in the same call as the put) and writes only the others: a block another engine stored is
  not sent again, and counts as stored (``KeyedStats.skipped_existing``). A record that failed to load
  here is written without asking (``RemoteStorage.unreadable``): one that merely exists under our name
  may be foreign garbage, and skipping it would pin a miss on its block. It reports the blocks the
  store did not take; they are counted drops;
- a load (remote -> host) accepts a block only when its record arrived whole and its header, data
  checksum and (with ``auth_key_env``) MAC, or its seal, say it is exactly that block, checked here
  before the job reports; every other block fails, and the engine recomputes it (and stores it again:
  see above).
  With ``fetches`` (Redis) a load ``fetch``es the records into the client's own bytes, checks each
  there as it arrives and copies in only a good one, until the call's completion closes the load's
  write gate (a call past its deadline writes nothing from then on, and fails): a bad record or a
  late reply never reaches the memory, so it may be the caller's own. Loads that want a
  record another load is fetching right now wait for that fetch instead of reading it again;
- where a call failed or outlived its deadline and has not settled yet (it may still write into its
  destination slots, or read its source slots), the failed blocks are reported in a ``Quarantine``
  that the link lifts once nothing of that call can touch them any more (never for a fetch).

While the store is down after a failure the link refuses calls at once (reconnecting with backoff),
so every job in that time fails without waiting.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from kvtier.core.caller_runs import caller_runs_here, offer
from kvtier.core.devices import HOST_DEVICE, KEYED_DEVICE
from kvtier.core.errors import ClosedError, TransferError
from kvtier.core.storage import block_pieces
from kvtier.core.transfer import OnComplete, Quarantine, Transfer, TransferBackend
from kvtier.tiers.remote.client import Piece, StoreClient, scatter
from kvtier.tiers.remote.link import Call, StoreLink
from kvtier.tiers.remote.record import HEADER_BYTES, RecordFormat
from kvtier.tiers.remote.tier import RemoteStorage

log = logging.getLogger(__name__)


class RemoteBackend(TransferBackend):
    """Stores and loads blocks between host memory ("cpu") and a shared store, through ``link``: as many
    transfers at once as the link has clients. A transfer is prepared on the caller's thread, run on a
    link worker and completed there (record checks, ``on_complete``): one hand-off between threads each
    way, however busy the interpreter; none where the caller waiting for its request's future runs the
    call itself (``caller_runs``: the call is offered to it)."""

    name = "remote"
    pairs = frozenset({(HOST_DEVICE, KEYED_DEVICE), (KEYED_DEVICE, HOST_DEVICE)})

    def __init__(self, link: StoreLink, fetches: bool = False) -> None:
        self.link = link
        self.fetches = fetches  # loads ``fetch`` records and copy each good one as it arrives (``_take``)
        self.refused_records = 0  # records that arrived whole but were not the block asked for
        self._lock = threading.Condition()
        self._in_flight = 0
        self._closed = False
        self._flights: dict[str, list[tuple[_Job, int]]] = {}  # record fetched now -> other loads waiting for it
        self._staging = Staging()  # where sealed records go out from

    def submit(self, transfer: Transfer, on_complete: OnComplete) -> None:
        if not self.can_copy(transfer.src.device, transfer.dst.device):
            raise TransferError(f"the remote backend cannot copy {transfer.src.device} -> {transfer.dst.device}")
        storing, remote, memory, slots = transfer.keyed_side()
        if not isinstance(remote, RemoteStorage):
            raise TransferError(f"a remote transfer needs the store's RemoteStorage, got {type(remote).__name__}")
        assert transfer.keys is not None  # Transfer requires keys for a side addressed by key
        sealing = self._staging if storing and remote.records.sealing is not None else None
        job = _Job(
            remote, list(transfer.keys), block_pieces(memory, slots), on_complete, transfer, memory.header_room, sealing
        )
        with self._lock:
            if self._closed:
                raise ClosedError("the remote transfer backend is closed")
            self._in_flight += 1
        if self.fetches and not storing:
            self._fetch(job)
            return
        try:
            if storing:
                call = self.link.start(
                    lambda client: _put_missing(client, job),
                    self._completion(job, self._stored),
                    _dirty,
                    caller_runs_here(),
                    background=True,  # (write-through copies; a stack of the remote tier alone waits behind loads)
                )
            else:
                call = self.link.start(
                    lambda client: client.get(job.names, job.pieces),
                    self._completion(job, self._loaded),
                    _dirty,
                    caller_runs_here(),
                )
        except BaseException:  # (not started: it never completes)
            self._ended()
            raise
        offer(functools.partial(self.link.run_here, call))

    def close(self) -> None:
        """Wait for the transfers in flight (each ends by its deadline), then close the link's clients;
        a call still past its deadline closes its client when it returns."""
        with self._lock:
            self._closed = True
            while self._in_flight:
                self._lock.wait()
        self.link.close(timeout=0)

    def _fetch(self, job: _Job) -> None:
        """Load ``job`` by ``fetch``: the records no other load is fetching right now by one call of its
        own, the others from the calls of the loads fetching them (``_flights``): the store is read
        once per record however many loads want it at once (requests of one engine sharing a prefix)."""
        mine = []
        with self._lock:
            for i, name in enumerate(job.names):
                waiting = self._flights.get(name)
                if waiting is None:
                    self._flights[name] = []
                    mine.append(i)
                else:
                    waiting.append((job, i))
        if not mine:
            return
        names, size = [job.names[i] for i in mine], HEADER_BYTES + job.records.block_bytes
        take = functools.partial(self._take, job, mine)
        try:
            call = self.link.start(
                lambda client: client.fetch(names, size, take),
                functools.partial(self._fetched, job, mine),
                here=caller_runs_here(),
            )
        except Exception as exc:  # (not started: its records fail, for the loads waiting for them too)
            log.exception("kvtier remote transfer failed to start")
            self._fetched(job, mine, Call.failed(exc))
            return
        offer(functools.partial(self.link.run_here, call))

    # --- completions (on the link's threads) ---------------------------------------------------

    def _completion(
        self, job: _Job, direction: Callable[[_Job, Call, list[Any]], list[bool]]
    ) -> Callable[[Call], None]:
        """The call's ``on_done``: ``direction`` checks what the call did (its result per record, None for
        each when it did not answer in time) and says which records are good, then the job reports its
        failed blocks (a bug fails them all rather than losing the completion)."""

        def done(call: Call) -> None:
            n = len(job.keys)
            answers = call.result if call.ok and call.result is not None and len(call.result) == n else [None] * n
            try:
                ok = direction(job, call, list(answers))
            except Exception:
                log.exception("kvtier remote transfer failed")
                ok = [False] * n
            try:
                _finish(job, call, ok)
            finally:
                call.when_settled(job.settled)
                self._ended()

        return done

    @staticmethod
    def _stored(job: _Job, call: Call, written: list[Any]) -> list[bool]:
        ok = [answer is True for answer in written]
        if call.ok:
            job.remote.stored(
                [key for i, key in enumerate(job.keys) if ok[i] and i not in job.skipped], len(job.skipped)
            )
        return ok

    def _loaded(self, job: _Job, call: Call, arrived: list[Any]) -> list[bool]:
        """A ``get``: the records that arrived whole into the job's memory, checked there."""
        problems = [
            _MISSING if answer is not True else job.records.problem(job.header(i), key, job.data(i))
            for i, (key, answer) in enumerate(zip(job.keys, arrived, strict=True))
        ]
        return self._checked(job, call, list(range(len(job.keys))), problems)

    def _take(self, job: _Job, mine: list[int], k: int, value: bytes | None) -> bool:
        """Record ``mine[k]`` of ``job`` as its fetch brings it (on the call's worker): checked in the
        client's bytes, and a good one copied into ``job``'s memory and that of the loads waiting for it,
        unless the call's completion has run (``job.gate``: past its deadline nothing is written).
        Its flight ends here: a load that wants the record from now on reads it again."""
        i = mine[k]
        problem, good = (_MISSING, None) if value is None else _checked_record(job.records, value, job.keys[i])
        with job.gate:
            if not job.open:
                return False
            with self._lock:
                loads = [(job, i), *self._flights.pop(job.names[i])]
            copies = [(load, j, good is not None and _copied(good, load.pieces[j])) for load, j in loads]
            job.taken[k] = (problem, copies)
            return copies[0][2]

    def _fetched(self, job: _Job, mine: list[int], call: Call[list[bool]]) -> None:
        """The end of a ``fetch`` of records ``mine`` of ``job`` (on the call's worker, or on the
        watchdog at its deadline): no record is written into memory from now on; a call that returned in
        time keeps what its records' ``_take`` did, one past its deadline fails them all (nothing to
        quarantine: it writes nowhere). Records that never came end their flights failed. Each load
        reports once all its records are decided."""
        with job.gate:
            job.open = False
        in_time = call.ok and call.result is not None and len(call.result) == len(mine)
        problems: list[str | None] = []
        decided: dict[int, tuple[_Job, list[tuple[int, bool]]]] = {}
        for k, i in enumerate(mine):
            taken = job.taken.get(k)
            if taken is None:  # (no reply, or an error reply)
                with self._lock:
                    taken = (_MISSING, [(load, j, False) for load, j in [(job, i), *self._flights.pop(job.names[i])]])
            problem, copies = taken
            problems.append(problem)
            for load, j, copied in copies:
                decided.setdefault(id(load), (load, []))[1].append((j, copied and in_time))
        try:
            self._checked(job, call, mine, problems)
        except Exception:
            log.exception("kvtier remote transfer failed")
        for load, records in decided.values():
            load.failed.update(j for j, copied in records if not copied)
            with self._lock:
                load.pending -= len(records)
                over = load.pending == 0
            if over:
                try:
                    load.on_complete(load.failed)
                finally:
                    self._ended()

    def _ended(self) -> None:
        """A transfer submitted is over: reported, or not started."""
        with self._lock:
            self._in_flight -= 1
            self._lock.notify_all()

    def _checked(self, job: _Job, call: Call, asked: list[int], problems: list[str | None]) -> list[bool]:
        """Which of the records ``asked`` (indices into ``job``) are the blocks asked for: ``problems[k]``
        says why the k-th is not (``_MISSING``: it did not arrive whole; else ``RecordFormat.problem``'s
        answer). What the load found is remembered (``RemoteStorage.loaded``) and refused records are
        logged, one line per load."""
        ok = [problem is None for problem in problems]
        bad = [(i, problem) for i, problem in zip(asked, problems, strict=True) if problem not in (None, _MISSING)]
        if call.ok:
            job.remote.loaded([job.keys[i] for i in asked], ok, [job.keys[i] for i, _ in bad])
        refused = [(job.names[i], problem) for i, problem in bad]
        if refused:  # one line per load: a store full of foreign records (a wrong MAC key) must not flood the log
            with self._lock:
                self.refused_records += len(refused)
            log.warning(
                "kvtier refused %d of %d records from %s, e.g. %s: %s",
                len(refused),
                len(job.keys),
                self.link.connector.where,
                *refused[0],
            )
        return ok


_MISSING = "it did not arrive whole"
"""The problem of a record that did not come, or not at the size asked: a miss, not a refused record."""


def _checked_record(records: RecordFormat, record: bytes, key: bytes) -> tuple[str | None, bytes | memoryview | None]:
    """A fetched record checked in the client's bytes: why it is not ``key``'s block (None: it is), and
    what to copy into a load's memory (None where nothing may be): the record itself, or for a sealed
    one the record with its block opened, into this thread's scratch memory (the client's bytes may be
    read-only, and nothing of a record that does not open reaches a load)."""
    view = memoryview(record)
    header, data = view[:HEADER_BYTES], view[HEADER_BYTES:]
    if records.sealing is None:
        problem = records.problem(header, key, [data])
        return problem, record if problem is None else None
    opened = _scratch(len(view))
    opened[:HEADER_BYTES] = header
    problem = records.problem(header, key, [data], [opened[HEADER_BYTES:]])
    return problem, opened if problem is None else None


_scratches = threading.local()


def _scratch(nbytes: int) -> memoryview:
    """This thread's scratch memory, ``nbytes`` of it: a sealed record is opened there, then copied into
    the loads that want it (reused: a fresh 2 MiB costs page faults every record)."""
    buffer = getattr(_scratches, "buffer", None)
    if buffer is None or len(buffer) < nbytes:
        buffer = _scratches.buffer = bytearray(nbytes)
    return memoryview(buffer)[:nbytes]


def _copied(record: bytes | memoryview, pieces: list[Piece]) -> bool:
    """Copy a good fetched record into a load's pieces; False (logged) should that fail."""
    try:
        scatter(record, pieces)
    except Exception:
        log.exception("kvtier remote transfer failed")
        return False
    return True


def _dirty(ok: list[bool]) -> bool:
    """A call that left some records unhandled: a client with late writes may still write into them."""
    return not all(ok)


def _finish(job: _Job, call: Call, ok: list[bool]) -> None:
    """Report the failed blocks; those of a call that has not settled yet are quarantined until it has."""
    failed = {i for i, good in enumerate(ok) if not good}
    quarantine = None
    if failed and not call.settled:
        quarantine = Quarantine(failed)
        call.when_settled(quarantine.lift)
    job.on_complete(failed, quarantine)


def _put_missing(client: StoreClient, job: _Job) -> list[bool]:
    """Write ``job``'s records that the store lacks, in one call on ``client``: their headers, one
    batched existence query (of every name but those whose load failed here: ``RemoteStorage.unreadable``),
    then one put of every record not found (``job.skipped``: those found, left as they are). Returns, per
    record, whether the store holds it now. Raises ValueError when the client answers for another number
    of records: the call fails (counted drops, no skip)."""
    for i, key in enumerate(job.keys):
        job.header(i)[:] = job.records.header(key, job.data(i), job.sealed(i))
    ask = [not bad for bad in job.remote.unreadable(job.keys)]
    asked = [i for i, yes in enumerate(ask) if yes]
    found = client.exists([job.names[i] for i in asked]) if asked else []
    job.skipped = {i for i, here in zip(asked, found, strict=True) if here}
    missing = [i for i in range(len(job.keys)) if i not in job.skipped]
    written = client.put([job.names[i] for i in missing], [job.pieces[i] for i in missing]) if missing else []
    ok = [True] * len(job.keys)
    for i, good in zip(missing, written, strict=True):
        ok[i] = good
    return ok


class Staging:
    """Buffers that sealed records go out from, kept for the next stores: a fresh 128 MiB costs this VM
    0.3 s of first-touch page faults (64 sealed 2 MiB blocks stored at 0.39 GB/s against 2 plain,
    bench/remote.py), a reused one nothing. At most ``KEPT_BYTES`` are kept; a buffer goes back only
    once its call settled (a put past its deadline may still read it)."""

    KEPT_BYTES = 256 << 20

    def __init__(self) -> None:
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of ``nbytes`` (a kept one's first bytes where one is large enough)."""
        with self._lock:
            fits = [buffer for buffer in self._free if buffer.nbytes >= nbytes]
            if fits:
                buffer = min(fits, key=lambda b: b.nbytes)
                self._free.remove(buffer)
                return buffer[:nbytes]
        return np.empty(nbytes, np.uint8)

    def give_back(self, buffer: np.ndarray) -> None:
        whole = buffer if buffer.base is None else buffer.base
        assert isinstance(whole, np.ndarray)
        with self._lock:
            self._free.append(whole)
            self._free.sort(key=lambda b: b.nbytes, reverse=True)
            while sum(b.nbytes for b in self._free) > self.KEPT_BYTES:
                self._free.pop()


class _Job:
    """One transfer's blocks as the store sees them: keys, record names, and each record's pieces: its
    header, then the block's host memory. Where the host storage keeps ``header_room`` before each
    slot (a host tier above a remote one), the header lies there and a record is one piece, which
    moves faster than two (Mooncake: 4-9 ms less per 64 x 2 MiB); else headers are a buffer of the job.
    A store of sealed records sends each from a buffer taken from ``sealing`` instead, header and
    ciphertext in one piece (the host memory keeps the block as it is), given back once its call
    settled. (A load of sealed records opens each where it arrived: in host memory, or in a fetched
    record's copy.)"""

    def __init__(
        self,
        remote: RemoteStorage,
        keys: list[bytes],
        memory: list[list[Piece]],
        on_complete: OnComplete,
        keep: Transfer,
        header_room: int = 0,
        sealing: Staging | None = None,
    ) -> None:
        self.remote = remote
        self.records = remote.records
        self.keys = keys
        self.names = [self.records.name(key) for key in keys]
        self.skipped: set[int] = set()  # the records a store found in the store and left as they were
        self.pending = len(keys)  # a fetched load's records not decided yet
        self.failed: set[int] = set()  # and those that failed
        self.taken: dict[int, tuple[str | None, list[tuple[_Job, int, bool]]]] = {}  # its fetch's records so far
        self.gate = threading.Lock()  # held while a fetched record is written into memory
        self.open = True  # (under ``gate``) records may be written: the fetch's completion has not run
        self.memory = memory
        self.on_complete = on_complete
        self._staging = sealing
        self._sealed: np.ndarray | None = None
        if sealing is not None:
            record = HEADER_BYTES + self.records.block_bytes
            self._sealed = sealing.take(len(keys) * record)
            self.header_at = [self._sealed.ctypes.data + i * record for i in range(len(keys))]
            self.pieces = [[(at, record)] for at in self.header_at]
        elif header_room >= HEADER_BYTES and all(len(pieces) == 1 for pieces in memory):
            self.header_at = [pieces[0][0] - HEADER_BYTES for pieces in memory]
            self.pieces = [[(at, HEADER_BYTES + piece[0][1])] for at, piece in zip(self.header_at, memory, strict=True)]
        else:
            self._headers = np.zeros((len(keys), HEADER_BYTES), np.uint8)
            self.header_at = [self._headers.ctypes.data + i * HEADER_BYTES for i in range(len(keys))]
            self.pieces = [[(at, HEADER_BYTES), *pieces] for at, pieces in zip(self.header_at, memory, strict=True)]
        self._keep = keep  # holds the transfer, and so both storages' memory, while the job runs

    def header(self, i: int) -> memoryview:
        """Record ``i``'s header bytes, where they are sent from and arrive into."""
        return _view(self.header_at[i], HEADER_BYTES)

    def data(self, i: int) -> list[memoryview]:
        """Block ``i``'s bytes in host memory, as views (for checksums and MACs)."""
        return [_view(address, size) for address, size in self.memory[i]]

    def settled(self) -> None:
        """Its call settled: nothing reads the job's sealed records any more."""
        if self._staging is not None and self._sealed is not None:
            self._staging.give_back(self._sealed)
            self._sealed = None

    def sealed(self, i: int) -> memoryview | None:
        """Where a store seals block ``i`` (its record's bytes after the header); None: it sends the block."""
        if self._sealed is None:
            return None
        return _view(self.header_at[i] + HEADER_BYTES, self.records.block_bytes)


def _view(address: int, size: int) -> memoryview:
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")
