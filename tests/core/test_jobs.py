"""The job manager: ids, reports, final states, callbacks and fences.

Invariants checked:
- job ids increase strictly, also across completions and refused creations;
- a job is final exactly when all its expected reports are in: reports may come from several ranks
  and several steps (WorkerReport.aggregate sums counts and unites failures);
- the final state is DONE, FAILED (the union of every report's failed blocks, ok_blocks the rest) or
  CANCELLED (cancel holds the fences until the reports are in);
- completion callbacks run exactly once, also when added after completion (at once) and when another
  callback raises (its exception lands in callback_errors);
- a bad report (too many, unknown job, block index out of range, a count below one) raises
  StateError and changes nothing, also for the valid jobs in the same merged report;
- fences: a write conflicts with any other access to the slot, reads share; a refused job is not
  created; fences drop when the job ends; flush and drain wait for the jobs; wait times out.
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from kvtier.core.errors import FenceError, StateError
from kvtier.core.jobs import Fence, JobManager, JobState, WorkerReport


@pytest.fixture
def jobs() -> JobManager:
    return JobManager()


def report_later(manager: JobManager, job_id: int, failed=(), delay: float = 0.05) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)
        manager.report(job_id, failed)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


# --- ids and states ------------------------------------------------------------------------------


def test_ids_increase_strictly(jobs):
    ids = []
    for i in range(5):
        job = jobs.create("store", 2)
        ids.append(job.id)
        if i % 2:
            jobs.report(job.id)
    jobs.create("load", 1, fences=[Fence("host", 0, True)])
    with pytest.raises(FenceError):
        jobs.create("load", 1, fences=[Fence("host", 0, True)])
    ids.append(jobs.create("load", 1).id)
    assert ids == sorted(set(ids)) and len(ids) == 6
    assert all(b > a for a, b in itertools.pairwise(ids))


def test_a_job_moves_pending_running_done(jobs):
    job = jobs.create("store", 3)
    assert job.state is JobState.PENDING and not job.state.final
    jobs.start(job.id)
    assert job.state is JobState.RUNNING
    jobs.report(job.id)
    assert job.state is JobState.DONE and job.state.final
    assert job.failed_blocks == set() and job.ok_blocks == [0, 1, 2]
    assert jobs.wait(job, timeout=5) is job
    assert jobs.in_flight() == []


def test_a_job_needs_at_least_one_report():
    with pytest.raises(ValueError):
        JobManager().create("store", 1, expected_reports=0)


def test_expected_reports_all_arrive_before_completion(jobs):
    calls = []
    job = jobs.create("store", 4, expected_reports=2, on_done=calls.append)
    jobs.report(job.id, failed=[1])
    assert job.state is JobState.RUNNING and job.reports == 1 and calls == []
    with pytest.raises(TimeoutError):
        jobs.wait(job, timeout=0)
    jobs.report(job.id)
    assert job.state is JobState.FAILED and job.reports == 2
    assert job.failed_blocks == {1} and job.ok_blocks == [0, 2, 3]
    assert calls == [job]


def test_failed_blocks_are_united_across_reports(jobs):
    job = jobs.create("load", 6, expected_reports=3)
    jobs.report(job.id, failed=[0, 4])
    jobs.report(job.id, failed=[])
    jobs.report(job.id, failed=[4, 5])
    assert job.state is JobState.FAILED
    assert job.failed_blocks == {0, 4, 5}
    assert job.ok_blocks == [1, 2, 3]


def test_report_with_a_count_stands_for_several_reports(jobs):
    job = jobs.create("store", 1, expected_reports=4)
    jobs.report(job.id, count=3)
    assert job.state is JobState.RUNNING
    jobs.report(job.id, count=1)
    assert job.state is JobState.DONE


def test_worker_reports_aggregate_across_ranks_and_steps(jobs):
    a = jobs.create("load", 4, expected_reports=2)  # two ranks
    b = jobs.create("store", 3, expected_reports=2)
    c = jobs.create("store", 2, expected_reports=2)

    rank0, rank1 = WorkerReport(), WorkerReport()
    rank0.add(a.id, failed=[1])
    rank0.add(b.id)
    rank1.add(a.id, failed=[3])
    rank1.add(c.id)
    step1 = rank0.aggregate(rank1)
    assert step1.finished == {a.id: 2, b.id: 1, c.id: 1}
    assert step1.failed == {a.id: frozenset({1, 3})}
    assert rank0.finished == {a.id: 1, b.id: 1}  # aggregate builds a new report
    assert rank0.failed == {a.id: frozenset({1})}

    jobs.apply(step1)
    assert a.state is JobState.FAILED and a.failed_blocks == {1, 3} and a.ok_blocks == [0, 2]
    assert b.state is JobState.RUNNING and c.state is JobState.RUNNING

    step2_rank0, step2_rank1 = WorkerReport(), WorkerReport()
    step2_rank0.add(c.id, failed=[0])
    step2_rank1.add(b.id)
    jobs.apply(step2_rank0.aggregate(step2_rank1))
    assert b.state is JobState.DONE and b.reports == 2
    assert c.state is JobState.FAILED and c.ok_blocks == [1]


def test_refused_blocks_merge_across_ranks_apart_from_errors(jobs):
    """A block one rank's disk refused (too large compressed) did not land; it is refused for the
    job (the tier above drops it rather than retry) unless some rank also failed it with an error,
    which may have hit an earlier stage (the tier above must not keep its copy then)."""
    job = jobs.create("store", 5, expected_reports=2)
    rank0, rank1 = WorkerReport(), WorkerReport()
    rank0.add(job.id, failed=[0], refused=[2, 4])
    rank1.add(job.id, failed=[4], refused=[3])
    merged = rank0.aggregate(rank1)
    assert merged.refused == {job.id: frozenset({2, 3, 4})} and merged.failed == {job.id: frozenset({0, 4})}
    jobs.apply(merged)
    assert job.state is JobState.FAILED
    assert job.failed_blocks == {0, 2, 3, 4} and job.refused_blocks == {2, 3} and job.ok_blocks == [1]


def test_an_error_in_a_later_step_unrefuses_a_block(jobs):
    job = jobs.create("demote", 2, expected_reports=2)
    jobs.report(job.id, refused=[1])
    assert job.refused_blocks == {1} and job.state is JobState.RUNNING
    jobs.report(job.id, failed=[1])
    assert job.failed_blocks == {1} and job.refused_blocks == set() and job.ok_blocks == [0]


def test_refused_block_outside_the_job_is_rejected(jobs):
    job = jobs.create("demote", 2)
    with pytest.raises(StateError, match="outside"):
        jobs.report(job.id, refused=[2])
    assert job.state is JobState.PENDING and job.refused_blocks == set() and job.reports == 0


def test_worker_report_add_counts_and_unites():
    report = WorkerReport()
    report.add(7)
    report.add(7, failed=[2])
    report.add(7, failed={2, 5})
    report.add(8, failed=())
    assert report.finished == {7: 3, 8: 1}
    assert report.failed == {7: frozenset({2, 5})}


# --- cancel ------------------------------------------------------------------------------------


def test_cancel_ends_cancelled_after_the_reports_and_holds_fences_until_then(jobs):
    calls = []
    job = jobs.create("store", 2, fences=[Fence("host", 3, True)], on_done=calls.append)
    jobs.cancel(job.id)
    assert job.cancel_requested and job.state is JobState.PENDING
    assert jobs.is_fenced("host", 3)
    with pytest.raises(FenceError):
        jobs.create("store", 1, fences=[Fence("host", 3, False)])
    jobs.report(job.id)
    assert job.state is JobState.CANCELLED
    assert not jobs.is_fenced("host", 3)
    assert calls == [job]


def test_cancel_wins_over_failures(jobs):
    job = jobs.create("load", 2)
    jobs.cancel(job.id)
    jobs.report(job.id, failed=[0])
    assert job.state is JobState.CANCELLED


def test_lost_blocks_are_every_block_of_a_cancelled_job_else_the_failed_ones(jobs):
    failed = jobs.create("store", 4)
    jobs.apply(
        WorkerReport({failed.id: 1}, {failed.id: frozenset({1, 3})}, first_stage_failed={failed.id: frozenset({3})})
    )
    assert (failed.lost_blocks, failed.lost_in_first_stage) == ({1, 3}, {3})
    cancelled = jobs.create("store", 3)
    jobs.cancel(cancelled.id)
    jobs.report(cancelled.id, failed=[0])
    assert cancelled.lost_blocks == cancelled.lost_in_first_stage == {0, 1, 2}


def test_cancel_of_an_unknown_job_raises(jobs):
    with pytest.raises(StateError):
        jobs.cancel(12345)


# --- callbacks ---------------------------------------------------------------------------------


def test_callbacks_run_exactly_once_in_order(jobs):
    calls = []
    job = jobs.create("store", 1, expected_reports=2, on_done=lambda j: calls.append(("on_done", j.state)))
    jobs.add_done_callback(job, lambda j: calls.append(("added", j.state)))
    jobs.report(job.id)
    assert calls == []
    jobs.report(job.id)
    assert calls == [("on_done", JobState.DONE), ("added", JobState.DONE)]
    jobs.add_done_callback(job, lambda j: calls.append(("late", j.state)))  # runs at once
    assert calls[-1] == ("late", JobState.DONE) and len(calls) == 3
    with pytest.raises(StateError):
        jobs.report(job.id)
    assert len(calls) == 3


def test_a_raising_callback_is_recorded_and_the_others_still_run(jobs):
    calls = []
    boom = RuntimeError("callback bug")

    def bad(job):
        raise boom

    job = jobs.create("store", 1, on_done=bad)
    jobs.add_done_callback(job, calls.append)
    jobs.report(job.id)  # does not raise in the reporter
    assert calls == [job]
    assert job.callback_errors == [boom]
    assert job.state is JobState.DONE
    assert jobs.wait(job, timeout=5) is job
    assert jobs.in_flight() == []


def test_callbacks_run_once_when_many_threads_report(jobs):
    calls = []
    job = jobs.create("store", 8, expected_reports=16, on_done=calls.append)
    barrier = threading.Barrier(16)

    def worker(rank: int) -> None:
        barrier.wait()
        jobs.report(job.id, failed=[rank % 8] if rank % 5 == 0 else [])

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [job]
    assert job.reports == 16 and job.state is JobState.FAILED
    assert job.failed_blocks == {0, 5, 2, 7}  # ranks 0, 5, 10, 15


def test_callbacks_run_on_the_thread_that_delivered_the_last_report(jobs):
    seen = []
    job = jobs.create("store", 1, on_done=lambda j: seen.append(threading.current_thread()))
    thread = report_later(jobs, job.id, delay=0)
    thread.join()
    assert seen == [thread]


def test_wait_returns_only_after_the_callbacks_ran(jobs):
    entered, release = threading.Event(), threading.Event()

    def slow_callback(job):
        entered.set()
        assert release.wait(30)

    job = jobs.create("store", 1, fences=[Fence("host", 0, True)], on_done=slow_callback)
    thread = threading.Thread(target=jobs.report, args=(job.id,))
    thread.start()
    assert entered.wait(30)
    assert job.state is JobState.DONE  # final, but its callback is still running
    assert not jobs.is_fenced("host", 0)
    assert job in jobs.in_flight()
    with pytest.raises(TimeoutError):
        jobs.wait(job, timeout=0.05)
    with pytest.raises(TimeoutError):
        jobs.drain(timeout=0.05)
    release.set()
    assert jobs.wait(job, timeout=30) is job
    thread.join()
    assert jobs.in_flight() == []


# --- bad reports -------------------------------------------------------------------------------


def test_too_many_reports_raise_and_change_nothing(jobs):
    job = jobs.create("store", 2, expected_reports=2)
    jobs.report(job.id)
    with pytest.raises(StateError):
        jobs.report(job.id, failed=[0], count=2)
    assert job.reports == 1 and job.failed_blocks == set() and job.state is JobState.RUNNING
    jobs.report(job.id)
    assert job.state is JobState.DONE


def test_a_report_for_an_unknown_or_finished_job_raises(jobs):
    with pytest.raises(StateError):
        jobs.report(999)
    job = jobs.create("store", 1)
    jobs.report(job.id)
    with pytest.raises(StateError):
        jobs.report(job.id)
    with pytest.raises(StateError):
        jobs.get(job.id)  # the table holds jobs in flight only
    assert job.reports == 1 and job.state is JobState.DONE


@pytest.mark.parametrize("bad", [[-1], [3], [0, 7]])
def test_a_failed_block_index_out_of_range_raises_and_changes_nothing(jobs, bad):
    job = jobs.create("load", 3)
    with pytest.raises(StateError):
        jobs.report(job.id, failed=bad)
    assert job.reports == 0 and job.failed_blocks == set() and job.state is JobState.PENDING
    jobs.report(job.id, failed=[2])
    assert job.state is JobState.FAILED and job.ok_blocks == [0, 1]


@pytest.mark.parametrize("count", [0, -1])
def test_a_report_count_below_one_raises_and_changes_nothing(jobs, count):
    job = jobs.create("store", 1, expected_reports=2)
    jobs.report(job.id)
    with pytest.raises(StateError):
        jobs.report(job.id, count=count)
    assert job.reports == 1 and job.state is JobState.RUNNING
    jobs.report(job.id)
    assert job.state is JobState.DONE


def test_a_merged_report_with_one_bad_entry_applies_nothing(jobs):
    good = jobs.create("store", 2)
    other = jobs.create("store", 2)
    report = WorkerReport()
    report.add(good.id)
    report.add(other.id, failed=[9])
    with pytest.raises(StateError):
        jobs.apply(report)
    assert good.reports == 0 and good.state is JobState.PENDING
    assert other.reports == 0 and other.failed_blocks == set()
    report = WorkerReport()
    report.add(good.id)
    report.add(424242)
    with pytest.raises(StateError):
        jobs.apply(report)
    assert good.reports == 0
    jobs.report(good.id)
    jobs.report(other.id)
    assert good.state is JobState.DONE and other.state is JobState.DONE


# --- fences ------------------------------------------------------------------------------------


def test_write_fences_conflict_and_read_fences_share(jobs):
    writer = jobs.create("store", 1, fences=[Fence("host", 0, True)])
    with pytest.raises(FenceError):
        jobs.create("store", 1, fences=[Fence("host", 0, True)])
    with pytest.raises(FenceError):
        jobs.create("load", 1, fences=[Fence("host", 5, False), Fence("host", 0, False)])
    assert not jobs.is_fenced("host", 5)  # the refused job created nothing
    assert [j.id for j in jobs.in_flight()] == [writer.id]

    reader1 = jobs.create("load", 1, fences=[Fence("host", 1, False)])
    reader2 = jobs.create("load", 1, fences=[Fence("host", 1, False), Fence("gpu", 0, True)])  # other tier
    with pytest.raises(FenceError):
        jobs.create("store", 1, fences=[Fence("host", 1, True)])
    assert jobs.is_fenced("host", 0) and jobs.is_fenced("host", 1) and jobs.is_fenced("gpu", 0)
    assert not jobs.is_fenced("host", 2) and not jobs.is_fenced("disk", 0)

    jobs.report(reader1.id)
    assert jobs.is_fenced("host", 1)  # reader2 still reads it
    jobs.report(reader2.id)
    assert not jobs.is_fenced("host", 1) and not jobs.is_fenced("gpu", 0)
    jobs.create("store", 1, fences=[Fence("host", 1, True)])
    jobs.report(writer.id)
    assert not jobs.is_fenced("host", 0)
    jobs.create("store", 1, fences=[Fence("host", 0, True)])


def test_a_failed_job_drops_its_fences_too(jobs):
    job = jobs.create("store", 2, fences=[Fence("host", 4, True)])
    jobs.report(job.id, failed=[0, 1])
    assert job.state is JobState.FAILED
    assert not jobs.is_fenced("host", 4)


def test_flush_waits_for_the_jobs_on_those_slots(jobs):
    done = []
    slow = jobs.create("store", 1, fences=[Fence("host", 0, True)], on_done=lambda j: done.append(j.id))
    other = jobs.create("store", 1, fences=[Fence("host", 9, True)])
    thread = report_later(jobs, slow.id)
    jobs.flush("host", [0, 1], timeout=30)
    assert slow.state is JobState.DONE and done == [slow.id]  # callbacks ran before flush returned
    assert other.state is JobState.PENDING
    jobs.flush("host", [3])  # nothing there: returns at once
    thread.join()
    thread = report_later(jobs, other.id)
    jobs.flush("host", timeout=30)  # every slot of the tier
    assert other.state is JobState.DONE
    thread.join()


def test_flush_times_out_on_a_job_that_never_reports(jobs):
    job = jobs.create("store", 1, fences=[Fence("host", 2, True)])
    with pytest.raises(TimeoutError):
        jobs.flush("host", [2], timeout=0.05)
    assert jobs.is_fenced("host", 2)
    jobs.report(job.id)


def test_wait_times_out_and_then_returns_once_done(jobs):
    job = jobs.create("load", 1)
    with pytest.raises(TimeoutError, match=f"job {job.id}"):
        jobs.wait(job, timeout=0.05)
    thread = report_later(jobs, job.id)
    assert jobs.wait(job, timeout=30) is job
    assert job.state is JobState.DONE
    thread.join()


def test_drain_waits_for_every_job(jobs):
    created = [jobs.create("store", 1, fences=[Fence("host", i, True)]) for i in range(3)]
    threads = [report_later(jobs, job.id, failed=[0] if i == 1 else []) for i, job in enumerate(created)]
    jobs.drain(timeout=30)
    assert [j.state for j in created] == [JobState.DONE, JobState.FAILED, JobState.DONE]
    assert jobs.in_flight() == []
    for t in threads:
        t.join()


def test_drain_times_out(jobs):
    job = jobs.create("store", 1)
    with pytest.raises(TimeoutError):
        jobs.drain(timeout=0.05)
    jobs.report(job.id)
    jobs.drain(timeout=0)


def test_in_flight_lists_unfinished_jobs(jobs):
    a = jobs.create("store", 1)
    b = jobs.create("load", 1, expected_reports=2)
    assert {j.id for j in jobs.in_flight()} == {a.id, b.id}
    assert jobs.get(b.id) is b
    jobs.report(a.id)
    jobs.report(b.id)
    assert [j.id for j in jobs.in_flight()] == [b.id]
    jobs.report(b.id)
    assert jobs.in_flight() == []
