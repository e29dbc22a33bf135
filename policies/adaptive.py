"""LRU with an admission filter that switches itself on and off by scoring both choices on the same stream.

Why: which policy a tier should run depends on the traffic and on the tier's size. Where most
blocks are written once and never read again (long one-off prompts, a small tier), a block should
only be stored on its second sight: first-seen blocks would only push out blocks that are read
again. Where the traffic keeps coming back to what it saw recently (a chat workload in a tier large
enough to hold most conversations), every block should be stored and the oldest should leave: the
filter would turn each conversation's next turn into a miss. Neither is right everywhere (bench/
policies.py measures both regimes), and nobody should have to tune a tier per trace. So the policy
learns which regime it is in, as the trace runs.

How
    * Residents are kept in LRU order, with each run of consecutive ``insert`` calls queued
      deepest first (as in ``kvtier.policies.s3fifo_prefix``): a tier commits a request's new blocks
      in chain order, and a chain should lose its tail before its head, which keeps what stays a
      usable prefix.
    * ``admit(key)``: a key found in the history (declined or evicted within about
      ``history_factor`` x capacity keys) is admitted. Any other key is admitted while the filter
      is off, and declined (and remembered in the history) while it is on.
    * Two miniature LRU caches score the two choices on the same references (Waldspurger et al.,
      "Cache modeling and optimization using miniature simulations", USENIX ATC 2017): one admits
      everything, the other admits on second sight with its own history. They see only the keys
      whose hash is a multiple of ``sample_every``, and hold capacity / ``sample_every`` keys each,
      so they cost O(1) per reference and a fraction of the tier's memory. A counter moves up by
      one when only the filtering miniature hits and down by one when only the other does, within
      +-``score_limit`` (so it can turn within a bounded number of references when the traffic
      changes, as set dueling in CPU caches does); the filter is on while the counter is above
      zero. Ties stay with plain LRU: with no evidence either way, the policy is LRU.

References are what ``touch`` (a read of a resident block) and ``admit`` (a block about to be
stored) report: together every block the tier is asked for.

Capacity
    Pass ``capacity``; when it is None the policy uses the largest number of keys it has tracked
    at once (a tier fills before it evicts, so this converges to the tier's size), and the
    miniatures and the history grow with it.

Every operation is O(1) amortized: a protected key skipped during ``evict`` costs O(1) once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable, Iterable

from kvtier.policies._queues import learned_capacity, pop_oldest_unprotected, unpark
from kvtier.policies.base import EvictionPolicy, Key


class _History:
    """Keys seen recently but not resident, oldest first, at most ``limit`` of them."""

    def __init__(self) -> None:
        self._keys: OrderedDict[Hashable, None] = OrderedDict()

    def add(self, key: Hashable, limit: int) -> None:
        self._keys[key] = None
        while len(self._keys) > limit:
            self._keys.popitem(last=False)

    def take(self, key: Hashable) -> bool:
        """Whether ``key`` was remembered; it is forgotten (it is about to be resident)."""
        return self._keys.pop(key, self) is not self

    def __len__(self) -> int:
        return len(self._keys)


class _Miniature:
    """An LRU cache of keys only, fed every sampled reference: hit or miss, then the key is resident
    (unless ``filters`` and it was not seen within the history: then it is only remembered)."""

    def __init__(self, filters: bool) -> None:
        self._filters = filters
        self._order: OrderedDict[Hashable, None] = OrderedDict()
        self._history = _History()

    def reference(self, key: Hashable, capacity: int, history: int) -> bool:
        if key in self._order:
            self._order.move_to_end(key)
            return True
        if self._filters and not self._history.take(key):
            self._history.add(key, history)
            return False
        self._order[key] = None
        while len(self._order) > capacity:
            self._history.add(self._order.popitem(last=False)[0], history)
        return False


class AdaptivePolicy(EvictionPolicy[Key]):
    """Prefix-aware LRU whose second-sight admission filter is on while a sampled duel says it pays."""

    def __init__(self, capacity: int | None = None, sample_every: int = 8, history_factor: float = 4.0,
                 score_limit: int = 64) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"adaptive capacity must be >= 1 or None, not {capacity}")
        if sample_every < 1:
            raise ValueError(f"sample_every must be >= 1, not {sample_every}")
        if history_factor <= 0:
            raise ValueError(f"history_factor must be > 0, not {history_factor}")
        if score_limit < 1:
            raise ValueError(f"score_limit must be >= 1, not {score_limit}")
        self._fixed = capacity
        self._learned = 0
        self._sample_every = sample_every
        self._history_factor = history_factor
        self._limit = score_limit
        self._order: OrderedDict[Key, None] = OrderedDict()  # oldest use first
        self._pending: dict[Key, None] = {}  # the current run of inserts, in insertion order
        self._history = _History()
        self._plain = _Miniature(filters=False)
        self._filtering = _Miniature(filters=True)
        self.score = 0
        """Sampled references only the filtering miniature hit, less those only the plain one hit (clamped)."""

    @property
    def filtering(self) -> bool:
        """Whether first-seen blocks are declined now."""
        return self.score > 0

    def admit(self, key: Key) -> bool:
        self._observe(key)
        if self._history.take(key) or not self.filtering:
            return True
        self._history.add(key, self._history_size())
        return False

    def insert(self, key: Key) -> None:
        if key in self:
            raise KeyError(f"key {key!r} is already tracked")
        self._learned = learned_capacity(self._fixed, self._learned, len(self) + 1)
        self._pending[key] = None

    def restore(self, keys: Iterable[Key]) -> None:
        """Restored blocks (oldest use first) are not one batch of a chain: they keep their order."""
        self._flush()
        for key in keys:
            self.insert(key)
            self._flush()

    def touch(self, key: Key) -> None:
        self._flush()
        self._order.move_to_end(key)  # KeyError for an untracked key
        self._observe(key)

    def remove(self, key: Key) -> None:
        self._flush()
        del self._order[key]

    def evict(self, n: int, protected: Container[Key]) -> list[Key]:
        self._flush()
        victims: list[Key] = []
        parked: list[Key] = []
        try:
            while len(victims) < n:
                key = pop_oldest_unprotected(self._order, protected, parked)
                if key is None:
                    break
                victims.append(key)
        finally:
            unpark(self._order, parked)
        size = self._history_size()
        for key in victims:
            self._history.add(key, size)
        return victims

    def __len__(self) -> int:
        return len(self._order) + len(self._pending)

    def __contains__(self, key: object) -> bool:
        return key in self._order or key in self._pending

    def _capacity(self) -> int:
        return learned_capacity(self._fixed, self._learned, len(self))

    def _history_size(self) -> int:
        return max(1, int(self._capacity() * self._history_factor))

    def _observe(self, key: Key) -> None:
        """Feed a reference to both miniatures when it is sampled, and move the score by who hit."""
        if hash(key) % self._sample_every:
            return
        capacity = max(1, self._capacity() // self._sample_every)
        history = max(1, int(capacity * self._history_factor))
        plain = self._plain.reference(key, capacity, history)
        filtering = self._filtering.reference(key, capacity, history)
        if filtering and not plain:
            self.score = min(self.score + 1, self._limit)
        elif plain and not filtering:
            self.score = max(self.score - 1, -self._limit)

    def _flush(self) -> None:
        """Queue the pending run of inserts deepest first (its last insert becomes the oldest)."""
        if self._pending:
            batch = list(self._pending)
            self._pending.clear()
            for key in reversed(batch):
                self._order[key] = None
