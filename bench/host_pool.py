"""Start-up of a large pinned host pool: kvtier's host slab against one cudaHostRegister of the same memory.

What is measured
    The seconds from nothing to a pinned pool of ``--gib`` GiB, usable by the GPU's copy engines:
    ``kvtier.tiers.host.HostSlab`` (an anonymous map with huge pages advised, its pages populated by
    several threads, registered in slot-aligned chunks of ``host_pinning.CHUNK_BYTES`` from those
    threads) and, as the reference in the same run, the plain way: the same map, then one
    ``cudaHostRegister`` of all of it (the driver faults in every page on the calling thread). Each
    pool is released before the next is made. Then one 1 GiB copy GPU <- pool on each, to show the
    chunked pool copies at the pinned speed of the plain one.

The last line is one JSON object: ``ratio`` = reference seconds / kvtier seconds (above 1: kvtier
starts faster), with both times, the chunk count and the copy bandwidths.

Run: ``python bench/host_pool.py --gib 64`` on a machine with CUDA and more than that much free memory.
"""

from __future__ import annotations

import argparse
import json
import mmap
import sys
import time

GIB = 2**30


def plain_pool(nbytes: int):
    """The reference: an anonymous private map (huge pages advised, as the slab does) and one registration."""
    import cupy
    import numpy as np

    pool = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        pool.madvise(mmap.MADV_HUGEPAGE)
    address = np.frombuffer(pool, dtype=np.uint8).ctypes.data
    cupy.cuda.runtime.hostRegister(address, nbytes, 0)
    return pool, address


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
    parser.add_argument("--gib", type=float, default=64.0, help="pool size in GiB")
    parser.add_argument("--block-bytes", type=int, default=2 * 2**20, help="slot size of the kvtier slab")
    args = parser.parse_args()
    from kvtier.transfers.cuda import cuda_available

    if not cuda_available():
        sys.exit("bench/host_pool.py needs CuPy and a CUDA GPU")
    import cupy

    from kvtier.core.layout import BlockLayout
    from kvtier.tiers import host_pinning
    from kvtier.tiers.host import HostSlab

    cupy.zeros(1)  # the CUDA context is made outside the timings
    slots = int(args.gib * GIB) // args.block_bytes
    nbytes = slots * args.block_bytes

    start = time.perf_counter()
    slab = HostSlab(slots, BlockLayout.contiguous(args.block_bytes))
    kvtier_s = time.perf_counter() - start
    if not slab.pinned:
        sys.exit("kvtier's slab could not be pinned")
    chunks = len(slab._pinned)
    kvtier_gbs = copy_gbs(slab.address, GIB)
    start = time.perf_counter()
    slab.close()
    kvtier_close_s = time.perf_counter() - start

    start = time.perf_counter()
    pool, address = plain_pool(nbytes)
    reference_s = time.perf_counter() - start
    reference_gbs = copy_gbs(address, GIB)
    start = time.perf_counter()
    cupy.cuda.runtime.hostUnregister(address)
    pool.close()
    reference_close_s = time.perf_counter() - start

    device = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(
        f"device: {device}; pool {nbytes / GIB:.1f} GiB in {chunks} chunks of <= {host_pinning.CHUNK_BYTES / GIB:g} GiB"
    )
    print(
        f"kvtier HostSlab: {kvtier_s:.2f} s to pinned ({kvtier_close_s:.2f} s to release), copy {kvtier_gbs:.1f} GB/s"
    )
    print(
        f"one cudaHostRegister: {reference_s:.2f} s ({reference_close_s:.2f} s to release),"
        f" copy {reference_gbs:.1f} GB/s"
    )
    print(
        json.dumps(
            {
                "ratio": reference_s / kvtier_s,
                "pool_gib": nbytes / GIB,
                "kvtier_s": kvtier_s,
                "reference_s": reference_s,
                "kvtier_release_s": kvtier_close_s,
                "reference_release_s": reference_close_s,
                "chunks": chunks,
                "kvtier_copy_gbs": kvtier_gbs,
                "reference_copy_gbs": reference_gbs,
                "device": device,
            }
        )
    )


if __name__ == "__main__":
    main()
