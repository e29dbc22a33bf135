"""vLLM's KV cache events from the scheduler side: blocks stored into and removed from kvtier's tiers,
and the disk blocks a restart took back, announced as their restore puts them back.

A part of its own because the events are gathered from everywhere a block comes or goes (a plan
finished, room made, a cache reset, a restore's chunk) and handed to vLLM once per step
(``take``), under rules that hold for all of them: only tiers whose medium names a KV-event medium
have events, which say where the blocks live (``core/events.py``: a node tier's and a shared store's
are LOCAL or REMOTE and owned by the machine or the store, which other engines load from too);
a block's size is its group's (``geometry.GroupKeys.tokens_of``); every restored block still in its
tier is announced once, and none that was dropped before its announcement.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent

from kvtier.connectors.vllm.geometry import GroupKeys
from kvtier.connectors.vllm.recovery import ChunksBack
from kvtier.connectors.vllm.request_state import BlockRef
from kvtier.core.events import BlockTokens, HeldTokens, Where, where
from kvtier.core.tier import Tier

RESTORED_PER_EVENT = 65536
"""Keys per BlockStored event for blocks taken back at start (``KVEvents._restored``)."""

RESTORED_PER_STEP = RESTORED_PER_EVENT
"""Blocks taken back at start announced per step at most (``KVEvents._announce_restored``): about 3 ms of
vLLM's thread each (12 ms at worst; 2-core VM, 15.8 M blocks), for a chunk the restore's thread put back
in 80 ms or more (``ChunkedRestore.chunk``)."""


class _GoneFromStores:
    """The watcher of the tiers by key (a remote store, a node daemon): blocks found gone as far as this
    engine can tell (a load of them failed, the store said absent what it had said present), noted from
    whichever thread found it, until taken. Their stores are announced by the plans that made them, with
    tokens and parents, as every tier's are."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gone: list[tuple[Tier, list[bytes]]] = []

    def stored(self, tier: Tier, keys: list[bytes]) -> None:
        """(Announced by the plan that stored them.)"""

    def removed(self, tier: Tier, keys: list[bytes]) -> None:
        with self._lock:
            self._gone.append((tier, list(keys)))

    def take(self) -> list[tuple[Tier, list[bytes]]]:
        with self._lock:
            gone, self._gone = self._gone, []
            return gone


class KVEvents:
    """The events since vLLM last took them. ``tier_of`` names a tier by its name; ``restores`` are the
    disk tiers' restores of blocks kept from before the restart (``tiers.SchedulerTiers.restores``).
    ``keep_tokens``: keep each block's tokens while this engine's tiers hold it, for the events of its
    copies (``HeldTokens``); off where vLLM's KV events are off, since nobody reads them then."""

    def __init__(
        self,
        geometry: GroupKeys,
        tier_of: Callable[[str], Tier],
        restores: Iterable[ChunksBack],
        keep_tokens: bool = True,
    ) -> None:
        self.geometry = geometry
        self._tier_of = tier_of
        self._events: list[KVCacheEvent] = []
        self._restoring = list(restores)  # restores whose blocks are not all announced yet
        self._gone = _GoneFromStores()
        self.tokens = HeldTokens() if keep_tokens else None  # (nothing is noted: a store's blocks come with it)

    def watch_keyed(self, tiers: Iterable[Tier]) -> None:
        """Hear from each tier by key with KV events when a block of it is found gone (BlockRemoved at the
        next ``take``)."""
        for tier in tiers:
            if tier.by_key and where(tier) is not None:
                tier.watcher = self._gone

    def stored(self, keys: list[bytes], tier: Tier, blocks: Mapping[bytes, BlockRef] | None = None) -> None:
        """BlockStored per key, for a tier whose medium names a KV-event medium, with the block's tokens and
        its parent's key: from the request's blocks (a store), else as they were stored, while one of
        this engine's own tiers has held the block since (a demotion, a copy to a keyed store:
        ``HeldTokens``)."""
        place = where(tier)
        if place is None:
            return
        refs = [blocks.get(key) for key in keys] if blocks else [None] * len(keys)
        given = [BlockTokens(ref.tokens, ref.parent) if ref else None for ref in refs]
        known = given if self.tokens is None else self.tokens.stored(tier.name, place, keys, given)
        for key, block in zip(keys, known, strict=True):
            tokens, parent = (list(block.tokens), block.parent) if block is not None else ([], None)
            self._events.append(_stored([key], tokens, self.geometry.tokens_of(key), place, parent))

    def removed(self, keys: list[bytes], tier: Tier) -> None:
        """BlockRemoved for keys the tier dropped (a restore still putting blocks back there is told)."""
        for restore in self._restoring:  # (a block dropped after it went back is not announced as back)
            if restore.tier is tier:
                restore.dropped(keys)
        if self.tokens is not None:
            self.tokens.removed(tier.name, keys)
        place = where(tier)
        if keys and place is not None:
            self._events.append(
                BlockRemoved(
                    block_hashes=list(keys), medium=place.medium, locality=place.locality, ownership=place.owner
                )
            )

    def dropped(self, by_tier: Mapping[str, list[bytes]]) -> None:
        """BlockRemoved for what a plan or the room it made dropped, per tier name."""
        for name, keys in by_tier.items():
            self.removed(keys, self._tier_of(name))

    def take(self) -> list[KVCacheEvent]:
        for tier, keys in self._gone.take():
            self.removed(keys, tier)
        if self._restoring:
            self._announce_restored()
        events, self._events = self._events, []
        return events

    def _announce_restored(self) -> None:
        """BlockStored events for the blocks the disk tiers' restores have put back since the last call, at
        most ``RESTORED_PER_STEP`` of them (the rest at the next calls). Runs on vLLM's thread, which
        alone stores and drops blocks: a block announced is one that went into the tier (a key stored
        meanwhile keeps the stored block, whose store announced it) and that the tier has not dropped
        since (``ChunksBack.announce``), so every restored block still in the tier is announced once."""
        budget = RESTORED_PER_STEP
        for restore in list(self._restoring):
            while budget > 0:
                try:
                    first, went_in = restore.back.get_nowait()
                except queue.Empty:
                    if restore.done.is_set() and restore.back.empty():  # (no chunk came since get_nowait)
                        self._restoring.remove(restore)  # (and its keys let go)
                        restore.keys, restore.left = [], {}
                    break
                self._restored(restore.announce(first, went_in), restore.tier)
                budget -= len(went_in)

    def _restored(self, keys: Sequence[bytes], tier: Tier) -> None:
        """BlockStored for blocks taken back at start, whose tokens are unknown: many keys per event
        (one event per key costs 3 us, 47 s for the 15.8 M blocks of a 1 TiB disk tier of 64 KiB
        blocks), one block size per event."""
        place = where(tier)
        if place is None or not keys:
            return
        by_size: Mapping[int, Sequence[bytes]] = {self.geometry.block_tokens: keys}
        if not self.geometry.uniform:
            grouped: dict[int, list[bytes]] = {}
            for key in keys:
                grouped.setdefault(self.geometry.tokens_of(key), []).append(key)
            by_size = grouped
        for size, same in by_size.items():
            for start in range(0, len(same), RESTORED_PER_EVENT):
                self._events.append(_stored(same[start : start + RESTORED_PER_EVENT], [], size, place))


def _stored(
    keys: Sequence[bytes], tokens: list[int], size: int, place: Where, parent: bytes | None = None
) -> BlockStored:
    return BlockStored(
        block_hashes=list[bytes | int](keys),
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=size,
        lora_id=None,
        medium=place.medium,
        lora_name=None,
        locality=place.locality,
        ownership=place.owner,
    )
