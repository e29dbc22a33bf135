"""The worker side of the connector: one rank's tier memory and the copies between it and vLLM's KV.

Each rank (one process per GPU) keeps its own host slab and disk file, addressed by the slot ids the
scheduler side chose, and runs the copies the step's metadata names: loads before the forward pass,
stores after it (the KV they read is computed by then). GPU <-> host copies go through the CUDA
backend on CUDA devices (ordered after the compute stream current at submit) and the CPU backend
on CPU tensors; host <-> disk through the disk backend. Every job ends with a report, also on a rank
whose copies failed, so the scheduler's JobManager can count one report per rank.

Thread safety: copies complete on the transfer backends' threads; everything they touch here is
under ``_lock``, and vLLM's hooks run on the worker's main thread.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from kvtier.connectors.vllm.geometry import block_layout, kv_cache_storage
from kvtier.connectors.vllm.metadata import GPU, Copy, KVTierMetadata, KVTierWorkerMetadata, TransferJob
from kvtier.connectors.vllm.recovery import rank_directory
from kvtier.connectors.vllm.scheduler import tier_slots
from kvtier.connectors.vllm.stats import KVTierConnectorStats
from kvtier.core.config import StackConfig
from kvtier.core.errors import ClosedError, TransferError
from kvtier.core.jobs import WorkerReport
from kvtier.core.storage import BlockStorage
from kvtier.core.transfer import Transfer, TransferRegistry
from kvtier.tiers.disk import DiskSlab, FileStorage
from kvtier.tiers.host import HostSlab
from kvtier.transfers import backends_for

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

FLUSH_TIMEOUT_S = 300.0


class _RunningJob:
    """A job on this rank: which blocks failed so far (which of those a disk slot can never hold,
    which in the first stage), and when it stops reading vLLM's blocks."""

    def __init__(self, job: TransferJob) -> None:
        self.job = job
        self.failed: set[int] = set()
        self.refused: set[int] = set()
        self.first_stage_failed: set[int] = set()
        self.started = time.perf_counter()
        self.gpu_released = threading.Event()  # set once no later stage reads vLLM's KV blocks
        self.last_gpu_read = max((k for k, stage in enumerate(job.stages) if any(c.src == GPU for c in stage)),
                                 default=-1)


class WorkerSide:
    """One rank's host slab and disk file, its transfer backends, and the reports it owes the scheduler."""

    def __init__(self, config: StackConfig, kv_cache_config: "KVCacheConfig", rank: int, namespace: str) -> None:
        self.kv_cache_config = kv_cache_config
        self.transfer = config.transfer
        self.layout = block_layout(kv_cache_config)
        self.stats = KVTierConnectorStats()
        self._lock = threading.Lock()
        self._running: dict[int, _RunningJob] = {}
        self._report = WorkerReport()
        self._finished_loads: set[str] = set()
        self._load_errors: set[int] = set()
        self._reported_errors: set[int] = set()
        self._refused_keys: set[bytes] = set()  # named by a disk slab (too large compressed), until their copy ends
        self.storages: dict[str, BlockStorage] = {}
        self.transfers = TransferRegistry([])  # the backends come once vLLM's KV caches name their device
        try:
            slots = {name: n for name, _, n in tier_slots(config, self.layout.block_bytes)}
            for i, tier_cfg in enumerate(config.tiers):
                name = config.tier_name(i)
                if tier_cfg.medium == "host":
                    self.storages[name] = HostSlab(slots[name], self.layout).storage
                elif tier_cfg.medium == "disk":
                    # One directory per rank: each rank holds its own shard of every block.
                    slab = DiskSlab(rank_directory(tier_cfg.path, rank), slots[name], self.layout, namespace,
                                    tier_cfg.o_direct, tier_cfg.compression, tier_cfg.slot_bytes,
                                    shared_directory=tier_cfg.shared_directory, reinitialise=tier_cfg.reinitialise)
                    # Marks every old header without touching it: the blocks the scheduler side kept
                    # (recovery.py) stay readable, and any slot is cleared before new bytes land in it.
                    slab.scan()
                    slab.refuse = self._note_refused
                    self.storages[name] = FileStorage(slab, self.layout)
        except BaseException:
            self.shutdown()
            raise

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Address vLLM's KV blocks and start the transfer backends this rank's storages need (on CUDA,
        copies are ordered after vLLM's compute stream current at each submit); refuses a device no
        transfer backend reaches from host memory."""
        gpu = kv_cache_storage(kv_caches, self.kv_cache_config)
        devices = {gpu.device, *(storage.device for storage in self.storages.values())}
        self.transfers = TransferRegistry(backends_for(self.transfer, devices))
        for src, dst in ((gpu.device, "cpu"), ("cpu", gpu.device)):
            self.transfers.backend(src, dst, "between vLLM's KV cache and host memory")
        self.storages[GPU] = gpu

    # --- running jobs --------------------------------------------------------------------------

    def flush(self, meta: KVTierMetadata) -> None:
        """Wait until the named jobs no longer read vLLM's blocks (vLLM reuses them this step)."""
        for job_id in meta.flush:
            with self._lock:
                running = self._running.get(job_id)
            if running is not None and not running.gpu_released.wait(FLUSH_TIMEOUT_S):
                raise TransferError(f"kvtier job {job_id} still reads KV blocks vLLM reuses after {FLUSH_TIMEOUT_S} s")

    def start(self, jobs: list[TransferJob]) -> None:
        for job in jobs:
            running = _RunningJob(job)
            with self._lock:
                self._running[job.job_id] = running
            self._run_stage(running, 0)

    def _run_stage(self, running: _RunningJob, k: int) -> None:
        """Start stage ``k`` (skipping stages whose blocks all failed); finish the job after the last."""
        job = running.job
        copies: list[Copy] = []
        while k < len(job.stages):
            alive = set(range(job.num_blocks)) - running.failed
            copies = [part for c in job.stages[k] if (part := c.only(alive)) is not None]
            if copies:
                break
            k += 1
        if k > running.last_gpu_read:
            running.gpu_released.set()
        if k >= len(job.stages):
            self._finish(running)
            return
        pending = [len(copies)]
        lock = threading.Lock()

        def copied(copy: Copy, lost: set[int]) -> None:
            refused = self._take_refused([copy.keys[j] for j in lost])
            with lock:
                running.failed.update(copy.blocks[j] for j in lost)
                running.refused.update(copy.blocks[j] for j in lost if copy.keys[j] in refused)
                if k == 0:
                    running.first_stage_failed.update(copy.blocks[j] for j in lost)
                pending[0] -= 1
                last = pending[0] == 0
            if last:
                self._run_stage(running, k + 1)

        for copy in copies:
            self._submit(copy, lambda lost, c=copy: copied(c, lost))

    def _submit(self, copy: Copy, on_complete: Callable[[set[int]], None]) -> None:
        """Hand one copy to the backend for its two sides' devices; a copy that cannot start fails whole."""
        try:
            transfer = Transfer(self.storages[copy.src], copy.src_slots, self.storages[copy.dst], copy.dst_slots,
                                copy.keys)
            self.transfers.submit(transfer, on_complete)
        except (TransferError, ClosedError, KeyError):
            on_complete(set(range(len(copy.blocks))))

    def _note_refused(self, keys: list[bytes]) -> None:
        """The disk slab's ``refuse`` hook: these blocks' compressed bytes can never fit a slot. The
        scheduler side learns it from the job's report and drops the host copy instead of offering
        it to the disk again at every eviction."""
        with self._lock:
            self._refused_keys.update(keys)

    def _take_refused(self, keys: list[bytes]) -> set[bytes]:
        """Which of a finished copy's failed keys were refused; forgets them."""
        with self._lock:
            refused = self._refused_keys.intersection(keys)
            self._refused_keys -= refused
            return refused

    def _finish(self, running: _RunningJob) -> None:
        job = running.job
        seconds = time.perf_counter() - running.started
        with self._lock:
            self._running.pop(job.job_id, None)
            self._report.add(job.job_id, running.failed - running.refused, running.refused, running.first_stage_failed)
            if job.kind in ("load", "store"):
                moved = sum(len(c.blocks) for stage in job.stages for c in stage if GPU in (c.src, c.dst))
                self.stats.record_transfer(job.kind, (moved - len(running.failed)) * self.layout.block_bytes, seconds)
            if job.kind == "load":
                self._finished_loads.add(job.req_id)
                self._load_errors |= {job.gpu_blocks[i] for i in running.failed} | set(job.missing)

    # --- what vLLM collects after the step -----------------------------------------------------

    def take_finished_loads(self) -> set[str]:
        """Requests whose load ended on this rank since the last call; their failed GPU blocks are
        handed out by the next ``take_load_errors``, so vLLM sees them no later than the request."""
        with self._lock:
            done, self._finished_loads = self._finished_loads, set()
            self._reported_errors |= self._load_errors
            self._load_errors = set()
            return done

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._reported_errors = self._reported_errors, set()
            return errors

    def take_report(self) -> KVTierWorkerMetadata | None:
        with self._lock:
            if not self._report.finished:
                return None
            report, self._report = self._report, WorkerReport()
            return KVTierWorkerMetadata(report)

    def take_stats(self) -> KVTierConnectorStats | None:
        with self._lock:
            if self.stats.is_empty():
                return None
            stats, self.stats = self.stats, KVTierConnectorStats()
            return stats

    def in_flight(self) -> int:
        with self._lock:
            return len(self._running)

    def shutdown(self, timeout: float = 60.0) -> None:
        """Wait for copies in flight, then release the slabs and the backends."""
        deadline = time.monotonic() + timeout
        while self.in_flight() and time.monotonic() < deadline:
            time.sleep(0.01)
        self.transfers.close()
        for name, storage in list(self.storages.items()):
            if name != GPU:
                storage.close()
        self.storages.clear()
