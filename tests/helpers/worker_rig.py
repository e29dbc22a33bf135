"""kvtier's vLLM worker side on a KV cache laid out as vLLM 0.33 lays it out, on any torch device, and the
test bodies that run on it: tests/gpu runs them on CUDA, tests/connectors/vllm on CPU tensors, so the
logic a GPU machine checks once is proven on every machine first.

A ``Rank`` is what one vLLM worker process holds: one flat KV buffer with a bf16 view per layer (the
logical [B, H, N, C] of vLLM's ``KVCacheLayout``, strided as the layout orders it), a ``kv_cache_config``
stand-in read by field (vLLM is not importable where these run), a compute stream of its own on CUDA,
and a ``WorkerSide`` over a host slab and a disk slab, fed ``TransferJob`` metadata as the scheduler side
plans it. Bytes are checked over the whole buffer: every loaded block's every page, and the poison
(0xFF) everywhere else, so a copy into the wrong block shows as well as a wrong byte.

On CUDA, the KV and the poison are written by kernels queued behind a chain of large matrix products
on the compute stream, and the jobs start with nothing synchronized: a copy not ordered after that
stream would read or be overwritten by bytes not yet computed. On CPU the streams are no-ops.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import torch

from kvtier.connectors.vllm.metadata import GPU, Copy, TransferJob
from kvtier.connectors.vllm.worker import WorkerSide
from kvtier.core.config import load_config
from kvtier.core.jobs import JobManager, WorkerReport
from kvtier.core.planner import copy_of, numbered

LAYOUTS = ("LBNHC", "LBHNC", "BLHNC")
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn", "model.layers.2.self_attn.attn")
NUM_BLOCKS = 32
TOKENS = 16  # N: tokens per block
HEADS, CONTENT = 2, 128  # H x C: two KV heads, K and V of 64 bf16 dims each
LATENT = 288  # MLA: one latent vector per token (H = 1), bf16
SLOTS = 16  # host and disk slots of each rank
SETTLE_S = 60.0
"""How long a rank's jobs may take to end before the test fails (never a hang)."""


class FullAttentionSpec(SimpleNamespace):
    """Named as vLLM's spec: the geometry tells a spec's kind by the names of its classes."""


class MLAAttentionSpec(FullAttentionSpec):
    """Named as vLLM's MLA spec (a full-attention spec there too): one latent vector per token."""


def kv_cache_config(layout: str, mla: bool = False, replicas: int = 1) -> SimpleNamespace:
    """vLLM 0.33's ``KVCacheConfig`` fields for one group of ``LAYERS`` over one flat buffer: layer-outer
    (``L...``: a layer's blocks back to back) or block-outer (``B...``: a block's layers back to back).
    ``mla``: an MLA group, the same KV on each of ``replicas`` tensor-parallel ranks."""
    heads, content = (1, LATENT) if mla else (HEADS, CONTENT)
    page = heads * TOKENS * content * 2
    spec = (MLAAttentionSpec if mla else FullAttentionSpec)(block_size=TOKENS, page_size_bytes=page)
    layer_outer = layout[0] == "L"
    tensor = SimpleNamespace(
        offset=0,
        layers=list(LAYERS),
        layer_stride=page * NUM_BLOCKS if layer_outer else page,
        block_stride=page if layer_outer else page * len(LAYERS),
        size=page * NUM_BLOCKS * len(LAYERS),
    )
    return SimpleNamespace(
        num_blocks=NUM_BLOCKS,
        kv_cache_layout=layout,
        kv_cache_groups=[SimpleNamespace(layer_names=list(LAYERS), kv_cache_spec=spec)],
        kv_cache_tensors=[tensor],
        kv_tp_replicas=replicas,
    )


def layer_views(buffer: torch.Tensor, config: SimpleNamespace, heads: int, content: int) -> dict[str, torch.Tensor]:
    """Each layer's bf16 view of the flat uint8 ``buffer``, logical [B, H, N, C], its H, N and C strided in
    the order the layout's last three letters give (vLLM's ``layer_view_order``)."""
    sizes = {"H": heads, "N": TOKENS, "C": content}
    strides, step = {}, 1
    for dim in reversed(config.kv_cache_layout[2:]):
        strides[dim] = step
        step *= sizes[dim]
    elements = buffer.view(torch.bfloat16)
    tensor = config.kv_cache_tensors[0]
    return {
        name: torch.as_strided(
            elements,
            (NUM_BLOCKS, heads, TOKENS, content),
            (tensor.block_stride // 2, strides["H"], strides["N"], strides["C"]),
            (tensor.offset + i * tensor.layer_stride) // 2,
        )
        for i, name in enumerate(tensor.layers)
    }


def key(label: str) -> bytes:
    """The block key of a labelled block (disk slots record it, and a load checks it)."""
    return hashlib.blake2b(label.encode(), digest_size=16).digest()


def copies(src: str | None, dst: str | None, labels: list[str], src_slots: list[int], dst_slots: list[int]) -> Copy:
    return copy_of(src, dst, numbered([key(label) for label in labels], src_slots, dst_slots))


class Rank:
    """One vLLM worker's KV cache and kvtier worker side (see the module doc)."""

    def __init__(
        self,
        device: str,
        layout: str,
        disk_dir: str,
        rank: int = 0,
        ranks: int = 1,
        mla: bool = False,
        engine_id: str = "",
        copy_mode: str = "auto",
    ) -> None:
        self.device = device
        self.config = kv_cache_config(layout, mla, ranks if mla else 1)
        heads, content = (1, LATENT) if mla else (HEADS, CONTENT)
        tensor = self.config.kv_cache_tensors[0]
        self.page = self.config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
        self.buffer = torch.zeros(tensor.size, dtype=torch.uint8, device=device)
        self.kv_caches = layer_views(self.buffer, self.config, heads, content)
        self.stream = torch.cuda.Stream(device) if device == "cuda" else None
        self.generator = torch.Generator(device=device).manual_seed(rank)
        stack = load_config(
            {
                "transfer": {"cuda_copy": copy_mode},
                "tiers": [
                    {"medium": "host", "capacity_blocks": SLOTS},
                    {"medium": "disk", "capacity_blocks": SLOTS, "path": disk_dir, "o_direct": "off"},
                ],
            }
        )
        self.side = WorkerSide(stack, self.config, rank, "worker-rig", ranks, engine_id)
        try:
            self.side.register_kv_caches(self.kv_caches)
        except BaseException:
            self.side.shutdown()
            raise

    def computing(self) -> contextlib.AbstractContextManager[object]:
        """This rank's compute stream made current (vLLM's forward pass runs on the current stream)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _busy(self) -> torch.Tensor:
        """A scalar at the end of a chain of large matrix products (tens of ms on a GPU): what is queued
        after it on the compute stream lands long after the host moved on."""
        n, rounds = (8192, 8) if self.device == "cuda" else (64, 1)
        x = torch.randn(n, n, dtype=torch.bfloat16, device=self.device, generator=self.generator)
        for _ in range(rounds):
            x = torch.tanh(x @ x / n**0.5)
        return x.mean()

    def compute_kv(self, blocks: list[int]) -> None:
        """The model writes these blocks' KV on the compute stream (random values behind the busy chain)."""
        index = torch.tensor(blocks, device=self.device)
        with self.computing():
            bias = self._busy()
            for view in self.kv_caches.values():
                shape = (len(blocks), *view.shape[1:])
                view[index] = torch.randn(shape, dtype=view.dtype, device=self.device, generator=self.generator) + bias

    def poison(self) -> None:
        """Every byte of the KV cache set to 0xFF on the compute stream, behind the busy chain."""
        with self.computing():
            self._busy()
            self.buffer.fill_(0xFF)

    def wait_compute(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def start(self, *jobs: TransferJob) -> None:
        """The step's jobs started as vLLM's hooks start them, with the compute stream current and nothing
        synchronized."""
        with self.computing():
            self.side.start(list(jobs))

    def settle(self) -> None:
        """Wait until this rank's jobs have ended (every job ends with a report, also a failed one)."""
        deadline = time.monotonic() + SETTLE_S
        while self.side.in_flight():
            assert time.monotonic() < deadline, f"jobs still in flight after {SETTLE_S} s"
            time.sleep(0.002)

    def image(self) -> np.ndarray:
        """The whole KV buffer's bytes."""
        if self.device == "cuda":
            torch.cuda.synchronize()
        return self.buffer.cpu().numpy()

    def _page_offsets(self, block: int) -> list[int]:
        tensor = self.config.kv_cache_tensors[0]
        return [tensor.offset + i * tensor.layer_stride + block * tensor.block_stride for i in range(len(LAYERS))]

    def blocks(self, blocks: list[int]) -> dict[int, np.ndarray]:
        """Each block's bytes as a slot holds them (its layers' pages back to back)."""
        image = self.image()
        return {b: np.concatenate([image[o : o + self.page] for o in self._page_offsets(b)]) for b in blocks}

    def assert_holds(self, placed: dict[int, np.ndarray]) -> None:
        """The buffer holds exactly ``placed`` (block id -> its bytes) and poison everywhere else."""
        expected = np.full(self.buffer.numel(), 0xFF, dtype=np.uint8)
        for block, data in placed.items():
            for i, offset in enumerate(self._page_offsets(block)):
                expected[offset : offset + self.page] = data[i * self.page : (i + 1) * self.page]
        actual = self.image()
        wrong = np.flatnonzero(actual != expected)
        assert wrong.size == 0, f"{wrong.size} bytes differ, the first at byte {wrong[0]} of the KV buffer"

    def close(self) -> None:
        self.side.shutdown()


@contextlib.contextmanager
def ranks_of(device: str, layout: str, disk_dir: str, ranks: int, mla: bool = False, **kwargs) -> Iterator[list[Rank]]:
    """``ranks`` tensor-parallel ranks of one engine in this process, rank 0 first (with MLA it creates
    the host slab the others join), all shut down at the end."""
    engine_id = f"worker-rig-{uuid.uuid4().hex}"  # a shared slab's name of its own
    made: list[Rank] = []
    try:
        for r in range(ranks):
            made.append(Rank(device, layout, disk_dir, r, ranks, mla, engine_id, **kwargs))
        yield made
    finally:
        for rank in made:
            rank.close()


def on_each(ranks: list[Rank], body) -> list:
    """``body(rank)`` on every rank at once, one thread each (as vLLM's workers step together)."""
    with ThreadPoolExecutor(len(ranks)) as pool:
        return [f.result(timeout=10 * SETTLE_S) for f in [pool.submit(body, rank) for rank in ranks]]


def assert_jobs_done(ranks: int, expected: list[tuple[str, int, int]], reports: list[WorkerReport]) -> None:
    """The scheduler side's JobManager, given every rank's report (``expected``: kind, blocks and parts of
    each job, in id order from 1), ends every job as done."""
    jobs = JobManager()
    made = [jobs.create(kind, n, expected_reports=parts * ranks) for kind, n, parts in expected]
    assert [job.id for job in made] == list(range(1, len(expected) + 1))
    for report in reports:
        jobs.apply(report)
    assert [job.state.value for job in made] == ["done"] * len(made)


# --- the test bodies ---------------------------------------------------------------------------------

ROUND_TRIP_JOBS = [("store", 3, 1), ("load", 3, 1), ("demote", 3, 1), ("store", 3, 1), ("load", 6, 1)]


def round_trip(rank: Rank) -> WorkerReport:
    """Blocks computed on the compute stream are stored at once; loaded back from host memory into other
    block ids of a poisoned cache; evicted to disk (their host slots reused by a write-through store of
    other blocks) and loaded back from disk through host memory, all six bit-exact. Returns the rank's
    report (jobs 1-5, ``ROUND_TRIP_JOBS``) after checking it and the rank's other counts."""
    a, b = ["a3", "a7", "a8"], ["b1", "b2", "b4"]
    rank.compute_kv([3, 7, 8])
    rank.start(TransferJob(1, "store", 3, ((copies(GPU, "host", a, [3, 7, 8], [5, 0, 1]),),)))
    rank.settle()
    computed = rank.blocks([3, 7, 8])
    assert all(data.any() for data in computed.values()), "the model's KV never reached the blocks"

    rank.poison()
    rank.start(TransferJob(2, "load", 3, ((copies("host", GPU, a, [5, 0, 1], [11, 20, 12]),),), "r2", (11, 20, 12)))
    rank.settle()
    rank.assert_holds({11: computed[3], 20: computed[7], 12: computed[8]})

    rank.start(TransferJob(3, "demote", 3, ((copies("host", "disk", a, [5, 0, 1], [6, 3, 0]),),)))
    rank.settle()
    rank.compute_kv([1, 2, 4])
    rank.start(
        TransferJob(
            4,
            "store",
            3,
            ((copies(GPU, "host", b, [1, 2, 4], [5, 0, 1]),), (copies("host", "disk", b, [5, 0, 1], [10, 11, 12]),)),
        )
    )
    rank.settle()
    computed |= rank.blocks([1, 2, 4])

    rank.poison()
    # The second stage (host -> KV) is submitted from the disk backend's thread when the first ends,
    # ordered after that thread's current stream, not this rank's compute stream: wait for it here.
    rank.wait_compute()
    both, gpu = a + b, [30, 9, 14, 15, 16, 17]
    staged = (
        (copies("disk", "host", both, [6, 3, 0, 10, 11, 12], [2, 3, 4, 6, 7, 8]),),
        (copies("host", GPU, both, [2, 3, 4, 6, 7, 8], gpu),),
    )
    rank.start(TransferJob(5, "load", 6, staged, "r5", tuple(gpu)))
    rank.settle()
    rank.assert_holds({g: computed[int(label[1:])] for g, label in zip(gpu, both, strict=True)})  # "a3": block 3

    side = rank.side
    assert side.take_finished_loads() == ({"r2", "r5"}, set()) and side.take_load_errors() == set()
    stats = side.take_stats()
    assert stats is not None
    block_bytes = side.layout.block_bytes
    assert (stats["store_bytes"], stats["load_bytes"]) == (6 * block_bytes, 9 * block_bytes)
    report = side.take_report()
    assert report == WorkerReport(dict.fromkeys(range(1, 6), 1), {})
    return report


def check_round_trip(device: str, layout: str, disk_dir: str, copy_mode: str = "auto") -> None:
    """``round_trip`` on one rank; with CUDA tensors the CUDA backend moves the KV bytes."""
    with ranks_of(device, layout, disk_dir, 1, copy_mode=copy_mode) as ranks:
        assert ranks[0].side.transfers.backends[0].name == ("cuda" if device == "cuda" else "cpu")
        assert_jobs_done(1, ROUND_TRIP_JOBS, [round_trip(ranks[0])])
    assert_no_vllm_imported_unless_loaded_before()


def check_two_ranks(device: str, disk_dir: str) -> None:
    """Two tensor-parallel ranks in one process, each with its own KV cache, compute stream, host slab and
    disk slab, run ``round_trip`` at once; each gets its own bytes back, and the JobManager ends every job
    once both ranks reported it."""
    with ranks_of(device, "LBHNC", disk_dir, 2) as ranks:
        reports = on_each(ranks, round_trip)
        assert_jobs_done(2, ROUND_TRIP_JOBS, reports)
    assert_no_vllm_imported_unless_loaded_before()


MLA_JOBS = [("store", 3, 1), ("load", 3, 1), ("demote", 3, 1), ("store", 3, 1), ("load", 3, 2)]


def check_mla_shared_slab(device: str, disk_dir: str) -> None:
    """MLA on two ranks of one engine: one host slab in shared memory, rank 0's disk slab. Rank 0 alone
    stores; both ranks load rank 0's bytes into their own (poisoned) caches from the shared slab, and
    from disk once rank 0 staged them there (a staged load in the scheduler's two parts)."""
    a = ["m2", "m5", "m6"]
    with ranks_of(device, "LBHNC", disk_dir, 2, mla=True) as ranks:
        zero, one = ranks
        assert zero.side.storages["host"].device == "cpu" and "disk" not in one.side.storages
        for rank in ranks:  # rank 1's KV differs here: what it loads can only be rank 0's
            rank.compute_kv([2, 5, 6])
        on_each(
            ranks,
            lambda r: (
                r.start(TransferJob(1, "store", 3, ((copies(GPU, "host", a, [2, 5, 6], [0, 1, 2]),),))),
                r.settle(),
            ),
        )
        computed = zero.blocks([2, 5, 6])

        def load_host(rank: Rank) -> None:
            rank.poison()
            rank.start(
                TransferJob(2, "load", 3, ((copies("host", GPU, a, [0, 1, 2], [10, 11, 12]),),), "r2", (10, 11, 12))
            )
            rank.settle()
            rank.assert_holds({10: computed[2], 11: computed[5], 12: computed[6]})

        on_each(ranks, load_host)
        zero.compute_kv([1, 3, 4])  # the host slots go to other blocks once theirs are on disk
        for job in (
            TransferJob(3, "demote", 3, ((copies("host", "disk", a, [0, 1, 2], [7, 8, 9]),),)),
            TransferJob(4, "store", 3, ((copies(GPU, "host", ["m1", "m3", "m4"], [1, 3, 4], [0, 1, 2]),),)),
        ):
            on_each(ranks, lambda r, job=job: (r.start(job), r.settle()))
        staged = TransferJob(
            5,
            "load",
            3,
            ((copies("disk", "host", a, [7, 8, 9], [4, 5, 6]),), (copies("host", GPU, a, [4, 5, 6], [20, 21, 22]),)),
            "r5",
            (20, 21, 22),
        )
        on_each(ranks, lambda r: (r.start(staged.staging_part()), r.settle()))

        def load_staged(rank: Rank) -> WorkerReport:
            rank.poison()
            rank.start(staged.loading_part(set()))
            rank.settle()
            rank.assert_holds({20: computed[2], 21: computed[5], 22: computed[6]})
            assert rank.side.take_finished_loads() == ({"r2", "r5"}, set()) and not rank.side.take_load_errors()
            report = rank.side.take_report()
            assert report == WorkerReport({1: 1, 2: 1, 3: 1, 4: 1, 5: 2}, {})
            return report

        reports = on_each(ranks, load_staged)
        assert_jobs_done(2, MLA_JOBS, reports)
        block_bytes = zero.side.layout.block_bytes
        moved = [(s["store_bytes"], s["load_bytes"]) for s in (r.side.take_stats() or {} for r in ranks)]
        assert moved == [(6 * block_bytes, 6 * block_bytes), (0, 6 * block_bytes)]  # stored once, loaded by each
    assert_no_vllm_imported_unless_loaded_before()


def vllm_modules() -> list[str]:
    """The vLLM modules loaded in this process (a name mapped to None is one refused, not loaded)."""
    return [m for m, mod in list(sys.modules.items()) if mod is not None and (m == "vllm" or m.startswith("vllm."))]


VLLM_BEFORE = bool(vllm_modules())


def assert_no_vllm_imported_unless_loaded_before() -> None:
    """Where vLLM was not loaded when this module was (a GPU machine without it, a process that refuses
    it), nothing the bodies ran imported it."""
    if not VLLM_BEFORE:
        assert vllm_modules() == []
