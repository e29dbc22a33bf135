"""The remote tier as the planner sees it: a ``Tier`` whose index is the shared store itself.

The store is not ours: another engine adds records, the store evicts or loses any of them at any
moment, a restart empties it. So this tier keeps no mirror of it. A key is READY only for a few
seconds after the store said it holds the record (``query``, one batched existence query) or after
this process stored it; WRITING while this process puts it; FREE otherwise. A key whose load failed
(missing by then, damaged, foreign, unsigned) is FREE for those few seconds whatever the store says,
so lookups stop promising a record that cannot be read, until this process stores the block again.
It has no slots (``by_key``: copies name keys), no pins (a record may vanish under a load anyway:
that load then fails exactly that block) and no eviction (the store evicts by itself).

``RemoteStorage`` is what transfers see: the store's records for one stack, or for one rank of one
(``RecordFormat``: names, headers, MAC). Bytes move through ``kvtier.transfers.remote``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvtier.core.errors import StateError, StoreError, TransferError
from kvtier.core.keys import check_key
from kvtier.core.layout import BlockLayout
from kvtier.core.media import KEYED_DEVICE
from kvtier.core.metrics import TierStats
from kvtier.core.storage import BlockStorage
from kvtier.core.tier import BlockState, Tier, Usage
from kvtier.policies import LRUPolicy
from kvtier.tiers.remote.link import StoreLink
from kvtier.tiers.remote.record import RecordFormat

KNOWN_FOR_S = 5.0
"""How long an answer counts (the store's "present", this process's own store, a failed load): short,
because other engines and the store's eviction change what it holds without telling anyone."""


class RemoteStorage(BlockStorage):
    """The records of a shared store in one stack's (or rank's) ``RecordFormat``: no addresses, no slots."""

    def __init__(self, layout: BlockLayout, records: RecordFormat) -> None:
        super().__init__(layout, 0, KEYED_DEVICE)
        self.records = records

    def _addresses(self, slots):
        raise TransferError("a remote store's records have no addresses: they are named by key")


@dataclass
class RemoteStats(TierStats):
    """A remote tier's counters: those of every tier (``aborted``: stores that did not land, counted
    drops; ``read_errors``: loads that failed), and the lookups the store could not answer."""

    lookup_errors: int = 0


class RemoteTier(Tier):
    """The shared store behind ``records`` (one per tensor-parallel rank whose shard a block needs: a
    block is present only when every rank's record is), asked through ``link``. ``placement`` is
    the tier's own: ``write_through`` (the host tier copies every block on) or ``write_back`` (it
    takes the host tier's victims)."""

    by_key = True

    def __init__(
        self,
        name: str,
        layout: BlockLayout,
        records: Sequence[RecordFormat],
        link: StoreLink,
        placement: str = "write_through",
        known_for: float = KNOWN_FOR_S,
    ) -> None:
        super().__init__(
            name,
            "remote",
            RemoteStorage(layout, records[0]),
            LRUPolicy(),
            note=f"{link.connector.where}, timeout {link.timeout:g} s",
        )
        self.records = list(records)
        self.link = link
        self.placement = placement
        self.takes_demotions = placement == "write_back"
        self.stats = RemoteStats()
        self._known_for = known_for
        self._answers: OrderedDict[bytes, tuple[float, bool]] = OrderedDict()  # key -> (expiry, readable)
        self._writing: set[bytes] = set()

    def __repr__(self) -> str:
        return (
            f"RemoteTier(name={self.name!r}, placement={self.placement!r}, {self.note}, "
            f"{len(self._writing)} block(s) being stored)"
        )

    # --- what the store holds ------------------------------------------------------------------

    def query(self, keys: Sequence[bytes]) -> int:
        """Ask the store which keys it holds, in one batched query bounded by the link's timeout; each
        key present (for every rank) is READY here for a while. Returns how many leading keys are
        present; 0 when the store could not answer (counted in ``lookup_errors``): a miss, never a wait
        past the timeout."""
        if not keys:
            return 0
        names = [fmt.name(key) for key in keys for fmt in self.records]
        try:
            found = self.link.ask(lambda client: client.exists(names))
        except StoreError:
            self.count(lookup_errors=1)
            return 0
        ranks = len(self.records)
        present = [all(found[i * ranks : (i + 1) * ranks]) for i in range(len(keys))]
        with self._lock:
            now = time.monotonic()
            for key, here in zip(keys, present, strict=True):
                if here and self._answer(key, now) is not False:  # not after a failed load of it
                    self._remember(key, True, now)
            return self.lookup(keys)

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading keys the store was found to hold recently (no network)."""
        with self._lock:
            now = time.monotonic()
            return next((i for i, key in enumerate(keys) if not self._answer(key, now)), len(keys))

    def state(self, key: bytes) -> BlockState:
        with self._lock:
            if key in self._writing:
                return BlockState.WRITING
            return BlockState.READY if self._answer(key, time.monotonic()) else BlockState.FREE

    def try_pin(self, key: bytes) -> bool:
        """Whether the key is READY; nothing is pinned: a record may vanish under a load anyway."""
        return self.state(key) is BlockState.READY

    def unpin(self, keys: Iterable[bytes]) -> None:
        """Nothing to release (see ``try_pin``)."""

    def ready_keys(self) -> list[bytes]:
        """None: what the store holds is not listed, it is asked for."""
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
        """Stored: the store holds them now, as far as anyone can tell for a while."""
        with self._lock:
            keys = self._end_writing(keys, "commit")
            now = time.monotonic()
            for key in keys:
                self._remember(key, True, now)
            self.stats.committed += len(keys)
            self.stats.bytes_in += len(keys) * self.block_bytes

    def abort(self, keys: Iterable[bytes]) -> list[bytes]:
        """Not stored (a counted drop); the store can hold any block, so none is refused for good."""
        with self._lock:
            keys = self._end_writing(keys, "abort")
            self.stats.aborted += len(keys)
            return []

    def discard(self, keys: Iterable[bytes]) -> list[bytes]:
        """A load of these failed: a miss for a while, whatever the store says (see the module doc).
        Returns no keys: nothing of kvtier's left any tier."""
        with self._lock:
            keys = list(keys)
            now = time.monotonic()
            for key in keys:
                self._remember(key, False, now)
            self.stats.read_errors += len(keys)
            return []

    # --- accounting ----------------------------------------------------------------------------

    def usage(self) -> Usage:
        """Nothing of kvtier's: the store's memory is the store's."""
        return Usage(0, 0)

    def leaks(self) -> dict[str, int]:
        with self._lock:
            return {"pinned": 0, "writing": len(self._writing)}

    def close(self) -> None:
        """Close the link for lookups. Raises StateError while blocks are still being stored."""
        if self._writing:
            raise StateError(f"tier {self.name!r} closed with {len(self._writing)} block(s) being stored")
        self.link.close(timeout=0)
        self.storage.close()

    # --- helpers (under self._lock) ------------------------------------------------------------

    def _answer(self, key: bytes, now: float) -> bool | None:
        """Whether ``key`` is readable as far as a recent answer says; None when there is none."""
        answer = self._answers.get(key)
        return None if answer is None or answer[0] <= now else answer[1]

    def _remember(self, key: bytes, readable: bool, now: float) -> None:
        """Remember an answer for ``key`` for a while, forgetting those that have expired (the oldest
        first: every answer lives equally long)."""
        self._answers[key] = (now + self._known_for, readable)
        self._answers.move_to_end(key)
        while self._answers:
            oldest, (until, _) = next(iter(self._answers.items()))
            if until > now:
                break
            del self._answers[oldest]

    def _end_writing(self, keys: Iterable[bytes], what: str) -> list[bytes]:
        keys = list(keys)
        missing = [key for key in keys if key not in self._writing]
        if missing or len(set(keys)) != len(keys):
            raise StateError(
                f"{what} of block {(missing or keys)[0].hex()[:16]} which was not reserved in tier {self.name!r}"
            )
        self._writing.difference_update(keys)
        return keys
