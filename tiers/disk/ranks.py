"""An engine's ranks' slabs (vLLM): one directory per rank under the tier's path, each rank holding its
shard of every block at the same slot, what an index of all of them names to describe them, and the
blocks they keep across the engine's restart (``RankSlabs``, the medium's ``Medium.kept_blocks``).

Each rank writes its shard of every block into its own slab (``rank_directory``), at the slot the
scheduler side chose, the same on every rank. The scheduler side (another process than the workers,
which own the slabs and their locks) holds the index: which key is at which slot.

Restart in seconds: at its clean shutdown the scheduler side leaves an index of its disk tier's
READY blocks at the tier's path (``kvtier.tiers.disk.snapshot``'s format and file rules, ``<path>/index.kvt``),
naming the geometry, namespace, number of ranks and every rank's slab file as it was then (inode,
size, mtime: ``rank_slabs_identity``). vLLM stops the workers before the scheduler side (its engine
core shuts the executor down first), so the slabs are sealed by their workers' clean closes by then,
and any write after that changes a slab's mtime. At start the index is taken (read and removed, the
directory synced) before any store is planned, so an engine that crashes later leaves none.

Without a usable index (none: a crash; stale: a slab was written since, or the workers closed after
the scheduler side; damaged, hostile, of another geometry, namespace or TP size) the scheduler side
reads the slot headers without locking or writing anything, and keeps a block only where EVERY rank
holds a valid header for it, under this engine's namespace and geometry, at the same slot: a load
needs every rank's shard. Every other slot is free to the scheduler; the workers clear its old
header before anything is written there, as they do for every slot whose header they found at open.
Either way the scheduler side puts the blocks back into the tier's index in the background
(``connectors/vllm/recovery.py``).

Neither is trusting bytes: every load still checks its slot's header (key, namespace, lengths) and
checksum on every rank, and a block that fails is reported for recomputation, so an index that is
wrong in any way can only cause misses. Nor is either trusting the directory: the index, a rank
directory or slab that fails the workers' own ownership and mode checks (``shared_directory`` as
configured) is not used, with a warning.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from kvtier.core.errors import StateError
from kvtier.core.layout import BlockLayout
from kvtier.tiers.disk.compression import CODEC_IDS
from kvtier.tiers.disk.config import DiskTierConfig
from kvtier.tiers.disk.files import SNAPSHOT_NAME, open_directory, open_slab_for_reading
from kvtier.tiers.disk.format import VERSION, checked_slot_room, namespace_digest
from kvtier.tiers.disk.inspect import read_block_headers
from kvtier.tiers.disk.slots import PAGE
from kvtier.tiers.disk.snapshot import SlabIdentity, Snapshot, take_snapshot, write_snapshot

log = logging.getLogger(__name__)

INDEX = "index snapshot"
HEADERS = "slot headers of every rank"
_READING = "reading every rank's slot headers"


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


@dataclass(frozen=True)
class RankSlabs:
    """A disk tier under vLLM: the slabs of ``ranks`` ranks (each its shard of every block, at the same
    slot), ``slots`` slots each, written under ``namespace`` with ``layout``'s geometry. The blocks they
    keep across a restart, as the medium gives them to an engine's scheduler side (``KeptBlocks``)."""

    config: DiskTierConfig
    ranks: int
    slots: int
    layout: BlockLayout
    namespace: str

    @property
    def where(self) -> str:
        """The tier's path, as log lines name it."""
        return self.config.path

    def recover(self, restore: Callable[[Sequence[bytes], Sequence[int] | np.ndarray], object]) -> str:
        """Hand the blocks every rank's slab holds, as keys and slots oldest first, to ``restore``
        (``ChunksBack.start``; StateError: it took none): from the index the last clean shutdown left
        when it describes the slabs as they are (its keys a lazy column: made chunk by chunk as they go
        back), from every rank's slot headers otherwise. Returns where it found them (``INDEX`` or
        ``HEADERS``)."""
        index = self._take_index()
        if index is not None:
            try:
                restore(index.keys, index.slots)
                return INDEX
            except StateError as exc:
                log.warning("kvtier disk tier %s: index snapshot not used (%s); %s", self._index_path, exc, _READING)
        blocks = self.blocks_on_every_rank()
        restore([key for key, _ in blocks], [slot for _, slot in blocks])
        return HEADERS

    def save(self, keys: list[bytes], slots: list[int]) -> None:
        """Leave the index of the READY blocks ``keys`` at ``slots`` (oldest first) for the next start,
        once the workers have closed their slabs. Logged, never raised, when it cannot be written
        (the next start reads the headers)."""
        try:
            identity = rank_slabs_identity(self.config, self.ranks, self.slots, self.layout, self.namespace)
            if identity is None:
                return  # a rank without a slab holds none of the blocks
            dir_fd = open_directory(Path(self.config.path), shared=self.config.shared_directory, create=True)
            try:
                write_snapshot(
                    dir_fd, shared=self.config.shared_directory, identity=identity, keys=keys, slots=slots, sequence=0
                )
            finally:
                os.close(dir_fd)
        except OSError as exc:  # DiskTierError included
            log.warning(
                "kvtier disk tier %s: index snapshot not written (%s); the next start reads every rank's slot headers",
                self._index_path,
                exc,
            )

    def _take_index(self) -> Snapshot | None:
        """The blocks of the index the last clean shutdown left, when it describes every rank's slab as
        it is now; the index is removed either way (``take_snapshot``). None when there is none, and,
        with one log line saying why, when it cannot be used. Left where it is while a rank has no
        slab: it names slab files that are not there, so it describes none created later."""
        shared = self.config.shared_directory
        path = Path(self.config.path)
        try:
            identity = rank_slabs_identity(self.config, self.ranks, self.slots, self.layout, self.namespace)
            dir_fd = open_directory(path, shared=shared, create=False) if identity is not None else None
            if dir_fd is None:
                return None  # a rank without a slab (or no directory): nothing to take back
            try:
                return take_snapshot(dir_fd, path, shared=shared, identity=identity)
            finally:
                os.close(dir_fd)
        except OSError as exc:  # DiskTierError included: a directory or slab failing the owner's checks
            log.warning("kvtier disk tier %s: index snapshot not used (%s); %s", self._index_path, exc, _READING)
            return None

    @property
    def _index_path(self) -> Path:
        return Path(self.config.path) / SNAPSHOT_NAME

    def blocks_on_every_rank(self) -> list[tuple[bytes, int]]:
        """(key, slot) of the blocks every rank's slab holds at the same slot, oldest write first (the
        order ``Tier.restore`` wants), read from their slot headers. Where several slots hold one key
        on every rank, the newest (highest sequence on rank 0) is kept; the others are left to be
        reused."""
        ranks = [
            read_block_headers(
                rank_directory(self.config.path, rank),
                self.slots,
                self.layout,
                self.namespace,
                self.config.compression,
                self.config.slot_bytes,
                self.config.shared_directory,
                self.config.encryption != "none",
            )
            for rank in range(self.ranks)
        ]
        first, others = ranks[0], ranks[1:]
        newest: dict[bytes, tuple[int, int]] = {}  # key -> (sequence on rank 0, slot)
        for slot, header in first.items():
            if not all(slot in other and other[slot].key == header.key for other in others):
                continue
            if header.key not in newest or newest[header.key][0] < header.sequence:
                newest[header.key] = (header.sequence, slot)
        return [(key, slot) for key, (_, slot) in sorted(newest.items(), key=lambda item: item[1])]
