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
      deepest first (as in ``kvtier.policies.s3fifo_prefix``; any other call ends a run): a tier
      commits a request's new blocks in chain order, and a chain should lose its tail before its
      head, which keeps what stays a usable prefix.
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

Every operation is O(1) amortized, except that ``evict`` walks past protected keys at the old end as
LRU does (O(1) each per call).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable, Iterable

from kvtier.policies.base import EvictionPolicy, Key


def _remember(history: OrderedDict[Hashable, None], key: Hashable, limit: int) -> None:
    """Add ``key`` to a history of keys seen recently but not resident, dropping the oldest beyond ``limit``."""
    history[key] = None
    if len(history) > limit:  # one key in, at most one out: limits only grow
        history.popitem(last=False)


class _Miniature:
    """An LRU cache of keys only, fed every sampled reference: hit or miss, then the key is resident
    (unless ``filters`` and it was not seen within the history: then it is only remembered)."""

    def __init__(self, filters: bool) -> None:
        self._filters = filters
        self._order: OrderedDict[Hashable, None] = OrderedDict()
        self._history: OrderedDict[Hashable, None] = OrderedDict()

    def reference(self, key: Hashable, capacity: int, history: int) -> bool:
        if key in self._order:
            self._order.move_to_end(key)
            return True
        if self._filters and self._history.pop(key, self) is self:
            _remember(self._history, key, history)
            return False
        self._order[key] = None
        while len(self._order) > capacity:
            _remember(self._history, self._order.popitem(last=False)[0], history)
        return False


class AdaptivePolicy(EvictionPolicy[Key]):
    """Prefix-aware LRU whose second-sight admission filter is on while a sampled duel says it pays."""

    def __init__(self, capacity: int | None = None, sample_every: int = 8, history_factor: float = 4.0,
                 score_limit: int = 64) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"adaptive capacity must be >= 1 or None, not {capacity}")
        if sample_every < 1 or sample_every & (sample_every - 1):
            raise ValueError(f"sample_every must be a power of two, not {sample_every}")
        if history_factor <= 0:
            raise ValueError(f"history_factor must be > 0, not {history_factor}")
        if score_limit < 1:
            raise ValueError(f"score_limit must be >= 1, not {score_limit}")
        self._fixed = capacity
        self._learned = 0
        self._sizes = (1, 1, 1)  # the history's limit, a miniature's capacity and its history's limit
        self._sample_every = sample_every
        self._mask = sample_every - 1  # a key is sampled when its hash is a multiple of sample_every
        self._history_factor = history_factor
        self._limit = score_limit
        self._order: OrderedDict[Key, None] = OrderedDict()  # oldest use first
        self._move_to_end = self._order.move_to_end
        self._pending: dict[Key, None] = {}  # the current run of inserts, in insertion order
        self._history: OrderedDict[Key, None] = OrderedDict()  # declined or evicted, oldest first
        self._plain = _Miniature(filters=False)
        self._filtering = _Miniature(filters=True)
        self.score = 0
        """Sampled references only the filtering miniature hit, less those only the plain one hit (clamped)."""
        self.filtering = False
        """Whether first-seen blocks are declined now (``score`` > 0)."""
        if capacity is not None:
            self._resize(capacity)

    # The per-reference paths (admit, insert, touch) inline their cheap checks: they run once per block.

    def admit(self, key: Key) -> bool:
        if self._pending:  # a tier asks before it stores: the next request's blocks start a new run
            self._flush()
        if not hash(key) & self._mask:
            self._observe(key)
        if not self.filtering or self._history.pop(key, self) is not self:
            return True
        _remember(self._history, key, self._sizes[0])
        return False

    def insert(self, key: Key) -> None:
        if key in self._order or key in self._pending:
            raise KeyError(f"key {key!r} is already tracked")
        self._pending[key] = None
        tracked = len(self._order) + len(self._pending)
        if tracked > self._learned:
            self._learned = tracked
            if self._fixed is None:
                self._resize(tracked)

    def restore(self, keys: Iterable[Key]) -> None:
        """Restored blocks (oldest use first) are not one batch of a chain: they keep their order."""
        self._flush()
        for key in keys:
            self.insert(key)
            self._flush()

    def touch(self, key: Key) -> None:
        if self._pending:
            self._flush()
        self._move_to_end(key)  # KeyError for an untracked key
        if not hash(key) & self._mask:
            self._observe(key)

    def remove(self, key: Key) -> None:
        self._flush()
        del self._order[key]

    def evict(self, n: int, protected: Container[Key]) -> list[Key]:
        if self._pending:
            self._flush()
        victims: list[Key] = []
        for key in self._order:  # oldest first; protected keys keep their place
            if len(victims) >= n:
                break
            if key not in protected:
                victims.append(key)
        for key in victims:
            del self._order[key]
        for key in victims:
            self._history[key] = None
        while len(self._history) > self._sizes[0]:
            self._history.popitem(last=False)
        return victims

    def __len__(self) -> int:
        return len(self._order) + len(self._pending)

    def __contains__(self, key: object) -> bool:
        return key in self._order or key in self._pending

    def _resize(self, capacity: int) -> None:
        """Size the history and the miniatures for a tier of ``capacity`` blocks."""
        mini = max(1, capacity // self._sample_every)
        self._sizes = (max(1, int(capacity * self._history_factor)), mini, max(1, int(mini * self._history_factor)))

    def _observe(self, key: Key) -> None:
        """Feed a sampled reference to both miniatures, and move the score by who hit."""
        _, capacity, history = self._sizes
        plain = self._plain.reference(key, capacity, history)
        filtering = self._filtering.reference(key, capacity, history)
        if filtering and not plain:
            self.score = min(self.score + 1, self._limit)
        elif plain and not filtering:
            self.score = max(self.score - 1, -self._limit)
        self.filtering = self.score > 0

    def _flush(self) -> None:
        """Queue the pending run of inserts deepest first (its last insert becomes the oldest)."""
        for key in reversed(self._pending):
            self._order[key] = None
        self._pending.clear()
