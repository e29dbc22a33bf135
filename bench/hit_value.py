"""What a kvtier hit is worth on a GPU: recomputing a prefix's KV (prefill) against loading it back.

What is measured
    A Llama-3-8B-shaped model (32 layers, 32 heads, 8 KV heads of 128 dims, hidden 4096; default
    RoPE with theta 500000, no llama3 scaling) with random bf16 weights, made on the device without
    a download (``--tiny``: 2 layers, hidden 256, for a CPU). For each prefix length:

    - ``prefill``: one forward over the prefix with ``use_cache=True`` and ``logits_to_keep=1``,
      timed with CUDA events (wall clock on a CPU) after one untimed warm-up; the median of
      ``--repeat`` runs (one fewer from 16k tokens on). The last run's DynamicCache is kept: per
      layer K and V of shape [1, kv_heads, T, head_dim].
    - ``load from host``: the whole prefix, stored before in a kvtier stack (a pinned host tier over
      a disk tier, write-through), loaded from host memory into a zeroed copy of that cache.
    - ``load from disk``: the same after a second copy of the KV under other keys has pushed the
      first out of host memory, so every block comes from the disk tier's slab (O_DIRECT where the
      filesystem takes it, as by default: from the device, not the page cache), staged through the
      host tier as any disk hit on a GPU is. Repetitions alternate between the two copies, so each
      load finds its blocks on disk only.

    A load is timed from the call to ``TierStack.load`` until its future resolved and the device
    synchronised. kvtier addresses the cache in its own layout: a block's fragments are, per layer,
    per K/V, per KV head, the run of ``block_tokens`` x ``head_dim`` values (contiguous in
    [1, H, T, D]), handed to ``kvtier.tiers.gpu.device_storage`` as one [blocks, run] view per head.
    The plain API (``KVTier.load``) takes contiguous block arrays, and a stack of host and disk tiers
    builds no CUDA backend, so the stack is built here with the backends a CUDA destination needs.

Reference, in the same run
    ``speedup`` = prefill time / load time: how much faster a hit gives the engine the prefix's KV
    than computing it again. ``ratio`` (the last line's JSON) is that speedup for a load from host
    memory at the largest prefix; GB/s counts the KV bytes of the prefix. ``raw disk GB/s`` is the
    disk's own speed: as many bytes of the slab file read with O_DIRECT by 8 threads in 32 MiB reads
    (what fio would do with that queue depth), for the disk loads to be read against.

Correctness
    Every load must find the whole prefix in the tier it is meant to come from, with no failed block,
    and give back the prefill's K and V bit for bit (``torch.equal`` per layer). Then one decode step
    runs on the loaded cache, on the prefill's own cache and on a copy of it (math attention), and the
    loaded cache's logits must equal the prefill cache's, or differ no more than the copy's do (on an
    H200 the fused attention kernels gave logits 1 bf16 step apart for bit-equal caches). The script
    prints every figure, then exits non-zero if any check failed.

Run: ``python bench/hit_value.py`` on a GPU (sized for about 2 minutes on an H200), or
``.venv/bin/python bench/hit_value.py --device cpu --tiny --prefixes 256,512`` to check the logic.
Options: ``--prefixes 2048,8192,32768 --block-tokens 256 --repeat 3 --disk-path DIR``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import LlamaConfig, LlamaForCausalLM

from kvtier.builder import build_stack, config_layout
from kvtier.core.config import load_config
from kvtier.core.devices import FILE_DEVICE, HOST_DEVICE
from kvtier.core.keys import chain_hashes
from kvtier.core.stack import TierStack
from kvtier.core.storage import StridedStorage
from kvtier.tiers.disk.files import SLAB_NAME
from kvtier.tiers.disk.io import private_buffer
from kvtier.tiers.gpu import device_storage
from kvtier.transfers import backends_for

NAMESPACE = "bench-hit-value"
TIMEOUT_S = 300.0  # the longest a store or load may take before the run counts as failed
FEWER_RUNS_FROM = 16384  # prefixes this long are timed one run fewer (a 32k prefill takes seconds)
MiB = 1 << 20
START = time.perf_counter()


def progress(message: str) -> None:
    """A line on stderr with the seconds since start: where a run that is cut off got to."""
    print(f"[{time.perf_counter() - START:6.1f}s] {message}", file=sys.stderr, flush=True)


def model_config(tiny: bool) -> LlamaConfig:
    """Llama-3-8B's shape, or a 2-layer model of the same kind for a CPU."""
    layers, hidden, ffn, heads, kv_heads, dims, vocab = (
        (2, 256, 512, 4, 2, 64, 1000) if tiny else (32, 4096, 14336, 32, 8, 128, 128256)
    )
    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=dims,
        vocab_size=vocab,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        attn_implementation="sdpa",
    )


def random_model(config: LlamaConfig, device: str) -> LlamaForCausalLM:
    """The model built directly on ``device`` in bf16, so its random init runs there (on a GPU: in
    about a second for 8B parameters) and no full-precision copy is ever made."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        torch.manual_seed(0)
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def kv_pairs(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values) of a DynamicCache: ``layers[i].keys`` in transformers 5, ``key_cache``
    before."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))


def make_contiguous(cache) -> None:
    """Make every K and V tensor contiguous [1, H, T, D], in place in the cache. Transformers 5 builds
    them so (its first update concatenates); older versions keep the projection's transposed view."""
    for i, (keys, values) in enumerate(kv_pairs(cache)):
        if hasattr(cache, "layers"):
            cache.layers[i].keys, cache.layers[i].values = keys.contiguous(), values.contiguous()
        else:
            cache.key_cache[i], cache.value_cache[i] = keys.contiguous(), values.contiguous()


def cache_storage(pairs: list[tuple[torch.Tensor, torch.Tensor]], block_tokens: int, layout) -> StridedStorage:
    """The cache as kvtier blocks: fragment (layer, K/V, head) of block b is tokens [b*bt, (b+1)*bt) of
    that head, one run of bt x head_dim values. Each head's [T, D] plane viewed as [blocks, bt*D]
    has its blocks along dimension 0, which is what ``device_storage`` addresses."""
    planes = []
    for keys, values in pairs:
        for tensor in (keys, values):
            _, heads, tokens, dims = tensor.shape
            planes += [tensor[0, h].view(tokens // block_tokens, block_tokens * dims) for h in range(heads)]
    return device_storage(planes, layout)


def stack_config(pairs, block_tokens: int, blocks: int, disk_dir: str) -> dict:
    """A host tier that holds one copy of the prefix over a disk tier that holds two, write-through:
    every stored block reaches the disk, and storing the second copy pushes the first out of host."""
    keys = pairs[0][0]
    fragments = len(pairs) * 2 * keys.shape[1]
    return {
        "block_tokens": block_tokens,
        "block_bytes": fragments * block_tokens * keys.shape[3] * keys.element_size(),
        "fragments": fragments,
        "namespace": NAMESPACE,
        "placement": "write_through",
        "tiers": [
            {"medium": "host", "capacity_blocks": blocks, "eviction": "lru"},
            {"medium": "disk", "path": disk_dir, "capacity_blocks": 2 * blocks, "eviction": "lru"},
        ],
    }


def open_stack(config: dict, device: str) -> TierStack:
    """The stack with the backends a load into ``device`` needs too (the CUDA one on a GPU)."""
    parsed = load_config(config)
    backends = backends_for(parsed.transfer, {HOST_DEVICE, FILE_DEVICE, device}, parsed.tiers)
    return build_stack(parsed, config_layout(parsed), backends)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def prefill_ms(model, ids: torch.Tensor, runs: int, device: str):
    """Median prefill time over ``runs`` after one warm-up, every run's time, and the last run's cache."""
    times = []
    cache = None
    for run in range(runs + 1):
        cache = None  # the previous run's cache goes before this run builds its own
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            cache = model(input_ids=ids, use_cache=True, logits_to_keep=1).past_key_values
            end.record()
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            began = time.perf_counter()
            cache = model(input_ids=ids, use_cache=True, logits_to_keep=1).past_key_values
            elapsed = (time.perf_counter() - began) * 1000
        if run:
            times.append(elapsed)
    return statistics.median(times), times, cache


def timed_load(stack: TierStack, keys: list[bytes], dst: StridedStorage, zero: Callable[[], None], device: str):
    """One load of every key into ``dst`` after zeroing it: (ms until the future resolved and the device
    synchronised, the LoadResult). The gpu medium: on a CPU too the load takes the GPU's route."""
    zero()
    sync(device)
    began = time.perf_counter()
    result = stack.load(keys, dst, range(len(keys)), dst_medium="gpu").result(TIMEOUT_S)
    sync(device)
    return (time.perf_counter() - began) * 1000, result


def load_problems(result, tier: str, src, dst) -> list[str]:
    """What is wrong with a load meant to bring every block from ``tier``: a short prefix, failed
    blocks, another source, or bytes that differ from the prefill's."""
    problems = []
    if result.hits != result.requested or result.loaded != result.requested or result.failed:
        problems.append(f"load from {tier}: {result.loaded}/{result.requested} blocks, failed {result.failed}")
    if set(result.sources) != {tier}:
        problems.append(f"load from {tier}: blocks came from {result.per_tier}")
    same = all(torch.equal(a, b) for (ka, va), (kb, vb) in zip(src, dst, strict=True) for a, b in ((ka, kb), (va, vb)))
    if not same:
        problems.append(f"load from {tier}: loaded KV differs from the prefill's")
    return problems


def store_ms(stack: TierStack, keys: list[bytes], source: StridedStorage, problems: list[str]) -> float:
    """Store every block of ``source`` under ``keys`` and wait for the write-through copy to disk; the
    ms until the store's future resolved (the blocks are in host memory then)."""
    began = time.perf_counter()
    stored = stack.store(keys, source, range(len(keys))).result(TIMEOUT_S)
    elapsed = (time.perf_counter() - began) * 1000
    stack.wait_idle(TIMEOUT_S)
    if stored.stored != len(keys):
        problems.append(f"store: {stored.stored}/{len(keys)} blocks stored")
    return elapsed


def kvtier_times(ids: torch.Tensor, src, dst, kv_bytes: int, runs: int, args: argparse.Namespace, work: str) -> dict:
    """Store the prefill's KV (``src``, ``kv_bytes`` in all) in a fresh stack, then time ``args.repeat``
    loads into ``dst`` from host memory and ``runs`` from disk, and ``runs`` raw reads of as many bytes of
    the disk tier's slab; every load is checked against ``src``."""
    device, bt = args.device, args.block_tokens
    blocks = ids.shape[1] // bt
    copies = [chain_hashes(ids[0].tolist(), bt, NAMESPACE + suffix) for suffix in ("/a", "/b")]
    disk_dir = os.path.join(work, f"disk-{ids.shape[1]}")
    times: dict = {"problems": [], "host": [], "disk": []}

    def zero() -> None:
        for pair in dst:
            for tensor in pair:
                tensor.zero_()

    def load(keys: list[bytes], tier: str) -> None:
        ms, result = timed_load(stack, keys, target, zero, device)
        times[tier].append(ms)
        times["problems"] += load_problems(result, tier, src, dst)

    stack = open_stack(stack_config(src, bt, blocks, disk_dir), device)
    try:
        times["disk_tier"] = stack.tiers[1].note
        source = cache_storage(src, bt, stack.tiers[0].storage.layout)
        target = cache_storage(dst, bt, stack.tiers[0].storage.layout)
        times["store"] = store_ms(stack, copies[0], source, times["problems"])
        for _ in range(args.repeat):
            load(copies[0], "host")
        progress(f"{ids.shape[1]} tokens: load from host {statistics.median(times['host']):.1f} ms")
        store_ms(stack, copies[1], source, times["problems"])  # pushes copy a out of host memory
        for run in range(runs):
            load(copies[run % 2], "disk")  # each load's staging pushes the other copy out of host
        progress(f"{ids.shape[1]} tokens: load from disk {statistics.median(times['disk']):.1f} ms")
        times["raw_disk"] = [raw_read_ms(os.path.join(disk_dir, SLAB_NAME), kv_bytes) for _ in range(runs)]
    finally:
        stack.close(TIMEOUT_S)
        shutil.rmtree(disk_dir, ignore_errors=True)
    return times


def decode_problems(model, step: torch.Tensor, cache, loaded_cache) -> list[str]:
    """One decode step on the loaded cache, on the prefill's own cache and on a copy of it, with the
    math attention kernel (the fused kernels' rounding may vary from call to call): the loaded cache
    must give the prefill cache's logits, or differ from them no more than its own copy does."""

    def logits(past) -> torch.Tensor:
        with sdpa_kernel(SDPBackend.MATH):
            return model(input_ids=step, past_key_values=past, use_cache=True, logits_to_keep=1).logits.float()

    twin = copy.deepcopy(cache)  # decoding appends to a cache: copies first
    loaded, prefill, again = logits(loaded_cache), logits(cache), logits(twin)
    diff, noise = (loaded - prefill).abs().max().item(), (again - prefill).abs().max().item()
    return (
        []
        if diff <= noise
        else [f"decode step: logits differ by {diff:.3g} (a copy of the prefill cache: {noise:.3g})"]
    )


def raw_read_ms(path: str, nbytes: int, threads: int = 8, piece: int = 32 * MiB) -> float:
    """The disk's own speed for the reference: ``nbytes`` of ``path`` read with O_DIRECT in ``piece``
    reads by ``threads`` threads at once (as fio would with that queue depth), in ms."""
    nbytes = min(nbytes, os.path.getsize(path))
    piece = max(4096, min(piece, nbytes // threads // 4096 * 4096))
    nbytes = nbytes // piece * piece
    buffers = [private_buffer(piece) for _ in range(threads)]  # page-aligned (O_DIRECT), on huge pages as the tier's
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    try:

        def read(worker: int) -> None:
            for offset in range(worker * piece, nbytes, threads * piece):
                os.preadv(fd, [buffers[worker]], offset)

        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, range(threads)))
        return (time.perf_counter() - start) * 1e3
    finally:
        os.close(fd)


def measure(model, tokens: int, args: argparse.Namespace, work: str) -> dict:
    """One row: prefill, loads from host and from disk, and the decode check, for one prefix."""
    device = args.device
    generator = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=generator).to(device)
    runs = args.repeat - 1 if tokens >= FEWER_RUNS_FROM and args.repeat > 1 else args.repeat
    prefill, prefill_runs, cache = prefill_ms(model, ids, runs, device)
    progress(f"{tokens} tokens: prefill {prefill:.1f} ms")
    make_contiguous(cache)
    loaded_cache = copy.deepcopy(cache)
    src, dst = kv_pairs(cache), kv_pairs(loaded_cache)
    kv_bytes = sum(t.numel() * t.element_size() for pair in src for t in pair)
    times = kvtier_times(ids, src, dst, kv_bytes, runs, args, work)
    times["problems"] += decode_problems(model, ids[:, -1:], cache, loaded_cache)
    host, disk = statistics.median(times["host"]), statistics.median(times["disk"])
    return {
        "prefix_tokens": tokens,
        "blocks": tokens // args.block_tokens,
        "kv_mib": round(kv_bytes / MiB, 1),
        "prefill_ms": round(prefill, 3),
        "host_load_ms": round(host, 3),
        "host_gbps": round(kv_bytes / host / 1e6, 2),
        "disk_load_ms": round(disk, 3),
        "disk_gbps": round(kv_bytes / disk / 1e6, 2),
        "speedup_host": round(prefill / host, 3),
        "speedup_disk": round(prefill / disk, 3),
        "raw_disk_gbps": round(kv_bytes / statistics.median(times["raw_disk"]) / 1e6, 2),
        "store_ms": round(times["store"], 3),
        "runs_ms": {
            "prefill": prefill_runs,
            "host": times["host"],
            "disk": times["disk"],
            "raw_disk": times["raw_disk"],
        },
        "disk_tier": times["disk_tier"],
        "problems": times["problems"],
    }


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU ({platform.machine()}, {os.cpu_count()} cores)"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model of the same kind (for a CPU)")
    parser.add_argument("--prefixes", default="2048,8192,32768", help="prefix lengths in tokens, comma-separated")
    parser.add_argument("--block-tokens", type=int, default=256, help="tokens per kvtier block")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per figure (one fewer from 16k tokens)")
    parser.add_argument("--disk-path", help="the disk tier's directory goes in a fresh folder under this")
    args = parser.parse_args()
    args.prefixes = sorted(int(p) for p in args.prefixes.split(","))
    if args.repeat < 1 or args.block_tokens < 1:
        parser.error("--repeat and --block-tokens must be positive")
    if any(p < args.block_tokens or p % args.block_tokens for p in args.prefixes):
        parser.error(f"every prefix must be a positive multiple of --block-tokens ({args.block_tokens})")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: use --device cpu --tiny")
    return args


def main() -> int:
    args = parse_args()
    model = random_model(model_config(args.tiny), args.device)
    progress(f"model ready on {args.device}")
    rows, errors = [], []
    with tempfile.TemporaryDirectory(prefix="kvtier-hit-value-", dir=args.disk_path) as work, torch.no_grad():
        for tokens in args.prefixes:
            try:
                rows.append(measure(model, tokens, args, work))
            except Exception as exc:  # a one-shot run still reports the other prefixes; exits 1 below
                traceback.print_exc()
                errors.append(f"{tokens} tokens: {type(exc).__name__}: {exc}")
            if args.device == "cuda":
                torch.cuda.empty_cache()  # the caches of this prefix are gone; room for the next one's
    name = device_name(args.device)
    if not rows:
        print(json.dumps({"ratio": None, "ok": False, "device": name, "errors": errors}))
        return 1
    shape = "tiny Llama (2 layers)" if args.tiny else "Llama-3-8B shape"
    print(f"{name}: {shape}, random bf16 weights; kvtier blocks of {args.block_tokens} tokens")
    print(f"disk tier: {rows[-1]['disk_tier']}")
    print(
        f"{'prefix':>7} {'KV MiB':>8} {'prefill ms':>11} {'host ms':>9} {'GB/s':>6} {'disk ms':>9} {'GB/s':>6}", end=""
    )
    print(f" {'raw disk GB/s':>14} {'recompute/host':>15} {'recompute/disk':>15}")
    for r in rows:
        print(
            f"{r['prefix_tokens']:>7} {r['kv_mib']:>8.1f} {r['prefill_ms']:>11.2f} {r['host_load_ms']:>9.2f} "
            f"{r['host_gbps']:>6.2f} {r['disk_load_ms']:>9.2f} {r['disk_gbps']:>6.2f} {r['raw_disk_gbps']:>14.2f} "
            f"{r['speedup_host']:>14.2f}x {r['speedup_disk']:>14.2f}x"
        )
    problems = errors + [p for r in rows for p in r["problems"]]
    for problem in problems:
        print(f"CHECK FAILED: {problem}")
    summary = {
        "ratio": rows[-1]["speedup_host"],
        "ratio_disk": rows[-1]["speedup_disk"],
        "ratio_prefix_tokens": rows[-1]["prefix_tokens"],
        "ok": not problems,
        "errors": errors,
        "device": name,
        "model": shape,
        "block_tokens": args.block_tokens,
        "torch": torch.__version__,
        "rows": rows,
    }
    print(json.dumps(summary))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
