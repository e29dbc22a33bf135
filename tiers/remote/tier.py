"""The remote tier as the planner sees it: a ``KeyedTier`` whose owner is the shared store itself.

The store is not ours: another engine adds records, the store evicts or loses any of them at any
moment, a restart empties it. So this tier keeps no mirror of it (``kvtier.tiers.keyed``: a key is
READY for a few seconds after the store said it holds the record, or after this process stored it),
and asks the store which records it holds in one batched existence query over every rank's records.

``RemoteStorage`` is what transfers see: the store's records for one stack, or for one rank of one
(``RecordFormat``: names, headers, MAC), and which of them failed to load here. Bytes move through
``kvtier.tiers.remote.transfer``, whose stores skip a record the store already holds (another engine stored
the block) unless it failed to load here: a record that merely exists under our name may be a foreign
one, and skipping its rewrite would pin a miss on that block.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

import numpy as np

from kvtier.core.devices import KEYED_DEVICE
from kvtier.core.errors import StoreError, TransferError
from kvtier.core.layout import BlockLayout
from kvtier.core.misses import MissReason
from kvtier.core.namespaces import ENTRY_BYTES, MAX_NAMESPACES, KnownNamespace, decode_entry, encode_entry
from kvtier.core.storage import BlockStorage
from kvtier.tiers.keyed import KeyedTier, RecentFailures
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

    by_key = True

    def __init__(
        self, layout: BlockLayout, records: RecordFormat, on_skipped: Callable[[int], None] | None = None
    ) -> None:
        super().__init__(layout, 0, KEYED_DEVICE)
        self.records = records
        self._on_skipped = on_skipped
        self._unreadable = RecentFailures(UNREADABLE_KEPT)  # key -> why its record failed to load here

    def _addresses(self, slots):
        raise TransferError("a remote store's records have no addresses: they are named by key")

    def loaded(self, keys: Sequence[bytes], ok: Sequence[bool], refused: Iterable[bytes] = ()) -> None:
        """What a load that the store answered found: the keys whose record arrived and passed its
        checks are readable; the others are not: ``refused`` ones arrived and failed a check (damaged,
        foreign, unsigned), the rest were missing (the store lost them since it said it held them)."""
        damaged = set(refused)
        for key, good in zip(keys, ok, strict=True):
            why = None if good else MissReason.DAMAGED if key in damaged else MissReason.EVICTED
            self._unreadable.note(key, why)

    def unreadable(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether its record failed to load here since this process last wrote it."""
        return [key in self._unreadable for key in keys]

    def failure(self, key: bytes) -> MissReason | None:
        """Why the record of ``key`` failed to load here (``loaded``); None when it did not, or when no
        store answered (the call failed or timed out)."""
        return self._unreadable.get(key)

    def stored(self, written: Iterable[bytes], skipped: int) -> None:
        """What a store did: the records of ``written`` are this process's own now; ``skipped`` more
        were found in the store and left as they were."""
        for key in written:
            self._unreadable.note(key, None)
        if skipped and self._on_skipped is not None:
            self._on_skipped(skipped)


class RemoteTier(KeyedTier):
    """The shared store behind ``records`` (one per tensor-parallel rank whose shard a block needs: a
    block is present only when every rank's record is), asked through ``link``. ``placement`` is
    the tier's own: ``write_through`` (the host tier copies every block on) or ``write_back`` (it
    takes the host tier's victims)."""

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
            name,
            "remote",
            storage,
            f"{link.connector.where}, timeout {link.timeout:g} s",
            known_for,
            loads_direct,  # (its clients ``fetch``: a late reply writes nowhere)
            takes_demotions=placement == "write_back",
        )
        self._remote_storage = storage  # (typed: ``storage`` is any BlockStorage to the base class)
        self.records = list(records)
        self.link = link
        self.placement = placement
        self.registry = registry  # whether the store keeps the namespace registry (``record_namespace``)

    def __repr__(self) -> str:
        return (
            f"RemoteTier(name={self.name!r}, placement={self.placement!r}, {self.note}, "
            f"{len(self._writing)} block(s) being stored)"
        )

    @property
    def timeout(self) -> float:
        return self.link.timeout

    def location(self) -> tuple[str, str | None]:
        """A store elsewhere, named by its address: every engine on it may load its blocks."""
        return "REMOTE", self.link.connector.where

    def _present(self, keys: list[bytes]) -> list[bool]:
        """One batched existence query of every rank's record of each key: present when all are."""
        names = [fmt.name(key) for key in keys for fmt in self.records]
        found = self.link.ask(lambda client: client.exists(names))
        ranks = len(self.records)
        return [all(found[i * ranks : (i + 1) * ranks]) for i in range(len(keys))]

    def _failure(self, key: bytes) -> MissReason | None:
        return self._remote_storage.failure(key)

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

    def disconnect(self) -> None:
        """Close the link for lookups."""
        self.link.close(timeout=0)


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
