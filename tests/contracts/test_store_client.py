"""The ``StoreClient`` contract (``kvtier.testing.store.StoreClientTests``, whose docstring lists what it
checks), run against every store in ``helpers.stores.STORES`` for real: a Redis server, a Redis Cluster of
three masters, a Mooncake master with a segment owner (its clients with and without a fetch buffer).

To add a backend: subclass ``kvtier.testing.store.StoreUnderTest`` for its servers and client and add it to
``STORES``; every test here then runs against it (ids ``[redis]``, ``[redis-cluster]``, ``[mooncake]``, ...).
"""

from __future__ import annotations

from helpers.stores import EveryStore
from kvtier.testing.store import StoreClientTests


class TestStoreClients(EveryStore, StoreClientTests):
    pass
