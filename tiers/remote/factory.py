"""A remote tier, its clients and its record format, from a stack's configuration: what the ``remote``
medium's registry entry (``kvtier.tiers.remote.MEDIUM``) builds them with.

Everything that can be checked without the store is checked here, when the stack is built: the
backend's client package, the secrets the configuration names (a MAC key, a password). Connections
are made later, on a call's thread within its deadline, so a store that is down when an engine
starts makes misses, not a failed start.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.core.layout import BlockLayout
from kvtier.tiers.remote.config import RemoteTierConfig, store_backend
from kvtier.tiers.remote.link import Connector, StoreLink
from kvtier.tiers.remote.record import RecordFormat, mac_key, namespace_digest
from kvtier.tiers.remote.tier import RemoteTier

LOOKUP_CLIENTS = 1
"""The vLLM scheduler side's lookups are one batched query each, asked by one executor thread at a time."""


def connector(config: RemoteTierConfig, lends_memory: bool = True) -> Connector:
    """How to open clients of the configured store, with up to how many open at once (its backend's
    ``StoreBackend.connector``); a client that does not ``lends_memory`` only asks (lookups)."""
    return store_backend(config.backend).connector(config.settings, config.timeout, lends_memory)


def record_format(
    config: RemoteTierConfig, layout: BlockLayout, namespace: str | bytes, rank: int | None = None
) -> RecordFormat:
    """The records of a stack with this ``namespace`` and ``layout`` (of one tensor-parallel ``rank``
    under vLLM); raises ConfigError when ``auth_key_env`` or ``encryption_key_env`` names a missing or
    short secret."""
    return RecordFormat(
        config.prefix,
        namespace_digest(namespace, layout, rank),
        layout.block_bytes,
        mac_key(config.auth_key_env),
        rank,
        config.sealing(),
    )


def remote_tier(
    name: str,
    config: RemoteTierConfig,
    layout: BlockLayout,
    namespace: str | bytes,
    ranks: Sequence[int | None] = (None,),
    in_stack: bool = False,
) -> RemoteTier:
    """The tier, with a link of its own for lookups; a block is present when every one of ``ranks``
    has its record (one rank, None, for a standalone stack).

    ``in_stack``: the tier of a ``TierStack``, which any of the engine's threads may ask and load from:
    its lookups get as many clients as the store's loads and stores (``pool_size``), and its loads go
    straight into the caller's memory where the store's clients fetch (``Tier.loads_direct``). Else
    the tier of the vLLM scheduler side: one thread asks (``LOOKUP_CLIENTS``), and the workers' loads
    stage through host slots (MLA ranks share one staged copy; GPU blocks need it anyway)."""
    records = [record_format(config, layout, namespace, rank) for rank in ranks]
    wired = connector(config, lends_memory=False)
    clients = wired.clients if in_stack else LOOKUP_CLIENTS
    link = StoreLink(Connector(wired.connect, clients, wired.where), config.timeout, "lookups")
    backend = store_backend(config.backend)
    direct = in_stack and config.fetches
    return RemoteTier(
        name, layout, records, link, config.placement, registry=backend.reads_anywhere, loads_direct=direct
    )
