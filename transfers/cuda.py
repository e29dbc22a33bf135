"""The CUDA transfer backend: GPU <-> host copies on CuPy streams, ordered with the engine's compute.

Loads (host -> GPU) and stores (GPU -> host, and GPU -> GPU) run on two streams of their own, so
both directions use the copy engines at once. Before its copies, every job makes its stream wait for
an event recorded on the compute stream at submit time: a store then reads what the model has just
written, and a load never overwrites blocks a kernel still reads. A job's completion is an event
after its copies; a thread per stream waits on those events in order (spinning for short jobs,
sleeping on long ones) and calls the job's callback, so the engine loop itself never blocks.

A job's fragment copies go out in one of three ways (``mode``):

- ``batch``: one ``cuMemcpyBatchAsync`` driver call for all of them (copy engines, no SMs);
- ``kernel``: one launch of a copy kernel over all of them (SMs, over PCIe for pinned host memory);
- ``loop``: one ``cudaMemcpyAsync`` per copy; the fallback where neither of the others applies
  (pageable host memory, an old driver) and the way a failed batch pinpoints the failed blocks.

``auto`` uses the kernel for jobs of small fragments and the batched DMA otherwise; the threshold
comes from bench/gpu_copy.py on an H100 (see docs/benchmarks.md, "GPU copies").
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.core.devices import CUDA_DEVICE, HOST_DEVICE
from kvtier.core.errors import ClosedError, TransferError
from kvtier.core.jobs import mark_kvtier_thread
from kvtier.core.storage import BlockStorage
from kvtier.core.transfer import CopyList, OnComplete, Transfer, TransferBackend
from kvtier.transfers.cuda_driver import BatchCopy, chunk_copies, copy_kernel

MODES = ("auto", "batch", "kernel", "loop")
KERNEL_BELOW_BYTES = 64 * 1024
"""In ``auto`` mode, jobs whose copies average less than this go to the kernel."""
SLICE_BYTES = 64 * 1024 * 1024
"""Large jobs are enqueued in pieces of about this size (about 1.2 ms of PCIe each). Measured on an
H100 with 16 KiB fragments: 64 MiB pieces gave 0.91/0.88 of a plain copy (store/load, 2 GiB jobs)
where 16 MiB pieces gave 0.87/0.83: each piece has a fixed cost."""
SPIN_BELOW_BYTES = 1024 * 1024 * 1024
"""Jobs smaller than this (under some 20 ms at PCIe speed) are waited for by spinning, which holds a
core (not the GIL) while they run. Measured on an H200 (``bench/gpu_copy.py --phases``, 256-block jobs
of 128 and 512 MiB): a sleeping wait handed the completion over 0.15-0.27 ms after the copies ended,
a spinning one 0.03-0.09 ms, worth 2-9 % of those jobs' bandwidth."""

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction follows from the (unified) addresses
_CAN_USE_HOST_POINTER = 91  # cudaDevAttrCanUseHostPointerForRegisteredMem
_THREADS_PER_BLOCK = 512
KERNEL_THREAD_BLOCKS = 4
"""Thread blocks per copy-kernel launch. Measured on an H100 (16 KiB fragments, 2 GiB jobs): 4 blocks
of 512 threads already move 52 GB/s (store) and 51 GB/s (load), as many as 528 do, while a bf16
matrix product running beside them slowed 1.44x with 4 blocks, 3.2x with 16 and 27x with 528 in a
probe (1.14-1.24x with 4 blocks in bench/gpu_copy.py runs)."""

log = logging.getLogger(__name__)


def cuda_available() -> bool:
    """Whether CuPy is installed and sees a CUDA device."""
    try:
        import cupy
    except ImportError:
        return False
    try:
        return bool(cupy.cuda.is_available())
    except Exception:
        return False


@dataclass
class _Pending:
    """A job whose copies are enqueued: its completion event and what must live until it fires."""

    done: Any
    on_complete: OnComplete
    failed: set[int]
    num_blocks: int
    keepalive: tuple


class _Lane:
    """One direction: a non-blocking stream and the thread that reports its jobs in order."""

    def __init__(self, name: str, device: Any, cupy: Any) -> None:
        self._cupy = cupy
        self._device = device
        with device:
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self.pending: queue.Queue[_Pending | None] = queue.Queue()
        self._thread = threading.Thread(target=self._report, name=f"kvtier-cuda-{name}", daemon=True)
        self._thread.start()

    def _report(self) -> None:
        mark_kvtier_thread()
        self._device.use()
        while (job := self.pending.get()) is not None:
            try:
                job.done.synchronize()
            except self._cupy.cuda.runtime.CUDARuntimeError:
                job.failed.update(range(job.num_blocks))  # the copy faulted: none of its bytes are trusted
            job.keepalive = ()
            try:
                job.on_complete(job.failed)
            except Exception:  # a failing callback must not stop the reports of the jobs behind it
                log.exception("a CUDA copy's completion callback failed")

    def close(self) -> None:
        self.pending.put(None)
        self._thread.join()


class CUDABackend(TransferBackend):
    """Copies between GPU memory and host memory (pinned for speed; pageable works, slower)."""

    name = "cuda"
    pairs = frozenset({(CUDA_DEVICE, HOST_DEVICE), (HOST_DEVICE, CUDA_DEVICE), (CUDA_DEVICE, CUDA_DEVICE)})

    def __init__(
        self,
        mode: str = "auto",
        device: int | None = None,
        compute_stream: Any = None,
        kernel_below_bytes: int = KERNEL_BELOW_BYTES,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not cuda_available():
            raise TransferError("the CUDA backend needs CuPy and a CUDA device (pip install kvtier[cuda13])")
        import cupy

        self._cupy = cupy
        self.device = cupy.cuda.Device(cupy.cuda.runtime.getDevice() if device is None else device)
        self.mode = mode
        self.kernel_below_bytes = kernel_below_bytes
        self._compute_stream = compute_stream
        self._batch = BatchCopy()
        self._kernel_ok = bool(cupy.cuda.runtime.deviceGetAttribute(_CAN_USE_HOST_POINTER, self.device.id))
        self.jobs_by_method: Counter[str] = Counter()  # how jobs went out; "batch_refused" fell back to loop
        if mode == "batch" and not self._batch.available:
            raise TransferError("this CUDA driver has no cuMemcpyBatchAsync (CUDA 12.8 or newer needed)")
        if mode == "kernel" and not self._kernel_ok:
            raise TransferError("this device cannot address registered host memory directly; use mode batch")
        self._lanes = {"load": _Lane("load", self.device, cupy), "store": _Lane("store", self.device, cupy)}
        self._locked: weakref.WeakKeyDictionary[BlockStorage, bool] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self._closed = False

    def __repr__(self) -> str:
        return f"CUDABackend(device={self.device.id}, mode={self.mode!r})"

    def submit(self, transfer: Transfer, on_complete: OnComplete) -> None:
        src_device, dst_device = transfer.src.device, transfer.dst.device
        if not self.can_copy(src_device, dst_device):
            raise TransferError(f"the CUDA backend cannot copy {src_device} -> {dst_device}")
        transfer.src.check_slots(transfer.src_slots)  # before anything is enqueued: all or nothing
        transfer.dst.check_slots(transfer.dst_slots)
        lane = self._lanes["load" if src_device == HOST_DEVICE else "store"]
        runtime = self._cupy.cuda.runtime
        with self._lock:  # jobs enter a lane's stream and its report queue in the same order
            if self._closed:
                raise ClosedError("the transfer backend is closed")
            with self.device:
                ready = self._cupy.cuda.Event(disable_timing=True)
                runtime.eventRecord(ready.ptr, self._compute_stream_handle())
                runtime.streamWaitEvent(lane.stream.ptr, ready.ptr, 0)
                failed: set[int] = set()
                keep = []
                for first, part in self._slices(transfer):
                    try:
                        part_failed, part_keep = self._enqueue(part, part.copies(), lane.stream)
                    except Exception:
                        # Earlier pieces may be in flight: fail the rest, and report once they are over.
                        log.exception("could not enqueue blocks %d.. of a %d-block copy", first, transfer.num_blocks)
                        failed.update(range(first, transfer.num_blocks))
                        break
                    failed.update(first + i for i in part_failed)
                    keep.append(part_keep)
                # A job's completion is spun on (a sleeping wait adds 0.1-0.2 ms of wake-up); a very
                # long one's thread sleeps, so waiting never holds a core for long.
                done = self._cupy.cuda.Event(block=transfer.nbytes >= SPIN_BELOW_BYTES, disable_timing=True)
                done.record(lane.stream)
            lane.pending.put(_Pending(done, on_complete, failed, transfer.num_blocks, (transfer, keep)))

    @staticmethod
    def _slices(transfer: Transfer):
        """(first block, sub-transfer) pieces of about ``SLICE_BYTES``: the GPU copies one piece while
        Python prepares the next, instead of idling until the whole job's copy list is built."""
        step = max(1, SLICE_BYTES // transfer.src.layout.block_bytes)
        if transfer.num_blocks <= step:
            yield 0, transfer
            return
        for first in range(0, transfer.num_blocks, step):
            yield (
                first,
                Transfer(
                    transfer.src,
                    transfer.src_slots[first : first + step],
                    transfer.dst,
                    transfer.dst_slots[first : first + step],
                ),
            )

    def method_for(self, transfer: Transfer, copies: CopyList) -> str:
        """Which way this backend sends a job's copies: ``batch``, ``kernel`` or ``loop``."""
        if not len(copies.size):
            return "loop"
        if not self._page_locked(transfer.src) or not self._page_locked(transfer.dst):
            return "loop"  # pageable host memory: only cudaMemcpyAsync takes it (it stages the bytes)
        if self.mode != "auto":
            return self.mode
        small = copies.total_bytes < self.kernel_below_bytes * len(copies.size)
        if self._kernel_ok and (small or not self._batch.available):
            return "kernel"
        return "batch" if self._batch.available else "loop"

    def _page_locked(self, storage: BlockStorage) -> bool:
        """True for device memory and pinned/registered host memory; False for pageable host memory.
        Asked once per storage: a storage's memory does not change kind while it lives."""
        known = self._locked.get(storage)
        if known is None:
            address = int(storage.fragment_addresses([0])[0, 0])
            try:
                known = self._cupy.cuda.runtime.pointerGetAttributes(address).type != 0  # 0: pageable
            except self._cupy.cuda.runtime.CUDARuntimeError:
                known = False
            self._locked[storage] = known
        return known

    def _enqueue(self, transfer: Transfer, copies: CopyList, stream: Any) -> tuple[set[int], Any]:
        """Put the copies on the stream; returns the blocks that could not be enqueued and what must
        stay alive until the stream has run them."""
        method = self.method_for(transfer, copies)
        if method == "kernel":
            keep = self._launch_kernel(copies, stream)
            self.jobs_by_method["kernel"] += 1
            return set(), keep
        if method == "batch":
            result = self._batch(copies.src, copies.dst, copies.size, stream.ptr)
            if result == 0:
                self.jobs_by_method["batch"] += 1
                return set(), None
            if not self.jobs_by_method["batch_refused"]:
                log.warning("cuMemcpyBatchAsync refused a job (CUresult %d); copying it one fragment at a time", result)
            self.jobs_by_method["batch_refused"] += 1
        self.jobs_by_method["loop"] += 1
        return self._copy_each(copies, transfer.num_blocks, stream), None

    def _launch_kernel(self, copies: CopyList, stream: Any) -> Any:
        cupy = self._cupy
        table = chunk_copies(copies.src, copies.dst, copies.size)
        count = len(table) // 3
        staged = cupy.cuda.alloc_pinned_memory(table.nbytes)  # from CuPy's pinned pool: no pinning per job
        np.frombuffer(staged, dtype=np.uint64, count=len(table))[:] = table
        on_device = cupy.empty(len(table), dtype=cupy.uint64)
        cupy.cuda.runtime.memcpyAsync(on_device.data.ptr, staged.ptr, table.nbytes, _MEMCPY_DEFAULT, stream.ptr)
        blocks = min(-(-count // (_THREADS_PER_BLOCK // 32)), KERNEL_THREAD_BLOCKS)  # a warp per piece
        copy_kernel(self.device.id)((blocks,), (_THREADS_PER_BLOCK,), (on_device, np.int64(count)), stream=stream)
        return staged, on_device

    def _copy_each(self, copies: CopyList, num_blocks: int, stream: Any) -> set[int]:
        """One cudaMemcpyAsync per copy; a copy the runtime refuses fails exactly the blocks it touches."""
        memcpy = self._cupy.cuda.runtime.memcpyAsync
        failed: set[int] = set()
        for j, (s, d, n) in enumerate(zip(copies.src.tolist(), copies.dst.tolist(), copies.size.tolist(), strict=True)):
            try:
                memcpy(d, s, n, _MEMCPY_DEFAULT, stream.ptr)
            except self._cupy.cuda.runtime.CUDARuntimeError:
                failed.update(copies.blocks_of(j, num_blocks))
        return failed

    def _compute_stream_handle(self) -> int:
        """The stream the engine computes on: the one given, else torch's current stream, else CuPy's."""
        given = self._compute_stream
        if given is not None:  # a CuPy stream (.ptr), a torch stream (.cuda_stream) or a raw handle
            return int(getattr(given, "ptr", getattr(given, "cuda_stream", given)))
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            return torch.cuda.current_stream(self.device.id).cuda_stream
        return self._cupy.cuda.get_current_stream().ptr

    def synchronize(self) -> None:
        """Wait until every enqueued copy has run (not for the callbacks)."""
        for lane in self._lanes.values():
            lane.stream.synchronize()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for lane in self._lanes.values():
            lane.close()
