"""Start-up of a large pinned host pool: kvtier's host slab against one cudaHostRegister of the same memory.

What is measured
    The seconds from nothing to a pinned pool usable by the GPU's copy engines. First, on pools of
    ``--variant-gib`` GiB, each way ``kvtier.tiers.host_pinning`` can pin a slab (chunks of at most
    ``CHUNK_BYTES`` registered one after the other or by several threads, with or without the pages
    populated by several threads first) and the reference; then, on a pool of ``--gib`` GiB,
    ``kvtier.tiers.host.HostSlab`` pinned the fastest of those ways against the reference. Every pool
    is an anonymous private map with huge pages advised (as the slab's), released before the next is
    made; the release is timed too. All of that memory is touched once before (in a virtual machine
    the first touch of guest memory is far slower, and would fall on whichever pool came first). One
    1 GiB host -> GPU copy out of each large pool shows the chunked pool copies at the pinned speed of
    the plain one.

Reference, in the same run
    The plain way: the same map, then one ``cudaHostRegister`` of all of it.

The last line is one JSON object: ``ratio`` = reference seconds / kvtier seconds at ``--gib`` (above 1:
kvtier starts faster), with both times, the way used (``populate_threads``, ``register_threads``), the
chunk count, the copy bandwidths and every variant's time.

Run: ``python bench/host_pool.py --gib 64`` on a machine with CUDA and more than that much free memory.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

GIB = 2**30


def plain_pool(nbytes: int) -> tuple[float, float, float]:
    """The reference: (seconds to pinned, GB/s of a 1 GiB copy to the GPU, seconds to release)."""
    import cupy
    import numpy as np

    start = time.perf_counter()
    pool = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        pool.madvise(mmap.MADV_HUGEPAGE)
    view = np.frombuffer(pool, dtype=np.uint8)
    address = view.ctypes.data
    cupy.cuda.runtime.hostRegister(address, nbytes, 0)
    seconds = time.perf_counter() - start
    gbs = copy_gbs(address, min(GIB, nbytes))
    start = time.perf_counter()
    cupy.cuda.runtime.hostUnregister(address)
    del view
    pool.close()
    return seconds, gbs, time.perf_counter() - start


def kvtier_pool(nbytes: int, block_bytes: int, populate_threads: int, register_threads: int):
    """kvtier's slab pinned one way: (seconds to pinned, GB/s of a 1 GiB copy, seconds to release, chunks)."""
    from kvtier.core.layout import BlockLayout
    from kvtier.tiers import host_pinning
    from kvtier.tiers.host import HostSlab

    host_pinning.POPULATE_THREADS, host_pinning.REGISTER_THREADS = populate_threads, register_threads
    start = time.perf_counter()
    slab = HostSlab(nbytes // block_bytes, BlockLayout.contiguous(block_bytes))
    seconds = time.perf_counter() - start
    if not slab.pinned:
        sys.exit("kvtier's slab could not be pinned")
    chunks = len(slab.storage.breaks) + 1
    gbs = copy_gbs(slab.address, min(GIB, nbytes))
    start = time.perf_counter()
    slab.close()
    return seconds, gbs, time.perf_counter() - start, chunks


def warm_up(nbytes: int) -> None:
    """Touch ``nbytes`` of fresh memory once and give it back: in a virtual machine the first touch of
    guest memory costs the host's faults too, which would fall on whichever pool came first."""
    from kvtier.tiers.host_pinning import CHUNK_BYTES, chunks, populate

    pool = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    anchor = ctypes.c_char.from_buffer(pool)
    address = ctypes.addressof(anchor)
    with ThreadPoolExecutor(min(16, os.cpu_count() or 1)) as threads:
        list(threads.map(lambda piece: populate(address + piece[0], piece[1]), chunks(nbytes, 4096, CHUNK_BYTES)))
    del anchor
    pool.close()


def copy_gbs(address: int, nbytes: int) -> float:
    """GB/s of one host -> GPU copy of ``nbytes`` from ``address`` (the second of two runs)."""
    import cupy

    device = cupy.empty(nbytes, dtype=cupy.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    for _ in range(2):
        start = time.perf_counter()
        cupy.cuda.runtime.memcpyAsync(device.data.ptr, address, nbytes, 4, stream.ptr)
        stream.synchronize()
        seconds = time.perf_counter() - start
    return nbytes / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=int, default=64, help="size of the pool compared, GiB")
    parser.add_argument("--variant-gib", type=int, default=16, help="size of the pools that pick the way, GiB")
    parser.add_argument("--block-bytes", type=int, default=2 * 2**20, help="slot size of the kvtier slab")
    args = parser.parse_args()
    from kvtier.transfers.cuda import cuda_available

    if not cuda_available():
        sys.exit("bench/host_pool.py needs CuPy and a CUDA GPU")
    import cupy

    cupy.zeros(1)  # the CUDA context is made outside the timings
    warm_up(args.gib * GIB)
    device = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    threads = min(16, os.cpu_count() or 1)
    ways = [(0, 1), (0, threads), (threads, 1), (threads, threads)]
    small = args.variant_gib * GIB // args.block_bytes * args.block_bytes
    variants = [{"way": "one cudaHostRegister", "seconds": plain_pool(small)[0]}]
    for populate_threads, register_threads in ways:
        seconds = kvtier_pool(small, args.block_bytes, populate_threads, register_threads)[0]
        way = {"populate_threads": populate_threads, "register_threads": register_threads}
        variants.append({"way": "kvtier chunks", **way, "seconds": seconds})
    print(f"device: {device}; pools of {args.variant_gib} GiB:")
    for row in variants:
        print("  " + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    best = min(variants[1:], key=lambda row: row["seconds"])
    knobs = (best["populate_threads"], best["register_threads"])

    nbytes = args.gib * GIB // args.block_bytes * args.block_bytes
    reference_s, reference_gbs, reference_release = plain_pool(nbytes)
    kvtier_s, kvtier_gbs, kvtier_release, chunks = kvtier_pool(nbytes, args.block_bytes, *knobs)
    print(f"pool of {args.gib} GiB, kvtier in {chunks} chunks, populate/register threads {knobs}:")
    print(
        f"  kvtier HostSlab: {kvtier_s:.2f} s to pinned ({kvtier_release:.2f} s to release), copy {kvtier_gbs:.1f} GB/s"
    )
    print(f"  one cudaHostRegister: {reference_s:.2f} s ({reference_release:.2f} s), copy {reference_gbs:.1f} GB/s")
    print(
        json.dumps(
            {
                "ratio": reference_s / kvtier_s,
                "pool_gib": args.gib,
                "kvtier_s": kvtier_s,
                "reference_s": reference_s,
                "populate_threads": knobs[0],
                "register_threads": knobs[1],
                "kvtier_release_s": kvtier_release,
                "reference_release_s": reference_release,
                "chunks": chunks,
                "kvtier_copy_gbs": kvtier_gbs,
                "reference_copy_gbs": reference_gbs,
                "variant_gib": args.variant_gib,
                "variants": variants,
                "device": device,
            }
        )
    )


if __name__ == "__main__":
    main()
