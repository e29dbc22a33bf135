"""Disk blocks kept across a restart under vLLM: which ones every rank's slab still holds.

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

Either way the blocks go back into the tier's index in the background (``ChunksBack``, a
``ChunkedRestore`` that reports each chunk it put back, for the KV events): the scheduler side serves
at once, a block not back yet being a miss that vLLM recomputes.

Neither is trusting bytes: every load still checks its slot's header (key, namespace, lengths) and
checksum on every rank, and a block that fails is reported for recomputation, so an index that is
wrong in any way can only cause misses. Nor is either trusting the directory: the index, a rank
directory or slab that fails the workers' own ownership and mode checks (``shared_directory`` as
configured) is not used, with a warning.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtier.core.errors import StateError
from kvtier.core.layout import BlockLayout
from kvtier.core.tier import Tier
from kvtier.tiers.disk.config import DiskTierConfig
from kvtier.tiers.disk.files import SNAPSHOT_NAME, open_directory
from kvtier.tiers.disk.inspect import read_block_headers
from kvtier.tiers.disk.ranks import rank_directory, rank_slabs_identity
from kvtier.tiers.disk.restore import ChunkedRestore
from kvtier.tiers.disk.snapshot import Snapshot, take_snapshot, write_snapshot

log = logging.getLogger(__name__)

INDEX = "index snapshot"
HEADERS = "slot headers of every rank"
_READING = "reading every rank's slot headers"


class ChunksBack(ChunkedRestore):
    """A disk tier's blocks put back in the background (``ChunkedRestore``), each chunk reported once it
    is in, for the scheduler side's KV events (``events.KVEvents.take``, on vLLM's thread, which
    alone stores and drops blocks): the restore's thread puts ``(first, went_in)`` into ``back`` in the
    same step under the tier's lock as the chunk goes in, ``first`` the index of its first block in
    ``keys`` and ``went_in`` which of its blocks went in (a key stored meanwhile keeps the stored block,
    whose store has its own event). vLLM's thread tells each drop of the tier (``dropped``), so that a
    block dropped after it went in is not announced after its BlockRemoved (``announce``)."""

    def __init__(self, tier: Tier, name: str) -> None:
        super().__init__(tier, name)
        self.tier = tier
        self.keys: Sequence[bytes] = []  # the blocks being put back, oldest first (a snapshot's lazy column)
        self.back: queue.SimpleQueue[tuple[int, np.ndarray]] = queue.SimpleQueue()
        self.left: dict[bytes, int] = {}  # (vLLM's thread only) key dropped -> ``passed`` when it was

    def start(self, keys: Sequence[bytes], slots: Sequence[int] | np.ndarray) -> None:
        self.keys = keys
        super().start(keys, slots)

    def _chunk_in(self, first: int, went_in: np.ndarray) -> None:
        self.back.put((first, went_in))

    def dropped(self, keys: Sequence[bytes]) -> None:
        """vLLM's thread, once the tier dropped ``keys`` and before it stores any of them again: note
        those whose restored block may be what left. ``passed`` is read first: a key the tier holds
        after that went in after its drop (its block is in the tier, to be announced); any other is
        noted with it, and a chunk counted in it went in before the drop (``announce`` leaves its
        block out). A chunk not counted goes in after the drop and is announced."""
        passed = self.passed
        for key in itertools.compress(keys, ~self.tier.holds(keys)):
            self.left[key] = passed

    def announce(self, first: int, went_in: np.ndarray) -> list[bytes]:
        """The keys to announce of a chunk reported in ``back``: those that went in, less those the tier
        dropped since (noted by ``dropped`` with a ``passed`` past ``first``: this chunk was in then)."""
        keys = itertools.compress(self.keys[first : first + len(went_in)], went_in)
        left = self.left
        return [key for key in keys if left.get(key, first) <= first] if left else list(keys)


@dataclass(frozen=True)
class RankSlabs:
    """A disk tier under vLLM: the slabs of ``ranks`` ranks (each its shard of every block, at the same
    slot), ``slots`` slots each, written under ``namespace`` with ``layout``'s geometry."""

    config: DiskTierConfig
    ranks: int
    slots: int
    layout: BlockLayout
    namespace: str

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
