"""Blocks that became loadable from a tier and blocks that stopped being: what a prefix-aware router needs
to send each request to an engine that holds its prefix (``kvtier/event_publisher.py`` sends them on).

A tier with a ``watcher`` calls it with the keys of every block that became readable there (``stored``:
committed, or put back by a restore) and of every one that stopped being (``removed``: evicted, dropped
as unreadable; for a store shared with other engines, as far as this engine can tell: a load of the
block failed, or the store said absent a block it had said present). It calls under its own lock, so a
watcher only notes them down.

``BlockEvents`` is that watcher for a stack: runs of keys, one per tier and kind in the order they came
(a burst of evictions is one run however many blocks it holds), at most ``max_keys`` keys waiting.
Beyond that it forgets what waits and says so (``Batch.lost``): a subscriber must then forget what it
knew of this engine, since some removals never reach it. It never blocks and never raises into a tier.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvtier.core.media import medium
from kvtier.core.tier import Tier

MAX_KEYS = 1 << 20
"""Keys waiting to be taken at most (16 MiB of 16-byte keys and the lists holding them)."""


class Where(NamedTuple):
    """Where a tier's blocks live, in the terms of vLLM's KV events: ``medium`` ("CPU", "STORAGE"),
    ``locality`` ("LOCAL": this machine; "REMOTE": a store elsewhere) and ``owner`` (None: this engine's
    alone; else who else may load them, as ``Tier.location`` names it)."""

    medium: str
    locality: str
    owner: str | None


def where(tier: Tier) -> Where | None:
    """Where ``tier``'s blocks live; None for a medium without KV events (GPU memory: the engine's own
    events name it)."""
    label = medium(tier.medium).event_medium
    return None if label is None else Where(label, *tier.location())


@dataclass
class Run:
    """Blocks of one tier that became loadable (``stored``) or stopped being, in the order they did."""

    stored: bool
    tier: str
    where: Where
    keys: list[bytes] = field(default_factory=list)


class Batch(NamedTuple):
    """What happened since the last ``take``: its runs, and how many keys were forgotten before them
    (``lost``: nonzero means the runs do not tell everything)."""

    runs: list[Run]
    lost: int


class BlockEvents:
    """The watcher of a stack's tiers that have KV events (``watch``): runs of keys until ``take``."""

    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self.max_keys = max_keys
        self._lock = threading.Lock()
        self._runs: list[Run] = []
        self._waiting = 0  # keys in ``_runs``
        self._lost = 0
        self._where: dict[int, Where] = {}  # id(tier) -> where its blocks live

    def watch(self, tiers: list[Tier]) -> None:
        """Become the watcher of every tier of ``tiers`` whose medium has KV events."""
        for tier in tiers:
            place = where(tier)
            if place is not None:
                self._where[id(tier)] = place
                tier.watcher = self

    def stored(self, tier: Tier, keys: list[bytes]) -> None:
        self._add(True, tier, keys)

    def removed(self, tier: Tier, keys: list[bytes]) -> None:
        self._add(False, tier, keys)

    def take(self) -> Batch:
        """Everything since the last call."""
        with self._lock:
            batch = Batch(self._runs, self._lost)
            self._runs, self._waiting, self._lost = [], 0, 0
            return batch

    def _add(self, stored: bool, tier: Tier, keys: list[bytes]) -> None:
        if not keys:
            return
        with self._lock:
            if self._waiting + len(keys) > self.max_keys:  # (nobody took them for long: forget, and say so)
                self._lost += self._waiting + len(keys)
                self._runs, self._waiting = [], 0
                return
            last = self._runs[-1] if self._runs else None
            if last is None or last.stored != stored or last.tier != tier.name:
                last = Run(stored, tier.name, self._where[id(tier)])
                self._runs.append(last)
            last.keys.extend(keys)
            self._waiting += len(keys)


class BlockTokens(NamedTuple):
    """A block's token ids and its parent's key (None for a prompt's first block), which a router that
    hashes tokens itself (llm-d's indexer) chains blocks by."""

    tokens: tuple[int, ...]
    parent: bytes | None


class HeldTokens:
    """The tokens of each block while one of this engine's own tiers holds it (a tier whose blocks no one
    else loads: ``Where.owner`` None), so that a block copied down, or on to a shared store, is announced
    with the tokens of its first store, as vLLM's offloading events announce theirs. What it keeps is
    bounded by those tiers' capacity, plus ``max_noted`` blocks noted for a store not yet taken (the
    oldest forgotten first: a store refused or failed never says so here). Thread-safe."""

    def __init__(self, max_noted: int = MAX_KEYS) -> None:
        self.max_noted = max_noted
        self._lock = threading.Lock()
        self._noted: dict[bytes, BlockTokens] = {}  # before a tier took them, oldest first
        self._held: dict[bytes, tuple[BlockTokens, set[str]]] = {}  # key -> tokens, the tiers holding it

    def note(self, keys: Sequence[bytes], blocks: Sequence[BlockTokens]) -> None:
        """These blocks are about to be stored."""
        with self._lock:
            noted = self._noted
            noted.update(zip(keys, blocks, strict=True))
            while len(noted) > self.max_noted:
                del noted[next(iter(noted))]

    def stored(
        self, tier: str, place: Where, keys: Sequence[bytes], given: Sequence[BlockTokens | None] | None = None
    ) -> list[BlockTokens | None]:
        """``tier`` took these blocks: the tokens of each (``given``, else as noted or kept; None when
        unknown). One call per run of keys: the lock is taken once."""
        own = place.owner is None
        out: list[BlockTokens | None] = []
        with self._lock:
            noted, held = self._noted, self._held
            for i, key in enumerate(keys):
                block = given[i] if given is not None else None
                was = noted.pop(key, None)
                kept = held.get(key)
                block = block or was or (kept[0] if kept is not None else None)
                if block is not None and own:
                    if kept is None:
                        held[key] = kept = (block, set())
                    kept[1].add(tier)
                out.append(block)
        return out

    def removed(self, tier: str, keys: Sequence[bytes]) -> None:
        """``tier`` let these blocks go: their tokens too, once no tier holds them."""
        with self._lock:
            held = self._held
            for key in keys:
                kept = held.get(key)
                if kept is not None:
                    kept[1].discard(tier)
                    if not kept[1]:
                        del held[key]

    def __len__(self) -> int:
        """Blocks whose tokens are kept (noted or held)."""
        with self._lock:
            return len(self._noted) + len(self._held)
