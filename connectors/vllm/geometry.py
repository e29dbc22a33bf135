"""Block geometry of vLLM 0.33's KV cache, derived from ``kv_cache_config``, never from tensor shapes.

vLLM 0.33 allocates one flat buffer and hands each attention layer a view of it. Where layer ``l``
keeps block ``b`` is stated by the ``KVCacheTensor`` entries: ``offset + l * layer_stride +
b * block_stride`` bytes into the buffer, one page of ``page_size_bytes``. kvtier stores a block as
one fragment per layer (its page), back to back in host and disk slots, so the same block can be
copied into any other block id later. Views may subdivide a block into kernel blocks or order their
dimensions any way: the pages, not the view shapes, are what is copied.

How many such blocks each kvtier tier holds (``tier_slots``) is geometry too: the scheduler side and
every worker derive it here, so they agree on every tier's slot count. Nothing here imports vLLM
(the worker side runs without it); ``kv_cache_config`` is read by its fields.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier.core.config import StackConfig, capacity_in_blocks
from kvtier.core.errors import ConfigError
from kvtier.core.layout import BlockLayout
from kvtier.core.storage import StridedStorage
from kvtier.tiers.gpu import device_storage

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


def _group(kv_cache_config: KVCacheConfig):
    """The one KV cache group kvtier serves; models with several groups (hybrid attention) are refused."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(f"kvtier serves models with one KV cache group (full attention); this model has "
                          f"{len(groups)} groups: {[type(g.kv_cache_spec).__name__ for g in groups]}")
    return groups[0]


def _placements(kv_cache_config: KVCacheConfig) -> list[tuple[str, int, int]]:
    """(layer name, byte offset of its block 0 in the buffer, block stride) for every layer, in order."""
    layers = set(_group(kv_cache_config).layer_names)
    out = []
    for tensor in kv_cache_config.kv_cache_tensors:
        for index, name in enumerate(tensor.layers):
            if name in layers:
                out.append((name, tensor.offset + index * tensor.layer_stride, tensor.block_stride))
    if {name for name, _, _ in out} != layers:
        raise ConfigError(f"kv_cache_config places layers {sorted({n for n, _, _ in out})} but the group "
                          f"has {sorted(layers)}")
    return out


def _check_pages_contiguous(kv_cache_config: KVCacheConfig) -> None:
    """A page must be one run of bytes: true when layer and block are the outermost dimensions, the
    first two letters of vLLM's layout name (``KVCacheLayout.is_block_compact``)."""
    layout = kv_cache_config.kv_cache_layout
    if layout is None:
        return
    name = {"NHD": "LBNHC", "HND": "LBHNC"}.get(layout, layout)  # the older names vLLM still accepts
    if set(name[:2]) != {"L", "B"}:
        raise ConfigError(f"KV cache layout {name} interleaves other dimensions between blocks; kvtier needs "
                          f"a layout whose layer and block dimensions are outermost (LBHNC, LBNHC, BLHNC, BLNHC)")


def block_layout(kv_cache_config: KVCacheConfig) -> BlockLayout:
    """One fragment per layer (its page of one block); ``block_bytes`` is what one rank stores per block."""
    page = _group(kv_cache_config).kv_cache_spec.page_size_bytes
    _check_pages_contiguous(kv_cache_config)
    return BlockLayout((page,) * len(_placements(kv_cache_config)))


def kv_cache_storage(kv_caches: dict[str, Any], kv_cache_config: KVCacheConfig) -> StridedStorage:
    """vLLM's KV blocks as a storage whose slot ids are vLLM's block ids.

    Each layer's pages are addressed through a byte view of the shared buffer (block dimension first,
    one page per row), built from the ``KVCacheTensor`` placement; the layer's own view must start
    where that placement says, which catches a buffer that is not what ``kv_cache_config`` describes.
    """
    import torch

    layout = block_layout(kv_cache_config)
    page = layout.fragment_bytes[0]
    num_blocks = kv_cache_config.num_blocks
    views = []
    for name, offset, block_stride in _placements(kv_cache_config):
        if name not in kv_caches:
            raise ConfigError(f"vLLM registered no KV cache tensor for layer {name!r}")
        tensor = kv_caches[name]
        storage = tensor.untyped_storage()
        if tensor.data_ptr() != storage.data_ptr() + offset:
            raise ConfigError(f"layer {name!r}: its KV view starts {tensor.data_ptr() - storage.data_ptr()} bytes "
                              f"into the buffer, kv_cache_config places it at {offset}")
        if offset + (num_blocks - 1) * block_stride + page > storage.nbytes():
            raise ConfigError(f"layer {name!r}: {num_blocks} blocks of {block_stride} bytes do not fit its "
                              f"{storage.nbytes()}-byte buffer")
        raw = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
        views.append(torch.as_strided(raw, (num_blocks, page), (block_stride, 1), offset))
    return device_storage(views, layout)


def tier_slots(config: StackConfig, block_bytes: int) -> list[tuple[str, str, int]]:
    """(name, medium, number of slots) of every tier of slots kvtier keeps under vLLM, fastest first (the
    GPU is vLLM's own; a remote store has no slots); ``block_bytes`` is one rank's share of a vLLM block."""
    out: list[tuple[str, str, int]] = []
    for i, tier_cfg in enumerate(config.tiers):
        if tier_cfg.medium in ("gpu", "remote"):
            continue
        blocks = capacity_in_blocks(tier_cfg, block_bytes, config.header_room)
        if blocks is None or blocks < 1:
            raise ConfigError(f"tiers[{i}] ({config.tier_name(i)}): capacity holds no block of {block_bytes} "
                              f"bytes (one rank's share of a vLLM block)")
        out.append((config.tier_name(i), tier_cfg.medium, blocks))
    if not out or out[0][1] != "host":
        raise ConfigError("under vLLM the first tier below the GPU must be a host tier (disk blocks are loaded "
                          "through host memory)")
    return out
