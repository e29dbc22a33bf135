"""kvtier's remote tier against the store's own client: stores and loads of whole blocks, and lookups.

What is measured
    For each backend (Mooncake Store, Redis), against servers this script starts on free loopback
    ports (``tests/helpers``: a mooncake_master with a standalone segment owner, a redis-server), for
    blocks of 2 MiB and 256 KiB, ``--blocks`` blocks per batch:

    - kvtier: the remote transfer backend (``kvtier.tiers.remote.transfer.RemoteBackend``) running one
      ``Transfer`` per batch between a host slab (``kvtier.tiers.host.HostSlab``, with the page of
      header room before each slot that a host tier above a remote one keeps) and the store's
      records (``RemoteStorage``), from ``submit`` until ``on_complete``: a store is each record's
      header (its checksum; the MAC when on) and one batched put through the link's deadline-bound
      thread; a load is one batched get into the slots (Redis: one batched fetch into the client's
      bytes, copied into the slots once checked), then each header, checksum (and MAC) checked.
    - stack: the same through ``KVTier`` (a host tier with the store below it, write-through): one
      stack stores the blocks (``store`` until ``wait_idle``: caller -> host -> store), a second one,
      whose host tier does not hold them, loads them (Mooncake: store -> host -> caller, one more
      memcpy than the backend's load; Redis: store -> caller, fetched). Reported apart.
    - lookups: one batched existence query of 64 keys, through ``RemoteTier.query`` and through the
      client's own call; p50 and p99 latency.
    - the MAC (``auth_key_env`` set to a 32-byte secret): the same kvtier store and load with it;
    - sealed (``encryption: aes-gcm``, a 32-byte secret): the same with every record sealed (sealed into
      a buffer of the job on the way out, opened where it lands on the way in).

Reference, in the same run, on the same server and the same slab memory
    Mooncake: ``MooncakeDistributedStore.batch_put_from`` / ``batch_get_into`` of the same slots, the
    slab registered with that client (zero-copy). kvtier's put first removes the names (forced:
    Mooncake's put keeps an existing record), so every round stores fresh names on both sides, and
    that extra remove is timed on its own (``remove_missing``, and ``remove_present`` for names that
    are stored). Redis: a redis-py (hiredis) pipeline of ``SET`` of the slots, and one ``MGET`` whose
    values are copied into the same slots (kvtier copies each value into its slot too); redis-py's
    command packing copies every value it sends, kvtier's client sends the slots as they are, so
    kvtier can beat this reference. Lookups: ``batch_is_exist``, and a pipeline of 64 ``EXISTS``.

    The parts of a round (kvtier plain, the reference, kvtier with the MAC, kvtier sealed) take turns
    going first, and each part's records are removed once it is timed, so all see the same machine
    and store state (a part that ran after the others wrote into memory the store had to grow: the
    sealed part, always last, measured 0.58 of plain on Redis that way, 0.8-0.96 in turn); every
    figure is the median of ``--repeat`` rounds after three untimed ones (the first checks that both
    paths bring the bytes back bit-exact; by the third every host slot of the stacks has been touched,
    so no round pays first-touch page faults). Throughput counts block bytes only (kvtier's headers are
    its overhead), in GB/s (1e9).

The last line printed is one JSON object. ``ratio`` is the smallest, over the backends run, of
min(store, load) kvtier / reference throughput for 2 MiB blocks with the MAC off (``ratio_by_backend``
per backend); the per-size figures (GB/s, median ms per batch), the stack, lookup and MAC figures
(``mac_cost_ms``: what the MAC adds per batch) are in it too. ``sealed_ratio``: the smallest, over the
backends run, of min(store, load) sealed / plain throughput for 2 MiB blocks (per backend in each
size's figures, with ``sealed_over_mac``: sealed / MAC). Mooncake's client logs to stderr.

Run: ``.venv/bin/python bench/remote.py [--backend both|mooncake|redis] [--blocks 64] [--repeat 11]``
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import json
import os
import secrets
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from kvtier import KVTier
from kvtier.core.layout import BlockLayout
from kvtier.core.transfer import Transfer
from kvtier.tiers.host import HostSlab
from kvtier.tiers.remote.config import HEADER_ROOM, RemoteTierConfig
from kvtier.tiers.remote.factory import connector, record_format, remote_tier
from kvtier.tiers.remote.link import StoreLink
from kvtier.tiers.remote.tier import RemoteStorage
from kvtier.tiers.remote.transfer import RemoteBackend

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the servers of the tests' helpers

KiB, MiB, GB = 1 << 10, 1 << 20, 1e9
SIZES = (2 * MiB, 256 * KiB)
HEADLINE = 2 * MiB
LOOKUP_KEYS = 64
TIMEOUT = 30.0  # the tier's deadline: far above any batch here, so it measures throughput, not deadlines
NAMESPACE = "bench-remote"
MAC_ENV = "KVTIER_BENCH_REMOTE_MAC"
SEAL_ENV = "KVTIER_BENCH_REMOTE_SEAL"
RECORDS = ("plain", "mac", "sealed")
"""How records are written: as they are, with a MAC, sealed."""
TOKENS = 16  # tokens per block in the stacks
STACK_HOST_BATCHES = 3  # each stack's host tier holds this many batches (LRU: each round evicts the oldest)
WARMUP_ROUNDS = STACK_HOST_BATCHES  # untimed: every host slot of the stacks touched once (no page faults after)
OWNER_SIZE = "2GB"  # the segment owner's store memory: a round holds at most 4 batches of 128 MiB


# --- the reference: each backend's own client --------------------------------------------------


class MooncakeReference:
    """A ``MooncakeDistributedStore`` of its own, set up as kvtier sets up its client, with the slab
    registered."""

    def __init__(self, master) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        code = self.store.setup("127.0.0.1", master.metadata_url, 0, 0, "tcp", "", master.address)
        if code != 0:
            raise RuntimeError(f"Mooncake setup failed with code {code}")

    def register(self, slab: HostSlab) -> None:
        code = self.store.register_buffer(slab.address, slab.nbytes)
        if code != 0:
            raise RuntimeError(f"Mooncake could not register the slab (code {code})")

    def put(self, names: list[str], pieces: list[tuple[int, int]]) -> None:
        codes = self.store.batch_put_from(names, [a for a, _ in pieces], [s for _, s in pieces])
        if any(code != 0 for code in codes):
            raise RuntimeError(f"batch_put_from failed: codes {sorted(set(codes))}")

    def get(self, names: list[str], pieces: list[tuple[int, int]]) -> None:
        codes = self.store.batch_get_into(names, [a for a, _ in pieces], [s for _, s in pieces])
        if any(code != size for code, (_, size) in zip(codes, pieces, strict=True)):
            raise RuntimeError(f"batch_get_into failed: codes {sorted(set(codes))}")

    def exists(self, names: list[str]) -> list[bool]:
        return [code == 1 for code in self.store.batch_is_exist(names)]

    def remove(self, names: list[str]) -> None:
        self.store.batch_remove(names, True)

    def close(self) -> None:
        self.store.close()


class RedisReference:
    """A redis-py client (hiredis parser): pipelined ``SET``, one ``MGET``, pipelined ``EXISTS``."""

    def __init__(self, url: str) -> None:
        import redis

        self.client = redis.Redis.from_url(url, socket_timeout=TIMEOUT)

    def register(self, slab: HostSlab) -> None:
        """Nothing to register: redis-py sends and receives through its socket."""

    def put(self, names: list[str], pieces: list[tuple[int, int]]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for name, piece in zip(names, pieces, strict=True):
            pipe.set(name, view(piece))
        if not all(pipe.execute()):
            raise RuntimeError("a SET failed")

    def get(self, names: list[str], pieces: list[tuple[int, int]]) -> None:
        for value, piece in zip(self.client.mget(names), pieces, strict=True):
            if value is None or len(value) != piece[1]:
                raise RuntimeError("MGET missed a record")
            view(piece)[:] = value

    def exists(self, names: list[str]) -> list[bool]:
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.exists(name)
        return [reply == 1 for reply in pipe.execute()]

    def remove(self, names: list[str]) -> None:
        self.client.delete(*names)

    def close(self) -> None:
        self.client.close()


def view(piece: tuple[int, int]) -> memoryview:
    """The bytes of an (address, size) piece of the slab."""
    address, size = piece
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


# --- servers and configs -----------------------------------------------------------------------


@contextlib.contextmanager
def mooncake_store() -> Iterator[tuple[dict, Callable[[], MooncakeReference]]]:
    from helpers.mooncake_server import MooncakeMaster, SegmentOwner, mooncake_problem

    problem = mooncake_problem()
    if problem is not None:
        raise SystemExit(f"cannot run the Mooncake part: {problem}")
    with MooncakeMaster() as master, SegmentOwner(master, OWNER_SIZE):
        yield {"master": master.address, "metadata_server": master.metadata_url}, lambda: MooncakeReference(master)


@contextlib.contextmanager
def redis_store() -> Iterator[tuple[dict, Callable[[], RedisReference]]]:
    from helpers.redis_server import redis_server

    with tempfile.TemporaryDirectory(prefix="kvtier-bench-redis-") as work, redis_server(Path(work)) as server:
        yield {"url": server.url}, lambda: RedisReference(server.url)


STORES = {"mooncake": mooncake_store, "redis": redis_store}


def tier_config(backend: str, options: dict, records: str = "plain") -> dict:
    config = {"medium": "remote", "backend": backend, "timeout": TIMEOUT, backend: options}
    if records == "mac":
        config["auth_key_env"] = MAC_ENV
    elif records == "sealed":
        config.update(encryption="aes-gcm", encryption_key_env=SEAL_ENV)
    return config


def stack_config(tier: dict, block_bytes: int, blocks: int) -> dict:
    return {
        "block_tokens": TOKENS,
        "block_bytes": block_bytes,
        "namespace": NAMESPACE,
        "tiers": [{"medium": "host", "capacity_blocks": STACK_HOST_BATCHES * blocks, "eviction": "lru"}, tier],
    }


# --- one backend, one block size ---------------------------------------------------------------


class Rig:
    """A slab of random blocks, kvtier's backend (MAC off and on) and the reference between it and the
    store, two stacks, and fresh names for every round."""

    def __init__(self, backend: str, options: dict, reference, block_bytes: int, blocks: int) -> None:
        self.backend_name = backend
        self.layout = BlockLayout.contiguous(block_bytes)
        self.blocks = blocks
        self.slab = HostSlab(blocks, self.layout, HEADER_ROOM)  # as a host tier above a remote one has it
        self.slots = self.slab.array.reshape(blocks, HEADER_ROOM + block_bytes)[:, HEADER_ROOM:]
        self.slots[:] = np.random.default_rng(block_bytes).integers(0, 256, self.slots.shape, dtype=np.uint8)
        self.data = self.slots.copy()
        addresses = self.slab.storage.fragment_addresses(range(blocks))[:, 0].tolist()
        self.pieces = [(address, block_bytes) for address in addresses]
        self.reference = reference
        reference.register(self.slab)
        plain = RemoteTierConfig.model_validate(tier_config(backend, options))
        self.remote = {
            records: RemoteStorage(
                self.layout,
                record_format(
                    RemoteTierConfig.model_validate(tier_config(backend, options, records)), self.layout, NAMESPACE
                ),
            )
            for records in RECORDS
        }
        link = StoreLink(connector(plain), TIMEOUT, "loads and stores")
        self.backend = RemoteBackend(link, plain.fetches)  # (as a stack's: Redis fetches)
        self.tier = remote_tier("remote", plain, self.layout, NAMESPACE)
        stack = stack_config(tier_config(backend, options), block_bytes, blocks)
        self.writer, self.reader = KVTier.open(stack), KVTier.open(stack)
        self.round = 0

    def close(self) -> None:
        for kv in (self.writer, self.reader):
            kv.close()
        self.tier.close()
        self.backend.close()
        del self.slots  # a view of the slab's memory, which cannot be unmapped while views of it exist
        self.slab.close()

    def keys(self, tag: str) -> list[bytes]:
        return [
            hashlib.blake2b(f"{tag}/{self.round}/{i}".encode(), digest_size=16).digest() for i in range(self.blocks)
        ]

    def names(self, keys: list[bytes], records: str = "plain") -> list[str]:
        return [self.remote[records].records.name(key) for key in keys]

    def reference_names(self, keys: list[bytes]) -> list[str]:
        """Names as long as kvtier's, under a prefix of their own."""
        return [name.replace("kvtier/", "refere/", 1) for name in self.names(keys)]

    # kvtier's backend

    def transfer(self, keys: list[bytes], storing: bool, records: str = "plain") -> float:
        """Seconds from submit until on_complete of one batch; raises unless every block made it."""
        slots, remote = list(range(self.blocks)), self.remote[records]
        transfer = (
            Transfer(self.slab.storage, slots, remote, (), keys)
            if storing
            else Transfer(remote, (), self.slab.storage, slots, keys)
        )
        done = threading.Event()
        failed: list[set[int]] = []

        def on_complete(bad, quarantine=None) -> None:
            failed.append(set(bad))
            done.set()

        start = time.perf_counter()
        self.backend.submit(transfer, on_complete)
        if not done.wait(4 * TIMEOUT):
            raise RuntimeError("a kvtier transfer never completed")
        took = time.perf_counter() - start
        if failed[0]:
            raise RuntimeError(
                f"kvtier {'stored' if storing else 'loaded'} {len(failed[0])} of {self.blocks} "
                f"blocks wrong or not at all"
            )
        return took

    # the stacks

    def stack_round(self) -> tuple[float, float]:
        """Seconds of the writer stack's store (until the store holds the blocks) and of the reader
        stack's load of them into a buffer of the caller's, checked bit-exact."""
        data = self.data
        tokens = list(range(self.round * 1_000_000, self.round * 1_000_000 + self.blocks * TOKENS))
        start = time.perf_counter()
        stored = self.writer.store(tokens, data).result(4 * TIMEOUT)
        self.writer.wait_idle(4 * TIMEOUT)
        store_s = time.perf_counter() - start
        out = np.zeros_like(data)
        start = time.perf_counter()
        loaded = self.reader.load(tokens, out).result(4 * TIMEOUT)
        load_s = time.perf_counter() - start
        if stored.stored != self.blocks or loaded.loaded != self.blocks or not np.array_equal(out, data):
            raise RuntimeError(
                f"the stacks stored {stored.stored} and loaded {loaded.loaded} of {self.blocks} "
                f"blocks (or not bit-exact)"
            )
        self.reference.remove(self.names(self.writer.keys(tokens)))
        return store_s, load_s

    # the reference

    def timed(self, fn: Callable[..., object], *args) -> float:
        start = time.perf_counter()
        fn(*args)
        return time.perf_counter() - start

    def check_bit_exact(self, load: Callable[[], object], what: str) -> None:
        self.slots[:] = 0
        load()
        if not np.array_equal(self.slots, self.data):
            raise RuntimeError(f"{what} did not bring the blocks back bit-exact")


def round_times(rig: Rig, verify: bool) -> dict[str, float]:
    """One round: kvtier's store and load of plain records, the reference's put and get, kvtier's with the
    MAC and sealed, in an order that turns by one every round (each in turn first, when the store's
    memory has been given back by the round before), each part's records removed once it is timed (the
    store holds one batch at a time: a part that followed others would write into memory the store
    had to grow for); then the stacks, and (Mooncake) the remove kvtier's put does first."""
    pieces = rig.pieces
    t: dict[str, float] = {}

    def kvtier(records: str) -> Callable[[], None]:
        prefix = "" if records == "plain" else f"{records}_"

        def part() -> None:
            keys = rig.keys(records)
            names = rig.names(keys, records)
            t[f"{prefix}store"] = rig.transfer(keys, storing=True, records=records)
            t[f"{prefix}load"] = rig.transfer(keys, storing=False, records=records)
            if verify:
                rig.check_bit_exact(lambda: rig.transfer(keys, storing=False, records=records), f"a {records} load")
            if records == "plain" and rig.backend_name == "mooncake":  # what kvtier's put removes first
                t["remove_present"] = rig.timed(rig.reference.remove, names)
            else:
                rig.reference.remove(names)

        return part

    def reference() -> None:
        names = rig.reference_names(rig.keys("ref"))
        t["ref_store"] = rig.timed(rig.reference.put, names, pieces)
        t["ref_load"] = rig.timed(rig.reference.get, names, pieces)
        if verify:
            rig.check_bit_exact(lambda: rig.reference.get(names, pieces), "the reference's get")
        rig.reference.remove(names)

    parts = [kvtier("plain"), reference, kvtier("mac"), kvtier("sealed")]
    turn = rig.round % len(parts)
    for part in parts[turn:] + parts[:turn]:
        part()
    t["stack_store"], t["stack_load"] = rig.stack_round()
    if rig.backend_name == "mooncake":  # (names not stored yet)
        t["remove_missing"] = rig.timed(rig.reference.remove, rig.reference_names(rig.keys("missing")))
    rig.round += 1
    return t


def lookup_latencies(rig: Rig, samples: int) -> dict[str, dict[str, float]]:
    """p50/p99 milliseconds of a batched existence query of ``LOOKUP_KEYS`` stored keys, through
    ``RemoteTier.query`` and the client's own call, alternating."""
    keys = rig.keys("lookup")[:LOOKUP_KEYS]
    rig.transfer(rig.keys("lookup"), storing=True)
    names = rig.names(keys)
    seconds: dict[str, list[float]] = {"kvtier": [], "reference": []}
    for _ in range(samples):
        start = time.perf_counter()
        found = rig.tier.query(keys)
        seconds["kvtier"].append(time.perf_counter() - start)
        start = time.perf_counter()
        present = rig.reference.exists(names)
        seconds["reference"].append(time.perf_counter() - start)
        if found != len(keys) or not all(present):
            raise RuntimeError(f"a lookup found {found} (kvtier) / {sum(present)} (client) of {len(keys)} keys")
    rig.reference.remove(rig.names(rig.keys("lookup")))
    return {
        who: {
            "p50_ms": round(float(np.percentile(s, 50)) * 1e3, 3),
            "p99_ms": round(float(np.percentile(s, 99)) * 1e3, 3),
        }
        for who, s in seconds.items()
    }


def summarize(times: list[dict[str, float]], nbytes: int) -> dict:
    med = {name: statistics.median(t[name] for t in times) for name in times[0]}
    gbps = {
        name: round(nbytes / med[name] / GB, 3)
        for name in (
            *("store", "load", "ref_store", "ref_load", "mac_store", "mac_load", "sealed_store", "sealed_load"),
            *("stack_store", "stack_load"),
        )
    }
    return {
        "gbps": gbps,
        "store_ratio": round(med["ref_store"] / med["store"], 3),
        "load_ratio": round(med["ref_load"] / med["load"], 3),
        "ratio": round(min(med["ref_store"] / med["store"], med["ref_load"] / med["load"]), 3),
        "stack_store_ratio": round(med["ref_store"] / med["stack_store"], 3),
        "stack_load_ratio": round(med["ref_load"] / med["stack_load"], 3),
        "sealed_ratio": round(min(med["store"] / med["sealed_store"], med["load"] / med["sealed_load"]), 3),
        "sealed_over_mac": round(min(med["mac_store"] / med["sealed_store"], med["mac_load"] / med["sealed_load"]), 3),
        "mac_cost_ms": {
            "store": round((med["mac_store"] - med["store"]) * 1e3, 2),
            "load": round((med["mac_load"] - med["load"]) * 1e3, 2),
        },
        "ms": {name: round(value * 1e3, 2) for name, value in med.items()},
    }


def bench_size(backend: str, options: dict, make_reference, block_bytes: int, args, lookups: int) -> dict:
    """The figures of one block size; ``lookups`` samples of lookup latency too, unless 0."""
    reference = make_reference()
    try:
        rig = Rig(backend, options, reference, block_bytes, args.blocks)
    except BaseException:
        reference.close()
        raise
    try:
        for i in range(WARMUP_ROUNDS):  # the first checks both paths bit-exact
            round_times(rig, verify=i == 0)
        times = [round_times(rig, verify=False) for _ in range(args.repeat)]
        result = summarize(times, block_bytes * args.blocks)
        result["fetches"] = rig.backend.fetches  # (loads fetched into the caller's memory, not staged)
        if lookups:
            result["lookup"] = lookup_latencies(rig, lookups)
        return result
    finally:
        rig.close()
        reference.close()


def bench_backend(backend: str, args) -> dict[str, dict]:
    """Every block size against one server; lookups (which do not depend on it) with the first."""
    with STORES[backend]() as (options, make_reference):
        results = {
            f"{size // KiB}KiB": bench_size(
                backend, options, make_reference, size, args, args.lookups if size == HEADLINE else 0
            )
            for size in SIZES
        }
    results["lookup"] = results[f"{HEADLINE // KiB}KiB"].pop("lookup")
    return results


def print_backend(backend: str, results: dict[str, dict], blocks: int) -> None:
    print(f"{backend}: {blocks} blocks per batch, median GB/s (kvtier / reference)")
    fetches = results[f"{HEADLINE // KiB}KiB"]["fetches"]
    route = "fetched into the caller" if fetches else "+ a memcpy host -> caller"
    for size in (f"{size // KiB}KiB" for size in SIZES):
        r = results[size]
        g = r["gbps"]
        print(
            f"  {size:>7}  store {g['store']:6.2f} / {g['ref_store']:6.2f} = {r['store_ratio']:.2f}"
            f"   load {g['load']:6.2f} / {g['ref_load']:6.2f} = {r['load_ratio']:.2f}"
        )
        print(
            f"           stack store {g['stack_store']:6.2f} = {r['stack_store_ratio']:.2f} of the client's"
            f"   stack load {g['stack_load']:6.2f} = {r['stack_load_ratio']:.2f} ({route})"
        )
        print(
            f"           MAC on: store {g['mac_store']:6.2f} (+{r['mac_cost_ms']['store']} ms per batch)"
            f"   load {g['mac_load']:6.2f} (+{r['mac_cost_ms']['load']} ms per batch)"
        )
        print(
            f"           sealed: store {g['sealed_store']:6.2f}   load {g['sealed_load']:6.2f}   "
            f"= {r['sealed_ratio']:.2f} of plain, {r['sealed_over_mac']:.2f} of MAC on"
        )
        if "remove_missing" in r["ms"]:
            print(
                f"           kvtier's forced remove before a put: {r['ms']['remove_missing']} ms per batch of new "
                f"names, {r['ms']['remove_present']} ms of stored ones"
            )
    lk = results["lookup"]
    print(
        f"  lookup of {LOOKUP_KEYS} keys (ms): kvtier p50 {lk['kvtier']['p50_ms']} p99 {lk['kvtier']['p99_ms']}; "
        f"client p50 {lk['reference']['p50_ms']} p99 {lk['reference']['p99_ms']}"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("both", "mooncake", "redis"), default="both")
    p.add_argument("--blocks", type=int, default=64, help="blocks per batch (default 64)")
    p.add_argument("--repeat", type=int, default=11, help="timed rounds; medians are reported (default 11)")
    p.add_argument("--lookups", type=int, default=200, help="lookup samples per path (default 200)")
    args = p.parse_args(argv)
    if args.blocks < LOOKUP_KEYS or args.repeat < 1 or args.lookups < 1:
        p.error(f"--blocks must be at least {LOOKUP_KEYS}; --repeat and --lookups at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    os.environ[MAC_ENV] = secrets.token_hex(16)  # 32 bytes
    os.environ[SEAL_ENV] = secrets.token_hex(16)
    backends = ("mooncake", "redis") if args.backend == "both" else (args.backend,)
    results = {backend: bench_backend(backend, args) for backend in backends}
    for backend, result in results.items():
        print_backend(backend, result, args.blocks)
    headline = {backend: result[f"{HEADLINE // KiB}KiB"]["ratio"] for backend, result in results.items()}
    runtime = time.perf_counter() - started
    print(
        f"ratio: min over backends of min(store, load) kvtier / client for {HEADLINE // MiB} MiB blocks, MAC off; "
        f"runtime {runtime:.0f} s"
    )
    print(
        json.dumps(
            {
                "bench": "remote",
                "ratio": min(headline.values()),
                "ratio_by_backend": headline,
                "sealed_ratio": min(result[f"{HEADLINE // KiB}KiB"]["sealed_ratio"] for result in results.values()),
                "reference": {
                    "mooncake": "batch_put_from / batch_get_into, slab registered",
                    "redis": "redis-py pipeline of SET / MGET copied into the slots",
                },
                "blocks": args.blocks,
                "repeat": args.repeat,
                "cpus": os.cpu_count(),
                "runtime_s": round(runtime, 1),
                "results": results,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
