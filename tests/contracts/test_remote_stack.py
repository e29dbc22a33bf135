"""A whole stack over a shared store (``kvtier.testing.remote_stack.RemoteStackTests``, whose docstring says
what it shows), run against every store in ``helpers.stores.STORES`` for real.

To add a backend: subclass ``kvtier.testing.store.StoreUnderTest`` and add it to ``STORES``; every test here
then runs over it. What one store does beyond this (Redis: a server that hangs or dies under a load, the
password from the environment; a Redis Cluster: slots that move, masters killed, stopped or failed over;
Mooncake: its master or segment owner killed mid-load, the memory an engine lends) stays in
tests/tiers/remote/test_redis_stack.py, test_redis_cluster.py and test_mooncake_stack.py.
"""

from __future__ import annotations

from helpers.stores import EveryStore
from kvtier.testing.remote_stack import RemoteStackTests


class TestRemoteStacks(EveryStore, RemoteStackTests):
    pass
