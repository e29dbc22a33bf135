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
