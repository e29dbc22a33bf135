"""Why a prefix missed: the reasons, a bounded memory of what left each tier, and counters.

A lookup that ends before the prompt's last full block costs the engine a recompute; this module says
why it ended there, once per such lookup, in total and per tier:

- ``MissReason``: the answer (its values are Prometheus label values: stable);
- ``GhostIndex``: what happened to recent keys in each tier (evicted, declined, dropped, damaged),
  in a fixed number of entries, so "evicted" and "dropped" can be told from "never stored";
- ``MissCounter``: counts per reason, in total and per tier, with a delta form (``take``) for
  engines that report per step;
- ``Misses``: one per stack: classifies a lookup's first missing block (``explain``), counts it
  (``count``) and writes the ``kvtier.misses`` debug line.

Only statistics come from here: a wrong attribution (two keys whose 64-bit digests collide, an entry
forgotten) misnames a reason, never changes what a lookup or a load returns.
"""

from __future__ import annotations

import enum
import logging
import secrets
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import xxhash

from kvtier.core.namespaces import said

log = logging.getLogger("kvtier.misses")

DEFAULT_GHOST_ENTRIES = 65536
"""Keys the ghost index remembers by default: about 5 MiB at most, about 76 bytes each (measured with
tracemalloc at 65,535 entries: two dicts of int digests to int reasons; 0.5 M records/s one key per call,
3 M/s batched, 0.8 M lookups/s, one core; the test holds it under 200 bytes each)."""

TOTAL = "all"
"""The tier label of the totals in ``MissCounter.counts``: one reason per lookup, whatever the tier."""


class MissReason(enum.Enum):
    """Why the first missing block of a lookup is not there (in total), or not in one tier."""

    NEVER_STORED = "never_stored"  # nothing here ever held it, or that was forgotten
    EVICTED = "evicted"  # the tier's policy chose it as a victim (a remote tier: its store lost it)
    DECLINED = "declined"  # the tier's admission policy did not take it
    DROPPED = "dropped"  # a store of it did not land: no room, refused, failed, timed out, quarantined
    DAMAGED = "damaged"  # a load of it failed its checksum, header or MAC check (or could not be read)
    REMOTE_ERROR = "remote_error"  # the remote store did not answer in time, or failed
    OTHER_NAMESPACE = "other_namespace"  # stored under another namespace (block size, namespace, geometry)
    PARTIAL_BLOCK = "partial_block"  # every full block hit; the prompt's last block is partial (never stored)


_GHOSTLY = (MissReason.EVICTED, MissReason.DECLINED, MissReason.DROPPED, MissReason.DAMAGED, MissReason.REMOTE_ERROR)
_CODE = {reason: code for code, reason in enumerate(_GHOSTLY, 1)}  # 4 bits per tier; 0: no entry


class GhostIndex:
    """Per key, what last happened to it in each tier (``record``), for at most ``entries`` keys.

    A key is named by its 64-bit xxh3 digest under a seed drawn per process (a tenant of a shared store
    cannot craft keys whose digests collide with another's), and its value is one int: 4 bits per tier
    (the reason, 0 for none), so one entry per key answers for every tier. Two generations of dicts
    hold them: a record goes into the young one; when that is full it becomes the old one and the
    previous old one is forgotten whole. Insert and lookup are O(1), memory is bounded by ``entries``
    keys, and the oldest half goes first (a key recorded again moves to the young generation).

    Thread safe: the planner records from completion threads while lookups read."""

    def __init__(self, num_tiers: int, entries: int = DEFAULT_GHOST_ENTRIES) -> None:
        if entries < 2:
            raise ValueError(f"a ghost index needs at least 2 entries, got {entries}")
        self.num_tiers = num_tiers
        self._half = entries // 2
        self._young: dict[int, int] = {}
        self._old: dict[int, int] = {}
        self._seed = secrets.randbits(64)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._young) + len(self._old)

    def record(self, tier: int, keys: Iterable[bytes], reason: MissReason) -> None:
        """Remember that ``keys`` left tier ``tier`` (or never got in) for ``reason``."""
        code, shift = _CODE[reason], 4 * tier
        with self._lock:
            for key in keys:
                digest = xxhash.xxh3_64_intdigest(key, self._seed)
                value = self._young.get(digest)
                if value is None:
                    value = self._old.pop(digest, 0)
                    if len(self._young) >= self._half:
                        self._old, self._young = self._young, {}
                self._young[digest] = (value & ~(0xF << shift)) | code << shift

    def forget(self, tier: int, keys: Iterable[bytes]) -> None:
        """Clear tier ``tier``'s entries of ``keys`` (they are there now: an old reason would be stale)."""
        mask = ~(0xF << (4 * tier))
        with self._lock:
            for key in keys:
                digest = xxhash.xxh3_64_intdigest(key, self._seed)
                for generation in (self._young, self._old):
                    value = generation.get(digest)
                    if value is not None:
                        generation[digest] = value & mask
                        break

    def reasons(self, key: bytes) -> list[MissReason | None]:
        """Per tier the reason recorded for ``key`` (None: none)."""
        digest = xxhash.xxh3_64_intdigest(key, self._seed)
        with self._lock:
            value = self._young.get(digest)
            if value is None:
                value = self._old.get(digest, 0)
        codes = [(value >> (4 * t)) & 0xF for t in range(self.num_tiers)]
        return [_GHOSTLY[code - 1] if code else None for code in codes]


@dataclass(frozen=True)
class Miss:
    """Why one lookup ended early: ``hits`` of ``blocks`` full blocks were found; the first missing
    block is absent for ``reason``, which happened in ``tier`` (None: in none, e.g. never stored);
    ``by_tier``: why it is absent from each tier; ``differing``: for ``OTHER_NAMESPACE``, the
    namespace fields that differ from the stack that stored it, ``{field: (here, there)}``."""

    hits: int
    blocks: int
    reason: MissReason
    tier: str | None
    by_tier: dict[str, MissReason]
    differing: dict[str, tuple[object, object]] = field(default_factory=dict)


def in_other_namespace(miss: Miss, found: Mapping[str, Mapping[str, tuple[object, object]]]) -> Miss:
    """``miss``, a block never stored, told as stored under another namespace in the tiers ``found``
    names (each with the fields that differ there, ``{field: (ours, theirs)}``;
    ``core/namespaces.OtherNamespaces.find``): their reason, and in total the deepest of them."""
    tier = [name for name in miss.by_tier if name in found][-1]
    by_tier = {name: MissReason.OTHER_NAMESPACE if name in found else why for name, why in miss.by_tier.items()}
    return Miss(miss.hits, miss.blocks, MissReason.OTHER_NAMESPACE, tier, by_tier, dict(found[tier]))


class MissCounter:
    """Lookups that ended early, per reason: in total and per tier. Thread safe."""

    def __init__(self, tiers: Sequence[str]) -> None:
        if TOTAL in tiers:
            raise ValueError(f"a tier named {TOTAL!r} would be mistaken for the miss totals: rename it")
        self.tiers = list(tiers)
        self._counts: dict[tuple[MissReason, str], int] = {}
        self._taken: dict[tuple[MissReason, str], int] = {}
        self._lock = threading.Lock()

    def add(self, miss: Miss) -> None:
        """Count ``miss`` once in total and once in each tier."""
        with self._lock:
            for row in [(miss.reason, TOTAL), *((reason, tier) for tier, reason in miss.by_tier.items())]:
                self._counts[row] = self._counts.get(row, 0) + 1

    def counts(self) -> dict[tuple[MissReason, str], int]:
        """Every count so far, by (reason, tier); the tier ``TOTAL`` holds the totals."""
        with self._lock:
            return dict(self._counts)

    def take(self) -> dict[tuple[MissReason, str], int]:
        """The counts added since the last ``take`` (the non-zero ones), for engines that report per step."""
        with self._lock:
            delta = {row: n - self._taken.get(row, 0) for row, n in self._counts.items()}
            self._taken = dict(self._counts)
        return {row: n for row, n in delta.items() if n}

    def stats(self) -> dict[str, dict]:
        """``{"total": {reason: n}, "by_tier": {tier: {reason: n}}}``, every reason and tier listed (0 too)."""
        counts = self.counts()

        def row(tier: str) -> dict[str, int]:
            return {reason.value: counts.get((reason, tier), 0) for reason in MissReason}

        return {"total": row(TOTAL), "by_tier": {tier: row(tier) for tier in self.tiers}}


WhyAbsent = Callable[[bytes], MissReason | None]


class Misses:
    """One stack's miss attribution: the ``ghost`` its planner records into, ``why_absent`` of each of
    its ``tiers`` (names in stack order; what a tier knows itself, e.g. a remote query that failed),
    and the ``counter``."""

    def __init__(self, tiers: Sequence[str], ghost: GhostIndex, why_absent: Sequence[WhyAbsent]) -> None:
        self.tiers = list(tiers)
        self.ghost = ghost
        self._why_absent = list(why_absent)
        self.counter = MissCounter(self.tiers)

    def explain(self, keys: Sequence[bytes], hits: int, partial: bool = False) -> Miss | None:
        """Why a lookup of ``keys`` that found ``hits`` leading blocks ended early; None when it did not
        (every block found and no partial block after them). Counts nothing.

        The first missing block: each tier says why it lacks it (its own knowledge, then the ghost,
        else never stored); in total, the ghost entry of the deepest tier that has one (the last
        place that could have kept the block: evicted from host and declined by disk is "declined,
        disk"), else a remote error the lookup met, else never stored."""
        if hits >= len(keys):
            if not partial:
                return None
            return Miss(
                hits, len(keys), MissReason.PARTIAL_BLOCK, None, dict.fromkeys(self.tiers, MissReason.PARTIAL_BLOCK)
            )
        key = keys[hits]
        ghosts = self.ghost.reasons(key)
        own = [why(key) for why in self._why_absent]
        by_tier = {name: own[t] or ghosts[t] or MissReason.NEVER_STORED for t, name in enumerate(self.tiers)}
        found = [(why, name) for why, name in zip(ghosts, self.tiers, strict=True) if why is not None]
        found = found or [
            (why, name) for why, name in zip(own, self.tiers, strict=True) if why is MissReason.REMOTE_ERROR
        ]
        reason, tier = found[-1] if found else (MissReason.NEVER_STORED, None)
        return Miss(hits, len(keys), reason, tier, by_tier)

    def count(self, miss: Miss | None) -> None:
        """Count a lookup's miss (None: it did not miss) and write its debug line."""
        if miss is None:
            return
        self.counter.add(miss)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s", describe(miss))

    def counts(self) -> dict[tuple[MissReason, str], int]:
        return self.counter.counts()

    def take(self) -> dict[tuple[MissReason, str], int]:
        return self.counter.take()

    def stats(self) -> dict[str, dict]:
        return self.counter.stats()


def describe(miss: Miss) -> str:
    """The debug line of one miss: hits of full blocks, the reason and its tier, each tier's reason,
    and for another namespace the fields that differ."""
    where = f" in {miss.tier}" if miss.tier else ""
    tiers = ", ".join(f"{name}={reason.value}" for name, reason in miss.by_tier.items())
    line = f"lookup hit {miss.hits}/{miss.blocks} full blocks; miss: {miss.reason.value}{where}; per tier: {tiers}"
    if miss.reason is MissReason.OTHER_NAMESPACE:
        line += f"; namespace differs (here vs there) in: {'; '.join(said(miss.differing)) or 'no recorded field'}"
    return line
