"""The job manager: the single place that knows which transfers are in flight.

A job is one transfer of a list of blocks. It expects a number of completion reports (one per
worker; with tensor parallelism every rank reports, also ranks that copied nothing) that may arrive
over several steps. A block fails when any report says so. The job is DONE when every report arrived
and no block failed, FAILED when some block failed, CANCELLED when it was cancelled before its
reports were in (its bytes may still have moved, so its fences hold until then).

Fences: each job names the slots it reads and writes, per tier. A slot written by a job in flight may
not be read or written by another job, and a slot read by one may not be written; ``create`` refuses
such a job, ``flush`` waits until a slot's jobs are over, and tiers ask ``is_fenced`` before freeing.

Quarantine: a report may name failed blocks whose memory a remote store's call, still running past
its deadline, may yet touch (``quarantined``). The job still ends, and its fences drop, but whoever
finishes its plan keeps that memory out of use (``Planner.finish``) until every report that
quarantined something has been followed by one that lifts it (``lifted``, at a later step under vLLM);
``when_lifted`` callbacks then run.

Thread safety: all methods may be called from any thread; completion callbacks run exactly once,
outside the manager's lock, on the thread that delivered the last report. While they run, that thread
counts as one of kvtier's own (``on_kvtier_thread``): a callback must not wait for kvtier's jobs, the
one it belongs to is not over until it returns.
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

from kvtier.core.errors import FenceError, StateError

log = logging.getLogger(__name__)

_thread_role = threading.local()


def on_kvtier_thread() -> bool:
    """Whether the current thread is doing kvtier's own work: one of its worker threads, or any thread
    while it runs a job's completion callbacks (a future's done-callbacks among them). Such a thread
    must not block on kvtier's jobs or join kvtier's threads: it may be the one they wait for."""
    return getattr(_thread_role, "depth", 0) > 0


def mark_kvtier_thread() -> None:
    """Mark the current thread as kvtier's own for the rest of its life (a worker thread's first call,
    or a thread pool's ``initializer``)."""
    _thread_role.depth = getattr(_thread_role, "depth", 0) + 1


@contextmanager
def kvtier_work() -> Iterator[None]:
    """Mark the current thread as kvtier's own while the block runs."""
    mark_kvtier_thread()
    try:
        yield
    finally:
        _thread_role.depth -= 1


class JobState(enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def final(self) -> bool:
        return self in (JobState.DONE, JobState.FAILED, JobState.CANCELLED)


class Fence(NamedTuple):
    """Job access to one slot of one tier (or of an engine's storage, named like a tier). A named
    tuple: plans carry one per slot they touch, built every engine step."""

    tier: str
    slot: int
    write: bool


@dataclass
class Job:
    id: int
    kind: str
    num_blocks: int
    expected_reports: int
    fences: tuple[Fence, ...] = ()
    state: JobState = JobState.PENDING
    reports: int = 0
    failed_blocks: set[int] = field(default_factory=set)  # did not land: an error or a refusal, on any report
    refused_blocks: set[int] = field(default_factory=set)  # failed only because the destination can never hold them
    first_stage_failed: set[int] = field(default_factory=set)  # failed in a staged job's first copy, on some report
    quarantined_blocks: set[int] = field(default_factory=set)  # failed, their memory still touched (see module doc)
    holds: int = 0  # reports that quarantined blocks and have not been lifted yet
    cancel_requested: bool = False
    callback_errors: list[BaseException] = field(default_factory=list)
    _errors: set[int] = field(default_factory=set, repr=False)  # blocks some report failed with an error
    _callbacks: list[Callable[[Job], None]] = field(default_factory=list, repr=False)
    _lift_callbacks: list[Callable[[Job], None]] = field(default_factory=list, repr=False)
    _done: threading.Event = field(default_factory=threading.Event, repr=False)
    _lifted: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def ok_blocks(self) -> list[int]:
        """Indices of the blocks every report said landed (meaningful once the job is final)."""
        return [i for i in range(self.num_blocks) if i not in self.failed_blocks]

    @property
    def lost_blocks(self) -> set[int]:
        """Indices of the blocks whose copy cannot be trusted once the job is final: every block of
        a cancelled job (its result is discarded, whatever its reports said), else the failed ones."""
        return set(range(self.num_blocks)) if self.state is JobState.CANCELLED else set(self.failed_blocks)

    @property
    def lost_in_first_stage(self) -> set[int]:
        """``lost_blocks`` as far as a staged job's first copy goes: every block if cancelled, else
        those that failed in the first stage on some report (what reached the first destination
        whole on every rank is the rest)."""
        return set(range(self.num_blocks)) if self.state is JobState.CANCELLED else set(self.first_stage_failed)


@dataclass
class WorkerReport:
    """What workers say about jobs, per job id: reports received, block indices that failed with an
    error, block indices the destination refused for good (``Tier.refuse``: a compressing disk
    slot too small for them), which are not errors, and the blocks that failed in a staged job's
    first copy (GPU -> host of a write-through store: whatever failed after it left the host copy
    whole).

    Reports of several ranks, or of several steps, merge with ``aggregate``: counts add up and
    block sets are united, so a job completes exactly when all its expected reports are in. The
    sets stay apart because they mean different things to the tiers: a refusal tells the tier
    above to drop its copy, an error in a later stage that its copy is still good.

    ``quarantined`` names failed blocks whose memory a call past its deadline may still touch, and
    ``holds`` counts the reports that quarantined any; ``lifted`` counts, per job that ended
    already, reports whose quarantine is over (see the module doc).
    """

    finished: dict[int, int] = field(default_factory=dict)
    failed: dict[int, frozenset[int]] = field(default_factory=dict)
    refused: dict[int, frozenset[int]] = field(default_factory=dict)
    first_stage_failed: dict[int, frozenset[int]] = field(default_factory=dict)
    quarantined: dict[int, frozenset[int]] = field(default_factory=dict)
    holds: dict[int, int] = field(default_factory=dict)
    lifted: dict[int, int] = field(default_factory=dict)

    def add(
        self,
        job_id: int,
        failed: Iterable[int] = (),
        refused: Iterable[int] = (),
        first_stage_failed: Iterable[int] = (),
        quarantined: Iterable[int] = (),
    ) -> None:
        quarantined = frozenset(quarantined)
        self._merge(
            WorkerReport(
                {job_id: 1},
                {job_id: frozenset(failed) | quarantined},
                {job_id: frozenset(refused)},
                {job_id: frozenset(first_stage_failed)},
                {job_id: quarantined},
                {job_id: 1} if quarantined else {},
            )
        )

    def lift(self, job_id: int) -> None:
        """One earlier report's quarantine for ``job_id`` is over."""
        self._merge(WorkerReport(lifted={job_id: 1}))

    def aggregate(self, other: WorkerReport) -> WorkerReport:
        merged = WorkerReport(
            dict(self.finished),
            dict(self.failed),
            dict(self.refused),
            dict(self.first_stage_failed),
            dict(self.quarantined),
            dict(self.holds),
            dict(self.lifted),
        )
        merged._merge(other)
        return merged

    def _merge(self, other: WorkerReport) -> None:
        for ours_count, theirs_count in (
            (self.finished, other.finished),
            (self.holds, other.holds),
            (self.lifted, other.lifted),
        ):
            for job_id, count in theirs_count.items():
                ours_count[job_id] = ours_count.get(job_id, 0) + count
        for ours, theirs in (
            (self.failed, other.failed),
            (self.refused, other.refused),
            (self.first_stage_failed, other.first_stage_failed),
            (self.quarantined, other.quarantined),
        ):
            for job_id, blocks in theirs.items():
                if blocks:
                    ours[job_id] = ours.get(job_id, frozenset()) | blocks


class JobManager:
    """Creates jobs with increasing ids, collects their reports, holds their fences."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._jobs: dict[int, Job] = {}
        self._held: dict[int, Job] = {}  # ended jobs whose quarantined blocks are not lifted yet
        self._fences: dict[tuple[str, int], dict[int, bool]] = {}  # (tier, slot) -> {job id: writes}

    def create(
        self,
        kind: str,
        num_blocks: int,
        expected_reports: int = 1,
        fences: Iterable[Fence] = (),
        on_done: Callable[[Job], None] | None = None,
    ) -> Job:
        """A new PENDING job. Raises FenceError (creating nothing) when a fence conflicts with a job in flight."""
        if expected_reports < 1:
            raise ValueError("a job expects at least one report")
        fences = tuple(fences)
        with self._lock:
            for fence in fences:
                holders = self._fences.get((fence.tier, fence.slot), {})
                if any(fence.write or writes for writes in holders.values()):
                    raise FenceError(f"slot {fence.slot} of {fence.tier!r} is in use by job(s) {sorted(holders)}")
            job = Job(next(self._ids), kind, num_blocks, expected_reports, fences)
            if on_done is not None:
                job._callbacks.append(on_done)
            self._jobs[job.id] = job
            for fence in fences:
                holders = self._fences.setdefault((fence.tier, fence.slot), {})
                holders[job.id] = holders.get(job.id, False) or fence.write
            return job

    def get(self, job_id: int) -> Job:
        with self._lock:
            return self._job(job_id)

    def start(self, job_id: int) -> None:
        with self._lock:
            job = self._job(job_id)
            if job.state is JobState.PENDING:
                job.state = JobState.RUNNING

    def report(self, job_id: int, failed: Iterable[int] = (), count: int = 1, refused: Iterable[int] = ()) -> None:
        """Record ``count`` completion reports for a job, with the block indices that failed with an
        error and those the destination refused for good."""
        self.apply(WorkerReport({job_id: count}, {job_id: frozenset(failed)}, {job_id: frozenset(refused)}))

    def apply(self, report: WorkerReport) -> None:
        """Record merged worker reports; jobs whose reports are all in become final and run their callbacks."""
        finished: list[Job] = []
        with self._lock:
            for job_id, count in report.finished.items():  # validate everything before changing anything
                job = self._job(job_id)
                if count < 1:
                    raise StateError(f"job {job_id} got a report count of {count}; counts are at least 1")
                if job.state.final:
                    raise StateError(f"job {job_id} got a report after it ended ({job.state.value})")
                if job.reports + count > job.expected_reports:
                    raise StateError(f"job {job_id} got {job.reports + count} reports, expected {job.expected_reports}")
                named = report.failed.get(job_id, frozenset()) | report.refused.get(job_id, frozenset())
                if any(not 0 <= i < job.num_blocks for i in named):
                    raise StateError(f"job {job_id} got a failure for a block index outside [0, {job.num_blocks})")
            for job_id, count in report.finished.items():
                job = self._jobs[job_id]
                job._errors |= report.failed.get(job_id, frozenset())
                job.refused_blocks |= report.refused.get(job_id, frozenset())
                job.failed_blocks |= job._errors | job.refused_blocks
                job.refused_blocks -= job._errors  # an error anywhere: not known to be a refusal alone
                job.first_stage_failed |= report.first_stage_failed.get(job_id, frozenset())
                job.quarantined_blocks |= report.quarantined.get(job_id, frozenset())
                job.holds += report.holds.get(job_id, 0)
                job.reports += count
                job.state = JobState.RUNNING
                if job.reports == job.expected_reports:
                    self._finish(job)
                    finished.append(job)
        for job in finished:
            self._run_callbacks(job)
        if report.lifted:
            self._lift(report.lifted)

    def _lift(self, lifted: dict[int, int]) -> None:
        """Count quarantines that are over; jobs left with none run their ``when_lifted`` callbacks."""
        over: list[Job] = []
        with self._lock:
            for job_id, count in lifted.items():
                job = self._held.get(job_id)
                if job is None or count > job.holds:
                    raise StateError(
                        f"job {job_id} got {count} lifted quarantine(s) but holds {0 if job is None else job.holds}"
                    )
            for job_id, count in lifted.items():
                job = self._held[job_id]
                job.holds -= count
                if not job.holds:
                    del self._held[job_id]
                    over.append(job)
        for job in over:
            self._run_lift_callbacks(job)

    def cancel(self, job_id: int) -> None:
        """Ask for a job's result to be discarded; it still waits for its reports before its fences drop."""
        with self._lock:
            job = self._job(job_id)
            if not job.state.final:
                job.cancel_requested = True

    def add_done_callback(self, job: Job, callback: Callable[[Job], None]) -> None:
        """Run ``callback(job)`` once the job is final (at once if it already is)."""
        with self._lock:
            if not job.state.final:
                job._callbacks.append(callback)
                return
        callback(job)

    def when_lifted(self, job: Job, callback: Callable[[Job], None]) -> None:
        """Run ``callback(job)`` once the job is final and no memory of it is quarantined any more (at
        once if that is so already)."""
        with self._lock:
            if not job._lifted.is_set():
                job._lift_callbacks.append(callback)
                return
        callback(job)

    def held(self) -> list[Job]:
        """Jobs that ended with quarantined blocks not yet lifted (their lifts are still to come)."""
        with self._lock:
            return list(self._held.values())

    def wait(self, job: Job, timeout: float | None = None) -> Job:
        """Block until the job is final and its callbacks ran; TimeoutError if it does not end in time."""
        if not job._done.wait(timeout):
            raise TimeoutError(
                f"job {job.id} ({job.kind}) did not complete within {timeout} s: "
                f"{job.reports}/{job.expected_reports} reports"
            )
        return job

    def is_fenced(self, tier: str, slot: int) -> bool:
        with self._lock:
            return bool(self._fences.get((tier, slot)))

    def flush(self, tier: str, slots: Iterable[int] | None = None, timeout: float | None = None) -> None:
        """Wait until no job in flight reads or writes any of these slots (any slot of the tier when None)."""
        with self._lock:
            if slots is None:
                jobs = [j for j in self._jobs.values() if any(f.tier == tier for f in j.fences)]
            else:
                ids = {job_id for slot in slots for job_id in self._fences.get((tier, slot), {})}
                jobs = [self._jobs[i] for i in ids]
        self._wait_all(jobs, timeout)

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every job is final and nothing of any is quarantined any more."""
        with self._lock:
            jobs = list(self._jobs.values()) + list(self._held.values())
        deadline = None if timeout is None else time.monotonic() + timeout
        self._wait_all(jobs, timeout)
        for job in jobs:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not job._lifted.wait(remaining):
                raise TimeoutError(
                    f"job {job.id} ({job.kind}) still holds {job.holds} quarantine(s) after "
                    f"{timeout} s: a store call past its deadline has not returned"
                )

    def in_flight(self) -> list[Job]:
        """Jobs not yet final (or whose callbacks are still running)."""
        with self._lock:
            return list(self._jobs.values())

    # --- helpers -------------------------------------------------------------------------------

    def _job(self, job_id: int) -> Job:
        try:
            return self._jobs[job_id]
        except KeyError:
            raise StateError(f"unknown job id {job_id}") from None

    def _finish(self, job: Job) -> None:
        if job.cancel_requested:
            job.state = JobState.CANCELLED
        else:
            job.state = JobState.FAILED if job.failed_blocks else JobState.DONE
        if job.holds:
            self._held[job.id] = job
        for fence in job.fences:
            holders = self._fences.get((fence.tier, fence.slot))
            if holders is not None:
                holders.pop(job.id, None)
                if not holders:
                    del self._fences[(fence.tier, fence.slot)]

    def _run_callbacks(self, job: Job) -> None:
        with kvtier_work():
            callbacks, job._callbacks = job._callbacks, []
            while callbacks:  # one at a time: a stack whose last reference a callback held is finalized here, marked
                self._run_callback(job, callbacks.pop(0))
        with self._lock:
            del self._jobs[job.id]  # the table holds jobs in flight only; callers keep their Job objects
            held = job.id in self._held
        job._done.set()
        if not held:
            self._run_lift_callbacks(job)

    def _run_lift_callbacks(self, job: Job) -> None:
        with kvtier_work():
            with self._lock:
                job._lifted.set()
                callbacks, job._lift_callbacks = job._lift_callbacks, []
            for callback in callbacks:
                self._run_callback(job, callback)

    @staticmethod
    def _run_callback(job: Job, callback: Callable[[Job], None]) -> None:
        try:
            callback(job)
        except BaseException as exc:  # a callback bug must not kill the thread that reported
            log.exception("completion callback of job %d failed", job.id)
            job.callback_errors.append(exc)

    def _wait_all(self, jobs: Iterable[Job], timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for job in jobs:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            self.wait(job, remaining)
