"""Least recently used: evict the block whose last insert or read is oldest."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container

from kvtier.policies.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """An ordered dict from oldest to newest use; ``evict`` skips protected keys without reordering them."""

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, key: bytes) -> None:
        if key in self._order:
            raise KeyError(f"key {key!r} is already tracked")
        self._order[key] = None

    def touch(self, key: bytes) -> None:
        self._order.move_to_end(key)

    def remove(self, key: bytes) -> None:
        del self._order[key]

    def evict(self, n: int, protected: Container[bytes]) -> list[bytes]:
        victims = []
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
