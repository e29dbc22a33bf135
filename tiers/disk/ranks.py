"""An engine's ranks' slabs (vLLM): one directory per rank under the tier's path, each rank holding its
shard of every block at the same slot, and what an index of all of them names to describe them.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import xxhash

from kvtier.core.layout import BlockLayout
from kvtier.tiers.disk.compression import CODEC_IDS
from kvtier.tiers.disk.config import DiskTierConfig
from kvtier.tiers.disk.files import open_slab_for_reading
from kvtier.tiers.disk.format import VERSION, checked_slot_room, namespace_digest
from kvtier.tiers.disk.slots import PAGE
from kvtier.tiers.disk.snapshot import SlabIdentity


def rank_directory(path: str | os.PathLike, rank: int) -> Path:
    """The directory of one rank's slab under a disk tier's ``path`` (each rank holds its own shard of
    every block)."""
    return Path(path) / f"rank{rank}"


_RANK_FILE = struct.Struct("<QQq")
"""One rank's slab file in ``rank_slabs_identity``'s digest: inode, size, mtime (ns)."""


def rank_slabs_identity(
    config: DiskTierConfig, ranks: int, num_slots: int, layout: BlockLayout, namespace: str
) -> SlabIdentity | None:
    """What an index of the blocks held by an engine's ``ranks`` slabs (``rank_directory``, each of
    ``num_slots`` slots) names to describe them (``snapshot``): the geometry and namespace the
    configuration gives, and every rank's slab file as it is now. A worker's clean close seals its
    slab's mtime (``DiskSlab.close``) and any later write changes it, so an index written after the
    workers closed describes the slabs only until one of them is written again. None when a rank
    has no slab; raises OSError (DiskTierError included) when one fails the owner's checks
    (``files``, ``shared_directory`` as configured) or cannot be read."""
    room = checked_slot_room(config.path, layout.block_bytes, config.compression, config.slot_bytes)
    files = []
    for rank in range(ranks):
        fd = open_slab_for_reading(rank_directory(config.path, rank), shared=config.shared_directory)
        if fd is None:
            return None
        try:
            files.append(os.fstat(fd))
        finally:
            os.close(fd)
    first, others = files[0], files[1:]
    others_digest = xxhash.xxh3_128_digest(
        b"".join(_RANK_FILE.pack(st.st_ino, st.st_size, st.st_mtime_ns) for st in others)
    )
    return SlabIdentity(
        VERSION,
        layout.block_bytes,
        PAGE + room,
        num_slots,
        CODEC_IDS[config.compression],
        namespace_digest(namespace, layout),
        first.st_ino,
        first.st_size,
        first.st_mtime_ns,
        ranks,
        others_digest if others else bytes(16),
    )
