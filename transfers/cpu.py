"""The CPU transfer backend: memmove on a thread pool, between host memories (and CPU tensors standing
in for a GPU).

A transfer's copy list is cut into up to ``threads`` parts of similar byte counts, one per pool
thread, at block boundaries. Within a part, copies back to back on one side (a host slot's fragments
gathered from or scattered to a per-layer KV cache) form a run; a run of ``GIL_HELD_BELOW_BYTES`` or
more is one NumPy call that copies every fragment in C and releases the GIL once (``_Run``), so the
threads copy in parallel; a shorter one is copied fragment by fragment keeping the GIL. Completion is
reported asynchronously with the indices of exactly the blocks whose bytes did not land.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
from numpy.lib.stride_tricks import as_strided

from kvtier.core.devices import HOST_DEVICE
from kvtier.core.errors import ClosedError, TransferError
from kvtier.core.jobs import mark_kvtier_thread
from kvtier.core.transfer import CopyList, OnComplete, Transfer, TransferBackend

GIL_HELD_BELOW_BYTES = 256 * 1024
"""Runs (and copies) smaller than this are copied without releasing the GIL. ``ctypes.memmove`` releases it for every
call and must take it back after; beside a busy Python thread (an engine's loop polling for a load)
each take-back waits for that thread's switch interval. Measured here: 96 copies of 64 KiB took 96-153
ms that way against 0.7 ms alone, and 11 ms with the GIL held (one wait). Larger runs still release
it, so the pool's threads copy them in parallel and a long copy never holds up the engine's thread;
beside a busy thread each of them pays the wait too, but there are far fewer of them per byte."""

TABLE_ROW_BYTES = 4096
"""The shortest row a run's scattered side is cut into for ``np.take``; measured here, taking rows of 4
KiB was as fast as taking whole 16-64 KiB fragments on an AMD EPYC (6% slower for 16 KiB on one
thread on an Intel Xeon). Fragments whose starts are not a multiple of this apart (tensors allocated
at unrelated addresses) get tables of their own, or a byte-granular view (see ``_regions``)."""

ALIGNED_SHARE = 0.9
"""Fragments are grouped by start modulo the row (so their tables are C-contiguous) unless that
would leave less than this share of the bytes of native runs in runs still long enough to copy
natively; then one byte-granular table is used (see ``_regions``)."""

MIN_ROW_BYTES = 512
"""Copies whose sizes share no power of two this large are all copied in the loop: the index of a
run's rows would take an entry per few bytes (a layout of odd-sized fragments)."""

_memmove_holding_gil = ctypes.PyDLL(None).memmove  # a PyDLL function keeps the GIL during the call
_memmove_holding_gil.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_memmove_holding_gil.restype = ctypes.c_void_p


class CPUBackend(TransferBackend):
    """memmove on a thread pool: host memory to host memory, and CPU tensors standing in for a GPU."""

    name = "cpu"
    pairs = frozenset({(HOST_DEVICE, HOST_DEVICE)})
    copies_now = True

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
        """Cut the copy list into up to ``threads`` parts of similar byte counts, at block boundaries (a
        block cut in two would leave both halves shorter runs, maybe too short to copy natively)."""
        count = len(copies.size)
        if count == 0:
            return [(0, 0)]
        cumulative = np.cumsum(copies.size)
        targets = cumulative[-1] * np.arange(1, self.threads) / self.threads
        block_starts = np.append(np.flatnonzero(np.diff(copies.block)) + 1, count)
        cuts = block_starts[np.searchsorted(block_starts, np.searchsorted(cumulative, targets, side="right"))]
        cuts = sorted({0, *cuts.tolist(), count})
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
        src, dst, size = copies.src[lo:hi], copies.dst[lo:hi], copies.size[lo:hi]
        for run in _runs(src, dst, size):
            if run.table is not None:
                run.copy()
                continue
            for s, d, n in zip(
                src[run.lo : run.hi].tolist(),
                dst[run.lo : run.hi].tolist(),
                size[run.lo : run.hi].tolist(),
                strict=True,
            ):
                (_memmove_holding_gil if n < GIL_HELD_BELOW_BYTES else ctypes.memmove)(d, s, n)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True)


class _Run(NamedTuple):  # a tuple: a job makes one per host slot, and a frozen dataclass is slow to build
    """Copies ``lo:hi`` of a part that are back to back on one side: the destination for a gather
    (``gather``), the source otherwise. That side is ``nbytes`` from ``contiguous_address``.

    The scattered side is ``table``, an array of equal rows over its region's address range, and ``rows``
    lists the rows the run reads or writes, in order, so the run is one NumPy call that copies row by
    row in C and releases the GIL once, instead of one Python-level call per copy: an assignment into
    the table for a scatter; for a gather, ``np.take`` into the contiguous side, when the table is
    C-contiguous (every fragment starts a whole number of rows from its start), else a fancy read and
    a copy (``take`` would first copy a table whose rows overlap: all of its address range).
    """

    lo: int
    hi: int
    nbytes: int
    gather: bool
    contiguous_address: int
    table: np.ndarray | None  # None: copied copy by copy (shorter than GIL_HELD_BELOW_BYTES, or no row fits)
    rows: np.ndarray

    def copy(self) -> None:
        table = self.table
        assert table is not None, "a run without a table is copied copy by copy"
        contiguous = _memory(self.contiguous_address, self.nbytes).reshape(-1, table.shape[1])
        if not self.gather:
            table[self.rows] = contiguous
        elif table.flags.c_contiguous:
            np.take(table, self.rows, axis=0, out=contiguous, mode="wrap")  # "raise" would buffer ``out``
        else:
            contiguous[...] = table[self.rows]


def _runs(src: np.ndarray, dst: np.ndarray, size: np.ndarray) -> list[_Run]:
    """Cut copies into runs back to back on one side: the destination's (gathers) or the source's
    (scatters), whichever gives fewer runs; the other side is indexed as ``_Run`` says, in the table
    of its region (``_regions``), and a run ends where the region does."""
    if len(size) == 0:
        return []
    dst_breaks = np.flatnonzero(dst[1:] != dst[:-1] + size[:-1]) + 1
    src_breaks = np.flatnonzero(src[1:] != src[:-1] + size[:-1]) + 1
    gather = len(dst_breaks) <= len(src_breaks)
    breaks, contiguous, scattered = (dst_breaks, dst, src) if gather else (src_breaks, src, dst)
    row = _lowest_bit(size)  # every copy is a whole number of rows
    run_bytes = _run_bytes(breaks, size)
    native = run_bytes >= GIL_HELD_BELOW_BYTES
    if not native.any() or row < MIN_ROW_BYTES:  # the loop copies every run
        return _loop_runs(breaks, run_bytes, gather, len(size))
    region, breaks, run_bytes = _regions(scattered, size, contiguous, min(row, TABLE_ROW_BYTES), breaks, run_bytes)
    native = run_bytes >= GIL_HELD_BELOW_BYTES
    if not native.any():
        return _loop_runs(breaks, run_bytes, gather, len(size))
    count = int(region.max()) + 1
    bases = _reduce_by(np.minimum, scattered, region, count)
    offsets = scattered - bases[region]
    spans = _reduce_by(np.maximum, offsets + size, region, count)
    step = min(_lowest_bit(offsets) or row, row)  # offsets all 0: every copy starts at row 0
    if step >= min(row, TABLE_ROW_BYTES):
        row = step
        tables = [_memory(b, n).reshape(-1, row) for b, n in zip(bases.tolist(), spans.tolist(), strict=True)]
    else:  # a row at every byte: any fragment start is a row
        step = 1
        tables = [
            as_strided(_memory(b, n), shape=(n - row + 1, row), strides=(1, 1))
            for b, n in zip(bases.tolist(), spans.tolist(), strict=True)
        ]
    counts = size // row  # rows per copy
    firsts = np.cumsum(counts) - counts  # where each copy's rows start in ``index``
    within = np.arange(int(counts.sum())) - np.repeat(firsts, counts)  # a row's place in its copy
    index = np.repeat(offsets // step, counts) + within * (row // step)
    starts = np.concatenate(([0], breaks)).astype(np.intp)
    stops = [*breaks.tolist(), len(size)]
    return [
        _Run(a, b, n, gather, address, tables[r] if big else None, index[first : first + n // row])
        for a, b, n, big, address, first, r in zip(
            starts.tolist(),
            stops,
            run_bytes.tolist(),
            native.tolist(),
            contiguous[starts].tolist(),
            firsts[starts].tolist(),
            region[starts].tolist(),
            strict=True,
        )
    ]


def _regions(
    scattered: np.ndarray,
    size: np.ndarray,
    contiguous: np.ndarray,
    quantum: int,
    breaks: np.ndarray,
    run_bytes: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Which table each copy's scattered side is indexed in: a region number per copy, with the
    breaks and byte counts of the runs (``breaks``, ``run_bytes``) cut where the region changes.

    One table over the whole scattered side would be simplest, but NumPy compares address ranges,
    not bytes: where the contiguous side lies inside the table's range (a host slab mapped between
    two layer tensors) ``np.take`` buffers its output and an indexed assignment its input, extra
    copies that made a take 3x slower (measured). And fragments whose starts are not a whole number
    of rows apart (layer tensors allocated at unrelated offsets) need the byte-granular table, which
    a gather reads through a temporary copy. So fragments before the contiguous side's range and
    after it get tables of their own, and so does each start modulo ``quantum`` (the row such a table
    would use), which makes every table C-contiguous. A run holds one region, so the second cut also
    cuts runs: where that would leave less than ``ALIGNED_SHARE`` of the bytes of native runs in runs
    still long enough (many offsets: every tensor at its own), only the first cut is made."""
    side = (scattered >= int((contiguous + size).max())).astype(np.intp)  # 1: after the contiguous range
    offset = scattered & (quantum - 1)  # quantum is a power of two
    if not (offset == offset[0]).all():
        region = _numbered(side + 2 * offset)
        cut = _cut_at_regions(breaks, region)
        kept = _run_bytes(cut, size)
        native_bytes = run_bytes[run_bytes >= GIL_HELD_BELOW_BYTES].sum()
        if kept[kept >= GIL_HELD_BELOW_BYTES].sum() >= ALIGNED_SHARE * native_bytes:
            return region, cut, kept
    region = _numbered(side)
    if not region.any():  # one region: the runs stay as they are
        return region, breaks, run_bytes
    cut = _cut_at_regions(breaks, region)
    return region, cut, _run_bytes(cut, size)


def _reduce_by(ufunc: np.ufunc, values: np.ndarray, region: np.ndarray, count: int) -> np.ndarray:
    """``ufunc`` (``np.minimum`` or ``np.maximum``) over the ``values`` of each of ``count`` regions."""
    if count == 1:
        return ufunc.reduce(values, keepdims=True)
    out = np.zeros(count, dtype=np.int64)
    out[region] = values  # each region starts from one of its own values (which one does not matter)
    ufunc.at(out, region, values)
    return out


def _numbered(labels: np.ndarray) -> np.ndarray:
    """``labels`` renumbered 0, 1, ... in their order."""
    if (labels == labels[0]).all():
        return np.zeros(len(labels), dtype=np.intp)
    return np.unique(labels, return_inverse=True)[1]


def _cut_at_regions(breaks: np.ndarray, region: np.ndarray) -> np.ndarray:
    """``breaks`` with a break added wherever the region changes from one copy to the next."""
    return np.union1d(breaks, np.flatnonzero(region[1:] != region[:-1]) + 1)


def _run_bytes(breaks: np.ndarray, size: np.ndarray) -> np.ndarray:
    """Bytes of each run when runs start at 0 and at each of ``breaks``."""
    ends = np.cumsum(size)
    return np.diff(np.concatenate(([0], ends[breaks - 1], [ends[-1]])))


def _loop_runs(breaks: np.ndarray, run_bytes: np.ndarray, gather: bool, count: int) -> list[_Run]:
    """The runs of ``count`` copies cut at ``breaks``, all copied copy by copy (no table)."""
    cuts = breaks.tolist()
    return [
        _Run(a, b, n, gather, 0, None, _NO_INDEX)
        for a, b, n in zip([0, *cuts], [*cuts, count], run_bytes.tolist(), strict=True)
    ]


def _lowest_bit(values: np.ndarray) -> int:
    """The largest power of two dividing every value; 0 when every value is 0."""
    bits = int(np.bitwise_or.reduce(values))
    return bits & -bits


class _Address:
    """Raw memory as NumPy takes it (``__array_interface__``): ``np.asarray`` of it copies nothing."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__array_interface__ = {"data": (address, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}


def _memory(address: int, nbytes: int) -> np.ndarray:
    """The ``nbytes`` at ``address`` as a writable uint8 array (the caller keeps the memory alive)."""
    return np.asarray(_Address(address, nbytes))


_NO_INDEX = np.empty(0, dtype=np.intp)
