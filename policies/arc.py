"""Adaptive Replacement Cache (Megiddo and Modha, 2003), fitted to the tier's policy interface.

Why: LRU lets one long scan of blocks that are never read again push out everything that was
reused. ARC splits residents into T1 (seen once) and T2 (seen at least twice), remembers the keys
it recently dropped from each (ghost lists B1 and B2), and moves a target size ``p`` for T1: a miss
that hits B1 says T1 was too small, one that hits B2 says T2 was. Eviction takes T1's oldest while
T1 is over its target, T2's oldest otherwise.

How it maps onto insert/touch/remove/evict
    * ``insert`` of a key remembered in B1 or B2 adapts ``p`` and puts the key into T2 (it was
      wanted again); any other key goes to T1.
    * ``touch`` moves the key to the young end of T2.
    * ``evict`` runs ARC's REPLACE ``n`` times; victims go to the matching ghost list. A protected
      key is skipped without being reordered; when one list has nothing unprotected, the other is
      used.
    * ``remove`` forgets the key and leaves no ghost (the block did not leave for lack of room).

Capacity
    ARC sizes ``p`` and the ghost lists against the cache size c (|T1|+|B1| <= c and
    |T1|+|T2|+|B1|+|B2| <= 2c). Pass ``capacity``; when it is None the policy uses the largest
    number of keys it has tracked at once. A tier fills before it evicts, so that converges to the
    tier's size, at the price of short ghost lists while the tier is still filling.

Every operation is O(1) amortized (protected keys skipped during one ``evict`` cost O(1) each).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container

from kvtier.policies._queues import learned_capacity, pop_oldest_unprotected, unpark
from kvtier.policies.base import EvictionPolicy, Key


class ARCPolicy(EvictionPolicy[Key]):
    """ARC over opaque keys. Oldest first in each OrderedDict; values are unused."""

    def __init__(self, capacity: int | None = None) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"ARC capacity must be >= 1 or None, not {capacity}")
        self._fixed = capacity
        self._learned = 0
        self._t1: OrderedDict[Key, None] = OrderedDict()
        self._t2: OrderedDict[Key, None] = OrderedDict()
        self._b1: OrderedDict[Key, None] = OrderedDict()
        self._b2: OrderedDict[Key, None] = OrderedDict()
        self._p = 0.0  # target size of T1

    @property
    def capacity(self) -> int:
        """The cache size ARC adapts against (given, or learned)."""
        return learned_capacity(self._fixed, self._learned, 0)

    def insert(self, key: Key) -> None:
        if key in self._t1 or key in self._t2:
            raise KeyError(f"key {key!r} is already tracked")
        c = self._learn(1)
        if key in self._b1:
            self._p = min(self._p + max(len(self._b2) / len(self._b1), 1.0), c)
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self._p = max(self._p - max(len(self._b1) / len(self._b2), 1.0), 0.0)
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._trim_ghosts()

    def touch(self, key: Key) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        else:
            self._t2.move_to_end(key)  # KeyError for an untracked key

    def remove(self, key: Key) -> None:
        if self._t1.pop(key, self) is self and self._t2.pop(key, self) is self:
            raise KeyError(key)

    def evict(self, n: int, protected: Container[Key]) -> list[Key]:
        victims: list[Key] = []
        parked1: list[Key] = []
        parked2: list[Key] = []
        try:
            while len(victims) < n:
                t1_size = len(self._t1) + len(parked1)
                if t1_size and t1_size > self._p:
                    order = ((self._t1, self._b1, parked1), (self._t2, self._b2, parked2))
                else:
                    order = ((self._t2, self._b2, parked2), (self._t1, self._b1, parked1))
                for queue, ghost, parked in order:
                    key = pop_oldest_unprotected(queue, protected, parked)
                    if key is not None:
                        ghost[key] = None
                        victims.append(key)
                        break
                else:
                    break  # everything left is protected
        finally:
            unpark(self._t1, parked1)
            unpark(self._t2, parked2)
        self._trim_ghosts()
        return victims

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def _learn(self, adding: int) -> int:
        self._learned = learned_capacity(self._fixed, self._learned, len(self) + adding)
        return self._learned

    def _trim_ghosts(self) -> None:
        """Keep the directory ARC's size: |T1|+|B1| <= c and all four lists <= 2c."""
        c = self._learned if self._fixed is None else self._fixed
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        while self._b2 and len(self) + len(self._b1) + len(self._b2) > 2 * c:
            self._b2.popitem(last=False)
        while self._b1 and len(self) + len(self._b1) + len(self._b2) > 2 * c:
            self._b1.popitem(last=False)
