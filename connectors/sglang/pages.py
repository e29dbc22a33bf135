"""SGLang's host pool pages as kvtier blocks: one block per page, its bytes in the pool's own memory.

SGLang's host pool (``HostKVCache``: MHA, MLA, any ``hicache_mem_layout``) shows one page as a strided
view of its ``kv_buffer`` (``get_data_page(index, flat=False)``): per layer and K/V in ``layer_first``,
one K and one V run in ``page_first``. The block's bytes are that view's elements in order, which is
exactly the flat page SGLang's generic storage path hands a backend (``get_data_page(flat=True)``), so
a page stored through the zero-copy path (``batch_set_v1``) and one stored through the generic path
(``batch_set``) are the same block and serve each other.

The view's contiguous runs are the block's fragments, and page ``p``'s fragments lie at page 0's plus
``p`` times the distance between two pages: a ``StridedStorage`` whose slot is the page index. kvtier's
transfers then read and write the pages in place, with no copy besides the one into or out of a tier,
whatever the layout. This is what ``get_page_buffer_meta`` gives SGLang's own zero-copy backends, in
flat-page order and for every layout that has a strided page view (MLA's ``layer_first`` included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.core.devices import HOST_DEVICE
from kvtier.core.errors import ConfigError
from kvtier.core.layout import BlockLayout
from kvtier.core.storage import StridedStorage


@dataclass(frozen=True)
class PageGeometry:
    """The pages of one host pool: their block layout, and the pool's memory as a storage of pages."""

    layout: BlockLayout
    storage: StridedStorage
    page_tokens: int
    page_shape: tuple[int, ...]  # the page view's shape: layers, heads and head size, in the pool's order


def page_geometry(host_pool: Any) -> PageGeometry:
    """Pages of ``host_pool`` as kvtier blocks; raises ConfigError for a pool whose pages are not strided
    views of one buffer (a layout SGLang builds from several tensors, a page it must copy to show)."""
    page_tokens = int(host_pool.page_size)
    num_pages = int(host_pool.size) // page_tokens
    if num_pages < 2:
        raise ConfigError(f"SGLang's host pool holds {num_pages} page(s); kvtier needs at least two")
    what = f"SGLang's host pool ({type(host_pool).__name__}, layout {host_pool.layout})"
    try:
        first, second = (host_pool.get_data_page(p * page_tokens, flat=False) for p in (0, 1))
    except (ValueError, NotImplementedError, AttributeError) as exc:
        raise ConfigError(f"{what} shows no page kvtier can address: {exc}") from None
    buffer = host_pool.kv_buffer
    runs = _runs(first)
    page_bytes = second.data_ptr() - first.data_ptr()
    if (tuple(second.shape), second.stride()) != (tuple(first.shape), first.stride()) or page_bytes <= 0:
        raise ConfigError(f"{what}: its pages are not views of one shape at a fixed distance")
    start, end = _extent(buffer)
    bases = first.data_ptr() + np.array([offset for offset, _ in runs], dtype=np.int64)
    last = bases + (num_pages - 1) * page_bytes + np.array([size for _, size in runs], dtype=np.int64)
    if first.device.type != "cpu" or bases.min() < start or last.max() > end:
        raise ConfigError(f"{what}: its pages do not lie in its host buffer")
    layout = BlockLayout(tuple(size for _, size in runs))
    storage = StridedStorage(
        layout, num_pages, bases, [page_bytes] * layout.num_fragments, HOST_DEVICE, keepalive=buffer
    )
    return PageGeometry(layout, storage, page_tokens, tuple(first.shape))


def _runs(view: Any) -> list[tuple[int, int]]:
    """The view's bytes in element order as (offset from its first element, size) runs: the innermost
    dimensions that are contiguous make one run, the outer ones repeat it; runs that follow on in
    memory are merged."""
    shape, strides, itemsize = list(view.shape), list(view.stride()), view.element_size()
    run, inner = 1, len(shape)
    while inner and (shape[inner - 1] == 1 or strides[inner - 1] == run):
        run *= shape[inner - 1]
        inner -= 1
    outer = shape[:inner]
    starts = (
        np.indices(outer).reshape(inner, -1).T @ np.asarray(strides[:inner], dtype=np.int64)
        if inner
        else np.zeros(1, dtype=np.int64)
    )
    merged: list[tuple[int, int]] = []
    for offset in (starts * itemsize).tolist():
        if merged and sum(merged[-1]) == offset:
            merged[-1] = (merged[-1][0], merged[-1][1] + run * itemsize)
        else:
            merged.append((offset, run * itemsize))
    return merged


def _extent(buffer: Any) -> tuple[int, int]:
    """The addresses of the memory behind ``buffer`` (its whole storage, not only the view)."""
    storage = buffer.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def page_slots(host_indices: Any, page_tokens: int, num_pages: int) -> list[int]:
    """The pages SGLang's token indices name (one run of ``page_tokens`` consecutive, page-aligned
    indices per page, as its page allocator hands them out); raises ValueError for anything else, so a
    batch that would read or write memory of other pages is refused whole."""
    indices = np.asarray(host_indices.cpu() if hasattr(host_indices, "cpu") else host_indices, dtype=np.int64)
    if indices.ndim != 1 or indices.size % page_tokens:
        raise ValueError(f"{indices.size} host indices are not whole pages of {page_tokens} tokens")
    pages = indices.reshape(-1, page_tokens)
    first = pages[:, 0]
    if (first % page_tokens).any() or (pages != first[:, None] + np.arange(page_tokens)).any():
        raise ValueError("host indices are not whole, page-aligned pages")
    if first.size and (first.min() < 0 or first.max() // page_tokens >= num_pages):
        raise ValueError(f"host indices name pages outside the host pool's {num_pages}")
    return (first // page_tokens).tolist()
