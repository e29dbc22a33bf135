"""What the scheduler-side connector tells the workers each step: the planner's plans, as jobs.

vLLM runs the scheduler side and the workers in different processes (one worker per tensor-parallel
rank); these objects, pickled once per step, are all that passes from one to the others (the workers
answer with a ``WorkerReport``, ``core/jobs.py``). Every copy names slots the scheduler chose, the
same on every rank, so the ranks need no coordination of their own: each rank holds its own shard of
every block in its own host slab and disk file.

Nothing here imports vLLM: the worker side runs, and is tested, without it. The classes vLLM itself
carries (``KVConnectorMetadata`` subclasses) wrap these in ``connector.py``.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field, replace

from kvtier.core.planner import ENGINE, Copy, Plan

GPU = ENGINE
"""Copies name vLLM's own KV blocks (addressed by block id) as the planner's caller endpoint."""

__all__ = ["GPU", "Copy", "StepJobs", "TransferJob"]


@dataclass(frozen=True)
class TransferJob:
    """One plan of the scheduler's planner, as a worker runs it: job ``job_id`` of the JobManager.

    ``stages`` run one after the other and the copies inside a stage at once: a block that failed in
    one stage is left out of the later ones (a staged disk load: disk -> host, then host -> GPU; a
    write-through store: GPU -> host, then host -> disk). ``gpu_blocks`` are the vLLM block ids a
    load writes, in job block order, so a failed block can be reported to vLLM for recomputation;
    ``missing`` are GPU blocks vLLM counted as hits that the scheduler could not plan (the block
    left the tier between lookup and allocation): they are reported failed at once. An ``in_step``
    load is one whose request vLLM computes in this very step: workers wait for it before the forward
    pass, report its failed blocks in this step and its request never as finished receiving.
    """

    job_id: int
    kind: str  # "load", "store" or "demote"
    num_blocks: int
    stages: tuple[tuple[Copy, ...], ...]
    req_id: str | None = None
    gpu_blocks: tuple[int, ...] = ()
    missing: tuple[int, ...] = ()
    in_step: bool = False

    @classmethod
    def of(
        cls,
        job_id: int,
        plan: Plan,
        req_id: str | None = None,
        gpu_blocks: tuple[int, ...] = (),
        missing: tuple[int, ...] = (),
        in_step: bool = False,
    ) -> TransferJob:
        """The job that runs ``plan`` (its copies; the fences and what to commit stay with the scheduler)."""
        return cls(job_id, plan.kind, plan.num_blocks, plan.stages, req_id, gpu_blocks, missing, in_step)

    def staging_part(self) -> TransferJob:
        """A staged load's copies into host memory alone, tied to no request: the first half of a load
        shipped in two steps (ranks that share one host slab, see ``loading_part``)."""
        return replace(self, stages=self.stages[:-1], req_id=None, gpu_blocks=(), missing=())

    def loading_part(self, lost: Collection[int]) -> TransferJob:
        """The second half: the last stage, into vLLM's blocks, shipped once every rank reported the
        first. Blocks ``lost`` in the first half are left out and reported failed like missing ones.
        The first stage stays, empty, so that a failure here is not taken for one in host memory."""
        alive = set(range(self.num_blocks)) - set(lost)
        last = tuple(part for copy in self.stages[-1] if (part := copy.only(alive)) is not None)
        return replace(self, stages=((), last), missing=self.missing + tuple(self.gpu_blocks[i] for i in sorted(lost)))


@dataclass
class StepJobs:
    """One step's work: ``loads`` start before the forward pass, ``stores`` (and demotions) after it,
    once the KV they read is computed. ``flush`` names jobs that still read GPU blocks vLLM hands out
    again in this step (or that belong to a preempted request): workers wait for them first. ``idle``:
    vLLM schedules no token this step, so its loop would come straight back (see ``WorkerSide.idle``)."""

    loads: list[TransferJob] = field(default_factory=list)
    stores: list[TransferJob] = field(default_factory=list)
    flush: set[int] = field(default_factory=set)
    idle: bool = False
