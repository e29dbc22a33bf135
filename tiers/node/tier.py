"""The node tier as an engine's stack sees it: a ``KeyedTier`` whose owner is the machine's node daemon,
over a ``NodeStorage`` (the daemon's slab, mapped here, and the connection to the daemon).

Blocks go to the daemon under node keys: the engine's key bound to its namespace and block geometry (a
16-byte BLAKE2b of both), so engines of different models, layouts or tensor-parallel ranks share a daemon
without ever finding each other's blocks, and the slab's headers need no namespace of their own.

The storage remembers where the daemon last said each block is (``Location``: the slot and its
generation, from a lookup, a pin or this engine's own store), so a load of a block found lately reads
it there without asking: the slot header and the block's checksum tell whether it is still that block
(``kvtier.tiers.node.transfer``). The tier's recent answers count only while that header holds: a
block evicted and its slot reused since is asked about again instead of promised to a load.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from kvtier.core.errors import StoreError, TransferError
from kvtier.core.layout import BlockLayout
from kvtier.core.misses import MissReason
from kvtier.core.sealing import SEAL_BYTES, Sealer, SealingKeys
from kvtier.core.storage import BlockStorage
from kvtier.tiers.keyed import KeyedTier, RecentFailures
from kvtier.tiers.node.client import NodeClient
from kvtier.tiers.node.protocol import Op, is_slot_gen
from kvtier.tiers.node.slab import NODE_KEY_BYTES, READY, WRITING, SlabView

NODE_DEVICE = "node"
"""The device of a node slab's blocks as transfers see them: named by key, copied by ``NodeBackend``."""

KNOWN_FOR_S = 2.0
"""How long the daemon's "present" counts here: other engines' stores and the daemon's evictions change
what it holds; a load of a block evicted meanwhile fails that block (recomputed), no more."""

FAILURES_KEPT = 65536
"""How many keys whose loads failed a ``NodeStorage`` remembers the reason of (``RecentFailures``)."""

LOCATIONS_KEPT = 65536
"""How many blocks' locations a ``NodeStorage`` remembers (the oldest forgotten first; a block whose
location is forgotten is pinned for its load, one round trip, no miss)."""


class Location(NamedTuple):
    """Where the daemon said a block is: its slot, the slot's generation then, the block's node key, the
    slab mapped then, and the connection (``NodeClient.epoch``) it said it on."""

    slot: int
    gen: int
    name: bytes
    view: SlabView
    epoch: int

    def holds(self) -> bool:
        """Whether the slot header still names this block at this generation, READY, or WRITING (a block
        this engine stored, whose COMMIT the daemon has not read yet): a local read."""
        view, slot = self.view, self.slot
        return (
            int(view.gen[slot]) == self.gen
            and int(view.state[slot]) in (READY, WRITING)
            and view.keys[slot].tobytes() == self.name
        )


_PERSON = b"kvtier-node-key"


class NodeStorage(BlockStorage):
    """The daemon's slab for blocks of one ``layout`` under one ``namespace`` digest (whose blocks they
    are), reached through ``client``: no addresses or slots of its own (slots are the daemon's, handed
    out per copy). Closing it closes the connection. ``on_skipped`` counts the blocks a store found in
    the daemon already (another engine stored them). With ``sealing`` keys a slot holds the block sealed
    (under its tenant's key), then its seal (``stored_bytes``); ``older`` namespace digests (a previous
    secret's, during a rotation) are looked up and loaded from after ``namespace``, never stored into."""

    by_key = True

    def __init__(
        self,
        layout: BlockLayout,
        client: NodeClient,
        namespace: bytes,
        on_skipped: Callable[[int], None] | None = None,
        sealing: SealingKeys | None = None,
        older: Sequence[bytes] = (),
    ) -> None:
        super().__init__(layout, 0, NODE_DEVICE, on_close=client.close)
        self.client = client
        self.namespaces = [namespace, *older]  # where its blocks may be found, the one they are stored under first
        self.sealing = sealing  # seals the blocks it writes into the slab (``encryption: aes-gcm``), or None
        self.stored_bytes = layout.block_bytes + (0 if sealing is None else SEAL_BYTES)  # a block's bytes in a slot
        self.on_skipped = on_skipped
        self.failures = RecentFailures(FAILURES_KEPT)
        self._locations: OrderedDict[bytes, Location] = OrderedDict()  # node key -> where it was last seen
        self._lock = threading.Lock()

    @property
    def namespace(self) -> bytes:
        """The digest its blocks are stored under (and looked up under first)."""
        return self.namespaces[0]

    def _addresses(self, slots):
        raise TransferError("a node slab's blocks are named by key: the daemon gives their slots per copy")

    def node_keys(self, keys: Sequence[bytes], namespace: bytes | None = None) -> list[bytes]:
        """The keys the daemon knows these blocks by (see the module doc): this storage's, or those of
        another ``namespace`` digest (another rank's)."""
        person, namespace = _PERSON, self.namespace if namespace is None else namespace
        return [hashlib.blake2b(namespace + key, digest_size=NODE_KEY_BYTES, person=person).digest() for key in keys]

    def sealer(self, key: bytes) -> Sealer | None:
        """The sealer of block ``key`` (its tenant's), or None where this tier does not seal."""
        return None if self.sealing is None else self.sealing.for_key(key)

    def failure(self, key: bytes) -> MissReason | None:
        """Why a load of ``key`` failed here lately, if it did."""
        return self.failures.get(key)

    def located(
        self, keys: Sequence[bytes], names: Sequence[bytes], answers: Iterable[Any], view: SlabView, epoch: int
    ) -> None:
        """Remember the locations a daemon's answer on connection ``epoch`` gives for ``keys`` (node keys
        ``names``; ``[slot, gen]`` each, or None for a block it does not hold, which forgets it) in the
        slab ``view`` it answered about."""
        with self._lock:
            known = self._locations
            for key, name, answer in zip(keys, names, answers, strict=True):
                if is_slot_gen(answer):
                    known[key] = Location(answer[0], answer[1], name, view, epoch)
                    known.move_to_end(key)
                else:  # (not held, or held below the slab: no place to read it from yet)
                    known.pop(key, None)
            while len(known) > LOCATIONS_KEPT:
                known.popitem(last=False)

    def location(self, key: bytes) -> Location | None:
        """Where the daemon said ``key``'s block is, if it said so on the connection that is up now: once a
        call failed (the daemon died, stopped or restarted), nothing it said before is read on its word."""
        with self._lock:
            where = self._locations.get(key)
        return where if where is not None and where.epoch == self.client.live_epoch() else None

    def moved(self, key: bytes) -> bool:
        """Whether what the daemon said of ``key``'s place no longer holds: its slot went to another block
        (or was dropped), or the connection it was said on is gone. False where nothing was said."""
        with self._lock:
            where = self._locations.get(key)
        return where is not None and (where.epoch != self.client.live_epoch() or not where.holds())

    def forget(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            for key in keys:
                self._locations.pop(key, None)


class NodeTier(KeyedTier):
    """The daemon behind ``storage``: asked which blocks it holds (one LOOKUP per query), loaded from and
    stored into by ``NodeBackend`` (straight between the caller's memory and the slab). With
    ``rank_namespaces`` (an engine's scheduler side, whose workers write one copy per tensor-parallel
    rank under each rank's digest; each rank's digests as ``NodeStorage.namespaces``) a block is present
    when every rank's copy is."""

    def __init__(
        self,
        name: str,
        storage: NodeStorage,
        known_for: float | None = None,
        rank_namespaces: Sequence[Sequence[bytes]] = (),
    ) -> None:
        client = storage.client
        note = f"node daemon at {client.path} ({client.node_id or 'not connected'}), timeout {client.timeout:g} s"
        known_for = KNOWN_FOR_S if known_for is None else known_for
        super().__init__(name, "node", storage, note, known_for, loads_direct=True)
        self._node_storage = storage  # (typed: ``storage`` is any BlockStorage to the base class)
        self._rank_namespaces = [list(spaces) for spaces in rank_namespaces]
        storage.on_skipped = lambda n: self.count(skipped_existing=n)

    @property
    def timeout(self) -> float:
        return self._node_storage.client.timeout

    def location(self) -> tuple[str, str | None]:
        """This machine's shared memory: every engine of its node daemon may load its blocks."""
        client = self._node_storage.client
        return "LOCAL", f"node:{client.node_id or client.path}"

    def _present(self, keys: list[bytes]) -> list[bool]:
        """One LOOKUP (of every rank's copy, under each of its digests); the locations it gives are
        remembered for the loads that follow (of this storage's own blocks)."""
        storage = self._node_storage
        ranks = self._rank_namespaces or [storage.namespaces]
        names = [name for spaces in ranks for space in spaces for name in storage.node_keys(keys, space)]
        (found,), epoch, view = storage.client.call(Op.LOOKUP, names)
        if not isinstance(found, list) or len(found) != len(names):
            raise TransferError(f"the node daemon answered a lookup of {len(names)} keys with {found!r:.80}")
        n, present, at = len(keys), [True] * len(keys), 0
        for spaces in ranks:
            chosen = list(range(at, at + n))  # per key, where its answer is in ``found``: the first digest's
            for s in range(1, len(spaces)):  # (a rotation's previous digest, for keys the ones before lack)
                for i, j in enumerate(chosen):
                    if not isinstance(found[j], list):
                        chosen[i] = at + s * n + i
            if not self._rank_namespaces:
                storage.located(keys, [names[j] for j in chosen], [found[j] for j in chosen], view, epoch)
            present = [p and isinstance(found[j], list) for p, j in zip(present, chosen, strict=True)]
            at += len(spaces) * n
        return present

    def disconnect(self) -> None:
        self._node_storage.client.close()

    def settle(self) -> None:
        """One round trip on the connection: the daemon reads a connection's messages in order, so once
        it answers, every commit posted before is published (another engine's lookup finds those
        blocks). Nothing to wait for while the daemon does not answer (its calls fail at once)."""
        client = self._node_storage.client
        if client.live_epoch() is None:
            return
        try:
            client.call(Op.STATS)
        except StoreError:
            pass

    def _answer(self, key: bytes, now: float) -> bool | None:
        """A recent "present" counts while the block's slot still holds it (a local read of its header):
        one evicted and reused since, or said by a connection that is gone, is asked about again."""
        answer = super()._answer(key, now)
        return None if answer and self._node_storage.moved(key) else answer

    def _failure(self, key: bytes) -> MissReason | None:
        return self._node_storage.failure(key)
