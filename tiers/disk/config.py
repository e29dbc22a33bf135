"""The disk tier's YAML schema (``medium: disk``): where its slab lives, how it is opened (O_DIRECT, a
shared directory, a file that is not a slab), and how its blocks are packed (compression, slot size)
and sealed; a slot's footprint and a slot size that cannot work follow the slots' geometry (``slots``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from kvtier.core.config_messages import Problems
from kvtier.core.sealing import SealingSettings
from kvtier.core.sizes import Size, format_size
from kvtier.core.tier_config import ProblemList, SizedTierConfig, StackShape
from kvtier.tiers.disk.slots import slot_problem, slot_stride


class DiskTierConfig(SealingSettings, SizedTierConfig):
    """A local directory holding a preallocated slab file that survives restarts.

    ``compression`` trades CPU for capacity: each block gets ``slot_bytes`` of room on disk instead of
    ``block_bytes`` (see ``slots.slot_room`` for the default), so a byte ``capacity`` holds
    more blocks; blocks that do not compress into that room are not stored.
    """

    medium: Literal["disk"]
    path: str = Field(min_length=1)
    o_direct: Literal["auto", "on", "off"] = "auto"
    compression: Literal["none", "lz4", "zstd"] = "none"
    slot_bytes: Size | None = None
    # Trust: by default the directory and slab must be the running user's and writable by nobody else.
    # True accepts a directory a group of services shares on purpose (docs/security.md): every user who
    # can write it can then plant blocks that this tier loads.
    shared_directory: bool = False
    # True lets the tier overwrite a file named like its slab that is not a kvtier slab; by default that
    # is an error, so a mistyped path never destroys someone's data.
    reinitialise: bool = False

    @field_validator("slot_bytes")
    @classmethod
    def _at_least_a_page(cls, value: int | None) -> int | None:
        if value is not None and value < 4096:
            raise ValueError(f"{format_size(value)} ({value} bytes) is less than 4KiB, the smallest slot")
        return value

    def footprint(self, block_bytes: int, header_room: int = 0) -> int:
        """A slot: a 4 KiB header and ``slot_bytes`` of room, which compression makes smaller than the block."""
        return slot_stride(block_bytes, self.compression, self.slot_bytes)

    @model_validator(mode="after")
    def _sealing(self) -> DiskTierConfig:
        problems = self.sealing_problems()
        if problems:
            raise Problems(problems)
        return self

    def stack_problems(self, stack: StackShape, i: int) -> ProblemList:
        if stack.block_bytes is None:
            return []
        problem = slot_problem(stack.block_bytes, self.compression, self.slot_bytes)
        return [] if problem is None else [(("slot_bytes",), problem)]
