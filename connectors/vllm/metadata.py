"""What the scheduler-side connector tells the workers each step, and what the workers report back.

vLLM runs the scheduler side and the workers in different processes (one worker per tensor-parallel
rank); these objects, pickled once per step, are all that passes between them. Every copy names
slots the scheduler chose, the same on every rank, so the ranks need no coordination of their own:
each rank holds its own shard of every block in its own host slab and disk file.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvtier.core.jobs import WorkerReport

GPU = "gpu"
"""The name copies use for vLLM's own KV blocks (addressed by block id) instead of a tier name."""


@dataclass(frozen=True)
class Copy:
    """Blocks ``src_slots[i]`` of ``src`` to ``dst_slots[i]`` of ``dst``; ``blocks[i]`` is block i's
    index in its job (a failure is reported against that index), ``keys[i]`` its key (disk records it)."""

    src: str
    src_slots: tuple[int, ...]
    dst: str
    dst_slots: tuple[int, ...]
    keys: tuple[bytes, ...]
    blocks: tuple[int, ...]

    def only(self, blocks: set[int]) -> "Copy | None":
        """The part of this copy that moves the given job blocks (None when nothing is left)."""
        keep = [i for i, b in enumerate(self.blocks) if b in blocks]
        if not keep:
            return None
        pick = lambda xs: tuple(xs[i] for i in keep)  # noqa: E731
        return Copy(self.src, pick(self.src_slots), self.dst, pick(self.dst_slots), pick(self.keys),
                    pick(self.blocks))


@dataclass(frozen=True)
class TransferJob:
    """One job of the scheduler's JobManager, as a worker runs it.

    ``stages`` run one after the other and the copies inside a stage at once: a block that failed in
    one stage is left out of the later ones (a staged disk load: disk -> host, then host -> GPU; a
    write-through store: GPU -> host, then host -> disk). ``gpu_blocks`` are the vLLM block ids a
    load writes, in job block order, so a failed block can be reported to vLLM for recomputation;
    ``missing`` are GPU blocks vLLM counted as hits that the scheduler could not plan (the block
    left the tier between lookup and allocation): they are reported failed at once.
    """

    job_id: int
    kind: str  # "load", "store" or "demote"
    num_blocks: int
    stages: tuple[tuple[Copy, ...], ...]
    req_id: str | None = None
    gpu_blocks: tuple[int, ...] = ()
    missing: tuple[int, ...] = ()


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    """One step's work: ``loads`` start before the forward pass, ``stores`` (and demotions) after it,
    once the KV they read is computed. ``flush`` names jobs that still read GPU blocks vLLM hands out
    again in this step (or that belong to a preempted request): workers wait for them first."""

    loads: list[TransferJob] = field(default_factory=list)
    stores: list[TransferJob] = field(default_factory=list)
    flush: set[int] = field(default_factory=set)


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """Job completions from workers. vLLM merges the ranks' objects of one step with ``aggregate``;
    the scheduler's JobManager adds up steps, so a job ends once every rank has reported it."""

    report: WorkerReport = field(default_factory=WorkerReport)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KVTierWorkerMetadata":
        if not isinstance(other, KVTierWorkerMetadata):
            raise TypeError(f"cannot aggregate kvtier worker metadata with {type(other).__name__}")
        return KVTierWorkerMetadata(self.report.aggregate(other.report))
