"""Helpers the queue-based policies share: take the oldest unprotected key without reordering the rest.

Why: ``evict(n, protected)`` must skip protected keys (pinned blocks, the request being served)
but leave them where they were, so that protection does not change the eviction order. Skipped
keys are parked in a list and put back at the front afterwards, which costs O(skipped) per
``evict`` call instead of O(skipped) per victim.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


def pop_oldest_unprotected(queue: OrderedDict[K, None], protected: Container[K], parked: list[K]) -> K | None:
    """Remove and return the oldest key of ``queue`` not in ``protected``, or None when there is none.

    Protected keys met on the way are removed too and appended to ``parked``; the caller must hand
    them back with ``unpark`` before anyone else sees the queue.
    """
    while queue:
        key, _ = queue.popitem(last=False)
        if key in protected:
            parked.append(key)
        else:
            return key
    return None


def unpark(queue: OrderedDict[K, None], parked: list[K]) -> None:
    """Put keys taken by ``pop_oldest_unprotected`` back at the front, in their old order."""
    for key in reversed(parked):
        queue[key] = None
        queue.move_to_end(key, last=False)
    parked.clear()


def learned_capacity(fixed: int | None, learned: int, tracked: int) -> int:
    """The capacity a policy sizes its lists with: the one it was given, or the most keys it ever
    tracked (a tier fills up before it evicts, so this converges to the tier's size)."""
    if fixed is not None:
        return fixed
    return max(learned, tracked)
