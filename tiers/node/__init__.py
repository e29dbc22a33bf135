"""The node tier: one slab of shared memory per machine, owned by the node daemon (``kvtier node serve``)
and mapped by every engine process on the machine, so a block one engine computed is a hit for all of
them, copied by each engine itself between its own memory and the slab, with only control messages on
the daemon's socket.

- ``slab``: the slab's format (superblock, slot headers, data) and the daemon's file of it;
- ``protocol``: the control messages, and the checks every message from a peer passes;
- ``client``: an engine's connection to the daemon (timeouts, reconnection, the daemon's user checked);
- ``config``: the tier's YAML schema (``medium: node``);
- ``tier``: the tier an engine's stack plans with (``NodeTier``) over the slab (``NodeStorage``);
- ``transfer``: the copies in and out, checked against the slot headers (``NodeBackend``);
- ``doctor``: what ``kvtier doctor`` checks of the tier (its daemon, its secrets).

This module builds the medium's registry entry (``MEDIUM``); the daemon itself is ``kvtier.node_daemon``.
"""

from __future__ import annotations

import hashlib

from kvtier.core.config import TransferConfig
from kvtier.core.errors import ConfigError
from kvtier.core.layout import BlockLayout
from kvtier.core.media import EngineTierRequest, Medium, RankRequest, TierRequest
from kvtier.core.sealing import SEAL_BYTES, SealingKeys
from kvtier.core.tier_config import TierConfigBase
from kvtier.tiers.node import doctor
from kvtier.tiers.node.client import NodeClient
from kvtier.tiers.node.config import NodeTierConfig
from kvtier.tiers.node.tier import NodeStorage, NodeTier
from kvtier.tiers.node.transfer import NodeBackend
from kvtier.tiers.remote.record import namespace_digest


def node_storage(config: NodeTierConfig, layout: BlockLayout, namespace: str | bytes, rank: int | None = None):
    """A connection to the daemon ``config`` names, made now (a daemon that is not there, speaks another
    protocol, runs as an untrusted user or has slots too small for ``layout``'s blocks, sealed where the
    tier seals, is a ConfigError), for blocks of ``namespace`` (and of one tensor-parallel ``rank``
    where the ranks' KV differs)."""
    sealing = config.sealing()
    trusted = [] if config.daemon_uid is None else [config.daemon_uid]
    client = NodeClient(config.socket, config.timeout, trusted)
    client.open()
    assert client.geometry is not None
    stored = layout.block_bytes + (0 if sealing is None else SEAL_BYTES)
    if stored > client.geometry.slot_bytes:
        client.close()
        what = f"blocks of {layout.block_bytes} bytes" + ("" if sealing is None else f", {stored} sealed,")
        raise ConfigError(
            f"node tier: {what} do not fit the daemon's slots of {client.geometry.slot_bytes} bytes at "
            f"{config.socket}: raise block_bytes in the daemon's YAML to at least {stored}"
        )
    current, *older = node_namespaces(namespace, layout, rank, sealing)
    return NodeStorage(layout, client, current, sealing=sealing, older=older)


def node_namespaces(
    namespace: str | bytes, layout: BlockLayout, rank: int | None, sealing: SealingKeys | None
) -> list[bytes]:
    """The digests the daemon knows a stack's blocks under (``NodeStorage.node_keys``): its namespace's, and
    where the tier seals, bound to the sealing key's id, so that engines sealing under another secret, or
    not at all, never find these blocks (nor take them for damaged ones of their own). During a rotation
    the previous secret's digest follows the current one: blocks engines still on the previous secret
    stored are found (and open) under it; nothing is stored there."""
    digest = namespace_digest(namespace, layout, rank)
    if sealing is None:
        return [digest]
    return [
        hashlib.blake2b(digest + key_id, digest_size=len(digest), person=_SEALED_PERSON).digest()
        for key_id in sealing.key_ids
    ]


_SEALED_PERSON = b"kvtier-node-seal"


def _tier(request: TierRequest) -> NodeTier:
    assert isinstance(request.config, NodeTierConfig)
    return NodeTier(request.name, node_storage(request.config, request.layout, request.stack.namespace))


def _rank_storage(request: RankRequest) -> NodeStorage:
    assert isinstance(request.config, NodeTierConfig)
    rank = None if request.replicated else request.rank
    storage = node_storage(request.config, request.layout, request.namespace, rank)
    storage.on_skipped = lambda n: request.count(skipped_existing=n)
    return storage


def _engine_tier(request: EngineTierRequest) -> NodeTier:
    """The tier of an engine's scheduler side: its own connection, asking for every rank's copy."""
    assert isinstance(request.config, NodeTierConfig)
    storage = node_storage(request.config, request.layout, request.namespace)
    spaces = [node_namespaces(request.namespace, request.layout, rank, storage.sealing) for rank in request.ranks]
    return NodeTier(request.name, storage, rank_namespaces=spaces)


def _backend(transfer: TransferConfig, config: TierConfigBase) -> NodeBackend:
    return NodeBackend(transfer.threads)


MEDIUM = Medium(
    "node",
    NodeTierConfig,
    _tier,
    _rank_storage,
    # host memory directly (an engine's own blocks too, where they are host memory); GPU memory through a
    # host tier until the slab is registered with CUDA
    direct=lambda other, caps: other != "gpu" or caps.gpu_in_host_memory,
    event_medium="CPU",  # (the machine's: ``NodeTier.location``)
    one_copy_for_ranks=True,  # ranks with the same KV (MLA) share one copy: one node key for all of them
    backend=_backend,
    engine_tier=_engine_tier,
    doctor=doctor.checks,
)
