"""A real Redis Cluster for the remote tier's tests: ``masters`` redis-servers (and ``replicas`` more per
master where a test needs failover) on free loopback ports, joined by ``redis-cli --cluster create``,
without persistence, each node's files in the test's own directory; every node killed by its pid when
the test is done.

    with redis_cluster(tmp_path, masters=3, replicas=1, password="...") as cluster:
        cluster.url, cluster.seeds                # node 0's redis:// URL; every node's
        cluster.nodes[i].client()                 # a redis-py client of node i, for poking it directly
        cluster.masters(); cluster.owner(slot)    # the nodes serving slots now; the node serving ``slot``
        cluster.kill(i); cluster.stop(i); cluster.cont(i)   # SIGKILL / SIGSTOP / SIGCONT node i
        cluster.migrate(slot, to)                 # move a slot and its keys to node ``to``, or in steps:
        cluster.begin_migration(slot, to); cluster.move_keys(source, to, names); cluster.end_migration(slot, to)
        cluster.restart()                         # every node killed and started again: the same cluster, empty

Nodes time each other out after ``NODE_TIMEOUT_MS``, and keep serving their own slots while another
master is down (``cluster-require-full-coverage no``), as a deployment that prefers a partial cache to
none would. ``redis_cluster()`` skips the test when redis-server, redis-cli or redis-py is missing (fails
it under KVTIER_REQUIRE_REMOTE=1), as ``helpers.redis_server`` does.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from helpers.ports import free_port
from helpers.redis_server import INSTALL_SERVER, RedisServer, require_redis, skip_unless_present

CLI = "redis-cli"
NODE_TIMEOUT_MS = 1000
FORMED_WITHIN_S = 30.0


def require_cluster() -> None:
    """``require_redis()``, and redis-cli (which creates the cluster)."""
    require_redis()
    if shutil.which(CLI) is None:
        skip_unless_present([f"redis-cli is not installed: {INSTALL_SERVER}"])


class ClusterNode(RedisServer):
    """One node of a cluster: a redis-server with cluster mode on (its ``nodes.conf`` in its directory, so
    a restart rejoins the cluster it was in, empty), its cluster bus on a free port of its own."""

    def __init__(self, directory: Path, maxmemory: str | None = None, password: str | None = None) -> None:
        super().__init__(directory, maxmemory, password)
        self.bus_port = free_port()

    def config_lines(self) -> list[str]:
        lines = super().config_lines() + [
            "cluster-enabled yes",
            f"cluster-port {self.bus_port}",
            f"cluster-config-file {self.directory / 'nodes.conf'}",
            f"cluster-node-timeout {NODE_TIMEOUT_MS}",
            "cluster-require-full-coverage no",
        ]
        if self.password is not None:  # replicas log in to their masters with it too
            lines.append(f"masterauth {self.password}")
        return lines

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def node_id(self) -> str:
        return _text(self.client().cluster("myid"))

    def info(self) -> dict[str, str]:
        """``CLUSTER INFO``, as redis-py parses it."""
        return self.client().cluster("info")


class RedisCluster:
    """``masters`` x (1 + ``replicas``) nodes; ``nodes[i]`` for i < masters are the masters it was created with."""

    def __init__(
        self,
        directory: Path,
        masters: int = 3,
        replicas: int = 0,
        maxmemory: str | None = None,
        password: str | None = None,
    ) -> None:
        self.nodes = [ClusterNode(directory / f"node{i}", maxmemory, password) for i in range(masters * (1 + replicas))]
        self.replicas = replicas
        self.password = password

    @property
    def url(self) -> str:
        return self.nodes[0].url.removesuffix("/0")

    @property
    def seeds(self) -> list[str]:
        return [node.url.removesuffix("/0") for node in self.nodes]

    def start(self) -> None:
        """Start every node and join them into a new cluster; returns once every live node says it is ok."""
        for node in self.nodes:
            node.start()
        done = subprocess.run(
            [
                CLI,
                "--cluster",
                "create",
                *(node.address for node in self.nodes),
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=FORMED_WITHIN_S,
            env=os.environ if self.password is None else {**os.environ, "REDISCLI_AUTH": self.password},
        )
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed ({done.returncode}): {done.stdout[-2000:]}")
        self.wait_formed()

    def restart(self) -> None:
        """Kill every node and start them again on the same ports: the same cluster, empty."""
        for node in self.nodes:
            node.kill()
        for node in self.nodes:
            node.start()
        self.wait_formed()

    def wait_formed(self, within: float = FORMED_WITHIN_S) -> None:
        """Until every running node says cluster_state:ok, knows every slot served and every running
        node, and (with replicas) every replica is in sync with its master."""
        running = [node for node in self.nodes if node.proc is not None and node.proc.poll() is None]
        deadline = time.monotonic() + within
        while True:
            try:
                if all(self._formed(node, len(running)) for node in running):
                    return
            except Exception:  # a node still starting or electing
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the cluster did not form within {within} s: {[n.info() for n in running]}")
            time.sleep(0.05)

    def _formed(self, node: ClusterNode, running: int) -> bool:
        info = node.info()
        if info["cluster_state"] != "ok" or int(info["cluster_slots_ok"]) != 16384:
            return False
        if int(info["cluster_known_nodes"]) < running:
            return False
        replication = node.client().info("replication")
        return replication["role"] == "master" or replication.get("master_link_status") == "up"

    def masters(self) -> list[int]:
        """The running nodes that serve slots now (by index)."""
        return sorted({self.owner(slot) for slot in self._slot_starts()})

    def owner(self, slot: int) -> int:
        """The node serving ``slot`` now, as a running master says."""
        for first, last, master, *_ in self._slots():
            if first <= slot <= last:
                return self._index(int(master[1]))
        raise LookupError(f"no node serves slot {slot}")

    def _slots(self) -> list:
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None and not node.stopped:
                return node.client().execute_command("CLUSTER SLOTS")
        raise RuntimeError("no node of the cluster is running")

    def _slot_starts(self) -> list[int]:
        return [first for first, *_ in self._slots()]

    def _index(self, port: int) -> int:
        return next(i for i, node in enumerate(self.nodes) if node.port == port)

    def kill(self, i: int) -> None:
        self.nodes[i].kill()

    def stop(self, i: int) -> None:
        self.nodes[i].stop()

    def cont(self, i: int) -> None:
        self.nodes[i].cont()

    def kill_all(self) -> None:
        for node in self.nodes:
            node.kill()

    def begin_migration(self, slot: int, to: int) -> int:
        """Mark ``slot`` as migrating from its owner to node ``to`` (the state in which the owner answers
        ASK for keys it no longer holds); the owner's index."""
        source = self.owner(slot)
        target = self.nodes[to]
        target.client().execute_command("CLUSTER SETSLOT", slot, "IMPORTING", self.nodes[source].node_id())
        self.nodes[source].client().execute_command("CLUSTER SETSLOT", slot, "MIGRATING", target.node_id())
        return source

    def move_keys(self, source: int, to: int, names: Sequence[str]) -> None:
        """MIGRATE ``names`` (of a slot being migrated) from node ``source`` to node ``to``."""
        target = self.nodes[to]
        self.nodes[source].client().execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *names)

    def end_migration(self, slot: int, to: int) -> None:
        """Give ``slot`` to node ``to``, telling every running master (the others learn it by gossip)."""
        owner = self.nodes[to].node_id()
        for i in [to, *self.masters()]:
            self.nodes[i].client().execute_command("CLUSTER SETSLOT", slot, "NODE", owner)

    def migrate(self, slot: int, to: int) -> None:
        """Move ``slot`` and every key in it to node ``to``, as ``redis-cli --cluster reshard`` does."""
        source = self.begin_migration(slot, to)
        names = self.nodes[source].client().execute_command("CLUSTER GETKEYSINSLOT", slot, 1000)
        if names:
            self.move_keys(source, to, [_text(name) for name in names])
        self.end_migration(slot, to)


def _text(value: bytes | str) -> str:
    """A reply's text (redis-py decodes some cluster replies itself, not others)."""
    return value.decode() if isinstance(value, bytes) else value


@contextlib.contextmanager
def redis_cluster(
    directory: Path, masters: int = 3, replicas: int = 0, maxmemory: str | None = None, password: str | None = None
) -> Iterator[RedisCluster]:
    """A formed cluster, every node killed on the way out whatever happened (skips when Redis is missing);
    with ``password``, every node requires it."""
    require_cluster()
    cluster = RedisCluster(directory, masters, replicas, maxmemory, password)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.kill_all()
