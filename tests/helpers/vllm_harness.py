"""A test engine for the vLLM connector: vLLM's own Scheduler, KVTierConnector built by vLLM's
KVConnectorFactory on both sides, KV caches allocated by vLLM's own ``allocate_kv_cache`` on CPU.

``Engine.step()`` is one engine step the way vLLM's model runner drives a connector: schedule, then
on every worker ``handle_preemptions``, ``start_load_kv``, a stand-in forward pass that calls
``wait_for_layer_load`` for every layer (as vLLM's attention layers do) and writes each newly full
block's KV, ``wait_for_save``, ``get_transfer_results``, ``get_block_ids_with_load_errors``,
``build_connector_worker_meta``; the workers' outputs merged by vLLM's ``KVOutputAggregator``, then
``update_from_output``. The metadata crosses a pickle round trip each way, as between processes. The
workers run one after the other in this process, or (``processes=True``) each in a process of its
own, all at once, as under vLLM's multiprocessing executor.

The stand-in forward writes a block's KV as a pure function of the tokens up to its end, so a block
loaded back can be compared with what the model would have computed.

This module imports vLLM: tests/connectors/vllm/conftest.py imports it once it has set vLLM's
environment up and found vLLM installed (the tests there are skipped otherwise), and so do the vLLM
benches (after setting that environment), for ``make_vllm_config`` among others.
"""

from __future__ import annotations

import multiprocessing
import pickle
import time
import traceback

import numpy as np
import torch
import xxhash
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_events import MEDIUM_GPU
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, resolve_kv_cache_block_sizes
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from helpers.vllm_helpers import BLOCK

LAYERS = ("model.decoder.layers.0.self_attn.attn", "model.decoder.layers.1.self_attn.attn")
HYBRID_LAYERS = tuple(f"model.decoder.layers.{i}.self_attn.attn" for i in range(4))
# A small OPT-like model: vLLM's ModelConfig reads only this file (no weights for scheduler tests).
MODEL_JSON = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "ffn_dim": 128,
    "vocab_size": 50272,
    "max_position_embeddings": 2048,
    "torch_dtype": "float16",
}


def kv_cache_config(num_blocks: int, layout: str = "LBHNC", head_size: int = 8, mla_ranks: int = 0) -> KVCacheConfig:
    """Two layers of 2 KV heads x ``head_size`` dims in fp16 (1 KiB pages with 8 dims), one
    backing buffer, layer-outer or block-outer as ``layout`` says. ``mla_ranks``: MLA instead (one
    latent vector per token, the same on each of that many tensor-parallel ranks)."""
    spec = (
        MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=4 * head_size, dtype=torch.float16)
        if mla_ranks
        else FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=head_size, dtype=torch.float16)
    )
    page = spec.page_size_bytes
    if KVCacheLayout[layout].is_layer_compact:
        tensor = KVCacheTensor(
            size=page * num_blocks * len(LAYERS), layers=list(LAYERS), layer_stride=page * num_blocks, block_stride=page
        )
    else:
        tensor = KVCacheTensor(
            size=page * num_blocks * len(LAYERS),
            layers=list(LAYERS),
            layer_stride=page,
            block_stride=page * len(LAYERS),
        )
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
        kv_tp_replicas=max(1, mla_ranks),
    )
    config.kv_cache_layout = layout
    return config


def hybrid_kv_cache_config(
    num_blocks: int, window: int | None, head_size: int = 8, window_block: int = BLOCK
) -> KVCacheConfig:
    """Four layers as vLLM's hybrid manager groups them for a model of interleaved full-attention and
    sliding-window layers: group 0 full attention (layers 0 and 2), group 1 a ``window``-token window
    (layers 1 and 3), each group's tensor over the whole buffer from byte 0 (groups share the block
    pool: a block id belongs to one group at a time), layer-outer. ``window_block``: the window
    group's tokens per block, its heads fewer to keep one page size (as vLLM sizes the blocks of
    groups whose layers differ). ``window`` None: group 1 is a Mamba state instead (vLLM's "align"
    mode, its page padded to the attention page)."""
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=head_size, dtype=torch.float16)
    page = full.page_size_bytes
    other = (
        SlidingWindowSpec(
            block_size=window_block,
            num_kv_heads=2 * BLOCK // window_block,
            head_size=head_size,
            dtype=torch.float16,
            sliding_window=window,
        )
        if window is not None
        else MambaSpec(
            block_size=BLOCK,
            shapes=((4, head_size),),
            dtypes=(torch.float16,),
            page_size_padded=page,
            mamba_cache_mode="align",
        )
    )
    groups = [
        KVCacheGroupSpec([HYBRID_LAYERS[0], HYBRID_LAYERS[2]], full),
        KVCacheGroupSpec([HYBRID_LAYERS[1], HYBRID_LAYERS[3]], other),
    ]
    tensors = [
        KVCacheTensor(
            size=page * num_blocks * 2, layers=list(g.layer_names), layer_stride=page * num_blocks, block_stride=page
        )
        for g in groups
    ]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=groups,
        kv_cache_layout="LBHNC",
        hash_block_size=BLOCK,
        cache_hit_alignment_tokens=BLOCK,
    )


def block_kv(prefix: list[int], page: int, layer: int) -> np.ndarray:
    """The KV bytes a model would compute for the block that ends a sequence's ``prefix``: a pure
    function of every token up to the block's end (and the layer), like real attention KV."""
    seed = xxhash.xxh64_intdigest(np.asarray(prefix, dtype=np.int64).tobytes(), layer)
    return np.random.default_rng(seed).integers(0, 256, page, dtype=np.uint8)


def make_vllm_config(
    model_dir,
    kvtier: dict | None,
    num_gpu_blocks: int,
    tp: int = 1,
    *,
    extra: dict | None = None,
    block_size: int = BLOCK,
    max_model_len: int = 2048,
    max_num_batched_tokens: int = 1024,
    max_num_seqs: int = 8,
    engine_id: str | None = None,
    kv_events: bool = False,
) -> VllmConfig:
    """The VllmConfig of a test engine or a bench's scheduler, written once for all of them (what differs
    between them is a parameter): the model folder's config on CPU, prefix caching and chunked prefill
    on, ``tp`` ranks, and ``num_gpu_blocks`` set by hand (vLLM sets it after profiling the GPU, which
    does not happen here).

    ``kvtier``: kvtier's config, KVTierConnector selected by module path, ``extra`` beside ``config`` in
    its extra config; None: vLLM's own OffloadingConnector, ``extra`` its whole extra config as a user
    writes it (its CPU spec, or ``spec_name: TieringOffloadingSpec``). A failed load is recomputed (the
    tests fail loads on purpose and expect the request to go on). ``kv_events``: vLLM's KV cache events
    on, published nowhere (the connector still makes them)."""
    if kvtier is not None:
        connector, module, extra = "KVTierConnector", "kvtier.connectors.vllm", {"config": kvtier, **(extra or {})}
    else:
        connector, module = "OffloadingConnector", None
    config = VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir), skip_tokenizer_init=True, dtype="float16", seed=0, max_model_len=max_model_len
        ),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector=connector,
            kv_connector_module_path=module,
            kv_role="kv_both",
            engine_id=engine_id,
            kv_connector_extra_config=extra,
            kv_load_failure_policy="recompute",
        ),
        device_config=DeviceConfig("cpu"),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None,
    )
    config.parallel_config.tensor_parallel_size = config.parallel_config.world_size = tp
    config.cache_config.num_gpu_blocks = num_gpu_blocks
    return config


class Worker:
    """One rank: a worker-side KVTierConnector over vLLM-allocated CPU KV caches."""

    def __init__(self, vllm_config: VllmConfig, kv_config: KVCacheConfig) -> None:
        self.connector = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER, kv_config)
        self.kv_config = kv_config
        self.kv_caches = allocate_kv_cache(kv_config, torch.device("cpu"), KVCacheLayout[kv_config.kv_cache_layout])
        self.connector.register_kv_caches(self.kv_caches)
        storage = next(iter(self.kv_caches.values())).untyped_storage()
        self.buffer = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
        self.page = kv_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
        # every layer: where it lives, and its number (the KV of a layer is a function of it)
        self.places = {name: (t, i) for t in kv_config.kv_cache_tensors for i, name in enumerate(t.layers)}
        self.numbers = {name: n for n, name in enumerate(sorted(self.places))}

    def page_view(self, block_id: int, layer: str) -> np.ndarray:
        t, index = self.places[layer]
        start = t.offset + index * t.layer_stride + block_id * t.block_stride
        return self.buffer[start : start + self.page]

    def write_block(self, prefix: list[int], block_id: int, layers=None) -> None:
        """Write the KV of the block ending ``prefix`` into ``block_id`` (of these layers)."""
        for layer in layers or self.places:
            self.page_view(block_id, layer)[:] = block_kv(prefix, self.page, self.numbers[layer])

    def block_matches(self, prefix: list[int], block_id: int, layers=None) -> bool:
        return all(
            np.array_equal(self.page_view(block_id, layer), block_kv(prefix, self.page, self.numbers[layer]))
            for layer in layers or self.places
        )

    def in_flight(self) -> int:
        return self.connector.worker_side.in_flight()

    def wait_idle(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.in_flight():
            assert time.monotonic() < deadline, "worker copies did not finish"
            time.sleep(0.002)

    def scribble(self) -> None:
        """Overwrite every KV byte: only what is loaded afterwards holds KV."""
        self.buffer[:] = 0xEE

    def begin_step(self, meta: bytes, writes: list, finished_req_ids: set[str], settle: bool, report: bool) -> None:
        """This rank's part of an engine step: the connector's hooks in the order of vLLM's model
        runner (kv_connector_model_runner_mixin.py) around the forward pass's ``writes`` (tokens, block,
        layers); ``settle`` waits for the copies first (a forward pass long enough for them),
        without ``report`` the rank's output is held back. ``end_step`` hands the output over."""
        c = self.connector
        bound = pickle.loads(meta)
        c.handle_preemptions(bound)
        c.bind_connector_metadata(bound)
        c.start_load_kv(None)
        for layer in self.places:
            c.wait_for_layer_load(layer)
        for prefix, block_id, layers in writes:
            self.write_block(prefix, block_id, layers)
        c.wait_for_save()
        if settle:
            self.wait_idle()
        if report:
            results = c.get_transfer_results(finished_req_ids)
            self._output = KVConnectorOutput(
                finished_recving=results.finished_recving or None,
                failed_recving=results.failed_recving,
                invalid_block_ids=c.get_block_ids_with_load_errors(),
                kv_connector_worker_meta=pickle.loads(pickle.dumps(c.build_connector_worker_meta())),
                kv_connector_stats=c.get_kv_connector_stats(),
            )
        else:
            self._output = KVConnectorOutput()
        c.clear_connector_metadata()

    def end_step(self) -> KVConnectorOutput:
        return self._output

    def shutdown(self) -> None:
        self.connector.shutdown()


class ProcessWorker:
    """A ``Worker`` in a process of its own (spawned: vLLM and the KV caches set up there), driven over a
    pipe: ``begin_step`` returns once the step is sent, so every rank's step runs at once."""

    TIMEOUT_S = 120.0

    def __init__(self, vllm_config: VllmConfig, kv_config: KVCacheConfig) -> None:
        context = multiprocessing.get_context("spawn")
        self._pipe, theirs = context.Pipe()
        self.process = context.Process(target=_serve_worker, args=(theirs, vllm_config, kv_config), daemon=True)
        self.process.start()
        theirs.close()

    def ready(self) -> None:
        """Wait until the rank has set its connector up (ranks sharing a host slab wait for each other)."""
        self._answer()

    def _call(self, name: str, *args):
        self._pipe.send((name, args))
        return self._answer()

    def _answer(self):
        if not self._pipe.poll(self.TIMEOUT_S):
            raise AssertionError(f"worker process {self.process.pid} did not answer in {self.TIMEOUT_S} s")
        ok, value = self._pipe.recv()
        if not ok:
            raise AssertionError(f"worker process {self.process.pid} failed:\n{value}")
        return value

    def begin_step(self, *args) -> None:
        self._pipe.send(("begin_step", args))

    def end_step(self) -> KVConnectorOutput:
        self._answer()
        return self._call("end_step")

    def block_matches(self, *args) -> bool:
        return self._call("block_matches", *args)

    def scribble(self) -> None:
        self._call("scribble")

    def in_flight(self) -> int:
        return self._call("in_flight")

    def shutdown(self) -> None:
        if self.process.is_alive():
            self._call("shutdown")
            self._pipe.send(None)
        self.process.join(30)


def _serve_worker(pipe, vllm_config: VllmConfig, kv_config: KVCacheConfig) -> None:
    """A worker process's loop: build the rank's ``Worker``, then run the calls the pipe brings (None
    ends it), answering each with (True, result) or (False, the traceback)."""
    try:
        worker = Worker(vllm_config, kv_config)
        pipe.send((True, None))
    except BaseException:
        pipe.send((False, traceback.format_exc()))
        return
    while (call := pipe.recv()) is not None:
        name, args = call
        try:
            pipe.send((True, getattr(worker, name)(*args)))
        except BaseException:
            pipe.send((False, traceback.format_exc()))


class Engine:
    """vLLM's Scheduler (or AsyncScheduler) plus ``tp`` workers, stepped by hand, one step after the other."""

    def __init__(
        self,
        model_dir,
        kvtier: dict,
        num_gpu_blocks: int = 64,
        tp: int = 1,
        layout: str = "LBHNC",
        max_num_batched_tokens: int = 1024,
        max_num_seqs: int = 8,
        extra: dict | None = None,
        async_scheduling: bool = False,
        head_size: int = 8,
        window: int | None = None,
        mamba: bool = False,
        mla: bool = False,
        processes: bool = False,
        window_block: int = BLOCK,
        kv_events: bool = False,
    ) -> None:
        """``window`` set: a hybrid model, full-attention and sliding-window groups, the window's blocks of
        ``window_block`` tokens; ``mamba``: full
        attention and a Mamba state group (``hybrid_kv_cache_config``); ``mla``: MLA, the same KV on
        every rank; ``processes``: each worker in a process of its own (``ProcessWorker``); ``kv_events``:
        vLLM's KV cache events on (``make_vllm_config``)."""
        self.vllm_config = make_vllm_config(
            model_dir,
            kvtier,
            num_gpu_blocks,
            tp,
            extra=extra,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            kv_events=kv_events,
        )
        self.kv_config = (
            hybrid_kv_cache_config(num_gpu_blocks, window, head_size, window_block)
            if window is not None or mamba
            else kv_cache_config(num_gpu_blocks, layout, head_size, tp if mla else 0)
        )
        if mamba:
            self.vllm_config.cache_config.mamba_cache_mode = "align"
        self.groups = [list(group.layer_names) for group in self.kv_config.kv_cache_groups]
        self.block_sizes = [group.kv_cache_spec.block_size for group in self.kv_config.kv_cache_groups]
        # what vLLM's engine core resolves: the scheduler's block (every group's) and the hash block
        scheduler_block, self.hash_block = resolve_kv_cache_block_sizes(self.kv_config, self.vllm_config)
        self.vllm_config.scheduler_config.async_scheduling = async_scheduling
        # In vLLM's order: the workers first (they open their disk slabs and hold the directory
        # locks), then the scheduler, whose connector reads those slabs' headers at start.
        self.workers = []
        for rank in range(tp):
            self.vllm_config.parallel_config.rank = rank
            self.workers.append((ProcessWorker if processes else Worker)(self.vllm_config, self.kv_config))
        self.vllm_config.parallel_config.rank = 0
        for worker in self.workers:
            if processes:
                worker.ready()
        scheduler_class = AsyncScheduler if async_scheduling else Scheduler
        self.scheduler = scheduler_class(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_config,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=scheduler_block,
            hash_block_size=self.hash_block,
        )
        self.connector = self.scheduler.connector
        self.kvtier = self.connector.scheduler_side
        self.aggregator = KVOutputAggregator(tp)
        self.tokens: dict[str, list[int]] = {}
        self.loaded: dict[str, list[int]] = {}
        self.load_errors: set[int] = set()
        self.failed_loads: set[str] = set()  # requests whose load failed as a whole (several KV cache groups)
        self.events = []  # kvtier's KV cache events, as vLLM's scheduler publishes them
        self.scheduler.kv_event_publisher = self
        self.stats: list[dict] = []  # kv_connector_stats payloads vLLM put into its scheduler stats
        self._ids = 0

    def add(self, prompt: list[int], max_tokens: int = 4, cache_salt: str | None = None) -> Request:
        self._ids += 1
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = Request(
            request_id=f"r{self._ids}",
            prompt_token_ids=list(prompt),
            sampling_params=params,
            pooling_params=None,
            mm_features=None,
            block_hasher=get_request_block_hasher(self.hash_block, sha256),
            cache_salt=cache_salt,
        )  # vLLM's own prefix cache
        self.scheduler.add_request(request)
        return request

    def step(self, settle: bool = True, report_ranks: set[int] | None = None):
        """One engine step. ``settle`` waits for the workers' copies before they report (a forward
        pass long enough for them); ``report_ranks`` holds back the other ranks' outputs."""
        out = self.scheduler.schedule()
        meta, writes = pickle.dumps(out.kv_connector_metadata), self._writes(out)
        reporting = report_ranks if report_ranks is not None else range(len(self.workers))
        for rank, worker in enumerate(self.workers):
            worker.begin_step(meta, writes, out.finished_req_ids, settle, rank in reporting)
        merged = self.aggregator.aggregate([self._model_output(out, worker.end_step()) for worker in self.workers])
        kv_out = merged.kv_connector_output
        if kv_out is not None:
            self.load_errors |= kv_out.invalid_block_ids
            self.failed_loads |= kv_out.failed_recving
        engine_outputs = self.scheduler.update_from_output(out, merged)  # publishes events to self
        for eco in engine_outputs.values():  # worker and scheduler stats as vLLM reports them
            if eco.scheduler_stats is not None and eco.scheduler_stats.kv_connector_stats:
                self.stats.append(eco.scheduler_stats.kv_connector_stats)
        return out, engine_outputs

    def publish(self, batch) -> None:
        """vLLM's scheduler publishes each step's KV cache events here (the engine's publisher); kvtier's
        are those naming a medium other than vLLM's own GPU blocks."""
        self.events += [e for e in batch.events if getattr(e, "medium", MEDIUM_GPU) not in (None, MEDIUM_GPU)]

    def _model_output(self, out, kv_output: KVConnectorOutput) -> ModelRunnerOutput:
        """A rank's model runner output: a token for every request whose prompt is done, and the rank's
        connector output."""
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = self.scheduler.requests[req_id]
            done = request.num_computed_tokens >= request.num_tokens  # schedule() advanced it already
            sampled.append([1000 + request.num_output_tokens] if done else [])
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_output,
        )

    def _writes(self, out) -> list:
        """What the forward pass writes: the KV of every block that becomes full in this step, as (the
        tokens up to its end, block id, layers) for each group that keeps the block."""
        writes = []
        for req_id, n in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            tables = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            tokens = list(request.all_token_ids)
            first, end = request.num_computed_tokens - n, request.num_computed_tokens  # advanced by schedule()
            for layers, table, size in zip(self.groups, tables, self.block_sizes, strict=True):
                for block in range(first // size, min(end, len(tokens)) // size):
                    if table[block]:  # a window's block vLLM no longer keeps is its null block, 0
                        writes.append((tokens[: (block + 1) * size], table[block], layers))
        return writes

    def run(self, requests, max_steps: int = 200, timeout: float = 30.0):
        """Step until these requests finished; returns the steps taken. A step that schedules nothing
        (a lookup said "ask again": a remote store's answer is on its way) is not counted: the next
        one comes a millisecond later, as long as ``timeout`` allows."""
        deadline = time.monotonic() + timeout
        steps = 0
        while steps < max_steps and time.monotonic() < deadline:
            out, _ = self.step()
            if all(r.request_id not in self.scheduler.requests for r in requests):
                self.drain()
                return steps + 1
            if out.total_num_scheduled_tokens:
                steps += 1
            else:
                time.sleep(0.001)
        raise AssertionError("requests did not finish")

    def drain(self, max_steps: int = 50) -> None:
        """Empty steps until no kvtier job is in flight (their reports come back through steps)."""
        for _ in range(max_steps):
            if not self.kvtier.jobs.in_flight():
                return
            self.step()
        raise AssertionError(f"kvtier jobs still in flight: {self.kvtier.leaks()}")

    def blocks_match(self, request: Request, blocks) -> bool:
        """Whether the request's GPU blocks over the tokens of these ``BLOCK``-token blocks hold, on every
        rank, the KV its tokens give (in every group that keeps them: a window's older blocks are vLLM's
        null block; a group of larger blocks, those of its blocks that lie within these tokens)."""
        tables = self.scheduler.kv_cache_manager.get_block_ids(request.request_id)
        tokens = list(request.all_token_ids)
        first, end = min(blocks) * BLOCK, (max(blocks) + 1) * BLOCK
        checks = [
            (tokens[: (k + 1) * size], table[k], layers)
            for layers, table, size in zip(self.groups, tables, self.block_sizes, strict=True)
            for k in range(-(-first // size), end // size)
            if table[k]
        ]
        return all(w.block_matches(*check) for w in self.workers for check in checks)

    def assert_no_leaks(self) -> None:
        leaks = self.kvtier.leaks()
        assert leaks == {"tiers": {}, "jobs": [], "gpu_readers": {}, "gpu_loading": {}}, leaks
        for tier in self.kvtier.tiers:
            tier.check_invariants()
        assert all(w.in_flight() == 0 for w in self.workers)

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.connector.shutdown()


init_none_hash(sha256)  # what the engine does at start, before requests are hashed
