"""S3-FIFO (Yang et al., SOSP 2023): three FIFO queues and a 2-bit read counter per block.

Why: in KV-cache traffic most blocks are written once and never read again (the tail of each new
prompt), while a few shared prefixes are read over and over. S3-FIFO drops the one-hit blocks
quickly: every new block waits in a small FIFO (about 10% of the cache); if it was not read while
there, it leaves and only its key is remembered in a ghost FIFO. Blocks read while in the small
queue, or inserted again while remembered in the ghost queue, go to the main FIFO, where a block
that was read since it last reached the head gets another round (its counter is decremented)
instead of leaving. Only FIFO moves, no reordering on a hit: a read costs one counter update.

How it maps onto insert/touch/remove/evict
    * ``insert``: into main if the key is in the ghost queue, else into small; counter 0.
    * ``touch``: counter + 1, saturating at 3. A block promoted from small to main starts main at
      0 (keeping its extra reads as credit measured no better on the Mooncake trace).
    * ``evict``: while the small queue holds at least its share of the cache, take from it (a
      block read at least ``promote_after`` times moves to main instead); otherwise take from main
      (second chances as above). Protected keys are skipped without being reordered; when one
      queue has nothing unprotected, the other is used.
    * ``remove``: forget the key; no ghost.

Capacity
    The small queue's share and the ghost queue's length are fractions of the cache size. Pass
    ``capacity``; when it is None the policy uses the largest number of keys it has tracked at once
    (a tier fills before it evicts, so this converges to the tier's size).

Every operation is O(1) amortized: each second chance in main is paid for by an earlier touch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container

from kvtier.policies._queues import learned_capacity, pop_oldest_unprotected, unpark
from kvtier.policies.base import EvictionPolicy, Key

_MAX_FREQ = 3


class S3FIFOPolicy(EvictionPolicy[Key]):
    """Small, main and ghost FIFOs (oldest first) and a saturating read counter per tracked key."""

    def __init__(
        self,
        capacity: int | None = None,
        small_fraction: float = 0.1,
        ghost_fraction: float = 0.9,
        promote_after: int = 1,
    ) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"S3-FIFO capacity must be >= 1 or None, not {capacity}")
        if not 0.0 < small_fraction < 1.0:
            raise ValueError(f"small_fraction must be in (0, 1), not {small_fraction}")
        if ghost_fraction < 0.0:
            raise ValueError(f"ghost_fraction must be >= 0, not {ghost_fraction}")
        if not 1 <= promote_after <= _MAX_FREQ:
            raise ValueError(f"promote_after must be in 1..{_MAX_FREQ}, not {promote_after}")
        self._fixed = capacity
        self._learned = 0
        self._small_fraction = small_fraction
        self._ghost_fraction = ghost_fraction
        self._promote_after = promote_after
        self._small: OrderedDict[Key, None] = OrderedDict()
        self._main: OrderedDict[Key, None] = OrderedDict()
        self._ghost: OrderedDict[Key, None] = OrderedDict()
        self._freq: dict[Key, int] = {}

    def insert(self, key: Key) -> None:
        if key in self._freq:
            raise KeyError(f"key {key!r} is already tracked")
        self._learned = learned_capacity(self._fixed, self._learned, len(self._freq) + 1)
        if self._ghost.pop(key, self) is self:
            self._small[key] = None
        else:
            self._main[key] = None
        self._freq[key] = 0

    def touch(self, key: Key) -> None:
        f = self._freq[key]  # KeyError for an untracked key
        if f < _MAX_FREQ:
            self._freq[key] = f + 1

    def remove(self, key: Key) -> None:
        del self._freq[key]
        if self._small.pop(key, self) is self:
            del self._main[key]

    def evict(self, n: int, protected: Container[Key]) -> list[Key]:
        victims: list[Key] = []
        parked_small: list[Key] = []
        parked_main: list[Key] = []
        c = learned_capacity(self._fixed, self._learned, len(self._freq))
        small_share = max(1, int(c * self._small_fraction))
        try:
            while len(victims) < n:
                key = None
                if len(self._small) + len(parked_small) >= small_share or not self._main:
                    key = self._from_small(protected, parked_small)
                if key is None:
                    key = self._from_main(protected, parked_main)
                if key is None:
                    key = self._from_small(protected, parked_small)
                if key is None:
                    break  # everything left is protected
                victims.append(key)
        finally:
            unpark(self._small, parked_small)
            unpark(self._main, parked_main)
        ghost_size = int(c * self._ghost_fraction)
        while len(self._ghost) > ghost_size:
            self._ghost.popitem(last=False)
        return victims

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq

    def _from_small(self, protected: Container[Key], parked: list[Key]) -> Key | None:
        """Oldest unprotected key of small that was not read enough; the ones that were go to main."""
        while True:
            key = pop_oldest_unprotected(self._small, protected, parked)
            if key is None:
                return None
            if self._freq[key] >= self._promote_after:
                self._freq[key] = 0
                self._main[key] = None
                continue
            del self._freq[key]
            self._ghost[key] = None
            return key

    def _from_main(self, protected: Container[Key], parked: list[Key]) -> Key | None:
        """Oldest unprotected key of main not read since its last pass; the others go round again."""
        while True:
            key = pop_oldest_unprotected(self._main, protected, parked)
            if key is None:
                return None
            f = self._freq[key]
            if f:
                self._freq[key] = f - 1
                self._main[key] = None
                continue
            del self._freq[key]
            return key
