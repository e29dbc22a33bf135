"""A remote store below the node daemon's slab (one store client per machine), with real daemon processes
and a real store (a redis-server; a Mooncake master and segment owner, read through a fetch buffer): two
daemons on one store stand for two machines. Every block committed into a slab is copied down to the
store; an engine on the other machine finds it there (its daemon asks the store about blocks found
nowhere else) and a pin brings it up into that machine's slab, checked as any, read from the store once
however many engines want it at once. A store that hangs or is killed costs misses within ``below_wait``,
never an engine's call to its daemon (past the queries that may wait, a miss at once); a damaged record is a
miss, never bytes taken. A store whose reads land straight in their destination (Mooncake without a
fetch buffer) is refused at start."""

from __future__ import annotations

import contextlib
import re
import time

import numpy as np
import pytest

from helpers.mooncake_server import MooncakeMaster, SegmentOwner
from helpers.node_blocks import TOKENS, load_at_once, prompt, wait_for
from helpers.node_daemon import node_daemon, node_daemon_here
from helpers.redis_server import redis_server
from kvtier import KVTier
from kvtier.core.errors import ConfigError
from kvtier.node_config import load_node_config

BLOCK = 64 * 1024
BELOW_WAIT = 0.2
SETTINGS = {"below_wait": BELOW_WAIT, "max_held": 1.0}


def stack(daemon) -> dict:
    return {"block_tokens": TOKENS, "block_bytes": BLOCK, "tiers": [daemon.tier(timeout=1.0)]}


def redis_below(server) -> dict:
    return {"medium": "remote", "backend": "redis", "timeout": 2.0, "redis": {"url": server.url}}


@pytest.fixture(params=["redis", "mooncake"])
def store(request, tmp_path):
    """A real store (its server: ``stop()`` hangs it, ``cont()`` resumes it) and the daemons' entry for it:
    a redis-server, or a Mooncake master with a segment owner, read through a fetch buffer."""
    if request.param == "redis":
        with redis_server(tmp_path / "redis") as server:
            yield server, redis_below(server)
    else:
        with MooncakeMaster() as master, SegmentOwner(master, "64MB"):
            below = master.tier(2.0)
            below["mooncake"]["fetch_buffer"] = "16MiB"
            yield master, below


@contextlib.contextmanager
def two_machines(tmp_path, below: dict):
    """Two daemons (two machines' slabs of 16 slots) over one store."""
    with (
        node_daemon(tmp_path / "a", capacity="1MiB", block_bytes="64KiB", below=[below], **SETTINGS) as a,
        node_daemon(tmp_path / "b", capacity="1MiB", block_bytes="64KiB", below=[below], **SETTINGS) as b,
    ):
        yield a, b


@pytest.fixture
def machines(tmp_path, store):
    with two_machines(tmp_path, store[1]) as daemons:
        yield daemons


def publish(daemon, tokens: list[int], blocks: np.ndarray) -> None:
    """An engine on ``daemon``'s machine stores ``blocks``; their copies down reach the store."""
    with KVTier.open(stack(daemon)) as writer:
        assert writer.store_now(tokens, blocks).stored == len(blocks)
    wait_for(lambda: daemon.stats()["copied_down"] == len(blocks))


def test_an_engine_loads_from_the_store_what_another_machine_committed(machines, rng):
    a, b = machines
    tokens = prompt(6)
    blocks = rng.integers(0, 256, (6, BLOCK), dtype=np.uint8)
    publish(a, tokens, blocks)
    with KVTier.open(stack(b)) as reader:
        assert reader.lookup(tokens) == 6  # machine b's daemon asked the store
        out = np.zeros_like(blocks)
        result = reader.load_now(tokens, out)
        assert (result.loaded, result.failed) == (6, []) and np.array_equal(out, blocks)
        assert reader.stats()["node"]["lookup_errors"] == 0
    wait_for(lambda: b.stats()["held"] == 0)  # (the daemon sees the reader go in its own time)
    stats = b.stats()
    assert stats["promoted"] == 6
    assert stats["copied_down"] == 0  # (the store holds them already: nothing written back)


def test_engines_wanting_the_same_blocks_at_once_read_each_from_the_store_once(machines, rng):
    a, b = machines
    tokens = prompt(8)
    blocks = rng.integers(0, 256, (8, BLOCK), dtype=np.uint8)
    publish(a, tokens, blocks)
    readers = [KVTier.open(stack(b)) for _ in range(3)]
    results, outs = load_at_once(readers, tokens, blocks, before=lambda kv: wait_for(lambda: kv.lookup(tokens) == 8))
    assert [r.loaded for r in results] == [8, 8, 8] and all(np.array_equal(out, blocks) for out in outs)
    assert b.stats()["promoted"] == 8  # once each, whoever asked first


def test_a_hung_store_costs_misses_within_below_wait_never_an_engines_timeout(machines, store, rng):
    a, b = machines
    server, _ = store
    tokens = prompt(4)
    blocks = rng.integers(0, 256, (4, BLOCK), dtype=np.uint8)
    publish(a, tokens, blocks)
    with KVTier.open(stack(b)) as reader:
        server.stop()  # hung: the daemon's query waits for the store's timeout, its lookups do not
        try:
            start = time.monotonic()
            assert reader.lookup(tokens) == 0
            assert time.monotonic() - start < BELOW_WAIT + 0.5  # well within the engine's 1 s
            other = prompt(2, start=50_000)  # the slab still takes and serves blocks meanwhile
            fresh = rng.integers(0, 256, (2, BLOCK), dtype=np.uint8)
            assert reader.store_now(other, fresh).stored == 2
            out = np.zeros_like(fresh)
            assert reader.load_now(other, out).loaded == 2 and np.array_equal(out, fresh)
        finally:
            server.cont()
        wait_for(lambda: reader.lookup(tokens) == 4)  # the store answers again: found
        out = np.zeros_like(blocks)
        assert reader.load_now(tokens, out).loaded == 4 and np.array_equal(out, blocks)
        assert reader.stats()["node"]["lookup_errors"] == 0  # the engine's calls never timed out
    assert b.stats()["store_late"] >= 1


def test_a_killed_store_costs_misses_while_the_slab_serves_on(machines, store, rng):
    """The store's server killed (SIGKILL): the other machine's lookups miss within ``below_wait``, its
    engine's calls never fail, its slab still takes and serves blocks (their copies down fail, harmlessly),
    and both daemons live on, holding nothing for the engine that left."""
    a, b = machines
    server, _ = store
    tokens = prompt(4)
    blocks = rng.integers(0, 256, (4, BLOCK), dtype=np.uint8)
    publish(a, tokens, blocks)
    server.kill()
    with KVTier.open(stack(b)) as reader:
        start = time.monotonic()
        assert reader.lookup(tokens) == 0
        assert time.monotonic() - start < BELOW_WAIT + 0.5
        other = prompt(2, start=50_000)
        fresh = rng.integers(0, 256, (2, BLOCK), dtype=np.uint8)
        assert reader.store_now(other, fresh).stored == 2
        out = np.zeros_like(fresh)
        assert reader.load_now(other, out).loaded == 2 and np.array_equal(out, fresh)
        assert reader.lookup(tokens) == 0  # (asked again: still a miss, no stale "present")
        node = reader.stats()["node"]
        assert (node["lookup_errors"], node["read_errors"]) == (0, 0)
    for daemon in (a, b):
        assert daemon.process is not None and daemon.process.poll() is None
        wait_for(lambda d=daemon: d.stats()["held"] == 0)  # (the daemon sees the engines go in its own time)
    assert b.stats()["promoted"] == 0 and b.stats()["copied_down"] == 0


def test_while_the_store_hangs_lookups_past_the_waiting_room_miss_at_once(store, monkeypatch, rng):
    """One asking thread and no room to wait: while a hung store holds the one query, another engine's
    lookup of other blocks is a miss at once (counted late), not a wait of ``below_wait`` in line."""
    import kvtier.node_daemon as node_daemon_module

    server, below = store
    monkeypatch.setattr(node_daemon_module, "ASKING_THREADS", 1)
    monkeypatch.setattr(node_daemon_module, "QUERIES_WAITING", 0)
    with node_daemon_here("1MiB", "64KiB", [below], **SETTINGS) as daemon:
        engine = {
            "block_tokens": TOKENS,
            "block_bytes": BLOCK,
            "tiers": [{"medium": "node", "socket": daemon.settings.socket}],
        }
        with KVTier.open(engine) as first, KVTier.open(engine) as second:
            server.stop()
            try:
                started = time.monotonic()
                assert first.lookup(prompt(2)) == 0  # its query waits for the store: a miss after below_wait
                assert time.monotonic() - started >= BELOW_WAIT
                started = time.monotonic()
                assert second.lookup(prompt(2, start=9000)) == 0  # no thread, no room: a miss at once
                assert time.monotonic() - started < BELOW_WAIT / 2
            finally:
                server.cont()
        assert daemon.stats()["store_late"] == 2


def test_a_damaged_record_in_the_store_is_a_miss_never_loaded(tmp_path, rng):
    """A byte of every record flipped in the store (edited in place, which Redis allows: a disk fault, a
    hostile writer): the other machine's engine loads none of them."""
    import redis

    tokens = prompt(3)
    blocks = rng.integers(0, 256, (3, BLOCK), dtype=np.uint8)
    with redis_server(tmp_path / "redis") as server, two_machines(tmp_path, redis_below(server)) as (a, b):
        publish(a, tokens, blocks)
        client = redis.Redis.from_url(server.url)
        try:
            names = client.keys("*")
            assert len(names) == 3
            for name in names:
                record = bytearray(client.get(name))
                record[-100] ^= 0xFF
                client.set(name, bytes(record))
        finally:
            client.close()
        with KVTier.open(stack(b)) as reader:
            assert reader.lookup(tokens) == 3  # present, as far as the store says
            out = np.zeros_like(blocks)
            result = reader.load_now(tokens, out)
            assert result.loaded == 0 or result.failed == list(range(result.loaded))
            assert not out.any()  # nothing of the damaged records reached the engine
        assert b.stats()["promoted"] == 0


@pytest.mark.parametrize(
    ("below", "message"),
    [
        (
            {
                "medium": "remote",
                "backend": "mooncake",
                "mooncake": {"master": "127.0.0.1:1", "metadata_server": "http://127.0.0.1:2/metadata"},
            },
            "(backend 'mooncake') cannot be below the slab: a read past its deadline could write into a slot "
            "given to another block since; give Mooncake a fetch_buffer",
        ),
        ({"medium": "node", "socket": "/tmp/x.sock"}, "the daemon serves the node tier"),
    ],
)
def test_a_store_the_slab_cannot_be_above_is_refused_at_start(below, message):
    config = {
        "node": {"socket": "/tmp/kvtier-test.sock"},
        "block_bytes": "64KiB",
        "tiers": [{"medium": "host", "capacity": "1MiB"}, below],
    }
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_node_config(config)
