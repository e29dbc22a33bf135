"""Least recently used: evict the block whose last insert or read is oldest."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container

from kvtier.policies.base import EvictionPolicy, Key


class LRUPolicy(EvictionPolicy[Key]):
    """An ordered dict from oldest to newest use; ``evict`` skips protected keys without reordering them."""

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key) -> None:
        if key in self._order:
            raise KeyError(f"key {key!r} is already tracked")
        self._order[key] = None

    def touch(self, key: Key) -> None:
        self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        del self._order[key]

    def evict(self, n: int, protected: Container[Key]) -> list[Key]:
        victims: list[Key] = []
        for key in self._order:
            if len(victims) >= n:
                break
            if key not in protected:
                victims.append(key)
        for key in victims:
            del self._order[key]
        return victims

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
