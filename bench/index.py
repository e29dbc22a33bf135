"""What the local block index costs at scale: bytes per block, inserts and lookups per second, restart time.

What is measured
    Index: a ``Tier`` over ``SlotCount(layout, n)`` (a storage that is only a slot count: the vLLM
    scheduler side's tiers, whose bytes the workers hold) with each default policy, ``lru`` (an upper
    tier) and ``adaptive`` (the last tier), filled with n distinct random 16-byte keys (what
    ``chain_hashes`` gives) in batches of 32 the way the scheduler side stores a block: ``admit``,
    then ``reserve`` of the admitted prefix, then ``commit`` (``Planner.store`` asks ``Tier.admit``
    and reserves; ``Planner.finish`` commits). Not ``restore``: that is only the disk tier's restart
    path, timed below. The tier ends full, nothing evicted. Each size and structure is built in a
    fresh process (fork), so no case runs on memory an earlier one freed.

    * bytes per block, by tracemalloc: the Python heap bytes the build requested (every object and
      container, GC headers included), exact and independent of what else the process holds; it
      traces a second build of its own, as tracing makes allocation several times slower. It does
      not see pymalloc rounding each object up to 16 bytes (a 16-byte key is a 49-byte object in a
      64-byte block), so the RSS growth of the untraced build is printed beside it (a cross-check,
      meaningful at millions of blocks; below that, heap the process already had blurs it).
      ``index_bytes_per_block``: the tier and its policy (the keys excluded); ``key_bytes_per_block``:
      the key objects, which the caller made and the index keeps alive.
    * where the bytes go: ``sys.getsizeof`` of every dict, set and list the tier and its policy hold
      (a policy's helper objects walked too), plus per-object costs (one slot int)
      traced on their own; what that leaves unexplained of the tracemalloc total is printed too
      (-4 for the plain dict: ``enumerate`` asks 28 bytes for an int, ``range`` 32; both get 32).
    * inserts per second: the whole untraced fill; lookups per second: ``Tier.lookup`` of prefixes
      of 32 present keys at random places (each call finds all 32), best of ``--repeat`` passes.
    * after churn (``--churn-blocks``, one smaller size: churning 10 M blocks takes too long): the
      same tiers kept full while ``--churn`` x n further new keys are stored (``reserve`` evicts
      through the policy, as ``Planner.make_room`` does for the last tier), traced throughout. A
      filled dict is at 1/3 to 2/3 load; one that deletes and inserts resizes to used x 3 instead
      (the tier copies its index back into the least table then: ``Tier._compact``), and
      ``adaptive``'s miniatures and watched samples keep some evicted keys' objects alive, so a
      serving tier costs more than a freshly filled one.

    Restart: a disk slab (``DiskSlab``) for 2 MiB and for 64 KiB blocks sized for ``--slab-bytes``
    (1 TiB: 523,265 and 15,790,320 slots, each a block and its 4 KiB header page), created in a
    scratch folder under ``--dir``, SPARSE (``ftruncate``; the bench's ``SparseSlab`` skips the
    preallocation a real slab gets at its first open, which there is not 1 TiB of disk for; a real
    slab's later opens skip it too). Two paths:

    * after a clean close, from the index snapshot (``kvtier.tiers.disk.snapshot``): the slab is closed with its
      blocks listed (``held_blocks``, what ``disk_tier`` hands it), which writes the snapshot of
      every slot, always at the FULL slot count: for 2 MiB over the slab whose headers are all
      written, for 64 KiB directly, over a slab whose headers are not written (a snapshot is read
      without touching a header). Slab and snapshot pages are dropped from the page cache
      (``POSIX_FADV_DONTNEED``), then the cold reopen is timed as ``disk_tier`` does it: open and
      lock, read and check the snapshot (``snapshot_open_s``); then the tier made (the last tier's
      default policy) and every block's slot claimed, when the tier answers lookups, loads and
      stores (``serving_s``: what an engine waits, its ``recovery_s``); and until the
      ``ChunkedRestore`` has put every block back into the index in the background
      (``restored_s``, of which ``restore_s`` after serving), at the full count.
      ``snapshot_close_s``: the close that writes it.
    * after a crash, by the full scan (``scan()``: one header page per slot). A valid slot header
      (``pack_slot_header``, with the slab's namespace digest) is written at the start of every slot,
      one ``pwrite`` of one page each, no block bytes: a 4 KiB page per slot on disk, so at most 8
      GiB (and ``--disk-share`` of the free space) of them: all 523,265 for 2 MiB, 2,097,152 of the
      15,790,320 for 64 KiB, on a slab of that many slots. The slab is closed without a snapshot
      (as a crash leaves it) and dropped from the page cache; then reopening plus ``scan()`` is timed
      cold, and once more warm, and scaled linearly to the full slot count where fewer were written,
      marked ``extrapolated`` (the scan reads one page per slot). ``scan_blank_s``: ``scan()`` of the
      fresh slab before any header is written (blank pages, holes in the sparse file).

    ``Tier.restore`` of the recovered blocks (what ``disk_tier`` and the scheduler side do next) is
    timed on its own for ``--restore-blocks`` and half of that, and extrapolated to the full slot
    count with the growth exponent those two points give (it was about 2 while ``SlotAllocator.claim``
    searched the free list for each slot; 1 since it does not).

References, measured in the same run
    A plain ``dict[bytes, int]`` of the same keys to slot numbers, filled in the same batches and
    looked up by the same prefixes with the least loop that answers "how many leading keys are
    present": the least a Python index can cost.

The last line printed is one JSON object. At the largest size, for the worse of the two policies:
``ratio`` = kvtier's (index + key) bytes per block / the plain dict's (table + slot ints + key);
``lookup_ratio`` and ``insert_ratio`` = kvtier's per-second rate / the plain dict's (below 1:
slower). Then every figure, per size and policy (``index``), after churn (``churn``) and per slot
size (``recovery``). ``recovery_s``: how long the cold restart of a 1 TiB slab from its index snapshot keeps the
tier from serving (``serving_s``), for the worse slot size; ``restored_s``: until every block is back in its
index (the blocks not back yet are misses meanwhile), for the worse slot size.

Run: ``.venv/bin/python bench/index.py [--blocks 1000000,10000000] [--churn-blocks 1000000]
[--slab-bytes 1TiB] [--skip-recovery]`` (on two cores: the index part about 8 minutes and 8 GiB of
memory, ``--skip-recovery`` alone; the restart part about 9 minutes, up to 8 GiB of slot headers on disk
for a moment, ``--blocks 32 --churn-blocks 0`` alone; ``--blocks 100000 --churn-blocks 100000
--slab-bytes 1GiB`` for a quick check).
"""

from __future__ import annotations

import argparse
import array
import gc
import json
import math
import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from kvtier.core.keys import KEY_BYTES
from kvtier.core.layout import BlockLayout
from kvtier.core.planner import SlotCount
from kvtier.core.restore import ChunkedRestore
from kvtier.core.sizes import format_size, parse_size
from kvtier.core.tier import Tier
from kvtier.policies import eviction_policy_class
from kvtier.tiers.disk.compression import CODEC_IDS
from kvtier.tiers.disk.files import SLAB_NAME, SNAPSHOT_NAME
from kvtier.tiers.disk.format import pack_slot_header
from kvtier.tiers.disk.slab import DiskSlab
from kvtier.tiers.disk.slots import PAGE, slot_stride

BATCH = 32  # keys per store, and per lookup: a request's chain of blocks
POLICIES = ("lru", "adaptive")  # the defaults: an upper tier, the last tier
LAYOUT = BlockLayout.contiguous(64 * 1024)  # the index does not depend on the geometry
SMALL_INTS = 257  # CPython caches the ints -5..256: a slot below 257 costs no object of its own
NAMESPACE = "bench-index"
KiB, MiB, GiB = 1024, 1024 * 1024, 1024 * 1024 * 1024
HEADER_BUDGET = 8 * GiB  # the most slot header pages the restart test writes (one 4 KiB page per slot)


# --- keys, structures, the store and lookup paths ---------------------------------------------


def make_keys(n: int, seed: int) -> list[bytes]:
    """``n`` distinct random 16-byte keys (as chain hashes are: uniform digests), each its own object."""
    data = random.Random(seed).randbytes(KEY_BYTES * n)
    return [data[i : i + KEY_BYTES] for i in range(0, len(data), KEY_BYTES)]


def new_tier(policy: str, n: int) -> Tier:
    """A tier of ``n`` slots as the scheduler side builds one: slot count only, a default policy."""
    return Tier("bench", "host", SlotCount(LAYOUT, n), eviction_policy_class(policy)())


def store(tier: Tier, keys: Sequence[bytes]) -> None:
    """Store ``keys`` batch by batch as the scheduler side does: the prefix the policy admits is
    reserved (evicting through the policy when the tier is full) and committed."""
    for start in range(0, len(keys), BATCH):
        batch = keys[start : start + BATCH]
        verdicts = tier.admit(batch)
        if False in verdicts:
            batch = batch[: verdicts.index(False)]
        if batch:
            tier.reserve(batch)
            tier.commit(batch)


def fill_dict(keys: Sequence[bytes]) -> dict[bytes, int]:
    """The reference index: key -> slot number, filled in the same batches."""
    index: dict[bytes, int] = {}
    for start in range(0, len(keys), BATCH):
        for slot, key in enumerate(keys[start : start + BATCH], start):
            index[key] = slot
    return index


def dict_lookup(index: dict[bytes, int], keys: Sequence[bytes]) -> int:
    """How many leading keys the reference index holds: ``Tier.lookup`` without lock or block state."""
    for i, key in enumerate(keys):
        if key not in index:
            return i
    return len(keys)


def build(kind: str, keys: list[bytes]) -> tuple[object, Callable[[Sequence[bytes]], int]]:
    """The filled structure of ``kind`` ("dict" or a policy name) and its lookup."""
    if kind == "dict":
        index = fill_dict(keys)
        return index, lambda batch: dict_lookup(index, batch)
    tier = new_tier(kind, len(keys))
    store(tier, keys)
    if tier.usage().used != len(keys):
        raise AssertionError(f"{kind}: {tier.usage().used} of {len(keys)} blocks stored")
    return tier, tier.lookup


# --- memory ------------------------------------------------------------------------------------


def rss_bytes() -> int:
    """This process's resident set size (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def traced_each(make: Callable[[int], object], count: int = 100_000) -> float:
    """Heap bytes per object ``make(i)`` builds, by tracemalloc (the list holding them is made before
    tracing starts): includes what ``sys.getsizeof`` leaves out, such as the separate array in which
    Python 3.11 keeps a plain class instance's attribute values."""
    objects: list[object] = [None] * count
    tracemalloc.start()
    for i in range(count):
        objects[i] = make(i)
    size = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return size / count


def object_costs() -> dict[str, float]:
    """Bytes of one key and one slot int: traced, and as ``sys.getsizeof`` says."""
    data = random.Random(0).randbytes(KEY_BYTES * 100_000)
    return {
        "key": traced_each(lambda i: data[i * KEY_BYTES : (i + 1) * KEY_BYTES]),
        "key_getsizeof": sys.getsizeof(data[:KEY_BYTES]),
        "int": traced_each(lambda i: i + 1000),
        "int_getsizeof": sys.getsizeof(1000),
    }


def policy_parts(policy: object, index: dict) -> tuple[dict[str, int], set[bytes]]:
    """``sys.getsizeof`` of every dict, set, list and array a policy holds, by attribute path (its helper
    objects such as adaptive's miniatures walked too; the tier's own ``index``, which a bound policy
    reads, left out), and the keys it holds that ``index`` does not: evicted or declined keys it
    remembers, whose objects only it keeps alive."""
    parts: dict[str, int] = {}
    outside: set[bytes] = set()

    def walk(obj: object, prefix: str) -> None:
        names = list(vars(obj)) if hasattr(obj, "__dict__") else list(getattr(type(obj), "__slots__", ()))
        for name in names:
            value = getattr(obj, name)
            if value is index:
                continue
            if isinstance(value, (array.array, bytearray)):
                parts[prefix + name] = sys.getsizeof(value)
            elif isinstance(value, (dict, set, list)):
                parts[prefix + name] = sys.getsizeof(value)
                outside.update(k for k in value if isinstance(k, bytes) and k not in index)
            elif type(value).__module__.startswith("kvtier.policies"):
                walk(value, prefix + name + ".")

    walk(policy, "")
    return parts, outside


def structure_parts(kind: str, structure, costs: dict[str, float]) -> dict[str, float]:
    """Bytes of a filled structure by part (the keys excluded), from sys.getsizeof and the traced
    per-object costs. Slot ints: the allocator makes one per slot up front (``list(range)``), the
    reference one per slot it stores; both keep them all."""
    if kind == "dict":
        return {"dict table": sys.getsizeof(structure), "slot ints": max(0, len(structure) - SMALL_INTS) * costs["int"]}
    tier: Tier = structure
    allocator = tier._allocator
    policy, outside = policy_parts(tier.policy, tier._slots)
    return {
        "index dict": sys.getsizeof(tier._slots),
        "slot flags": sys.getsizeof(tier._flags),
        "slot ints": max(0, tier.capacity - SMALL_INTS) * costs["int"],
        "allocator lists": sys.getsizeof(allocator._free) + sys.getsizeof(allocator._is_free),
        "pins, quarantined": sys.getsizeof(tier._pins) + sys.getsizeof(tier._quarantined),
        **{f"policy {path}": size for path, size in policy.items()},
        "policy: key objects of evicted/declined keys": len(outside) * costs["key"],
    }


# --- the measurements (each in a fresh process) -----------------------------------------------


def index_case(kind: str, n: int, seed: int, lookups: int, repeat: int, costs: dict[str, float]) -> dict:
    """Build ``kind`` over ``n`` keys: timed and measured by RSS, looked up, taken apart, then built
    again under tracemalloc."""
    rss0 = rss_bytes()
    keys = make_keys(n, seed)
    rss1 = rss_bytes()
    start = time.perf_counter()
    structure, lookup = build(kind, keys)
    insert_s = time.perf_counter() - start
    rss_index = rss_bytes() - rss1

    rng = random.Random(seed + 1)
    batches = [keys[s : s + BATCH] for s in (rng.randrange(n - BATCH + 1) for _ in range(max(1, lookups // BATCH)))]
    best = math.inf
    for _ in range(repeat):
        start = time.perf_counter()
        found = sum(lookup(batch) for batch in batches)
        best = min(best, time.perf_counter() - start)
        if found != len(batches) * BATCH:
            raise AssertionError(f"{kind}: {found} of {len(batches) * BATCH} present keys found")
    parts = structure_parts(kind, structure, costs)

    del structure, lookup
    gc.collect()
    tracemalloc.start()
    structure, _ = build(kind, keys)
    traced = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {
        "blocks": n,
        "index_bytes_per_block": traced / n,
        "key_bytes_per_block": costs["key"],
        "total_bytes_per_block": traced / n + costs["key"],
        "rss_index_bytes_per_block": rss_index / n,
        "rss_key_bytes_per_block": (rss1 - rss0) / n - 8,  # less the bench's list of keys
        "parts_bytes_per_block": {name: size / n for name, size in parts.items()},
        "unattributed_bytes_per_block": (traced - sum(parts.values())) / n,
        "insert_s": insert_s,
        "inserts_per_s": n / insert_s,
        "lookups_per_s": len(batches) * BATCH / best,
    }


def churn_case(policy: str, n: int, rounds: int, seed: int, costs: dict[str, float]) -> dict:
    """Fill a tier of ``n`` slots, then store ``rounds`` x n further new keys (each evicting one);
    traced throughout. Bytes per block are per slot of the full tier, its live keys excluded."""
    tracemalloc.start()
    tier = new_tier(policy, n)
    per_round = []
    start = time.perf_counter()
    for r in range(rounds + 1):
        store(tier, make_keys(n, seed + 1000 + r))
        per_round.append(tracemalloc.get_traced_memory()[0] / n - costs["key"])
    elapsed = time.perf_counter() - start
    parts = structure_parts(policy, tier, costs)
    tracemalloc.stop()
    stats = tier.stats
    return {
        "blocks": n,
        "stored": stats.committed,
        "evicted": stats.evicted,
        "declined": stats.declined,
        "index_bytes_per_block": per_round[-1],
        "index_bytes_per_block_max": max(per_round[1:], default=per_round[0]),
        "index_bytes_per_block_by_round": per_round,
        "parts_bytes_per_block": {name: size / n for name, size in parts.items()},
        "unattributed_bytes_per_block": per_round[-1] - sum(parts.values()) / n,
        "traced_s": elapsed,
    }


def in_child(fn: Callable[..., dict], *args) -> dict:
    """Run ``fn(*args)`` in a fresh forked process: a clean heap for every case, so an RSS delta is
    not offset by memory an earlier case freed, and 10 M blocks' worth of objects leave with it."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        return pool.submit(fn, *args).result()


# --- restart of a disk tier -------------------------------------------------------------------


def filesystem_type(path: str) -> str:
    """The type of the filesystem holding ``path`` (the longest mount point above it)."""
    best, fstype = "", "unknown"
    real = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            mount = fields[1]
            if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
                best, fstype = mount, fields[2]
    return fstype


def drop_cached_pages(path: Path) -> None:
    """Evict a closed (so flushed) file's pages from the page cache: the next read is a cold one."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class SparseSlab(DiskSlab):
    """A slab whose file stays sparse (``ftruncate``): this bench makes 1 TiB slabs on disks that do not
    hold 1 TiB. A real slab is preallocated at its first open only; its later opens skip that too."""

    def _preallocate(self) -> None:
        os.ftruncate(self.open_fd, self.file_bytes)


def write_headers(directory: Path, keys: list[bytes], layout: BlockLayout) -> tuple[float, float]:
    """Make a sparse slab of ``len(keys)`` slots with a valid header for ``keys[i]`` in slot i, and close
    it without a snapshot (as a crash leaves it): seconds to scan it blank, and to write the headers."""
    slab = SparseSlab(directory, len(keys), layout, NAMESPACE)
    try:
        start = time.perf_counter()
        slab.scan()
        scan_blank_s = time.perf_counter() - start
        page = bytearray(PAGE)
        block_bytes = layout.block_bytes
        start = time.perf_counter()
        for slot, key in enumerate(keys):
            pack_slot_header(page, 0, key, slab.namespace, block_bytes, 0, slot + 1, block_bytes, CODEC_IDS["none"])
            os.pwrite(slab.open_fd, page, slab.slot_offset(slot))
        write_s = time.perf_counter() - start
    finally:
        slab.close()
    return scan_blank_s, write_s


def close_with_snapshot(directory: Path, keys: list[bytes], layout: BlockLayout) -> tuple[float, int]:
    """Open the slab of ``len(keys)`` slots in ``directory`` (made here, sparse, when there is none) and
    close it with every slot listed as held, ``keys[i]`` in slot i: the snapshot a clean close of a
    full tier writes. Seconds the close takes, and the snapshot's size."""
    slab = SparseSlab(directory, len(keys), layout, NAMESPACE)
    slab.held_blocks = lambda: (keys, list(range(len(keys))))
    start = time.perf_counter()
    slab.close()
    close_s = time.perf_counter() - start
    return close_s, os.stat(directory / SNAPSHOT_NAME).st_size


def reopen_from_snapshot(directory: Path, keys: list[bytes], layout: BlockLayout) -> tuple[float, float, float]:
    """Seconds from the start of a reopen of the slab from its index snapshot: until it is open (the
    snapshot read and checked), until the tier over it serves (made with the last tier's default
    policy, every slot claimed: ``disk_tier``'s ``ChunkedRestore``), and until every block is back
    in its index. Closes it without a snapshot."""
    start = time.perf_counter()
    slab = SparseSlab(directory, len(keys), layout, NAMESPACE)
    try:
        opened = time.perf_counter()
        tier = new_tier(POLICIES[-1], len(keys))
        restoring = ChunkedRestore(tier, str(directory))
        recovered = slab.recover(restoring.start)
        serving = time.perf_counter()
        restoring.done.wait()
        restored = time.perf_counter()
    finally:
        slab.close()
    if recovered.source != "index snapshot" or tier.ready_keys() != keys:
        raise AssertionError(f"the snapshot did not give back the keys written: {recovered}")
    return opened - start, serving - start, restored - start


def reopen_and_scan(directory: Path, slots: int, layout: BlockLayout) -> tuple[float, float, list]:
    """Seconds to open the slab again and to scan its headers (a restart after a crash), and what the
    scan found."""
    start = time.perf_counter()
    slab = SparseSlab(directory, slots, layout, NAMESPACE)
    try:
        opened = time.perf_counter()
        found, damaged = slab.scan()
        scanned = time.perf_counter()
    finally:
        slab.close()
    if damaged or len(found) != slots:
        raise AssertionError(f"scan found {len(found)} of {slots} blocks, {damaged} damaged")
    return opened - start, scanned - opened, found


def restart_case(parent: str, block_bytes: int, slab_bytes: int, share: float, seed: int) -> dict:
    """Restart a sparse slab of ``slab_bytes``: cold from the index snapshot of a clean close, at the full
    slot count, and cold and warm by the full scan after a crash, over as many written headers as
    8 GiB (and ``share`` of the free space) hold, scaled to the full count."""
    stride = slot_stride(block_bytes)
    wanted = (slab_bytes - PAGE) // stride
    free = shutil.disk_usage(parent).free
    headers = min(wanted, HEADER_BUDGET // PAGE, int(free * share) // PAGE)
    if headers < 1:
        raise SystemExit(f"{parent}: {format_size(free)} free holds no slot header")
    layout = BlockLayout.contiguous(block_bytes)
    scratch = Path(tempfile.mkdtemp(prefix="kvtier-bench-index-", dir=parent))
    scan_dir = scratch / "scan"
    snapshot_dir = scan_dir if headers == wanted else scratch / "snapshot"
    try:
        keys = make_keys(wanted, seed)
        scan_blank_s, write_s = write_headers(scan_dir, keys[:headers], layout)
        close_s, snapshot_bytes = close_with_snapshot(snapshot_dir, keys, layout)
        drop_cached_pages(snapshot_dir / SLAB_NAME)
        drop_cached_pages(snapshot_dir / SNAPSHOT_NAME)
        snapshot_open_s, serving_s, restored_s = reopen_from_snapshot(snapshot_dir, keys, layout)
        drop_cached_pages(scan_dir / SLAB_NAME)
        cold_open_s, cold_s, found = reopen_and_scan(scan_dir, headers, layout)
        warm_open_s, warm_s, _ = reopen_and_scan(scan_dir, headers, layout)
        file_bytes = os.stat(snapshot_dir / SLAB_NAME).st_size
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if [key for _, key, _ in found] != keys[:headers]:
        raise AssertionError("the scan did not give back the keys written, oldest first")
    scale = wanted / headers
    return {
        "block_bytes": block_bytes,
        "slab_bytes": slab_bytes,
        "file_bytes": file_bytes,
        "slots": wanted,
        "snapshot_open_s": snapshot_open_s,
        "serving_s": serving_s,
        "restored_s": restored_s,
        "restore_s": restored_s - serving_s,
        "recovery_s": serving_s,
        "snapshot_close_s": close_s,
        "snapshot_bytes": snapshot_bytes,
        "scan_measured_slots": headers,
        "extrapolated": headers < wanted,
        "scan_recovery_s": (cold_open_s + cold_s) * scale,
        "scan_recovery_warm_s": (warm_open_s + warm_s) * scale,
        "scan_blank_s": scan_blank_s * scale,
        "header_write_s": write_s * scale,
        "measured": {"open_s": cold_open_s, "scan_s": cold_s, "warm_open_s": warm_open_s, "warm_scan_s": warm_s,
                     "scan_blank_s": scan_blank_s, "header_write_s": write_s},
    }  # fmt: skip


def restore_case(blocks: int, seed: int) -> dict:
    """Seconds ``Tier.restore`` takes to put back ``blocks`` recovered blocks (slots 0.., oldest
    first, as a scan of a slab filled in order returns them) into the last tier's default policy,
    at ``blocks`` and half of it: the growth exponent between the two."""
    times = {}
    for n in (blocks // 2, blocks):
        tier = new_tier(POLICIES[-1], n)
        keys, slots = make_keys(n, seed), list(range(n))
        start = time.perf_counter()
        tier.restore(keys, slots)
        times[n] = time.perf_counter() - start
    half, full = times[blocks // 2], times[blocks]
    return {"blocks": blocks, "restore_s": full, "restore_half_s": half, "exponent": math.log2(full / half)}


# --- output ------------------------------------------------------------------------------------


def print_index(results: dict[int, dict[str, dict]]) -> None:
    print("bytes per block (tracemalloc: requested heap bytes; rss: growth of the untraced build)")
    header = (
        f"{'blocks':>10}  {'index':<9}{'index B':>9}{'key B':>7}{'total B':>9}{'x dict':>8}"
        f"{'rss idx B':>11}{'rss key B':>11}{'inserts/s':>12}{'x dict':>8}{'lookups/s':>12}{'x dict':>8}"
    )
    print(header)
    print("-" * len(header))
    for n, cases in results.items():
        ref = cases["dict"]
        for kind, r in cases.items():
            print(
                f"{n:>10}  {kind:<9}{r['index_bytes_per_block']:>9.1f}{r['key_bytes_per_block']:>7.1f}"
                f"{r['total_bytes_per_block']:>9.1f}{r['total_bytes_per_block'] / ref['total_bytes_per_block']:>8.2f}"
                f"{r['rss_index_bytes_per_block']:>11.1f}{r['rss_key_bytes_per_block']:>11.1f}"
                f"{r['inserts_per_s']:>12,.0f}{r['inserts_per_s'] / ref['inserts_per_s']:>8.2f}"
                f"{r['lookups_per_s']:>12,.0f}{r['lookups_per_s'] / ref['lookups_per_s']:>8.2f}"
            )


def print_parts(title: str, parts: dict[str, float], unattributed: float) -> None:
    print(f"  {title}")
    for name, size in parts.items():
        if size >= 0.05:
            print(f"    {name:<48}{size:>9.1f}")
    print(f"    {'(tracemalloc total less the parts above)':<48}{unattributed:>9.1f}")


def print_recovery(recovery: list[dict], restore: dict | None) -> None:
    print(
        "restart of a sparse disk slab (seconds, cold unless marked warm): after a clean close, from the index "
        "snapshot (measured at the full slot count: the snapshot read, the tier serving, every block back in its "
        "index); after a crash, by the full scan (* scaled from the slots measured)"
    )
    header = (
        f"{'block':>8}{'slab':>10}{'slots':>11}  {'snapshot':>9}{'serving':>9}{'restored':>9}{'close':>8}"
        f"{'snap MB':>9}  {'scan slots':>11}{'scan':>9}{'warm':>9}{'blank':>9}{'write hdrs':>11}"
    )
    print(header)
    print("-" * len(header))
    for r in recovery:
        mark = "*" if r["extrapolated"] else " "
        print(
            f"{format_size(r['block_bytes']):>8}{format_size(r['slab_bytes']):>10}{r['slots']:>11}  "
            f"{r['snapshot_open_s']:>9.2f}{r['serving_s']:>9.2f}{r['restored_s']:>9.2f}{r['snapshot_close_s']:>8.2f}"
            f"{r['snapshot_bytes'] / 1e6:>9.0f}  {r['scan_measured_slots']:>11}"
            f"{r['scan_recovery_s']:>8.2f}{mark}{r['scan_recovery_warm_s']:>8.2f}{mark}"
            f"{r['scan_blank_s']:>8.2f}{mark}{r['header_write_s']:>10.2f}{mark}"
        )
    if restore:
        print(
            f"Tier.restore: {restore['restore_half_s']:.2f} s for {restore['blocks'] // 2} blocks, "
            f"{restore['restore_s']:.2f} s for {restore['blocks']}: time grows as n^{restore['exponent']:.2f}"
        )


# --- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", default="1000000,10000000", help="index sizes in blocks, comma separated")
    p.add_argument("--lookups", type=int, default=1 << 20, help="keys looked up per pass (default 2^20)")
    p.add_argument("--repeat", type=int, default=3, help="lookup passes; the best counts (default 3)")
    p.add_argument("--churn-blocks", type=int, default=1_000_000, help="tier size for the churn test (0: skip)")
    p.add_argument("--churn", type=int, default=4, help="further keys stored in the churn test, x its size")
    p.add_argument("--slab-bytes", default="1TiB", help="disk slab size for the restart test (default 1TiB)")
    p.add_argument("--disk-share", type=float, default=0.2, help="most of the free space a slab may take")
    p.add_argument("--restore-blocks", type=int, default=40_000, help="blocks put back by the timed Tier.restore")
    p.add_argument("--dir", default=None, help="where the slabs go (default: the temporary directory)")
    p.add_argument("--skip-recovery", action="store_true", help="skip the disk restart test")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.blocks = sorted(int(b) for b in args.blocks.split(","))
    args.slab_bytes = parse_size(args.slab_bytes)
    if min(args.blocks) < BATCH or args.lookups < BATCH or args.repeat < 1 or args.restore_blocks < 2:
        p.error("--blocks and --lookups must be at least 32, --repeat 1, --restore-blocks 2")
    if not 0 < args.disk_share <= 1:
        p.error("--disk-share must be in (0, 1]")
    args.dir = args.dir or tempfile.gettempdir()
    return args


def index_figures(args: argparse.Namespace, costs: dict) -> dict[int, dict[str, dict]]:
    """A plain dict and every policy's index at each size, each in a child process of its own."""
    results: dict[int, dict[str, dict]] = {}
    for n in args.blocks:
        results[n] = {}
        for kind in ("dict", *POLICIES):
            results[n][kind] = r = in_child(index_case, kind, n, args.seed, args.lookups, args.repeat, costs)
            print(f"  {kind} over {n} blocks: filled in {r['insert_s']:.1f} s", flush=True)
    print()
    print_index(results)
    print("\nwhere the index bytes go, per block (sys.getsizeof and traced per-object costs)")
    for n, cases in results.items():
        for kind, r in cases.items():
            print_parts(f"{kind}, {n} blocks", r["parts_bytes_per_block"], r["unattributed_bytes_per_block"])
    return results


def churn_figures(args: argparse.Namespace, costs: dict) -> dict[str, dict]:
    """Each policy's index bytes as a full tier keeps storing new keys (none without ``--churn-blocks``)."""
    churn: dict[str, dict] = {}
    if not args.churn_blocks:
        return churn
    print(f"\nafter churn: a full tier of {args.churn_blocks} blocks storing {args.churn} x as many new keys")
    for policy in POLICIES:
        churn[policy] = r = in_child(churn_case, policy, args.churn_blocks, args.churn, args.seed, costs)
        rounds = ", ".join(f"{b:.0f}" for b in r["index_bytes_per_block_by_round"])
        print(
            f"  {policy}: index bytes per block after each n stored: {rounds} "
            f"({r['evicted']} evicted, {r['declined']} declined)"
        )
        print_parts(f"{policy} at the end", r["parts_bytes_per_block"], r["unattributed_bytes_per_block"])
    return churn


def recovery_figures(args: argparse.Namespace) -> tuple[list[dict], dict | None]:
    """A disk slab's recovery at a restart, for both block sizes, and a policy's restore of its blocks."""
    if args.skip_recovery:
        return [], None
    free = shutil.disk_usage(args.dir).free
    print(f"\n{args.dir} on {filesystem_type(args.dir)}, {format_size(free)} free")
    recovery = [
        in_child(restart_case, args.dir, block_bytes, args.slab_bytes, args.disk_share, args.seed)
        for block_bytes in (2 * MiB, 64 * KiB)
    ]
    restore = in_child(restore_case, args.restore_blocks, args.seed)
    for r in recovery:
        growth = max(1.0, restore["exponent"])  # (below 1: noise of two short timings)
        r["restore_s_estimated"] = restore["restore_s"] * (r["slots"] / restore["blocks"]) ** growth
    print_recovery(recovery, restore)
    return recovery, restore


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    costs = object_costs()
    print(
        f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs. One 16-byte key: {costs['key']:.0f} B traced "
        f"(getsizeof {costs['key_getsizeof']}); one slot int: {costs['int']:.0f} B traced "
        f"(getsizeof {costs['int_getsizeof']})"
    )
    results = index_figures(args, costs)
    churn = churn_figures(args, costs)
    recovery, restore = recovery_figures(args)
    largest = results[args.blocks[-1]]
    ref = largest["dict"]
    ratio = max(largest[p]["total_bytes_per_block"] for p in POLICIES) / ref["total_bytes_per_block"]
    lookup_ratio = min(largest[p]["lookups_per_s"] for p in POLICIES) / ref["lookups_per_s"]
    insert_ratio = min(largest[p]["inserts_per_s"] for p in POLICIES) / ref["inserts_per_s"]
    runtime = time.perf_counter() - started
    print(
        f"\nat {args.blocks[-1]} blocks, worse policy vs plain dict: {ratio:.2f}x the bytes, "
        f"{lookup_ratio:.2f}x the lookups/s, {insert_ratio:.2f}x the inserts/s; total runtime {runtime:.0f} s"
    )
    summary = {
        "bench": "index",
        "ratio": round(ratio, 3),
        "lookup_ratio": round(lookup_ratio, 3),
        "insert_ratio": round(insert_ratio, 3),
        "blocks": args.blocks[-1],
        **{f"{p}_index_bytes_per_block": round(largest[p]["index_bytes_per_block"], 1) for p in POLICIES},
        "key_bytes_per_block": round(ref["key_bytes_per_block"], 1),
        "dict_index_bytes_per_block": round(ref["index_bytes_per_block"], 1),
        "object_costs": costs,
        "index": {str(n): cases for n, cases in results.items()},
        "churn": churn,
        "recovery_s": round(max(r["recovery_s"] for r in recovery), 3) if recovery else None,
        "restored_s": round(max(r["restored_s"] for r in recovery), 3) if recovery else None,
        "recovery": recovery,
        "restore": restore,
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "runtime_s": round(runtime, 1),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
