"""What ``kvtier doctor`` reports, one ``Check`` per thing it looked at, and what it gives a medium's own
checks of a tier (``Medium.doctor``, ``Medium.doctor_space``): here, below the tiers, so that each
medium's checks live in its own package, call what its tier calls at start, and the doctor
(``kvtier.doctor``) names no medium but host memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtier.core.config import StackConfig, capacity_in_blocks
from kvtier.core.errors import ConfigError
from kvtier.core.sealing import SealingSettings
from kvtier.core.tier_config import TierConfigBase


@dataclass(frozen=True)
class Check:
    """One thing the doctor looked at: whether it would work, in words, and the figures behind that."""

    name: str
    ok: bool
    message: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DoctorRequest:
    """Tier ``index`` of ``stack``, as the doctor asks its medium to check it: for a standalone stack
    (``engine_ranks`` None) or under an engine whose ``engine_ranks`` ranks each open their own storage
    of it. A check opens nothing for good: nothing is created, locked or written."""

    stack: StackConfig
    index: int
    engine_ranks: int | None

    @property
    def config(self) -> TierConfigBase:
        return self.stack.tiers[self.index]

    @property
    def label(self) -> str:
        """How a check's name calls the tier: ``tiers[1] (disk)``."""
        return f"tiers[{self.index}] ({self.stack.tier_name(self.index)})"

    def tier_bytes(self) -> int | None:
        """Bytes the tier takes: its blocks times what one takes there; where the block size is the
        engine's (no ``block_bytes``), its byte ``capacity`` (at most that); None for ``capacity_blocks``
        without ``block_bytes``."""
        tier, block_bytes, header_room = self.config, self.stack.block_bytes, self.stack.header_room
        if block_bytes is None:
            return tier.capacity
        blocks = capacity_in_blocks(tier, block_bytes, header_room)
        return None if blocks is None else blocks * tier.footprint(block_bytes, header_room)


def sealing_secrets(request: DoctorRequest) -> list[Check]:
    """A sealing tier's secrets (``SealingSettings``: a disk or node tier's): set and long enough, the
    ``cryptography`` package there, as the tier reads them at start; nothing where it does not seal."""
    tier = request.config
    assert isinstance(tier, SealingSettings)
    if tier.encryption == "none":
        return []
    name = f"{request.label} secrets"
    try:
        tier.sealing()
    except ConfigError as exc:
        return [Check(name, False, str(exc))]
    return [Check(name, True, f"{tier.encryption_key_env} is set: blocks are sealed (aes-gcm)")]


def gib(n: int) -> str:
    """Bytes as the doctor's messages give sizes."""
    return f"{n / 2**30:.2f} GiB"
