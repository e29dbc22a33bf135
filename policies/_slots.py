"""Queues of keys linked through arrays indexed by slot: the eviction order of a tier of tens of millions
of blocks in about 17 bytes per block, where an ``OrderedDict`` costs about 90.

Why: a tier already gives every block it holds a slot number below its capacity and keeps a dict
from key to slot (``Tier.bind`` hands that dict over). A policy that orders its keys by slot needs
no dict of its own: two int32 arrays link each slot to its neighbours, a list holds the key at each
slot (a reference to the tier's own key object), and a byte says which queue the slot is in. Used
on its own (the cache replay, tests), ``SlotQueues`` numbers its keys itself, with a dict of its own.

Every queue is circular around a sentinel of its own: sentinels take the first ``queues`` entries of
the arrays, so slot ``s`` lives at ``s + queues`` and the arrays grow at the end when unbound.
"""

from __future__ import annotations

import array
from collections.abc import Container, Hashable, Iterator, Mapping, Sequence
from typing import Generic, TypeVar

import numpy as np

K = TypeVar("K", bound=Hashable)

_NONE = 255  # the queue byte of an entry in no queue


class SlotQueues(Generic[K]):
    """``queues`` queues of keys, oldest first. A key is in at most one queue."""

    def __init__(self, queues: int = 1) -> None:
        self._queues = queues
        sentinels = range(queues)
        self._next = array.array("i", sentinels)  # each sentinel alone in its circle
        self._prev = array.array("i", sentinels)
        self._which = bytearray(queues)
        self._keys: list[K | None] = [None] * queues
        self._lengths = [0] * queues
        self._own: dict[K, int] | None = {}  # key -> slot, numbered here while unbound
        self._index: Mapping[K, int] = self._own  # key -> slot: ``_own``, or the tier's once bound
        self._free: list[int] = []  # own slot numbers given back

    def bind(self, index: Mapping[K, int], capacity: int) -> None:
        """Use a tier's slots: ``index`` maps each key to its slot below ``capacity`` before the key is
        pushed, and keeps that slot until the key was taken out of every queue. Only while empty."""
        if len(self):
            raise ValueError("a policy is bound to its tier before it tracks any key")
        self._index, self._own = index, None
        self._grow(capacity)

    def __len__(self) -> int:
        return sum(self._lengths)

    def length(self, queue: int) -> int:
        return self._lengths[queue]

    def queue_of(self, key: K) -> int | None:
        """The queue ``key`` is in, or None."""
        slot = self._index.get(key)
        if slot is None:
            return None
        at = slot + self._queues
        return self._which[at] if self._keys[at] == key else None

    def push(self, key: K, queue: int, oldest: bool = False) -> None:
        """Add an untracked ``key`` at the young end of ``queue`` (the old end with ``oldest``)."""
        at = self._place(key)
        if self._keys[at] is not None:
            raise KeyError(f"key {key!r} is already tracked")
        self._keys[at] = key
        self._link(at, queue, oldest)

    def extend(self, keys: Sequence[K], queue: int) -> None:
        """``push`` each of untracked ``keys`` at the young end of ``queue``, in order, in one
        loop: a policy applying a request's inserts at once pays no call per key (``push_many`` is for
        restores of millions, where numpy steps pay; for a request's few keys they cost more)."""
        if self._own is not None:
            for key in keys:
                self.push(key, queue)
            return
        first, entries, which = self._queues, self._keys, self._which
        ats = [self._index[key] + first for key in keys]
        if len(set(ats)) < len(ats) or any(entries[at] is not None for at in ats):  # before any change
            raise KeyError("a key is already tracked, or given twice")
        nxt, prev = self._next, self._prev
        tail = prev[queue]
        for key, at in zip(keys, ats, strict=True):
            entries[at] = key
            which[at] = queue
            nxt[tail] = at
            prev[at] = tail
            tail = at
        nxt[tail], prev[queue] = queue, tail
        self._lengths[queue] += len(keys)

    def push_many(self, keys: Sequence[K], queue: int, slots: Sequence[int] | np.ndarray | None = None) -> None:
        """``push`` each of ``keys``, in order: bound to a tier, in numpy steps over the slots' links
        rather than a Python step per link (a disk tier reopening puts back millions of blocks).
        ``slots``: the keys' slots in the tier's index, when the caller has them at hand."""
        if self._own is not None or not keys:
            for key in keys:
                self.push(key, queue)
            return
        index, first = self._index, self._queues
        if slots is None:
            at = np.fromiter((index[key] for key in keys), np.int64, len(keys)) + first
        else:
            at = np.asarray(slots, dtype=np.int64) + first
        which = np.frombuffer(self._which, np.uint8)
        if (which[at] != _NONE).any():
            raise KeyError("a key is already tracked")
        nxt, prev = np.frombuffer(self._next, np.int32), np.frombuffer(self._prev, np.int32)
        # Given twice: an entry's number written into its link (unused while untracked) is overwritten
        # by a later one at the same entry. O(len(keys)), not O(capacity): a restore comes in chunks.
        order = np.arange(len(at), dtype=np.int32)
        nxt[at] = order
        if (nxt[at] != order).any():
            raise KeyError("a key is given twice")
        which[at] = queue
        entries = self._keys
        for i, key in zip(at.tolist(), keys, strict=True):
            entries[i] = key
        tail = int(prev[queue])
        nxt[tail], prev[at[0]] = at[0], tail
        nxt[at[:-1]], prev[at[1:]] = at[1:], at[:-1]
        nxt[at[-1]], prev[queue] = queue, at[-1]
        self._lengths[queue] += len(keys)

    def move(self, key: K, queue: int, oldest: bool = False) -> None:
        """Move a tracked ``key`` to the young end of ``queue`` (the old end with ``oldest``)."""
        at = self._tracked(key)
        self._unlink(at)
        self._link(at, queue, oldest)

    def remove(self, key: K) -> None:
        """Take a tracked ``key`` out. Raises KeyError when it is not tracked."""
        self._drop(self._tracked(key))

    def pop_oldest(self, queue: int) -> K | None:
        """Remove and return the oldest key of ``queue``, or None when it is empty."""
        at = self._next[queue]
        if at == queue:
            return None
        key = self._keys[at]
        self._drop(at)
        return key

    def take_oldest(self, queue: int, n: int, protected: Container[K]) -> list[K]:
        """Remove and return up to ``n`` of the oldest keys of ``queue`` not in ``protected``; the
        protected keys met on the way keep their places."""
        taken: list[K] = []
        nxt, keys = self._next, self._keys
        at = nxt[queue]
        while at != queue and len(taken) < n:
            following = nxt[at]
            key = keys[at]
            if key not in protected:
                taken.append(key)  # type: ignore[arg-type]
                self._drop(at)
            at = following
        return taken

    def oldest_first(self, queue: int) -> Iterator[K]:
        """The keys of ``queue``, oldest first (not to be changed while iterating)."""
        nxt, keys = self._next, self._keys
        at = nxt[queue]
        while at != queue:
            yield keys[at]  # type: ignore[misc]
            at = nxt[at]

    # --- helpers -------------------------------------------------------------------------------

    def _tracked(self, key: K) -> int:
        slot = self._index.get(key)
        at = -1 if slot is None else slot + self._queues
        if at < 0 or self._keys[at] != key:
            raise KeyError(f"key {key!r} is not tracked")
        return at

    def _place(self, key: K) -> int:
        """The array entry of ``key``'s slot: the tier's, or a new one of our own."""
        own = self._own
        if own is None:
            return self._index[key] + self._queues
        slot = own.get(key)
        if slot is None:
            if not self._free:
                have = len(self._keys) - self._queues
                self._grow(max(16, 2 * have))
                self._free.extend(range(len(self._keys) - self._queues - 1, have - 1, -1))
            slot = own[key] = self._free.pop()
        return slot + self._queues

    def _grow(self, capacity: int) -> None:
        """Room for slots below ``capacity``."""
        have = len(self._keys) - self._queues
        more = capacity - have
        if more <= 0:
            return
        self._next.frombytes(bytes(self._next.itemsize * more))  # (links of untracked entries are unused)
        self._prev.frombytes(bytes(self._prev.itemsize * more))
        self._which.extend(bytes([_NONE]) * more)
        self._keys.extend([None] * more)

    def _link(self, at: int, queue: int, oldest: bool) -> None:
        nxt, prev = self._next, self._prev
        if oldest:
            before, after = queue, nxt[queue]
        else:
            before, after = prev[queue], queue
        nxt[before] = at
        prev[at] = before
        nxt[at] = after
        prev[after] = at
        self._which[at] = queue
        self._lengths[queue] += 1

    def _unlink(self, at: int) -> None:
        nxt, prev = self._next, self._prev
        before, after = prev[at], nxt[at]
        nxt[before] = after
        prev[after] = before
        self._lengths[self._which[at]] -= 1
        self._which[at] = _NONE

    def _drop(self, at: int) -> None:
        self._unlink(at)
        key = self._keys[at]
        self._keys[at] = None
        if self._own is not None:
            self._free.append(self._own.pop(key))  # type: ignore[arg-type]
