"""Disk blocks kept across a restart under vLLM: which ones every rank's slab still holds.

Each rank writes its shard of every block into its own slab (``rank_directory``), at the slot the
scheduler side chose, the same on every rank. After a restart the scheduler side (another process
than the workers, which own the slabs and their locks) reads the slot headers without locking or
writing anything, and keeps a block only where EVERY rank holds a valid header for it, under this
engine's namespace and geometry, at the same slot: a load needs every rank's shard. Every other
slot is free to the scheduler; the workers clear its old header before anything is written there,
as they do for every slot whose header they found at open (``DiskSlab.scan``).

Reading headers is not trusting bytes: every load still checks its slot's header and checksum on
every rank, and a block that fails is reported for recomputation. Nor is it trusting the directory:
a rank directory or slab that fails the workers' own ownership and mode checks (``shared_directory``
as configured) yields no blocks, with a warning.
"""

from __future__ import annotations

from kvtier.core.config import DiskTierConfig
from kvtier.core.layout import BlockLayout
from kvtier.tiers.disk import rank_directory, read_block_headers


def blocks_on_every_rank(
    tier_cfg: DiskTierConfig, num_ranks: int, num_slots: int, layout: BlockLayout, namespace: str
) -> list[tuple[bytes, int]]:
    """(key, slot) of the blocks every rank's slab holds at the same slot, oldest write first (the
    order ``Tier.restore`` wants). Where several slots hold one key on every rank, the newest
    (highest sequence on rank 0) is kept; the others are left to be reused."""
    ranks = [
        read_block_headers(
            rank_directory(tier_cfg.path, rank),
            num_slots,
            layout,
            namespace,
            tier_cfg.compression,
            tier_cfg.slot_bytes,
            tier_cfg.shared_directory,
        )
        for rank in range(num_ranks)
    ]
    first, others = ranks[0], ranks[1:]
    newest: dict[bytes, tuple[int, int]] = {}  # key -> (sequence on rank 0, slot)
    for slot, header in first.items():
        if not all(slot in other and other[slot].key == header.key for other in others):
            continue
        if header.key not in newest or newest[header.key][0] < header.sequence:
            newest[header.key] = (header.sequence, slot)
    return [(key, slot) for key, (_, slot) in sorted(newest.items(), key=lambda item: item[1])]
