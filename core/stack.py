"""The tier stack: ordered tiers (fastest first) behind the engine's three questions.

1. ``lookup(keys)``: the longest prefix of keys present anywhere, and the tier of each block.
2. ``load(keys, dst, slots)``: copy that prefix into the caller's storage, staging through an
   intermediate tier when the route planner says the source cannot reach the destination directly.
3. ``store(keys, src, slots)``: copy new blocks into the first tier. With ``write_through`` they then
   flow down to every tier in the background; with ``write_back`` a block moves down only when it is
   pushed out of the tier above (demotion on eviction), so nothing is lost while a lower tier has room.

Watermarks: after a write lands in a tier above its high mark, a background thread demotes or evicts
down to the low mark, so foreground stores seldom wait for space.

A remote tier (a store shared with other engines; the last tier) is asked only for the keys past what
the local tiers hold, in one batched query bounded by its timeout (a dead store answers "miss"); its
loads stage through host memory (Mooncake; a GPU caller's always) or go straight into a host caller's
memory (Redis: each reply is checked and copied in as it arrives, never after the call's deadline),
and blocks reach it from the host tier by background copies of their own, planned before any eviction
can drop them. Slots a store call past its deadline may still touch stay out of use until it has returned.

What moves where is the planner's (``core/planner.py``), as under vLLM; the stack executes its plans
in-process: one job per plan, its copies on the stack's transfer backends (``core/stages.py``). Where
the planner says room is on its way (victims still being demoted), the stack waits for it.

Thread safety: public methods may be called from any thread. Planning happens under the stack's lock
(taken before any tier lock); copy completions never take it: they only finish plans (commit, abort,
unpin) and post follow-up work (the next write-through hop, a watermark check) to the stack's
background thread.

Lifetime: ``close()`` releases everything (see there), also when called from a future's done-callback.
Threads hold only what the release needs (``_Resources``), never the stack itself, so a stack dropped
without ``close()`` is collected and a finalizer releases its threads, memory and files.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import logging
import queue
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvtier.core.caller_runs import CallerRunsFuture, offering, wait_here
from kvtier.core.devices import HOST, Capabilities, caller_medium
from kvtier.core.errors import ArgumentError, CapacityError, ClosedError, StateError
from kvtier.core.jobs import Job, JobManager, WorkerReport, mark_kvtier_thread, on_kvtier_thread
from kvtier.core.keys import check_key
from kvtier.core.media import medium
from kvtier.core.misses import GhostIndex, Misses
from kvtier.core.planner import ENGINE, Lookup, Outcome, Plan, Planner, Room
from kvtier.core.routes import plan_route
from kvtier.core.stages import StagedRun
from kvtier.core.storage import BlockStorage
from kvtier.core.tier import BlockState, Tier
from kvtier.core.transfer import CopiesHere, CopiesOffered, TransferBackend, TransferRegistry

log = logging.getLogger(__name__)

PLACEMENTS = ("write_through", "write_back")
LATER_COPIES_HERE_BYTES = 16 * 2**20
"""A later stage's copy (a staged load's copy from host memory into the caller's blocks) of at most this
much runs on the thread that completed the stage before it (``CopiesHere``), and a first stage's on the
caller's own thread where it waits (``store_now``, ``load_now``: ``CopiesOffered``): in a busy process
the hand-off to the copy pool and back cost more than a copy of this size on one thread."""


@dataclass(frozen=True)
class StackLookup:
    """``hits`` leading keys are present; ``tiers[i]`` names the tier that serves key i."""

    hits: int
    tiers: tuple[str, ...]


@dataclass
class StoreResult:
    requested: int
    stored: int = 0  # new blocks now readable in the first tier
    present: int = 0  # blocks that were already there (or being written)
    dropped: int = 0  # blocks that found no room ("a full tier stores less")
    failed: list[bytes] = field(default_factory=list)  # blocks whose copy failed


@dataclass
class LoadResult:
    requested: int
    hits: int  # leading keys found and planned
    loaded: int = 0  # of those, blocks that arrived intact
    failed: list[int] = field(default_factory=list)  # indices (into keys) of hits that could not be loaded
    sources: tuple[str, ...] = ()  # the tier each hit is read from, in key order

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def per_tier(self) -> dict[str, int]:
        """Hits per tier they are read from."""
        return dict(collections.Counter(self.sources))


class TierStack:
    """Tiers ordered fastest first, the transfer backends that move bytes between them, one job manager."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        backends: Sequence[TransferBackend],
        jobs: JobManager | None = None,
        placement: str = "write_back",
        capabilities: Capabilities | None = None,
        route: Callable[[str, str, Capabilities], tuple[str, ...]] = plan_route,
        ghost: GhostIndex | None = None,
    ) -> None:
        if not tiers:
            raise ArgumentError("a stack needs at least one tier")
        if placement not in PLACEMENTS:
            raise ArgumentError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ArgumentError(f"tier names must be unique, got {names}")
        block_bytes = {t.block_bytes for t in tiers}
        if len(block_bytes) != 1:
            raise ArgumentError(f"tiers disagree on the block size: {sorted(block_bytes)}")
        self.transfers = TransferRegistry(backends)
        self._later_copies = CopiesHere(self.transfers, LATER_COPIES_HERE_BYTES)
        self._copies_offered = CopiesOffered(self._later_copies)
        for upper, lower in _neighbours(tiers):
            for src, dst in ((upper, lower), (lower, upper)):
                self.transfers.backend(
                    src.storage.device, dst.storage.device, f"between tier {upper.name!r} and tier {lower.name!r}"
                )
        self.tiers = list(tiers)
        self._remote = next((t for t in self.tiers if t.by_key), None)
        self.jobs = jobs or JobManager()
        self.placement = placement
        self.capabilities = capabilities or Capabilities()
        self.planner = Planner(self.tiers, route, self.capabilities, ghost)
        self._copy_targets = [self.planner.copy_targets(i, placement == "write_through") for i in range(len(tiers))]
        self._copied_on = frozenset(t.name for t, targets in zip(tiers, self._copy_targets, strict=True) if targets)
        self._copies_due: collections.deque[tuple[int, list[bytes]]] = collections.deque()  # (tier, keys)
        self._planning_copies = False  # (under the lock: ``_plan_copies_due`` is running)
        self.misses = Misses(names, self.planner.ghost, [t.why_absent for t in self.tiers])
        self._index = {t.name: i for i, t in enumerate(self.tiers)}
        self._storages: dict[str | None, BlockStorage] = {t.name: t.storage for t in self.tiers}
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

    def lookup(self, keys: Sequence[bytes], partial: bool = False, count: bool = True) -> StackLookup:
        """The longest prefix of ``keys`` readable in some tier, and which tier (the fastest) holds each.
        A remote tier is asked for the keys past the local hit (waiting at most its timeout).

        A lookup that ends early (before the last key, or, with ``partial``, before a partial block
        the caller has after them) is counted in ``misses`` with its reason, unless ``count`` is False
        (a caller that counts it itself)."""
        found = self._find(keys)
        result = StackLookup(len(found.sources), tuple(self.tiers[i].name for i in found.sources))
        if count:
            self.misses.count(self.misses.explain(keys, result.hits, partial))
        return result

    def store(self, keys: Sequence[bytes], src: BlockStorage, src_slots: Sequence[int]) -> Future[StoreResult]:
        """Copy blocks ``src_slots`` of ``src`` into the first tier under ``keys``.

        Keys already present in any tier (or being written to one) are skipped. The future resolves once
        ``src`` is no longer read and the blocks are readable in the first tier; write-through copies
        further down continue afterwards.
        Raises CapacityError when the new blocks outnumber the first tier.
        """
        future: Future[StoreResult] = Future()
        self._store(future, keys, src, src_slots)
        return future

    def store_now(
        self, keys: Sequence[bytes], src: BlockStorage, src_slots: Sequence[int], timeout: float | None = None
    ) -> StoreResult:
        """``store(...).result(timeout)``, for a caller that waits anyway: the copy into the first tier runs
        on this thread (a memmove of at most ``LATER_COPIES_HERE_BYTES``; ``CopiesOffered``) with no copy
        thread woken for it; TimeoutError as ``result`` raises it."""
        return wait_here(lambda future: self._store(future, keys, src, src_slots), timeout)

    def _store(
        self, future: Future[StoreResult], keys: Sequence[bytes], src: BlockStorage, src_slots: Sequence[int]
    ) -> None:
        if len(keys) != len(src_slots):
            raise ArgumentError(f"{len(keys)} keys but {len(src_slots)} source slots")
        for key in keys:  # before any room is made: a key no tier can hold is refused with nothing moved
            check_key(key)
        with self._lock:
            self._check_open()
            top = self.tiers[0]
            result = StoreResult(len(keys))
            new = {k: s for k, s in dict(zip(keys, src_slots, strict=True)).items() if self.planner.is_new(k)}
            result.present = len(keys) - len(new)
            if len(new) > top.capacity and not top.by_key:  # (a tier by key has no slots: its owner makes room)
                raise CapacityError(
                    f"{len(new)} new blocks can never fit in tier {top.name!r} of {top.capacity} blocks"
                )
            if not top.by_key:
                top.expect(list(new))  # (room is made before the plan: shares count the blocks coming)
            self._await_room(0, len(new))
            planned = self.planner.store(list(new), list(new.values()))
            self._run_demotions(planned.room)
            plan = planned.plan
            result.dropped = len(new) - plan.num_blocks
            if not plan.num_blocks:
                future.set_result(result)
                return

            def landed(outcome: Outcome) -> None:
                result.stored = len(outcome.stored.get(top.name, ()))
                result.failed = [plan.keys[i] for i in sorted(outcome.lost)]
                future.set_result(result)

            with offering(future):  # (store_now's result() runs the copy)
                self._execute(plan, landed, caller=src, waiting=future)

    def load(
        self, keys: Sequence[bytes], dst: BlockStorage, dst_slots: Sequence[int], dst_medium: str | None = None
    ) -> Future[LoadResult]:
        """Copy the longest present prefix of ``keys`` into blocks ``dst_slots`` of ``dst``.

        Only the prefix that ``lookup`` would report is loaded; the result says how many blocks that
        is and which of them failed (the caller recomputes those). ``dst_medium`` defaults to "gpu"
        for CUDA memory and "host" otherwise.
        """
        future: CallerRunsFuture[LoadResult] = CallerRunsFuture()
        self._load(future, keys, dst, dst_slots, dst_medium)
        return future

    def load_now(
        self,
        keys: Sequence[bytes],
        dst: BlockStorage,
        dst_slots: Sequence[int],
        dst_medium: str | None = None,
        timeout: float | None = None,
    ) -> LoadResult:
        """``load(...).result(timeout)``, for a caller that waits anyway: the load's store calls, and the
        memmoves of a load from the first tier, run on this thread with no worker woken for them
        (``caller_runs``); TimeoutError as ``result`` raises it."""
        return wait_here(lambda future: self._load(future, keys, dst, dst_slots, dst_medium), timeout)

    def _load(
        self,
        future: CallerRunsFuture[LoadResult],
        keys: Sequence[bytes],
        dst: BlockStorage,
        dst_slots: Sequence[int],
        dst_medium: str | None,
    ) -> None:
        if len(keys) != len(dst_slots):
            raise ArgumentError(f"{len(keys)} keys but {len(dst_slots)} destination slots")
        dst_medium = dst_medium or caller_medium(dst.device)
        found = self._find(keys, dst_medium)
        waited = found.hits != len(keys) and self._await_staging(keys[len(found.sources) :], dst_medium)
        with self._lock:
            self._check_open()
            for index, stage in enumerate(self.planner.staging(dst_medium)):  # refuse before pinning anything
                last_hop = self.tiers[index if stage is None else stage]
                self.transfers.backend(last_hop.storage.device, dst.device, f"from tier {last_hop.name!r}")
            if waited or found.hits is None:  # (staging copies landed meanwhile: fewer blocks stage now)
                found = self.planner.lookup(keys, dst_medium)
            for stage, n in found.staging.items():
                self._await_room(stage, n)
            planned = self.planner.load(keys, dst_slots, dst_medium)
            self._run_demotions(planned.room)
            plan = planned.plan
            result = LoadResult(len(keys), plan.num_blocks, sources=tuple(self.tiers[i].name for i in planned.sources))
            if not plan.num_blocks:
                future.set_result(result)
                return

            def loaded(outcome: Outcome) -> None:
                result.failed = sorted(outcome.lost)
                result.loaded = plan.num_blocks - len(outcome.lost)
                future.set_result(result)

            with offering(future):  # its result() runs the store calls no worker has begun
                self._execute(plan, loaded, caller=dst, waiting=future)

    # --- a tier written from outside ----------------------------------------------------------

    def copies_on(self, index: int) -> bool:
        """Whether blocks written into tier ``index`` are copied on to other tiers (its placement): a
        writer from outside commits them pinned (``Tier.commit(pin=True)``) and says so (``committed``)."""
        return bool(self._copy_targets[index])

    def committed(self, index: int, keys: list[bytes]) -> None:
        """Blocks that a writer from outside the stack (a node daemon's engines, which copy into its slab
        themselves) wrote and committed into tier ``index``: copied on as the placement says (then
        unpinned, where ``copies_on``), the tier's watermark checked."""
        self._after_write(index, keys)

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
        """Wait until background work (write-through hops, watermark demotions) and every job are done,
        and every tier's owner took in what they told it (``Tier.settle``): blocks stored before are then
        visible to every engine sharing a tier."""
        if on_kvtier_thread():
            raise StateError(
                "wait_idle() cannot run in a kvtier completion callback: the callback's own job "
                "is not over until it returns"
            )
        self._resources.wait_idle(timeout)
        for tier in self.tiers:
            tier.settle()

    def describe(self) -> str:
        lines = [
            f"kvtier stack: {len(self.tiers)} tier(s), placement {self.placement}, "
            f"transfer backends: {', '.join(b.name for b in self.transfers.backends)}"
        ]
        lines += [f"  {i}. {tier!r}" for i, tier in enumerate(self.tiers)]
        return "\n".join(lines)

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per tier its counters and current usage, and where it has ``tenants:`` shares, ``"tenants"``:
        per tenant label, blocks stored, read, evicted and held (``Tier.tenant_counts``)."""
        out: dict[str, dict[str, Any]] = {}
        for tier in self.tiers:
            usage = tier.usage()
            out[tier.name] = {**tier.stats.as_dict(), "used": usage.used, "capacity": usage.capacity}
            tenants = tier.tenant_counts()
            if tenants is not None:
                out[tier.name]["tenants"] = tenants
        return out

    def __enter__(self) -> TierStack:
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
                log.warning(
                    "%s closed without copying the blocks only its memory tiers hold to disk: %s", self._name, exc
                )
            self._resources.release(timeout)
        finally:
            self._release_over.set()

    def _copy_down_to_disk(self, timeout: float | None) -> None:
        """Copy every block a tier holds that the tier below lacks into it, top down, as far as the
        lowest tier whose medium keeps blocks across a restart (disk): what a restart finds is then
        everything the stack held."""
        for index in range(len(self.tiers) - 1):
            if not any(medium(t.medium).survives_restart for t in self.tiers[index + 1 :]):
                break
            with self._lock:
                self._copy_down(index, self.tiers[index].ready_keys(), closing=True)
            self._resources.wait_idle(timeout)

    # --- executing plans (planning under self._lock) -------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the tier stack is closed")

    def _find(self, keys: Sequence[bytes], dst_medium: str | None = None) -> Lookup:
        """The planner's lookup of ``keys`` (with ``dst_medium``: what a load there stages), after asking
        the remote tier, if any, which of the keys past what the tiers are known to hold its store
        holds: one batched query, outside the stack's lock (it may take up to the tier's timeout); the
        planner then sees them READY there for a few seconds. Keys the store was found to hold lately
        are not asked again."""
        with self._lock:
            self._check_open()
            found = self.planner.lookup(keys, dst_medium)
        start = len(found.sources)
        if self._remote is None or start == len(keys):
            return found
        self._remote.query(keys[start:])
        with self._lock:
            self._check_open()
            return self.planner.lookup(keys, dst_medium)

    def _await_staging(self, keys: Sequence[bytes], dst_medium: str) -> bool:
        """Wait until no block of ``keys`` is being written into a tier that a load into ``dst_medium``
        stages through: another request's load of the same blocks (a hot prefix), or a store of them.
        This load then takes them from there instead of stopping at them, and the store is read once
        per block however many requests want it. Outside the stack's lock (those copies end by their
        deadlines); not on kvtier's own threads, where a job must not wait for another. Returns whether
        it waited."""
        if on_kvtier_thread():
            return False
        waited = False
        for stage in {s for s in self.planner.staging(dst_medium) if s is not None}:
            tier = self.tiers[stage]
            slots = []
            for key in keys:
                if tier.state(key) is BlockState.WRITING:
                    with contextlib.suppress(StateError):  # (written, and gone again, meanwhile)
                        slots += tier.slots([key])
            if slots:
                self.jobs.flush(tier.name, slots)
                waited = True
        return waited

    def _await_room(self, index: int, n: int) -> None:
        """Make ``n`` slots of tier ``index`` free before a plan reserves them, waiting where the
        planner says room is on its way: for the demotions it started (each round reaches one tier
        further down), and once for the copies in flight in this tier and those below it: copies that
        pin the victims (a write-through copy, a load) and demotions further down that make the room
        the victims wait for. Gives up when no more room comes; the plan then takes what is free."""
        tier = self.tiers[index]
        if tier.by_key:
            return  # (its owner makes room by itself)
        n = min(n, tier.capacity)
        flushed = False
        if tier.usage().free < n:
            self._plan_copies_due()
        for _ in range(len(self.tiers) + 1):
            room = self.planner.make_room(index, n)
            demotions = self._run_demotions(room)
            for job in demotions:
                self.jobs.wait(job)
            if tier.usage().free >= n or (flushed and not demotions):
                return
            if not demotions:
                for below in self.tiers[index:]:
                    self.jobs.flush(below.name)
                flushed = True

    def _copy_down(self, index: int, keys: list[bytes], target: int | None = None, closing: bool = False) -> None:
        """Copy READY blocks of tier ``index`` that tier ``target`` (the next one by default) lacks into
        it (write-through, the copies to a remote store, and the flush at close)."""
        target = index + 1 if target is None else target
        with self._lock:
            if self._closed and not closing:
                return
            keys = self.planner.lacking(index, keys, target)
            if not keys:
                return
            self._await_room(target, len(keys))  # (room for the blocks it lacks: none for those it holds)
            planned = self.planner.copy_down(index, keys, target)
            self._run_demotions(planned.room)
            if planned.plan.num_blocks:
                self._execute(planned.plan)

    def _run_demotions(self, room: Room) -> list[Job]:
        """Start the demotions the planner planned to make room; returns their jobs."""
        return [self._execute(plan) for plan in room.demotions]

    def _execute(
        self,
        plan: Plan,
        then: Callable[[Outcome], None] | None = None,
        caller: BlockStorage | None = None,
        waiting: Future | None = None,
    ) -> Job:
        """Run ``plan`` in-process: one job holding its fences, its stages on the transfer backends
        (``caller`` is the storage its ``ENGINE`` endpoint names). When the job ends the planner
        finishes the plan, ``then(outcome)`` runs, and every tier that stored blocks gets its
        follow-up work (``_after_write``). Raises (after the job has ended failed and released
        everything) when the first stage's copies cannot start. Where finishing the plan raises (a
        bug), the caller's future that ``then`` would complete (``waiting``) gets the error: no
        caller waits forever."""

        def finished(job: Job) -> None:
            try:
                outcome = self.planner.finish(plan, job, self._copied_on)
            except Exception as exc:
                if waiting is not None:
                    waiting.set_exception(exc)
                raise
            if outcome.holds:
                self.jobs.when_lifted(job, lambda job: self.planner.lift(outcome))
            if then is not None:
                then(outcome)
            for name, keys in outcome.stored.items():
                self._after_write(self._index[name], keys)

        job = self.jobs.create(plan.kind, plan.num_blocks, 1, plan.fences, finished)
        self.jobs.start(job.id)
        storages = self._storages if caller is None else {**self._storages, ENGINE: caller}
        # The run reports to the job manager, not through a closure over the stack: see _Resources.
        run = StagedRun(
            plan.stages,
            plan.num_blocks,
            storages,
            self._copies_offered,  # (a caller that waits runs the first stage's memmoves: caller_runs)
            functools.partial(_report, self.jobs, job.id),
            later=self._later_copies,
        )
        run.start()
        if run.start_errors and job.state.final:  # nothing could start: the caller hears why
            raise run.start_errors[0]
        return job

    # --- background ----------------------------------------------------------------------------

    def _after_write(self, index: int, keys: list[bytes]) -> None:
        """Called from completions: queue the copies on (the next write-through hop, a remote store's
        copy from the host tier) and a watermark check. Blocks with copies on arrive pinned
        (``Planner.finish``), so no eviction drops them before those copies are planned."""
        targets = [self.tiers[t] for t in self._copy_targets[index]]
        if keys and targets:
            due = [key for key in keys if any(t.state(key) is BlockState.FREE for t in targets)]
            if len(due) < len(keys):  # (a staged load's blocks, read from the tier below: nothing to copy)
                self.tiers[index].unpin(set(keys).difference(due) if due else keys)
            if due:
                self._copies_due.append((index, due))
                self._work.put(self._plan_copies_due)
        if self.tiers[index].excess() > 0:
            self._work.put(lambda: self._enforce_watermark(index))

    def _plan_copies_due(self) -> None:
        """Plan the copies on of blocks written lately (``_after_write``; their plans pin what they read),
        then let go of the pins those blocks arrived with. Run by the background thread, and by a
        request that waits for room (``_await_room``), which holds the lock the background thread
        would need. A block is not lost to an eviction while its copy waits in line: a host tier
        smaller than a burst of stores would otherwise drop blocks before they reach the remote store
        below it, which takes no demotions."""
        with self._lock:
            if self._planning_copies:  # (a copy's own wait for room, further down: the outer call goes on)
                return
            self._planning_copies = True
            try:
                while self._copies_due:
                    index, keys = self._copies_due.popleft()
                    try:
                        for target in self._copy_targets[index]:
                            self._copy_down(index, keys, target)
                    finally:
                        self.tiers[index].unpin(keys)
            finally:
                self._planning_copies = False

    def _enforce_watermark(self, index: int) -> None:
        with self._lock:
            if self._closed:
                return
            jobs = self._run_demotions(self.planner.relieve(index))
        for job in jobs:
            self.jobs.wait(job)


def _report(jobs: JobManager, job_id: int, run: StagedRun) -> None:
    """A finished in-process run reports to its job, as one worker would, and reports again once the
    quarantine of its blocks, if any, is lifted."""
    jobs.apply(run.report(job_id))
    if run.quarantined:
        run.when_lifted(functools.partial(_lifted, jobs, job_id))


def _lifted(jobs: JobManager, job_id: int) -> None:
    report = WorkerReport()
    report.lift(job_id)
    jobs.apply(report)


def _neighbours(tiers: Sequence[Tier]) -> list[tuple[Tier, Tier]]:
    """The pairs of tiers blocks move between: each local tier and the next, and a tier addressed by key
    and the host tier its blocks come from (or the last local tier, where there is no host tier; a tier
    by key alone has none: its blocks come from the caller)."""
    local = [t for t in tiers if not t.by_key]
    above = next((t for t in local if t.medium == HOST), local[-1] if local else None)
    return list(itertools.pairwise(local)) + [(above, t) for t in tiers if t.by_key and above is not None]


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
        self.worker = threading.Thread(
            target=_background, args=(self.work, self.errors), name="kvtier-stack", daemon=True
        )

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
    warnings.warn(
        f"{what} was dropped without close(); its threads and files are released now, but blocks only "
        f"its memory tiers held are not written to disk: call close() or use it in a with block",
        ResourceWarning,
        stacklevel=2,
    )

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
