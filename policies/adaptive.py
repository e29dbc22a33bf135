"""Prefix-ordered segmented LRU with an admission filter that switches itself on and off by scoring both
choices on the same stream.

Why: which policy a tier should run depends on the traffic and on the tier's size. Where most
blocks are written once and never read again (long one-off prompts, a small tier), a block should
only be stored on its second sight: first-seen blocks would only push out blocks that are read
again. Where the traffic keeps coming back to what it saw recently (a chat workload in a tier large
enough to hold most conversations), every block should be stored and the oldest should leave: the
filter would turn each conversation's next turn into a miss. Neither is right everywhere (bench/
policies.py measures both regimes), and nobody should have to tune a tier per trace. So the policy
learns which regime it is in, as the trace runs.

How
    * A request's references form a run: the touches of its resident blocks, then the inserts of
      its missing ones (a touch or ``admit`` after an insert starts the next run). A run is applied
      at its end, deepest block first, so within one request the chain's head is the most recent
      use and its tail the least: a chain loses its tail before its head, and what stays is a
      usable prefix (a block is only a hit when every block before it is one).
    * The run's last block, when it was inserted, is queued at the old end instead: a prompt's last
      block is usually partial, and the next turn extends it into a block with a new key, so it is
      almost never read again (bench/policies.py's workloads: 0-3% within 4 x capacity
      references, against 20-60% for the other blocks).
    * Segmented LRU (Karedla et al., "Caching strategies to improve disk system performance", 1994):
      a block read while resident moves to a protected segment of at most ``protected_share`` x
      capacity blocks; new blocks, and blocks pushed out of the protected segment, sit in a
      probation segment, which is evicted first. Blocks read again outlive a burst of one-off
      prompts, while most of the tier still follows recency.
    * ``admit(key)``: a key found in the history (declined or evicted within about
      ``history_factor`` x capacity keys) is admitted. Any other key is admitted while the filter
      is off, and declined (and remembered in the history) while it is on.
    * Two miniature caches run the same mechanism on a sample of the keys, one admitting
      everything, the other admitting on second sight with its own history (Waldspurger et al.,
      "Cache modeling and optimization using miniature simulations", USENIX ATC 2017). They see
      only the keys whose hash is a multiple of ``sample_every`` and hold capacity /
      ``sample_every`` keys each, so they cost O(1) per reference and a fraction of the tier's
      memory. Each run's sampled keys score as a request does: its prefix hits (hits before the
      first sampled miss). A counter moves by the filtering miniature's prefix hits less the plain
      one's, within +-``score_limit`` (so it can turn within a bounded number of references when
      the traffic changes, as set dueling in CPU caches does); the filter is on while the counter
      is above zero. Ties stay with no filter: with no evidence either way, nothing is declined.

References are what ``touch`` (a read of a resident block) and ``admit`` (a block about to be
stored) report: together every block the tier is asked for.

Capacity
    Pass ``capacity``; when it is None the policy uses the largest number of keys it has tracked
    at once (a tier fills before it evicts, so this converges to the tier's size), and the
    segments, the miniatures and the history grow with it.

Every operation is O(1) amortized (a run is applied once, at its end), except that ``evict`` walks
past protected keys at the old end as LRU does (O(1) each per call).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable, Iterable

from kvtier.policies._queues import unpark
from kvtier.policies.base import EvictionPolicy, Key


def _remember(history: OrderedDict[Hashable, None], key: Hashable, limit: int) -> None:
    """Add ``key`` to a history of keys seen recently but not resident, dropping the oldest beyond ``limit``."""
    history[key] = None
    if len(history) > limit:  # one key in, at most one out: limits only grow
        history.popitem(last=False)


class _Miniature:
    """A segmented LRU of keys only, run by the real cache's rules on the sampled keys of each run
    (when ``filters``, a key not seen within the history is only remembered, not stored)."""

    def __init__(self, filters: bool) -> None:
        self._filters = filters
        self._probation: OrderedDict[Hashable, None] = OrderedDict()
        self._protected: OrderedDict[Hashable, None] = OrderedDict()
        self._history: OrderedDict[Hashable, None] = OrderedDict()

    def run(self, keys: list[Hashable], tail: Hashable | None, sizes: tuple[int, int, int]) -> int:
        """Reference ``keys`` (one run's sampled keys, in request order; ``tail`` is the run's last
        key, None for a run of one) and return the run's prefix hits: resident keys before the first
        that is not."""
        probation, protected = self._probation, self._protected
        hits = 0
        for key in keys:
            if key not in probation and key not in protected:
                break
            hits += 1
        capacity, protected_limit, history = sizes
        for key in reversed(keys):  # deepest first, as the real cache applies a run
            if key in protected:
                protected.move_to_end(key)
            elif key in probation:
                del probation[key]
                protected[key] = None
            elif self._filters and self._history.pop(key, self) is self:
                _remember(self._history, key, history)
            else:
                probation[key] = None
                if key == tail:
                    probation.move_to_end(key, last=False)
        while len(protected) > protected_limit:
            probation[protected.popitem(last=False)[0]] = None
        while len(probation) + len(protected) > capacity:
            _remember(self._history, (probation or protected).popitem(last=False)[0], history)
        return hits


class AdaptivePolicy(EvictionPolicy[Key]):
    """Prefix-ordered segmented LRU whose second-sight admission filter is on while a sampled duel says it pays."""

    def __init__(self, capacity: int | None = None, sample_every: int = 4, history_factor: float = 4.0,
                 score_limit: int = 64, protected_share: float = 0.3) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"adaptive capacity must be >= 1 or None, not {capacity}")
        if sample_every < 1 or sample_every & (sample_every - 1):
            raise ValueError(f"sample_every must be a power of two, not {sample_every}")
        if history_factor <= 0:
            raise ValueError(f"history_factor must be > 0, not {history_factor}")
        if score_limit < 1:
            raise ValueError(f"score_limit must be >= 1, not {score_limit}")
        if not 0.0 <= protected_share < 1.0:
            raise ValueError(f"protected_share must be in [0, 1), not {protected_share}")
        self._fixed = capacity
        self._learned = 0
        self._sized = 0  # the capacity the history, the segment and the miniatures are sized for
        self._sample_every = sample_every
        self._mask = sample_every - 1  # a key is sampled when its hash is a multiple of sample_every
        self._history_factor = history_factor
        self._protected_share = protected_share
        self._limit = score_limit
        self._history_limit = 1
        self._protected_limit = 0
        self._mini_sizes = (1, 0, 1)  # a miniature's capacity, protected segment's limit and history's limit
        self._probation: OrderedDict[Key, None] = OrderedDict()  # oldest use first; evicted first
        self._protected: OrderedDict[Key, None] = OrderedDict()  # read while resident; oldest use first
        self._run: dict[Key, bool | None] = {}  # the current run: key -> inserted, touched (False) or asked (None)
        self._inserted = 0  # inserts in the current run (tracked, not yet in a segment)
        self._sampled: list[Key] = []  # the current run's sampled references, in order
        self._last: Key | None = None  # the current run's last reference
        self._history: OrderedDict[Key, None] = OrderedDict()  # declined or evicted, oldest first
        self._plain = _Miniature(filters=False)
        self._filtering = _Miniature(filters=True)
        self.score = 0
        """Sampled prefix hits only the filtering miniature had, less the plain one's (clamped)."""
        self.filtering = False
        """Whether first-seen blocks are declined now (``score`` > 0)."""
        if capacity is not None:
            self._resize(capacity)

    # The per-reference paths (admit, insert, touch) inline their cheap checks: they run once per block.

    def admit(self, key: Key) -> bool:
        run = self._run
        if self._inserted or key in run or len(run) >= self._history_limit:
            self._end_run()  # a tier asks before it stores: the next request's blocks start a new run
        run[key] = None
        self._last = key
        if not hash(key) & self._mask:
            self._sampled.append(key)
        if not self.filtering or self._history.pop(key, self) is not self:
            return True
        _remember(self._history, key, self._history_limit)
        return False

    def insert(self, key: Key) -> None:
        run = self._run
        if run.get(key) is True or key in self._probation or key in self._protected:
            raise KeyError(f"key {key!r} is already tracked")
        run[key] = True
        self._inserted += 1
        if self._fixed is None:  # sized again at the run's end
            self._learned = max(self._learned, len(self._probation) + len(self._protected) + self._inserted)

    def restore(self, keys: Iterable[Key]) -> None:
        """Restored blocks (oldest use first) are not one request's chain: each is a run of its own."""
        self._end_run()
        for key in keys:
            self.insert(key)
            self._end_run()

    def touch(self, key: Key) -> None:
        run = self._run
        if self._inserted or key in run:
            self._end_run()
        if key not in self._probation and key not in self._protected:
            raise KeyError(f"key {key!r} is not tracked")
        run[key] = False
        self._last = key
        if not hash(key) & self._mask:
            self._sampled.append(key)

    def remove(self, key: Key) -> None:
        self._end_run()
        if self._probation.pop(key, self) is self:
            del self._protected[key]

    def evict(self, n: int, protected: Container[Key]) -> list[Key]:
        if self._inserted:  # pending inserts are tracked, so they must be evictable
            self._end_run()
        victims: list[Key] = []
        run, history = self._run, self._history
        for segment in (self._probation, self._protected):  # oldest first; protected keys keep their place
            parked: list[Key] = []
            while len(victims) < n and segment:
                key = segment.popitem(last=False)[0]
                if key in protected:
                    parked.append(key)
                else:
                    victims.append(key)
                    if key in run:
                        run[key] = None  # touched in this run, and gone now
                    history[key] = None
            unpark(segment, parked)
        while len(history) > self._history_limit:
            history.popitem(last=False)
        return victims

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected) + self._inserted

    def __contains__(self, key: object) -> bool:
        return key in self._probation or key in self._protected or self._run.get(key) is True  # type: ignore[call-overload]

    def _resize(self, capacity: int) -> None:
        """Size the history, the protected segment and the miniatures for a tier of ``capacity`` blocks."""
        self._sized = capacity
        self._history_limit = max(1, int(capacity * self._history_factor))
        self._protected_limit = int(capacity * self._protected_share)
        mini = max(1, capacity // self._sample_every)
        self._mini_sizes = (mini, int(mini * self._protected_share), max(1, int(mini * self._history_factor)))

    def _end_run(self) -> None:
        """Apply the run deepest first: touched keys to the protected segment's new end, inserted ones to
        probation's (its last reference, if inserted, to probation's old end); then score the miniatures."""
        run, probation, protected = self._run, self._probation, self._protected
        if self._learned > self._sized:
            self._resize(self._learned)
        for key, state in reversed(run.items()):
            if state:
                probation[key] = None
            elif state is False:
                if probation.pop(key, self) is self:
                    del protected[key]
                protected[key] = None
        tail = self._last if len(run) > 1 else None  # one block alone is no chain: it has no tail
        if run.get(tail) is True:  # type: ignore[arg-type]
            probation.move_to_end(tail, last=False)  # type: ignore[arg-type]
        while len(protected) > self._protected_limit:
            probation[protected.popitem(last=False)[0]] = None
        if self._sampled:
            sizes = self._mini_sizes
            gain = self._filtering.run(self._sampled, tail, sizes) - self._plain.run(self._sampled, tail, sizes)
            self.score = max(-self._limit, min(self._limit, self.score + gain))
            self.filtering = self.score > 0
            self._sampled.clear()
        run.clear()
        self._inserted = 0
        self._last = None
