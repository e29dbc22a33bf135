"""One engine's loads from a shared store: kvtier's stack against the store's own client, same batches.

What is measured
    One process, one kvtier stack (a host tier of 2 x ``--blocks`` blocks per thread over the remote
    tier) on a store this script starts on loopback: ``--store redis``, a 3-master Redis Cluster
    (``tests/helpers/redis_cluster.py``); ``--store mooncake``, a mooncake_master with one segment owner
    (``tests/helpers/mooncake_server.py``; kvtier with ``pool_size`` 4, as in ``bench/fleet.py``).
    ``--requests`` prompts of ``--blocks`` blocks of ``--block-bytes`` are stored once, through kvtier
    and, under names of their own, through the raw client. Then ``--threads`` request threads load
    whole prompts in turn (each looks its prompt up, then loads every block into a buffer of its own),
    for ``--seconds`` per path, two rounds per path, kvtier and the raw client alternating. Loads are
    the stack's ``load_now`` (Redis records fetched on the request's thread, checked, copied into the
    buffer; Mooncake records read into host slots, checked, copied into the buffer) and the raw
    client's: ``bench/fleet.py``'s ``RawRedis`` (pipelined ``EXISTS`` and ``GET`` with each value copied
    into the buffer) or ``RawMooncake`` (``batch_is_exist``, ``batch_get_into`` straight into the
    buffer, registered with it). Every request checks that all its blocks were found and loaded.

    With ``--busy N``, N processes spin on the CPU meanwhile: a machine whose cores are all taken,
    where a thread woken by another waits for a core (``bench/fleet.py`` runs 8 engines on 2 cores).

Figures, per path
    load p50 (ms) and GB/s (bytes loaded / seconds in load calls x threads), lookup p50, and CPU
    milliseconds of this process per request (``time.process_time``; both paths' servers excluded).

The last line printed is one JSON object: ``ratio`` = kvtier's load GB/s / the raw client's.

Run: ``.venv/bin/python bench/remote_loads.py [--store redis|mooncake] [--threads 2] [--busy 0] [--seconds 4]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from kvtier import KVTier

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the servers of the tests' helpers
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fleet import POOL_SIZE, RawMooncake, RawRedis, block_key, content  # noqa: E402

PATHS = ("kvtier", "raw")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--store", choices=["redis", "mooncake"], default="redis")
    p.add_argument("--threads", type=int, default=2, help="request threads (default 2)")
    p.add_argument("--busy", type=int, default=0, help="processes spinning on the CPU meanwhile (default 0)")
    p.add_argument("--seconds", type=float, default=4.0, help="seconds per path and round (default 4)")
    p.add_argument("--blocks", type=int, default=16, help="blocks per prompt (default 16)")
    p.add_argument("--block-bytes", type=int, default=256 * 1024, help="bytes per block (default 256 KiB)")
    p.add_argument("--requests", type=int, default=40, help="prompts stored and loaded in turn (default 40)")
    return p.parse_args(argv)


def spin() -> None:
    while True:
        pass


def measure(
    args: argparse.Namespace,
    kv: KVTier,
    raw: RawRedis | RawMooncake,
    prompts: list[list[bytes]],
    outs: list[np.ndarray],
) -> dict:
    """Two rounds per path, alternating, each thread loading into its buffer in ``outs``; per path the
    latencies and the CPU per request."""
    times: dict[str, dict[str, list[float]]] = {path: {"lookup": [], "load": []} for path in PATHS}
    cpu = dict.fromkeys(PATHS, 0.0)
    size = args.block_bytes
    checked: set[tuple[str, int]] = set()

    def caller(t: int, path: str, until: float) -> None:
        out = outs[t]
        i = t
        while time.monotonic() < until:
            keys = prompts[i % len(prompts)]
            i += args.threads
            names = [f"raw/{key.hex()}" for key in keys]
            start = time.perf_counter()
            if path == "kvtier":
                hits = kv.locate(keys).hits
            else:
                present = raw.exists(names)
                hits = present.index(False) if False in present else len(keys)
            found = time.perf_counter()
            if path == "kvtier":
                ok = not kv.load_now(keys[:hits], out[:hits], 30).failed
            else:
                ok = all(raw.get(names[:hits], out[:hits]))
            loaded = time.perf_counter()
            assert hits == len(keys) and ok, f"{path}: a request found {hits} of {len(keys)} blocks, loaded: {ok}"
            if (path, i % len(prompts)) not in checked:  # (each prompt's bytes once per path: CPU counts)
                checked.add((path, i % len(prompts)))
                assert all(
                    np.array_equal(out[j], np.frombuffer(content(k, size), np.uint8)) for j, k in enumerate(keys)
                )
            times[path]["lookup"].append(found - start)
            times[path]["load"].append(loaded - found)

    for _ in range(2):
        for path in PATHS:
            until = time.monotonic() + args.seconds
            before = time.process_time()
            threads = [threading.Thread(target=caller, args=(t, path, until)) for t in range(args.threads)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            kv.wait_idle()
            cpu[path] += time.process_time() - before
    figures = {}
    for path in PATHS:
        loads = times[path]["load"]
        figures[path] = {
            "requests": len(loads),
            "load_p50_ms": round(statistics.median(loads) * 1e3, 3),
            "load_gbps": round(len(loads) * args.blocks * size / sum(loads) * args.threads / 1e9, 3),
            "lookup_p50_ms": round(statistics.median(times[path]["lookup"]) * 1e3, 3),
            "cpu_ms_per_request": round(cpu[path] / len(loads) * 1e3, 3),
        }
    return figures


@contextlib.contextmanager
def store(name: str, outs: list[np.ndarray], data: np.ndarray):
    """Start the store; its remote tier and a raw client (Mooncake's registers ``outs`` and ``data``)."""
    if name == "redis":
        from helpers.redis_cluster import redis_cluster

        with (
            tempfile.TemporaryDirectory() as work,
            redis_cluster(Path(work) / "redis", masters=3, replicas=0, maxmemory="1gb") as cluster,
        ):
            redis = {"url": cluster.url, "cluster": True, "seeds": cluster.seeds[1:]}
            yield {"medium": "remote", "backend": "redis", "timeout": 1.0, "redis": redis}, RawRedis(cluster.seeds, 1.0)
    else:
        from helpers.mooncake_server import mooncake_store

        with mooncake_store(1, "2GB") as (master, _):
            tier = master.tier(1.0)
            tier["mooncake"]["pool_size"] = POOL_SIZE
            yield tier, RawMooncake(master.address, master.metadata_url, [*outs, data])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = [[block_key(r * 1000 + i) for i in range(args.blocks)] for r in range(args.requests)]
    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
    outs = [np.zeros((args.blocks, args.block_bytes), np.uint8) for _ in range(args.threads)]
    data = np.zeros((args.blocks, args.block_bytes), np.uint8)
    with store(args.store, outs, data) as (tier, raw):
        host = {"medium": "host", "capacity_blocks": 2 * args.blocks * args.threads}
        kv = KVTier.open({"block_bytes": args.block_bytes, "namespace": "bench-loads", "tiers": [host, tier]})
        try:
            for keys in prompts:
                for j, key in enumerate(keys):
                    data[j] = np.frombuffer(content(key, args.block_bytes), np.uint8)
                kv.store(keys, data).result(30)
                raw.put([f"raw/{key.hex()}" for key in keys], data)
            kv.wait_idle()
            for spinner in spinners:
                spinner.start()
            figures = measure(args, kv, raw, prompts, outs)
        finally:
            for spinner in spinners:
                spinner.kill()
            kv.close()
            raw.close()
    ratio = figures["kvtier"]["load_gbps"] / figures["raw"]["load_gbps"]
    print(
        f"{args.store}: {args.threads} threads, {args.busy} busy processes, "
        f"{args.blocks} x {args.block_bytes // 1024} KiB loads"
    )
    for path in PATHS:
        f = figures[path]
        print(
            f"  {path:7} load p50 {f['load_p50_ms']:6.2f} ms  {f['load_gbps']:5.2f} GB/s  "
            f"lookup p50 {f['lookup_p50_ms']:5.2f} ms  CPU {f['cpu_ms_per_request']:5.2f} ms per request"
        )
    print(
        json.dumps(
            {
                "bench": "remote_loads",
                "store": args.store,
                "ratio": round(ratio, 3),
                "threads": args.threads,
                "busy": args.busy,
                **figures,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
