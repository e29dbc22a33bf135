"""How the disk backend groups consecutive slots into vectored calls (``kvtier.tiers.disk.io._runs``),
seen through its real system calls on a real slab file.

Invariants checked:
- small slots go in runs of up to ``_RUN_BYTES`` (2 MiB) of slots, whatever the job's size;
- slots of more than an eighth of ``_RUN_BYTES`` go in runs of up to ``_RUN_SLOTS`` (8) when the job
  gives every I/O thread such a run, and in shorter runs when it does not (a small job keeps all its
  threads busy);
- whatever the grouping, every block loads back bit-exact.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvtier.core.layout import BlockLayout
from kvtier.core.transfer import Transfer
from kvtier.tiers.disk.io import _RUN_BYTES, _RUN_SLOTS
from kvtier.tiers.disk.slab import DiskSlab, FileStorage
from kvtier.tiers.disk.slots import PAGE
from kvtier.tiers.disk.transfer import DiskBackend
from kvtier.tiers.host import HostSlab

THREADS = 2


class CountingDiskBackend(DiskBackend):
    """The real backend, counting the slots each write and read call moves."""

    def __init__(self, stride: int) -> None:
        super().__init__(io_threads=THREADS)
        self.stride = stride
        self.writes: list[int] = []
        self.reads: list[int] = []
        self._calls_lock = threading.Lock()

    def _slots(self, buffers) -> int:
        return sum(len(memoryview(b)) for b in buffers) // self.stride

    def _pwritev(self, fd, buffers, offset):
        with self._calls_lock:
            self.writes.append(self._slots(buffers))
        return super()._pwritev(fd, buffers, offset)

    def _preadv(self, fd, buffers, offset):
        with self._calls_lock:
            self.reads.append(self._slots(buffers))
        return super()._preadv(fd, buffers, offset)


def round_trip(tmp_path, block: int, blocks: int, rng, run_transfer) -> CountingDiskBackend:
    """Store ``blocks`` random blocks into consecutive slots and load them back; returns the backend."""
    layout = BlockLayout((block,))
    src, dst = HostSlab(blocks, layout), HostSlab(blocks, layout)
    slab = DiskSlab(tmp_path / "slab", blocks, layout, "runs")
    storage = FileStorage(slab, layout)
    backend = CountingDiskBackend(slab.slot_stride)
    try:
        src.array[:] = rng.integers(0, 256, src.nbytes, dtype=np.uint8)
        keys = [i.to_bytes(16, "little") for i in range(blocks)]
        slots = list(range(blocks))
        for transfer in (
            Transfer(src.storage, slots, storage, slots, keys),
            Transfer(storage, slots, dst.storage, slots, keys),
        ):
            assert run_transfer(backend, transfer) == set()
        assert np.array_equal(src.array, dst.array)
        return backend
    finally:
        backend.close()
        storage.close()
        src.close()
        dst.close()


def test_small_slots_go_in_runs_of_two_mebibytes(tmp_path, rng, run_transfer):
    block = 64 * 1024
    per_run = _RUN_BYTES // (block + PAGE)
    backend = round_trip(tmp_path, block, 3 * per_run + 5, rng, run_transfer)
    assert sorted(backend.writes) == sorted(backend.reads) == [5, per_run, per_run, per_run]


@pytest.mark.parametrize(("blocks", "per_run"), [(THREADS * _RUN_SLOTS * 2, _RUN_SLOTS), (6, 3), (2, 1)])
def test_large_slots_go_in_runs_of_up_to_eight_while_every_thread_gets_one(
    tmp_path, rng, run_transfer, blocks, per_run
):
    block = _RUN_BYTES // 2 + 4 * PAGE  # two such slots are more than _RUN_BYTES
    backend = round_trip(tmp_path, block, blocks, rng, run_transfer)
    expect = [per_run] * (blocks // per_run) + ([blocks % per_run] if blocks % per_run else [])
    assert sorted(backend.writes) == sorted(backend.reads) == sorted(expect)
