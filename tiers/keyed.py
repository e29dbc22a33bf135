"""A tier whose index is somebody else's: a store shared with other engines (``remote``) or a node
daemon's slab (``node``). What such a tier holds changes without telling it (other engines store, the
owner evicts), so it keeps no mirror: a key is READY only for a while after the owner said it holds
the block (``query``, one batched question) or after this process stored it; WRITING while this process
stores it; FREE otherwise. A key whose load failed is FREE for that while whatever the owner says, so
lookups stop promising a block that cannot be read. Concurrent queries share what they ask: many
requests that want the same prefix at once cost the owner one question per block.

It has no slots (``by_key``: copies name keys), no pins of its own (the owner protects a block while it
is copied, or a load of a block that vanished fails that block) and no eviction (the owner evicts).
A subclass says how to ask its owner (``_present``) and what it knows of a failed load (``_failure``).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.core.errors import StateError
from kvtier.core.keys import check_key
from kvtier.core.metrics import TierStats
from kvtier.core.misses import MissReason
from kvtier.core.storage import BlockStorage
from kvtier.core.tier import BlockState, Tier, Usage
from kvtier.core.tier_config import ProblemList, TierConfigBase
from kvtier.policies import LRUPolicy


@dataclass
class KeyedStats(TierStats):
    """A keyed tier's counters: those of every tier (``aborted``: stores that did not land, counted
    drops; ``read_errors``: loads that failed; ``committed``: stores that landed, skipped ones too), the
    lookups its owner could not answer, and the stores skipped because the owner already held the
    block (another engine stored it): asked about, not written again."""

    lookup_errors: int = 0
    skipped_existing: int = 0


def sized_by_owner(config: TierConfigBase, tier: str, owner: str) -> ProblemList:
    """The keys a keyed tier's config may not set, since its owner sizes and evicts: one problem each,
    saying that ``tier`` ("a remote tier") has none because ``owner`` (what does it instead)."""
    problems: ProblemList = []
    for key, what in (
        ("capacity", "capacity"),
        ("capacity_blocks", "capacity"),
        ("eviction", "eviction policy"),
        ("watermark", "watermark"),
        ("tenants", "tenant shares"),
    ):
        if getattr(config, key) is not None:
            problems.append(((key,), f"{tier} has no {what}: {owner}; remove {key}"))
    return problems


class RecentFailures:
    """Why loads of keys failed lately, for at most ``kept`` keys (the oldest forgotten first): memory stays
    bounded however many bad blocks an owner holds, and a key forgotten too early costs one more failed
    load (which remembers it again), not a miss for good."""

    def __init__(self, kept: int) -> None:
        self._kept = kept
        self._why: OrderedDict[bytes, MissReason] = OrderedDict()
        self._lock = threading.Lock()

    def note(self, key: bytes, why: MissReason | None) -> None:
        """Remember why ``key`` failed to load, or (``why`` None) that it loaded fine."""
        with self._lock:
            if why is None:
                self._why.pop(key, None)
                return
            self._why[key] = why
            self._why.move_to_end(key)
            while len(self._why) > self._kept:
                self._why.popitem(last=False)

    def get(self, key: bytes) -> MissReason | None:
        with self._lock:
            return self._why.get(key)

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._why


class KeyedTier(Tier):
    """A tier of ``medium`` over ``storage`` (addressed by key) whose owner is asked by ``_present``;
    its answers count for ``known_for`` seconds."""

    by_key = True

    def __init__(
        self,
        name: str,
        medium: str,
        storage: BlockStorage,
        note: str,
        known_for: float,
        loads_direct: bool = False,
        takes_demotions: bool = False,
    ) -> None:
        super().__init__(name, medium, storage, LRUPolicy(), note=note)
        self.loads_direct = loads_direct
        self.takes_demotions = takes_demotions
        self.stats = KeyedStats()
        self._known_for = known_for
        self._answers: OrderedDict[bytes, tuple[float, bool]] = OrderedDict()  # key -> (expiry, readable)
        self._failed: OrderedDict[bytes, tuple[float, MissReason]] = OrderedDict()  # key -> (expiry, why not)
        self._writing: set[bytes] = set()
        self._asking: dict[bytes, threading.Event] = {}  # key -> set once the query asking for it is over

    # --- what the owner holds ------------------------------------------------------------------

    def _present(self, keys: list[bytes]) -> list[bool]:
        """Ask the owner, in one call bounded by the tier's timeout, which of ``keys`` it holds. Raises
        any exception where it could not answer (counted in ``lookup_errors``)."""
        raise NotImplementedError

    def _failure(self, key: bytes) -> MissReason | None:
        """Why a load of ``key`` failed here, as far as the tier's storage knows."""
        return None

    def query(self, keys: Sequence[bytes]) -> int:
        """Ask the owner which keys it holds, in one batched query bounded by the tier's timeout; each
        key present is READY here for a while. Returns how many leading keys are present; 0 when the
        owner could not answer (counted in ``lookup_errors``): a miss, never a wait past the timeout.

        A key that another query is asking the owner right now is not asked again: this query asks
        only the others, then waits for that answer (within its own timeout; without one in time, the
        key is a miss)."""
        if not keys:
            return 0
        deadline = time.monotonic() + self.timeout
        asked = threading.Event()
        with self._lock:
            theirs = {self._asking[key] for key in keys if key in self._asking}
            mine = [key for key in dict.fromkeys(keys) if key not in self._asking]
            self._asking.update(dict.fromkeys(mine, asked))
        answered = self._ask(mine, asked) if mine else True
        for other in theirs:
            other.wait(max(0.0, deadline - time.monotonic()))
        return self.lookup(keys) if answered else 0

    @property
    def timeout(self) -> float:
        """Seconds a call to the owner may take."""
        raise NotImplementedError

    @property
    def known_for(self) -> float:
        """Seconds an answer of the owner's counts."""
        return self._known_for

    def _ask(self, keys: list[bytes], asked: threading.Event) -> bool:
        """Ask the owner for ``keys`` (this query's in ``_asking``), remember those present, then let the
        queries waiting for them go on; False (counted) when the owner could not answer."""
        found: list[bool] | None = None
        try:
            found = self._present(keys)
        except Exception:
            self.count(lookup_errors=1)
        finally:
            with self._lock:
                now = time.monotonic()
                gone = []
                for i, key in enumerate(keys):
                    del self._asking[key]
                    here = found is not None and found[i]
                    if here and self._answer(key, now) is not False:  # not after a failed load of it
                        self._remember(key, True, now)
                    elif found is not None and not here and self._answer(key, now):
                        del self._answers[key]  # the owner's "absent" is newer than what we knew
                        gone.append(key)
                    if found is None:
                        self._fail(key, MissReason.REMOTE_ERROR, now)
                    elif self._failed.get(key, (0.0, None))[1] is MissReason.REMOTE_ERROR:
                        del self._failed[key]  # answered now
                self._tell_watcher(False, gone)
            asked.set()
        return found is not None

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading keys the owner was found to hold recently (nothing asked)."""
        with self._lock:
            now = time.monotonic()
            return next((i for i, key in enumerate(keys) if not self._answer(key, now)), len(keys))

    def state(self, key: bytes) -> BlockState:
        with self._lock:
            if key in self._writing:
                return BlockState.WRITING
            return BlockState.READY if self._answer(key, time.monotonic()) else BlockState.FREE

    def try_pin(self, key: bytes) -> bool:
        """Whether the key is READY; nothing is pinned here (see the module doc)."""
        return self.state(key) is BlockState.READY

    def pin_leading(self, keys: Sequence[bytes]) -> list[int]:
        """The leading READY run, pinning nothing; a slot each is none (``Planner`` reads None)."""
        return [None] * self.lookup(keys)  # type: ignore[list-item]

    def unpin(self, keys: Iterable[bytes]) -> None:
        """Nothing to release (see ``try_pin``)."""

    def ready_keys(self) -> list[bytes]:
        """None: what the owner holds is not listed, it is asked for."""
        return []

    # --- stores --------------------------------------------------------------------------------

    def reserve(self, keys: Sequence[bytes], allow_evict: bool = True) -> list[int] | None:
        """Mark keys as being stored by this process; there are no slots to claim (an empty list).
        Raises StateError for a key reserved twice."""
        for key in keys:
            check_key(key)
        with self._lock:
            if len(set(keys)) != len(keys) or not self._writing.isdisjoint(keys):
                raise StateError(f"a block is reserved twice in tier {self.name!r}")
            self._writing.update(keys)
            return []

    def commit(self, keys: Iterable[bytes], pin: bool = False) -> None:
        """Stored: the owner holds them now, as far as anyone can tell for a while."""
        with self._lock:
            keys = self._end_writing(keys, "commit")
            now = time.monotonic()
            for key in keys:
                self._remember(key, True, now)
            self.stats.committed += len(keys)
            self.stats.bytes_in += len(keys) * self.block_bytes
            self._tell_watcher(True, keys)

    def abort(self, keys: Iterable[bytes]) -> list[bytes]:
        """Not stored (a counted drop); the owner can hold any block, so none is refused for good."""
        with self._lock:
            keys = self._end_writing(keys, "abort")
            self.stats.aborted += len(keys)
            return []

    def discard(self, keys: Iterable[bytes]) -> list[bytes]:
        """A load of these failed: a miss for a while, whatever the owner says (see the module doc).
        Returns no keys (nothing of kvtier's left the tier); the watcher hears they are gone, as far as
        this engine can tell."""
        with self._lock:
            keys = list(keys)
            now = time.monotonic()
            for key in keys:
                self._remember(key, False, now)
                self._fail(key, self._failure(key) or MissReason.REMOTE_ERROR, now)
            self.stats.read_errors += len(keys)
            self._tell_watcher(False, keys)
            return []

    def why_absent(self, key: bytes) -> MissReason | None:
        """Why ``key`` was not readable here lately: the owner did not answer a query of it, or a load of
        it failed (damaged or missing, the call failed); None otherwise."""
        with self._lock:
            failed = self._failed.get(key)
            return failed[1] if failed is not None and failed[0] > time.monotonic() else None

    # --- accounting ----------------------------------------------------------------------------

    def usage(self) -> Usage:
        """Nothing of kvtier's: the owner's memory is the owner's."""
        return Usage(0, 0)

    def leaks(self) -> dict[str, int]:
        with self._lock:
            return {"pinned": 0, "writing": len(self._writing)}

    def close(self) -> None:
        """Release the storage. Raises StateError while blocks are still being stored."""
        if self._writing:
            raise StateError(f"tier {self.name!r} closed with {len(self._writing)} block(s) being stored")
        self.disconnect()
        self.storage.close()

    def disconnect(self) -> None:
        """Stop asking the owner (a question in flight ends by its deadline): at an engine's shutdown,
        whatever is still being stored."""

    # --- helpers (under self._lock) ------------------------------------------------------------

    def _answer(self, key: bytes, now: float) -> bool | None:
        """Whether ``key`` is readable as far as a recent answer says; None when there is none."""
        answer = self._answers.get(key)
        return None if answer is None or answer[0] <= now else answer[1]

    def _remember(self, key: bytes, readable: bool, now: float) -> None:
        """Remember an answer for ``key`` for a while, forgetting those that have expired (the oldest
        first: every answer lives equally long)."""
        self._answers[key] = (now + self._known_for, readable)
        _expire(self._answers, key, now)

    def _fail(self, key: bytes, why: MissReason, now: float) -> None:
        """Remember for a while why ``key`` was not readable (``why_absent``), forgetting expired reasons."""
        self._failed[key] = (now + self._known_for, why)
        _expire(self._failed, key, now)

    def _end_writing(self, keys: Iterable[bytes], what: str) -> list[bytes]:
        keys = list(keys)
        missing = [key for key in keys if key not in self._writing]
        if missing or len(set(keys)) != len(keys):
            raise StateError(
                f"{what} of block {(missing or keys)[0].hex()[:16]} which was not reserved in tier {self.name!r}"
            )
        self._writing.difference_update(keys)
        return keys


def _expire(answers: OrderedDict[bytes, tuple[float, Any]], key: bytes, now: float) -> None:
    """Move ``key``, just answered, to the end of ``answers`` (key -> (expiry, answer)) and forget the
    answers that have expired, the oldest first: every answer lives equally long."""
    answers.move_to_end(key)
    while answers:
        oldest, (until, _) = next(iter(answers.items()))
        if until > now:
            break
        del answers[oldest]
