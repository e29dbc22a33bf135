"""The redis backend over a Redis Cluster (``cluster: true``), against real clusters of three masters
(``helpers.redis_cluster``) whose nodes the tests migrate slots between, kill, stop and fail over. The
contract suites (tests/contracts) run the cluster as one more store; this is what only a cluster does.

What it shows: a batch whose records land on every master round-trips bit-exact in one round trip per
node; a stack stores and loads through the cluster; a record whose slot moved is read after MOVED, and
one of a slot being migrated after ASK, also written there; a master killed under a load fails exactly
its blocks, at once, while the others load bit-exact, and a client whose URL names that dead node finds
the cluster through its seeds; after a failover the promoted replica serves the records that replicated,
bit-exact; a stopped master costs a lookup or load no more than the deadline and fails only its own
blocks; a hostile record written with redis-cli is refused; wrong cluster settings are config errors.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator

import numpy as np
import pytest
from redis.crc import key_slot

from helpers.config_helpers import error_of
from helpers.redis_cluster import CLI, RedisCluster, redis_cluster
from kvtier import KVTier
from kvtier.testing.common import assert_clean
from kvtier.tiers.remote.redis_cluster import RedisClusterClient

BLOCK = 64 * 1024
TOKENS = 16
TIMEOUT = 1.0
RECORD = 4096
PASSWORD = "correct-horse-cluster"


def prompt(n: int, start: int = 0) -> list[int]:
    return list(range(start * 1000, start * 1000 + TOKENS * n))


def data(n: int, seed: int = 0, size: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, size), dtype=np.uint8)


def pieces(array: np.ndarray) -> list[list[tuple[int, int]]]:
    """Each row of a contiguous uint8 array as one record of one piece."""
    return [[(row.ctypes.data, row.nbytes)] for row in array]


def config(cluster: RedisCluster, host: int = 32, **redis) -> dict:
    """A host tier over the cluster; ``redis`` adds settings of the backend."""
    remote = {
        "medium": "remote",
        "backend": "redis",
        "timeout": TIMEOUT,
        "redis": {"url": cluster.url, "cluster": True, **redis},
    }
    return {
        "block_bytes": BLOCK,
        "block_tokens": TOKENS,
        "namespace": "model-a",
        "tiers": [{"medium": "host", "capacity_blocks": host}, remote],
    }


def stored(cfg: dict, tokens: list[int], blocks: np.ndarray) -> None:
    with KVTier.open(cfg) as kv:
        assert kv.store(tokens, blocks).result(30).stored == len(blocks)
        kv.wait_idle(30)
        assert kv.stats()["remote"]["committed"] == len(blocks)


def load(kv: KVTier, tokens: list[int], n: int):
    out = np.zeros((n, BLOCK), np.uint8)
    return kv.load(tokens, out).result(30), out


def owners(kv: KVTier, cluster: RedisCluster, tokens: list[int]) -> list[int]:
    """The node serving each block's record."""
    return [cluster.owner(key_slot(kv.stack.tiers[-1].records[0].name(key).encode())) for key in kv.keys(tokens)]


def spread(cluster: RedisCluster, tag: str, per_node: int) -> list[str]:
    """Names of which every master serves ``per_node``, interleaved."""
    found: dict[int, list[str]] = {i: [] for i in cluster.masters()}
    i = 0
    while any(len(names) < per_node for names in found.values()):
        name = f"{tag}/{i}"
        names = found[cluster.owner(key_slot(name.encode()))]
        if len(names) < per_node:
            names.append(name)
        i += 1
    return [name for row in zip(*found.values(), strict=True) for name in row]


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One cluster for the tests that kill nothing (they name their records their own way)."""
    with redis_cluster(tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


@pytest.fixture
def own(tmp_path):
    """A cluster of the test's own: it kills or stops a node."""
    with redis_cluster(tmp_path / "cluster") as cluster:
        yield cluster


# --- batches ---------------------------------------------------------------------------------------


def test_a_batch_over_every_master_round_trips_bit_exact_in_one_round_trip_per_node(shared):
    names = spread(shared, "spread", per_node=4)
    source, target = data(len(names), size=RECORD), np.zeros((len(names), RECORD), np.uint8)
    client = RedisClusterClient(shared.url, timeout=TIMEOUT)
    try:
        assert client.exists(names) == [False] * len(names)  # asks the slot map first
        assert client.topology_queries == 1
        for call, expected in (
            (lambda: client.put(names, pieces(source)), [True] * len(names)),
            (lambda: client.exists(names), [True] * len(names)),
            (lambda: client.get(names, pieces(target)), [True] * len(names)),
        ):
            before = client.round_trips
            assert call() == expected
            assert client.round_trips - before == 3  # one per master, whatever the batch
        assert np.array_equal(target, source)
        for i, name in enumerate(names):  # each record on the master serving its slot
            node = shared.nodes[shared.owner(key_slot(name.encode()))]
            assert node.client().get(name) == source[i].tobytes()
        before = client.round_trips
        client.remove(names)
        assert client.round_trips - before == 3 and client.exists(names) == [False] * len(names)
        assert client.topology_queries == 1
    finally:
        client.close()


def test_a_stack_over_the_cluster_stores_and_loads_bit_exact(shared):
    tokens, blocks = prompt(12), data(12)
    stored(config(shared), tokens, blocks)
    with KVTier.open(config(shared)) as kv:
        assert len(set(owners(kv, shared, tokens))) == 3  # the blocks are spread over every master
        assert kv.locate(tokens).tiers == ("remote",) * 12
        result, out = load(kv, tokens, 12)
        assert (result.loaded, result.failed) == (12, []) and np.array_equal(out, blocks)
        assert_clean(kv)


# --- slots that move --------------------------------------------------------------------------------


def test_after_a_slot_moved_moved_refreshes_the_map_and_the_record_is_read(shared):
    source, target = data(2, seed=1, size=RECORD), np.zeros((2, RECORD), np.uint8)
    names = ["{moving}/a", "{moving}/b"]  # one slot
    slot = key_slot(names[0].encode())
    client = RedisClusterClient(shared.url, timeout=TIMEOUT)
    try:
        assert client.put(names, pieces(source)) == [True, True]
        owner = shared.owner(slot)
        shared.migrate(slot, to=next(i for i in shared.masters() if i != owner))
        before, asked = client.round_trips, client.topology_queries
        assert client.get(names, pieces(target)) == [True, True] and np.array_equal(target, source)
        assert (client.round_trips - before, client.topology_queries - asked) == (2, 1)  # MOVED, then the owner
        before = client.round_trips
        assert client.exists(names) == [True, True] and client.round_trips - before == 1  # straight to it now
    finally:
        client.close()


def test_during_a_migration_ask_sends_asking_and_the_command_to_the_importing_node(shared):
    source, target = data(3, seed=2, size=RECORD), np.zeros((3, RECORD), np.uint8)
    names = ["{asking}/moved", "{asking}/stays", "{asking}/new"]
    slot = key_slot(names[0].encode())
    client = RedisClusterClient(shared.url, timeout=TIMEOUT)
    try:
        assert client.put(names[:2], pieces(source[:2])) == [True, True]
        to = next(i for i in shared.masters() if i != shared.owner(slot))
        owner = shared.begin_migration(slot, to)
        try:
            shared.move_keys(owner, to, names[:1])
            assert client.exists(names) == [True, True, False]  # the moved one after ASK
            assert client.put(names[2:], pieces(source[2:])) == [True]  # a new key goes where the slot goes
            assert shared.nodes[to].client().cluster("countkeysinslot", slot) == 2  # the moved and the new
            assert client.get(names, pieces(target)) == [True, True, True]
            assert np.array_equal(target, source)
            assert client.topology_queries == 1  # ASK is no reason to ask for the slot map
        finally:
            shared.move_keys(owner, to, names[1:2])
            shared.end_migration(slot, to)
        assert client.get(names, pieces(target)) == [True, True, True] and np.array_equal(target, source)
    finally:
        client.close()


# --- nodes that fail --------------------------------------------------------------------------------


@contextlib.contextmanager
def over_the_cluster(own: RedisCluster) -> Iterator[tuple[KVTier, list[int], np.ndarray, int, list[int]]]:
    """A stack over ``own`` that finds 12 blocks in the store: (the stack, their tokens, their bytes, the
    master serving block 3, the blocks that master serves)."""
    tokens, blocks = prompt(12), data(12)
    cfg = config(own, seeds=own.seeds)  # a new client finds the cluster whichever node is down
    stored(cfg, tokens, blocks)
    with KVTier.open(cfg) as kv:
        where = owners(kv, own, tokens)
        victim = where[3]
        assert kv.locate(tokens).tiers == ("remote",) * 12
        yield kv, tokens, blocks, victim, [i for i, node in enumerate(where) if node == victim]


def test_a_master_killed_mid_load_fails_exactly_its_blocks_within_the_timeout(own):
    with over_the_cluster(own) as (kv, tokens, blocks, victim, lost):
        own.stop(victim)  # the load's GETs reach a master that does not answer...
        started = time.monotonic()
        out = np.zeros((12, BLOCK), np.uint8)
        future = kv.load(tokens, out)
        time.sleep(0.2)
        own.kill(victim)  # ...which then dies under them
        result = future.result(30)
        assert (result.failed, result.loaded) == (lost, 12 - len(lost))
        assert time.monotonic() - started < TIMEOUT + 0.5
        assert kv.stats()["remote"]["read_errors"] == len(lost)
        kept = [i for i in range(12) if i not in lost]
        assert np.array_equal(out[kept], blocks[kept])
        started = time.monotonic()
        assert kv.lookup(tokens) == lost[0] and time.monotonic() - started < TIMEOUT  # the dead master: a miss
        assert_clean(kv)


def test_with_the_urls_node_dead_the_seeds_tell_the_slot_map_and_only_its_records_fail(own):
    own.kill(0)
    names = spread(own, "seeded", per_node=2)
    dead = [own.owner(key_slot(name.encode())) == 0 for name in names]
    client = RedisClusterClient(own.url, timeout=TIMEOUT, seeds=[own.nodes[1].url, own.nodes[2].url])
    try:
        assert client.put(names, pieces(data(len(names), size=RECORD))) == [not gone for gone in dead]
        assert client.exists(names) == [not gone for gone in dead]
    finally:
        client.close()


def test_a_call_for_the_dead_masters_records_only_is_a_miss_while_the_others_answered_lately(own):
    """A lookup or load whose every record lies on a dead master must not raise (the link would then
    refuse every node's records for its backoff): it is a miss for them while other masters answered
    lately (a cluster none of whose masters answers raises: the contract suite's hung store)."""
    names = spread(own, "dead", per_node=2)
    client = RedisClusterClient(own.url, timeout=TIMEOUT, seeds=own.seeds[1:])
    try:
        assert client.put(names, pieces(data(len(names), size=RECORD))) == [True] * len(names)  # every master answers
        victim = own.owner(key_slot(names[0].encode()))
        dead = [name for name in names if own.owner(key_slot(name.encode())) == victim]
        alive = [name for name in names if name not in dead]
        own.kill(victim)
        assert client.exists(dead) == [False] * len(dead)
        assert client.exists(alive) == [True] * len(alive)
    finally:
        client.close()


def test_after_a_failover_the_promoted_replica_serves_what_replicated_bit_exact(tmp_path):
    with redis_cluster(tmp_path / "cluster", replicas=1) as cluster:
        names = spread(cluster, "failover", per_node=4)
        source, target = data(len(names), seed=3, size=RECORD), np.zeros((len(names), RECORD), np.uint8)
        client = RedisClusterClient(cluster.url, timeout=TIMEOUT, seeds=cluster.seeds)
        try:
            assert client.put(names, pieces(source)) == [True] * len(names)
            for i in cluster.masters():  # every write has reached the master's replica
                assert cluster.nodes[i].client().execute_command("WAIT", 1, 5000) == 1
            victim = cluster.owner(key_slot(names[0].encode()))
            lost = [cluster.owner(key_slot(name.encode())) == victim for name in names]
            cluster.kill(victim)
            deadline, answers = time.monotonic() + 30, [False]
            while not all(answers) and time.monotonic() < deadline:
                target[:] = 0
                answers = client.get(names, pieces(target))
                assert all(answers[i] for i, gone in enumerate(lost) if not gone)  # the other masters serve on
                ok = np.array(answers)
                assert np.array_equal(target[ok], source[ok]), "a record came back wrong"
                time.sleep(0.1)
            assert all(answers), "the promoted replica never served the dead master's slots"
            assert victim not in cluster.masters()
        finally:
            client.close()
        cfg = config(cluster, seeds=cluster.seeds)  # a stack finds the new topology too, whichever node died
        tokens, blocks = prompt(6, start=4), data(6, seed=4)
        stored(cfg, tokens, blocks)
        with KVTier.open(cfg) as kv:
            result, out = load(kv, tokens, 6)
            assert result.loaded == 6 and np.array_equal(out, blocks)


def test_a_stopped_master_costs_lookups_and_loads_the_deadline_at_most_and_fails_only_its_blocks(own):
    with over_the_cluster(own) as (kv, tokens, blocks, victim, lost):
        own.stop(victim)
        try:
            started = time.monotonic()
            result, out = load(kv, tokens, 12)
            assert time.monotonic() - started < TIMEOUT
            assert (result.failed, result.loaded) == (lost, 12 - len(lost))
            kept = [i for i in range(12) if i not in lost]
            assert np.array_equal(out[kept], blocks[kept])
            with KVTier.open(kv.config) as other:  # a client of its own, which has not asked for the slot map yet
                started = time.monotonic()
                assert other.lookup(tokens) == lost[0] and time.monotonic() - started < TIMEOUT
        finally:
            own.cont(victim)
        assert_clean(kv)


def test_a_hostile_record_written_with_redis_cli_is_refused(shared):
    tokens, blocks = prompt(4, start=9), data(4, seed=9)
    stored(config(shared), tokens, blocks)
    with KVTier.open(config(shared)) as kv:
        name = kv.stack.tiers[-1].records[0].name(kv.keys(tokens)[1])
        forged = blocks[1].tobytes() + b"\x00" * 4096  # the right bytes, in no kvtier record
        port = shared.nodes[0].port
        done = subprocess.run(
            [CLI, "-c", "-p", str(port), "-x", "SET", name], input=forged, capture_output=True, timeout=30
        )
        assert done.returncode == 0 and done.stdout.strip() == b"OK", done.stderr
        result, out = load(kv, tokens, 4)
        assert result.failed == [1] and kv.stats()["remote"]["read_errors"] == 1
        assert np.array_equal(out[[0, 2, 3]], blocks[[0, 2, 3]])


def test_every_node_takes_the_password_from_the_environment_and_no_message_shows_it(tmp_path, monkeypatch, caplog):
    with redis_cluster(tmp_path / "cluster", password=PASSWORD) as cluster:
        cfg = config(cluster, password_env="KVTIER_TEST_CLUSTER_PASSWORD")
        monkeypatch.setenv("KVTIER_TEST_CLUSTER_PASSWORD", PASSWORD)
        tokens, blocks = prompt(9, start=5), data(9, seed=5)
        stored(cfg, tokens, blocks)
        with KVTier.open(cfg) as kv:
            assert len(set(owners(kv, cluster, tokens))) == 3
            result, out = load(kv, tokens, 9)
            assert result.loaded == 9 and np.array_equal(out, blocks)
        monkeypatch.setenv("KVTIER_TEST_CLUSTER_PASSWORD", "not-the-password")
        with KVTier.open(cfg) as kv:
            assert kv.lookup(tokens) == 0 and kv.stats()["remote"]["lookup_errors"] == 1  # refused: a miss
        assert "invalid username-password pair" in caplog.text  # the cause, named
        assert PASSWORD not in caplog.text and "not-the-password" not in caplog.text


# --- settings ---------------------------------------------------------------------------------------


def tier(**redis) -> dict:
    return {
        "block_bytes": BLOCK,
        "tiers": [
            {"medium": "host", "capacity_blocks": 4},
            {"medium": "remote", "backend": "redis", "redis": {"url": "redis://10.0.0.1:7000", **redis}},
        ],
    }


def test_wrong_cluster_settings_are_config_errors():
    assert error_of(tier(seeds=["redis://10.0.0.2:7000"])) == (
        "config: tiers[1].redis.seeds: seeds apply to a Redis Cluster only; set cluster: true or remove seeds"
    )
    message = error_of(tier(cluster=True, seeds=["redis://10.0.0.2:7000", "redis://:hunter2@10.0.0.3:7000"]))
    assert message.startswith("config: tiers[1].redis.seeds: the URL carries a password;") and "hunter2" not in message
    assert error_of(tier(cluster=True, seeds=["rediss://10.0.0.2:7000"])) == (
        "config: tiers[1].redis.seeds[0]: rediss://10.0.0.2:7000 is not a redis:// URL like url: every node of a "
        "cluster is reached the same way (TLS or not)"
    )
    assert error_of(tier(cluster=True, url="redis://10.0.0.1:7000/2")) == (
        "config: tiers[1].redis.url: redis://10.0.0.1:7000/2 names a database; a Redis Cluster has database 0 only"
    )
    assert error_of(tier(cluster=True, seeds=["http://10.0.0.2:7000"])) == (
        "config: tiers[1].redis.seeds: 'http://10.0.0.2:7000' is not a redis:// or rediss:// URL, e.g. "
        "redis://127.0.0.1:6379/0"
    )
