"""The worker side of the connector: one rank's tier memory and the copies between it and vLLM's KV.

Each rank (one process per GPU) keeps its own host slab and disk file, addressed by the slot ids the
scheduler side chose, and runs the copies the step's metadata names: loads before the forward pass,
stores after it (the KV they read is computed by then). GPU <-> host copies go through the CUDA
backend on CUDA devices (ordered after the compute stream current at submit) and the CPU backend
on CPU tensors; host <-> disk through the disk backend; host <-> a remote store through the remote
backend, with this rank's records (``RecordFormat`` of this rank) and clients of its own. vLLM's
blocks of every KV cache group kvtier serves are one storage (``geometry.kv_cache_storage``).

With MLA on several ranks the KV is the same on every rank, so the tiers hold one copy for all of
them: one host slab in shared memory, rank 0's disk slab, one remote record per block. Rank 0 alone
moves blocks out of vLLM's KV and between tiers; every rank copies into its own KV from the shared
slab, which the scheduler side asks for only once every rank has reported the staging into it (a
staged load comes in two parts). Other ranks thus never write shared memory: a rank writing what it
read from a store could change bytes another rank already checked and is copying. Every job
ends with a report, also on a rank whose copies failed, so the scheduler's JobManager can count one
report per rank; a job whose store call outlived its deadline reports again, at a later step, once
that call can no longer touch the host slots it was given (``WorkerReport.lift``).

Each job is a plan of the scheduler's planner (``core/planner.py``); its stages run through the same
loop as the in-process stack's (``core/stages.py``). Nothing here imports vLLM: the connector in
``connector.py`` hands the hooks' metadata over and wraps what comes back.

Thread safety: copies complete on the transfer backends' threads; everything they touch here is
under ``_lock``, and vLLM's hooks run on the worker's main thread.
"""

from __future__ import annotations

import functools
import hashlib
import threading
import time
from typing import TYPE_CHECKING, Any

from kvtier.connectors.vllm.geometry import (
    block_layout,
    kv_cache_storage,
    replicated,
    served_groups,
    tier_slots,
)
from kvtier.connectors.vllm.metadata import GPU, Copy, StepJobs, TransferJob
from kvtier.core.config import StackConfig
from kvtier.core.devices import HOST_DEVICE
from kvtier.core.errors import TransferError
from kvtier.core.jobs import WorkerReport
from kvtier.core.media import RankRequest, medium
from kvtier.core.stages import StagedRun
from kvtier.core.storage import BlockStorage
from kvtier.core.tier_config import TierConfigBase
from kvtier.core.transfer import CopiesHere, TransferRegistry
from kvtier.transfers import backends_for

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

FLUSH_TIMEOUT_S = 300.0
IDLE_WAIT_S = 0.005
"""How long a step in which vLLM computes nothing may wait for an asynchronous load to end
(``WorkerSide.idle``): one switch interval of Python's, what a hand-off to a kvtier thread could
otherwise wait each time; a request arriving meanwhile waits at most this long for its first step."""


def shared_slab_name(engine_id: str, namespace: str) -> str:
    """The /dev/shm name of the host slab an engine's ranks share: the engine and its namespace, hashed
    (an engine id is the user's to choose; a name must be short and plain)."""
    return "kvtier-" + hashlib.blake2b(f"{engine_id}\0{namespace}".encode(), digest_size=12).hexdigest()


class _RunningJob:
    """A job on this rank: its run of copies, when it started, when it stops reading vLLM's blocks, and
    when it is over."""

    def __init__(self, job: TransferJob) -> None:
        self.job = job
        self.started = time.perf_counter()
        self.gpu_released = threading.Event()  # set once no later stage reads vLLM's KV blocks
        self.finished = threading.Event()  # set once its result is recorded
        self.last_gpu_read = max(
            (k for k, stage in enumerate(job.stages) if any(c.src.tier == GPU for c in stage)), default=-1
        )

    def stage_starts(self, k: int) -> None:
        """Stages from ``k`` on run now: past the last one reading vLLM's blocks, those may be reused."""
        if k > self.last_gpu_read:
            self.gpu_released.set()


class WorkerSide:
    """One rank's host slab and disk file, its transfer backends, and the reports it owes the scheduler."""

    def __init__(
        self,
        config: StackConfig,
        kv_cache_config: KVCacheConfig,
        rank: int,
        namespace: str,
        ranks: int = 1,
        engine_id: str = "",
    ) -> None:
        """``rank`` of ``ranks`` workers of the engine ``engine_id`` (the ranks of one engine share a host
        slab where their KV is the same: MLA)."""
        self.kv_cache_config = kv_cache_config
        self.transfer = config.transfer
        self.held_tiers: list[TierConfigBase] = []  # the tiers this rank holds a storage of: their backends
        self.layout = block_layout(kv_cache_config)
        # With several KV cache groups a failed load fails its request (vLLM takes no block ids then).
        self.per_request_errors = len(served_groups(kv_cache_config)) > 1
        # Replicated KV (MLA): one remote record per block; on several ranks one copy in every tier,
        # which rank 0 alone moves there.
        same_kv = replicated(kv_cache_config)
        shared_name = shared_slab_name(engine_id, namespace) if same_kv and ranks > 1 else None
        self.into_gpu_only = shared_name is not None and rank > 0
        self._counts: dict[str, float] = {}  # "load_bytes", "store_seconds", "skipped_existing", ...: see stats.py
        self._lock = threading.Lock()
        self._load_ended = threading.Condition(self._lock)  # notified when an asynchronous load ends
        self._running: dict[int, _RunningJob] = {}
        self._report = WorkerReport()
        self._finished_loads: set[str] = set()
        self._failed_loads: set[str] = set()
        self._load_errors: set[int] = set()
        self._reported_errors: set[int] = set()
        self._refused_keys: set[bytes] = set()  # named by a disk slab (too large compressed), until their copy ends
        self.storages: dict[str | None, BlockStorage] = {}  # by tier name, vLLM's own blocks under GPU
        self.in_step_copies: TransferRegistry | CopiesHere | None = None  # where in-step loads' copies run
        self.transfers = TransferRegistry([])  # the backends come once vLLM's KV caches name their device
        try:
            slots = {name: n for name, _, n in tier_slots(config, self.layout.block_bytes)}
            for i, tier_cfg in enumerate(config.tiers):
                name, entry = config.tier_name(i), medium(tier_cfg.medium)
                if entry.rank_storage is None or (self.into_gpu_only and not entry.one_copy_for_ranks):
                    continue  # the engine's own memory; or rank 0 holds the one copy there
                request = RankRequest(
                    tier_cfg,
                    slots.get(name, 0),
                    self.layout,
                    namespace,
                    rank,
                    ranks,
                    same_kv,
                    config.header_room,
                    shared_name,
                    self._note_refused,
                    self._count_storage,
                )
                self.storages[name] = entry.rank_storage(request)
                self.held_tiers.append(tier_cfg)
        except BaseException:
            self.shutdown()
            raise

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Address vLLM's KV blocks and start the transfer backends this rank's storages need (on CUDA,
        copies are ordered after vLLM's compute stream current at each submit); refuses a device no
        transfer backend reaches from host memory."""
        gpu = kv_cache_storage(kv_caches, self.kv_cache_config)
        devices = {gpu.device, *(storage.device for storage in self.storages.values())}
        self.transfers = TransferRegistry(backends_for(self.transfer, devices, self.held_tiers))
        for src, dst in ((gpu.device, HOST_DEVICE), (HOST_DEVICE, gpu.device)):
            self.transfers.backend(src, dst, "between vLLM's KV cache and host memory")
        self.storages[GPU] = gpu
        # An in-step load into vLLM's KV cache in CPU memory runs its copies on vLLM's own thread, which
        # would otherwise only wait for them in ``start_load_kv``: on a pool thread every copy costs
        # hand-offs, and copies that keep the GIL (small ones do, see ``kvtier.transfers.cpu``) stall vLLM's
        # thread whenever it needs the GIL while they run; waiting per layer in ``wait_for_layer_load`` to
        # overlap them with the forward pass made that worse. Measured with ``bench/ttft.py --prefix-blocks
        # 64`` (an 8,192-token prefix, 24 MiB of KV, 2-core AMD EPYC): vLLM's own prefix cache 106.0 ms,
        # copies here 106.7 ms; on the pool, waited per layer, 114.9 ms (its run's cache 101.5 ms). A GPU's
        # copies go to their backend as usual, and are waited for whole.
        self.in_step_copies = CopiesHere(self.transfers) if gpu.device == HOST_DEVICE else self.transfers

    # --- running jobs --------------------------------------------------------------------------

    def flush(self, step: StepJobs) -> None:
        """Wait until the named jobs no longer read vLLM's blocks (vLLM reuses them this step)."""
        for job_id in step.flush:
            with self._lock:
                running = self._running.get(job_id)
            if running is not None and not running.gpu_released.wait(FLUSH_TIMEOUT_S):
                raise TransferError(f"kvtier job {job_id} still reads KV blocks vLLM reuses after {FLUSH_TIMEOUT_S} s")

    def start(self, jobs: list[TransferJob]) -> None:
        """Start the jobs. Returns once the ``in_step`` loads have arrived: vLLM's forward pass reads
        them, and their failed blocks are reported in this step (see ``CopiesHere`` for where their
        copies run)."""
        in_step = []
        for job in jobs:
            running = _RunningJob(job)
            with self._lock:
                self._running[job.job_id] = running
            transfers = self.in_step_copies if job.in_step and self.in_step_copies is not None else self.transfers
            StagedRun(
                self._stages(job),
                job.num_blocks,
                self.storages,
                transfers,
                functools.partial(self._finish, running),
                self._take_refused,
                running.stage_starts,
            ).start()
            if job.in_step:
                in_step.append(running)
        for running in in_step:
            if not running.finished.wait(FLUSH_TIMEOUT_S):
                raise TransferError(f"kvtier load {running.job.job_id} did not arrive in {FLUSH_TIMEOUT_S} s")

    def _stages(self, job: TransferJob) -> tuple[tuple[Copy, ...], ...]:
        """The copies of a job this rank makes: all of them, but where rank 0 moves the one copy of
        replicated KV, only those into vLLM's blocks (rank 0's report vouches for the others)."""
        if not self.into_gpu_only:
            return job.stages
        return tuple(tuple(c for c in stage if c.dst.tier == GPU) for stage in job.stages)

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

    def _finish(self, running: _RunningJob, run: StagedRun) -> None:
        job = running.job
        seconds = time.perf_counter() - running.started
        with self._lock:
            self._running.pop(job.job_id, None)
            self._report = self._report.aggregate(run.report(job.job_id))
            if job.kind in ("load", "store"):
                moved = sum(
                    len(c.blocks) for stage in self._stages(job) for c in stage if GPU in (c.src.tier, c.dst.tier)
                )  # (the copies this rank made)
                self._count(job.kind, (moved - len(run.failed)) * self.layout.block_bytes, seconds)
            if job.kind == "load" and job.req_id is not None:
                errors = {job.gpu_blocks[i] for i in run.failed} | set(job.missing)
                if not job.in_step:  # (vLLM waits for no word of a load it computes the request after)
                    self._finished_loads.add(job.req_id)
                if errors and self.per_request_errors:
                    self._failed_loads.add(job.req_id)
                else:
                    self._load_errors |= errors
            if job.kind == "load" and not job.in_step:
                self._load_ended.notify_all()
        running.finished.set()
        if run.quarantined:
            run.when_lifted(functools.partial(self._lifted, job.job_id))

    def _lifted(self, job_id: int) -> None:
        """The quarantine of a finished job is over: said in the next report."""
        with self._lock:
            self._report.lift(job_id)

    def _count(self, direction: str, nbytes: int, seconds: float) -> None:
        """Bytes and seconds per direction: "load" (into vLLM's blocks) or "store" (out of them)."""
        for name, value in ((f"{direction}_bytes", nbytes), (f"{direction}_seconds", seconds)):
            self._counts[name] = self._counts.get(name, 0) + value

    def _count_storage(self, **counts: int) -> None:
        """The storages' ``count`` hook (``RankRequest.count``), on a transfer backend's thread: what a
        tier would count, such as the records a remote store held already (``skipped_existing``), goes
        into this rank's stats."""
        with self._lock:
            for name, value in counts.items():
                self._counts[name] = self._counts.get(name, 0) + value

    # --- what vLLM collects after the step -----------------------------------------------------

    def idle(self) -> None:
        """A step in which vLLM computes nothing: wait up to ``IDLE_WAIT_S`` for one of this rank's
        asynchronous loads to end, rather than return to vLLM's loop at once. That loop would come
        straight back, holding the GIL in Python while requests wait for their loads, and every
        thread of kvtier that moves those loads would wait up to Python's switch interval (5 ms)
        for the GIL, at each hand-off. Waiting here releases it."""
        with self._load_ended:
            if self._finished_loads or not any(
                r.job.kind == "load" and not r.job.in_step for r in self._running.values()
            ):
                return
            self._load_ended.wait(IDLE_WAIT_S)

    def take_finished_loads(self) -> tuple[set[str], set[str]]:
        """Requests whose load ended on this rank since the last call, and those of them whose load
        failed as a whole (several KV cache groups); failed GPU blocks (one group) are handed out by the
        next ``take_load_errors``, so vLLM sees them no later than the request."""
        with self._lock:
            done, self._finished_loads = self._finished_loads, set()
            failed, self._failed_loads = self._failed_loads, set()
            self._reported_errors |= self._load_errors
            self._load_errors = set()
            return done, failed

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._reported_errors = self._reported_errors, set()
            return errors

    def take_report(self) -> WorkerReport | None:
        """The job completions and lifted quarantines of this rank since the last call (None when there
        are none)."""
        with self._lock:
            if not (self._report.finished or self._report.lifted):
                return None
            report, self._report = self._report, WorkerReport()
            return report

    def take_stats(self) -> dict[str, float] | None:
        """Bytes and seconds moved per direction, and what the storages counted, since the last call
        (None when nothing was counted)."""
        with self._lock:
            if not self._counts:
                return None
            counts, self._counts = self._counts, {}
            return counts

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
