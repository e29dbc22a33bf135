"""Transfer backends: move the bytes of a list of blocks from one storage's slots to another's.

A transfer compiles to (source address, destination address, byte count) triples, one per fragment,
merged where consecutive fragments are adjacent on both sides. The CPU backend runs them with
memmove on a thread pool (large copies release the GIL, so threads run in parallel; small ones keep
it, see GIL_HELD_BELOW_BYTES) and reports completion asynchronously with the indices of the blocks
that failed. The CUDA backend
(core/cuda_transfer.py) takes the same triples to one batched driver copy or one kernel launch per job.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from kvtier.core.errors import ClosedError, TransferError
from kvtier.core.jobs import mark_kvtier_thread
from kvtier.core.storage import BlockStorage

GIL_HELD_BELOW_BYTES = 256 * 1024
"""Copies smaller than this run without releasing the GIL. ``ctypes.memmove`` releases it for every
call and must take it back after; beside a busy Python thread (an engine's loop polling for a load)
each take-back waits for that thread's switch interval. Measured here: 96 copies of 64 KiB took 96-153
ms that way against 0.7 ms alone, and 11 ms with the GIL held (one wait). Larger copies still release
it, so the pool's threads copy them in parallel and a long copy never holds up the engine's thread;
beside a busy thread each of them pays the wait too, but there are far fewer of them per byte."""

_memmove_holding_gil = ctypes.PyDLL(None).memmove  # a PyDLL function keeps the GIL during the call
_memmove_holding_gil.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_memmove_holding_gil.restype = ctypes.c_void_p

OnComplete = Callable[[set[int]], None]
"""Called once per submitted transfer with the indices (into the transfer's block list) that failed."""


@dataclass(frozen=True)
class CopyList:
    """Byte copies of one transfer: ``src``, ``dst`` and ``size`` arrays, and which block each copy belongs to."""

    src: np.ndarray
    dst: np.ndarray
    size: np.ndarray
    block: np.ndarray

    @property
    def total_bytes(self) -> int:
        return int(self.size.sum())

    @functools.cached_property
    def _ends(self) -> np.ndarray:
        """Where each copy ends in the job's bytes, counted once however many copies fail."""
        return np.cumsum(self.size)

    def blocks_of(self, index: int, num_blocks: int) -> range:
        """The blocks whose bytes copy ``index`` moves.

        Copies run in block order and every block has the same byte count, so a copy's byte range in
        that order names exactly the blocks it touches (a merged copy may start or end mid-block).
        """
        ends = self._ends
        block_bytes = int(ends[-1]) // num_blocks
        start, end = int(ends[index] - self.size[index]), int(ends[index])
        return range(start // block_bytes, (end - 1) // block_bytes + 1)


@dataclass(frozen=True)
class Transfer:
    """Copy block ``src_slots[i]`` of ``src`` to block ``dst_slots[i]`` of ``dst`` for every i."""

    src: BlockStorage
    src_slots: Sequence[int]
    dst: BlockStorage
    dst_slots: Sequence[int]
    keys: Sequence[bytes] | None = None  # the blocks' keys, for backends that record or verify them (disk)

    def __post_init__(self) -> None:
        if len(self.src_slots) != len(self.dst_slots):
            raise TransferError(f"{len(self.src_slots)} source slots but {len(self.dst_slots)} destination slots")
        if self.keys is not None and len(self.keys) != len(self.src_slots):
            raise TransferError(f"{len(self.keys)} keys for {len(self.src_slots)} blocks")
        if self.src.layout.block_bytes != self.dst.layout.block_bytes:
            raise TransferError(f"block sizes differ: {self.src.layout.block_bytes} B -> {self.dst.layout.block_bytes} B")

    @property
    def num_blocks(self) -> int:
        return len(self.src_slots)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.src.layout.block_bytes

    def copies(self) -> CopyList:
        """The fragment copies, merged where adjacent on both sides. Raises TransferError on bad slots."""
        src_layout, dst_layout = self.src.layout, self.dst.layout
        src = self.src.fragment_addresses(self.src_slots)
        dst = self.dst.fragment_addresses(self.dst_slots)
        if src_layout.fragment_bytes != dst_layout.fragment_bytes:
            # A contiguous side can follow the other side's fragment boundaries.
            if dst_layout.num_fragments == 1:
                dst, sizes = dst[:, :1] + src_layout.offsets[None, :], src_layout.sizes
            elif src_layout.num_fragments == 1:
                src, sizes = src[:, :1] + dst_layout.offsets[None, :], dst_layout.sizes
            else:
                raise TransferError("fragment layouts differ and neither side is contiguous")
        else:
            sizes = src_layout.sizes
        n, f = src.shape
        return _merge_adjacent(src.reshape(-1), dst.reshape(-1), np.tile(sizes, n), np.repeat(np.arange(n), f))


def _merge_adjacent(src: np.ndarray, dst: np.ndarray, size: np.ndarray, block: np.ndarray) -> CopyList:
    """Merge each copy into the one before it when both its source and destination follow on directly.

    Copies of different blocks merge too (a run of consecutive slots on both sides becomes one copy);
    the merged copy keeps its first block's index; a failed copy fails every block its byte range
    touches (see ``CopyList.blocks_of``).
    """
    if src.size <= 1:
        return CopyList(src, dst, size, block)
    follows = (src[1:] == src[:-1] + size[:-1]) & (dst[1:] == dst[:-1] + size[:-1])
    starts = np.concatenate(([0], np.flatnonzero(~follows) + 1))
    return CopyList(src[starts], dst[starts], np.add.reduceat(size, starts), block[starts])


class TransferBackend(ABC):
    """Moves bytes between storages and signals completion per transfer."""

    name: str

    @abstractmethod
    def can_copy(self, src_device: str, dst_device: str) -> bool:
        """Whether this backend can move bytes between memories of these devices."""

    @abstractmethod
    def submit(self, transfer: Transfer, on_complete: OnComplete) -> None:
        """Start the copy and return at once; ``on_complete(failed_block_indices)`` runs exactly once, on
        another thread. Raises TransferError or ClosedError (and never calls ``on_complete``) when the
        transfer cannot be started."""

    @abstractmethod
    def close(self) -> None:
        """Wait for copies in flight, then refuse new ones."""


class CPUBackend(TransferBackend):
    """memmove on a thread pool: host memory to host memory, and CPU tensors standing in for a GPU."""

    name = "cpu"

    def __init__(self, threads: int = 2) -> None:
        if threads < 1:
            raise ValueError("the CPU backend needs at least one thread")
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvtier-copy", initializer=mark_kvtier_thread)
        self._closed = False
        self._lock = threading.Lock()

    def can_copy(self, src_device: str, dst_device: str) -> bool:
        return src_device == "cpu" and dst_device == "cpu"

    def submit(self, transfer: Transfer, on_complete: OnComplete) -> None:
        if not self.can_copy(transfer.src.device, transfer.dst.device):
            raise TransferError(f"the CPU backend cannot copy {transfer.src.device} -> {transfer.dst.device}")
        copies = transfer.copies()
        parts = self._split(copies)
        pending = [len(parts)]
        failed: set[int] = set()
        lock = threading.Lock()

        def run(lo: int, hi: int, keep: Transfer) -> None:
            # ``keep`` holds the transfer, and so both storages' memory, until the copy is over:
            # the caller may drop its own references as soon as submit returns.
            lost = self._run_part(copies, lo, hi, keep.num_blocks)
            with lock:
                failed.update(lost)
                pending[0] -= 1
                last = pending[0] == 0
            if last:
                on_complete(failed)

        with self._lock:
            if self._closed:
                raise ClosedError("the transfer backend is closed")
            try:
                for lo, hi in parts:
                    self._pool.submit(run, lo, hi, transfer)
            except RuntimeError as exc:  # concurrent.futures stops every pool when the interpreter exits
                raise ClosedError(f"the CPU transfer backend takes no more copies: {exc}") from None

    def _split(self, copies: CopyList) -> list[tuple[int, int]]:
        """Cut the copy list into up to ``threads`` parts of similar byte counts, at copy boundaries."""
        count = len(copies.size)
        if count == 0:
            return [(0, 0)]
        cumulative = np.cumsum(copies.size)
        targets = cumulative[-1] * np.arange(1, self.threads) / self.threads
        cuts = sorted({0, *np.searchsorted(cumulative, targets, side="right").tolist(), count})
        return list(zip(cuts, cuts[1:]))

    def _run_part(self, copies: CopyList, lo: int, hi: int, num_blocks: int) -> set[int]:
        """Run copies ``lo:hi``; returns the blocks that failed. After an error each copy is retried
        alone, so exactly the blocks whose bytes could not be moved are reported."""
        try:
            self._copy(copies, lo, hi)
            return set()
        except Exception:
            pass
        failed: set[int] = set()
        for j in range(lo, hi):
            try:
                self._copy(copies, j, j + 1)
            except Exception:
                failed.update(copies.blocks_of(j, num_blocks))
        return failed

    def _copy(self, copies: CopyList, lo: int, hi: int) -> None:
        """The copy loop; a subclass may override it to inject faults in tests."""
        for s, d, n in zip(copies.src[lo:hi].tolist(), copies.dst[lo:hi].tolist(), copies.size[lo:hi].tolist()):
            (_memmove_holding_gil if n < GIL_HELD_BELOW_BYTES else ctypes.memmove)(d, s, n)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True)
