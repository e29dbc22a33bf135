"""Least recently used: evict the block whose last insert or read is oldest."""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence

import numpy as np

from kvtier.policies._slots import SlotQueues
from kvtier.policies.base import EvictionPolicy, Key


class LRUPolicy(EvictionPolicy[Key]):
    """One queue from oldest to newest use, linked by slot (``SlotQueues``); ``evict`` skips protected
    keys without reordering them."""

    def __init__(self) -> None:
        self._order: SlotQueues[Key] = SlotQueues()

    def bind(self, index: Mapping[Key, int], capacity: int) -> None:
        self._order.bind(index, capacity)

    def insert(self, key: Key) -> None:
        self._order.push(key, 0)

    def restore(self, keys: Sequence[Key], slots: Sequence[int] | np.ndarray | None = None) -> None:
        self._order.push_many(keys, 0, slots)

    def touch(self, key: Key) -> None:
        self._order.move(key, 0)

    def remove(self, key: Key) -> None:
        self._order.remove(key)

    def evict(self, n: int, protected: Container[Key]) -> list[Key]:
        return self._order.take_oldest(0, n, protected)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return self._order.queue_of(key) is not None  # type: ignore[arg-type]
