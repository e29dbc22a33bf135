"""The remote tier: a store shared with other engines and nodes (Mooncake Store, Redis/Valkey).

The store is not ours: other engines write into it, it evicts or loses any record at any moment, a
restart empties it. So the store itself is the index (batched existence queries, answers kept a few
seconds at most), every record describes itself and is checked before its bytes count (``record``),
every call has a deadline, and a dead store means a miss or a dropped store, never a hang.

- ``config``: the tier's YAML schema and the registry of store backends;
- ``client``: what kvtier needs from a store, whatever the backend (``StoreClient``);
- ``redis_settings``, ``mooncake_settings``: each backend's settings and registry entry;
- ``redis_client``, ``mooncake_client``: the backends' clients;
- ``record``: record names, the self-describing header, the optional MAC;
- ``link``: calls on a backend's clients with a deadline, reconnecting with backoff;
- ``tier``: the tier the planner sees (``RemoteTier``) over the store's records (``RemoteStorage``);
- ``factory``: the tier, its clients and its record format from a stack's configuration;
- ``transfer``: the transfer backend between host memory and the store's records (``RemoteBackend``);
- ``doctor``: what ``kvtier doctor`` checks of the tier and reports of it for sharing.

This module registers the store backends and builds the medium's registry entry (``MEDIUM``), which
names the medium's transfer backend.
"""

from __future__ import annotations

from kvtier.core.config import TransferConfig
from kvtier.core.media import EngineTierRequest, Medium, RankRequest, TierRequest
from kvtier.core.storage import BlockStorage
from kvtier.core.tier_config import TierConfigBase
from kvtier.tiers.remote import doctor, mooncake_settings, redis_settings
from kvtier.tiers.remote.config import RemoteTierConfig, register_store_backend
from kvtier.tiers.remote.factory import connector, record_format, remote_tier
from kvtier.tiers.remote.link import StoreLink
from kvtier.tiers.remote.tier import RemoteStorage, RemoteTier
from kvtier.tiers.remote.transfer import RemoteBackend

for _store in (mooncake_settings.BACKEND, redis_settings.BACKEND):
    register_store_backend(_store)


def _tier(request: TierRequest) -> RemoteTier:
    assert isinstance(request.config, RemoteTierConfig)
    return remote_tier(request.name, request.config, request.layout, request.stack.namespace, in_stack=True)


def _rank_storage(request: RankRequest) -> BlockStorage:
    """One rank's records (one record per block for every rank, where their KV is the same). The stores
    it skips because the store held the record already (another engine stored the block) are counted
    where the engine's worker says (``RankRequest.count``: ``skipped_existing``), as a tier counts them."""
    assert isinstance(request.config, RemoteTierConfig)
    rank = None if request.replicated else request.rank
    records = record_format(request.config, request.layout, request.namespace, rank)
    return RemoteStorage(request.layout, records, lambda n: request.count(skipped_existing=n))


def _engine_tier(request: EngineTierRequest) -> RemoteTier:
    """The tier of an engine's scheduler side: every rank's records (the workers' namespace), one client."""
    assert isinstance(request.config, RemoteTierConfig)
    return remote_tier(request.name, request.config, request.layout, request.namespace, request.ranks)


def _backend(transfer: TransferConfig, config: TierConfigBase) -> RemoteBackend:
    """Loads and stores of the tier's records, through a link of their own to the store."""
    assert isinstance(config, RemoteTierConfig)
    return RemoteBackend(StoreLink(connector(config), config.timeout, "loads and stores"), config.fetches)


# A store others write to and evict from: its blocks are announced as the store's (``RemoteTier.location``).
MEDIUM = Medium(
    "remote",
    RemoteTierConfig,
    _tier,
    _rank_storage,
    event_medium="STORAGE",
    copies_outlive_jobs=True,
    backend=_backend,
    engine_tier=_engine_tier,
    doctor=doctor.checks,
    sharing=doctor.sharing,
)
