"""Store and load throughput of the disk tier's I/O path, against plain O_DIRECT I/O of the same bytes.

What is measured
    ``kvtier.tiers.disk.transfer.DiskBackend`` moving a batch of blocks between a host slab
    (``kvtier.tiers.host.HostSlab``, page-aligned memory) and a disk slab (``DiskSlab`` +
    ``FileStorage``, one preallocated file of 4 KiB slot header + block bytes per slot), for 2 MiB
    and 64 KiB blocks:

    * store, fresh slots:  host -> disk into a newly created (fallocated, never written) slab;
    * store, reused slots: host -> disk into slots that already hold valid blocks.
      Either way each slot, header page and bytes, goes in one write (a run of consecutive slots in
      one ``pwritev``), with no fdatasync: the header checksums the bytes, so a torn slot is a miss.
    * load: disk -> host. One ``preadv`` of header + bytes per block; the backend checks the header
      and the xxh3 checksum of every block.

    Each figure is a whole job as a caller sees it: from ``submit`` (slot -> offset planning
    included) until ``on_complete`` has run.

Reference, measured in the same run and in the same directory
    A plain sequential write of the same bytes from the same memory (host slab A) in
    ``REF_CHUNK`` pieces on a descriptor opened with O_DIRECT, followed by one fdatasync (inside the
    time), and a sequential O_DIRECT read of them back into host slab B, where kvtier loads to (why
    the same memory: see ``Reference``). The write is measured twice, to match the two
    store cases: into a freshly fallocated file (ext4 and xfs then convert unwritten extents, as they
    do for a fresh slab) and over the same file once written. Fresh stores are compared with the
    fresh-file write, reused stores with the overwrite, loads with the read. O_DIRECT keeps the page
    cache out of the reads; where the filesystem refuses O_DIRECT (or with ``--o-direct off``) both
    sides use buffered I/O and the file's cached pages are dropped (fdatasync, then
    POSIX_FADV_DONTNEED, untimed) before each read, and the output says so. Repetitions of kvtier
    and reference are interleaved, each kvtier operation right before its reference. GB/s figures
    are the best of ``--repeat``; a ratio is the median over the repetitions of kvtier's speed over
    the reference's measured right after it (a shared disk's load drifts from second to second, and
    a pair sees about the same load; the best of each side may come from different moments). The
    table also gives the paired ratios' range and the ratio of the two best figures.

    When ``fio`` is installed, one sequential write job (``end_fsync=1``) and one read job with
    ``direct=1``, ``bs`` = the block size and ``iodepth`` = the backend's I/O thread count (libaio)
    are run on a file in the same directory: what the device gives for I/O of that size at that
    concurrency. fio's own bandwidth figure is reported, best of ``--repeat`` runs.

Why
    A disk tier pays off when loading a block from it beats recomputing the block, and a store path
    that keeps its crash-safety promise (no wrong bytes after any crash) must not cost much of the
    device's bandwidth to do so. The ratio kvtier / reference says how much of what a plain
    sequential writer or reader gets from this directory the block path keeps: its per-block
    header pages, system calls and checksums. The reference's fdatasync is in its time and kvtier
    stores none: a cache may lose its newest blocks in a power loss, never return wrong ones.

Correctness
    Every load (kvtier's and the reference's) goes into a poisoned host slab B and must give back
    host slab A bit for bit (checked after the timing); every kvtier job must also report no failed
    block (the backend verifies key, namespace, length and checksum). A first untimed pass runs on a
    backend that counts system calls, which the table reports per job. The script exits non-zero on
    any mismatch or failed block.

Compression (information for choosing the disk tier's ``compression`` setting)
    Synthetic bf16 KV-like values (``torch.randn * 0.5`` cast to bfloat16; numpy rounding when torch
    is absent), a few MiB, compressed on one thread with lz4 (frame format) and zstd level 1, each
    on the raw bytes and after splitting every 16-bit value into a plane of high bytes (sign,
    exponent, top mantissa bit) and a plane of low bytes, each plane compressed on its own. Ratio =
    original / compressed bytes; MB/s counts original bytes, split and merge included. Real KV
    caches (outlier channels, RoPE'd keys) may compress differently from Gaussian noise. Codecs
    that are not installed are skipped with a note.

Sealed slots (``encryption: aes-gcm``)
    A second slab of the same geometry that seals its slots, in the same directory: its stores into
    reused slots and its loads, each right after the plain slab's (the order turning every repetition),
    every load checked bit-exact. ``sealed_ratio``: sealed / plain, the lower of store and load (paired
    medians), 2 MiB blocks; ``sealed`` per block size.

The last line printed is one JSON object; ``ratio`` is the smallest of the kvtier / reference
ratios (paired medians) for 2 MiB blocks (fresh store, reused store, load), ``small_ratio`` the
same for 64 KiB blocks.

Run: ``.venv/bin/python bench/disk.py [--dir PATH] [--repeat 5] [--io-threads 8]``
"""

from __future__ import annotations

import argparse
import errno
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import xxhash
from rig import TransferFailed, run_transfer

from kvtier.core.layout import BlockLayout
from kvtier.core.sealing import SealingKeys
from kvtier.core.transfer import Transfer
from kvtier.tiers.disk.slab import DiskSlab, FileStorage
from kvtier.tiers.disk.transfer import DiskBackend
from kvtier.tiers.host import HostSlab

GB = 1e9
MB = 1e6
KiB = 1 << 10
MiB = 1 << 20
PAGE = 4096
REF_CHUNK = 8 * MiB
NAMESPACE = "bench-disk"
SEAL_SECRET = b"bench disk sealing secret, 32 b!"


class Mismatch(RuntimeError):
    pass


# --- the directory ------------------------------------------------------------------------------


def filesystem_of(path: str) -> tuple[str, str, str]:
    """(filesystem type, mount point, source) of the mount holding ``path``, from /proc/mounts."""
    real = os.path.realpath(path)
    best = ("?", "", "?")
    try:
        with open("/proc/mounts") as f:
            lines = f.read().splitlines()
    except OSError:
        return best
    unescape = lambda s: re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)  # noqa: E731
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        source, mount, fstype = unescape(fields[0]), unescape(fields[1]), fields[2]
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best[1]):  # the deepest mount wins; a later one shadows an earlier
            best = (fstype, mount, source)
    return best


def drop_cache(fd: int) -> None:
    """Make the next buffered read of this file come from the device: flush it, then drop its cached
    pages. Only called for a side that fell back to buffered I/O: O_DIRECT reads bypass the cache, and
    an fdatasync here would do, untimed, work that belongs to the job that dirtied the pages."""
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


# --- the kvtier side ----------------------------------------------------------------------------


class CountingDiskBackend(DiskBackend):
    """The disk backend with its system calls counted (used for the untimed correctness pass only)."""

    def __init__(self, io_threads: int) -> None:
        super().__init__(io_threads)
        # next() on an itertools.count is atomic under the GIL, so the I/O threads need no lock
        self.counts = {name: itertools.count() for name in ("pwritev", "preadv")}

    def take(self) -> dict[str, int]:
        """Counts since the last call; resets them."""
        out = {name: next(counter) for name, counter in self.counts.items()}
        self.counts = {name: itertools.count() for name in self.counts}
        return out

    def _pwritev(self, fd, buffers, offset):
        next(self.counts["pwritev"])
        return super()._pwritev(fd, buffers, offset)

    def _preadv(self, fd, buffers, offset):
        next(self.counts["preadv"])
        return super()._preadv(fd, buffers, offset)


def make_keys(block_bytes: int, generation: int, n: int) -> list[bytes]:
    """Distinct keys per generation, so a load only passes if the newest headers were written."""
    return [xxhash.xxh3_128_digest(f"{block_bytes}/{generation}/{i}".encode()) for i in range(n)]


class DiskSide:
    """The disk slab under test, fresh slabs made on demand, and the host slabs on either side."""

    def __init__(
        self,
        root: str,
        layout: BlockLayout,
        n: int,
        o_direct: str,
        rng: np.random.Generator,
        sealing: SealingKeys | None = None,
    ) -> None:
        self.root, self.layout, self.n, self.o_direct_mode, self.sealing = root, layout, n, o_direct, sealing
        self.slots = list(range(n))
        self.src = HostSlab(n, layout)
        self.src.array[:] = np.frombuffer(rng.bytes(self.src.nbytes), dtype=np.uint8)  # every block differs
        self.dst = HostSlab(n, layout)
        self.dst.array[:] = 0  # touch the pages before any timing
        self.slab, self.storage = self._open(os.path.join(root, "kvtier"))
        self.o_direct = self.slab.o_direct
        self._fresh = itertools.count()

    def _open(self, path: str) -> tuple[DiskSlab, FileStorage]:
        slab = DiskSlab(path, self.n, self.layout, NAMESPACE, self.o_direct_mode, sealing=self.sealing)
        return slab, FileStorage(slab, self.layout)

    def store(self, storage: FileStorage, keys: list[bytes]) -> Transfer:
        return Transfer(self.src.storage, self.slots, storage, self.slots, keys)

    def load(self, keys: list[bytes]) -> Transfer:
        return Transfer(self.storage, self.slots, self.dst.storage, self.slots, keys)

    def fresh_store(self, backend: DiskBackend, keys: list[bytes]) -> float:
        """Time one store into a newly created slab (never-written slots), then delete that slab."""
        path = os.path.join(self.root, f"fresh-{next(self._fresh)}")
        slab, storage = self._open(path)
        try:
            return run_transfer(backend, self.store(storage, keys))
        finally:
            storage.close()
            shutil.rmtree(path, ignore_errors=True)

    def timed_load(self, backend: DiskBackend, keys: list[bytes]) -> float:
        """Time one load into the poisoned destination slab, then check every byte (untimed)."""
        self.dst.array[:] = 0xA5  # a load that never happened cannot pass
        if not self.o_direct:
            drop_cache(self.slab.fd)
        seconds = run_transfer(backend, self.load(keys))
        self.verify()
        return seconds

    def verify(self) -> None:
        if not np.array_equal(self.src.array, self.dst.array):
            bad = int(np.flatnonzero(self.src.array != self.dst.array)[0]) // self.layout.block_bytes
            raise Mismatch(
                f"{self.layout.block_bytes // KiB} KiB blocks: block {bad} loaded from disk "
                f"differs from the bytes stored"
            )

    def close(self) -> None:
        self.storage.close()
        self.src.close()
        self.dst.close()


# --- the reference ------------------------------------------------------------------------------


class Reference:
    """Plain sequential I/O through one descriptor, O_DIRECT where the filesystem allows.

    It writes from and reads into the very memory the kvtier side uses (``out`` is the source host
    slab, ``back`` the destination one). Direct I/O speed depends on where the user pages lie in
    physical memory: a 2 MiB transfer into scattered 4 KiB pages needs more segments than one virtio
    request takes (254 here), and the same reads ran at 2.1 GB/s into a fragmented buffer and 2.7 GB/s
    into a huge-page-backed one. Buffers of its own would compare the kernel's page placement, not
    the I/O paths.
    """

    def __init__(self, root: str, out: np.ndarray, back: np.ndarray, want_direct: bool) -> None:
        self.path = os.path.join(root, "reference.dat")
        self.nbytes = len(out)
        self.out, self.back = out, back  # page-aligned (mmap'd host slabs): what O_DIRECT needs
        self.want_direct = want_direct
        self.o_direct = False
        self.fd = -1

    def _open_fresh(self) -> None:
        """A new file, fallocated like a fresh slab (unwritten extents)."""
        if self.fd >= 0:
            os.close(self.fd)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        flags = os.O_RDWR | os.O_CREAT
        self.fd, self.o_direct = -1, False
        if self.want_direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd, self.o_direct = os.open(self.path, flags | os.O_DIRECT, 0o644), True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
        if self.fd < 0:
            self.fd = os.open(self.path, flags, 0o644)
        try:
            os.posix_fallocate(self.fd, 0, self.nbytes)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
        os.fsync(self.fd)

    def _write(self) -> float:
        with memoryview(self.out) as view:
            start = time.perf_counter()
            for at in range(0, self.nbytes, REF_CHUNK):
                piece = view[at : at + REF_CHUNK]
                if os.pwrite(self.fd, piece, at) != len(piece):
                    raise OSError(errno.EIO, "reference: short write")
            os.fdatasync(self.fd)
            return time.perf_counter() - start

    def write_fresh(self) -> float:
        self._open_fresh()
        return self._write()

    def overwrite(self) -> float:
        return self._write()

    def read(self) -> float:
        self.back[:] = 0x5A
        if not self.o_direct:
            drop_cache(self.fd)
        with memoryview(self.back) as view:
            start = time.perf_counter()
            for at in range(0, self.nbytes, REF_CHUNK):
                piece = view[at : at + REF_CHUNK]
                if os.preadv(self.fd, [piece], at) != len(piece):
                    raise OSError(errno.EIO, "reference: short read")
            elapsed = time.perf_counter() - start
        if not np.array_equal(self.out, self.back):
            raise Mismatch("reference read returned other bytes than it wrote")
        return elapsed

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self.out = self.back = None  # the host slabs can be unmapped now


# --- fio ----------------------------------------------------------------------------------------


def run_fio(fio: str, root: str, block_bytes: int, nbytes: int, iodepth: int, repeat: int) -> dict:
    """Sequential write (end_fsync) then read, direct=1, ``repeat`` times: the best GB/s of each, from
    fio's JSON; an error is recorded, not raised."""
    path = os.path.join(root, "fio.dat")
    common = [
        f"--filename={path}",
        f"--bs={block_bytes}",
        f"--size={nbytes}",
        "--direct=1",
        "--ioengine=libaio",
        f"--iodepth={iodepth}",
        "--numjobs=1",
        "--output-format=json",
    ]
    out: dict = {"bs": block_bytes, "iodepth": iodepth, "ioengine": "libaio", "write_gbps": None, "read_gbps": None}
    try:
        for rw, extra in (("write", ["--end_fsync=1"]), ("read", [])) * repeat:
            proc = subprocess.run(
                [fio, f"--name=kvtier-{rw}", f"--rw={rw}", *common, *extra], capture_output=True, text=True, timeout=120
            )
            if proc.returncode != 0:
                raise RuntimeError(f"fio {rw} exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
            text = proc.stdout[proc.stdout.find("{") :]  # fio may print notes before the JSON
            job = json.loads(text)["jobs"][0]
            if job.get("error"):
                raise RuntimeError(f"fio {rw} job error {job['error']}")
            out[f"{rw}_gbps"] = max(out[f"{rw}_gbps"] or 0.0, round(job[rw]["bw_bytes"] / GB, 3))
    except (RuntimeError, ValueError, KeyError, OSError, subprocess.TimeoutExpired) as exc:
        out["error"] = str(exc)
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return out


# --- one block size -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Size:
    block_bytes: int
    blocks: int

    @property
    def nbytes(self) -> int:
        return self.block_bytes * self.blocks

    @property
    def label(self) -> str:
        return f"{self.block_bytes // MiB} MiB" if self.block_bytes >= MiB else f"{self.block_bytes // KiB} KiB"


def bench_size(size: Size, parent: str, args: argparse.Namespace, rng: np.random.Generator) -> tuple[list[dict], dict]:
    layout = BlockLayout.contiguous(size.block_bytes)
    root = os.path.join(parent, f"{size.block_bytes // KiB}k")  # one slab geometry per folder
    os.makedirs(root)
    side = DiskSide(root, layout, size.blocks, args.o_direct, rng)
    sealed_root = os.path.join(root, "sealed")
    os.makedirs(sealed_root)
    sealed = DiskSide(sealed_root, layout, size.blocks, args.o_direct, rng, SealingKeys(SEAL_SECRET))
    ref = Reference(root, side.src.array, side.dst.array, want_direct=args.o_direct != "off")
    counting = CountingDiskBackend(args.io_threads)
    backend = DiskBackend(args.io_threads)
    try:
        # Correctness pass (and warm-up), with system calls counted: fresh store, reused store, load.
        calls = {}
        generation = 0
        run_transfer(counting, side.store(side.storage, make_keys(size.block_bytes, generation, size.blocks)))
        calls["store fresh"] = counting.take()
        generation += 1
        keys = make_keys(size.block_bytes, generation, size.blocks)
        run_transfer(counting, side.store(side.storage, keys))
        calls["store reused"] = counting.take()
        side.timed_load(counting, keys)
        calls["load"] = counting.take()
        run_transfer(backend, sealed.store(sealed.storage, keys))
        sealed.timed_load(backend, keys)  # (checked bit-exact)

        times: dict[str, list[float]] = {
            name: []
            for name in (
                *("store fresh", "store reused", "load", "ref fresh", "ref overwrite", "ref read"),
                *("plain store", "plain load", "sealed store", "sealed load"),
            )
        }

        def keep(name: str, seconds: float) -> None:
            times[name].append(seconds)

        for _ in range(args.repeat):
            generation += 1
            keys = make_keys(size.block_bytes, generation, size.blocks)
            keep("store fresh", side.fresh_store(backend, keys))
            keep("ref fresh", ref.write_fresh())
            keep("store reused", run_transfer(backend, side.store(side.storage, keys)))
            keep("ref overwrite", ref.overwrite())
            keep("load", side.timed_load(backend, keys))
            keep("ref read", ref.read())
            pair = [("plain", side), ("sealed", sealed)]
            for which, disk in pair if len(times["load"]) % 2 else pair[::-1]:  # (each goes first in turn)
                keep(f"{which} store", run_transfer(backend, disk.store(disk.storage, keys)))
                keep(f"{which} load", disk.timed_load(backend, keys))

        fio = run_fio(args.fio, root, size.block_bytes, size.nbytes, args.io_threads, args.repeat) if args.fio else None
        best = {name: min(seconds) for name, seconds in times.items()}
        gbps = {name: size.nbytes / seconds / GB for name, seconds in best.items()}
        pairs = (
            ("store fresh", "ref fresh", "write, fresh file", "write"),
            ("store reused", "ref overwrite", "write, overwrite", "write"),
            ("load", "ref read", "read", "read"),
        )
        rows = []
        for op, ref_name, ref_label, fio_dir in pairs:
            c = calls[op]
            # each kvtier figure over the reference measured right after it: a pair shares the disk's mood
            paired = sorted(ref_s / op_s for op_s, ref_s in zip(times[op], times[ref_name], strict=True))
            rows.append(
                {
                    "block_bytes": size.block_bytes,
                    "op": op,
                    "blocks": size.blocks,
                    "bytes": size.nbytes,
                    "gbps": round(gbps[op], 3),
                    "reference": ref_label,
                    "reference_gbps": round(gbps[ref_name], 3),
                    "ratio": round(statistics.median(paired), 3),
                    "ratio_min": round(paired[0], 3),
                    "ratio_max": round(paired[-1], 3),
                    "ratio_best": round(gbps[op] / gbps[ref_name], 3),
                    "fio_gbps": fio.get(f"{fio_dir}_gbps") if fio else None,
                    "ms": round(best[op] * 1e3, 1),
                    "pwritev": c["pwritev"],
                    "preadv": c["preadv"],
                }
            )
        sealing = {}
        for op in ("store", "load"):
            paired = sorted(p / s for p, s in zip(times[f"plain {op}"], times[f"sealed {op}"], strict=True))
            sealing[f"{op}_gbps"] = round(size.nbytes / min(times[f"sealed {op}"]) / GB, 3)
            sealing[f"plain_{op}_gbps"] = round(size.nbytes / min(times[f"plain {op}"]) / GB, 3)
            sealing[f"{op}_ratio"] = round(statistics.median(paired), 3)
        sealing["ratio"] = min(sealing["store_ratio"], sealing["load_ratio"])
        info = {"o_direct": side.o_direct, "reference_o_direct": ref.o_direct, "fio": fio, "sealed": sealing}
        return rows, info
    finally:
        counting.close()
        backend.close()
        ref.close()
        side.close()
        sealed.close()
        shutil.rmtree(root, ignore_errors=True)


# --- compression --------------------------------------------------------------------------------


def bf16_kv_like(nbytes: int, seed: int) -> np.ndarray:
    """``nbytes`` of bf16 values ~ N(0, 0.5^2), as uint8."""
    n = nbytes // 2
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        gen = torch.Generator().manual_seed(seed)
        values = (torch.randn(n, generator=gen) * 0.5).to(torch.bfloat16)
        return values.view(torch.int16).numpy().view(np.uint8).copy()
    bits = (np.random.default_rng(seed).standard_normal(n, dtype=np.float32) * np.float32(0.5)).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even, like a bf16 cast
    return rounded.astype(np.uint16).view(np.uint8)


def split_planes(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(high bytes, low bytes) of little-endian 16-bit values, each contiguous."""
    values = raw.view(np.uint16)
    return (values >> 8).astype(np.uint8), values.astype(np.uint8)  # the cast keeps the low byte


def merge_planes(high: np.ndarray, low: np.ndarray) -> np.ndarray:
    return ((high.astype(np.uint16) << 8) | low).view(np.uint8)


def codecs() -> tuple[list[tuple[str, object, object]], list[str]]:
    """[(name, compress, decompress)] of the installed codecs, and a note for each missing one."""
    found, missing = [], []
    try:
        import lz4.frame as lz4f

        found.append(("lz4", lz4f.compress, lz4f.decompress))
    except ImportError:
        missing.append("lz4 is not installed (pip install lz4): skipped")
    try:
        import zstandard

        cctx, dctx = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
        found.append(("zstd-1", cctx.compress, dctx.decompress))
    except ImportError:
        missing.append("zstandard is not installed (pip install zstandard): skipped")
    return found, missing


def bench_compression(nbytes: int, repeat: int, seed: int) -> tuple[list[dict], list[str]]:
    available, notes = codecs()
    if not available:
        return [], notes
    raw = bf16_kv_like(nbytes, seed)
    raw_bytes = raw.tobytes()
    rows = []
    for name, compress, decompress in available:

        def pack_raw(compress=compress):
            return [compress(raw_bytes)]

        def unpack_raw(frames, decompress=decompress):
            return np.frombuffer(decompress(frames[0]), dtype=np.uint8)

        def pack_split(compress=compress):
            high, low = split_planes(raw)
            return [compress(high), compress(low)]

        def unpack_split(frames, decompress=decompress):
            high = np.frombuffer(decompress(frames[0]), dtype=np.uint8)
            low = np.frombuffer(decompress(frames[1]), dtype=np.uint8)
            return merge_planes(high, low)

        for layout, pack, unpack in (("raw", pack_raw, unpack_raw), ("byte-split", pack_split, unpack_split)):
            unpack(pack())  # warm-up: first-call setup (contexts, allocations) is not part of the rate
            best_c = best_d = float("inf")
            for _ in range(repeat):
                t0 = time.perf_counter()
                frames = pack()
                t1 = time.perf_counter()
                back = unpack(frames)
                t2 = time.perf_counter()
                best_c, best_d = min(best_c, t1 - t0), min(best_d, t2 - t1)
            if not np.array_equal(back, raw):
                raise Mismatch(f"{name} {layout}: decompressed bytes differ from the input")
            row = {
                "codec": name,
                "layout": layout,
                "bytes": nbytes,
                "ratio": round(nbytes / sum(len(f) for f in frames), 3),
                "compress_mbps": round(nbytes / best_c / MB, 1),
                "decompress_mbps": round(nbytes / best_d / MB, 1),
            }
            if layout == "byte-split":
                row["high_plane_ratio"] = round(nbytes / 2 / len(frames[0]), 3)
                row["low_plane_ratio"] = round(nbytes / 2 / len(frames[1]), 3)
            rows.append(row)
    return rows, notes


def checksum_gbps(nbytes: int, repeat: int) -> float:
    """xxh3-64 over ``nbytes`` on one thread: what the backend spends per byte on every store and load."""
    data = np.frombuffer(os.urandom(nbytes), dtype=np.uint8)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        xxhash.xxh3_64_intdigest(data)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / GB


# --- output -------------------------------------------------------------------------------------


def print_table(rows: list[dict], header_line: str) -> None:
    header = (
        "block",
        "op",
        "blocks",
        "MiB",
        "syscalls/job",
        "kvtier GB/s",
        "reference",
        "ref GB/s",
        "ratio",
        "paired min-max",
        "best/best",
        "fio GB/s",
    )
    lines = []
    for r in rows:
        calls = " ".join(f"{r[k]} {k}" for k in ("pwritev", "preadv") if r[k])
        fio = "-" if r["fio_gbps"] is None else f"{r['fio_gbps']:.2f}"
        label = f"{r['block_bytes'] // MiB} MiB" if r["block_bytes"] >= MiB else f"{r['block_bytes'] // KiB} KiB"
        lines.append(
            (
                label,
                r["op"],
                str(r["blocks"]),
                str(r["bytes"] // MiB),
                calls,
                f"{r['gbps']:.2f}",
                r["reference"],
                f"{r['reference_gbps']:.2f}",
                f"{r['ratio']:.2f}",
                f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}",
                f"{r['ratio_best']:.2f}",
                fio,
            )
        )
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    left = {0, 1, 4, 6}
    fmt = "  ".join(("{:<%d}" if i in left else "{:>%d}") % w for i, w in enumerate(widths))
    print(header_line)
    print(fmt.format(*header))
    print("  ".join("-" * w for w in widths))
    for line in lines:
        print(fmt.format(*line))


def print_compression(rows: list[dict], notes: list[str], nbytes: int) -> None:
    print()
    print(f"compression of {nbytes // MiB} MiB of bf16 N(0, 0.5^2) values, one thread (MB/s of original bytes)")
    for note in notes:
        print(f"  note: {note}")
    if not rows:
        return
    header = ("codec", "layout", "ratio", "compress MB/s", "decompress MB/s", "high plane", "low plane")
    lines = [
        (
            r["codec"],
            r["layout"],
            f"{r['ratio']:.3f}",
            f"{r['compress_mbps']:.0f}",
            f"{r['decompress_mbps']:.0f}",
            f"{r['high_plane_ratio']:.3f}" if "high_plane_ratio" in r else "-",
            f"{r['low_plane_ratio']:.3f}" if "low_plane_ratio" in r else "-",
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    fmt = "  ".join(("{:<%d}" if i < 2 else "{:>%d}") % w for i, w in enumerate(widths))
    print(fmt.format(*header))
    print("  ".join("-" * w for w in widths))
    for line in lines:
        print(fmt.format(*line))


# --- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--dir",
        default=None,
        help="directory on the filesystem to measure; a scratch folder is made inside it and "
        "removed afterwards (default: a temporary folder under /tmp)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=5,
        help="repetitions: GB/s are the best, ratios the median of paired runs (default 5: this VM's disk "
        "drifts enough that a median of 3 pairs was off by 0.3 in one run of three)",
    )
    p.add_argument("--io-threads", type=int, default=8, help="DiskBackend I/O threads (default 8, its default)")
    p.add_argument("--large-mib", type=int, default=512, help="bytes per measurement for 2 MiB blocks (default 512)")
    p.add_argument("--small-mib", type=int, default=256, help="bytes per measurement for 64 KiB blocks (default 256)")
    p.add_argument("--compress-mib", type=int, default=8, help="bf16 bytes for the compression section (default 8)")
    p.add_argument(
        "--o-direct",
        choices=("auto", "on", "off"),
        default="auto",
        help="the disk slab's o_direct setting; 'off' also makes the reference buffered (default auto)",
    )
    p.add_argument("--no-fio", action="store_true", help="skip fio even when it is installed")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.repeat < 1 or args.io_threads < 1:
        p.error("--repeat and --io-threads must be at least 1")
    if min(args.large_mib, args.small_mib) < 2 or args.compress_mib < 1:
        p.error("--large-mib and --small-mib must be at least 2, --compress-mib at least 1")
    args.fio = None if args.no_fio else shutil.which("fio")
    return args


def fio_version(args: argparse.Namespace) -> str | None:
    """The fio binary's version where fio runs (``args.fio``), else None."""
    if not args.fio:
        return None
    try:
        return subprocess.run([args.fio, "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown version"


def print_setup(args: argparse.Namespace, root: str, where: tuple[str, str, str], info: dict, fio: str | None) -> None:
    """What was measured against what: the directory, the reference, fio, what a kvtier time covers."""
    fstype, mount, source = where
    big = info[2 * MiB]
    why = "--o-direct off" if args.o_direct == "off" else "the filesystem refused O_DIRECT"
    direct = "O_DIRECT" if big["o_direct"] else f"buffered I/O ({why}; caches dropped before reads)"
    ref_direct = "O_DIRECT" if big["reference_o_direct"] else f"buffered ({why}), caches dropped before reads"
    print(f"directory {root} on {fstype} ({source} mounted at {mount}); kvtier slab: {direct}")
    print(
        f"reference: sequential {REF_CHUNK // MiB} MiB pwrite + fdatasync / preadv, {ref_direct}, from and into "
        f"the same host memory as kvtier; {args.repeat} repetitions interleaved with kvtier: GB/s = best, "
        f"ratio = median of kvtier / the reference run right after it"
    )
    if args.fio:
        print(
            f"fio: {fio}, libaio, iodepth={args.io_threads}, bs = block size, direct=1, "
            f"write with end_fsync=1 (fio's bw figure, best of {args.repeat})"
        )
        for block_bytes, i in info.items():
            if i["fio"] and i["fio"].get("error"):
                print(f"  fio failed for {block_bytes // KiB} KiB: {i['fio']['error']}")
    else:
        print("fio: " + ("skipped (--no-fio)" if args.no_fio else "not installed; no fio figures"))
    print(
        "kvtier times are whole jobs, submit to on_complete (a store writes each slot's header page and bytes "
        "in one call, runs of slots in one pwritev, no fdatasync)"
    )


def print_sealed(info: dict) -> None:
    print("sealed slots (encryption: aes-gcm) against plain ones, reused slots, GB/s (best) and ratio (paired median):")
    for block_bytes, i in info.items():
        z = i["sealed"]
        print(
            f"  {block_bytes // KiB:>5} KiB  store {z['store_gbps']:.2f} / {z['plain_store_gbps']:.2f} = "
            f"{z['store_ratio']:.2f}   load {z['load_gbps']:.2f} / {z['plain_load_gbps']:.2f} = {z['load_ratio']:.2f}"
        )


def figures(rows: list[dict], info: dict, block_bytes: int) -> dict:
    """One block size's figures for the JSON line: kvtier's GB/s and ratios, the references', fio's."""
    by = {(r["block_bytes"], r["op"]): r for r in rows}
    f = {
        "block_bytes": block_bytes,
        "blocks": by[(block_bytes, "load")]["blocks"],
        "bytes": by[(block_bytes, "load")]["bytes"],
    }
    for op in ("store fresh", "store reused", "load"):
        r = by[(block_bytes, op)]
        key = op.replace(" ", "_")
        f[f"{key}_gbps"] = r["gbps"]
        f[f"{key}_ratio"] = r["ratio"]
    f["store_gbps"] = min(f["store_fresh_gbps"], f["store_reused_gbps"])
    f["store_ratio"] = min(f["store_fresh_ratio"], f["store_reused_ratio"])
    f["reference_write_fresh_gbps"] = by[(block_bytes, "store fresh")]["reference_gbps"]
    f["reference_write_gbps"] = by[(block_bytes, "store reused")]["reference_gbps"]
    f["reference_read_gbps"] = by[(block_bytes, "load")]["reference_gbps"]
    fio = info[block_bytes]["fio"]
    f["fio_write_gbps"] = fio["write_gbps"] if fio else None
    f["fio_read_gbps"] = fio["read_gbps"] if fio else None
    return f


def fio_summary(args: argparse.Namespace, info: dict, version: str | None) -> dict:
    if args.fio:
        return {"installed": True, "version": version, **{str(b): i["fio"] for b, i in info.items()}}
    note = "fio not run" if args.no_fio else "fio is not installed"
    return {"installed": bool(shutil.which("fio")), "skipped": args.no_fio, "note": note}


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    sizes = (Size(2 * MiB, args.large_mib // 2), Size(64 * KiB, args.small_mib * 16))
    parent = args.dir if args.dir is not None else tempfile.gettempdir()
    os.makedirs(parent, exist_ok=True)
    root = tempfile.mkdtemp(prefix="kvtier-bench-disk-", dir=parent)
    where, fio = filesystem_of(root), fio_version(args)
    rows: list[dict] = []
    info: dict[int, dict] = {}
    try:
        for size in sizes:
            size_rows, info[size.block_bytes] = bench_size(size, root, args, rng)
            rows += size_rows
        compression, compression_notes = bench_compression(args.compress_mib * MiB, max(args.repeat, 3), args.seed)
    except Mismatch as exc:
        print(f"CORRECTNESS FAILURE: {exc}", file=sys.stderr)
        return 1
    except TransferFailed as exc:
        print(f"TRANSFER FAILURE: {exc}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(root, ignore_errors=True)
    xxh3 = checksum_gbps(64 * MiB, 3)

    print_setup(args, root, where, info, fio)
    print(f"xxh3-64 checksum, one thread: {xxh3:.1f} GB/s (every block is hashed on store and on load)")
    print()
    print_table(rows, f"kvtier DiskBackend(io_threads={args.io_threads}) host <-> disk vs plain sequential I/O")
    print()
    print_sealed(info)
    print_compression(compression, compression_notes, args.compress_mib * MiB)
    large, small = figures(rows, info, 2 * MiB), figures(rows, info, 64 * KiB)
    runtime = time.perf_counter() - started
    print()
    print(f"total runtime {runtime:.1f} s; loads verified bit-exact against the stored bytes for both block sizes")
    summary = {
        "bench": "disk",
        "ratio": round(min(large["store_ratio"], large["load_ratio"]), 3),
        "small_ratio": round(min(small["store_ratio"], small["load_ratio"]), 3),
        "sealed_ratio": info[2 * MiB]["sealed"]["ratio"],
        "sealed": {str(b): i["sealed"] for b, i in info.items()},
        **large,
        "small": small,
        "fs_type": where[0],
        "mount": where[1],
        "o_direct": info[2 * MiB]["o_direct"],
        "reference_o_direct": info[2 * MiB]["reference_o_direct"],
        "reference": f"sequential {REF_CHUNK // MiB} MiB O_DIRECT pwrite + fdatasync / preadv, same directory, "
        f"same host memory as kvtier",
        "fio": fio_summary(args, info, fio),
        "io_threads": args.io_threads,
        "repeat": args.repeat,
        "cpus": os.cpu_count(),
        "checksum_xxh3_gbps": round(xxh3, 2),
        "verified": True,
        "runtime_s": round(runtime, 1),
        "table": rows,
        "compression": compression,
        "compression_notes": compression_notes,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
