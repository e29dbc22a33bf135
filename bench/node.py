"""One cache per machine: engine processes sharing a node daemon's slab, against each keeping its own host
tier of the same size.

What is measured
    ``--procs`` (1, 2, 4, 8) engine processes, each a standalone ``KVTier`` with one tier: the node tier
    of a daemon this script starts (``kvtier node serve``, its own process), or a private host tier
    (the reference), for ``--block-bytes`` of 256 KiB and 2 MiB. Every process works on the same
    prefix set (``--prefixes`` requests of 16 blocks, the same tokens everywhere; both tiers evict by LRU,
    which stores every block at first sight) and runs, in step
    with the others, ``--seconds`` of loads (``load_now`` of the set's requests in turn, every byte
    checked against what was stored) then as long of stores (``store_now`` of 16 fresh blocks, another
    prompt every time: the tiers fill and evict), after as many untimed stores as fill the tier's
    capacity once (each process its share of the node slab; all of its private tier): the first touch of
    each page, and this VM's huge-page compaction, cost the private path up to 10 ms per store at 8
    processes otherwise, which is not what is compared. The node and private runs of a configuration follow
    each other, with the same processes' work.

Figures, per path
    load and store GB/s: bytes moved by all processes / the phase's wall seconds; CPU ms per request:
    the processes' CPU time in the phase (and the daemon's, for the node path) / requests; control
    microseconds per 16-block request, one process, medians of 2,000, nothing copied: for a load a PIN
    and its RELEASE on the daemon's socket (``control_us``; a load of blocks a lookup located lately
    needs none), for a store a RESERVE of 16 new blocks and its ABORT (``store_control_us``: the round
    trip every store pays, the daemon's evictions left out), and the checksum of 16 blocks in cache
    (``checksum_us``: every store and load hashes what it copies). Those two are what a node store adds
    to a private one, whose whole cost is the copy. Beside them, this machine's floor for any message:
    a bare round trip between two processes in the daemon's framing, no work at either end
    (``socket_rt_us``). Memory:
    with every process holding the prefix set (after the loads), the proportional set size (PSS,
    /proc/PID/smaps) of the tier's memory (the private host slabs; the node slab in every process
    that maps it, the daemon included: a shared page counts once, split among its mappers), and of
    the whole processes.

Hit ratio at the same total memory (``kvtier replay --engines 4 --node``)
    The Mooncake trace (``--trace``) and the generated chat workload split across 4 engines, round robin
    and by session (``kvtier.replay.routing``), through a node daemon's slab of ``--hit-blocks`` blocks
    against 4 private host tiers of a quarter of that each (both adaptive, the default for a last
    tier); every hit checked bit-exact. ``hit_gain``: the node tier's hit ratio over the private tiers',
    the lowest of the four (two traces, two splits).

Ratios
    ``ratio_N``: node / private, the lower of load and store GB/s, at N processes and 256 KiB blocks
    (``ratio_1``, ``ratio_8``; the issue asks >= 0.9 and >= 0.8); ``pss_ratio``: node / private resident
    bytes at the most processes (one copy per machine against one per process: ~1/N expected);
    ``ratio``: ``ratio_1``. The last line is one JSON object with every figure.
    ``pss_ratio`` compares the tiers' memory only (``tier_pss_bytes``).

    .venv/bin/python bench/node.py [--procs 1,2,4,8] [--block-bytes 262144,2097152] [--seconds 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the daemon of the tests' helpers

BLOCKS = 16
TOKENS = 16
TRACE = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"


def request_tokens(index: int) -> list[int]:
    """The tokens of request ``index``: its own 16 blocks, no prefix shared with another request."""
    start = index * BLOCKS * TOKENS
    return list(range(start, start + BLOCKS * TOKENS))


def content(index: int, block_bytes: int) -> np.ndarray:
    """Request ``index``'s blocks: bytes that say which request and block they are."""
    blocks = np.empty((BLOCKS, block_bytes), np.uint8)
    for b in range(BLOCKS):
        blocks[b] = np.random.default_rng(index * BLOCKS + b).integers(0, 256, block_bytes, dtype=np.uint8)
    return blocks


def pss_bytes(pid: int) -> int:
    """The process's proportional set size: its private pages and its share of each shared one."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no Pss in /proc/{pid}/smaps_rollup")


def mapping_pss(pid: int, address: int | None = None, path: str | None = None) -> int:
    """The PSS of the process's mappings that hold ``address`` or map the file ``path``."""
    total, inside = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:  # a mapping's first line: range perms offset dev inode [path]
                start, end = (int(x, 16) for x in head[0].split("-"))
                inside = (address is not None and start <= address < end) or (path is not None and head[-1] == path)
            elif inside and head[0] == "Pss:":
                total += int(head[1]) * 1024
    return total


def tier_memory(kv) -> tuple[int | None, str | None]:
    """Where the stack's one tier keeps its blocks: a host slab's address, or a node slab's file."""
    tier = kv.stack.tiers[0]
    if tier.medium == "node":
        return None, tier.storage.client.slab_path
    return int(tier.storage.fragment_addresses([0])[0, 0]), None


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker(
    config: dict, block_bytes: int, prefixes: int, seconds: float, warm_up: int, rank: int, barrier, results
) -> None:
    """One engine process: store the prefix set, loads for ``seconds``, ``warm_up`` stores, stores for
    ``seconds``."""
    from kvtier import KVTier

    kv = KVTier.open(config)
    sets = [(request_tokens(i), content(i, block_bytes)) for i in range(prefixes)]
    for tokens, blocks in sets:
        kv.store_now(tokens, blocks)
    out = np.empty((BLOCKS, block_bytes), np.uint8)
    barrier.wait()
    loaded = requests = wrong = 0
    cpu, start = time.process_time(), time.perf_counter()
    i = rank
    while time.perf_counter() - start < seconds:
        tokens, blocks = sets[i % prefixes]
        result = kv.load_now(tokens, out)
        loaded += result.loaded * block_bytes
        wrong += int(result.loaded == BLOCKS and not np.array_equal(out, blocks))
        requests += 1
        i += 1
    load = (loaded, time.perf_counter() - start, time.process_time() - cpu, requests)
    pss = pss_bytes(os.getpid()), mapping_pss(os.getpid(), *tier_memory(kv))
    barrier.wait()
    fresh = content(10_000 + rank, block_bytes)
    for warm in range(warm_up):  # every page of the tier once, before the timed stores (see the module doc)
        kv.store_now(request_tokens(200_000_000 + rank * 1_000_000 + warm), fresh)
    barrier.wait()
    stored = requests = 0
    cpu, start = time.process_time(), time.perf_counter()
    while time.perf_counter() - start < seconds:
        result = kv.store_now(request_tokens(100_000 + rank * 1_000_000 + requests), fresh)
        stored += result.stored * block_bytes
        requests += 1
    store = (stored, time.perf_counter() - start, time.process_time() - cpu, requests)
    barrier.wait()
    kv.close()
    results.put({"rank": rank, "load": load, "store": store, "pss": pss, "wrong": wrong})


def run_path(
    config: dict,
    procs: int,
    block_bytes: int,
    prefixes: int,
    seconds: float,
    capacity: int,
    daemon_pid: int | None,
    slab: str,
) -> dict:
    """Run ``procs`` workers on ``config`` (the node path: on the daemon ``daemon_pid`` serving ``slab``);
    the path's figures."""
    shared = daemon_pid is not None  # (the node slab is one for all; each private tier is a process's own)
    warm_up = -(-capacity // (BLOCKS * block_bytes * (procs if shared else 1)))
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(procs + 1), context.Queue()
    workers = [
        context.Process(target=worker, args=(config, block_bytes, prefixes, seconds, warm_up, rank, barrier, results))
        for rank in range(procs)
    ]
    for process in workers:
        process.start()
    barrier.wait(timeout=300)  # stored: the loads begin
    daemon_cpu = cpu_seconds(daemon_pid) if daemon_pid else 0.0
    barrier.wait(timeout=300)  # loads over
    daemon_pss = (pss_bytes(daemon_pid), mapping_pss(daemon_pid, path=slab)) if daemon_pid else (0, 0)
    daemon_load_cpu = (cpu_seconds(daemon_pid) - daemon_cpu) if daemon_pid else 0.0
    barrier.wait(timeout=600)  # warmed up: the stores begin
    daemon_cpu = cpu_seconds(daemon_pid) if daemon_pid else 0.0
    barrier.wait(timeout=300)  # stores over
    daemon_store_cpu = (cpu_seconds(daemon_pid) - daemon_cpu) if daemon_pid else 0.0
    got = [results.get(timeout=300) for _ in workers]
    for process in workers:
        process.join(timeout=60)
    figures: dict = {
        "wrong": sum(g["wrong"] for g in got),
        "pss_bytes": sum(g["pss"][0] for g in got) + daemon_pss[0],
        "tier_pss_bytes": sum(g["pss"][1] for g in got) + daemon_pss[1],
    }
    for phase, daemon_phase_cpu in (("load", daemon_load_cpu), ("store", daemon_store_cpu)):
        moved = sum(g[phase][0] for g in got)
        wall = max(g[phase][1] for g in got)
        cpu = sum(g[phase][2] for g in got) + daemon_phase_cpu
        requests = sum(g[phase][3] for g in got)
        figures[f"{phase}_gbps"] = moved / wall / 1e9
        figures[f"{phase}_cpu_ms_per_request"] = 1e3 * cpu / max(requests, 1)
    return figures


def control_us(socket_path: str, block_bytes: int) -> dict[str, float]:
    """Median microseconds, per 16-block request, nothing copied: a PIN and its RELEASE (``load``: what a
    load of blocks no lookup located lately adds), a RESERVE of 16 new blocks and its ABORT (``store``:
    the round trip a store adds, with the daemon's work short of evictions), and the checksum of 16
    blocks in cache (``checksum``: what a store and a load each add, hashing what they copy)."""
    from kvtier import KVTier
    from kvtier.tiers.node.protocol import Op
    from kvtier.tiers.node.slab import checksum

    config = {"block_tokens": TOKENS, "block_bytes": block_bytes, "tiers": [{"medium": "node", "socket": socket_path}]}
    blocks = content(0, block_bytes)
    with KVTier.open(config) as kv:
        kv.store_now(request_tokens(0), blocks)
        node = kv.stack.tiers[0].storage
        names = node.node_keys(kv.keys(request_tokens(0)))

        def load() -> None:
            (pinned,), epoch, _ = node.client.call(Op.PIN, names, block_bytes)
            node.client.post(Op.RELEASE, epoch, names)
            assert all(pinned)

        def store() -> None:
            fresh = node.node_keys(kv.keys(request_tokens(1)))
            (given,), epoch, _ = node.client.call(Op.RESERVE, fresh, [block_bytes] * BLOCKS, [b""] * BLOCKS)
            node.client.post(Op.ABORT, epoch, fresh)
            assert all(isinstance(answer, list) for answer in given)

        def hash_blocks() -> None:
            for name, block in zip(names, blocks, strict=True):
                checksum(1, name).update(block)

        return {name: median_us(call) for name, call in (("load", load), ("store", store), ("checksum", hash_blocks))}


def echo(sock) -> None:
    """Answer every frame on ``sock`` with ``[OK, *its arguments]``, as a daemon that does no work would."""
    from kvtier.tiers.node.protocol import OK, frame, read_frame

    try:
        while True:
            sock.sendall(frame([OK, *read_frame(sock)[1:]]))
    except EOFError:
        pass


def socket_round_trip_us() -> float:
    """Median microseconds of a bare round trip between two processes on a Unix socket, in the daemon's
    framing, with 16 keys each way and no work at either end: this machine's floor for any control
    message (mostly the two wake-ups, not Python)."""
    import socket

    from kvtier.tiers.node.protocol import Op, frame, read_frame

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    peer = multiprocessing.get_context("fork").Process(target=echo, args=(theirs,))
    peer.start()
    theirs.close()
    keys = [os.urandom(16) for _ in range(BLOCKS)]

    def round_trip() -> None:
        ours.sendall(frame([Op.RESERVE, keys]))
        read_frame(ours)

    try:
        return median_us(round_trip)
    finally:
        ours.close()
        peer.join(timeout=10)


def median_us(call: Callable[[], None], times: int = 2000) -> float:
    """The median microseconds of ``call``, run ``times`` times."""
    took = []
    for _ in range(times):
        start = time.perf_counter()
        call()
        took.append(time.perf_counter() - start)
    return statistics.median(took) * 1e6


def hit_ratios(trace: Path, blocks: int) -> dict:
    """``kvtier replay --engines 4 --node`` on the trace and the chat workload, both splits: node and
    private hit ratios, and their ratio."""
    out: dict = {}
    with tempfile.TemporaryDirectory() as directory:
        config = Path(directory) / "stack.yaml"
        tier = {"medium": "host", "capacity_blocks": blocks}
        config.write_text(json.dumps({"block_tokens": 512, "block_bytes": 4096, "tiers": [tier]}))
        for name, source in (("mooncake", [str(trace)]), ("chat", [])):
            for split in ("round_robin", "session"):
                argv = [*source, "--config", str(config), "--engines", "4", "--split", split, "--node", "--json"]
                done = subprocess.run(
                    [sys.executable, "-m", "kvtier.cli", "replay", *argv], capture_output=True, text=True, check=True
                )
                run = json.loads(done.stdout.strip().splitlines()[-1])
                out[f"{name}_{split}"] = {
                    "node": run["hit_ratio"],
                    "private": run["private"]["hit_ratio"],
                    "gain": run["hit_gain"],
                    "corrupt": run["corrupt_blocks"],
                }
                print(
                    f"hit ratio {name:>8} {split:>11}: node {run['hit_ratio']:.3f}, private "
                    f"{run['private']['hit_ratio']:.3f}, gain {run['hit_gain']:.2f}",
                    flush=True,
                )
    return out


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", default="1,2,4,8")
    parser.add_argument("--block-bytes", default="262144,2097152")
    parser.add_argument("--prefixes", type=int, default=8, help="requests of 16 blocks every process holds")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--trace", type=Path, default=TRACE, help="a Mooncake trace for the hit ratios")
    parser.add_argument("--hit-blocks", type=int, default=4000, help="the node slab's blocks in the hit-ratio runs")
    return parser.parse_args()


def measure_size(args: argparse.Namespace, block_bytes: int, procs: list[int], figures: dict) -> None:
    """One block size: a daemon's control costs, then each process count through the node slab and
    through private host tiers, into ``figures``."""
    from helpers.node_daemon import node_daemon

    held = args.prefixes * BLOCKS * block_bytes
    capacity = 2 * held + 4 * BLOCKS * block_bytes * max(procs)  # the set, and room for stores to churn
    with (
        tempfile.TemporaryDirectory() as directory,
        node_daemon(
            Path(directory), capacity=str(capacity), block_bytes=str(block_bytes), eviction="lru", max_held=1.0
        ) as daemon,
    ):
        assert daemon.process is not None
        control = control_us(daemon.socket, block_bytes)
        figures[f"control_us_{block_bytes}"] = control["load"]
        figures[f"store_control_us_{block_bytes}"] = control["store"]
        figures[f"checksum_us_{block_bytes}"] = control["checksum"]
        print(
            f"control per 16 blocks: load (PIN + RELEASE) {control['load']:.0f} us, store (RESERVE + ABORT) "
            f"{control['store']:.0f} us, checksum {control['checksum']:.0f} us; a bare round trip "
            f"{figures['socket_rt_us']:.0f} us",
            flush=True,
        )
        for n in procs:
            base = {"block_tokens": TOKENS, "block_bytes": block_bytes}
            paths = {
                "node": (base | {"tiers": [daemon.tier(timeout=5.0)]}, daemon.process.pid),
                "private": (base | {"tiers": [{"medium": "host", "capacity": capacity, "eviction": "lru"}]}, None),
            }
            row = {}
            for path, (config, pid) in paths.items():
                row[path] = f = run_path(
                    config, n, block_bytes, args.prefixes, args.seconds, capacity, pid, daemon.slab
                )
                print(
                    f"{block_bytes // 1024:>6}Ki {n:>5}  {path:8} {f['load_gbps']:>9.2f} {f['store_gbps']:>10.2f} "
                    f"{f['load_cpu_ms_per_request']:>11.2f} {f['store_cpu_ms_per_request']:>12.2f} "
                    f"{f['tier_pss_bytes'] / 2**20:>12.0f} {f['pss_bytes'] / 2**20:>8.0f}",
                    flush=True,
                )
            key = f"{block_bytes}_{n}"
            figures[key] = row
            load = row["node"]["load_gbps"] / row["private"]["load_gbps"]
            store = row["node"]["store_gbps"] / row["private"]["store_gbps"]
            figures[f"load_ratio_{key}"], figures[f"store_ratio_{key}"] = load, store
            if block_bytes == 262144:
                figures[f"ratio_{n}"] = min(load, store)
            figures[f"pss_ratio_{key}"] = row["node"]["tier_pss_bytes"] / row["private"]["tier_pss_bytes"]


def main() -> None:
    args = parse_args()
    procs = [int(p) for p in args.procs.split(",")]
    sizes = [int(b) for b in args.block_bytes.split(",")]
    figures: dict = {"socket_rt_us": socket_round_trip_us()}
    print(
        f"{'blocks':>8} {'procs':>5}  {'path':8} {'load GB/s':>9} {'store GB/s':>10} {'load ms CPU':>11} "
        f"{'store ms CPU':>12} {'tier PSS MiB':>12} {'PSS MiB':>8}"
    )
    for block_bytes in sizes:
        measure_size(args, block_bytes, procs, figures)
    figures["hits"] = hit_ratios(args.trace, args.hit_blocks)
    figures["hit_gain"] = min(run["gain"] for run in figures["hits"].values())
    figures["pss_ratio"] = figures[f"pss_ratio_{sizes[0]}_{max(procs)}"]
    figures["ratio"] = figures.get("ratio_1", figures.get(f"ratio_{procs[0]}"))
    figures["wrong"] = sum(
        row[path]["wrong"] for key, row in figures.items() if key[0].isdigit() and isinstance(row, dict) for path in row
    ) + sum(run["corrupt"] for run in figures["hits"].values())
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
