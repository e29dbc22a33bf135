"""Block geometry of vLLM 0.33's KV cache, derived from ``kv_cache_config``, never from tensor shapes.

vLLM 0.33 allocates one flat buffer and hands each attention layer a view of it. Where layer ``l``
keeps block ``b`` is stated by the ``KVCacheTensor`` entries: ``offset + l * layer_stride +
b * block_stride`` bytes into the buffer, one page of ``page_size_bytes``. kvtier stores a block as
one fragment per layer (its page), back to back in host and disk slots, so the same block can be
copied into any other block id later. Views may subdivide a block into kernel blocks or order their
dimensions any way: the pages, not the view shapes, are what is copied.

A hybrid model has several KV cache groups (full attention, sliding window, Mamba state): each group
is a set of layers with its own block table, all groups' blocks drawn from one pool of block ids over
the same buffer. kvtier serves the attention groups (``served_groups``), each block of each group a
kvtier block of its own, and needs them to share one layout (the same pages per block) and block size;
it cannot serve a Mamba group's state, and says so (``state_groups``). vLLM's blocks of every served
group are one storage (``kv_cache_storage``): slot ``g * num_blocks + b`` is block ``b`` of served group
``g``. Groups may differ in tokens per block (vLLM picks block sizes that give every group the same
page): kvtier keys blocks by the largest size all of them are multiples of (``block_tokens``), and a
group's block by the key where it ends (``ServedGroup.keys_per_block``), as vLLM's own offloading does;
``GroupKeys`` is that arithmetic, for every part of the scheduler side.

How many such blocks each kvtier tier holds (``tier_slots``) is geometry too: the scheduler side and
every worker derive it here, so they agree on every tier's slot count. Nothing here imports vLLM
(the worker side runs without it); ``kv_cache_config`` is read by its fields, and a spec's kind by
the names of its classes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from kvtier.core.config import StackConfig, capacity_in_blocks
from kvtier.core.devices import HOST
from kvtier.core.errors import ConfigError
from kvtier.core.layout import BlockLayout
from kvtier.core.media import medium
from kvtier.core.storage import BlockStorage, GroupedStorage, StridedStorage
from kvtier.tiers.gpu import device_storage

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


class ServedGroup(NamedTuple):
    """A KV cache group kvtier stores and loads: its index in ``kv_cache_groups``, for a sliding window
    how many of its blocks before a hit's end its layers need (the rest of the prefix is not kept), and
    how many kvtier keys (``block_tokens`` each) one of its blocks spans."""

    vllm_index: int
    window_blocks: int | None = None
    keys_per_block: int = 1


class GroupKeys:
    """Where each served group's blocks lie among a request's keys and among vLLM's block ids: the
    arithmetic the scheduler side's lookup, loads, stores, fence and events share, said once.

    Keys are ``block_tokens`` apart; a group whose blocks span ``keys_per_block`` keys has a block
    every that many keys, keyed where it ends (``group_key``: the chain key, tagged with the group where
    there are several). A hit ends on every group's block boundary (``hit_keys``); it needs every
    full-attention group's blocks from its start and a sliding-window group's only within the window
    before its end (``window_start``). A group's vLLM block ``b`` is GPU slot ``g * gpu_blocks + b``
    (``kv_cache_storage``)."""

    def __init__(self, groups: Sequence[ServedGroup], block_tokens: int, gpu_blocks: int) -> None:
        self.groups = list(groups)
        self.block_tokens = block_tokens
        self.gpu_blocks = gpu_blocks  # vLLM's blocks per group
        self.full_groups = [p for p, g in enumerate(self.groups) if g.window_blocks is None]
        self.windowed = len(self.full_groups) < len(self.groups)
        self.keys_per_block = [g.keys_per_block for g in self.groups]
        self.uniform = all(m == 1 for m in self.keys_per_block)  # every group's block is one key
        self.hit_keys = math.lcm(*self.keys_per_block)  # a hit ends on a block boundary of every group

    def group_key(self, key: bytes, group: int) -> bytes:
        """The key of a block of served group ``group``: the chain key, tagged when there are several groups."""
        return key if len(self.groups) == 1 else key + group.to_bytes(2, "big")

    def group_keys(self, keys: list[bytes], start: int, end: int, groups: Iterable[int]) -> list[bytes]:
        """The blocks of these served groups that end within keys ``start`` to ``end``, in key order."""
        groups = list(groups)
        if groups == [0] and len(self.groups) == 1:
            return keys[start:end]
        return [self.group_key(keys[i], p) for i, p in self.ends(start, end, groups)]

    def ends(self, start: int, end: int, groups: Iterable[int]) -> list[tuple[int, int]]:
        """(key index, served group) of each block of these groups that ends within keys ``start`` to
        ``end``, in key order (every key ends a block of a group whose blocks are one key)."""
        groups = list(groups)
        if self.uniform:
            return [(i, p) for i in range(start, end) for p in groups]
        return [(i, p) for i in range(start, end) for p in groups if (i + 1) % self.keys_per_block[p] == 0]

    def needed(self, keys: list[bytes], start: int, end: int) -> list[bytes]:
        """The blocks a hit from ``start`` to ``end`` loads, in key order, group by group."""
        if self.uniform:  # (every lookup of a windowed model: block i of each group ends at key i)
            return [
                self.group_key(keys[i], p)
                for i in range(start, end)
                for p, group in enumerate(self.groups)
                if group.window_blocks is None or i >= end - group.window_blocks
            ]
        return [
            self.group_key(keys[i], p)
            for i, p in self.ends(start, end, range(len(self.groups)))
            if self.table_index(i, p) >= self.window_start(p, end)
        ]

    def window_start(self, group: int, end: int) -> int:
        """The first of served group ``group``'s blocks a hit ending at key ``end`` needs (0: all of them)."""
        window = self.groups[group].window_blocks
        return 0 if window is None else end // self.keys_per_block[group] - window

    def table_index(self, i: int, group: int) -> int:
        """Which of served group ``group``'s blocks ends at key ``i`` (its index in the block table)."""
        return (i + 1) // self.keys_per_block[group] - 1

    def gpu_slot(self, group: int, block_id: int) -> int:
        """The GPU slot of vLLM's block ``block_id`` of served group ``group`` (``kv_cache_storage``)."""
        return group * self.gpu_blocks + block_id

    def block_id(self, gpu_slot: int) -> int:
        """vLLM's block id of a GPU slot: what vLLM allocates and frees, whatever the group."""
        return gpu_slot % self.gpu_blocks if self.gpu_blocks else gpu_slot

    def tokens_of(self, key: bytes) -> int:
        """Tokens in the block a key names: its group's block size (the key's tag names the group)."""
        if self.uniform:
            return self.block_tokens
        return self.block_tokens * self.keys_per_block[int.from_bytes(key[-2:], "big")]


STATE_SPECS = {"MambaSpec"}
"""Specs whose blocks are a recurrent state at one position, not KV per token: kvtier cannot serve them."""
_SERVED_SPECS = {"FullAttentionSpec", "SlidingWindowSpec"}  # and their subclasses (MLA, sliding-window MLA)


def _spec_kinds(spec: Any) -> set[str]:
    return {cls.__name__ for cls in type(spec).__mro__}


def served_groups(kv_cache_config: KVCacheConfig) -> list[ServedGroup]:
    """The attention groups kvtier serves, in vLLM's order. Raises ConfigError for a group of a kind it
    cannot serve correctly (chunked local attention, ...) and for served groups that differ in pages
    per block (kvtier blocks of one stack all have one size)."""
    served = []
    key_tokens = block_tokens(kv_cache_config)
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        kinds = _spec_kinds(spec)
        if kinds & STATE_SPECS:
            continue
        keys = spec.block_size // key_tokens if key_tokens else 1
        if "SlidingWindowSpec" in kinds:  # a hit's end needs the blocks of its last window - 1 (+ retained) tokens
            reach = getattr(spec, "sliding_window", 0) - 1 + (getattr(spec, "extra_retained_tokens", 0) or 0)
            served.append(ServedGroup(index, -(-reach // spec.block_size), keys))
        elif kinds & _SERVED_SPECS or not hasattr(spec, "block_size"):  # (tests without vLLM: plain attention)
            served.append(ServedGroup(index, None, keys))
        else:
            raise ConfigError(
                f"KV cache group {index} ({type(spec).__name__}) is of a kind kvtier cannot serve; "
                f"it serves full attention, sliding windows and MLA"
            )
    if not served:
        raise ConfigError("the model has no attention KV cache group for kvtier to serve")
    groups = [kv_cache_config.kv_cache_groups[g.vllm_index] for g in served]
    shapes = {(g.kv_cache_spec.page_size_bytes, len(g.layer_names)) for g in groups}
    if len(shapes) > 1:
        raise ConfigError(
            f"kvtier needs every attention group to have the same pages per block; this model's "
            f"groups have (page bytes, layers) {sorted(shapes)}"
        )
    return served


def _attention_block_sizes(kv_cache_config: KVCacheConfig) -> list[int]:
    return [
        g.kv_cache_spec.block_size
        for g in kv_cache_config.kv_cache_groups
        if not _spec_kinds(g.kv_cache_spec) & STATE_SPECS and hasattr(g.kv_cache_spec, "block_size")
    ]


def block_tokens(kv_cache_config: KVCacheConfig) -> int | None:
    """Tokens per kvtier key: the largest size every attention group's block size is a multiple of
    (their block size when they share one); None when unstated."""
    sizes = _attention_block_sizes(kv_cache_config)
    return math.gcd(*sizes) if sizes else None


def replicated(kv_cache_config: KVCacheConfig) -> bool:
    """Whether every tensor-parallel rank holds the same KV (MLA: one latent vector per token, not split
    across ranks; vLLM says how many ranks hold each copy in ``kv_tp_replicas``)."""
    groups = kv_cache_config.kv_cache_groups
    return getattr(kv_cache_config, "kv_tp_replicas", 1) > 1 and all(
        "MLAAttentionSpec" in _spec_kinds(groups[g.vllm_index].kv_cache_spec) for g in served_groups(kv_cache_config)
    )


def state_groups(kv_cache_config: KVCacheConfig) -> list[int]:
    """Indices of the groups that hold a recurrent state (Mamba): with one, no prefix hit kvtier could
    load is whole, since the state at the hit's end is not a kvtier block."""
    return [
        i for i, group in enumerate(kv_cache_config.kv_cache_groups) if _spec_kinds(group.kv_cache_spec) & STATE_SPECS
    ]


def _page(kv_cache_config: KVCacheConfig, group: ServedGroup) -> int:
    return kv_cache_config.kv_cache_groups[group.vllm_index].kv_cache_spec.page_size_bytes


def _placements(kv_cache_config: KVCacheConfig, group: ServedGroup) -> list[tuple[str, int, int]]:
    """(layer name, byte offset of its block 0 in the buffer, block stride) for every layer of the
    group, in order."""
    layers = set(kv_cache_config.kv_cache_groups[group.vllm_index].layer_names)
    out = []
    for tensor in kv_cache_config.kv_cache_tensors:
        for index, name in enumerate(tensor.layers):
            if name in layers:
                out.append((name, tensor.offset + index * tensor.layer_stride, tensor.block_stride))
    if {name for name, _, _ in out} != layers:
        raise ConfigError(
            f"kv_cache_config places layers {sorted({n for n, _, _ in out})} but the group has {sorted(layers)}"
        )
    return out


def _check_pages_contiguous(kv_cache_config: KVCacheConfig) -> None:
    """A page must be one run of bytes: true when layer and block are the outermost dimensions, the
    first two letters of vLLM's layout name (``KVCacheLayout.is_block_compact``)."""
    layout = kv_cache_config.kv_cache_layout
    if layout is None:
        return
    name = {"NHD": "LBNHC", "HND": "LBHNC"}.get(layout, layout)  # the older names vLLM still accepts
    if set(name[:2]) != {"L", "B"}:
        raise ConfigError(
            f"KV cache layout {name} interleaves other dimensions between blocks; kvtier needs "
            f"a layout whose layer and block dimensions are outermost (LBHNC, LBNHC, BLHNC, BLNHC)"
        )


def block_layout(kv_cache_config: KVCacheConfig) -> BlockLayout:
    """One fragment per layer of a served group (its page of one block); ``block_bytes`` is what one
    rank stores per block of one group."""
    group = served_groups(kv_cache_config)[0]
    _check_pages_contiguous(kv_cache_config)
    return BlockLayout((_page(kv_cache_config, group),) * len(_placements(kv_cache_config, group)))


def kv_cache_storage(kv_caches: dict[str, Any], kv_cache_config: KVCacheConfig) -> BlockStorage:
    """vLLM's KV blocks as a storage: slot ``g * num_blocks + b`` is vLLM's block ``b`` of served group
    ``g`` (with one group, slot ids are vLLM's block ids)."""
    parts = [_group_storage(kv_caches, kv_cache_config, group) for group in served_groups(kv_cache_config)]
    return parts[0] if len(parts) == 1 else GroupedStorage(parts)


def _group_storage(kv_caches: dict[str, Any], kv_cache_config: KVCacheConfig, group: ServedGroup) -> StridedStorage:
    """One group's blocks: each layer's pages addressed through a byte view of the shared buffer (block
    dimension first, one page per row), built from the ``KVCacheTensor`` placement; the layer's own view
    must start where that placement says, which catches a buffer that is not what ``kv_cache_config``
    describes."""
    import torch

    layout = block_layout(kv_cache_config)
    page = layout.fragment_bytes[0]
    num_blocks = kv_cache_config.num_blocks
    views = []
    for name, offset, block_stride in _placements(kv_cache_config, group):
        if name not in kv_caches:
            raise ConfigError(f"vLLM registered no KV cache tensor for layer {name!r}")
        tensor = kv_caches[name]
        storage = tensor.untyped_storage()
        if tensor.data_ptr() != storage.data_ptr() + offset:
            raise ConfigError(
                f"layer {name!r}: its KV view starts {tensor.data_ptr() - storage.data_ptr()} bytes "
                f"into the buffer, kv_cache_config places it at {offset}"
            )
        if offset + (num_blocks - 1) * block_stride + page > storage.nbytes():
            raise ConfigError(
                f"layer {name!r}: {num_blocks} blocks of {block_stride} bytes do not fit its "
                f"{storage.nbytes()}-byte buffer"
            )
        raw = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
        views.append(torch.as_strided(raw, (num_blocks, page), (block_stride, 1), offset))
    return device_storage(views, layout)


def tier_slots(config: StackConfig, block_bytes: int) -> list[tuple[str, str, int]]:
    """(name, medium, number of slots) of every tier of slots kvtier keeps under vLLM, fastest first (the
    GPU is vLLM's own; a keyed store has no slots); ``block_bytes`` is one rank's share of a vLLM block."""
    out: list[tuple[str, str, int]] = []
    for i, tier_cfg in enumerate(config.tiers):
        if tier_cfg.keyed or medium(tier_cfg.medium).rank_storage is None:
            continue
        blocks = capacity_in_blocks(tier_cfg, block_bytes, config.header_room)
        if blocks is None or blocks < 1:
            raise ConfigError(
                f"tiers[{i}] ({config.tier_name(i)}): capacity holds no block of {block_bytes} "
                f"bytes (one rank's share of a vLLM block)"
            )
        out.append((config.tier_name(i), tier_cfg.medium, blocks))
    if not out or out[0][1] != HOST:
        raise ConfigError(
            "under vLLM the first tier below the GPU must be a host tier (disk blocks are loaded through host memory)"
        )
    return out
