"""The worker side on vLLM 0.33's KV layout (per-layer views of one flat buffer, allocated by vLLM's
own ``allocate_kv_cache`` on CPU): bytes written into "GPU" blocks come back bit-exact after store,
eviction and a load into other block ids, through host memory and through disk; the fence waits for
copies still reading blocks vLLM reuses; failed copies are reported block by block."""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
import pytest

from helpers.vllm_harness import LAYERS
from kvtier.connectors.vllm import worker as worker_module
from kvtier.connectors.vllm.connector import KVTierWorkerMetadata
from kvtier.connectors.vllm.metadata import GPU, StepJobs, TransferJob
from kvtier.core.errors import ConfigError
from kvtier.core.jobs import JobManager, WorkerReport
from kvtier.core.planner import Copy, copy_of
from kvtier.core.transfer import TransferRegistry
from kvtier.transfers.cpu import CPUBackend

HOST = {"tiers": [{"medium": "host", "capacity_blocks": 8}]}


def with_disk(tmp_path) -> dict:
    return {
        "tiers": [
            {"medium": "host", "capacity_blocks": 8},
            {"medium": "disk", "capacity_blocks": 8, "path": str(tmp_path / "disk")},
        ]
    }


def job(job_id: int, kind: str, *stages: Copy, req_id: str | None = None, gpu_blocks=(), missing=()) -> TransferJob:
    """A job as the scheduler side would plan it: stages of copies over job blocks 0..n-1."""
    num = max((b for stage in stages for c in stage for b in c.blocks), default=0) + 1
    return TransferJob(job_id, kind, num, tuple(stages), req_id, tuple(gpu_blocks), tuple(missing))


def copy(src: str | None, src_slots, dst: str | None, dst_slots) -> Copy:
    """Job block i moves from ``src_slots[i]`` to ``dst_slots[i]`` under key ``bytes([i]) * 16`` (disk
    slot headers record it, and a load checks it)."""
    pairs = zip(src_slots, dst_slots, strict=True)
    return copy_of(src, dst, [(i, bytes([i]) * 16, s, d) for i, (s, d) in enumerate(pairs)])


def run(worker, loads=(), stores=(), flush=()) -> None:
    """One step's worker hooks, as vLLM's model runner calls them."""
    meta = StepJobs(list(loads), list(stores), set(flush))
    c = worker.connector
    c.handle_preemptions(meta)
    c.bind_connector_metadata(meta)
    c.start_load_kv(None)
    c.wait_for_save()
    worker.wait_idle()
    c.clear_connector_metadata()


def fill(worker, block_ids, seed: int) -> list[np.ndarray]:
    """Random bytes into every layer's page of each block; returns them, block by block."""
    rng = np.random.default_rng(seed)
    out = []
    for b in block_ids:
        pages = [rng.integers(0, 256, worker.page, dtype=np.uint8) for _ in range(2)]
        for layer, page in zip(LAYERS, pages, strict=True):
            worker.page_view(b, layer)[:] = page
        out.append(np.concatenate(pages))
    return out


def read(worker, block_ids) -> list[np.ndarray]:
    return [np.concatenate([worker.page_view(b, layer).copy() for layer in LAYERS]) for b in block_ids]


def host_slab(worker) -> np.ndarray:
    storage = worker.connector.worker_side.storages["host"]
    base = int(storage.fragment_addresses([0])[0, 0])
    nbytes = storage.num_slots * storage.layout.block_bytes
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(base))


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLHNC"])
def test_round_trip_through_host_into_other_blocks(make_worker, layout):
    worker = make_worker(HOST, layout=layout)
    original = fill(worker, [3, 7, 8], seed=1)
    run(worker, stores=[job(1, "store", (copy(GPU, [3, 7, 8], "host", [5, 0, 1]),))])
    fill(worker, range(32), seed=2)  # vLLM reuses every block for other requests
    run(
        worker,
        loads=[job(2, "load", (copy("host", [0, 5, 1], GPU, [20, 11, 12]),), req_id="r", gpu_blocks=(20, 11, 12))],
    )
    assert all(np.array_equal(a, b) for a, b in zip(read(worker, [11, 20, 12]), original, strict=True))
    results = worker.connector.get_transfer_results(set())
    assert results.finished_recving == {"r"} and not results.failed_recving
    assert worker.connector.get_block_ids_with_load_errors() == set()
    report = worker.connector.build_connector_worker_meta().report
    assert report == WorkerReport({1: 1, 2: 1}, {})


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
def test_round_trip_through_disk_after_host_eviction(make_worker, tmp_path, layout):
    worker = make_worker(with_disk(tmp_path), layout=layout)
    original = fill(worker, [2, 4], seed=3)
    run(worker, stores=[job(1, "store", (copy(GPU, [2, 4], "host", [0, 1]),), (copy("host", [0, 1], "disk", [6, 3]),))])
    host_slab(worker)[:] = 0  # the host copies are gone (evicted and overwritten)
    fill(worker, range(32), seed=4)
    run(
        worker,
        loads=[
            job(
                2,
                "load",
                (copy("disk", [6, 3], "host", [4, 5]),),
                (copy("host", [4, 5], GPU, [30, 9]),),
                req_id="r",
                gpu_blocks=(30, 9),
            )
        ],
    )
    assert all(np.array_equal(a, b) for a, b in zip(read(worker, [30, 9]), original, strict=True))
    assert worker.connector.get_transfer_results(set()).finished_recving == {"r"}
    assert worker.connector.get_block_ids_with_load_errors() == set()


class GatedCPUBackend(CPUBackend):
    """A CPU copy engine whose copies wait for a gate: a copy still running when vLLM reuses blocks."""

    def __init__(self) -> None:
        super().__init__(threads=1)
        self.gate = threading.Event()

    def _copy(self, copies, lo, hi):
        assert self.gate.wait(10)
        super()._copy(copies, lo, hi)


def test_flush_waits_until_stores_stop_reading_reused_blocks(make_worker):
    worker = make_worker(HOST)
    side = worker.connector.worker_side
    gated = GatedCPUBackend()
    side.transfers, plain = TransferRegistry([gated]), side.transfers
    original = fill(worker, [5], seed=5)
    meta = StepJobs([], [job(1, "store", (copy(GPU, [5], "host", [2]),))], set())
    worker.connector.bind_connector_metadata(meta)
    worker.connector.wait_for_save()  # the store starts and blocks on the gate
    flushed = threading.Event()
    flusher = threading.Thread(target=lambda: (worker.connector.handle_preemptions(StepJobs(flush={1})), flushed.set()))
    flusher.start()
    assert not flushed.wait(0.2)  # the next step may not reuse block 5 yet
    gated.gate.set()
    assert flushed.wait(5)
    flusher.join()
    fill(worker, [5], seed=6)  # now vLLM overwrites the block
    worker.wait_idle()
    slot = host_slab(worker)[2 * side.layout.block_bytes : 3 * side.layout.block_bytes]
    assert np.array_equal(slot, original[0])
    plain.close()


@pytest.mark.parametrize("idle", [True, False])
def test_a_step_that_computes_nothing_waits_for_a_load_in_flight(make_worker, monkeypatch, idle):
    """In a step where vLLM schedules no token the worker waits (bounded) for an asynchronous load
    rather than return to vLLM's loop at once, and a load that ends meanwhile is reported in that very
    step; a step that computes something returns at once."""
    monkeypatch.setattr(worker_module, "IDLE_WAIT_S", 5.0)
    worker = make_worker(HOST)
    side = worker.connector.worker_side
    original = fill(worker, [5], seed=5)
    run(worker, stores=[job(1, "store", (copy(GPU, [5], "host", [2]),))])
    gated = GatedCPUBackend()
    side.transfers, plain = TransferRegistry([gated]), side.transfers
    c = worker.connector
    c.bind_connector_metadata(
        StepJobs([job(2, "load", (copy("host", [2], GPU, [6]),), req_id="r", gpu_blocks=[6])], [], set(), idle=idle)
    )
    c.start_load_kv(None)
    c.wait_for_save()
    threading.Timer(0.05, gated.gate.set).start()
    start = time.monotonic()
    finished = c.get_transfer_results(set()).finished_recving
    waited = time.monotonic() - start
    c.clear_connector_metadata()
    if idle:
        assert finished == {"r"} and 0.04 < waited < 4
    else:
        assert not finished and waited < 0.04
    worker.wait_idle()
    assert np.array_equal(read(worker, [6])[0], original[0])
    plain.close()


class FailingCPUBackend(CPUBackend):
    """Copies whose destination lies in one page fail (an unreadable source, a failed DMA)."""

    def __init__(self, bad: tuple[int, int]) -> None:
        super().__init__(threads=1)
        self.bad = bad

    def _copy(self, copies, lo, hi):
        for d in copies.dst[lo:hi].tolist():
            if self.bad[0] <= d < self.bad[1]:
                raise OSError("injected copy failure")
        super()._copy(copies, lo, hi)


def test_failed_and_missing_blocks_are_reported_as_load_errors(make_worker):
    worker = make_worker(HOST)
    side = worker.connector.worker_side
    fill(worker, [1, 2, 3], seed=7)
    run(worker, stores=[job(1, "store", (copy(GPU, [1, 2, 3], "host", [0, 1, 2]),))])
    worker.connector.build_connector_worker_meta()
    bad = int(side.storages[GPU].fragment_addresses([14])[0, 0])
    side.transfers, plain = TransferRegistry([FailingCPUBackend((bad, bad + worker.page))]), side.transfers
    run(
        worker,
        loads=[
            job(
                2,
                "load",
                (copy("host", [0, 1, 2], GPU, [13, 14, 15]),),
                req_id="r",
                gpu_blocks=(13, 14, 15),
                missing=(16,),
            )
        ],
    )
    results = worker.connector.get_transfer_results(set())
    # a failed load still finishes; with one KV cache group its failed blocks are named, not the request
    assert results.finished_recving == {"r"} and not results.failed_recving
    assert worker.connector.get_block_ids_with_load_errors() == {14, 16}
    assert worker.connector.get_block_ids_with_load_errors() == set()  # reported once
    assert worker.connector.build_connector_worker_meta().report == WorkerReport(
        {2: 1}, {2: frozenset({1})}, first_stage_failed={2: frozenset({1})}
    )  # its only stage is its first
    plain.close()


def test_two_ranks_reports_add_up_across_steps(make_worker, tmp_path):
    """Each rank runs the same job on its own memory and reports it; merged per step by vLLM and
    summed across steps by the JobManager, the job ends only when both ranks have reported."""
    ranks = [make_worker(with_disk(tmp_path), rank=r, tp=2) for r in (0, 1)]
    assert {str(w.connector.worker_side.storages["disk"].slab.dir.name) for w in ranks} == {"rank0", "rank1"}
    jobs = JobManager()
    store = jobs.create("store", 2, expected_reports=2)
    for seed, worker in enumerate(ranks):
        fill(worker, [4, 5], seed=10 + seed)
        run(worker, stores=[job(store.id, "store", (copy(GPU, [4, 5], "host", [0, 1]),))])
    step1 = ranks[0].connector.build_connector_worker_meta()  # rank 1 reports a step later
    jobs.apply(step1.report)
    assert not store.state.final
    step2 = ranks[1].connector.build_connector_worker_meta().aggregate(KVTierWorkerMetadata())
    jobs.apply(step2.report)
    assert store.state.value == "done"
    with pytest.raises(TypeError):
        step1.aggregate(object())


def test_layout_without_contiguous_pages_is_refused(make_worker):
    with pytest.raises(ConfigError, match="LHBNC"):
        make_worker(HOST, layout="LHBNC")


class GatedBackend(CPUBackend):
    """Copies of the second layer wait for ``gate`` (the other layers copy at once)."""

    def __init__(self, page_address_of_layer_1: set[int], gate: threading.Event) -> None:
        super().__init__(2)
        self.second_layer = page_address_of_layer_1
        self.gate = gate

    def _copy(self, copies, lo: int, hi: int) -> None:
        if set(copies.dst[lo:hi].tolist()) & self.second_layer:
            assert self.gate.wait(10)
        super()._copy(copies, lo, hi)
