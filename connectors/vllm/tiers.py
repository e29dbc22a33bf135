"""The scheduler side's tiers, built from the configuration: an index per tier, the job manager whose
fences they honour, the planner over them, and the blocks a previous engine left.

Why not ``kvtier.builder``: the builder builds tiers with their storage and the transfer backends
between them, a ``TierStack`` that runs its own copies. Under vLLM the workers hold every byte and run
every copy, so the tiers here are indexes over slot counts (``SlotCount``), as many slots as every
worker derives (``geometry.tier_slots``), with no backend; the one step both take, a tier's policy and
watermark, is ``StackConfig.tier_policy`` already. A last tier addressed by key (a store shared with
other engines, ``tiers/remote``, or the machine's node daemon, ``tiers/node``) opens here as a client
of this side's own (``Medium.engine_tier``), never through the workers.

At start, each tier whose medium keeps blocks across a restart (``Medium.kept_blocks``: a disk tier's
slabs, from the index its last clean shutdown left or else from every rank's slot headers) takes them
back, putting them back into its index on a thread while the scheduler side already serves
(``recovery.py``); ``shutdown`` leaves the index again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvtier.connectors.vllm.geometry import tier_slots
from kvtier.connectors.vllm.recovery import ChunksBack
from kvtier.core.config import StackConfig
from kvtier.core.devices import Capabilities
from kvtier.core.errors import ConfigError
from kvtier.core.jobs import JobManager
from kvtier.core.layout import BlockLayout
from kvtier.core.media import EngineTierRequest, KeptBlocks, RestartRequest, medium
from kvtier.core.planner import Planner, SlotCount
from kvtier.core.tier import Tier
from kvtier.tiers.keyed import KeyedTier

log = logging.getLogger(__name__)


class SchedulerTiers:
    """Every tier below vLLM's GPU blocks as the scheduler side indexes it, fastest first, with the job
    manager and the planner over them. ``replicated`` KV (MLA) is one copy per block for all
    ``num_workers`` ranks (``geometry.replicated``)."""

    def __init__(
        self,
        config: StackConfig,
        layout: BlockLayout,
        namespace: bytes,
        num_workers: int,
        replicated: bool,
        capabilities: Capabilities,
    ) -> None:
        self.jobs = JobManager()
        position = {config.tier_name(j): j for j in range(len(config.tiers))}
        self.tiers: list[Tier] = []
        for name, kind, slots in tier_slots(config, layout.block_bytes):
            policy, watermark = config.tier_policy(position[name])
            self.tiers.append(Tier(name, kind, SlotCount(layout, slots), policy, watermark, self.jobs.is_fenced))
        self.keyed: KeyedTier | None = None  # the last tier, where it is addressed by key (remote, node)
        if config.tiers[-1].keyed:
            ranks: Sequence[int | None] = [None] if replicated else range(num_workers)
            self.keyed = _keyed_tier(config, layout, namespace, ranks)
            self.tiers.append(self.keyed)
        self.planner = Planner(self.tiers, capabilities=capabilities)
        self._index = {tier.name: i for i, tier in enumerate(self.tiers)}
        # Write-through: a store's job also copies on into every tier below, stage after stage.
        self.store_hops = len(self.tiers) - 1 if config.placement == "write_through" else 0
        self.restores: list[ChunksBack] = []  # the restores of the blocks kept from before (disk tiers')
        self._kept: list[tuple[KeptBlocks, ChunksBack]] = []  # the tiers whose index shutdown leaves
        copy_ranks = 1 if replicated else num_workers  # ranks holding a copy of their own in the tiers
        for tier in self.tiers:
            tier_cfg = config.tiers[position[tier.name]]
            kept_blocks = medium(tier_cfg.medium).kept_blocks
            if kept_blocks is not None:
                self._recover(
                    tier, kept_blocks(RestartRequest(tier_cfg, copy_ranks, tier.capacity, layout, namespace.hex()))
                )

    def tier(self, name: str) -> Tier:
        return self.planner.tier(name)

    def index(self, name: str) -> int:
        """Where tier ``name`` is in the stack (0: the first below the GPU)."""
        return self._index[name]

    def per_medium(self, per_tier: dict[str, int]) -> dict[str, int]:
        """Counts per tier as counts per medium ("host", "disk", "remote"): what vLLM's hit sources and our
        stats name."""
        out: dict[str, int] = {}
        for name, n in per_tier.items():
            medium = self.tier(name).medium
            out[medium] = out.get(medium, 0) + n
        return out

    def _recover(self, tier: Tier, kept: KeptBlocks) -> None:
        """Take back the blocks a previous engine left in the tier (a disk tier: on every rank's slab):
        their slots at once, the blocks into the tier's index on a thread while this side already
        serves (each a miss until it is back), their KV events as they come (``events.KVEvents``). The
        tier's index is left for the next start at ``shutdown``."""
        restore = ChunksBack(tier, kept.where)
        source = kept.recover(restore.start)
        log.info(
            "kvtier %s tier %s: %d blocks kept from before the restart (from the %s), going back into its index",
            tier.medium,
            kept.where,
            tier.usage().used,
            source,
        )
        self._kept.append((kept, restore))
        self.restores.append(restore)

    def shutdown(self) -> None:
        """Stop asking the keyed tier's owner, and leave the index of each tier that keeps blocks for the
        next start (``KeptBlocks.save``; vLLM has stopped the workers by now): its READY blocks, then
        those its restore had not put back yet (stopped here), so a quick restart loses none. Once: a
        second call leaves nothing, as this index may be out of date by then (a new engine may have
        started on the same directories)."""
        if self.keyed is not None:
            self.keyed.disconnect()
        kept, self._kept = self._kept, []
        for blocks, restore in kept:
            blocks.save(*restore.held_blocks())


def _keyed_tier(config: StackConfig, layout: BlockLayout, namespace: bytes, ranks: Sequence[int | None]) -> KeyedTier:
    """The last tier, addressed by key, as its medium opens it on the scheduler side: a client of this
    side's own, asking for the copies of ``ranks`` written under the workers' namespace."""
    i = len(config.tiers) - 1
    open_tier = medium(config.tiers[i].medium).engine_tier
    if open_tier is None:
        raise ConfigError(f"tiers[{i}] ({config.tier_name(i)}): its medium serves no engine's scheduler side")
    tier = open_tier(EngineTierRequest(config.tier_name(i), config.tiers[i], layout, namespace.hex(), ranks))
    assert isinstance(tier, KeyedTier)
    return tier
