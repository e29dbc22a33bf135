"""Counters a tier and a stack keep, so users can see where hits come from and how many bytes move."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class TierStats:
    """Per-tier counters; a tier updates them under its own lock."""

    committed: int = 0  # blocks that became readable
    aborted: int = 0  # reserved blocks released without being written (failed or cancelled writes)
    evicted: int = 0  # blocks dropped to make room (after demotion when write-back)
    demoted: int = 0  # blocks copied down to the next tier because they were pushed out of this one
    hits: int = 0  # blocks served from this tier by load()
    bytes_in: int = 0  # bytes written into this tier
    bytes_out: int = 0  # bytes read out of this tier
    read_errors: int = 0  # blocks dropped because they could not be read back intact
    damaged: int = 0  # records found damaged when the tier reopened its storage (disk)
    incompressible: int = 0  # blocks a compressing disk tier did not store: their payload outgrew the slot
    demotion_refused: int = 0  # victims dropped (not kept) because the tier below can never hold them
    declined: int = 0  # blocks not stored here because the eviction policy did not admit them
    policy_errors: int = 0  # times the eviction policy raised or broke its contract (the tier then ran on LRU)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
