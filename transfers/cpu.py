"""The CPU transfer backend: memmove on a thread pool, between host memories (and CPU tensors standing
in for a GPU).

A transfer's copy list is cut into up to ``threads`` parts of similar byte counts, one per pool
thread. Large copies release the GIL, so the threads copy in parallel; small ones keep it (see
``GIL_HELD_BELOW_BYTES``). Completion is reported asynchronously with the indices of exactly the
blocks whose bytes did not land.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvtier.core.errors import ClosedError, TransferError
from kvtier.core.jobs import mark_kvtier_thread
from kvtier.core.transfer import CopyList, OnComplete, Transfer, TransferBackend

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


class CPUBackend(TransferBackend):
    """memmove on a thread pool: host memory to host memory, and CPU tensors standing in for a GPU."""

    name = "cpu"
    pairs = frozenset({("cpu", "cpu")})

    def __init__(self, threads: int = 2) -> None:
        if threads < 1:
            raise ValueError("the CPU backend needs at least one thread")
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvtier-copy", initializer=mark_kvtier_thread)
        self._closed = False
        self._lock = threading.Lock()

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

    def copy_now(self, transfer: Transfer) -> set[int]:
        """Run ``transfer`` on the calling thread, now; returns the blocks that failed (what ``submit``
        would have reported). For a caller that would only wait for the copy (an in-step load)."""
        if not self.can_copy(transfer.src.device, transfer.dst.device):
            raise TransferError(f"the CPU backend cannot copy {transfer.src.device} -> {transfer.dst.device}")
        copies = transfer.copies()
        return self._run_part(copies, 0, len(copies.size), transfer.num_blocks)

    def _split(self, copies: CopyList) -> list[tuple[int, int]]:
        """Cut the copy list into up to ``threads`` parts of similar byte counts, at copy boundaries."""
        count = len(copies.size)
        if count == 0:
            return [(0, 0)]
        cumulative = np.cumsum(copies.size)
        targets = cumulative[-1] * np.arange(1, self.threads) / self.threads
        cuts = sorted({0, *np.searchsorted(cumulative, targets, side="right").tolist(), count})
        return list(itertools.pairwise(cuts))

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
        src, dst, size = copies.src[lo:hi].tolist(), copies.dst[lo:hi].tolist(), copies.size[lo:hi].tolist()
        for s, d, n in zip(src, dst, size, strict=True):
            (_memmove_holding_gil if n < GIL_HELD_BELOW_BYTES else ctypes.memmove)(d, s, n)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True)
