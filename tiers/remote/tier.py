"""The remote tier as the planner sees it: a ``Tier`` whose index is the shared store itself.

The store is not ours: another engine adds records, the store evicts or loses any of them at any
moment, a restart empties it. So this tier keeps no mirror of it. A key is READY only for a few
seconds after the store said it holds the record (``query``, one batched existence query) or after
this process stored it; WRITING while this process puts it; FREE otherwise. A key whose load failed
(missing by then, damaged, foreign, unsigned) is FREE for those few seconds whatever the store says,
so lookups stop promising a record that cannot be read, until this process stores the block again.
Concurrent queries share what they ask (``query``): many requests of one engine that want the same
prefix at once (a shared system prompt) cost the store one question per block.
It has no slots (``by_key``: copies name keys), no pins (a record may vanish under a load anyway:
that load then fails exactly that block) and no eviction (the store evicts by itself).

``RemoteStorage`` is what transfers see: the store's records for one stack, or for one rank of one
(``RecordFormat``: names, headers, MAC), and which of them failed to load here. Bytes move through
``kvtier.transfers.remote``, whose stores skip a record the store already holds (another engine stored
the block) unless it failed to load here: a record that merely exists under our name may be a foreign
one, and skipping its rewrite would pin a miss on that block.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvtier.core.errors import StateError, StoreError, TransferError
from kvtier.core.keys import check_key
from kvtier.core.layout import BlockLayout
from kvtier.core.media import KEYED_DEVICE
from kvtier.core.metrics import TierStats
from kvtier.core.misses import MissReason
from kvtier.core.namespaces import ENTRY_BYTES, MAX_NAMESPACES, KnownNamespace, decode_entry, encode_entry
from kvtier.core.storage import BlockStorage
from kvtier.core.tier import BlockState, Tier, Usage
from kvtier.policies import LRUPolicy
from kvtier.tiers.remote.client import StoreClient
from kvtier.tiers.remote.link import Connector, StoreLink
from kvtier.tiers.remote.record import RecordFormat

log = logging.getLogger(__name__)

KNOWN_FOR_S = 5.0
"""How long an answer counts (the store's "present", this process's own store, a failed load): short,
because other engines and the store's eviction change what it holds without telling anyone."""

UNREADABLE_KEPT = 65536
"""How many keys whose records failed to load a ``RemoteStorage`` remembers (the oldest forgotten first):
memory stays bounded however many foreign records a store holds under our names, and a key forgotten
too early costs one more failed load (which remembers it again), not a miss for good."""


class RemoteStorage(BlockStorage):
    """The records of a shared store in one stack's (or rank's) ``RecordFormat``: no addresses, no slots.

    It remembers what loads found for the stores that follow (``loaded``, ``unreadable``, ``stored``):
    a key whose record failed to load here is written again by its next store without asking whether
    the store holds a record under its name. ``on_skipped`` counts the records a store left as the store
    held them (the tier's ``skipped_existing``); a storage without a tier (a vLLM worker's) counts none."""

    def __init__(
        self, layout: BlockLayout, records: RecordFormat, on_skipped: Callable[[int], None] | None = None
    ) -> None:
        super().__init__(layout, 0, KEYED_DEVICE)
        self.records = records
        self._on_skipped = on_skipped
        self._unreadable: OrderedDict[bytes, MissReason] = OrderedDict()  # key -> why its record failed
        self._lock = threading.Lock()

    def _addresses(self, slots):
        raise TransferError("a remote store's records have no addresses: they are named by key")

    def loaded(self, keys: Sequence[bytes], ok: Sequence[bool], refused: Iterable[bytes] = ()) -> None:
        """What a load that the store answered found: the keys whose record arrived and passed its
        checks are readable; the others are not: ``refused`` ones arrived and failed a check (damaged,
        foreign, unsigned), the rest were missing (the store lost them since it said it held them)."""
        damaged = set(refused)
        with self._lock:
            for key, good in zip(keys, ok, strict=True):
                if good:
                    self._unreadable.pop(key, None)
                else:
                    self._unreadable[key] = MissReason.DAMAGED if key in damaged else MissReason.EVICTED
                    self._unreadable.move_to_end(key)
            while len(self._unreadable) > UNREADABLE_KEPT:
                self._unreadable.popitem(last=False)

    def unreadable(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether its record failed to load here since this process last wrote it."""
        with self._lock:
            return [key in self._unreadable for key in keys]

    def failure(self, key: bytes) -> MissReason | None:
        """Why the record of ``key`` failed to load here (``loaded``); None when it did not, or when no
        store answered (the call failed or timed out)."""
        with self._lock:
            return self._unreadable.get(key)

    def stored(self, written: Iterable[bytes], skipped: int) -> None:
        """What a store did: the records of ``written`` are this process's own now; ``skipped`` more
        were found in the store and left as they were."""
        with self._lock:
            for key in written:
                self._unreadable.pop(key, None)
        if skipped and self._on_skipped is not None:
            self._on_skipped(skipped)


@dataclass
class RemoteStats(TierStats):
    """A remote tier's counters: those of every tier (``aborted``: stores that did not land, counted
    drops; ``read_errors``: loads that failed; ``committed``: stores that landed, skipped ones too), the
    lookups the store could not answer, and the stores skipped because the store already held a
    record of the block (another engine stored it): asked about, not written again."""

    lookup_errors: int = 0
    skipped_existing: int = 0


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
        registry: bool = True,
        loads_direct: bool = False,
    ) -> None:
        storage = RemoteStorage(layout, records[0], lambda n: self.count(skipped_existing=n))
        super().__init__(
            name, "remote", storage, LRUPolicy(), note=f"{link.connector.where}, timeout {link.timeout:g} s"
        )
        self._remote_storage = storage  # (typed: ``storage`` is any BlockStorage to the base class)
        self.records = list(records)
        self.link = link
        self.placement = placement
        self.takes_demotions = placement == "write_back"
        self.stats = RemoteStats()
        self.registry = registry  # whether the store keeps the namespace registry (``record_namespace``)
        self.loads_direct = loads_direct  # (its clients ``fetch``: a late reply writes nowhere)
        self._known_for = known_for
        self._answers: OrderedDict[bytes, tuple[float, bool]] = OrderedDict()  # key -> (expiry, readable)
        self._failed: OrderedDict[bytes, tuple[float, MissReason]] = OrderedDict()  # key -> (expiry, why not)
        self._writing: set[bytes] = set()
        self._asking: dict[bytes, threading.Event] = {}  # key -> set once the query asking for it is over

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
        past the timeout.

        A key that another query is asking the store right now is not asked again: this query asks
        only the others, then waits for that answer (within its own timeout; without one in time, the
        key is a miss)."""
        if not keys:
            return 0
        deadline = time.monotonic() + self.link.timeout
        asked = threading.Event()
        with self._lock:
            theirs = {self._asking[key] for key in keys if key in self._asking}
            mine = [key for key in dict.fromkeys(keys) if key not in self._asking]
            self._asking.update(dict.fromkeys(mine, asked))
        answered = self._ask(mine, asked) if mine else True
        for other in theirs:
            other.wait(max(0.0, deadline - time.monotonic()))
        return self.lookup(keys) if answered else 0

    def _ask(self, keys: list[bytes], asked: threading.Event) -> bool:
        """Ask the store for ``keys`` (this query's in ``_asking``), remember those present, then let the
        queries waiting for them go on; False (counted) when the store could not answer."""
        names = [fmt.name(key) for key in keys for fmt in self.records]
        found: list[bool] | None = None
        try:
            found = self.link.ask(lambda client: client.exists(names))
        except StoreError:
            self.count(lookup_errors=1)
        finally:
            ranks = len(self.records)
            with self._lock:
                now = time.monotonic()
                for i, key in enumerate(keys):
                    del self._asking[key]
                    here = found is not None and all(found[i * ranks : (i + 1) * ranks])
                    if here and self._answer(key, now) is not False:  # not after a failed load of it
                        self._remember(key, True, now)
                    if found is None:
                        self._fail(key, MissReason.REMOTE_ERROR, now)
                    elif self._failed.get(key, (0.0, None))[1] is MissReason.REMOTE_ERROR:
                        del self._failed[key]  # answered now
            asked.set()
        return found is not None

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

    # --- the namespaces that use the store (``core/namespaces.py``) -----------------------------

    def record_namespace(self, ours: KnownNamespace) -> list[KnownNamespace]:
        """Record ``ours`` (named by this tier's record digest) in the store's registry and return the other
        namespaces it lists: ``MAX_NAMESPACES`` records ``{prefix}/namespaces/{i}`` of ``ENTRY_BYTES``
        each (a store cannot list names, so their names are fixed), read in one call and ours written
        over its own, a free or unreadable one, or the oldest. Anyone who can write the store can write
        them: each is checked (size, JSON, fields) and a bad one is free; what is listed only ever
        names a miss's reason. Never raises: a store that does not answer is one log line.

        On a client of its own, closed afterwards: the lookups' link stays as it was (its client opens
        on the first lookup, no backoff after a failure here). A store without ``registry`` (Mooncake's
        clients read only into memory registered with them, and closing one holds the GIL most of a
        second) lists none and opens no client."""
        if not self.registry:
            return []
        ours = replace(ours, records=self.records[0].namespace.hex())
        names = [f"{self.records[0].prefix}/namespaces/{i}" for i in range(MAX_NAMESPACES)]
        try:
            record = np.frombuffer(encode_entry(ours), np.uint8).copy()
        except ValueError as exc:  # (a namespace too long to record: the others are read all the same)
            log.warning("remote tier %s: this stack's namespace not recorded: %s", self.name, exc)
            record = None
        wired = self.link.connector
        link = StoreLink(Connector(wired.connect, 1, wired.where), self.link.timeout, "the namespace registry")
        try:
            listed, bad = link.ask(lambda client: _record_namespace(client, names, ours, record))
        except StoreError as exc:
            log.warning("remote tier %s: the store's namespace registry not read: %s", self.name, exc)
            return []
        finally:
            link.close(timeout=0)  # (an abandoned call's client is closed once it returns)
        if bad:
            log.warning(
                "remote tier %s: namespace registry records ignored (not %d bytes of a namespace's JSON): %s",
                self.name,
                ENTRY_BYTES,
                ", ".join(bad),
            )
        return [entry for entry in listed if not entry.same(ours)]

    def hold_elsewhere(self, keys: Sequence[tuple[KnownNamespace, bytes]]) -> list[bool]:
        """Whether the store holds each key under its namespace's record digest (every rank's record),
        in one batched query within the timeout; no for all when it cannot say (nothing is counted:
        the lookup that missed counted its own query)."""
        asked = [(entry.records, key) for entry, key in keys if entry.records is not None]
        names = [
            RecordFormat(fmt.prefix, bytes.fromhex(digest), fmt.block_bytes, rank=fmt.rank).name(key)
            for digest, key in asked
            for fmt in self.records
        ]
        try:
            found = self.link.ask(lambda client: client.exists(names)) if names else []
        except StoreError:
            return [False] * len(keys)
        ranks = len(self.records)
        held = iter([all(found[i * ranks : (i + 1) * ranks]) for i in range(len(asked))])
        return [entry.records is not None and next(held) for entry, _ in keys]

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
                self._fail(key, self._remote_storage.failure(key) or MissReason.REMOTE_ERROR, now)
            self.stats.read_errors += len(keys)
            return []

    def why_absent(self, key: bytes) -> MissReason | None:
        """Why ``key`` was not readable here lately: the store did not answer a query of it, or a load of
        it failed (its record damaged or missing, the call failed); None otherwise."""
        with self._lock:
            failed = self._failed.get(key)
            return failed[1] if failed is not None and failed[0] > time.monotonic() else None

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


def _record_namespace(
    client: StoreClient, names: list[str], ours: KnownNamespace, record: np.ndarray | None
) -> tuple[list[KnownNamespace], list[str]]:
    """One call on a client: read the registry records ``names`` and write ``record`` (``ours``) into one
    of them (``RemoteTier.record_namespace``); the entries listed and the names of records that exist
    but are not an entry."""
    buffer = np.zeros((len(names), ENTRY_BYTES), np.uint8)
    pieces = [[(buffer.ctypes.data + i * ENTRY_BYTES, ENTRY_BYTES)] for i in range(len(names))]
    exists = client.exists(names)
    got = client.get(names, pieces)
    slots: list[KnownNamespace | None] = []
    bad = []
    for name, here, ok, raw in zip(names, exists, got, buffer, strict=True):
        try:
            slots.append(decode_entry(raw.tobytes()) if ok else None)
        except ValueError:
            slots.append(None)
        if here and slots[-1] is None:
            bad.append(name)
    mine = next((i for i, entry in enumerate(slots) if entry is not None and entry.same(ours)), None)
    free = next((i for i, entry in enumerate(slots) if entry is None), None)
    if record is not None:
        written = [0.0 if entry is None else entry.written for entry in slots]
        oldest = written.index(min(written))
        slot = next(i for i in (mine, free, oldest) if i is not None)
        client.put([names[slot]], [[(record.ctypes.data, ENTRY_BYTES)]])
    return [entry for entry in slots if entry is not None], bad
