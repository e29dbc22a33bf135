"""One step's connector metadata for the workers, gathered as the scheduler side's hooks plan it, and
the fence over vLLM's GPU blocks that decides what the workers must finish first.

A part of its own because what the workers get each step is more than the plans of that step: loads
(run before the forward pass) come from lookups and allocations earlier in the step, and from split
loads whose first part every rank reported; stores and copies between tiers (run after it) from the
step's end and from plans finished by the workers' reports in between. And GPU blocks are fenced the
way vLLM's own offloading connector does it: a running request's blocks are held by vLLM, and a store
still reading blocks that vLLM hands out again (after a finish or a preemption) is flushed by the
workers before the forward pass; that needs to know, per GPU block, which jobs in flight read or write
it. Nothing here plans: the coordinator (``scheduler.py``) hands in the jobs it started.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvtier.connectors.vllm.geometry import GroupKeys
from kvtier.connectors.vllm.metadata import StepJobs, TransferJob
from kvtier.core.jobs import JobManager, WorkerReport


class StepMetadata:
    """The jobs the workers get at the end of this step (``take``), and the GPU blocks that jobs in
    flight read (stores) or write (loads), by vLLM block id."""

    def __init__(self, geometry: GroupKeys, jobs: JobManager, num_workers: int) -> None:
        self.geometry = geometry
        self.jobs = jobs
        self.num_workers = num_workers
        self.loads: list[TransferJob] = []
        self.stores: list[TransferJob] = []
        self.copies: list[TransferJob] = []  # demotions and copies to a keyed store: no GPU block
        self.allocated: set[int] = set()  # vLLM blocks allocated in this step
        self.gpu_readers: dict[int, set[int]] = {}  # GPU block id -> store jobs reading it
        self.gpu_loading: dict[int, int] = {}  # GPU block id -> the load job writing it
        self._staging: dict[int, TransferJob] = {}  # split loads whose second part waits for the first

    def allocate(self, block_ids: Iterable[Iterable[int]]) -> None:
        """vLLM allocated these blocks (per group; 0 is no block) in this step: stores still reading
        them are flushed."""
        self.allocated.update(b for ids in block_ids for b in ids if b)

    def add_load(self, transfer: TransferJob, split: bool) -> None:
        """A load into vLLM's blocks ``transfer.gpu_blocks``: shipped now, or with ``split`` only its
        staging into the ranks' shared host slab now and the rest once every rank reported that
        (``apply_reports``)."""
        for slot in transfer.gpu_blocks:
            self.gpu_loading[self.geometry.block_id(slot)] = transfer.job_id
        if split:
            self._staging[transfer.job_id] = transfer
            transfer = transfer.staging_part()
        self.loads.append(transfer)

    def add_store(self, transfer: TransferJob, gpu_slots: Iterable[int]) -> None:
        """A store reading vLLM's blocks at ``gpu_slots``, run after this step's forward pass."""
        for slot in gpu_slots:
            self.gpu_readers.setdefault(self.geometry.block_id(slot), set()).add(transfer.job_id)
        self.stores.append(transfer)

    def add_copy(self, transfer: TransferJob) -> None:
        """A copy between tiers (a demotion, a copy to a keyed store), run with the stores."""
        self.copies.append(transfer)

    def being_loaded(self, block_id: int) -> bool:
        """Whether a load in flight writes vLLM's block ``block_id`` (a tier holds its KV: no store)."""
        return block_id in self.gpu_loading

    def job_ended(self, job_id: int, gpu_slots: Iterable[int], reads: bool) -> None:
        """Job ``job_id`` no longer reads (``reads``: a store) or writes these GPU slots."""
        for block in map(self.geometry.block_id, gpu_slots):
            if reads:
                readers = self.gpu_readers[block]
                readers.discard(job_id)
                if not readers:
                    del self.gpu_readers[block]
            elif self.gpu_loading.get(block) == job_id:
                del self.gpu_loading[block]

    def apply_reports(self, report: WorkerReport) -> None:
        """A split load whose first part every rank has now reported (``report``, already applied to
        the job manager) ships its second part with the next step's loads."""
        for job_id in report.finished.keys() & self._staging.keys():
            job = self.jobs.get(job_id)
            if job.reports == self.num_workers:
                self.loads.append(self._staging.pop(job_id).loading_part(job.failed_blocks))

    def flush(self, preempted_jobs: set[int]) -> set[int]:
        """The jobs the workers finish before the forward pass: stores reading blocks vLLM allocated in
        this step, and the jobs of preempted requests (``preempted_jobs``) other than this step's loads."""
        flush = {job for block in self.allocated for job in self.gpu_readers.get(block, ())}
        if preempted_jobs:
            flush |= preempted_jobs - {t.job_id for t in self.loads}
        return flush

    def take(self, flush: set[int], idle: bool) -> StepJobs:
        """This step's jobs for the workers; the next step starts with none."""
        meta = StepJobs(self.loads, self.stores + self.copies, flush, idle=idle)
        self.loads, self.stores, self.copies, self.allocated = [], [], [], set()
        return meta

    def leaks(self) -> dict[str, dict]:
        """GPU fences still held (empty when kvtier is idle)."""
        return {"gpu_readers": dict(self.gpu_readers), "gpu_loading": dict(self.gpu_loading)}
