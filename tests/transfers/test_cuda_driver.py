"""The parts of the CUDA backend that run without a GPU: the kernel's copy table and the refusals."""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from kvtier.core.errors import TransferError
from kvtier.transfers.cuda import CUDABackend, cuda_available
from kvtier.transfers.cuda_driver import BatchCopy, chunk_copies


@given(st.lists(st.integers(1, 300_000), min_size=1, max_size=40), st.sampled_from([16, 4096, 65536]))
def test_chunked_table_covers_every_byte_once_in_pieces_no_larger_than_a_chunk(sizes, chunk):
    size = np.asarray(sizes, dtype=np.int64)
    src = np.cumsum(np.concatenate(([1 << 20], size[:-1] + 7)))  # gaps between copies
    dst = np.cumsum(np.concatenate(([1 << 40], size[:-1] + 4096)))
    table = chunk_copies(src, dst, size, chunk)
    count = len(table) // 3
    piece_src, piece_dst, piece_size = table[:count], table[count : 2 * count], table[2 * count :]
    assert table.dtype == np.uint64 and len(table) == 3 * count
    assert (piece_size >= 1).all() and (piece_size <= chunk).all()
    assert int(piece_size.sum()) == int(size.sum())
    # pieces of copy i tile [src_i, src_i + size_i) in order, with the same offsets on the destination
    want_src = np.concatenate([np.arange(s, s + n, chunk) for s, n in zip(src, size, strict=True)])
    want_dst = np.concatenate([np.arange(d, d + n, chunk) for d, n in zip(dst, size, strict=True)])
    assert np.array_equal(piece_src, want_src.astype(np.uint64))
    assert np.array_equal(piece_dst, want_dst.astype(np.uint64))


def test_batch_copy_is_unavailable_without_a_cuda_driver():
    if cuda_available():
        pytest.skip("this machine has CUDA")
    assert BatchCopy().available is False


def test_cuda_backend_refuses_to_start_without_cuda():
    if cuda_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(TransferError, match="needs CuPy and a CUDA device"):
        CUDABackend()


def test_cuda_backend_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="mode must be one of"):
        CUDABackend("fast")


@pytest.mark.parametrize(
    ("blocks", "first", "step", "want"), [(10, 2, 3, [2, 3, 3, 2]), (2, 2, 3, [2]), (7, 1, 6, [1, 6])]
)
def test_a_job_goes_out_in_a_short_first_piece_then_longer_ones(monkeypatch, blocks, first, step, want):
    import kvtier.transfers.cuda as cuda_transfer
    from kvtier.core.layout import BlockLayout
    from kvtier.core.storage import StridedStorage
    from kvtier.core.transfer import Transfer

    layout = BlockLayout.contiguous(4096)
    monkeypatch.setattr(cuda_transfer, "FIRST_SLICE_BYTES", first * 4096)
    monkeypatch.setattr(cuda_transfer, "SLICE_BYTES", step * 4096)
    storage = StridedStorage(layout, 16, [1 << 20], [4096])
    src, dst = list(range(blocks)), list(range(15, 15 - blocks, -1))
    pieces = list(CUDABackend._slices(Transfer(storage, src, storage, dst)))
    assert [p.num_blocks for _, p in pieces] == want
    assert [first for first, _ in pieces] == [sum(want[:i]) for i in range(len(want))]
    assert [s for _, p in pieces for s in p.src_slots] == src and [s for _, p in pieces for s in p.dst_slots] == dst
