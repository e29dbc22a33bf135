"""The tier stack: ordered tiers (fastest first) behind the engine's three questions.

1. ``lookup(keys)``: the longest prefix of keys present anywhere, and the tier of each block.
2. ``load(keys, dst, slots)``: copy that prefix into the caller's storage, staging through an
   intermediate tier when the route planner says the source cannot reach the destination directly.
3. ``store(keys, src, slots)``: copy new blocks into the first tier. With ``write_through`` they then
   flow down to every tier in the background; with ``write_back`` a block moves down only when it is
   pushed out of the tier above (demotion on eviction), so nothing is lost while a lower tier has room.

Watermarks: after a write lands in a tier above its high mark, a background thread demotes or evicts
down to the low mark, so foreground stores seldom wait for space.

Thread safety: public methods may be called from any thread. Planning happens under the stack's lock
(taken before any tier lock); copy completions never take it: they only commit, abort, unpin, and
post follow-up work (the next write-through hop, a watermark check) to the stack's background thread.

Lifetime: ``close()`` releases everything (see there), also when called from a future's done-callback.
Threads hold only what the release needs (``_Resources``), never the stack itself, so a stack dropped
without ``close()`` is collected and a finalizer releases its threads, memory and files.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import warnings
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvtier.core.errors import CapacityError, ClosedError, StateError, TransferError
from kvtier.core.jobs import Fence, Job, JobManager, JobState, mark_kvtier_thread, on_kvtier_thread
from kvtier.core.keys import check_key
from kvtier.core.routes import Capabilities, plan_route
from kvtier.core.storage import BlockStorage
from kvtier.core.tier import BlockState, Tier
from kvtier.core.transfer import Transfer, TransferBackend, TransferRegistry

log = logging.getLogger(__name__)

PLACEMENTS = ("write_through", "write_back")


@dataclass(frozen=True)
class StackLookup:
    """``hits`` leading keys are present; ``tiers[i]`` names the tier that serves key i."""

    hits: int
    tiers: tuple[str, ...]


@dataclass
class StoreResult:
    requested: int
    stored: int = 0                                  # new blocks now readable in the first tier
    present: int = 0                                 # blocks that were already there (or being written)
    dropped: int = 0                                 # blocks that found no room ("a full tier stores less")
    failed: list[bytes] = field(default_factory=list)  # blocks whose copy failed


@dataclass
class LoadResult:
    requested: int
    hits: int                                        # leading keys found and planned
    loaded: int = 0                                  # of those, blocks that arrived intact
    failed: list[int] = field(default_factory=list)  # indices (into keys) of hits that could not be loaded
    per_tier: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failed


class TierStack:
    """Tiers ordered fastest first, the transfer backends that move bytes between them, one job manager."""

    def __init__(self, tiers: Sequence[Tier], backends: Sequence[TransferBackend], jobs: JobManager | None = None,
                 placement: str = "write_back", capabilities: Capabilities = Capabilities(),
                 route: Callable[[str, str, Capabilities], tuple[str, ...]] = plan_route) -> None:
        if not tiers:
            raise ValueError("a stack needs at least one tier")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        block_bytes = {t.block_bytes for t in tiers}
        if len(block_bytes) != 1:
            raise ValueError(f"tiers disagree on the block size: {sorted(block_bytes)}")
        self.transfers = TransferRegistry(backends)
        for upper, lower in zip(tiers, tiers[1:]):
            for src, dst in ((upper, lower), (lower, upper)):
                self.transfers.backend(src.storage.device, dst.storage.device,
                                       f"between tier {upper.name!r} and tier {lower.name!r}")
        self.tiers = list(tiers)
        self.jobs = jobs or JobManager()
        self.placement = placement
        self.capabilities = capabilities
        self._route = route
        self._lock = threading.RLock()
        self._closed = False
        self._release_over = threading.Event()
        self._resources = _Resources(self.tiers, self.transfers, self.jobs)
        self._work = self._resources.work
        self.background_errors = self._resources.errors
        self._name = f"kvtier stack ({', '.join(names)})"
        self._resources.worker.start()
        self._finalizer = weakref.finalize(self, _release_dropped, self._resources, self._name)
        self._finalizer.atexit = False  # at exit the process goes anyway; joining threads then could hang it

    # --- the engine's questions ----------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> StackLookup:
        """The longest prefix of ``keys`` readable in some tier, and which tier (the fastest) holds each."""
        with self._lock:
            self._check_open()
            where = []
            for key in keys:
                tier = next((t for t in self.tiers if t.state(key) is BlockState.READY), None)
                if tier is None:
                    break
                where.append(tier.name)
            return StackLookup(len(where), tuple(where))

    def store(self, keys: Sequence[bytes], src: BlockStorage, src_slots: Sequence[int]) -> "Future[StoreResult]":
        """Copy blocks ``src_slots`` of ``src`` into the first tier under ``keys``.

        Keys already present in any tier (or being written to one) are skipped. The future resolves once ``src`` is no longer read and the
        blocks are readable in the first tier; write-through copies further down continue afterwards.
        Raises CapacityError when the new blocks outnumber the first tier.
        """
        if len(keys) != len(src_slots):
            raise ValueError(f"{len(keys)} keys but {len(src_slots)} source slots")
        for key in keys:  # before any room is made: a key no tier can hold is refused with nothing moved
            check_key(key)
        future: Future[StoreResult] = Future()
        with self._lock:
            self._check_open()
            top = self.tiers[0]
            result = StoreResult(len(keys))
            new = [(k, s) for k, s in dict(zip(keys, src_slots)).items()
                   if all(t.state(k) is BlockState.FREE for t in self.tiers)]
            result.present = len(keys) - len(new)
            if len(new) > top.capacity:
                raise CapacityError(f"{len(new)} new blocks can never fit in tier {top.name!r} of {top.capacity} blocks")
            slots = self._reserve(0, [k for k, _ in new])
            result.dropped = len(new) - len(slots)
            new = new[:len(slots)]
            if not new:
                future.set_result(result)
                return future
            new_keys = [k for k, _ in new]

            def landed(ok: list[bytes], failed: list[bytes], _refused: list[bytes]) -> None:
                result.stored, result.failed = len(ok), failed
                future.set_result(result)
                self._after_write(0, ok)

            self._copy(src, [s for _, s in new], top, new_keys, slots, landed, read_fences=())
        return future

    def load(self, keys: Sequence[bytes], dst: BlockStorage, dst_slots: Sequence[int],
             dst_medium: str | None = None) -> "Future[LoadResult]":
        """Copy the longest present prefix of ``keys`` into blocks ``dst_slots`` of ``dst``.

        Only the prefix that ``lookup`` would report is loaded; the result says how many blocks that
        is and which of them failed (the caller recomputes those). ``dst_medium`` defaults to "gpu"
        for CUDA memory and "host" otherwise.
        """
        if len(keys) != len(dst_slots):
            raise ValueError(f"{len(keys)} keys but {len(dst_slots)} destination slots")
        dst_medium = dst_medium or ("gpu" if dst.device == "cuda" else "host")
        future: Future[LoadResult] = Future()
        with self._lock:
            self._check_open()
            routes = {t.name: self._route(t.medium, dst_medium, self.capabilities) for t in self.tiers}
            for name, route in routes.items():  # refuse before pinning anything
                if len(route) > 3:
                    raise TransferError(f"route {' -> '.join(route)} has more than one staging hop")
                last_hop_src = self._tier_for_medium(route[-2]) if len(route) > 2 else self._tier(name)
                self.transfers.backend(last_hop_src.storage.device, dst.device, f"from tier {last_hop_src.name!r}")
            by_tier: dict[str, list[int]] = {}
            for i, key in enumerate(keys):  # find and pin in one step per block: completions may evict meanwhile
                tier = next((t for t in self.tiers if t.try_pin(key)), None)
                if tier is None:
                    break
                by_tier.setdefault(tier.name, []).append(i)
            result = LoadResult(len(keys), sum(len(v) for v in by_tier.values()))
            if not by_tier:
                future.set_result(result)
                return future
            pending = [len(by_tier)]
            lock = threading.Lock()

            def part_done(indices: list[int], failed: list[int]) -> None:
                with lock:
                    result.failed.extend(failed)
                    result.loaded += len(indices) - len(failed)
                    pending[0] -= 1
                    last = pending[0] == 0
                if last:
                    result.failed.sort()
                    future.set_result(result)

            for name, indices in by_tier.items():
                tier = self._tier(name)
                tier.record(hits=len(indices), bytes_out=len(indices) * tier.block_bytes)
                result.per_tier[name] = len(indices)
                part = ([keys[i] for i in indices], dst, [dst_slots[i] for i in indices],
                        lambda failed, idx=indices: part_done(idx, [idx[j] for j in failed]))
                if len(routes[name]) == 2:
                    self._load_direct(tier, *part)
                else:
                    self._load_staged(tier, self._tier_for_medium(routes[name][1]), *part)
        return future

    # --- lifecycle -----------------------------------------------------------------------------

    def close(self, timeout: float | None = 60.0) -> None:
        """Refuse new work, wait for every job in flight, copy blocks that only memory tiers hold down
        into a disk tier below them (so a restart finds them), stop the background thread, release
        the tiers. Raises StateError if a tier still has pinned or writing blocks afterwards (a leak).

        On one of kvtier's own threads (a future's done-callback runs inside a job's completion, and
        that job is not over until the callback returns) it cannot wait: it refuses new work at once,
        returns, and a thread of its own releases everything as soon as the callback has returned
        (errors are logged there). A close() that finds the stack already closing waits until that
        release is over (TimeoutError after ``timeout``); on kvtier's own threads it returns at once.
        A stack dropped without close() is released by a finalizer instead, without the copy to disk
        (``_release_dropped``).
        """
        with self._lock:
            first, self._closed = not self._closed, True
        if first:
            self._finalizer.detach()
        if on_kvtier_thread():
            if first:
                _run_apart(functools.partial(self._release, timeout), f"closing the {self._name}")
            return
        if first:
            self._release(timeout)
        elif not self._release_over.wait(timeout):
            raise TimeoutError(f"the {self._name}'s release, begun by another close(), still runs after {timeout} s")

    @property
    def closed(self) -> bool:
        return self._closed

    def wait_idle(self, timeout: float | None = 60.0) -> None:
        """Wait until background work (write-through hops, watermark demotions) and every job are done."""
        if on_kvtier_thread():
            raise StateError("wait_idle() cannot run in a kvtier completion callback: the callback's own job "
                             "is not over until it returns")
        self._resources.wait_idle(timeout)

    def describe(self) -> str:
        lines = [f"kvtier stack: {len(self.tiers)} tier(s), placement {self.placement}, "
                 f"transfer backends: {', '.join(b.name for b in self.transfers.backends)}"]
        lines += [f"  {i}. {tier!r}" for i, tier in enumerate(self.tiers)]
        return "\n".join(lines)

    def stats(self) -> dict[str, dict[str, int]]:
        """Per-tier counters plus current usage."""
        out = {}
        for tier in self.tiers:
            usage = tier.usage()
            out[tier.name] = {**tier.stats.as_dict(), "used": usage.used, "capacity": usage.capacity}
        return out

    def __enter__(self) -> "TierStack":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _release(self, timeout: float | None) -> None:
        """The work of close(): wait, copy memory-only blocks down to disk, release the resources."""
        try:
            self._resources.wait_idle(timeout)
            try:
                self._copy_down_to_disk(timeout)
            except Exception as exc:  # e.g. thread pools refusing work at interpreter exit: release anyway
                log.warning("%s closed without copying the blocks only its memory tiers hold to disk: %s",
                            self._name, exc)
            self._resources.release(timeout)
        finally:
            self._release_over.set()

    def _copy_down_to_disk(self, timeout: float | None) -> None:
        """Copy every block a tier holds that the tier below lacks into it, top down, as far as the
        lowest disk tier: what a restart finds is then everything the stack held."""
        for index in range(len(self.tiers) - 1):
            if not any(t.medium == "disk" for t in self.tiers[index + 1:]):
                break
            with self._lock:
                self._copy_down(index, self.tiers[index].ready_keys(), closing=True)
            self._resources.wait_idle(timeout)

    # --- planning (under self._lock) -----------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the tier stack is closed")

    def _tier(self, name: str) -> Tier:
        return next(t for t in self.tiers if t.name == name)

    def _tier_for_medium(self, medium: str) -> Tier:
        for tier in self.tiers:
            if tier.medium == medium:
                return tier
        raise TransferError(f"the route needs a {medium} tier to stage through, and the stack has none")

    def _reserve(self, index: int, keys: list[bytes]) -> list[int]:
        """Slots for ``keys`` in tier ``index``, making room first; fewer (a prefix) when room runs out.

        Victims that the next tier lacks are demoted before their slots are reused (with write-back
        that is the only way down; with write-through it covers blocks whose eager copy is still
        queued); victims of the last tier are dropped.
        """
        tier = self.tiers[index]
        keys = keys[:tier.capacity]
        demote = index + 1 < len(self.tiers)
        for attempt in range(2):
            short = len(keys) - tier.usage().free
            if short > 0 and demote:
                for job in self._make_room(index, short):
                    self.jobs.wait(job)
            slots = tier.reserve(keys, allow_evict=not demote)
            if slots is not None:
                return slots
            if attempt == 0:
                # Victims may be pinned only by copies in flight (an eager write-through copy, a
                # load): once those land the blocks can go, so wait for them once before storing less.
                self.jobs.flush(tier.name)
        return tier.reserve(keys[:tier.usage().free], allow_evict=False) or []  # a full tier stores less

    def _make_room(self, index: int, n: int) -> list[Job]:
        """Start evicting ``n`` blocks from tier ``index``; returns the demotion jobs to wait for.

        Clean victims (already in the next tier) and victims of the last tier are dropped at once.
        """
        tier = self.tiers[index]
        victims = [key for key, _ in tier.begin_evict(n)]
        lower = self.tiers[index + 1] if index + 1 < len(self.tiers) else None
        dirty = [k for k in victims if lower is not None and lower.state(k) is BlockState.FREE]
        clean = set(victims) - set(dirty)
        tier.end_evict([k for k in victims if k in clean])
        if not dirty:
            return []
        slots = self._reserve(index + 1, dirty)
        tier.end_evict(dirty[len(slots):])  # no room below: these are dropped
        dirty = dirty[:len(slots)]
        if not dirty:
            return []

        def landed(ok: list[bytes], failed: list[bytes], refused: list[bytes]) -> None:
            tier.end_demotion(ok, failed, refused)
            tier.record(bytes_out=len(ok) * tier.block_bytes)
            self._after_write(index + 1, ok)

        job = self._copy(tier.storage, tier.slots(dirty), lower, dirty, slots, landed,
                         read_fences=[Fence(tier.name, s, False) for s in tier.slots(dirty)])
        return [job]

    def _copy_down(self, index: int, keys: list[bytes], closing: bool = False) -> None:
        """Copy READY blocks of tier ``index`` that the next tier lacks into it (write-through, and
        the flush at close)."""
        with self._lock:
            if self._closed and not closing:
                return
            tier, lower = self.tiers[index], self.tiers[index + 1]
            keys = [k for k in keys if tier.state(k) is BlockState.READY and lower.state(k) is BlockState.FREE]
            if not keys:
                return
            src_slots = tier.pin(keys)
            slots = self._reserve(index + 1, keys)
            tier.unpin(keys[len(slots):])
            keys, src_slots = keys[:len(slots)], src_slots[:len(slots)]
            if not keys:
                return

            def landed(ok: list[bytes], failed: list[bytes], _refused: list[bytes]) -> None:
                tier.unpin(keys)
                tier.record(bytes_out=len(ok) * tier.block_bytes)
                self._after_write(index + 1, ok)

            self._copy(tier.storage, src_slots, lower, keys, slots, landed,
                       read_fences=[Fence(tier.name, s, False) for s in src_slots])

    def _copy(self, src: BlockStorage, src_slots: Sequence[int], dst: Tier, keys: list[bytes],
              dst_slots: list[int], landed: Callable[[list[bytes], list[bytes], list[bytes]], None],
              read_fences: Sequence[Fence]) -> Job:
        """Copy into reserved slots of tier ``dst``; on completion commit what landed, abort the rest,
        then call ``landed(ok_keys, failed_keys, refused_keys)`` (refused: failed keys ``dst`` can
        never hold, see ``Tier.refuse``)."""

        def on_done(job: Job) -> None:
            failed_idx = set(range(len(keys))) if job.state is JobState.CANCELLED else job.failed_blocks
            ok = [k for i, k in enumerate(keys) if i not in failed_idx]
            failed = [k for i, k in enumerate(keys) if i in failed_idx]
            dst.commit(ok)
            landed(ok, failed, dst.abort(failed))

        fences = [*read_fences, *(Fence(dst.name, s, True) for s in dst_slots)]
        transfer = Transfer(src, src_slots, dst.storage, dst_slots, keys)
        return self._submit(transfer, "store", fences, on_done)

    def _load_direct(self, tier: Tier, keys: list[bytes], dst: BlockStorage, dst_slots: list[int],
                     done: Callable[[list[int]], None]) -> None:
        """Copy pinned ``keys`` of ``tier`` into ``dst``, unpin them, then ``done(failed indices into keys)``."""
        src_slots = tier.slots(keys)

        def finish(job: Job) -> None:
            tier.unpin(keys)
            tier.discard([keys[i] for i in job.failed_blocks])  # unreadable: a miss now and later
            done(sorted(job.failed_blocks))

        self._submit(Transfer(tier.storage, src_slots, dst, dst_slots, keys), "load",
                     [Fence(tier.name, s, False) for s in src_slots], finish)

    def _load_staged(self, tier: Tier, stage: Tier, keys: list[bytes], dst: BlockStorage, dst_slots: list[int],
                     done: Callable[[list[int]], None]) -> None:
        """Copy pinned ``keys`` of ``tier`` into new slots of ``stage`` (caching them there too), then on to ``dst``.

        Runs under the stack lock. Blocks that cannot be staged (no room, or the staging tier is
        already writing them) fail, and the caller recomputes them. ``done`` gets indices into ``keys``.
        """
        fresh = [i for i, k in enumerate(keys) if stage.state(k) is BlockState.FREE]
        slots = self._reserve(self.tiers.index(stage), [keys[i] for i in fresh])
        picked = fresh[:len(slots)]
        unstaged = sorted(set(range(len(keys))) - set(picked))
        tier.unpin([keys[i] for i in unstaged])
        if not picked:
            done(unstaged)
            return
        staged_keys = [keys[i] for i in picked]
        src_slots = tier.slots(staged_keys)

        def staged(job: Job) -> None:
            tier.unpin(staged_keys)
            tier.discard([staged_keys[i] for i in job.failed_blocks])
            ok = [i for i in range(len(picked)) if i not in job.failed_blocks]
            stage.abort([staged_keys[i] for i in sorted(job.failed_blocks)])
            stage.commit([staged_keys[i] for i in ok], pin=True)
            self._after_write(self.tiers.index(stage), [staged_keys[i] for i in ok])
            lost = unstaged + [picked[i] for i in job.failed_blocks]
            if not ok:
                done(sorted(lost))
                return
            self._load_direct(stage, [staged_keys[i] for i in ok], dst, [dst_slots[picked[i]] for i in ok],
                              lambda failed: done(sorted(lost + [picked[ok[j]] for j in failed])))

        fences = [*(Fence(tier.name, s, False) for s in src_slots), *(Fence(stage.name, s, True) for s in slots)]
        self._submit(Transfer(tier.storage, src_slots, stage.storage, slots, staged_keys), "stage", fences, staged)

    def _submit(self, transfer: Transfer, kind: str, fences: Sequence[Fence], on_done: Callable[[Job], None]) -> Job:
        job = self.jobs.create(kind, transfer.num_blocks, 1, fences, on_done)
        self.jobs.start(job.id)
        report = functools.partial(self.jobs.report, job.id)  # not a closure over the stack: see _Resources
        try:
            self.transfers.submit(transfer, report)
        except Exception:
            self.jobs.report(job.id, range(transfer.num_blocks))  # the job ends failed and releases everything
            raise
        return job

    # --- background ----------------------------------------------------------------------------

    def _after_write(self, index: int, keys: list[bytes]) -> None:
        """Called from completions: queue the next write-through hop and a watermark check."""
        if self.placement == "write_through" and keys and index + 1 < len(self.tiers):
            self._work.put(lambda: self._copy_down(index, keys))
        if self.tiers[index].excess() > 0:
            self._work.put(lambda: self._enforce_watermark(index))

    def _enforce_watermark(self, index: int) -> None:
        with self._lock:
            if self._closed:
                return
            excess = self.tiers[index].excess()
            jobs = self._make_room(index, excess) if excess > 0 else []
        for job in jobs:
            self.jobs.wait(job)


class _Resources:
    """What a stack's threads, memory and files hang on, and nothing that refers back to the stack.

    The background thread and the finalizer of a stack dropped without close() hold this object: one
    holding the stack would keep it reachable for ever, and the finalizer would never run.
    """

    def __init__(self, tiers: list[Tier], transfers: TransferRegistry, jobs: JobManager) -> None:
        self.tiers = tiers
        self.transfers = transfers
        self.jobs = jobs
        self.work: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self.errors: list[BaseException] = []
        self.worker = threading.Thread(target=_background, args=(self.work, self.errors), name="kvtier-stack",
                                       daemon=True)

    def wait_idle(self, timeout: float | None) -> None:
        while True:
            self.work.join()
            self.jobs.drain(timeout)
            if self.work.unfinished_tasks == 0 and not self.jobs.in_flight():
                return

    def release(self, timeout: float | None) -> None:
        """Stop the background thread, close the backends (each waits for its copies) and the tiers.
        Raises StateError naming the tiers that still have pinned or writing blocks (a leak: those
        stay open); the others are closed."""
        self.work.put(None)
        self.worker.join(timeout)
        self.transfers.close()
        leaks = {}
        for tier in self.tiers:
            in_use = tier.leaks()
            if any(in_use.values()):
                leaks[tier.name] = in_use
            else:
                tier.close()
        if leaks:
            raise StateError(f"blocks still in use at close: {leaks}")


def _background(work: queue.Queue, errors: list[BaseException]) -> None:
    """The stack's background thread: runs queued tasks until it gets None. It holds the queue, not the
    stack, and lets go of each task (a closure over the stack) once it ran, so a dropped stack can be
    collected while this thread waits."""
    mark_kvtier_thread()
    while (task := work.get()) is not None:
        try:
            task()
        except Exception as exc:  # recorded and counted; the stack keeps serving
            if isinstance(exc, ClosedError):  # a backend refused the copy: the interpreter is exiting
                log.warning("kvtier background copy not done: %s", exc)
            else:
                log.exception("kvtier background task failed")
            errors.append(exc.with_traceback(None))  # its frames would hold the stack
        finally:
            del task
            work.task_done()
    work.task_done()


def _release_dropped(resources: _Resources, what: str) -> None:
    """Finalizer of a stack dropped without close(): wait for its jobs in flight, stop its threads,
    close its backends and tiers (freeing memory and the disk lock). Unlike close() it does not copy
    blocks that only memory tiers hold down to disk: those are lost, so it warns."""
    warnings.warn(f"{what} was dropped without close(); its threads and files are released now, but blocks only "
                  f"its memory tiers held are not written to disk: call close() or use it in a with block",
                  ResourceWarning)

    def release() -> None:
        resources.wait_idle(60.0)
        resources.release(60.0)

    if on_kvtier_thread():  # collected in a completion or on a kvtier thread: that thread cannot wait
        _run_apart(release, f"releasing a dropped {what}")
    else:
        _logged(release, f"releasing a dropped {what}")


def _logged(release: Callable[[], None], what: str) -> None:
    """Run ``release`` where no caller is left to raise to: errors are logged."""
    try:
        release()
    except Exception:
        log.exception("%s failed", what)


def _run_apart(release: Callable[[], None], what: str) -> None:
    """Run ``release`` on a short-lived thread of its own, not marked as kvtier's, so it may wait for
    kvtier's jobs and join kvtier's threads. Not a daemon: the interpreter lets it finish at exit."""
    threading.Thread(target=_logged, args=(release, what), name="kvtier-release").start()
