"""kvtier's disk tier as SGLang's storage backend against SGLang's own ``file`` backend, in the same run on the
same disk. Runs in the SGLang venv: ``build/venv-sglang/bin/python bench/sglang_storage.py`` (``make bench-sglang``).

What is measured
    1. The backends alone, on SGLang's real host pool (``helpers.sglang_pools``, an MHA pool of
       ``--layers`` x ``--kv-heads`` x ``--head-dim`` in bf16, ``--page`` tokens a page, ``--layout``),
       as SGLang's cache controller drives them: kvtier through the zero-copy interface
       (``batch_set_v1`` / ``batch_get_v1`` of the pool's pages), the ``file`` backend through the
       generic one it implements (the controller copies each page out with ``get_data_page`` before
       ``batch_set``, and back with ``set_from_flat_data_page`` after ``batch_get``; both inside the
       time, as in SGLang). Batches of ``--batch`` pages (SGLang's batches are at most 128), new keys
       for every store, loads of what was stored into other pages, every loaded page compared with
       what was stored (after the timing).
       GB/s of page bytes, best of ``--repeat``.
    2. A real SGLang server on CPU (``sglang_server.harness``: a random-weight Llama, HiCache with the
       direct IO backend) with each backend: per prompt, a first request computes and stores it, then
       ``POST /flush_cache`` empties SGLang's device and host caches, and the same prompt again is a
       storage hit; its latency is timed. ``--prompts`` prompts of ``--prompt-tokens`` tokens; the
       median of their storage-hit latencies per backend. The second request's output tokens must
       equal the first's and its ``cached_tokens_details.storage`` must cover the prompt's full pages
       but the last (SGLang computes at least one token).

Reference and ratio
    ``ratio`` = the ``file`` backend's median storage-hit latency / kvtier's: >= 1 means kvtier serves a
    storage hit at least as fast as SGLang's own file backend, while checking every page it loads (slot
    header: key, namespace, length; xxh3 checksum of the bytes) where the file backend reads bytes back
    unchecked. The page cache is warm for both (the file backend writes through it; kvtier's disk tier
    uses O_DIRECT where the filesystem allows, so its loads read the device).

The last line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests")]  # helpers.sglang_pools and sglang_server.harness


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


# --- 1. the backends alone -------------------------------------------------------------------------


def backend_figures(args: argparse.Namespace, directory: Path) -> tuple[dict[str, dict[str, float]], int]:
    """GB/s of stores and loads per backend, best of ``args.repeat``, every loaded page checked; the page size."""
    import torch
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    from helpers import sglang_pools as pools

    pool = pools.mha_host_pool(
        args.layout,
        layers=args.layers,
        heads=args.kv_heads,
        head_dim=args.head_dim,
        page=args.page,
        device_pages=args.batch,
    )
    page_bytes = pool.get_dummy_flat_data_page().view(torch.uint8).numel()
    kvtier = pools.open_backend(
        pool,
        {
            "tiers": [
                {
                    "medium": "disk",
                    "path": str(directory / "kvtier"),
                    "capacity": 4 * args.repeat * args.batch * (page_bytes + 4096),
                    "o_direct": args.o_direct,
                }
            ]
        },
    )
    file_cfg = pools.storage_config({"file_storage_path": str(directory / "file")}, pool)
    file = StorageBackendFactory.create_backend("file", file_cfg, pool)
    src, dst = range(0, args.batch), range(args.batch, 2 * args.batch)
    times: dict[str, dict[str, list[float]]] = {name: {"store": [], "load": []} for name in ("kvtier", "file")}
    try:
        for round_ in range(args.repeat):  # the backends take turns, so a disk's drift touches both alike
            for name in times:
                pools.fill(pool, round_)
                names = pools.keys(args.batch, f"{name}-{round_}-")
                expected = [pools.page_bytes(pool, p) for p in src]
                started = time.perf_counter()
                if name == "kvtier":
                    ok = kvtier.batch_set_v1(names, pools.indices(src, args.page))
                else:
                    ok = [file.batch_set(names, [pool.get_data_page(p * args.page) for p in src])]
                times[name]["store"].append(time.perf_counter() - started)
                pools.zero_pages(pool, dst)
                started = time.perf_counter()
                if name == "kvtier":
                    got = kvtier.batch_get_v1(names, pools.indices(dst, args.page))
                else:
                    pages = file.batch_get(names, [pool.get_dummy_flat_data_page() for _ in names])
                    got = [page is not None for page in pages]
                    for p, page in zip(dst, pages, strict=True):
                        if page is not None:
                            pool.set_from_flat_data_page(p * args.page, page)
                times[name]["load"].append(time.perf_counter() - started)
                if (
                    not all(ok)
                    or not all(got)
                    or not all(torch.equal(pools.page_bytes(pool, p), e) for p, e in zip(dst, expected, strict=True))
                ):
                    raise SystemExit(f"{name}: a page did not round-trip (stored {ok}, loaded {got})")
    finally:
        kvtier.close()
    batch_bytes = args.batch * page_bytes
    out = {
        name: {f"{op}_GBps": round(batch_bytes / min(t) / 1e9, 3) for op, t in ops.items()}
        for name, ops in times.items()
    }
    return out, page_bytes


# --- 2. a storage hit in a real server ------------------------------------------------------------


def server_figures(args: argparse.Namespace, directory: Path) -> dict[str, dict]:
    """Per backend: the median storage-hit latency over the prompts, and what SGLang reported."""
    from sglang_server.harness import Server, flush_cache, generate, make_model

    model = make_model(directory / "model")
    prompts = [[(7 * p + 13 * i) % 900 + 50 for i in range(args.prompt_tokens)] for p in range(args.prompts)]
    backends = {
        "kvtier": {
            "backend_name": "kvtier",
            "module_path": "kvtier.connectors.sglang.backend",
            "class_name": "KVTierStorage",
            "interface_v1": 1,
            "prefetch_threshold": 4,
            "config": {"tiers": [{"medium": "disk", "path": str(directory / "kvtier-server"), "capacity": "1GiB"}]},
        },
        "file": {"file_storage_path": str(directory / "file-server"), "prefetch_threshold": 4},
    }
    out = {}
    for name, extra in backends.items():
        storage = "dynamic" if name == "kvtier" else "file"
        with Server(model, directory / "logs", storage=storage, extra_config=extra, name=name) as server:
            latencies, storage_tokens = [], []
            for prompt in prompts:
                first = generate(server.url, prompt, args.new_tokens)
                time.sleep(args.settle)  # SGLang backs pages up to storage in the background
                flush_cache(server.url)
                started = time.perf_counter()
                hit = generate(server.url, prompt, args.new_tokens)
                latencies.append(time.perf_counter() - started)
                if hit.ids != first.ids:
                    raise SystemExit(f"{name}: the storage hit generated other tokens")
                storage_tokens.append(hit.cached()["storage"])
        out[name] = {
            "hit_ms_median": round(1000 * statistics.median(latencies), 2),
            "hit_ms": [round(1000 * t, 2) for t in latencies],
            "storage_tokens": storage_tokens,
            "start_s": server.start_s,
        }
        full = (args.prompt_tokens - 1) // 4 * 4
        if min(storage_tokens) < full:
            raise SystemExit(f"{name}: storage served {storage_tokens} tokens, not the {full} of every prompt's pages")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page", type=int, default=16, help="tokens per page (part 1)")
    parser.add_argument(
        "--layout",
        default="layer_first",
        choices=["layer_first", "page_first", "page_first_direct"],
        help="the host pool's layout (part 1): a page is 2 x layers runs, or 2",
    )
    parser.add_argument("--batch", type=int, default=64, help="pages per storage call (part 1)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--o-direct", default="auto", choices=["auto", "on", "off"], help="kvtier's disk tier (part 1)")
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=1021)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--settle", type=float, default=1.0, help="seconds for SGLang's background backup")
    parser.add_argument("--dir", default=None, help="where both backends keep their files (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        directory = Path(tmp)
        print(f"{cpu_model()}, {os.cpu_count()} CPUs; files in {directory}", flush=True)
        backends, page_bytes = backend_figures(args, directory)
        print(f"backends alone, {args.batch} pages of {page_bytes / 2**20:.2f} MiB per call, best of {args.repeat}:")
        for name, figures in backends.items():
            print(f"  {name:7s} store {figures['store_GBps']:6.3f} GB/s   load {figures['load_GBps']:6.3f} GB/s")
        servers = server_figures(args, directory)
        print(f"storage hit in a real SGLang server, {args.prompt_tokens}-token prompts, median of {args.prompts}:")
        for name, figures in servers.items():
            print(
                f"  {name:7s} {figures['hit_ms_median']:8.2f} ms  (all: {figures['hit_ms']}, storage tokens "
                f"{figures['storage_tokens']})"
            )
    ratio = servers["file"]["hit_ms_median"] / servers["kvtier"]["hit_ms_median"]
    print(
        json.dumps(
            {
                "ratio": round(ratio, 3),
                "cpu": cpu_model(),
                "page_bytes": page_bytes,
                "backends": backends,
                "servers": servers,
                "settings": {k: v for k, v in vars(args).items() if k != "dir"},
            }
        )
    )


if __name__ == "__main__":
    main()
