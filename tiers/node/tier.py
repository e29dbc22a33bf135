"""The node tier as an engine's stack sees it: a ``KeyedTier`` whose owner is the machine's node daemon,
over a ``NodeStorage`` (the daemon's slab, mapped here, and the connection to the daemon).

Blocks go to the daemon under node keys: the engine's key bound to its namespace and block geometry (a
16-byte BLAKE2b of both), so engines of different models, layouts or tensor-parallel ranks share a daemon
without ever finding each other's blocks, and the slab's headers need no namespace of their own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

from kvtier.core.errors import TransferError
from kvtier.core.layout import BlockLayout
from kvtier.core.misses import MissReason
from kvtier.core.storage import BlockStorage
from kvtier.tiers.keyed import KeyedTier, RecentFailures
from kvtier.tiers.node.client import NodeClient
from kvtier.tiers.node.protocol import Op
from kvtier.tiers.node.slab import NODE_KEY_BYTES

NODE_DEVICE = "node"
"""The device of a node slab's blocks as transfers see them: named by key, copied by ``NodeBackend``."""

KNOWN_FOR_S = 2.0
"""How long the daemon's "present" counts here: other engines' stores and the daemon's evictions change
what it holds; a load of a block evicted meanwhile fails that block (recomputed), no more."""

FAILURES_KEPT = 65536
"""How many keys whose loads failed a ``NodeStorage`` remembers the reason of (``RecentFailures``)."""

_PERSON = b"kvtier-node-key"


class NodeStorage(BlockStorage):
    """The daemon's slab for blocks of one ``layout`` under one ``namespace`` digest (whose blocks they
    are), reached through ``client``: no addresses or slots of its own (slots are the daemon's, handed
    out per copy). Closing it closes the connection. ``on_skipped`` counts the blocks a store found in
    the daemon already (another engine stored them)."""

    by_key = True

    def __init__(
        self,
        layout: BlockLayout,
        client: NodeClient,
        namespace: bytes,
        on_skipped: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__(layout, 0, NODE_DEVICE, on_close=client.close)
        self.client = client
        self.namespace = namespace
        self.on_skipped = on_skipped
        self.failures = RecentFailures(FAILURES_KEPT)

    def _addresses(self, slots):
        raise TransferError("a node slab's blocks are named by key: the daemon gives their slots per copy")

    def node_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """The keys the daemon knows these blocks by (see the module doc)."""
        person, namespace = _PERSON, self.namespace
        return [hashlib.blake2b(namespace + key, digest_size=NODE_KEY_BYTES, person=person).digest() for key in keys]

    def failure(self, key: bytes) -> MissReason | None:
        """Why a load of ``key`` failed here lately, if it did."""
        return self.failures.get(key)


class NodeTier(KeyedTier):
    """The daemon behind ``storage``: asked which blocks it holds (one LOOKUP per query), loaded from and
    stored into by ``NodeBackend`` (straight between the caller's memory and the slab)."""

    def __init__(self, name: str, storage: NodeStorage, known_for: float | None = None) -> None:
        client = storage.client
        note = f"node daemon at {client.path} ({client.node_id or 'not connected'}), timeout {client.timeout:g} s"
        super().__init__(name, "node", storage, note, KNOWN_FOR_S if known_for is None else known_for, loads_direct=True)
        self._node_storage = storage  # (typed: ``storage`` is any BlockStorage to the base class)
        storage.on_skipped = lambda n: self.count(skipped_existing=n)

    @property
    def timeout(self) -> float:
        return self._node_storage.client.timeout

    def _present(self, keys: list[bytes]) -> list[bool]:
        (found,), _, _ = self._node_storage.client.call(Op.LOOKUP, self._node_storage.node_keys(keys))
        if not isinstance(found, list) or len(found) != len(keys):
            raise TransferError(f"the node daemon answered a lookup of {len(keys)} keys with {found!r:.80}")
        return [flag is True for flag in found]

    def _failure(self, key: bytes) -> MissReason | None:
        return self._node_storage.failure(key)
