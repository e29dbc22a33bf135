"""A fleet of engines on one shared store: throughput, latency and hits while a store node dies.

What is measured
    ``--engines`` processes (8), each an engine of its own: one kvtier stack (a small host tier over
    the remote tier, write-through) used by ``--threads`` request threads (2), replaying its share of
    the Mooncake trace in ``--trace`` (the shared data set: requests whose ``hash_ids`` repeat across
    requests are shared prefixes, and every engine sees some of every prefix), each request capped
    at ``--max-blocks`` blocks of ``--block-bytes``. A request is what an engine does with a prompt:
    look its blocks up, load the leading ones found (``load_now``: the load's store calls run on the
    request's thread; checking every byte: a block's content is its key repeated, so a block under the
    wrong name is caught), and store the rest (``store_now``: the copy into the host tier runs on the
    request's thread, as the raw path copies into its staging memory there). The store is started by
    this script on loopback: ``redis``, a Redis Cluster of 3 masters with a replica each
    (``tests/helpers/redis_cluster.py``); ``mooncake``, a mooncake_master with two segment owners
    (``tests/helpers/mooncake_server.py``). Every engine runs for ``--duration`` seconds (60) from a
    common start; at ``--kill-at`` of it (0.5) one master (Redis) or one segment owner (Mooncake) is
    SIGKILLed.

Reference, in the same run, by the same processes and threads
    Every engine alternates, in step with the others, between ``--window`` seconds (5) of kvtier and
    as many of the store's own Python client driven with the same batches (its own names, so both
    populate the store alike): redis-py's ``RedisCluster`` (a
    pipeline of ``EXISTS``, of ``GET``, of ``SET``), and ``MooncakeDistributedStore``
    (``batch_is_exist``, ``batch_get_into``, ``batch_put_from``). Its calls are bounded by the same
    timeout where the client has one (redis-py's socket timeout; Mooncake's have none). Its puts run
    as kvtier's copies to the store do, in the background (``BackgroundPuts``: the request copies its
    blocks into as much staging memory as kvtier's host tier and goes on; as many put threads as
    kvtier has clients): with the puts on the request's thread, the raw path's windows held less
    concurrent work than kvtier's, and its loads were faster for that alone (2026-11-27: kvtier's
    ratio 0.61 that way; 0.92 with kvtier's requests waiting for their copies instead).
    With ``--raw-checked`` the raw client also does the work kvtier's guarantees cost it: it hashes
    every record it reads (xxh3, as kvtier checks a record's data before serving it) and Mooncake's
    reads land in registered memory of its own, copied into the request's buffer from there (kvtier
    stages through its host tier, where a read abandoned at its deadline may still land without
    touching memory the engine uses). What is left between the paths then is kvtier's own code.

Figures, per path (kvtier, raw)
    load GB/s: bytes loaded bit-exact / the seconds spent in load calls, times the callers (engines x
    threads): the fleet's aggregate rate while it loads, whatever share of blocks it found.
    delivered GB/s: bytes loaded / the seconds that path ran (hits and load speed together: the two
    paths replay different requests in their windows, so their hit ratios differ). Store, load and
    lookup latency p50/p99 (a store returns once kvtier's host tier, or the raw path's staging memory,
    holds the blocks; the copy to the store follows in the background). Hit ratio (blocks found /
    blocks asked) of the requests started before the kill and of those started at least ``--settle``
    seconds (2) after it. Requests that hung (a call that did not
    return within 10 x the timeout: 0 expected), blocks that came back wrong (0 expected), calls that
    raised (``errors``: the raw client's while a node is gone; kvtier's do not raise). CPU ms per
    request: the engines' CPU time in the path's windows (every thread of the process; copies still
    running when a window ends count in the next) / the path's requests: with 8 engines on 2 cores the
    loads of the path whose requests take less CPU are faster. For kvtier,
    ``store_reads_per_block``: records the engines read from the store / blocks their requests found
    only there (below 1 where requests of one engine waiting for the same block share one read), and
    the remote tiers' counters summed (``remote_tier``: stores committed, dropped (``aborted``: the
    store did not take them within the timeout, or refused them) and skipped as already there, loads,
    errors); for the raw client, its background puts (``puts``: batches put, dropped, failed, and the
    records the store refused in the batches put).

Ratio, over the same batches
    The paths replay other requests in their windows and so load prefixes of other lengths, and a
    small load costs more per byte. So the ratio compares the same batches: per batch size (blocks a
    load asked for) each path's mean load time, weighted by how many loads of that size kvtier made
    (``same_batches``; sizes the raw client never loaded are left out and counted). The plain GB/s of
    all loads is printed beside it (``ratio_all_loads``), and the same batches' ratio with each load's
    lookup counted in (``same_batches_with_lookup``): kvtier answers most lookups from what it knows,
    so its load is often the request's first round trip to the store and pays for waking the store's
    servers on an oversubscribed machine, where the raw client's load follows its ``EXISTS``.

The last line printed is one JSON object: ``ratio`` = the worse over the stores run of kvtier's load
GB/s / the raw client's over the same batches, then every figure per store.

Run: ``.venv/bin/python bench/fleet.py [--store both|redis|mooncake] [--engines 8] [--duration 60]
[--raw-checked]``
(about 2 x (duration + 20) s on two cores; ``--engines 2 --duration 10`` for a quick check).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import xxhash

from kvtier import KVTier
from kvtier.replay.trace import load_trace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the servers of the tests' helpers

TRACE = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"
NAMESPACE = "bench-fleet"
HOST_BLOCKS_PER_THREAD = 2  # x max-blocks: enough to stage a request (Mooncake's loads; Redis's go straight
# into the request's buffer), too few to keep the shared prefixes
PATHS = ("kvtier", "raw")
HUNG_FACTOR = 10  # a call that takes this many timeouts hung
OWNER_SIZE = "1GB"  # each Mooncake segment owner's store memory
NODE_MEMORY = "1gb"  # each Redis node's maxmemory (the cluster evicts, as a store in service does)
POOL_SIZE = 4  # Mooncake clients per engine for loads and stores (Redis: its default pool of 4)


def block_key(hash_id: int) -> bytes:
    """The trace's chained block id as a 16-byte key: equal ids, equal keys, in every engine."""
    return hashlib.blake2b(b"%d" % hash_id, digest_size=16).digest()


def content(key: bytes, block_bytes: int) -> bytes:
    """A block's bytes: its key repeated (a block read under another key is caught)."""
    return key * (block_bytes // len(key))


# --- the raw clients --------------------------------------------------------------------------


class RawRedis:
    """redis-py's cluster client: pipelines grouped by node, as an engine author would write it. With
    ``checked`` it hashes each record it reads before copying it out (``--raw-checked``)."""

    def __init__(self, seeds: list[str], timeout: float, checked: bool = False) -> None:
        import redis
        from redis.cluster import ClusterNode

        self.checked = checked
        nodes = [ClusterNode(urlsplit(seed).hostname, urlsplit(seed).port) for seed in seeds]
        self.client = redis.RedisCluster(startup_nodes=nodes, socket_timeout=timeout, socket_connect_timeout=timeout)

    def _pipe(self, commands: list[tuple]) -> list:
        pipe = self.client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return pipe.execute(raise_on_error=False)

    def exists(self, names: list[str]) -> list[bool]:
        return [reply == 1 for reply in self._pipe([("EXISTS", name) for name in names])]

    def get(self, names: list[str], out: np.ndarray) -> list[bool]:
        ok = []
        for i, value in enumerate(self._pipe([("GET", name) for name in names])):
            good = isinstance(value, bytes) and len(value) == out.shape[1]
            if good:
                if self.checked:
                    xxhash.xxh3_64_intdigest(value)
                out[i] = np.frombuffer(value, np.uint8)
            ok.append(good)
        return ok

    def put(self, names: list[str], blocks: np.ndarray) -> int:
        """Records the store refused (an error reply: a master gone, out of memory)."""
        replies = self._pipe([("SET", name, memoryview(block)) for name, block in zip(names, blocks, strict=True)])
        return sum(isinstance(reply, Exception) for reply in replies)

    def close(self) -> None:
        self.client.close()


class RawMooncake:
    """A ``MooncakeDistributedStore`` of its own, reading into and writing from registered buffers.
    ``landings`` (``--raw-checked``): per request buffer (by its address) registered memory of its own
    that a get reads into first; each record is hashed there, then copied into the request's buffer."""

    def __init__(
        self, master: str, metadata: str, buffers: list[np.ndarray], landings: dict[int, np.ndarray] | None = None
    ) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        if self.store.setup("127.0.0.1", metadata, 0, 0, "tcp", "", master) != 0:
            raise RuntimeError("Mooncake setup failed")
        self.landings = landings or {}
        for buffer in [*buffers, *self.landings.values()]:
            self.store.register_buffer(buffer.ctypes.data, buffer.nbytes)

    def exists(self, names: list[str]) -> list[bool]:
        return [code == 1 for code in self.store.batch_is_exist(names)]

    def get(self, names: list[str], out: np.ndarray) -> list[bool]:
        size, landing = out.shape[1], self.landings.get(out.ctypes.data)
        into = out if landing is None else landing[: len(names)]
        codes = self.store.batch_get_into(names, [into[i].ctypes.data for i in range(len(names))], [size] * len(names))
        ok = [code == size for code in codes]
        if landing is not None:
            for i in range(len(names)):
                if ok[i]:
                    xxhash.xxh3_64_intdigest(into[i])
            out[: len(names)] = into
        return ok

    def put(self, names: list[str], blocks: np.ndarray) -> int:
        """Records the store refused (a negative code: no room, an owner gone)."""
        size = blocks.shape[1]
        codes = self.store.batch_put_from(
            names, [blocks[i].ctypes.data for i in range(len(names))], [size] * len(names)
        )
        return sum(code < 0 for code in codes)

    def close(self) -> None:
        self.store.close()


class BackgroundPuts:
    """The raw client's puts as kvtier's copies to the store run: the request hands its blocks over and
    goes on. They are copied into one of ``staging``'s buffers (as many blocks as kvtier's host tier; a
    request waits up to ``timeout`` for a free one, else its put is dropped, as kvtier's store waits for
    room) and put by ``workers`` threads (kvtier's clients per engine); a put that waited more than
    ``timeout`` for a thread is dropped, as kvtier drops a copy no client took within its deadline.
    ``counts``: batches put, dropped and failed (raised), and records the store refused in batches put
    (as kvtier counts a refused record among its dropped copies, ``aborted``)."""

    def __init__(
        self, put: Callable[[list[str], np.ndarray], int], staging: list[np.ndarray], workers: int, timeout: float
    ) -> None:
        self._put, self._timeout = put, timeout
        self._free = list(staging)
        self._room = threading.Condition()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="raw-put")
        self.counts = {"put": 0, "dropped": 0, "failed": 0, "refused_records": 0}

    def put(self, names: list[str], blocks: np.ndarray) -> None:
        if not names:
            return
        with self._room:
            if not self._room.wait_for(lambda: self._free, self._timeout):
                self.counts["dropped"] += 1  # (under the lock: the counts are the workers' too)
                return
            buffer = self._free.pop()
        buffer[: len(names)] = blocks
        self._pool.submit(self._run, time.monotonic(), names, buffer)

    def _run(self, queued: float, names: list[str], buffer: np.ndarray) -> None:
        outcome, refused = "dropped", 0
        try:
            if time.monotonic() - queued <= self._timeout:
                refused = self._put(names, buffer[: len(names)])
                outcome = "put"
        except Exception:
            outcome = "failed"
        with self._room:
            self.counts[outcome] += 1
            self.counts["refused_records"] += refused
            self._free.append(buffer)
            self._room.notify()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


# --- one engine (a process of its own) -------------------------------------------------------


def engine(rank: int, spec: dict) -> dict:
    """Replay this engine's requests from ``spec["start"]`` for ``spec["duration"]`` s, alternating kvtier
    and the raw client; returns one record per request and the stack's counters."""
    block, timeout, threads = spec["block_bytes"], spec["timeout"], spec["threads"]
    kv = KVTier.open(spec["config"])
    records: list[dict] = []
    lock = threading.Lock()
    buffers = [np.zeros((spec["max_blocks"], block), np.uint8) for _ in range(2 * threads)]
    staging = [np.zeros((spec["max_blocks"], block), np.uint8) for _ in range(HOST_BLOCKS_PER_THREAD * threads)]
    if spec["store"] == "redis":
        raw = RawRedis(spec["seeds"], timeout, spec["raw_checked"])
    else:
        outs = buffers[::2] if spec["raw_checked"] else []  # (each request thread's ``out``)
        landings = {out.ctypes.data: np.zeros_like(out) for out in outs}
        raw = RawMooncake(spec["master"], spec["metadata"], buffers + staging, landings)
    puts = BackgroundPuts(raw.put, staging, POOL_SIZE, timeout)
    requests = spec["requests"][rank]
    time.sleep(max(0.0, spec["start"] - time.time()))
    stop = spec["start"] + spec["duration"]

    def caller(t: int) -> None:
        out, data = buffers[2 * t], buffers[2 * t + 1]
        i = t
        while time.time() < stop:
            ids = requests[i % len(requests)]
            path = PATHS[int((time.time() - spec["start"]) / spec["window"]) % 2]
            record = request(kv, raw, puts, path, ids, out, data, block, timeout)
            record["t"] = record["t"] - spec["start"]
            with lock:
                records.append(record)
            i += threads

    workers = [threading.Thread(target=caller, args=(t,)) for t in range(threads)]
    for worker in workers:
        worker.start()
    cpu = cpu_by_path(spec["start"], stop, spec["window"])
    for worker in workers:
        worker.join()
    stats = kv.stats()
    puts.close()
    with contextlib.suppress(Exception):  # a store node is dead: closing may report it
        kv.close()
    with contextlib.suppress(Exception):
        raw.close()
    return {"records": records, "stats": stats, "raw_puts": puts.counts, "cpu_s": cpu}


def cpu_by_path(start: float, stop: float, window: float) -> dict[str, float]:
    """This process's CPU seconds (every thread: the stack's, the clients' own) in each path's windows,
    read at every window's end until ``stop``: on a machine whose cores are all taken, a path's loads
    are as fast as its work per request is small. Copies still running when a window ends count in
    the next one."""
    cpu = dict.fromkeys(PATHS, 0.0)
    turn, before = 0, time.process_time()
    while (end := min(stop, start + (turn + 1) * window)) > start + turn * window:
        time.sleep(max(0.0, end - time.time()))
        now = time.process_time()
        cpu[PATHS[turn % 2]] += now - before
        turn, before = turn + 1, now
    return cpu


def request(
    kv: KVTier, raw, puts: BackgroundPuts, path: str, ids, out: np.ndarray, data: np.ndarray, block: int, timeout: float
) -> dict:
    """One prompt: look up, load the leading blocks found (checked), store the rest."""
    keys = [block_key(h) for h in ids]
    n = len(keys)
    for i, key in enumerate(keys):
        data[i] = np.frombuffer(content(key, block), np.uint8)
    record = {"t": time.time(), "path": path, "blocks": n, "hits": 0, "loaded": 0, "wrong": 0, "hung": 0, "remote": 0}
    record["errors"] = 0  # calls that raised (the raw client's, when a node is gone): a miss or a drop
    limit = HUNG_FACTOR * timeout
    start = time.perf_counter()
    if path == "kvtier":
        found = kv.locate(keys)
        hits, record["remote"] = found.hits, sum(1 for tier in found.tiers if tier == "remote")
    else:
        names = [f"raw/{key.hex()}" for key in keys]
        present = raised(record, raw.exists, names) or [False] * n
        hits = present.index(False) if False in present else n
    record["lookup_s"] = time.perf_counter() - start
    record["hits"] = hits
    if hits:
        out[:hits] = 0
        start = time.perf_counter()
        if path == "kvtier":
            try:
                result = kv.load_now(keys[:hits], out[:hits], limit)
                ok = [i not in result.failed for i in range(result.hits)] + [False] * (hits - result.hits)
            except TimeoutError:
                record["hung"] += 1
                ok = [False] * hits
        else:
            ok = raised(record, raw.get, names[:hits], out[:hits]) or [False] * hits
        record["load_s"] = time.perf_counter() - start
        record["hung"] += record["load_s"] > limit
        for i in range(hits):
            if ok[i] and not np.array_equal(out[i], data[i]):
                record["wrong"] += 1
                ok[i] = False
        record["loaded"] = ok.index(False) if False in ok else hits
    start = time.perf_counter()
    if path == "kvtier":
        try:
            kv.store_now(keys, data[:n], limit)
        except TimeoutError:
            record["hung"] += 1
    else:
        puts.put(names[hits:n], data[hits:n])
    record["store_s"] = time.perf_counter() - start
    record["hung"] += record["store_s"] > limit or record["lookup_s"] > limit
    return record


def raised(record: dict, call, *args):
    """``call(*args)``, or None (counted in the record's ``errors``) when it raises."""
    try:
        return call(*args)
    except Exception:
        record["errors"] += 1
        return None


# --- the stores -------------------------------------------------------------------------------


@contextlib.contextmanager
def redis_fleet_store(work: Path, timeout: float) -> Iterator[tuple[dict, dict, object]]:
    """A 3-master cluster with a replica each; the tier, the raw client's settings, and what to kill."""
    from helpers.redis_cluster import redis_cluster

    with redis_cluster(work / "redis", masters=3, replicas=1, maxmemory=NODE_MEMORY) as cluster:
        tier = {
            "medium": "remote",
            "backend": "redis",
            "timeout": timeout,
            "redis": {"url": cluster.url, "cluster": True, "seeds": cluster.seeds[1:]},
        }
        yield tier, {"seeds": cluster.seeds}, lambda: cluster.kill(cluster.masters()[0])


@contextlib.contextmanager
def mooncake_fleet_store(work: Path, timeout: float) -> Iterator[tuple[dict, dict, object]]:
    """A master with two segment owners; the tier, the raw client's settings, and what to kill."""
    from helpers.mooncake_server import mooncake_problem, mooncake_store

    problem = mooncake_problem()
    if problem is not None:
        raise SystemExit(f"cannot run the Mooncake part: {problem}")
    with mooncake_store(2, OWNER_SIZE) as (master, owners):
        tier = master.tier(timeout)
        tier["mooncake"]["pool_size"] = POOL_SIZE
        yield tier, {"master": master.address, "metadata": master.metadata_url}, owners[0].kill


STORES = {"redis": redis_fleet_store, "mooncake": mooncake_fleet_store}


def run_store(store: str, args: argparse.Namespace, chains: list[list[int]]) -> dict:
    """Start the store, run the engines, kill a node mid-run, and sum up."""
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-fleet-") as work:
        with STORES[store](Path(work), args.timeout) as (tier, raw, kill):
            host = {"medium": "host", "capacity_blocks": HOST_BLOCKS_PER_THREAD * args.threads * args.max_blocks}
            spec = {
                "store": store,
                "config": {
                    "block_bytes": args.block_bytes,
                    "namespace": NAMESPACE,
                    "tiers": [{**host, "eviction": "lru"}, tier],
                },
                "block_bytes": args.block_bytes,
                "timeout": args.timeout,
                "threads": args.threads,
                "max_blocks": args.max_blocks,
                "duration": args.duration,
                "window": args.window,
                "raw_checked": args.raw_checked,
                "requests": [chains[e :: args.engines] for e in range(args.engines)],
                "start": time.time() + args.warmup,
                **raw,
            }
            kill_at = spec["start"] + args.kill_at * args.duration
            context = multiprocessing.get_context("spawn")
            with context.Pool(args.engines) as pool:
                pending = pool.starmap_async(engine, [(e, spec) for e in range(args.engines)])
                time.sleep(max(0.0, kill_at - time.time()))
                kill()
                print(f"  {store}: killed a node at {time.time() - spec['start']:.1f} s", flush=True)
                results = pending.get(args.duration + args.warmup + 60 * args.timeout + 60)
    return summarize(results, args, kill_at - spec["start"])


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50_ms": float("nan"), "p99_ms": float("nan")}
    ordered = sorted(values)
    return {
        "p50_ms": 1e3 * statistics.median(ordered),
        "p99_ms": 1e3 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
    }


def path_seconds(duration: float, window: float) -> dict[str, float]:
    """How long each path ran: windows taken in turn, kvtier first, until ``duration``."""
    seconds = dict.fromkeys(PATHS, 0.0)
    start, turn = 0.0, 0
    while start < duration:
        seconds[PATHS[turn % 2]] += min(window, duration - start)
        start, turn = start + window, turn + 1
    return seconds


def summarize(results: list[dict], args: argparse.Namespace, killed: float) -> dict:
    records = [r for result in results for r in result["records"]]
    out: dict = {"killed_at_s": killed, "requests": len(records)}
    ran = path_seconds(args.duration, args.window)
    callers = args.engines * args.threads
    for path in PATHS:
        mine = [r for r in records if r["path"] == path]
        loads = [r for r in mine if "load_s" in r]
        loaded_bytes = sum(r["loaded"] for r in loads) * args.block_bytes
        load_seconds = sum(r["load_s"] for r in loads)
        before = [r for r in mine if r["t"] < killed]
        after = [r for r in mine if r["t"] >= killed + args.settle]
        out[path] = {
            "requests": len(mine),
            "load_gbps": loaded_bytes / load_seconds * callers / 1e9 if load_seconds else 0.0,
            "delivered_gbps": loaded_bytes / ran[path] / 1e9,
            "loaded_gb": loaded_bytes / 1e9,
            "load": percentiles([r["load_s"] for r in loads]),
            "store": percentiles([r["store_s"] for r in mine]),
            "lookup": percentiles([r["lookup_s"] for r in mine]),
            "hit_ratio_before_kill": sum(r["hits"] for r in before) / max(1, sum(r["blocks"] for r in before)),
            "hit_ratio_after_kill": sum(r["hits"] for r in after) / max(1, sum(r["blocks"] for r in after)),
            "cpu_ms_per_request": 1e3 * sum(result["cpu_s"][path] for result in results) / max(1, len(mine)),
            "hung": sum(r["hung"] for r in mine),
            "wrong_blocks": sum(r["wrong"] for r in mine),
            "errors": sum(r["errors"] for r in mine),
        }
    remote = [result["stats"].get("remote", {}) for result in results]
    out["kvtier"]["remote_tier"] = {
        name: sum(stats.get(name, 0) for stats in remote)
        for name in ("committed", "aborted", "skipped_existing", "hits", "read_errors", "lookup_errors")
    }
    out["raw"]["puts"] = {name: sum(r["raw_puts"][name] for r in results) for name in results[0]["raw_puts"]}
    reads = out["kvtier"]["remote_tier"]["hits"]
    needed = sum(r["remote"] for r in records if r["path"] == "kvtier")
    out["kvtier"]["store_reads_per_block"] = reads / needed if needed else float("nan")
    out["ratio_all_loads"] = out["kvtier"]["load_gbps"] / out["raw"]["load_gbps"] if out["raw"]["load_gbps"] else 0.0
    out["same_batches"] = same_batches(records, args.block_bytes, callers)
    # kvtier answers most lookups from what it knows, so its load is often the request's first round trip
    # to the store, where the raw client's follows its EXISTS: on an oversubscribed machine the first one
    # pays for waking the store's servers. Lookup and load together compare the requests' store time.
    out["same_batches_with_lookup"] = same_batches(
        records, args.block_bytes, callers, lambda r: r["lookup_s"] + r["load_s"]
    )
    out["ratio"] = out["same_batches"]["ratio"]
    return out


def same_batches(
    records: list[dict], block_bytes: int, callers: int, took: Callable[[dict], float] = lambda r: r["load_s"]
) -> dict:
    """Both paths' load rate over the same batches: per batch size (blocks a load asked for), each
    path's mean load time, weighted by how many loads of that size kvtier made; sizes only one path
    loaded are left out (``sizes_left_out``: kvtier's loads of them). The paths replay other requests in
    their windows and find other prefixes, so their plain GB/s compare loads of other sizes, and a
    small load costs more per byte. ``took``: a request's seconds that count (its load's, or its
    lookup's and load's)."""
    times: dict[str, dict[int, list[float]]] = {path: {} for path in PATHS}
    for r in records:
        if "load_s" in r:
            times[r["path"]].setdefault(r["hits"], []).append(took(r))
    kvtier, raw = times["kvtier"], times["raw"]
    shared = [n for n in kvtier if n in raw]
    loads = {n: len(kvtier[n]) for n in shared}
    asked = sum(count * n for n, count in loads.items()) * block_bytes
    seconds = {
        "kvtier": sum(sum(kvtier[n]) for n in shared),
        "raw": sum(count * statistics.fmean(raw[n]) for n, count in loads.items()),
    }
    gbps = {path: asked / s * callers / 1e9 if s else 0.0 for path, s in seconds.items()}
    return {
        "kvtier_gbps": gbps["kvtier"],
        "raw_gbps": gbps["raw"],
        "ratio": gbps["kvtier"] / gbps["raw"] if gbps["raw"] else 0.0,
        "sizes_left_out": sum(len(kvtier[n]) for n in kvtier if n not in raw),
    }


def print_store(store: str, figures: dict) -> None:
    print(f"\n{store}: {figures['requests']} requests, a node killed at {figures['killed_at_s']:.1f} s")
    print(
        f"  {'path':7} {'load GB/s':>9} {'delivered':>9} {'load p50/p99 ms':>16} {'lookup p50/p99':>15} "
        f"{'store p50/p99':>15} "
        f"{'hits before/after':>18} {'CPU ms/req':>10} {'hung':>5} {'wrong':>6} {'errors':>7}"
    )
    for path in ("kvtier", "raw"):
        f = figures[path]
        print(
            f"  {path:7} {f['load_gbps']:9.2f} {f['delivered_gbps']:9.2f} "
            f"{f['load']['p50_ms']:7.1f}/{f['load']['p99_ms']:<8.1f} "
            f"{f['lookup']['p50_ms']:6.1f}/{f['lookup']['p99_ms']:<8.1f} {f['store']['p50_ms']:6.1f}/"
            f"{f['store']['p99_ms']:<8.1f} {f['hit_ratio_before_kill']:8.3f}/{f['hit_ratio_after_kill']:<9.3f} "
            f"{f['cpu_ms_per_request']:10.1f} {f['hung']:5d} {f['wrong_blocks']:6d} {f['errors']:7d}"
        )
    print(f"  kvtier store reads per block found only there: {figures['kvtier']['store_reads_per_block']:.3f}")
    print(f"  kvtier's remote tiers, summed: {figures['kvtier']['remote_tier']}")
    print(f"  the raw client's background puts, summed: {figures['raw']['puts']}")
    same = figures["same_batches"]
    print(
        f"  load GB/s over the same batches (kvtier's mix of sizes): kvtier {same['kvtier_gbps']:.2f}, raw "
        f"{same['raw_gbps']:.2f}; ratio {same['ratio']:.3f} (all loads: {figures['ratio_all_loads']:.3f})"
    )
    both = figures["same_batches_with_lookup"]
    print(f"  the same with each load's lookup counted in: ratio {both['ratio']:.3f}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--store", choices=["both", *STORES], default="both")
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--threads", type=int, default=2, help="request threads per engine")
    p.add_argument("--duration", type=float, default=60.0, help="seconds every engine runs")
    p.add_argument("--window", type=float, default=5.0, help="seconds of one path before the other's turn")
    p.add_argument("--kill-at", type=float, default=0.5, help="when a node is killed, as a share of the duration")
    p.add_argument("--settle", type=float, default=2.0, help="seconds after the kill not counted in either hit ratio")
    p.add_argument("--warmup", type=float, default=15.0, help="seconds the engines get to start before the run")
    p.add_argument("--block-bytes", type=int, default=256 * 1024)
    p.add_argument("--max-blocks", type=int, default=16, help="blocks per request at most")
    p.add_argument("--timeout", type=float, default=1.0, help="the remote tier's timeout, s")
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--requests", type=int, default=4000, help="trace requests replayed (cycled)")
    p.add_argument(
        "--raw-checked",
        action="store_true",
        help="the raw client also hashes every record it reads and (Mooncake) reads into memory of its own first",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    chains = [list(r.hash_ids[: args.max_blocks]) for r in load_trace(args.trace)[: args.requests] if r.hash_ids]
    stores = list(STORES) if args.store == "both" else [args.store]
    print(
        f"{args.engines} engines x {args.threads} threads, {args.duration:g} s per store, blocks of "
        f"{args.block_bytes // 1024} KiB, at most {args.max_blocks} per request, timeout {args.timeout:g} s",
        flush=True,
    )
    figures = {store: run_store(store, args, chains) for store in stores}
    for store, result in figures.items():
        print_store(store, result)
    summary = {
        "ratio": min(result["ratio"] for result in figures.values()),
        "engines": args.engines,
        "threads": args.threads,
        "duration_s": args.duration,
        "block_bytes": args.block_bytes,
        "raw_checked": args.raw_checked,
        **figures,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
