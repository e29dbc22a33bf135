"""kvtier's disk tier against vLLM's own file tier, both as the secondary tier of vLLM's tiered offloading.

What is measured
    vLLM 0.33's real ``TieringOffloadingManager`` (``OffloadingConnector`` with ``spec_name:
    TieringOffloadingSpec``, built on the scheduler side by vLLM's ``KVConnectorFactory`` from an
    extra config as a user writes it) with one secondary tier: kvtier's ``KVTierDisk`` (loaded by
    module path from ``kvtier.connectors.vllm_tiering``) or vLLM's built-in ``fs`` tier (one file
    per chunk). Both sit in the same filesystem, under ``--dir`` (default: a temporary directory in
    /tmp), and get the same chunks, for chunks of 2 MiB and of 64 KiB (the chunk size follows from
    the KV cache spec: 64 KiB per GPU block of 16 tokens, times the blocks per chunk; vLLM aligns
    each CPU row to 4 KiB, which these sizes already are).

    The bench drives the manager as vLLM's offloading scheduler does (this file plays vLLM's GPU
    worker: it writes a chunk's bytes into its CPU tier row between ``prepare_store`` and
    ``complete_store``, and reads promoted rows back). Per tier and chunk size:

    * store: ``--total`` bytes of chunks, in batches that fill the CPU tier, each batch split over
      ``--requests`` requests (one cascade job per request, as vLLM cascades each request's stores).
      The clock runs from a batch's first ``complete_store`` until every cascade job of the batch
      has finished (steps polled with ``on_schedule_end`` / ``has_pending_work``); the worker's
      writes into the rows are outside it. GB/s = bytes / the batches' summed time.
    * restart: the manager is shut down and the page cache of the tier's files dropped (fsync and
      ``POSIX_FADV_DONTNEED`` on each file: no root needed, no other process's cache touched); a
      new engine opens the same directory with an empty CPU tier.
    * lookup latency: every stored key and as many never stored keys, asked of the secondary tier
      itself (under the manager's lock): mean microseconds per ``lookup`` call. vLLM's fs tier
      answers RETRY first and checks the files on its lookup thread; for it the time until every
      key has a definite answer (one batch, flushed by ``on_schedule_end``) is given per key too.
      The stored keys found are the chunks recovered after the restart.
    * load: every chunk promoted back into the CPU tier, in batches it can hold, ``--requests``
      requests per batch, each asking vLLM's maximal-prefix lookup step after step until every
      answer is HIT (a RETRY or HIT_PENDING means "ask again at the next step"). The clock runs from
      a batch's first lookup until all of its chunks are HIT; every promoted row is then compared
      with what was written (outside the clock): mismatches must be 0.
    * a flipped byte (first repetition): one byte of one stored chunk is flipped on disk (kvtier: in its
      slab file, found by searching for 64 bytes of the chunk; fs: in the chunk's file, named by vLLM's
      ``FileMapper``), the manager restarted and the chunk asked for, twice: a miss, or a failed
      promotion and then a miss, is the right outcome; a promotion of the wrong bytes the wrong one.

    ``--repeat`` repetitions (5): in each, the two tiers' stores run back to back, then the restarts,
    lookups and loads, the tier that goes first alternating, so that a disk whose speed drifts (a
    shared virtual disk does) meets both tiers about alike. GB/s: the median and the best of the
    repetitions; lookup figures: medians; counts: the worst repetition's.

Reference, measured in the same run
    vLLM's ``fs`` tier (O_DIRECT where the filesystem allows it, 16 read and 16 write threads, its C
    I/O helpers when built) on the same filesystem, the same chunks and the same driver. Per chunk
    size and direction (store, load) the figure is the median over the repetitions of kvtier's GB/s /
    fs's GB/s in that repetition; ``ratio`` is the smallest of the four. The output names the
    filesystem and whether each tier used O_DIRECT.

Why
    Whoever runs vLLM's tiered offloading picks a secondary tier by its entry in the config; kvtier's
    disk tier is worth choosing over the one vLLM ships only if it moves chunks at least as fast
    through vLLM's own manager, finds them again after a restart, and never hands back damaged bytes.

The last line printed is one JSON object: ``ratio`` and every figure. ``--policy`` also runs
bench/vllm_tiering_policy.py (kvtier's CPU tier eviction policy against vLLM's) and adds its result
under ``policy`` (its ratio as ``policy_ratio``).

Run: ``.venv/bin/python bench/vllm_tiering.py [--total 512MiB] [--dir DIR] [--repeat 5] [--policy]`` (two
to three minutes on two cores; about 2.5 x ``--total`` of free disk).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

for _name, _value in (
    ("VLLM_TARGET_DEVICE", "cpu"),
    ("CUDA_VISIBLE_DEVICES", ""),
    ("HF_HUB_OFFLINE", "1"),
    ("VLLM_LOGGING_LEVEL", "ERROR"),
):
    os.environ.setdefault(_name, _value)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the tests' driver of vLLM's tiering

import numpy as np  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, ScheduleEndContext, make_offload_key  # noqa: E402

from helpers.vllm_harness import MODEL_JSON  # noqa: E402
from helpers.vllm_helpers import BLOCK  # noqa: E402
from helpers.vllm_tiering import DEFERRED, MODULE, POLL_S, TieringEngine, maximal_prefix  # noqa: E402
from kvtier.core.sizes import format_size, parse_size  # noqa: E402
from kvtier.tiers.disk.files import SLAB_NAME  # noqa: E402

logging.getLogger("vllm").setLevel(logging.ERROR)  # vLLM's CPU platform warns about this test model's settings

POLICY_BENCH = Path(__file__).resolve().parent / "vllm_tiering_policy.py"
TIERS = ("kvtier", "fs")
WAYS = ("store", "load")
SIZES = {"2MiB": 2 << 20, "64KiB": 64 << 10}
HEAD_SIZE = 256  # the tests' KV cache (two layers of 2 KV heads, fp16, 16-token blocks) with 32 KiB pages
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * HEAD_SIZE * 2  # one GPU block of both layers (K and V): 64 KiB
PROBE = 64  # bytes of a chunk searched for in kvtier's slab
TIMEOUT_S = 120.0  # the longest a batch's cascades, promotions or lookups may take


# --- the chunks ------------------------------------------------------------------------------------


class Chunks:
    """N chunks of one size, each a pure function of its index: a random base XOR a 64-bit word of its own.

    Why not random bytes per chunk: drawing hundreds of MiB of random bytes runs at a fraction of
    memory speed on two cores, and would sit between the steps of the store loop. XOR with a word is
    a memory-speed write, and still gives every 8 bytes of every chunk a value no other chunk holds
    at any offset (incompressible, and found unambiguously by a 64-byte search)."""

    def __init__(self, label: str, size: int, count: int) -> None:
        rng = np.random.default_rng(int.from_bytes(hashlib.sha256(label.encode()).digest()[:8], "little"))
        self.size = size
        self.base = np.frombuffer(rng.bytes(size), dtype=np.uint64)
        self.words = rng.integers(1, 2**63, count, dtype=np.uint64) | np.uint64(1 << 63)
        self.keys = [_key(f"{label}:{i}") for i in range(count)]
        self.absent = [_key(f"{label}:absent:{i}") for i in range(count)]
        self.index = {key: i for i, key in enumerate(self.keys)}

    def write(self, row: np.ndarray, key: OffloadKey) -> None:
        np.bitwise_xor(self.base, self.words[self.index[key]], out=row.view(np.uint64))

    def matches(self, row: np.ndarray, key: OffloadKey) -> bool:
        return bool(np.array_equal(row.view(np.uint64), self.base ^ self.words[self.index[key]]))

    def probe(self, key: OffloadKey) -> bytes:
        """64 bytes from the middle of the chunk: what kvtier's slab is searched for."""
        middle = self.size // 16  # in words: half the chunk
        return (self.base[middle : middle + PROBE // 8] ^ self.words[self.index[key]]).tobytes()


def _key(name: str) -> OffloadKey:
    """An OffloadKey as vLLM makes one: a SHA-256 block hash in KV cache group 0."""
    return make_offload_key(hashlib.sha256(name.encode()).digest(), 0)


def batches(items: Sequence, size: int) -> list[Sequence]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def split(items: Sequence, parts: int) -> list[Sequence]:
    """``items`` in up to ``parts`` nearly equal consecutive pieces (one per request)."""
    step = -(-len(items) // parts)
    return batches(items, step)


# --- vLLM's manager, driven as its scheduler drives it ---------------------------------------------


def tier_entry(tier: str, path: Path, chunks: int) -> dict:
    """The ``secondary_tiers`` entry of ``tier`` in ``path``, as a user writes it. kvtier's disk tier gets
    room for every chunk and some to spare, so that none is evicted."""
    if tier == "kvtier":
        return {"type": "KVTierDisk", "module_path": MODULE, "path": str(path), "capacity_blocks": chunks + chunks // 4}
    return {"type": "fs", "root_dir": str(path)}


@dataclass
class Promotion:
    """What a batch of lookups found: per request, its leading chunks now in the CPU tier."""

    hits: list[int] = field(default_factory=list)
    seconds: float = 0.0
    promoted: bool = False  # some lookup started a promotion (answered HIT_PENDING)


class Engine(TieringEngine):
    """The scheduler side of one vLLM engine with tiered offloading (the tests' driver), timed batch by batch."""

    def __init__(self, model_dir: Path, entry: dict, chunk_bytes: int, cpu_bytes: int) -> None:
        blocks_per_chunk = chunk_bytes // BLOCK_BYTES
        super().__init__(
            model_dir,
            [entry],
            num_gpu_blocks=4 * blocks_per_chunk,
            head_size=HEAD_SIZE,
            cpu_bytes=cpu_bytes,
            extra={"block_size": BLOCK * blocks_per_chunk},
        )
        if self.chunk_size != chunk_bytes:
            raise RuntimeError(f"vLLM made CPU rows of {self.chunk_size} bytes, not {chunk_bytes}")
        (self.tier,) = self.tiers

    @property
    def cpu_chunks(self) -> int:
        return self.rows.shape[0]

    def store_batch(
        self, groups: Sequence[Sequence[OffloadKey]], write: Callable[[np.ndarray, OffloadKey], None]
    ) -> float:
        """One request per group stores its chunks into the CPU tier (the worker writes each row first);
        returns the seconds from the first ``complete_store`` until every cascade has finished."""
        prepared = []
        for keys in groups:
            ctx = self.request()
            with self.manager.lock:
                out = self.manager.prepare_store(list(keys), ctx)
            if out is None or len(out.keys_to_store) != len(keys):
                raise RuntimeError("the CPU tier refused a store: it holds less than a batch")
            for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
                write(self.rows[chunk], key)
            prepared.append((ctx, out.keys_to_store))
        start = time.perf_counter()
        for ctx, keys in prepared:
            with self.manager.lock:
                self.manager.complete_store(keys, ctx)
            self.finish(ctx)
        self.settle()
        return time.perf_counter() - start

    def promote(self, groups: Sequence[Sequence[OffloadKey]]) -> tuple[Promotion, list[ReqContext]]:
        """One request per group asks for its chunks as vLLM's scheduler does (maximal-prefix lookup, again
        at each step while an answer is RETRY or HIT_PENDING) until every request has its answer. The
        requests stay open: the caller reads the rows, then finishes them."""
        contexts = [self.request() for _ in groups]
        result = Promotion(hits=[-1] * len(groups))
        deadline = time.monotonic() + TIMEOUT_S
        start = time.perf_counter()
        while -1 in result.hits:
            with self.manager.lock:
                for n, (ctx, keys) in enumerate(zip(contexts, groups, strict=True)):
                    if result.hits[n] < 0:
                        result.hits[n] = self._prefix(keys, ctx, result)
            if -1 in result.hits:
                if time.monotonic() > deadline:
                    raise TimeoutError("lookups still deferred")
                self.step()
                time.sleep(POLL_S)
        result.seconds = time.perf_counter() - start
        return result, contexts

    def _prefix(self, keys: Sequence[OffloadKey], ctx: ReqContext, result: Promotion) -> int:
        """The request's chunks up to the first MISS, or -1 when some answer says to ask again next step."""
        hits, answers = maximal_prefix(self.manager, keys, ctx)
        result.promoted |= LookupResult.HIT_PENDING in answers
        return -1 if answers & DEFERRED else hits

    def read(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[np.ndarray]:
        """The CPU tier's rows of ``keys`` (HITs), pinned while the worker would copy them."""
        if not keys:
            return []
        with self.manager.lock:
            spec = self.manager.prepare_load(list(keys), ctx)
        return [self.rows[chunk] for chunk in spec.chunk_ids]

    def release(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        with self.manager.lock:
            if keys:
                self.manager.complete_load(list(keys), ctx)
            self.manager.on_request_finished(ctx)

    def o_direct(self) -> bool:
        """Whether the secondary tier does its I/O with O_DIRECT (each tier says so its own way)."""
        stack = getattr(self.tier, "stack", None)
        if stack is not None:
            return bool(stack.tiers[0].storage.slab.o_direct)
        return bool(self.tier._use_o_direct)


# --- the measurements ------------------------------------------------------------------------------


def store_all(engine: Engine, chunks: Chunks, requests: int) -> float:
    """Seconds to cascade every chunk, batch by batch (each batch fills the CPU tier)."""
    seconds = 0.0
    for batch in batches(chunks.keys, engine.cpu_chunks):
        seconds += engine.store_batch(split(batch, requests), chunks.write)
    return seconds


def load_all(engine: Engine, chunks: Chunks, requests: int) -> tuple[float, int, int]:
    """(seconds, chunks promoted, promoted chunks whose bytes differ), batch by batch."""
    seconds, loaded, wrong = 0.0, 0, 0
    for batch in batches(chunks.keys, engine.cpu_chunks):
        groups = split(batch, requests)
        result, contexts = engine.promote(groups)
        seconds += result.seconds
        for keys, hits, ctx in zip(groups, result.hits, contexts, strict=True):
            found = keys[:hits]
            wrong += sum(not chunks.matches(row, key) for key, row in zip(found, engine.read(found, ctx), strict=True))
            engine.release(found, ctx)
            loaded += hits
    return seconds, loaded, wrong


@dataclass
class Lookups:
    """The secondary tier's answers to one batch of keys, and what they cost."""

    found: int
    call_us: float  # mean time of one lookup call
    definite_us: float  # mean time per key until every key had a definite answer (the batch's wall time / keys)
    batch_ms: float  # that wall time


def tier_lookups(engine: Engine, keys: Sequence[OffloadKey]) -> Lookups:
    """Ask the secondary tier itself about every key (under the manager's lock, as the manager does), again
    at each step for the keys it answered RETRY, until every answer is HIT or MISS."""
    tier, ctx = engine.tier, ReqContext(req_id=f"lookups-{uuid.uuid4().hex[:8]}")
    tier.on_new_request(ctx)
    answers: dict[OffloadKey, LookupResult] = {}
    calls, call_seconds = 0, 0.0
    pending = list(keys)
    deadline = time.monotonic() + TIMEOUT_S
    start = time.perf_counter()
    while pending:
        with engine.manager.lock:
            before = time.perf_counter()
            for key in pending:
                answers[key] = tier.lookup(key, ctx)
            call_seconds += time.perf_counter() - before
            calls += len(pending)
            pending = [key for key in pending if answers[key] is LookupResult.RETRY]
            if pending:
                tier.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        if pending:
            if time.monotonic() > deadline:
                raise TimeoutError("the tier's lookups stay RETRY")
            time.sleep(POLL_S)
    wall = time.perf_counter() - start
    with engine.manager.lock:
        tier.on_request_finished(ctx)
    found = sum(answer is LookupResult.HIT for answer in answers.values())
    return Lookups(found, call_seconds / calls * 1e6, wall / len(keys) * 1e6, wall * 1e3)


def flip_byte(path: Path, offset: int) -> None:
    """Flip every bit of the byte at ``offset`` of the file, written through to the disk."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())


def find_in_file(path: Path, needle: bytes) -> int:
    """The offset of the one occurrence of ``needle`` in the file (read in pieces that overlap by its length)."""
    piece = 64 << 20
    found = []
    with open(path, "rb") as f:
        offset = 0
        while data := f.read(piece + len(needle)):
            at = data.find(needle)
            while at >= 0:
                if offset + at not in found:
                    found.append(offset + at)
                at = data.find(needle, at + 1)
            if len(data) <= piece:
                break
            offset += piece
            f.seek(offset)
    if len(found) != 1:
        raise RuntimeError(f"{len(found)} occurrences of the chunk's bytes in {path}")
    return found[0]


def corrupted_outcome(engine: Engine, chunks: Chunks, key: OffloadKey) -> str:
    """Ask for a chunk whose bytes were damaged on disk: "miss" (never found), "failed promotion" (found,
    the promotion failed; asked again it must be a plain miss, not a promotion tried step after step),
    "wrong bytes" (promoted, and not what was written) or "intact" (the flip missed the chunk's bytes)."""
    outcome = ask_once(engine, chunks, key)
    if outcome == "failed promotion":
        again = ask_once(engine, chunks, key)
        outcome += ", then miss" if again == "miss" else f", then {again}"
    return outcome


def ask_once(engine: Engine, chunks: Chunks, key: OffloadKey) -> str:
    result, (ctx,) = engine.promote([[key]])
    found = [key][: result.hits[0]]
    rows = engine.read(found, ctx)
    if found:
        outcome = "intact" if chunks.matches(rows[0], key) else "wrong bytes"
    else:
        outcome = "failed promotion" if result.promoted else "miss"
    engine.release(found, ctx)
    return outcome


def drop_page_cache(path: Path) -> int:
    """Write back and drop the cached pages of every file under ``path``; returns the number of files."""
    count = 0
    for file in path.rglob("*"):
        if file.is_file() and not file.is_symlink():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            count += 1
    return count


def filesystem(path: Path) -> str:
    """The type and device of the mount holding ``path`` (longest matching mount point)."""
    best, kind = "", "unknown"
    real = os.path.realpath(path)
    with open("/proc/mounts") as mounts:
        for line in mounts:
            device, point, fstype = line.split()[:3]
            if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
                best, kind = point, f"{fstype} ({device} on {point})"
    return kind


# --- one chunk size: the two tiers side by side, repeated -----------------------------------------


@dataclass(frozen=True)
class Setup:
    """What every engine of the run shares: the model folder, the CPU tier's bytes, requests per batch."""

    model_dir: Path
    cpu_bytes: int
    requests: int


class TierRun:
    """One tier in a directory of its own for one repetition: its engines, one after the other (a restart
    between phases), and the figures they gave."""

    def __init__(self, tier: str, chunks: Chunks, setup: Setup, root: Path) -> None:
        self.tier, self.chunks, self.setup, self.root = tier, chunks, setup, root
        self.entry = tier_entry(tier, root, len(chunks.keys))
        self.victim = chunks.keys[len(chunks.keys) // 2]  # the chunk whose byte is flipped
        self.victim_file: str | None = None
        self.figures: dict = {}

    def engine(self) -> Engine:
        return Engine(self.setup.model_dir, self.entry, self.chunks.size, self.setup.cpu_bytes)

    @property
    def total(self) -> int:
        return self.chunks.size * len(self.chunks.keys)

    def store(self) -> None:
        engine = self.engine()
        self.figures["o_direct"] = engine.o_direct()
        if self.tier == "fs":
            self.victim_file = engine.tier.file_mapper.get_file_name(self.victim)
        seconds = store_all(engine, self.chunks, self.setup.requests)
        engine.shutdown()
        self.figures.update(store_s=seconds, store_gbps=self.total / seconds / 1e9)

    def load(self) -> None:
        """After a restart: the tier's lookups, then every chunk promoted and checked."""
        engine = self.engine()
        present, absent = tier_lookups(engine, self.chunks.keys), tier_lookups(engine, self.chunks.absent)
        seconds, loaded, wrong = load_all(engine, self.chunks, self.setup.requests)
        engine.shutdown()
        self.figures.update(
            load_s=seconds,
            load_gbps=self.total / seconds / 1e9,
            loaded=loaded,
            mismatches=wrong,
            recovered=present.found,
            absent_found=absent.found,
            lookup_hit_us=present.call_us,
            lookup_miss_us=absent.call_us,
            lookup_hit_definite_us=present.definite_us,
            lookup_miss_definite_us=absent.definite_us,
            lookup_batch_ms=present.batch_ms,
        )

    def flip(self) -> None:
        """Damage one byte of the victim on disk, restart, and ask for it."""
        if self.tier == "fs":
            path, offset = Path(self.victim_file), self.chunks.size // 2
        else:
            path = self.root / SLAB_NAME
            offset = find_in_file(path, self.chunks.probe(self.victim)) + PROBE // 2
        flip_byte(path, offset)
        drop_page_cache(self.root)
        engine = self.engine()
        outcome = corrupted_outcome(engine, self.chunks, self.victim)
        engine.shutdown()
        self.figures.update(
            flipped_byte=outcome,
            flipped_byte_ok=outcome in ("miss", "failed promotion, then miss"),
            flipped_file=os.path.relpath(path, self.root),
        )


def run_size(label: str, total: int, setup: Setup, base: Path, repeat: int) -> dict:
    """Both tiers at one chunk size, ``repeat`` times. In each repetition the two stores run back to back,
    then (page cache dropped) the two restarts and loads; the tier that goes first alternates. The
    flipped byte is tried in the first repetition."""
    size = SIZES[label]
    chunks = Chunks(label, size, max(1, total // size))
    print(
        f"\n{label} chunks: {len(chunks.keys)} ({format_size(len(chunks.keys) * size)}), CPU tier "
        f"{format_size(setup.cpu_bytes)} ({setup.cpu_bytes // size} chunks a batch, {setup.requests} requests "
        f"each), {repeat} repetitions",
        flush=True,
    )
    figures: dict[str, list[dict]] = {tier: [] for tier in TIERS}
    for rep in range(repeat):
        started = time.perf_counter()
        order = TIERS if rep % 2 == 0 else TIERS[::-1]
        runs = [TierRun(tier, chunks, setup, base / label / f"{tier}-{rep}") for tier in order]
        for run in runs:
            run.store()
        for run in runs:
            drop_page_cache(run.root)
        for run in runs:
            run.load()
        for run in runs if rep == 0 else ():
            run.flip()
        for run in runs:
            figures[run.tier].append(run.figures)
            shutil.rmtree(run.root, ignore_errors=True)
        print(
            f"  {rep + 1}/{repeat} ({' first, '.join(order)} second): "
            + "; ".join(
                f"{way} " + ", ".join(f"{t} {figures[t][-1][f'{way}_gbps']:.3f}" for t in TIERS) + " GB/s"
                for way in WAYS
            )
            + f" ({time.perf_counter() - started:.1f} s)",
            flush=True,
        )
    return summary(figures, len(chunks.keys))


def summary(figures: dict[str, list[dict]], count: int) -> dict:
    """Per tier: GB/s as the median and the best of the repetitions (and each), the lookup figures' medians,
    the worst of the counts; per direction the median of the repetitions' kvtier / fs ratios (the two
    tiers of one repetition ran seconds apart; the disk's speed drifts over minutes)."""
    out: dict = {"chunks": count, "repeat": len(figures[TIERS[0]])}
    for tier, reps in figures.items():
        row: dict = {}
        for way in WAYS:
            speeds = [r[f"{way}_gbps"] for r in reps]
            row.update(
                {
                    f"{way}_gbps": round(median(speeds), 3),
                    f"{way}_gbps_best": round(max(speeds), 3),
                    f"{way}_gbps_all": [round(v, 3) for v in speeds],
                }
            )
        for name in (
            "lookup_hit_us",
            "lookup_miss_us",
            "lookup_hit_definite_us",
            "lookup_miss_definite_us",
            "lookup_batch_ms",
        ):
            row[name] = round(median(r[name] for r in reps), 2)
        row.update(
            recovered=min(r["recovered"] for r in reps),
            absent_found=max(r["absent_found"] for r in reps),
            loaded=min(r["loaded"] for r in reps),
            mismatches=sum(r["mismatches"] for r in reps),
            o_direct=all(r["o_direct"] for r in reps),
        )
        row.update({k: reps[0][k] for k in ("flipped_byte", "flipped_byte_ok", "flipped_file")})
        out[tier] = row
    out["ratio"] = {
        way: round(
            median(k[f"{way}_gbps"] / f[f"{way}_gbps"] for k, f in zip(figures["kvtier"], figures["fs"], strict=True)),
            4,
        )
        for way in WAYS
    }
    return out


# --- the report ------------------------------------------------------------------------------------


ROWS = (
    ("store GB/s (median)", "store_gbps", "{:.3f}"),
    ("store GB/s (best)", "store_gbps_best", "{:.3f}"),
    ("load GB/s (median)", "load_gbps", "{:.3f}"),
    ("load GB/s (best)", "load_gbps_best", "{:.3f}"),
    ("lookup hit us/key (call)", "lookup_hit_us", "{:.2f}"),
    ("lookup miss us/key (call)", "lookup_miss_us", "{:.2f}"),
    ("lookup hit us/key (definite)", "lookup_hit_definite_us", "{:.2f}"),
    ("lookup miss us/key (definite)", "lookup_miss_definite_us", "{:.2f}"),
    ("recovered after restart", "recovered", "{}"),
    ("absent keys found", "absent_found", "{}"),
    ("promoted", "loaded", "{}"),
    ("promoted with wrong bytes", "mismatches", "{}"),
    ("flipped byte", "flipped_byte", "{}"),
    ("O_DIRECT", "o_direct", "{}"),
)


def print_table(sizes: dict) -> None:
    """One table per chunk size; the last column: kvtier / fs (GB/s rows: the median of the paired ratios
    for medians, the ratio of the bests for bests)."""
    for label, figures in sizes.items():
        print(f"\n{label} chunks ({figures['chunks']}, {figures['repeat']} repetitions)")
        header = f"{'':<32}" + "".join(f"{t:>20}" for t in TIERS) + f"{'kvtier/fs':>12}"
        print(header)
        print("-" * len(header))
        for title, name, fmt in ROWS:
            values = [figures[t][name] for t in TIERS]
            share = ""
            if name.endswith("_gbps"):
                share = f"{figures['ratio'][name.removesuffix('_gbps')]:>12.3f}"
            elif name.endswith("_best"):
                share = f"{values[0] / values[1]:>12.3f}"
            print(f"{title:<32}" + "".join(f"{fmt.format(v):>20}" for v in values) + share)


def run_policy() -> dict | None:
    """bench/vllm_tiering_policy.py's result (it prints its own table and JSON), or None when it is not there."""
    if not POLICY_BENCH.is_file():
        print(f"\n--policy: {POLICY_BENCH} not found; skipped")
        return None
    spec = importlib.util.spec_from_file_location("vllm_tiering_policy", POLICY_BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    print(f"\n--- {POLICY_BENCH.name} ---", flush=True)
    return module.main([])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total", default="512MiB", help="bytes of chunks stored per chunk size and tier")
    parser.add_argument("--cpu", default="128MiB", help="vLLM's CPU tier (cpu_bytes_to_use): one batch")
    parser.add_argument("--requests", type=int, default=8, help="requests per batch (one job each)")
    parser.add_argument("--repeat", type=int, default=5, help="repetitions of every measurement")
    parser.add_argument("--dir", default=None, help="where the tiers' directories go (default: a temp dir in /tmp)")
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"comma separated, of {', '.join(SIZES)}")
    parser.add_argument("--policy", action="store_true", help="also run bench/vllm_tiering_policy.py")
    args = parser.parse_args(argv)
    labels = args.sizes.split(",")
    if unknown := [label for label in labels if label not in SIZES]:
        parser.error(f"unknown sizes: {unknown}")
    total, cpu_bytes = parse_size(args.total), parse_size(args.cpu)
    if any(cpu_bytes < SIZES[label] * args.requests for label in labels):
        parser.error("--cpu must hold a chunk for each of --requests")

    started = time.perf_counter()
    base = Path(tempfile.mkdtemp(prefix="kvtier-vllm-tiering-", dir=args.dir))
    try:
        model_dir = base / "model"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(MODEL_JSON))
        fs_kind = filesystem(base)
        print(f"directory {base}: {fs_kind}")
        setup = Setup(model_dir, cpu_bytes, args.requests)
        sizes = {label: run_size(label, total, setup, base, args.repeat) for label in labels}
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print_table(sizes)
    parts = {f"{label}_{way}": figures["ratio"][way] for label, figures in sizes.items() for way in WAYS}
    ratio = min(parts.values())
    wall = time.perf_counter() - started
    print(f"\nratio (min over sizes and directions of kvtier/fs GB/s, paired medians) {ratio:.3f}; wall {wall:.1f} s")
    result = {
        "ratio": ratio,
        "ratios": parts,
        "sizes": sizes,
        "filesystem": fs_kind,
        "total_bytes": total,
        "cpu_bytes": cpu_bytes,
        "requests": args.requests,
        "repeat": args.repeat,
        "wall_s": round(wall, 1),
    }
    if args.policy:
        policy = run_policy()
        result["policy"] = policy
        result["policy_ratio"] = policy.get("ratio") if policy else None
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
