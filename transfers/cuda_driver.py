"""The two CUDA entry points CuPy does not wrap: the driver's batched copy and a fragment-copy kernel.

``cuMemcpyBatchAsync`` (CUDA 12.8+) takes the whole list of (source, destination, size) triples of a
job in one call, so thousands of 16-64 KiB fragments cost one driver call instead of one
``cudaMemcpyAsync`` each. It is called through ctypes on libcuda with the numpy arrays' memory, so
no Python object per fragment is ever made. CUDA 13 names it ``cuMemcpyBatchAsync_v2`` and drops the
``failIdx`` argument that 12.8's version has; both are handled.

The kernel moves the same triples with the GPU's own threads (over PCIe for host addresses, which
works on pinned memory the device can address directly). It competes with the model for SMs, which
is why DMA is the default where it is as fast.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

import numpy as np

_SRC_ACCESS_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: read the sources in stream order


class _MemcpyAttributes(ctypes.Structure):
    """CUmemcpyAttributes: access order, source and destination location hints (CUmemLocation), flags."""

    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_loc_type", ctypes.c_int),
        ("src_loc_id", ctypes.c_int),
        ("dst_loc_type", ctypes.c_int),
        ("dst_loc_id", ctypes.c_int),
        ("flags", ctypes.c_uint),
    ]


class BatchCopy:
    """``cuMemcpyBatchAsync`` from libcuda; ``available`` is False where the driver lacks it."""

    SLICE = 512

    def __init__(self) -> None:
        self._call: Callable[..., int] | None = None
        self._with_fail_index = False
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError:
            return
        pointer, size = ctypes.c_void_p, ctypes.c_size_t
        attrs = ctypes.POINTER(_MemcpyAttributes)
        for symbol, with_fail_index in (("cuMemcpyBatchAsync_v2", False), ("cuMemcpyBatchAsync", True)):
            call = getattr(lib, symbol, None)
            if call is None:
                continue
            call.restype = ctypes.c_int
            call.argtypes = (
                [pointer, pointer, pointer, size, attrs, pointer, size]
                + ([pointer] if with_fail_index else [])
                + [pointer]
            )
            self._call, self._with_fail_index = call, with_fail_index
            break
        self._attrs = _MemcpyAttributes(_SRC_ACCESS_ORDER_STREAM, 0, 0, 0, 0, 0)
        self._attr_index = (ctypes.c_size_t * 1)(0)

    @property
    def available(self) -> bool:
        return self._call is not None

    def __call__(self, src: np.ndarray, dst: np.ndarray, size: np.ndarray, stream_handle: int) -> int:
        """Enqueue every copy on the stream (not the legacy default stream); returns the first nonzero
        CUresult, or 0. The driver spends about 0.7 us of CPU per copy before it lets the copies go, so
        a long list goes in slices of ``SLICE`` copies: the copy engines start on the first slice while
        the driver reads the next."""
        call = self._call
        assert call is not None, "cuMemcpyBatchAsync is not available: check BatchCopy.available first"
        srcs = np.ascontiguousarray(src, dtype=np.uint64)
        dsts = np.ascontiguousarray(dst, dtype=np.uint64)
        sizes = np.ascontiguousarray(size, dtype=np.uint64)
        fail_index = ctypes.c_size_t(0)
        for lo in range(0, len(sizes), self.SLICE):
            count = min(self.SLICE, len(sizes) - lo)
            args: list[Any] = [
                dsts.ctypes.data + 8 * lo,
                srcs.ctypes.data + 8 * lo,
                sizes.ctypes.data + 8 * lo,
                count,
                ctypes.byref(self._attrs),
                ctypes.addressof(self._attr_index),
                1,
            ]
            if self._with_fail_index:
                args.append(ctypes.byref(fail_index))
            result = call(*args, stream_handle)
            if result:
                return result
        return 0


_KERNEL_SOURCE = r"""
extern "C" __global__ void kvtier_copy_fragments(const unsigned long long* __restrict__ table, long long count) {
    // table: count sources, then count destinations, then count sizes. One warp per copy, grid-stride
    // over copies; each lane keeps four 16-byte loads in flight before it stores (PCIe reads are slow
    // to answer, so many must be outstanding). Bytes one at a time where an end or the size is unaligned.
    const long long warps = (long long)gridDim.x * blockDim.x / 32;
    const unsigned lane = threadIdx.x % 32;
    const unsigned long long* src = table;
    const unsigned long long* dst = table + count;
    const unsigned long long* size = table + 2 * count;
    for (long long c = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32; c < count; c += warps) {
        const unsigned long long s = src[c], d = dst[c], n = size[c];
        if (((s | d | n) & 15ULL) == 0) {
            const uint4* __restrict__ s4 = reinterpret_cast<const uint4*>(s);
            uint4* __restrict__ d4 = reinterpret_cast<uint4*>(d);
            const unsigned long long n4 = n >> 4;
            unsigned long long i = lane;
            for (; i + 96 < n4; i += 128) {
                const uint4 a = s4[i], b = s4[i + 32], e = s4[i + 64], f = s4[i + 96];
                d4[i] = a; d4[i + 32] = b; d4[i + 64] = e; d4[i + 96] = f;
            }
            for (; i < n4; i += 32) d4[i] = s4[i];
        } else {
            const unsigned char* s1 = reinterpret_cast<const unsigned char*>(s);
            unsigned char* d1 = reinterpret_cast<unsigned char*>(d);
            for (unsigned long long i = lane; i < n; i += 32) d1[i] = s1[i];
        }
    }
}
"""

KERNEL_CHUNK_BYTES = 32 * 1024
"""Copies are cut into pieces of at most this size, so one large block still spreads over many warps."""


@functools.cache
def copy_kernel(device_id: int) -> Any:
    """The compiled fragment-copy kernel for one device (compiled once per process, cached by CuPy on disk)."""
    import cupy

    with cupy.cuda.Device(device_id):
        return cupy.RawKernel(_KERNEL_SOURCE, "kvtier_copy_fragments")


def chunk_copies(src: np.ndarray, dst: np.ndarray, size: np.ndarray, chunk: int = KERNEL_CHUNK_BYTES) -> np.ndarray:
    """The kernel's table: copies cut into pieces of at most ``chunk`` bytes, as one uint64 array
    (sources, then destinations, then sizes). ``chunk`` is a multiple of 16, so 16-byte aligned copies
    stay aligned piece by piece."""
    pieces = (size + chunk - 1) // chunk
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)
    offset = (np.arange(int(pieces.sum()), dtype=np.int64) - first) * chunk
    owner = np.repeat(np.arange(len(size)), pieces)
    piece_size = np.minimum(size[owner] - offset, chunk)
    return np.concatenate((src[owner] + offset, dst[owner] + offset, piece_size)).astype(np.uint64)
