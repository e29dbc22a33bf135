"""Gather/scatter of scattered KV blocks between per-layer "device" tensors and the host tier.

What is measured
    The CPU transfer backend (``kvtier.transfers.cpu.CPUBackend``) moving a batch of blocks
    between a layer-outer KV cache allocated as vLLM allocates one (a tensor per layer of at least
    ``LAYER_TENSOR_BYTES``, K and V inside it when split, blocks along a dimension) and a host slab
    (``kvtier.tiers.host.HostSlab``, one contiguous run of ``block_bytes`` per slot):

    * store: device -> host, a gather of the fragments of randomly chosen, scattered device blocks
      into random host slots;
    * load:  host -> device, a scatter from random host slots into random device blocks.

    Device block ids are scattered, so no two fragments are adjacent on both sides: a block is 32
    fragments for packed K/V, 64 with K and V split (the ``memmoves`` column), and each host slot is
    one run the backend copies in one NumPy call. Layer tensors this large are mostly mmapped, so
    their fragments lie a whole number of pages apart and the backend takes them in rows of 4 KiB;
    now and then glibc serves one from its heap, at another offset within a page (and the host slab
    may be mapped between the two): the backend then gives it a table of its own and copies its two
    fragments per slot in the loop (``transfers/cpu.py``, ``_regions``). The time covers
    the whole job as a caller sees it: ``submit`` (slot -> address translation, copy-list
    compilation, the split over threads) until ``on_complete`` has run. The device tensors are CPU
    tensors standing in for a GPU, so this is a measure of the copy machinery and of memory
    bandwidth, not of PCIe.

Reference, measured in the same run
    A contiguous copy of the same number of bytes between two preallocated, pre-touched uint8
    arrays, cut into as many equal parts as the backend has threads and copied at once
    (``np.copyto``, which releases the GIL): what plain copying by that many threads gets here. The
    whole table is measured twice: with the backend's ``--threads`` and with one thread against one
    thread. Repetitions are interleaved with the kvtier repetitions so both see the same machine
    state, and every figure is the best of ``--repeat`` repetitions. glibc picks its memcpy strategy
    by size (non-temporal stores above a threshold that depends on the cache sizes), so the
    reference is not monotonic in the byte count, and a ratio above 1 at such sizes is a property
    of memcpy, not a gain of kvtier. On the 2-core machine of these figures the threshold is 240 MiB
    (``/lib64/ld-linux-x86-64.so.2 --list-tunables``): the 2-thread reference of the 256-block jobs
    copies halves of 256 MiB with non-temporal stores, which no 16-64 KiB fragment copy gets.

    Context, in the same repetitions: the same bytes as fragment-sized rows taken from random places
    of a tensor allocated as the device cache is (``torch.empty``) and as large as it (2 GiB) into
    one contiguous run of a host slab (``np.take`` by the same threads, no kvtier code between
    fragments; ``take GB/s``, and kvtier's share of it ``vs take``): what copying scattered
    fragments of that size between these two kinds of memory gets on this machine at all. Kind and
    span matter to scattered copies, not to the contiguous one: torch's tensors sit on 4 KiB pages
    64 bytes into a page, the slab's slots start on (2 MiB) pages, as O_DIRECT needs; the same take
    between two NumPy arrays (huge pages, 16 bytes into a page on both sides) ran 15-17% faster here
    on one thread, and random 16 KiB rows of a 512 MiB, 2 GiB and 4 GiB torch tensor ran 16.3, 14.2
    and 12.9 GB/s on two threads (9.2, 9.1, 9.0 on one): a real engine's cache is larger still.

Why
    Offloading only pays when moving a block costs much less than recomputing it; on a GPU-less
    machine the CPU backend is also what every test and demo runs on. The ratio
    kvtier / memcpy says how much of the machine's copy bandwidth the per-fragment gather/scatter
    keeps, for fragment sizes a real model produces (64 KiB: Llama-3-8B-like, 8 KV heads x 128
    head dim x 16 tokens x bf16, K and V packed; 32 KiB: the same with K and V split; 16 KiB: 4
    KV heads, K and V split).

Correctness is checked once per variant: a store from device blocks A to host slots H, then a load
from H to other device blocks B; the host bytes must equal A's fragments laid out back to back, and
B must equal A bit for bit. The script exits non-zero if not.

The last line printed is one JSON object; ``ratio`` is the smallest ratio over every fragment size,
batch and direction with the backend's threads, ``ratio_one_thread`` the same with one thread;
``ratio_vs_take`` and ``ratio_vs_take_one_thread`` the same against the fragment take.

Run: ``.venv/bin/python bench/host_copy.py [--threads 2] [--blocks 64,256] [--repeat 5]``
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from rig import TransferFailed, run_transfer

from kvtier.core.layout import BlockLayout
from kvtier.core.transfer import Transfer
from kvtier.tiers.gpu import device_storage
from kvtier.tiers.host import HostSlab
from kvtier.transfers.cpu import CPUBackend

NUM_LAYERS = 32
BLOCK_TOKENS = 16
HEAD_DIM = 128
DTYPE = torch.bfloat16
GB = 1e9
MiB = 1 << 20
LAYER_TENSOR_BYTES = 64 * MiB


@dataclass(frozen=True)
class Variant:
    name: str
    kv_heads: int
    kv_split: bool

    @property
    def fragment_shape(self) -> tuple[int, ...]:
        """Shape of one block of one tensor (what dimension 0 indexes)."""
        per_kv = (BLOCK_TOKENS, self.kv_heads, HEAD_DIM)
        return per_kv if self.kv_split else (2, *per_kv)

    @property
    def fragment_bytes(self) -> int:
        return int(np.prod(self.fragment_shape)) * torch.finfo(DTYPE).bits // 8

    @property
    def layout(self) -> BlockLayout:
        return BlockLayout.per_layer(NUM_LAYERS, self.fragment_bytes, kv_split=self.kv_split)


VARIANTS = (
    Variant("packed K/V", kv_heads=8, kv_split=False),  # 64 KiB fragments, 32 per block
    Variant("K/V split", kv_heads=8, kv_split=True),  # 32 KiB fragments, 64 per block
    Variant("K/V split", kv_heads=4, kv_split=True),  # 16 KiB fragments, 64 per block
)


class Reference:
    """Plain copies by as many threads as the backend has, each cut into equal parts copied at once (both
    ``np.copyto`` and ``np.take`` release the GIL): a contiguous copy, and a take of scattered fragments."""

    def __init__(
        self, src: np.ndarray, dst: np.ndarray, take_src: np.ndarray, take_dst: np.ndarray, threads: int
    ) -> None:
        self.src, self.dst, self.threads = src, dst, threads
        self.take_src, self.take_dst = take_src, take_dst
        self._pool = ThreadPoolExecutor(threads) if threads > 1 else None

    def seconds(self, nbytes: int) -> float:
        return self._timed(nbytes, lambda a, b: np.copyto(self.dst[a:b], self.src[a:b]))

    def fragment_seconds(self, nbytes: int, fragment: int, rng: np.random.Generator) -> float:
        """The same bytes as rows of ``fragment`` bytes taken from random places of ``take_src`` into one
        contiguous run of ``take_dst`` (``np.take``, which releases the GIL), split over the threads: what
        copying fragments of that size between those memories gets here with no kvtier code between them
        (the per-fragment ceiling)."""
        table = self.take_src[: self.take_src.size // fragment * fragment].reshape(-1, fragment)
        count = nbytes // fragment
        index = rng.permutation(len(table))[:count]
        out = self.take_dst[: count * fragment].reshape(count, fragment)
        # mode "raise" would buffer ``out``
        return self._timed(count, lambda a, b: np.take(table, index[a:b], axis=0, out=out[a:b], mode="wrap"))

    def _timed(self, count: int, copy: Callable[[int, int], object]) -> float:
        """Seconds to run ``copy(a, b)`` over ``count`` items cut into one equal part per thread, at once."""
        cuts = [count * i // self.threads for i in range(self.threads + 1)]
        start = time.perf_counter()
        if self._pool is None:
            copy(0, count)
        else:
            for future in [self._pool.submit(copy, a, b) for a, b in itertools.pairwise(cuts)]:
                future.result()
        return time.perf_counter() - start

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


def make_device(variant: Variant, num_blocks: int, seed: int) -> list[torch.Tensor]:
    """The fragment tensors of a KV cache allocated as vLLM allocates one: a tensor per layer (K and V
    inside it when split, the split tensors being views), filled with random bits so every page is
    touched and blocks differ."""
    gen = torch.Generator().manual_seed(seed)
    tensors = []
    for _ in range(NUM_LAYERS):
        shape = (2, num_blocks, *variant.fragment_shape) if variant.kv_split else (num_blocks, *variant.fragment_shape)
        t = torch.empty(shape, dtype=DTYPE)
        t.view(torch.int16).random_(generator=gen)  # raw bits; compared as integers, so NaN patterns are fine
        tensors.extend([t[0], t[1]] if variant.kv_split else [t])
    return tensors


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def verify(
    backend: CPUBackend,
    variant: Variant,
    tensors: list[torch.Tensor],
    dev,
    slab: HostSlab,
    n: int,
    rng: np.random.Generator,
) -> None:
    """Store device blocks A into host slots H, load H into device blocks B; check bytes bit for bit."""
    perm = rng.permutation(dev.num_slots)
    a, b = perm[:n], perm[n : 2 * n]
    h = rng.permutation(slab.storage.num_slots)[:n]
    for t in tensors:  # poison the destinations so a copy that never happened cannot pass
        t.index_fill_(0, torch.from_numpy(b), 0.0)
    slab.array[:] = 0
    what = f"{variant.fragment_bytes // 1024} KiB {variant.name}"
    run_transfer(backend, Transfer(dev, a.tolist(), slab.storage, h.tolist()))
    bad = _host_mismatch(variant.layout, tensors, slab, a, h)
    if bad is not None:  # raised here, not in the helper, so no traceback keeps a view of the slab alive
        raise AssertionError(f"{what}: host bytes of fragment {bad} differ from the device blocks stored there")
    run_transfer(backend, Transfer(slab.storage, h.tolist(), dev, b.tolist()))
    bad = _device_mismatch(tensors, a, b)
    if bad is not None:
        raise AssertionError(f"{what}: fragment {bad} differs after a store and a load into other device blocks")


def _host_mismatch(
    layout: BlockLayout, tensors: list[torch.Tensor], slab: HostSlab, a: np.ndarray, h: np.ndarray
) -> int | None:
    """The first fragment whose bytes in host slots ``h`` differ from device blocks ``a``, or None."""
    host = slab.array.reshape(slab.storage.num_slots, layout.block_bytes)
    a_t = torch.from_numpy(a)
    for f, (off, size) in enumerate(zip(layout.offsets.tolist(), layout.sizes.tolist(), strict=True)):
        expect = tensors[f].index_select(0, a_t).view(torch.uint8).reshape(len(a), size).numpy()
        if not np.array_equal(host[h, off : off + size], expect):
            return f
    return None


def _device_mismatch(tensors: list[torch.Tensor], a: np.ndarray, b: np.ndarray) -> int | None:
    """The first fragment whose device blocks ``b`` differ from blocks ``a`` bit for bit, or None."""
    a_t, b_t = torch.from_numpy(a), torch.from_numpy(b)
    for f, t in enumerate(tensors):
        if not torch.equal(bits(t.index_select(0, a_t)), bits(t.index_select(0, b_t))):
            return f
    return None


def bench_variant(
    variant: Variant,
    backend: CPUBackend,
    batches: list[int],
    repeat: int,
    reference: Reference,
    rng: np.random.Generator,
) -> list[dict]:
    layout = variant.layout
    max_batch = max(batches)
    # Room for disjoint source and destination ids and real scatter, in layer tensors of a real cache's
    # size (vLLM's are larger still): allocations this large are mmapped, at the same offset in a page.
    num_device = max(
        2 * max_batch,
        LAYER_TENSOR_BYTES // (2 * variant.fragment_bytes if variant.kv_split else variant.fragment_bytes),
    )
    tensors = make_device(variant, num_device, seed=int(rng.integers(1 << 31)))
    dev = device_storage(tensors, layout)
    slab = HostSlab(max_batch, layout)
    slab.array[:] = 0  # touch the host pages before any timing
    try:
        verify(backend, variant, tensors, dev, slab, max_batch, rng)

        def store(n: int) -> Transfer:
            src = rng.permutation(num_device)[:n]
            dst = rng.permutation(slab.storage.num_slots)[:n]
            return Transfer(dev, src.tolist(), slab.storage, dst.tolist())

        def load(n: int) -> Transfer:
            src = rng.permutation(slab.storage.num_slots)[:n]
            dst = rng.permutation(num_device)[:n]
            return Transfer(slab.storage, src.tolist(), dev, dst.tolist())

        rows = []
        for n in batches:
            nbytes = n * layout.block_bytes
            # warm-up round: one of each, plus the reference
            run_transfer(backend, store(n))
            run_transfer(backend, load(n))
            reference.seconds(nbytes)
            best = {"store": float("inf"), "load": float("inf"), "ref": float("inf"), "take": float("inf")}
            copies = {}
            for _ in range(repeat):
                for direction, make in (("store", store), ("load", load)):
                    transfer = make(n)
                    copies[direction] = len(transfer.copies().size)
                    best[direction] = min(best[direction], run_transfer(backend, transfer))
                    best["ref"] = min(best["ref"], reference.seconds(nbytes))
                    best["take"] = min(best["take"], reference.fragment_seconds(nbytes, variant.fragment_bytes, rng))
            ref_gbps = nbytes / best["ref"] / GB
            take_gbps = nbytes / best["take"] / GB
            for direction in ("store", "load"):
                gbps = nbytes / best[direction] / GB
                rows.append(
                    {
                        "threads": backend.threads,
                        "fragment_bytes": variant.fragment_bytes,
                        "layout": variant.name,
                        "fragments_per_block": layout.num_fragments,
                        "direction": direction,
                        "blocks": n,
                        "bytes": nbytes,
                        "memmoves": copies[direction],
                        "gbps": round(gbps, 3),
                        "reference_gbps": round(ref_gbps, 3),
                        "ratio": round(gbps / ref_gbps, 3),
                        "fragment_take_gbps": round(take_gbps, 3),
                        "ratio_vs_take": round(gbps / take_gbps, 3),
                    }
                )
        return rows
    finally:
        dev.close()
        slab.close()
        del tensors


def print_table(rows: list[dict], threads: int, reference_note: str) -> None:
    header = (
        "fragment",
        "layout",
        "dir",
        "blocks",
        "MiB",
        "memmoves",
        "kvtier GB/s",
        "memcpy GB/s",
        "ratio",
        "take GB/s",
        "vs take",
    )
    lines = [
        (
            f"{r['fragment_bytes'] // 1024} KiB",
            r["layout"],
            r["direction"],
            str(r["blocks"]),
            str(r["bytes"] // MiB),
            str(r["memmoves"]),
            f"{r['gbps']:.2f}",
            f"{r['reference_gbps']:.2f}",
            f"{r['ratio']:.2f}",
            f"{r['fragment_take_gbps']:.2f}",
            f"{r['ratio_vs_take']:.2f}",
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" if i < 3 else f"{{:>{w}}}" for i, w in enumerate(widths))
    print(f"kvtier CPUBackend(threads={threads}) gather/scatter vs {reference_note}")
    print(fmt.format(*header))
    print("  ".join("-" * w for w in widths))
    for line in lines:
        print(fmt.format(*line))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2, help="CPU backend copy threads (default 2, its default)")
    p.add_argument("--blocks", default="64,256", help="comma list of batch sizes in blocks (default 64,256)")
    p.add_argument("--repeat", type=int, default=5, help="repetitions; the best is reported (default 5)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        args.blocks = sorted({int(b) for b in args.blocks.split(",") if b.strip()})
    except ValueError:
        p.error(f"--blocks must be a comma list of integers, got {args.blocks!r}")
    if not args.blocks or args.blocks[0] < 1:
        p.error("--blocks needs at least one positive batch size")
    if args.repeat < 1 or args.threads < 1:
        p.error("--repeat and --threads must be at least 1")
    return args


def reference_memory(max_bytes: int, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """The references' memory, touched: the plain copy's source and target, and the take's, allocated as
    kvtier's copies find theirs (a torch tensor as large as the device cache, and a host slab)."""
    ref_src = rng.integers(0, 256, size=max_bytes, dtype=np.uint8)
    ref_dst = np.empty(max_bytes, dtype=np.uint8)
    ref_dst.fill(0xA5)
    take_src = torch.empty(max(max_bytes, NUM_LAYERS * LAYER_TENSOR_BYTES), dtype=torch.uint8)
    take_src.fill_(0x5A)  # (the rows' values do not matter to the copy)
    take_dst = HostSlab(1, BlockLayout.per_layer(1, max_bytes)).array
    take_dst.fill(0xA5)
    return ref_src, ref_dst, take_src.numpy(), take_dst


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    torch.set_num_threads(max(1, os.cpu_count() or 1))  # only for filling and checking, not timed

    memory = reference_memory(max(args.blocks) * max(v.layout.block_bytes for v in VARIANTS), rng)
    rows: list[dict] = []
    for threads in sorted({args.threads, 1}, reverse=True):  # the backend's threads, and one against one
        backend, reference = CPUBackend(threads=threads), Reference(*memory, threads)
        try:
            for variant in VARIANTS:
                rows += bench_variant(variant, backend, args.blocks, args.repeat, reference, rng)
        except AssertionError as exc:
            print(f"CORRECTNESS FAILURE: {exc}", file=sys.stderr)
            return 1
        except TransferFailed as exc:
            print(f"TRANSFER FAILURE: {exc}", file=sys.stderr)
            return 2
        finally:
            backend.close()
            reference.close()
        print_table(
            [r for r in rows if r["threads"] == threads],
            threads,
            f"one contiguous copy of the same bytes by {threads} thread(s) (best of {args.repeat} each)",
        )
    runtime = time.perf_counter() - started
    print(f"total runtime {runtime:.1f} s; verified bit-exact for every variant")
    worst = {t: min(r["ratio"] for r in rows if r["threads"] == t) for t in {r["threads"] for r in rows}}
    worst_take = {t: min(r["ratio_vs_take"] for r in rows if r["threads"] == t) for t in worst}
    print(
        json.dumps(
            {
                "bench": "host_copy",
                "ratio": worst[args.threads],
                "ratio_one_thread": worst[1],
                "ratio_vs_take": worst_take[args.threads],
                "ratio_vs_take_one_thread": worst_take[1],
                "reference": "np.copyto of the same bytes, contiguous, split over as many threads as the backend has",
                "take_reference": "np.take of the same bytes as random fragment-sized rows of a torch tensor as large "
                "as the device cache into one contiguous run of a host slab, same threads",
                "threads": args.threads,
                "blocks": args.blocks,
                "repeat": args.repeat,
                "cpus": os.cpu_count(),
                "verified": True,
                "runtime_s": round(runtime, 1),
                "table": rows,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
