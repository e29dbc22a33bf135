"""Every shared store kvtier's remote tier runs on, as a ``kvtier.testing.store.StoreUnderTest`` each, so
that the suites over a store (``StoreClientTests``, ``RemoteStackTests``; tests/contracts) run against
each of them for real: a Redis server, a Redis Cluster, a Mooncake master with a segment owner, the same
with a fetch buffer.

To add a store to kvtier's own runs: subclass ``StoreUnderTest`` and add it to ``STORES``; every suite
parametrised over ``STORES`` (``EveryStore``) then runs against it. What the backends are allowed to do
differently is stated as data on each class, so a backend whose bounds change says so here, once.

A store's servers are real processes: ``__enter__`` skips the test (fails it under KVTIER_REQUIRE_REMOTE=1)
when the server or its client package is missing, naming the install line, as the servers' helpers do.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest

from helpers.mooncake_server import MooncakeMaster, SegmentOwner, http_get
from helpers.redis_cluster import RedisCluster, redis_cluster
from helpers.redis_server import RedisServer, redis_server
from kvtier.core.errors import ClosedError
from kvtier.testing.store import StoreUnderTest, bounded


class RedisStore(StoreUnderTest):
    """A redis-server on a free loopback port (``helpers.redis_server``)."""

    name = "redis"
    DEAD_WITHIN_S = 0.5  # the kernel refuses the connection at once
    RECONNECTS_AT_ONCE = True  # a call that fails before any reply goes once more on a new connection
    SMALL = (96, 64 << 10)
    SMALL_OPTIONS = {"maxmemory": "3mb"}  # maxmemory-policy allkeys-lru
    CLOSED_CALLS_RAISE = ClosedError  # close() is final: no call connects again (redis-py alone would)
    FETCHES = True

    def __init__(self, directory: Path, maxmemory: str | None = None) -> None:
        super().__init__(directory)
        self.maxmemory = maxmemory
        self.server: RedisServer | None = None

    def __enter__(self) -> RedisStore:
        self.server = self._stack.enter_context(redis_server(self.directory / "redis", maxmemory=self.maxmemory))
        return self

    def client(self, timeout: float = 1.0):
        from kvtier.tiers.remote.redis_client import RedisClient

        assert self.server is not None
        return RedisClient(self.server.url, timeout=timeout)

    def tier(self, timeout: float = 1.0, **options: Any) -> dict:
        assert self.server is not None
        return {
            "medium": "remote",
            "backend": "redis",
            "timeout": timeout,
            "redis": {"url": self.server.url},
            **options,
        }

    def hung_window(self, timeout: float) -> tuple[float, float]:
        from kvtier.tiers.remote.redis_client import SOCKET_TIMEOUT_FACTOR

        # the socket timeout ends the call, a backstop at a multiple of the tier's timeout
        return timeout * SOCKET_TIMEOUT_FACTOR - 0.1, timeout * SOCKET_TIMEOUT_FACTOR + 1.0

    def kill(self) -> None:
        assert self.server is not None
        self.server.kill()

    def restart(self) -> None:
        assert self.server is not None
        self.server.restart()

    def hang(self) -> None:
        assert self.server is not None
        self.server.stop()

    def resume(self) -> None:
        assert self.server is not None
        self.server.cont()

    def existence_queries(self) -> int:
        assert self.server is not None
        return self.server.client().info("commandstats").get("cmdstat_exists", {}).get("calls", 0)

    def write(self, name: str, data: bytes) -> None:
        assert self.server is not None
        self.server.client().set(name, data)

    def read(self, name: str, size: int) -> bytes | None:
        assert self.server is not None
        value = self.server.client().get(name)
        return value if value is not None and len(value) == size else None


class RedisClusterStore(StoreUnderTest):
    """A Redis Cluster of three masters on free loopback ports (``helpers.redis_cluster``); its records
    spread over all of them."""

    name = "redis-cluster"
    DEAD_WITHIN_S = 0.5  # every node refuses the connection at once
    RECONNECTS_AT_ONCE = True  # as RedisStore: each node's batch goes once more on a new connection
    SMALL = (192, 64 << 10)  # 12 MiB over three nodes of 3 MB each
    SMALL_OPTIONS = {"maxmemory": "3mb"}
    CLOSED_CALLS_RAISE = ClosedError
    FETCHES = True

    def __init__(self, directory: Path, maxmemory: str | None = None) -> None:
        super().__init__(directory)
        self.maxmemory = maxmemory
        self.cluster: RedisCluster | None = None

    def __enter__(self) -> RedisClusterStore:
        self.cluster = self._stack.enter_context(redis_cluster(self.directory / "cluster", maxmemory=self.maxmemory))
        return self

    def client(self, timeout: float = 1.0):
        from kvtier.tiers.remote.redis_cluster import RedisClusterClient

        assert self.cluster is not None
        return RedisClusterClient(self.cluster.url, timeout=timeout)

    def tier(self, timeout: float = 1.0, **options: Any) -> dict:
        assert self.cluster is not None
        return {
            "medium": "remote",
            "backend": "redis",
            "timeout": timeout,
            "redis": {"url": self.cluster.url, "cluster": True},
            **options,
        }

    def hung_window(self, timeout: float) -> tuple[float, float]:
        from kvtier.tiers.remote.redis_cluster import REPLY_SHARE

        # the first call waits REPLY_SHARE of the timeout for its nodes; the nodes are then down for a
        # backoff in which calls fail at once
        return 0.0, timeout * REPLY_SHARE + 1.0

    def kill(self) -> None:
        assert self.cluster is not None
        self.cluster.kill_all()

    def restart(self) -> None:
        assert self.cluster is not None
        self.cluster.restart()

    def hang(self) -> None:
        assert self.cluster is not None
        for i in range(len(self.cluster.nodes)):
            self.cluster.stop(i)

    def resume(self) -> None:
        assert self.cluster is not None
        for i in range(len(self.cluster.nodes)):
            self.cluster.cont(i)

    def existence_queries(self) -> int:
        assert self.cluster is not None
        return sum(
            node.client().info("commandstats").get("cmdstat_exists", {}).get("calls", 0) for node in self.cluster.nodes
        )


class MooncakeStore(StoreUnderTest):
    """A Mooncake master and one standalone segment owner holding the records (``helpers.mooncake_server``)."""

    name = "mooncake"
    DEAD_WITHIN_S = 7.0  # a call against a killed master returns after about 4.3 s whatever the timeout
    RECONNECTS_AT_ONCE = False  # the client finds the new master by itself, after some failed calls
    SMALL = (40, 1 << 20)
    SMALL_OPTIONS = {"segment": "32MB"}
    CLOSED_CALLS_RAISE = ClosedError  # closing under a call would crash the process: calls and close share a lock
    FETCHES = False  # (reads land straight in the memory given; ``MooncakeFetchStore`` fetches)

    def __init__(self, directory: Path, segment: str = "256MB") -> None:
        super().__init__(directory)
        self.segment = segment
        self.master: MooncakeMaster | None = None
        self.owner: SegmentOwner | None = None

    def __enter__(self) -> MooncakeStore:
        with contextlib.ExitStack() as starting:
            self.master = starting.enter_context(MooncakeMaster())
            self.owner = starting.enter_context(SegmentOwner(self.master, self.segment))
            self._stack = starting.pop_all()
        return self

    def client(self, timeout: float = 1.0):
        from kvtier.tiers.remote.mooncake_client import MooncakeClient

        assert self.master is not None
        master = self.master
        return bounded(
            lambda: MooncakeClient(master=master.address, metadata_server=master.metadata_url, timeout=timeout)
        )[0]

    def tier(self, timeout: float = 1.0, **options: Any) -> dict:
        assert self.master is not None
        return {
            "medium": "remote",
            "backend": "mooncake",
            "timeout": timeout,
            "mooncake": {"master": self.master.address, "metadata_server": self.master.metadata_url},
            **options,
        }

    def hung_window(self, timeout: float) -> tuple[float, float]:
        # a stalled master answers after MC_RPC_TIMEOUT_MS, which the client sets to its timeout
        return 0.9 * timeout, timeout + 1.5

    def kill(self) -> None:
        assert self.master is not None and self.owner is not None
        self.owner.kill()
        self.master.kill()

    def restart(self) -> None:
        """The master only: the owner mounts its segment again, empty, as it would after a master's crash."""
        assert self.master is not None
        self.master.restart()
        self.master.wait_segments(1)

    def hang(self) -> None:
        assert self.master is not None and self.owner is not None
        self.master.stop()
        self.owner.stop()

    def resume(self) -> None:
        assert self.master is not None and self.owner is not None
        self.owner.cont()
        self.master.cont()

    def existence_queries(self) -> int:
        assert self.master is not None
        body = http_get(self.master.metrics_port, "/metrics")
        assert body is not None, "the master's metrics did not answer"
        counts = dict(
            line.split()
            for line in body.decode().splitlines()
            if line.startswith("master_batch_exist_key_requests_total")
        )
        return int(float(counts["master_batch_exist_key_requests_total"]))


class MooncakeFetchStore(MooncakeStore):
    """The same store, its records read into each client's fetch buffer first (``fetch_buffer``): loads go
    straight into the caller's memory, as Redis's do, and a node daemon may keep it below its slab."""

    name = "mooncake-fetch"
    FETCHES = True
    FETCH_BUFFER = 64 << 20

    def client(self, timeout: float = 1.0):
        from kvtier.tiers.remote.mooncake_client import MooncakeClient

        assert self.master is not None
        master = self.master
        return bounded(
            lambda: MooncakeClient(
                master=master.address,
                metadata_server=master.metadata_url,
                timeout=timeout,
                fetch_buffer=self.FETCH_BUFFER,
            )
        )[0]

    def tier(self, timeout: float = 1.0, **options: Any) -> dict:
        entry = super().tier(timeout, **options)
        entry["mooncake"]["fetch_buffer"] = self.FETCH_BUFFER
        return entry


STORES: dict[str, type[StoreUnderTest]] = {
    "redis": RedisStore,
    "redis-cluster": RedisClusterStore,
    "mooncake": MooncakeStore,
    "mooncake-fetch": MooncakeFetchStore,
}
"""Every store a suite parametrised over stores runs against (its ids are these names)."""


class EveryStore:
    """Mixed into a suite over a store (before it): its tests run against every store in ``STORES``, their
    ids the stores' names."""

    @pytest.fixture(scope="class", params=sorted(STORES))
    @classmethod
    def store_class(cls, request) -> type[StoreUnderTest]:
        return STORES[request.param]
