"""Byte geometry of one KV block.

A block is an ordered list of fragments (per layer, K and V split or packed). Host and disk tiers
keep a block as one contiguous run of ``block_bytes`` with the fragments back to back in this order;
a device tier may keep each fragment in a different tensor. Two storages can exchange a block when
their layouts have the same fragment sizes, which is what makes a gather from per-layer GPU tensors
into one contiguous host slot a plain list of copies.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BlockLayout:
    """Fragment sizes of one block, in bytes, in the order they are laid out in a contiguous slot."""

    fragment_bytes: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.fragment_bytes:
            raise ValueError("a block layout needs at least one fragment")
        if any(int(n) <= 0 for n in self.fragment_bytes):
            raise ValueError(f"fragment sizes must be positive, got {self.fragment_bytes}")
        object.__setattr__(self, "fragment_bytes", tuple(int(n) for n in self.fragment_bytes))

    @classmethod
    def contiguous(cls, block_bytes: int) -> BlockLayout:
        """A block that is a single run of bytes."""
        return cls((block_bytes,))

    @classmethod
    def per_layer(cls, num_layers: int, fragment_bytes: int, kv_split: bool = False) -> BlockLayout:
        """One fragment per layer, or two (K then V) when ``kv_split``."""
        per_layer = (fragment_bytes, fragment_bytes) if kv_split else (fragment_bytes,)
        return cls(per_layer * num_layers)

    @property
    def num_fragments(self) -> int:
        return len(self.fragment_bytes)

    @property
    def block_bytes(self) -> int:
        return sum(self.fragment_bytes)

    @functools.cached_property
    def offsets(self) -> np.ndarray:
        """Offset of each fragment inside a contiguous slot (read-only: computed once, every transfer
        addressing a slot asks)."""
        offsets = np.concatenate(([0], np.cumsum(self.sizes)[:-1])).astype(np.int64)
        offsets.flags.writeable = False
        return offsets

    @functools.cached_property
    def sizes(self) -> np.ndarray:
        """Each fragment's size (read-only)."""
        sizes = np.asarray(self.fragment_bytes, dtype=np.int64)
        sizes.flags.writeable = False
        return sizes
