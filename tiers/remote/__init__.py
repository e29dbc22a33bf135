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
- ``tier``: the tier the planner sees (``RemoteTier``) over the store's records (``RemoteStorage``).

Bytes move through ``kvtier.transfers.remote``.
"""

from kvtier.tiers.remote import mooncake_settings, redis_settings
from kvtier.tiers.remote.config import register_store_backend

for _backend in (mooncake_settings.BACKEND, redis_settings.BACKEND):
    register_store_backend(_backend)
