"""Transfers and the CPU backend, beyond the TransferBackend contract (tests/contracts/test_transfer_backend.py
runs that over the CPU backend too: completion once per transfer, no-block transfers, refused device pairs,
close, memory kept alive).

Invariants checked:
- every block of a transfer lands bit-exact in its destination slot, and no other destination byte
  changes: between contiguous storages, gathering per-layer (multi-fragment) storage into contiguous
  slots and scattering back, between per-layer storages, for random slot permutations, with 1 and 3
  copy threads;
- adjacent fragment copies merge (consecutive slots on both sides become one copy), scattered ones
  do not;
- a transfer that cannot be set up (bad slots, mismatched counts or block sizes, fragment layouts
  that are different and both scattered) raises synchronously and never calls on_complete;
- on_complete reports exactly the blocks whose bytes did not land, with 1 and 3 threads, for gathers,
  scatters and merged runs (fault injection through a ``_copy`` override); every block not reported
  failed is bit-exact.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.core.errors import TransferError
from kvtier.core.layout import BlockLayout
from kvtier.core.storage import StridedStorage, buffer_storage
from kvtier.core.transfer import CopyList, Transfer
from kvtier.transfers.cpu import CPUBackend

PER_LAYER = BlockLayout.per_layer(3, 24, kv_split=True)  # 6 fragments of 24 bytes
FLAT = BlockLayout.contiguous(PER_LAYER.block_bytes)


class LayerBuffers:
    """Per-layer storage in one buffer with a gap after each layer, so fragments are never adjacent."""

    def __init__(self, layout: BlockLayout, num_slots: int, rng: np.random.Generator | None = None) -> None:
        assert len(set(layout.fragment_bytes)) == 1
        self.frag = layout.fragment_bytes[0]
        shape = (layout.num_fragments, num_slots + 1, self.frag)
        self.buffer = rng.integers(0, 256, shape, dtype=np.uint8) if rng is not None else np.zeros(shape, np.uint8)
        base = self.buffer.ctypes.data
        bases = [base + f * (num_slots + 1) * self.frag for f in range(layout.num_fragments)]
        self.storage = StridedStorage(
            layout, num_slots, bases, [self.frag] * layout.num_fragments, keepalive=self.buffer
        )

    def block(self, slot: int) -> np.ndarray:
        """The block's bytes in layout order (as a contiguous slot holds them)."""
        return self.buffer[:, slot, :].reshape(-1).copy()


@pytest.fixture(params=[1, 3], ids=["threads1", "threads3"])
def backend(request):
    b = CPUBackend(threads=request.param)
    yield b
    b.close()


def pick(rng, total: int, n: int) -> list[int]:
    return rng.permutation(total)[:n].tolist()


# --- bit-exact copies ----------------------------------------------------------------------------


def test_contiguous_to_contiguous_random_slots(backend, rng, run_transfer):
    layout = BlockLayout((40, 24))
    src = rng.integers(0, 256, (20, 64), dtype=np.uint8)
    dst = np.zeros((30, 64), np.uint8)
    src_slots, dst_slots = pick(rng, 20, 12), pick(rng, 30, 12)
    failed = run_transfer(
        backend, Transfer(buffer_storage(src, layout), src_slots, buffer_storage(dst, layout, writable=True), dst_slots)
    )
    assert failed == set()
    for s, d in zip(src_slots, dst_slots, strict=True):
        assert np.array_equal(dst[d], src[s])
    untouched = sorted(set(range(30)) - set(dst_slots))
    assert not dst[untouched].any()


def test_gather_per_layer_into_contiguous_and_scatter_back(backend, rng, run_transfer):
    gpu = LayerBuffers(PER_LAYER, 10, rng)
    original = [gpu.block(s) for s in range(10)]
    host = np.zeros((16, FLAT.block_bytes), np.uint8)
    host_storage = buffer_storage(host, FLAT, writable=True)

    gpu_slots, host_slots = pick(rng, 10, 7), pick(rng, 16, 7)
    assert run_transfer(backend, Transfer(gpu.storage, gpu_slots, host_storage, host_slots)) == set()
    for g, h in zip(gpu_slots, host_slots, strict=True):
        assert np.array_equal(host[h], original[g])
    assert not host[sorted(set(range(16)) - set(host_slots))].any()

    back = LayerBuffers(PER_LAYER, 12)
    back_slots = pick(rng, 12, 7)
    assert run_transfer(backend, Transfer(host_storage, host_slots, back.storage, back_slots)) == set()
    for g, b in zip(gpu_slots, back_slots, strict=True):
        assert np.array_equal(back.block(b), original[g])
    for b in set(range(12)) - set(back_slots):
        assert not back.block(b).any()
    assert not back.buffer[:, 12, :].any()  # the gaps between layers are never written


def test_contiguous_side_may_have_its_own_fragments(backend, rng, run_transfer):
    """A host slot described as two fragments still exchanges blocks with six per-layer fragments."""
    gpu = LayerBuffers(PER_LAYER, 4, rng)
    host = np.zeros((4, PER_LAYER.block_bytes), np.uint8)
    host_layout = BlockLayout((PER_LAYER.block_bytes,))
    host_storage = buffer_storage(host, host_layout, True)
    assert run_transfer(backend, Transfer(gpu.storage, [3, 1], host_storage, [0, 2])) == set()
    assert np.array_equal(host[0], gpu.block(3)) and np.array_equal(host[2], gpu.block(1))


def test_per_layer_to_per_layer(backend, rng, run_transfer):
    src = LayerBuffers(PER_LAYER, 8, rng)
    dst = LayerBuffers(PER_LAYER, 8)
    src_slots, dst_slots = pick(rng, 8, 8), pick(rng, 8, 8)
    assert run_transfer(backend, Transfer(src.storage, src_slots, dst.storage, dst_slots)) == set()
    for s, d in zip(src_slots, dst_slots, strict=True):
        assert np.array_equal(dst.block(d), src.block(s))


def test_torch_tensors_and_lists_of_arrays(backend, rng, run_transfer):
    layout = BlockLayout.per_layer(2, 32)
    tensor = torch.from_numpy(rng.integers(0, 256, (5, 64), dtype=np.uint8))
    blocks = [np.zeros(64, np.uint8) for _ in range(3)]
    assert (
        run_transfer(
            backend,
            Transfer(
                buffer_storage(tensor, layout), [4, 0, 2], buffer_storage(blocks, layout, writable=True), [1, 2, 0]
            ),
        )
        == set()
    )
    assert np.array_equal(blocks[1], tensor[4].numpy())
    assert np.array_equal(blocks[2], tensor[0].numpy())
    assert np.array_equal(blocks[0], tensor[2].numpy())


def test_many_blocks_across_threads(rng, run_transfer):
    backend = CPUBackend(threads=3)
    src = LayerBuffers(PER_LAYER, 200, rng)
    host = np.zeros((256, FLAT.block_bytes), np.uint8)
    src_slots, dst_slots = pick(rng, 200, 200), pick(rng, 256, 200)
    assert run_transfer(backend, Transfer(src.storage, src_slots, buffer_storage(host, FLAT, True), dst_slots)) == set()
    for s, d in zip(src_slots, dst_slots, strict=True):
        assert np.array_equal(host[d], src.block(s))
    backend.close()


# --- copy lists ----------------------------------------------------------------------------------


def test_consecutive_slots_merge_into_one_copy():
    layout = BlockLayout((16, 16, 32))
    src, dst = np.zeros((8, 64), np.uint8), np.zeros((8, 64), np.uint8)
    copies = Transfer(buffer_storage(src, layout), [2, 3, 4, 5], buffer_storage(dst, layout), [0, 1, 2, 3]).copies()
    assert len(copies.size) == 1
    assert copies.size.tolist() == [256] and copies.total_bytes == 256
    assert copies.src.tolist() == [src.ctypes.data + 2 * 64]
    assert copies.dst.tolist() == [dst.ctypes.data]
    assert copies.block.tolist() == [0]


def test_consecutive_slots_do_not_merge_across_a_break_of_either_side():
    """Where two pinned registrations meet (``BlockStorage.breaks``) a copy ends, on either side."""
    layout = BlockLayout.contiguous(64)
    src, dst = np.zeros((8, 64), np.uint8), np.zeros((8, 64), np.uint8)
    source, target = buffer_storage(src, layout), buffer_storage(dst, layout)
    source.breaks = np.array([src.ctypes.data + 4 * 64])  # slot 4 starts a registration
    copies = Transfer(source, [2, 3, 4, 5], target, [0, 1, 2, 3]).copies()
    assert copies.size.tolist() == [128, 128] and copies.block.tolist() == [0, 2]
    source.breaks, target.breaks = source.breaks[:0], np.array([dst.ctypes.data + 64])  # slot 1 of dst
    copies = Transfer(source, [2, 3, 4, 5], target, [0, 1, 2, 3]).copies()
    assert copies.size.tolist() == [64, 192] and copies.block.tolist() == [0, 1]
    assert Transfer(source, [2, 3], target, [4, 5]).copies().size.tolist() == [128]  # a break elsewhere: merged


def test_scattered_slots_do_not_merge():
    layout = BlockLayout.contiguous(64)
    src, dst = np.zeros((8, 64), np.uint8), np.zeros((8, 64), np.uint8)
    copies = Transfer(buffer_storage(src, layout), [0, 1, 2], buffer_storage(dst, layout), [0, 2, 4]).copies()
    assert len(copies.size) == 3
    assert copies.block.tolist() == [0, 1, 2]
    assert copies.dst.tolist() == [dst.ctypes.data + 64 * i for i in (0, 2, 4)]
    runs = Transfer(buffer_storage(src, layout), [0, 1, 5, 6], buffer_storage(dst, layout), [3, 4, 5, 6]).copies()
    assert runs.size.tolist() == [128, 128] and runs.block.tolist() == [0, 2]


def test_per_layer_gather_merges_nothing_but_each_fragment_is_one_copy():
    gpu = LayerBuffers(PER_LAYER, 6)
    host = np.zeros((6, FLAT.block_bytes), np.uint8)
    copies = Transfer(gpu.storage, [0, 1, 2], buffer_storage(host, FLAT), [0, 1, 2]).copies()
    assert len(copies.size) == 3 * PER_LAYER.num_fragments
    assert copies.size.tolist() == [24] * 18
    assert copies.block.tolist() == [b for b in range(3) for _ in range(6)]
    assert copies.dst.tolist() == [host.ctypes.data + 24 * i for i in range(18)]  # one contiguous run of slots
    assert copies.total_bytes == 3 * FLAT.block_bytes


def test_per_layer_copies_do_not_merge_across_layers():
    layout = BlockLayout.per_layer(2, 16)
    src, dst = LayerBuffers(layout, 5), LayerBuffers(layout, 5)
    copies = Transfer(src.storage, [0, 1, 2], dst.storage, [2, 3, 4]).copies()
    # copies run block by block, layer by layer: each copy follows a copy of another layer's tensor
    assert len(copies.size) == 6
    consecutive = Transfer(src.storage, [0, 1], dst.storage, [3, 4]).copies()
    assert len(consecutive.size) == 4


def test_zero_block_copy_list_is_empty():
    layout = BlockLayout.contiguous(8)
    copies = Transfer(
        buffer_storage(np.zeros((2, 8), np.uint8), layout), [], buffer_storage(np.zeros((2, 8), np.uint8), layout), []
    ).copies()
    assert isinstance(copies, CopyList) and len(copies.size) == 0 and copies.total_bytes == 0


# --- refused set-ups -----------------------------------------------------------------------------


def _never_called(calls):
    return lambda failed: calls.append(failed)


@pytest.mark.parametrize("src_slots, dst_slots", [([0, 4], [0, 1]), ([0, 1], [0, 5]), ([-1], [0]), ([0], [-3])])
def test_bad_slots_raise_synchronously(src_slots, dst_slots):
    backend = CPUBackend(2)
    src, dst = np.ones((4, 8), np.uint8), np.zeros((5, 8), np.uint8)
    layout = BlockLayout.contiguous(8)
    calls = []
    with pytest.raises(TransferError):
        backend.submit(
            Transfer(buffer_storage(src, layout), src_slots, buffer_storage(dst, layout, True), dst_slots),
            _never_called(calls),
        )
    backend.close()
    assert calls == [] and not dst.any()


def test_mismatched_slot_counts_raise():
    layout = BlockLayout.contiguous(8)
    storage = buffer_storage(np.zeros((4, 8), np.uint8), layout)
    with pytest.raises(TransferError):
        Transfer(storage, [0, 1], storage, [2])


def test_mismatched_block_sizes_raise():
    a = buffer_storage(np.zeros((4, 8), np.uint8), BlockLayout.contiguous(8))
    b = buffer_storage(np.zeros((4, 16), np.uint8), BlockLayout.contiguous(16))
    with pytest.raises(TransferError, match="block sizes"):
        Transfer(a, [0], b, [0])


def test_incompatible_fragment_layouts_raise():
    backend = CPUBackend(1)
    a = LayerBuffers(BlockLayout.per_layer(2, 24), 4)  # 2 x 24
    b = LayerBuffers(BlockLayout.per_layer(3, 16), 4)  # 3 x 16: same 48-byte blocks
    calls = []
    with pytest.raises(TransferError, match="fragment layouts"):
        backend.submit(Transfer(a.storage, [0], b.storage, [0]), _never_called(calls))
    backend.close()
    assert calls == []


def test_a_backend_needs_a_thread():
    with pytest.raises(ValueError):
        CPUBackend(threads=0)


# --- completion and failures ---------------------------------------------------------------------


class PoisonedBackend(CPUBackend):
    """Fails every copy whose destination touches a poisoned byte range (a fault injected per slot)."""

    def __init__(self, threads: int, poisoned: list[tuple[int, int]]) -> None:
        super().__init__(threads)
        self.poisoned = poisoned

    def _copy(self, copies, lo, hi):
        for d, n in zip(copies.dst[lo:hi].tolist(), copies.size[lo:hi].tolist(), strict=True):
            if any(d < end and start < d + n for start, end in self.poisoned):
                raise OSError("injected copy fault")
        super()._copy(copies, lo, hi)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("gather", [True, False], ids=["gather", "scatter"])
def test_a_failing_copy_reports_exactly_the_failed_blocks(threads, gather, rng, run_transfer):
    n = 24
    gpu = LayerBuffers(PER_LAYER, n, rng if gather else None)
    host = (
        np.zeros((2 * n, FLAT.block_bytes), np.uint8)
        if gather
        else rng.integers(0, 256, (2 * n, FLAT.block_bytes), dtype=np.uint8)
    )
    host_storage = buffer_storage(host, FLAT, writable=True)
    gpu_slots = pick(rng, n, n)
    host_slots = [2 * s for s in pick(rng, n, n)]  # every other slot: no two blocks merge
    bad = sorted(rng.choice(n, 5, replace=False).tolist())
    if gather:
        poisoned = [
            (
                host.ctypes.data + host_slots[i] * FLAT.block_bytes,
                host.ctypes.data + (host_slots[i] + 1) * FLAT.block_bytes,
            )
            for i in bad
        ]
        transfer = Transfer(gpu.storage, gpu_slots, host_storage, host_slots)
    else:
        # poison one layer's fragment of each bad destination block
        poisoned = [(int(a), int(a) + 24) for a in gpu.storage.fragment_addresses([gpu_slots[i] for i in bad])[:, 4]]
        transfer = Transfer(host_storage, host_slots, gpu.storage, gpu_slots)
    backend = PoisonedBackend(threads, poisoned)
    failed = run_transfer(backend, transfer)
    backend.close()
    assert failed == set(bad)
    for i in range(n):
        landed = np.array_equal(host[host_slots[i]], gpu.block(gpu_slots[i]))
        assert landed == (i not in bad), i


@pytest.mark.parametrize("threads", [1, 2])
def test_merged_runs_fail_every_block_they_touch_and_no_other(threads, rng, run_transfer):
    n = 12
    src = rng.integers(0, 256, (n, 64), dtype=np.uint8)
    dst = np.zeros((n, 64), np.uint8)
    layout = BlockLayout.contiguous(64)
    # blocks 0..5 copy slots 0..5 to 0..5 (one merged copy); blocks 6..11 read slots in reverse order
    # (one copy each)
    dst_slots = list(range(n))
    src_slots = list(range(6)) + list(reversed(range(6, n)))
    transfer = Transfer(buffer_storage(src, layout), src_slots, buffer_storage(dst, layout, True), dst_slots)
    copies = transfer.copies()
    assert len(copies.size) == 1 + 6
    base = dst.ctypes.data
    poisoned = [(base + 64 * 2, base + 64 * 3), (base + 64 * 8, base + 64 * 9)]
    backend = PoisonedBackend(threads, poisoned)
    failed = run_transfer(backend, transfer)
    backend.close()
    assert failed == {0, 1, 2, 3, 4, 5, 8}
    for i in range(n):
        if i not in failed:
            assert np.array_equal(dst[dst_slots[i]], src[src_slots[i]]), i


def test_a_merged_copy_ending_mid_block_fails_both_blocks_it_touches(rng, run_transfer):
    """Regression: with an interleaved geometry one merged copy holds the end of block 0 and the start
    of block 1; when it fails, block 1 must be reported too (it was not, and came back wrong)."""
    layout = BlockLayout((16, 16))
    buffer = np.zeros(400, np.uint8)
    base = buffer.ctypes.data
    # fragment 1 of slot 0 ends exactly where fragment 0 of slot 1 starts
    dst = StridedStorage(layout, 2, [base, base + 100], [116, 116], keepalive=buffer)
    src_blocks = rng.integers(0, 256, (2, 32), dtype=np.uint8)
    transfer = Transfer(buffer_storage(src_blocks, BlockLayout.contiguous(32)), [0, 1], dst, [0, 1])
    copies = transfer.copies()
    assert (copies.dst - base).tolist() == [0, 100, 216] and copies.size.tolist() == [16, 32, 16]
    backend = PoisonedBackend(1, [(base + 100, base + 101)])
    failed = run_transfer(backend, transfer)
    backend.close()
    assert failed == {0, 1}
    ok = CPUBackend(1)
    assert run_transfer(ok, transfer) == set()
    ok.close()
    assert np.array_equal(buffer[0:16], src_blocks[0, :16]) and np.array_equal(buffer[100:116], src_blocks[0, 16:])
    assert np.array_equal(buffer[116:132], src_blocks[1, :16]) and np.array_equal(buffer[216:232], src_blocks[1, 16:])


def test_every_block_failing_reports_all(rng, run_transfer):
    layout = BlockLayout.contiguous(16)
    dst = np.zeros((4, 16), np.uint8)
    backend = PoisonedBackend(3, [(dst.ctypes.data, dst.ctypes.data + dst.nbytes)])
    src = rng.integers(0, 256, (4, 16), dtype=np.uint8)
    failed = run_transfer(
        backend, Transfer(buffer_storage(src, layout), [0, 1, 2, 3], buffer_storage(dst, layout, True), [3, 1, 2, 0])
    )
    backend.close()
    assert failed == {0, 1, 2, 3}
    assert not dst.any()
