"""Block geometry and storage addresses.

Invariants checked:
- a BlockLayout's offsets are the running sum of its fragment sizes and its block size is their sum;
  empty or non-positive layouts are refused;
- a storage's fragment address for (slot, fragment) is exactly where that fragment's bytes live in
  the memory it wraps (checked by reading the caller's random bytes back through the address);
- a slot outside [0, num_slots) raises TransferError, also after close();
- buffer_storage accepts C-contiguous numpy arrays, torch tensors and lists of either, and refuses a
  read-only destination, a non-contiguous buffer, a wrong size or a type it cannot address.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from kvtier.core.errors import TransferError
from kvtier.core.layout import BlockLayout
from kvtier.core.storage import SlotListStorage, StridedStorage, buffer_info, buffer_storage, contiguous_storage


def _bytes_at(address: int, n: int) -> np.ndarray:
    return np.frombuffer(ctypes.string_at(int(address), n), dtype=np.uint8)


# --- layout ------------------------------------------------------------------------------------


def test_layout_geometry():
    layout = BlockLayout((16, 48, 8))
    assert layout.num_fragments == 3
    assert layout.block_bytes == 72
    assert layout.offsets.tolist() == [0, 16, 64]
    assert layout.sizes.tolist() == [16, 48, 8]
    assert layout.offsets.dtype == np.int64


def test_layout_constructors():
    assert BlockLayout.contiguous(100).fragment_bytes == (100,)
    assert BlockLayout.per_layer(3, 10).fragment_bytes == (10, 10, 10)
    kv = BlockLayout.per_layer(2, 10, kv_split=True)
    assert kv.fragment_bytes == (10, 10, 10, 10)
    assert kv.block_bytes == 40
    assert kv.offsets.tolist() == [0, 10, 20, 30]


@pytest.mark.parametrize("fragments", [(), (0,), (8, -1), (8, 0, 8)])
def test_layout_refuses_empty_or_non_positive_fragments(fragments):
    with pytest.raises(ValueError):
        BlockLayout(fragments)


def test_layout_normalises_to_ints_and_compares_by_value():
    layout = BlockLayout((np.int64(8), 16.0))
    assert layout.fragment_bytes == (8, 16)
    assert all(type(n) is int for n in layout.fragment_bytes)
    assert layout == BlockLayout((8, 16))
    assert layout != BlockLayout((16, 8))


# --- storages ----------------------------------------------------------------------------------


def test_contiguous_storage_addresses_point_at_each_slots_fragments(rng):
    layout = BlockLayout((8, 24))
    slab = rng.integers(0, 256, (5, layout.block_bytes), dtype=np.uint8)
    storage = contiguous_storage(slab.ctypes.data, 5, layout, keepalive=slab)
    addresses = storage.fragment_addresses([4, 0, 2])
    assert addresses.shape == (3, 2) and addresses.dtype == np.int64
    for row, slot in zip(addresses, [4, 0, 2], strict=True):
        assert np.array_equal(_bytes_at(row[0], 8), slab[slot, :8])
        assert np.array_equal(_bytes_at(row[1], 24), slab[slot, 8:])


def test_strided_storage_per_layer_addresses(rng):
    layout = BlockLayout.per_layer(3, 16)
    layers = [rng.integers(0, 256, (4, 16), dtype=np.uint8) for _ in range(3)]
    storage = StridedStorage(layout, 4, [a.ctypes.data for a in layers], [16] * 3, keepalive=layers)
    addresses = storage.fragment_addresses(np.array([3, 1]))
    for row, slot in zip(addresses, [3, 1], strict=True):
        for f in range(3):
            assert np.array_equal(_bytes_at(row[f], 16), layers[f][slot])


def test_strided_storage_needs_one_base_and_stride_per_fragment():
    with pytest.raises(TransferError):
        StridedStorage(BlockLayout.per_layer(2, 8), 4, [0], [8, 8])
    with pytest.raises(TransferError):
        StridedStorage(BlockLayout.per_layer(2, 8), 4, [0, 64], [8])


@pytest.mark.parametrize("slots", [[4], [-1], [0, 1, 7]])
def test_slot_out_of_range_raises(slots):
    layout = BlockLayout.contiguous(8)
    slab = np.zeros((4, 8), np.uint8)
    storage = contiguous_storage(slab.ctypes.data, 4, layout, keepalive=slab)
    with pytest.raises(TransferError):
        storage.fragment_addresses(slots)


def test_empty_slot_list_gives_empty_addresses():
    slab = np.zeros((4, 8), np.uint8)
    storage = contiguous_storage(slab.ctypes.data, 4, BlockLayout((4, 4)), keepalive=slab)
    assert storage.fragment_addresses([]).shape == (0, 2)


def test_close_runs_on_close_once_and_refuses_addresses():
    calls = []
    slab = np.zeros((4, 8), np.uint8)
    storage = contiguous_storage(
        slab.ctypes.data, 4, BlockLayout.contiguous(8), keepalive=slab, on_close=lambda: calls.append(1)
    )
    storage.fragment_addresses([3])
    storage.close()
    storage.close()
    assert calls == [1]
    assert storage.num_slots == 0
    with pytest.raises(TransferError):
        storage.fragment_addresses([0])


# --- buffer_storage ----------------------------------------------------------------------------


def test_buffer_storage_over_one_numpy_array(rng):
    layout = BlockLayout((4, 12))
    blocks = rng.integers(0, 256, (6, 16), dtype=np.uint8)
    storage = buffer_storage(blocks, layout)
    assert isinstance(storage, StridedStorage)
    assert storage.num_slots == 6 and storage.device == "cpu" and storage.layout == layout
    for slot in range(6):
        row = storage.fragment_addresses([slot])[0]
        assert np.array_equal(_bytes_at(row[0], 4), blocks[slot, :4])
        assert np.array_equal(_bytes_at(row[1], 12), blocks[slot, 4:])


def test_buffer_storage_counts_blocks_by_bytes_not_by_shape(rng):
    layout = BlockLayout.contiguous(32)
    halves = rng.standard_normal((3, 4, 4)).astype(np.float16)  # 3 blocks of 32 bytes as float16
    storage = buffer_storage(halves, layout)
    assert storage.num_slots == 3
    assert np.array_equal(_bytes_at(storage.fragment_addresses([2])[0, 0], 32), halves[2].view(np.uint8).reshape(-1))


def test_buffer_storage_over_a_torch_tensor(rng):
    layout = BlockLayout((8, 8))
    tensor = torch.from_numpy(rng.integers(0, 256, (5, 16), dtype=np.uint8))
    storage = buffer_storage(tensor, layout, writable=True)
    assert storage.num_slots == 5 and storage.device == "cpu"
    row = storage.fragment_addresses([3])[0]
    assert np.array_equal(_bytes_at(row[1], 8), tensor[3, 8:].numpy())


def test_buffer_storage_over_a_list_of_arrays(rng):
    layout = BlockLayout((4, 4, 8))
    blocks = [rng.integers(0, 256, 16, dtype=np.uint8) for _ in range(4)]
    storage = buffer_storage(blocks, layout, writable=True)
    assert isinstance(storage, SlotListStorage)
    assert storage.num_slots == 4
    for slot in (2, 0, 3):
        row = storage.fragment_addresses([slot])[0]
        got = np.concatenate([_bytes_at(a, n) for a, n in zip(row, layout.fragment_bytes, strict=True)])
        assert np.array_equal(got, blocks[slot])


def test_buffer_storage_over_a_list_of_tensors(rng):
    layout = BlockLayout.contiguous(24)
    blocks = [torch.from_numpy(rng.integers(0, 256, 24, dtype=np.uint8)) for _ in range(3)]
    storage = buffer_storage(blocks, layout)
    assert storage.num_slots == 3
    assert np.array_equal(_bytes_at(storage.fragment_addresses([1])[0, 0], 24), blocks[1].numpy())


def test_empty_list_is_a_storage_of_no_slots():
    storage = buffer_storage([], BlockLayout.contiguous(8))
    assert storage.num_slots == 0
    with pytest.raises(TransferError):
        storage.fragment_addresses([0])


def test_read_only_array_is_refused_only_as_a_destination():
    blocks = np.zeros((2, 8), np.uint8)
    blocks.flags.writeable = False
    layout = BlockLayout.contiguous(8)
    assert buffer_storage(blocks, layout).num_slots == 2  # a source may be read-only
    with pytest.raises(TransferError, match="read-only"):
        buffer_storage(blocks, layout, writable=True)
    with pytest.raises(TransferError, match="read-only"):
        buffer_storage([np.zeros(8, np.uint8), blocks[0]], layout, writable=True)


def test_non_contiguous_buffers_are_refused():
    layout = BlockLayout.contiguous(8)
    strided = np.zeros((4, 16), np.uint8)[:, ::2]  # 4 x 8 bytes, but not contiguous
    assert strided.nbytes == 32
    with pytest.raises(TransferError, match="contiguous"):
        buffer_storage(strided, layout)
    with pytest.raises(TransferError, match="contiguous"):
        buffer_storage([strided[0]], layout)
    transposed = torch.zeros((8, 4), dtype=torch.uint8).t()
    with pytest.raises(TransferError, match="contiguous"):
        buffer_storage(transposed, layout)


def test_wrong_sizes_are_refused():
    layout = BlockLayout((8, 8))
    with pytest.raises(TransferError, match="whole number"):
        buffer_storage(np.zeros(40, np.uint8), layout)
    with pytest.raises(TransferError, match="block 1"):
        buffer_storage([np.zeros(16, np.uint8), np.zeros(15, np.uint8)], layout)
    with pytest.raises(TransferError):
        buffer_storage(torch.zeros(17, dtype=torch.uint8), layout)


@pytest.mark.parametrize("thing", [b"\x00" * 16, bytearray(16), 16, [b"\x00" * 16]])
def test_unaddressable_types_are_refused(thing):
    with pytest.raises(TransferError, match="numpy arrays or torch tensors"):
        buffer_storage(thing, BlockLayout.contiguous(16))


def test_buffer_info_reports_address_size_and_device():
    array = np.zeros((3, 5), np.float32)
    assert buffer_info(array, writable=True) == (array.ctypes.data, 60, "cpu")
    tensor = torch.zeros((2, 3), dtype=torch.float16)
    assert buffer_info(tensor, writable=False) == (tensor.data_ptr(), 12, "cpu")


def test_storage_keeps_the_callers_memory_alive(rng):
    layout = BlockLayout.contiguous(64)
    data = rng.integers(0, 256, (3, 64), dtype=np.uint8)
    expected = data.copy()
    storage = buffer_storage(data, layout)
    del data  # only the storage holds the array now
    junk = [np.full((3, 64), 7, np.uint8) for _ in range(50)]  # allocations that would reuse freed memory
    for slot in range(3):
        assert np.array_equal(_bytes_at(storage.fragment_addresses([slot])[0, 0], 64), expected[slot])
    assert len(junk) == 50
