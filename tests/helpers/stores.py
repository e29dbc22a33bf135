"""Every shared store kvtier's remote tier runs on, behind one test interface, so that a suite written once
(tests/contracts: the ``StoreClient`` contract, the remote transfer backend, a stack over a store) runs
against each of them for real: a Redis server, a Redis Cluster, a Mooncake master with a segment owner.

    with STORES["redis"](tmp_path) as store:
        client = store.client(timeout=1.0)        # kvtier's StoreClient for this backend
        store.tier(timeout=1.0, prefix="t1")      # a stack's remote tier mapping for it
        store.write(name, data); store.read(name, size); store.holds(names)  # around kvtier's client
        store.kill(); store.restart(); store.hang(); store.resume()          # faults
        store.existence_queries()                 # batched existence queries the server answered so far

What the backends are allowed to do differently is stated as data on each class (``DEAD_WITHIN_S``,
``hung_window``, ``RECONNECTS_AT_ONCE``, ``SMALL``, ``CLOSED_CALLS_RAISE``), so the suites assert the
same behaviour with each backend's own bounds, and a backend whose bounds change says so here, once.

To add a store: subclass ``StoreUnderTest`` (start its servers in ``__enter__`` on ``self._stack``, which
``__exit__`` closes) and add it to ``STORES``; every suite parametrised over ``STORES`` then runs against it.

A store's servers are real processes: ``__enter__`` skips the test (fails it under KVTIER_REQUIRE_REMOTE=1)
when the server or its client package is missing, naming the install line, as the servers' helpers do.
"""

from __future__ import annotations

import contextlib
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from helpers.mooncake_server import MooncakeMaster, SegmentOwner
from helpers.redis_cluster import RedisCluster, redis_cluster
from helpers.redis_server import RedisServer, redis_server
from kvtier.core.errors import ClosedError, StoreError

CALL_LIMIT_S = 30.0
"""No store call in a test may take longer: a test that hits it fails instead of hanging."""


def bounded(call: Callable[..., Any], *args: Any, limit: float = CALL_LIMIT_S) -> tuple[Any, float]:
    """``call(*args)`` on a thread, failing the test if it is still running after ``limit`` seconds; its
    result (or its exception, raised here) and how long it took. A hung store must fail a test, never hang it."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        start = time.monotonic()
        try:
            outcome["result"] = call(*args)
        except BaseException as exc:  # handed to the test's thread below
            outcome["error"] = exc
        outcome["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    assert not thread.is_alive(), f"{getattr(call, '__name__', call)} still running after {limit} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"], outcome["seconds"]


def retry(call: Callable[[], Any], until: Callable[[Any], bool] = lambda _: True, seconds: float = 10.0) -> Any:
    """``call()`` until it returns without StoreError and ``until`` its result, for ``seconds`` at most: a
    store that came back may refuse the first calls of a client that has not noticed yet."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            result, _ = bounded(call)
            if until(result) or time.monotonic() > deadline:
                return result
        except StoreError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)


def pieces_of(array: np.ndarray) -> list[tuple[int, int]]:
    """One record's single piece: the whole of a contiguous uint8 ``array``."""
    return [(array.ctypes.data, array.nbytes)]


class StoreUnderTest(ABC):
    """One running store, as the suites over every store see it. A context manager: entering starts the
    servers (or skips the test), leaving kills them."""

    name: ClassVar[str]
    DEAD_WITHIN_S: ClassVar[float]
    """A call to a store whose servers were killed raises StoreError within this many seconds."""
    RECONNECTS_AT_ONCE: ClassVar[bool]
    """Whether a client's first call after a server restart already succeeds (else it may raise for a while)."""
    SMALL: ClassVar[tuple[int, int]]
    """(records, bytes each) that overfill the store ``small()`` starts."""
    SMALL_OPTIONS: ClassVar[dict[str, Any]]
    """What the constructor takes to start a store too small for ``SMALL``."""
    CLOSED_CALLS_RAISE: ClassVar[type[Exception] | None]
    """What a call on a closed client raises; None where it answers instead (all False, writing nothing)."""
    FETCHES: ClassVar[bool]
    """Whether its clients ``fetch`` (read records into memory of their own first)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._raw: Any = None
        self._stack = contextlib.ExitStack()  # the servers ``__enter__`` starts, stopped by ``__exit__``

    @abstractmethod
    def __enter__(self) -> StoreUnderTest: ...

    def __exit__(self, *exc_info: object) -> None:
        try:
            self._close_raw()
        finally:
            self._stack.close()

    @abstractmethod
    def client(self, timeout: float = 1.0):
        """A new kvtier ``StoreClient`` of this store (the caller closes it)."""

    @abstractmethod
    def tier(self, timeout: float = 1.0, **options: Any) -> dict:
        """A stack's remote tier mapping for this store; ``options`` are further keys of the tier."""

    @abstractmethod
    def hung_window(self, timeout: float) -> tuple[float, float]:
        """Seconds within which a call to a hung store (``hang()``) raises StoreError, for a client of ``timeout``."""

    @abstractmethod
    def kill(self) -> None:
        """Kill every server of the store: it is dead."""

    @abstractmethod
    def restart(self) -> None:
        """Kill the store and start it again at the same address: it comes back empty."""

    @abstractmethod
    def hang(self) -> None:
        """Stop every server (SIGSTOP): they keep their sockets and answer nothing."""

    @abstractmethod
    def resume(self) -> None: ...

    @abstractmethod
    def existence_queries(self) -> int:
        """How many batched existence queries the store has answered so far."""

    @classmethod
    @contextlib.contextmanager
    def small(cls, directory: Path) -> Iterator[StoreUnderTest]:
        """A store of its own with too little memory for ``SMALL``: it must evict."""
        with cls(directory, **cls.SMALL_OPTIONS) as store:
            yield store

    # Around kvtier's client, through a client the store keeps for itself (opened on first use).

    def write(self, name: str, data: bytes) -> None:
        """Put ``data`` as the record ``name``, replacing any (damage, forgery, another stack's copy)."""
        array = np.frombuffer(data, np.uint8).copy()
        assert bounded(self._raw_client().put, [name], [pieces_of(array)])[0] == [True]

    def read(self, name: str, size: int) -> bytes | None:
        """The record ``name`` when it holds exactly ``size`` bytes, else None."""
        array = np.zeros(size, np.uint8)
        ok, _ = bounded(self._raw_client().get, [name], [pieces_of(array)])
        return array.tobytes() if ok[0] else None

    def holds(self, names: Sequence[str]) -> list[bool]:
        """Which of ``names`` the store holds now."""
        return bounded(self._raw_client().exists, list(names))[0]

    def _raw_client(self):
        if self._raw is None:
            self._raw = self.client(timeout=5.0)
        return self._raw

    def _close_raw(self) -> None:
        raw, self._raw = self._raw, None
        if raw is not None:
            bounded(raw.close)


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
        from helpers.mooncake_server import http_get

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
