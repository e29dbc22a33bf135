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
    * A run is what one call of the tier's user leaves: the touches of resident blocks, then the
      inserts of missing ones (a touch or ``admit`` after an insert starts the next run). A run is
      applied at its end, deepest block first, so within one request the chain's head is the most
      recent use and its tail the least: a chain loses its tail before its head, and what stays is
      a usable prefix (a block is only a hit when every block before it is one). A tier whose
      blocks arrive as demotion batches (victims of the tier above, oldest first) gets the same:
      a chain's head leaves the tier above first, and here it stays longest.
    * The run's last block, when it was inserted, is queued at the old end instead, while that
      pays: a prompt's last block is usually partial, and the next turn extends it into a block
      with a new key, so it is almost never read again (bench/policies.py's workloads: 0-3% within
      4 x capacity references, against 20-60% for the other blocks). In a demotion batch the last
      block is just the youngest victim, often the middle of a chain, and queuing it first would
      cut that chain. So the policy watches a sample of inserted blocks (the sampled keys below)
      and applies the rule only while the sampled run tails are referenced again at most half as
      often as the other sampled inserted blocks (and before there is any evidence).
    * Segmented LRU (Karedla et al., "Caching strategies to improve disk system performance", 1994):
      a block read while resident moves to a protected segment of at most ``protected_share`` x
      capacity blocks; new blocks, and blocks pushed out of the protected segment, sit in a
      probation segment, which is evicted first. Blocks read again outlive a burst of one-off
      prompts, while most of the tier still follows recency.
    * ``admit(key)``: a key found in the history (declined or evicted within the last
      ``history_factor`` / 2 to ``history_factor`` x capacity keys: two generations of Bloom filters) is
      admitted. Any other key is admitted while the filter is off, and declined (and remembered in
      the history) while it is on.
    * Two miniature caches run the same mechanism on a sample of the keys, one admitting
      everything, the other admitting on second sight with its own history (Waldspurger et al.,
      "Cache modeling and optimization using miniature simulations", USENIX ATC 2017). They see
      only the keys whose hash is a multiple of ``sample_every`` and hold capacity /
      ``sample_every`` keys each (a ``bytes`` key's xxh3 picks them, so runs repeat),
      so they cost O(1) per reference and a fraction of the tier's memory. Above ``SAMPLE_CAP`` keys
      (tiers of more than ~128 K blocks) a miniature sees a further sample of the sampled keys (by
      other bits of that hash), so its size stops growing with the tier: a fixed number of sampled keys models
      a cache of any size about as well (Waldspurger et al., "Efficient MRC construction with SHARDS",
      FAST 2015), and a tier of 10 M blocks keeps ~16 K keys per miniature, not 1.25 M. Each run's sampled keys
      score as a request does: its prefix hits (hits before the first sampled miss). A counter
      moves by the filtering miniature's prefix hits less the plain one's, within
      +-``score_limit`` (so it can turn within a bounded number of references when the traffic
      changes, as set dueling in CPU caches does); the filter is on while the counter
      is above zero. Ties stay with no filter: with no evidence either way, nothing is declined.

References are what ``touch`` (a read of a resident block) and ``admit`` (a block about to be
stored) report: together every block the tier is asked for.

Capacity
    Pass ``capacity``; when it is None the policy uses the largest number of keys it has tracked
    at once (a tier fills before it evicts, so this converges to the tier's size), and the
    segments, the miniatures and the histories grow with it.

Every operation is O(1) amortized (a run is applied once, at its end), except that ``evict`` walks
past protected keys at the old end as LRU does (O(1) each per call).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable, Mapping, Sequence
from typing import Generic, TypeVar

import numpy as np
import xxhash

from kvtier.policies._slots import SlotQueues
from kvtier.policies.base import EvictionPolicy, Key

K = TypeVar("K", bound=Hashable)

PROBATION, PROTECTED = 0, 1  # the segments' queues

SAMPLE_CAP = 1 << 14
"""The most keys a miniature holds, and a generation of watched keys takes, before they see only a further
sample of the sampled keys (``_thinning``): their memory and time per reference stop growing with the tier."""

BITS_PER_KEY = 10
"""Bloom filter bits per key a history remembers (at least: a filter's size is a power of two): with
three probes, under 1.7% of the keys it never saw look remembered (a first-seen block admitted while
the filter is on: harmless)."""


def _digest(key: Hashable) -> int:
    """The 128-bit hash a history's probes come from, the same in every process (Python salts ``hash``
    of bytes and str per process, and the same traffic must get the same decisions in every run).
    Computed once per key and call: both generations, and a key remembered when not found, probe with it."""
    if isinstance(key, bytes):
        data = key
    elif isinstance(key, int):
        data = key.to_bytes(16, "little", signed=True)
    else:
        data = repr(key).encode()
    return xxhash.xxh3_128_intdigest(data)


_hash64 = xxhash.xxh3_64_intdigest
"""A ``bytes`` key's sampling hash (see ``AdaptivePolicy._mask``): the same in every process."""


def _thinning(count: int) -> tuple[int, int]:
    """The mask of the further sample (``_thinned``) that keeps ``count`` sampled keys at most ``SAMPLE_CAP``,
    and how many of them it keeps."""
    mask = (1 << ((count - 1) // SAMPLE_CAP).bit_length()) - 1 if count > SAMPLE_CAP else 0
    return mask, max(1, count // (mask + 1))


def _thinned(key: Hashable, mask: int) -> bool:
    """Whether a sampled key is in the further sample of 1 in ``mask`` + 1: by other bits of the hash
    whose lowest picked it for the sample, the same in every process, as the first sample."""
    bits = _hash64(key) >> 32 if isinstance(key, bytes) else _digest(key) >> 64
    return not bits & mask


class _History(Generic[K]):
    """Keys seen recently but not stored: two generations of Bloom filters, the older dropped whole when
    the newer has taken ``half`` keys, so it remembers the last ``half`` to 2 x ``half`` keys added.
    Bits, not the keys: a tier of 10 M blocks remembers up to 40 M evicted or declined keys, which as
    a set (and the key objects it kept alive) cost more than the tier's whole index; as filters, 5
    to 10 bytes per block of the tier. A filter cannot forget one key: a key found stays remembered."""

    __slots__ = ("new", "old", "added", "old_added", "half")

    def __init__(self) -> None:
        self.half = 1
        self.new = self._filter()
        self.old = self._filter()
        self.added = self.old_added = 0

    def _filter(self) -> bytearray:
        return bytearray(max(8, 1 << (self.half * BITS_PER_KEY - 1).bit_length()) // 8)

    def resize(self, half: int) -> None:
        """Remember ``half`` to 2 x ``half`` keys from now on. A filter with too few bits for that would
        fill up and then say every key was seen, so a generation of the new size starts at once (the
        current one becomes the old, remembered as it is); sizes are powers of two, so a growing tier
        starts a new one a few times, not at every step."""
        self.half = half
        if len(self.new) * 8 < half * BITS_PER_KEY:
            self.old, self.new = self.new, self._filter()
            self.old_added, self.added = self.added, 0

    def take(self, key: K) -> bool:
        """Whether ``key`` was remembered (or is one of the few false positives)."""
        return self._holds(_digest(key))

    def recall(self, key: K) -> bool:
        """``take``, and when the key was not remembered, ``add`` it: one hash for both."""
        h = _digest(key)
        if self._holds(h):
            return True
        self._add(h)
        return False

    def add(self, key: K) -> None:
        self._add(_digest(key))

    def _holds(self, h: int) -> bool:
        for bits in (self.new, self.old):
            mask = len(bits) * 8 - 1  # three bit positions in a filter of mask + 1 bits
            a, b, c = h & mask, (h >> 42) & mask, (h >> 84) & mask
            if bits[a >> 3] >> (a & 7) & bits[b >> 3] >> (b & 7) & bits[c >> 3] >> (c & 7) & 1:
                return True
        return False

    def _add(self, h: int) -> None:
        bits = self.new
        mask = len(bits) * 8 - 1
        a, b, c = h & mask, (h >> 42) & mask, (h >> 84) & mask
        bits[a >> 3] |= 1 << (a & 7)
        bits[b >> 3] |= 1 << (b & 7)
        bits[c >> 3] |= 1 << (c & 7)
        self.added += 1
        if self.added >= self.half:
            self.old, self.new = self.new, self._filter()
            self.old_added, self.added = self.added, 0

    def __len__(self) -> int:
        """Keys added to the two generations (what it may remember)."""
        return self.added + self.old_added


class _Miniature(Generic[K]):
    """A segmented LRU of keys only, run by the real cache's rules on the sampled keys of each run
    (when ``filters``, a key not seen within the history is only remembered, not stored)."""

    def __init__(self, filters: bool) -> None:
        self._filters = filters
        self._probation: OrderedDict[K, None] = OrderedDict()
        self._protected: OrderedDict[K, None] = OrderedDict()
        self._history: _History[K] = _History()

    def run(self, keys: list[K], tail: K | None, capacity: int, protected_limit: int, history: int) -> int:
        """Reference ``keys`` (one run's sampled keys, in request order; ``tail`` is the run's last
        key when the last-block rule applies, else None) and return the run's prefix hits: resident
        keys before the first that is not."""
        probation, protected = self._probation, self._protected
        hits = 0
        for key in keys:
            if key not in probation and key not in protected:
                break
            hits += 1
        remembered = self._history
        remembered.resize(history)
        filters = self._filters
        for key in reversed(keys):  # deepest first, as the real cache applies a run
            if key in protected:
                protected.move_to_end(key)
            elif key in probation:
                del probation[key]
                protected[key] = None
            elif not filters or remembered.recall(key):  # (a first sight is only remembered)
                probation[key] = None
                if key == tail:
                    probation.move_to_end(key, last=False)
        while len(protected) > protected_limit:
            probation[protected.popitem(last=False)[0]] = None
        excess = len(probation) + len(protected) - capacity
        while excess > 0:
            remembered.add((probation or protected).popitem(last=False)[0])
            excess -= 1
        return hits


class AdaptivePolicy(EvictionPolicy[Key]):
    """Prefix-ordered segmented LRU whose second-sight admission filter is on while a sampled duel says it pays."""

    def __init__(
        self,
        capacity: int | None = None,
        sample_every: int = 8,
        history_factor: float = 4.0,
        score_limit: int = 64,
        protected_share: float = 0.3,
    ) -> None:
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
        # A key is sampled when its hash (a ``bytes`` key: its xxh3-64, ``_hash64``) is a multiple of
        # sample_every. Not one of its bytes: no byte is uniform in every key a tier sees (a tenant's
        # begin with its tag, vLLM's offload keys and kvtier's keys of hybrid models end in a group
        # index), and a key sampled by a fixed byte was sampled with all its tenant's or group's, or
        # none of them were. Not ``hash`` of bytes: Python salts it per process, so the same traffic
        # would get different admission decisions in every run.
        # The test is inlined in touch and admit, which run once per block.
        self._mask = sample_every - 1
        self._history_factor = history_factor
        self._protected_share = protected_share
        self._limit = score_limit
        self._run_limit = 1  # a run ends at this many references (the history's size)
        self._protected_limit = 0
        self._mini_sizes = (1, 0, 1)  # a miniature's capacity, protected segment's limit and history generation
        self._mini_mask = 0  # the miniatures' further sample (``_thinned``): 0 while they see every sampled key
        self._watch_mask = 0  # the same for the keys watched
        # The two segments, oldest use first: PROBATION (evicted first), PROTECTED (read while resident).
        self._segments: SlotQueues[Key] = SlotQueues(2)
        self._run: dict[Key, bool | None] = {}  # the current run: key -> inserted, touched (False) or asked (None)
        self._inserted = 0  # the current run's inserts (tracked, not yet in a segment)
        self._sampled: list[Key] = []  # the current run's sampled references, in order
        self._history: _History[Key] = _History()  # declined or evicted
        self._plain: _Miniature[Key] = _Miniature(filters=False)
        self._filtering: _Miniature[Key] = _Miniature(filters=True)
        # Sampled inserted keys watched for a later reference: key -> whether it was its run's tail;
        # two generations, and per kind (other, tail) how many were watched and referenced again.
        self._watched: dict[Key, bool] = {}
        self._watched_old: dict[Key, bool] = {}
        self._watch_half = 1
        self._seen = [0, 0]
        self._reused = [0, 0]
        self.score = 0
        """Sampled prefix hits only the filtering miniature had, less the plain one's (clamped)."""
        self.filtering = False
        """Whether first-seen blocks are declined now (``score`` > 0)."""
        self.tail_first = True
        """Whether a run's last inserted block is queued at the old end (its sampled reuse is low)."""
        if capacity is not None:
            self._resize(capacity)

    # The per-reference paths (admit, insert, touch) inline their cheap checks: they run once per block.

    def admit(self, key: Key) -> bool:
        run = self._run
        if self._inserted or key in run:
            self._end_run()  # a tier asks before it stores: the next request's blocks start a new run
        run[key] = None
        if not (_hash64(key) if isinstance(key, bytes) else hash(key)) & self._mask:  # sampled (see _mask)
            self._sampled.append(key)
        if not self.filtering:
            return True
        if self._history.recall(key):
            return True
        if len(run) >= self._run_limit:
            self._end_run()  # nothing stored for this long: a run must end somewhere
        return False

    def bind(self, index: Mapping[Key, int], capacity: int) -> None:
        self._segments.bind(index, capacity)

    def insert(self, key: Key) -> None:
        run = self._run
        if run.get(key) or self._segments.queue_of(key) is not None:
            raise KeyError(f"key {key!r} is already tracked")
        run[key] = True
        self._inserted += 1

    def restore(self, keys: Sequence[Key], slots: Sequence[int] | np.ndarray | None = None) -> None:
        """Restored blocks (oldest use first) are not one request's chain: each is a run of its own,
        which puts it at probation's young end, the whole list at once."""
        self._end_run()
        self._segments.push_many(keys, PROBATION, slots)
        self._note_size()

    def touch(self, key: Key) -> None:
        run = self._run
        if self._inserted or key in run:
            self._end_run()
        if self._segments.queue_of(key) is None:
            raise KeyError(f"key {key!r} is not tracked")
        run[key] = False
        if not (_hash64(key) if isinstance(key, bytes) else hash(key)) & self._mask:  # sampled (see _mask)
            self._sampled.append(key)

    def remove(self, key: Key) -> None:
        self._end_run()
        self._segments.remove(key)

    def evict(self, n: int, protected: Container[Key]) -> list[Key]:
        if self._inserted:  # pending inserts are tracked, so they must be evictable
            self._end_run()
        segments = self._segments  # oldest first; protected keys keep their place
        victims = segments.take_oldest(PROBATION, n, protected)
        if len(victims) < n:
            victims += segments.take_oldest(PROTECTED, n - len(victims), protected)
        for victim in victims:
            self._history.add(victim)
        return victims

    def __len__(self) -> int:
        return len(self._segments) + self._inserted

    def __contains__(self, key: object) -> bool:
        return self._segments.queue_of(key) is not None or self._run.get(key) is True  # type: ignore[arg-type]

    def _resize(self, capacity: int) -> None:
        """Size the history, the protected segment and the miniatures for a tier of ``capacity`` blocks."""
        self._sized = capacity
        limit = max(1, int(capacity * self._history_factor))
        self._run_limit = limit
        self._history.resize(max(1, limit // 2))
        self._watch_mask, self._watch_half = _thinning(max(1, limit // self._sample_every // 2))
        self._protected_limit = int(capacity * self._protected_share)
        self._mini_mask, mini = _thinning(max(1, capacity // self._sample_every))
        self._mini_sizes = (mini, int(mini * self._protected_share), max(1, int(mini * self._history_factor) // 2))

    def _note_size(self) -> None:
        """Learn the capacity from the most keys tracked at once (see the module's Capacity)."""
        tracked = len(self._segments)
        if tracked > self._learned:
            self._learned = tracked
            if self._fixed is None and tracked > self._sized:
                self._resize(tracked)

    def _end_run(self) -> None:
        """Apply the run deepest first: touched keys to the protected segment's new end, inserted ones to
        probation's (its last reference, if inserted and ``tail_first``, to probation's old end); then
        score the miniatures and the tail rule."""
        run = self._run
        if not run:
            return
        segments = self._segments
        if self._inserted:  # (the two segments are apart: inserts and reads can be applied one after the other)
            segments.extend([key for key, inserted in reversed(run.items()) if inserted], PROBATION)
        if self._inserted < len(run):
            for key, inserted in reversed(run.items()):
                if inserted is False and segments.queue_of(key) is not None:  # (None: asked, not stored)
                    segments.move(key, PROTECTED)
                # else: inserted, or evicted since it was read
        tail = next(reversed(run)) if len(run) > 1 else None  # one block alone is no chain: it has no tail
        if tail is not None and not run[tail]:
            tail = None  # the last reference was a read (or a declined block): nothing to queue first
        if tail is not None and self.tail_first:
            segments.move(tail, PROBATION, oldest=True)
        self._note_size()
        while segments.length(PROTECTED) > self._protected_limit:
            segments.push(segments.pop_oldest(PROTECTED), PROBATION)  # type: ignore[arg-type]
        sampled = self._sampled
        if sampled:
            self._watch(sampled, tail)
            mask = self._mini_mask
            seen = [key for key in sampled if _thinned(key, mask)] if mask else sampled
            mini_tail = tail if self.tail_first else None
            capacity, protected_limit, history = self._mini_sizes
            gain = self._filtering.run(seen, mini_tail, capacity, protected_limit, history) - self._plain.run(
                seen, mini_tail, capacity, protected_limit, history
            )
            if gain:
                limit = self._limit
                self.score = score = max(-limit, min(limit, self.score + gain))
                self.filtering = score > 0
            sampled.clear()
        run.clear()
        self._inserted = 0

    def _watch(self, sampled: list[Key], tail: Key | None) -> None:
        """Count the sampled keys referenced again since they were inserted (per kind: run tail or
        not), watch those this run inserted, and set ``tail_first``: on while the tails' share
        referenced again is at most half the others' (with no evidence, on)."""
        run, watched, old, seen, reused = self._run, self._watched, self._watched_old, self._seen, self._reused
        mask = self._watch_mask
        for key in sampled:
            kind = watched.pop(key, None)
            if kind is None:
                kind = old.pop(key, None)
            if kind is not None:
                reused[kind] += 1
            if run[key] and (not mask or _thinned(key, mask)):
                is_tail = key == tail
                watched[key] = is_tail
                seen[is_tail] += 1
        if len(watched) >= self._watch_half:
            self._watched_old, self._watched = watched, {}
            for counts in (seen, reused):  # decay: the evidence of the last two generations or so
                counts[0] //= 2
                counts[1] //= 2
        self.tail_first = 2 * reused[1] * seen[0] <= reused[0] * seen[1]
