"""The disk tier: a ``Tier`` over one slab (``slab``), and the one place that builds it from its settings.

The tier holds again every block a previous process committed to the slab under the same namespace
and geometry: their slots are taken at once, and the blocks come back into its index in chunks while
the tier already serves (``restore``). It keeps the namespaces of the stacks that used its directory
(``namespaces``), so a miss on a block another namespace stored there can say so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.core.layout import BlockLayout
from kvtier.core.namespaces import KnownNamespace
from kvtier.core.restore import ChunkedRestore
from kvtier.core.tier import BlockState, Tier
from kvtier.policies.base import EvictionPolicy
from kvtier.policies.watermark import Watermark
from kvtier.tiers.disk.config import DiskTierConfig
from kvtier.tiers.disk.namespaces import record
from kvtier.tiers.disk.slab import DiskSlab, FileStorage


class DiskTier(Tier):
    """A tier over a slab that keeps the namespaces of the stacks that used its directory
    (``namespaces.json``, ``namespaces``): a ``NamespaceBook`` (``core/namespaces.py``)."""

    def __init__(
        self,
        name: str,
        storage: FileStorage,
        policy: EvictionPolicy[bytes],
        watermark: Watermark | None,
        is_fenced: Callable[[str, int], bool] | None,
        note: str,
    ) -> None:
        super().__init__(name, "disk", storage, policy, watermark, is_fenced, note)
        self.slab = storage.slab

    def record_namespace(self, ours: KnownNamespace) -> list[KnownNamespace]:
        """Record ``ours`` in the directory's ``namespaces.json``; the others it lists (none once closed)."""
        if self.slab.dir_fd is None:
            return []
        return record(self.slab.dir_fd, self.slab.dir, ours, shared=self.slab.shared)

    def hold_elsewhere(self, keys: Sequence[tuple[KnownNamespace, bytes]]) -> list[bool]:
        """Whether the slab holds each key: in this tier's index (a namespace whose blocks have this
        tier's digest, such as another block size), or among the other digests' blocks the open found
        (they stay until their slots are reused: a statistic, which may be stale)."""
        foreign = self.slab.foreign or set()
        return [self.state(key) is BlockState.READY or key in foreign for _, key in keys]


def disk_tier(
    name: str,
    num_slots: int,
    layout: BlockLayout,
    policy: EvictionPolicy[bytes],
    watermark: Watermark | None = None,
    is_fenced=None,
    *,
    config: DiskTierConfig,
    namespace: str = "",
) -> DiskTier:
    """A tier of ``num_slots`` blocks over the slab its ``config`` describes, holding again every block a
    previous process committed there under the same namespace, block size and slot geometry (codec and
    slot size): their slots are taken at once, and the blocks come back into the index in chunks
    while the tier already serves (``restore``; until then each is a miss). Raises ConfigError
    for a bad combination or a codec whose package is missing.
    """
    slab = DiskSlab.from_config(config, num_slots, layout, namespace)
    slab.foreign = set()
    try:
        io = "O_DIRECT" if slab.o_direct else "buffered I/O"
        packing = "" if slab.codec is None else f", {config.compression} into {slab.room} B slots"
        packing += ", sealed (aes-gcm)" if slab.sealing is not None else ""
        tier = DiskTier(name, FileStorage(slab, layout), policy, watermark, is_fenced, f"{slab.path}, {io}{packing}")
        slab.restoring = ChunkedRestore(tier, str(slab.path))
        recovered = slab.recover(slab.restoring.start)
        # (the close runs once no job is left: nothing changes while it lists the blocks)
        slab.held_blocks = slab.restoring.held_blocks
        tier.note += f", {recovered.blocks} blocks recovered ({recovered.source})"
        tier.count(damaged=recovered.damaged)
        slab.count, slab.refuse = tier.count, tier.refuse
        return tier
    except BaseException:
        if slab.restoring is not None:
            slab.restoring.stop()
        slab.close()
        raise
