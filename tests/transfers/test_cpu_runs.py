"""The CPU backend's native runs: a run of copies back to back on one side, at least
``GIL_HELD_BELOW_BYTES`` long, is one NumPy call over the other side's rows.

Invariants checked:
- blocks of 256 KiB and more gather from per-layer storage into random host slots and scatter back
  bit-exact, with no other byte written, whether the per-layer fragments sit a whole number of pages
  apart (``np.take`` over a C-contiguous table of rows) or at unrelated byte offsets (the
  byte-granular table), with 1 and 3 threads; both table kinds and both directions are taken;
- consecutive slots on both sides (copies merged across blocks, of several sizes) copy bit-exact;
- a host side lying inside the address range of the scattered side copies bit-exact, through tables
  whose ranges leave it out (NumPy would copy through a buffer otherwise);
- fragments of one tensor at an offset of their own leave the others in C-contiguous tables;
- a job mixing runs above and below the size copies every block, the small ones in the loop;
- blocks of odd-sized fragments (no row of ``MIN_ROW_BYTES`` divides them) copy bit-exact in the loop;
- property: fragment tables at any mix of offsets, with the host slots before, between or after them
  in one buffer, gather and scatter back exactly the bytes asked for and no other byte.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvtier.core.layout import BlockLayout
from kvtier.core.storage import StridedStorage, buffer_storage
from kvtier.core.transfer import Transfer
from kvtier.transfers import cpu
from kvtier.transfers.cpu import GIL_HELD_BELOW_BYTES, MIN_ROW_BYTES, CPUBackend

FRAGMENT = 32 * 1024
LAYOUT = BlockLayout.per_layer(4, FRAGMENT, kv_split=True)  # 8 fragments: a 256 KiB block
assert LAYOUT.block_bytes >= GIL_HELD_BELOW_BYTES


class Scattered:
    """Per-fragment tables in one buffer: fragment f of slot s at ``bases[f] + s * FRAGMENT``, the
    table of fragment f ``shifts[f]`` bytes after a whole number of fragments (unrelated offsets
    where shifts differ by other than whole pages)."""

    def __init__(
        self, num_slots: int, shifts: list[int], rng: np.random.Generator, layout: BlockLayout = LAYOUT
    ) -> None:
        assert max(shifts) < FRAGMENT
        stride = (num_slots + 2) * FRAGMENT  # a whole number of pages
        self.buffer = rng.integers(0, 256, layout.num_fragments * stride, dtype=np.uint8)
        self.offsets = [f * stride + shift for f, shift in enumerate(shifts)]
        base = self.buffer.ctypes.data
        self.storage = StridedStorage(
            layout,
            num_slots,
            [base + o for o in self.offsets],
            [FRAGMENT] * layout.num_fragments,
            keepalive=self.buffer,
        )

    def block(self, slot: int) -> np.ndarray:
        return np.concatenate([self.buffer[o + slot * FRAGMENT : o + (slot + 1) * FRAGMENT] for o in self.offsets])


@pytest.fixture(params=[1, 3], ids=["threads1", "threads3"])
def backend(request):
    b = CPUBackend(threads=request.param)
    yield b
    b.close()


@pytest.fixture
def runs_taken(monkeypatch) -> Counter:
    """Bytes copied by native runs, by (gather, C-contiguous table), and under "overlapping" those of
    runs whose table's address range holds their contiguous side (NumPy then copies through a
    buffer); the runs still copy."""
    taken: Counter = Counter()
    copy = cpu._Run.copy

    def counted(run) -> None:
        taken[(run.gather, bool(run.table.flags.c_contiguous))] += run.nbytes
        if np.may_share_memory(run.table, cpu._memory(run.contiguous_address, run.nbytes)):  # compares ranges
            taken["overlapping"] += run.nbytes
        copy(run)

    monkeypatch.setattr(cpu._Run, "copy", counted)
    return taken


@pytest.mark.parametrize("skew", [0, 64 + 8], ids=["page-apart", "unrelated-offsets"])
def test_large_blocks_gather_and_scatter_back_bit_exact(backend, skew, rng, run_transfer, runs_taken):
    shifts = [f * skew for f in range(LAYOUT.num_fragments)]  # with a skew, every fragment at an offset of its own
    device = Scattered(24, shifts, rng)
    host = np.zeros((16, LAYOUT.block_bytes), np.uint8)
    host_storage = buffer_storage(host, BlockLayout.contiguous(LAYOUT.block_bytes), writable=True)
    blocks, slots = rng.permutation(24)[:10].tolist(), rng.permutation(16)[:10].tolist()
    assert run_transfer(backend, Transfer(device.storage, blocks, host_storage, slots)) == set()
    for b, s in zip(blocks, slots, strict=True):
        assert np.array_equal(host[s], device.block(b))
    assert not host[sorted(set(range(16)) - set(slots))].any()

    back = Scattered(24, shifts, rng)
    before = back.buffer.copy()
    targets = rng.permutation(24)[:10].tolist()
    assert run_transfer(backend, Transfer(host_storage, slots, back.storage, targets)) == set()
    for b, t in zip(blocks, targets, strict=True):
        assert np.array_equal(back.block(t), device.block(b))
    for t in sorted(set(range(24)) - set(targets)):  # every other slot of every fragment is unchanged
        for o in back.offsets:
            assert np.array_equal(
                back.buffer[o + t * FRAGMENT : o + (t + 1) * FRAGMENT],
                before[o + t * FRAGMENT : o + (t + 1) * FRAGMENT],
            )
    assert runs_taken == {(True, skew == 0): 10 * LAYOUT.block_bytes, (False, skew == 0): 10 * LAYOUT.block_bytes}


def test_consecutive_slots_merge_and_copy_bit_exact(backend, rng, run_transfer, runs_taken):
    src = rng.integers(0, 256, (12, LAYOUT.block_bytes), dtype=np.uint8)
    dst = np.zeros((12, LAYOUT.block_bytes), np.uint8)
    flat = BlockLayout.contiguous(LAYOUT.block_bytes)
    src_slots, dst_slots = [3, 4, 5, 9, 0, 1], [7, 8, 9, 2, 10, 11]  # runs of three, one and two blocks
    assert (
        run_transfer(
            backend, Transfer(buffer_storage(src, flat), src_slots, buffer_storage(dst, flat, True), dst_slots)
        )
        == set()
    )
    for s, d in zip(src_slots, dst_slots, strict=True):
        assert np.array_equal(dst[d], src[s])
    assert not dst[[0, 1, 3, 4, 5, 6]].any()
    assert sum(runs_taken.values()) == 6 * LAYOUT.block_bytes


def test_a_host_side_inside_the_fragments_address_range(backend, rng, run_transfer, runs_taken):
    """Host slots between two halves of the fragment tables: each half gets a table of its own, so no
    table's range holds the host side (NumPy would copy through a buffer), and bytes are exact."""
    layout = BlockLayout.per_layer(16, FRAGMENT, kv_split=True)  # 1 MiB blocks: half a block is a native run
    num_slots, half = 6, layout.num_fragments // 2
    table = num_slots * FRAGMENT
    buffer = rng.integers(0, 256, layout.num_fragments * table + 4 * layout.block_bytes, dtype=np.uint8)
    host_at = half * table
    offsets = [
        f * table if f < half else host_at + 4 * layout.block_bytes + (f - half) * table
        for f in range(layout.num_fragments)
    ]
    base = buffer.ctypes.data
    device = StridedStorage(
        layout, num_slots, [base + o for o in offsets], [FRAGMENT] * layout.num_fragments, keepalive=buffer
    )
    expect = {
        b: np.concatenate([buffer[o + b * FRAGMENT : o + (b + 1) * FRAGMENT] for o in offsets]) for b in (5, 0, 3)
    }
    host = buffer[host_at : host_at + 4 * layout.block_bytes].reshape(4, layout.block_bytes)
    host_storage = buffer_storage(host, BlockLayout.contiguous(layout.block_bytes), writable=True)
    assert run_transfer(backend, Transfer(device, [5, 0, 3], host_storage, [2, 0, 3])) == set()
    for b, s in zip([5, 0, 3], [2, 0, 3], strict=True):
        assert np.array_equal(host[s], expect[b])
    assert runs_taken == {(True, True): 3 * layout.block_bytes}  # each slot: two runs of half a block


def test_one_layer_at_an_offset_of_its_own_keeps_the_others_in_row_tables(backend, rng, run_transfer, runs_taken):
    """A 1 MiB block whose last layer's tensor (K and V) sits at an unrelated offset, as when one
    tensor came from the heap: the other 30 fragments of every slot are still one native run over
    a C-contiguous table, the odd two go through the loop, and every byte lands."""
    layout = BlockLayout.per_layer(16, FRAGMENT, kv_split=True)  # 32 fragments
    shifts = [0] * 30 + [72, 72]
    device = Scattered(12, shifts, rng, layout)
    host = np.zeros((6, layout.block_bytes), np.uint8)
    host_storage = buffer_storage(host, BlockLayout.contiguous(layout.block_bytes), writable=True)
    blocks, slots = [7, 2, 10, 0], [5, 1, 0, 3]
    assert run_transfer(backend, Transfer(device.storage, blocks, host_storage, slots)) == set()
    for b, s in zip(blocks, slots, strict=True):
        assert np.array_equal(host[s], device.block(b))
    back = Scattered(12, shifts, rng, layout)
    assert run_transfer(backend, Transfer(host_storage, slots, back.storage, [1, 11, 4, 6])) == set()
    for b, t in zip(blocks, [1, 11, 4, 6], strict=True):
        assert np.array_equal(back.block(t), device.block(b))
    native = 4 * 30 * FRAGMENT
    assert runs_taken == {(True, True): native, (False, True): native}


def test_runs_above_and_below_the_size_in_one_job(backend, rng, run_transfer, runs_taken):
    small = BlockLayout.per_layer(4, 1024, kv_split=True)  # 8 KiB blocks: every run is below the size
    src = rng.integers(0, 256, (40, small.block_bytes), dtype=np.uint8)
    dst = np.zeros((40, small.block_bytes), np.uint8)
    flat = BlockLayout.contiguous(small.block_bytes)
    src_slots = list(range(0, 36)) + [38]  # 36 consecutive blocks merge into one 288 KiB copy
    dst_slots = list(range(2, 38)) + [0]
    assert (
        run_transfer(
            backend, Transfer(buffer_storage(src, flat), src_slots, buffer_storage(dst, flat, True), dst_slots)
        )
        == set()
    )
    for s, d in zip(src_slots, dst_slots, strict=True):
        assert np.array_equal(dst[d], src[s])
    assert not dst[[1, 38, 39]].any()
    assert sum(runs_taken.values()) == 36 * small.block_bytes  # the merged copy; the lone small block is not


def test_odd_sized_fragments_copy_in_the_loop(backend, rng, run_transfer, runs_taken):
    odd = BlockLayout.per_layer(4, 40 * 1024 + 8, kv_split=True)  # 8 fragments: a 320 KiB block
    assert odd.block_bytes >= GIL_HELD_BELOW_BYTES and (40 * 1024 + 8) % MIN_ROW_BYTES
    src = rng.integers(0, 256, (8, odd.block_bytes), dtype=np.uint8)
    dst = np.zeros((8, odd.block_bytes), np.uint8)
    flat = BlockLayout.contiguous(odd.block_bytes)
    assert (
        run_transfer(backend, Transfer(buffer_storage(src, odd), [6, 1, 3], buffer_storage(dst, flat, True), [0, 5, 7]))
        == set()
    )
    for s, d in zip([6, 1, 3], [0, 5, 7], strict=True):
        assert np.array_equal(dst[d], src[s])
    assert not dst[[1, 2, 3, 4, 6]].any()
    assert not runs_taken


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_placement_of_fragment_tables_and_host_slots_copies_exactly(data, run_transfer):
    """Fragment tables at any offsets (whole pages apart, 64 bytes off, unrelated) with the host slots
    before, between or after them in one buffer: a gather and a scatter back move exactly the bytes
    asked for and write no other byte of the buffer, whichever tables ``_regions`` chooses."""
    frag = data.draw(st.sampled_from([4096, 32 * 1024]), "fragment bytes")
    layout = BlockLayout.per_layer(data.draw(st.integers(2, 8), "layers"), frag, kv_split=True)
    count = layout.num_fragments
    shifts = data.draw(
        st.lists(st.sampled_from([0, 64, 72, 4096, 8192 + 64]), min_size=count, max_size=count), "table shifts"
    )
    host_at = data.draw(st.integers(0, count), "host slots after this many tables")
    num_slots, host_slots = 6, 4
    table_bytes = (num_slots + 3) * frag  # room for any shift
    host_bytes = host_slots * layout.block_bytes
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), "seed"))
    buffer = rng.integers(0, 256, count * table_bytes + host_bytes, dtype=np.uint8)
    starts, host_start, at = [], 0, 0
    for f in range(count + 1):
        if f == host_at:
            host_start, at = at, at + host_bytes
        if f < count:
            starts.append(at + shifts[f])
            at += table_bytes
    base = buffer.ctypes.data
    device = StridedStorage(layout, num_slots, [base + s for s in starts], [frag] * count, keepalive=buffer)
    host = buffer[host_start : host_start + host_bytes].reshape(host_slots, layout.block_bytes)
    host_storage = buffer_storage(host, BlockLayout.contiguous(layout.block_bytes), writable=True)

    def block(b: int) -> np.ndarray:
        return np.concatenate([buffer[s + b * frag : s + (b + 1) * frag] for s in starts])

    blocks = data.draw(st.permutations(range(num_slots)), "blocks")[:host_slots]
    slots = data.draw(st.permutations(range(host_slots)), "slots")
    backend = CPUBackend(threads=data.draw(st.sampled_from([1, 2, 3]), "threads"))
    try:
        expect = buffer.copy()
        for b, s in zip(blocks, slots, strict=True):
            expect[host_start + s * layout.block_bytes : host_start + (s + 1) * layout.block_bytes] = block(b)
        assert run_transfer(backend, Transfer(device, blocks, host_storage, slots)) == set()
        assert np.array_equal(buffer, expect)
        targets = data.draw(st.permutations(range(num_slots)), "targets")[:host_slots]
        for t, s in zip(targets, slots, strict=True):
            for f, start in enumerate(starts):
                expect[start + t * frag : start + (t + 1) * frag] = host[s, f * frag : (f + 1) * frag]
        assert run_transfer(backend, Transfer(host_storage, slots, device, targets)) == set()
        assert np.array_equal(buffer, expect)
    finally:
        backend.close()
