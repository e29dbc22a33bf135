"""The remote tier in a whole stack (KVTier: host, host + disk, then a Redis store), against a real
redis-server that the fault tests really kill, stop and restart.

What it shows: blocks round-trip bit-exact between stacks and between processes through the store;
another namespace finds nothing; a record damaged, truncated, foreign, or (with auth on) unsigned or
signed with another secret is a miss and the block is recomputed and stored again; a server killed
while a load waits fails exactly the blocks it was serving, at once, and local hits go on; a hung
server answers lookups and loads at the deadline, its stores become counted drops, the engine never
waits, and host slots a stuck read may still write stay out of use until it returned; after a
restart the store is empty and then fills again; the store's own eviction never yields wrong bytes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from helpers.redis_server import redis_server
from helpers.stack_helpers import assert_clean
from kvtier import KVTier
from kvtier.core.config import RemoteTierConfig
from kvtier.core.errors import ConfigError
from kvtier.tiers.remote.factory import connector

BLOCK = 64 * 1024
TIMEOUT = 1.0


def prompt(n: int, start: int = 0) -> list[int]:
    """Token ids of ``n`` full blocks (16 tokens each); ``start`` makes another prompt."""
    return list(range(start * 1000, start * 1000 + 16 * n))


def data(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, BLOCK), dtype=np.uint8)


@pytest.fixture
def config(server, tmp_path):
    """``config(**options)``: a stack config dict over the test's server."""

    def make(host: int = 16, disk: str | None = None, namespace: str = "model-a", auth_env: str | None = None,
             timeout: float = TIMEOUT, placement: str = "write_through") -> dict:
        tiers: list[dict] = [{"medium": "host", "capacity_blocks": host}]
        if disk is not None:
            tiers.append({"medium": "disk", "path": str(tmp_path / disk), "capacity_blocks": 32})
        remote = {"medium": "remote", "backend": "redis", "timeout": timeout, "placement": placement,
                  "redis": {"url": server.url}}
        if auth_env is not None:
            remote["auth_key_env"] = auth_env
        return {"block_bytes": BLOCK, "namespace": namespace, "tiers": [*tiers, remote]}

    return make


def stored(config: dict, tokens: list[int], blocks: np.ndarray) -> dict:
    """Store ``blocks`` through a stack of its own and wait until they reached the store; its stats."""
    with KVTier.open(config) as kv:
        result = kv.store(tokens, blocks).result(30)
        assert result.stored == len(blocks)
        kv.wait_idle()
        return kv.stats()


def load(kv: KVTier, tokens: list[int], n: int):
    out = np.zeros((n, BLOCK), np.uint8)
    return kv.load(tokens, out).result(30), out


def exists_calls(server) -> int:
    return server.client().info("commandstats").get("cmdstat_exists", {}).get("calls", 0)


def remote(kv: KVTier):
    return kv.stack.tiers[-1]


def host(kv: KVTier):
    return kv.stack.tiers[0]


def wait_until(condition, within: float) -> float:
    """Poll ``condition`` until it holds; the seconds it took (fails after ``within``)."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < within, "the condition did not come true in time"
        time.sleep(0.01)
    return time.monotonic() - started


# --- sharing -------------------------------------------------------------------------------------


@pytest.mark.parametrize("disk", [None, "disk"])
def test_blocks_round_trip_between_stacks_through_the_store(config, server, disk):
    tokens, blocks = prompt(8), data(8)
    stats = stored(config(disk=None if disk is None else "writer-disk"), tokens, blocks)
    assert stats["remote"]["committed"] == 8 and server.client().dbsize() == 8
    with KVTier.open(config(disk=None if disk is None else "reader-disk")) as kv:
        assert kv.locate(tokens).tiers == ("remote",) * 8
        result, out = load(kv, tokens, 8)
        assert (result.loaded, result.failed, result.per_tier) == (8, [], {"remote": 8})
        assert np.array_equal(out, blocks)
        asked = exists_calls(server)
        assert kv.locate(tokens).tiers == ("host",) * 8  # staged through host memory, kept there
        assert exists_calls(server) == asked  # a local hit never asks the store
        assert kv.stats()["remote"]["hits"] == 8
        assert_clean(kv)


def test_placed_write_back_the_store_gets_the_host_tiers_victims_only(config, server):
    first, second = prompt(4), prompt(4, start=1)
    blocks = data(4)
    with KVTier.open(config(host=4, placement="write_back")) as kv:
        kv.store(first, blocks).result(30)
        kv.wait_idle()
        assert server.client().dbsize() == 0  # nothing is copied while the host tier keeps it
        kv.store(second, data(4, seed=1)).result(30)  # pushes the first prompt out of host memory
        kv.wait_idle()
        assert kv.stats()["host"]["demoted"] == 4 and kv.stats()["remote"]["committed"] == 4
    with KVTier.open(config()) as fresh:
        assert fresh.lookup(second) == 0
        result, out = load(fresh, first, 4)
        assert result.loaded == 4 and np.array_equal(out, blocks)


CHILD = """
import json, sys
import numpy as np
from kvtier import KVTier
config, n = json.loads(sys.argv[1]), int(sys.argv[2])
blocks = np.random.default_rng(5).integers(0, 256, (n, 65536), dtype=np.uint8)
with KVTier.open(config) as kv:
    result = kv.store(list(range(16 * n)), blocks).result(30)
    kv.wait_idle()
    print(json.dumps({"stored": result.stored, "in_store": kv.stats()["remote"]["committed"]}))
"""


def test_two_processes_with_the_same_config_share_blocks(config):
    cfg = config()
    child = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg), "6"], capture_output=True, text=True,
                           timeout=120)
    assert child.returncode == 0, child.stderr
    assert json.loads(child.stdout) == {"stored": 6, "in_store": 6}
    with KVTier.open(cfg) as kv:
        result, out = load(kv, prompt(6), 6)
        assert result.loaded == 6 and np.array_equal(out, np.random.default_rng(5).integers(0, 256, (6, BLOCK),
                                                                                            dtype=np.uint8))


def test_another_namespace_finds_nothing_not_even_under_a_copied_name(config, server):
    tokens, blocks = prompt(4), data(4)
    stored(config(namespace="model-a"), tokens, blocks)
    with KVTier.open(config(namespace="model-a")) as a, KVTier.open(config(namespace="model-b")) as b:
        keys = a.keys(tokens)
        assert b.lookup(tokens) == 0 and b.lookup(keys) == 0  # its names differ, even for the same keys
        raw = server.client()
        ours, theirs = remote(a).records[0], remote(b).records[0]
        raw.set(theirs.name(keys[0]), raw.get(ours.name(keys[0])))  # model-a's record under model-b's name
        assert b.lookup(keys) == 1
        result, _ = load(b, keys, 4)
        assert (result.hits, result.failed) == (1, [0])  # its header names another namespace: a miss
        assert b.stats()["remote"]["read_errors"] == 1
        mine = data(4, seed=9)  # model-b's own bytes for these keys, computed again and stored over it
        assert b.store(keys, mine).result(30).stored == 4
        b.wait_idle()
    with KVTier.open(config(namespace="model-b")) as b, KVTier.open(config(namespace="model-a")) as a:
        for kv, expected in ((b, mine), (a, blocks)):
            result, out = load(kv, keys, 4)
            assert result.loaded == 4 and np.array_equal(out, expected)


# --- damaged and forged records ------------------------------------------------------------------


def test_a_damaged_or_truncated_record_is_a_miss_and_the_block_is_recomputed(config, server):
    tokens, blocks = prompt(4), data(4)
    stored(config(), tokens, blocks)
    with KVTier.open(config()) as kv:
        keys = kv.keys(tokens)
        names = [remote(kv).records[0].name(key) for key in keys]
        raw = server.client()
        raw.set(names[1], b"\xff" * (len(raw.get(names[1]))))  # garbage of the right size
        raw.set(names[2], raw.get(names[2])[:-1])  # truncated
        result, out = load(kv, tokens, 4)
        assert result.failed == [1, 2] and np.array_equal(out[0], blocks[0])
        assert kv.lookup(tokens) == 1  # failed loads are forgotten: a miss from block 1 on
        recomputed = kv.store(tokens, blocks).result(30)  # what the engine does: compute again, store
        assert recomputed.stored == 2  # blocks 1 and 2; 0 and 3 are in host memory already
        kv.wait_idle()
    with KVTier.open(config()) as fresh:
        result, out = load(fresh, tokens, 4)
        assert result.loaded == 4 and np.array_equal(out, blocks)


def test_with_auth_on_records_without_the_secret_or_with_another_are_misses(config, monkeypatch):
    monkeypatch.setenv("KVTIER_TEST_MAC", "first-secret-0123456789")
    monkeypatch.setenv("KVTIER_TEST_OTHER_MAC", "second-secret-0123456789")
    tokens, blocks = prompt(3), data(3)
    stored(config(), tokens, blocks)  # written without a MAC
    with KVTier.open(config(auth_env="KVTIER_TEST_MAC")) as signed:
        result, _ = load(signed, tokens, 3)
        assert (result.hits, result.loaded) == (3, 0)  # found, refused
        assert signed.store(tokens, blocks).result(30).stored == 3  # recomputed, stored signed
        signed.wait_idle()
    with KVTier.open(config(auth_env="KVTIER_TEST_OTHER_MAC")) as other:
        result, _ = load(other, tokens, 3)
        assert (result.hits, result.loaded) == (3, 0)
    with KVTier.open(config(auth_env="KVTIER_TEST_MAC")) as same:
        result, out = load(same, tokens, 3)
        assert result.loaded == 3 and np.array_equal(out, blocks)


# --- a store that fails --------------------------------------------------------------------------


def test_a_server_killed_during_a_load_fails_exactly_its_blocks_and_local_hits_go_on(config, server):
    tokens, blocks = prompt(8), data(8)
    stored(config(), tokens, blocks)
    with KVTier.open(config()) as kv:
        assert kv.store(tokens[:32], blocks[:2]).result(30).stored == 2  # blocks 0 and 1 in host memory
        assert kv.locate(tokens).tiers == ("host",) * 2 + ("remote",) * 6
        server.stop()  # the load's GETs reach a server that does not answer...
        started = time.monotonic()
        out = np.zeros((8, BLOCK), np.uint8)
        future = kv.load(tokens, out)
        time.sleep(0.2)
        server.kill()  # ...which then dies under them
        result = future.result(30)
        took = time.monotonic() - started
        assert (result.loaded, result.failed) == (2, [2, 3, 4, 5, 6, 7]) and took < TIMEOUT
        assert np.array_equal(out[:2], blocks[:2])
        started = time.monotonic()
        assert kv.lookup(tokens) == 2 and time.monotonic() - started < TIMEOUT  # a dead store: a miss
        result, out = load(kv, tokens, 8)
        assert (result.hits, result.loaded) == (2, 2) and np.array_equal(out[:2], blocks[:2])
        assert_clean(kv)


def test_a_hung_server_fails_a_load_at_the_deadline_and_its_slots_stay_out_of_use_until_it_returns(config, server):
    tokens, blocks = prompt(8), data(8)
    stored(config(), tokens, blocks)
    with KVTier.open(config(host=16)) as kv:
        assert kv.lookup(tokens) == 8
        server.stop()
        started = time.monotonic()
        result, _ = load(kv, tokens, 8)
        took = time.monotonic() - started
        assert result.failed == list(range(8)) and TIMEOUT - 0.05 < took < TIMEOUT + 0.5
        # the 8 staging slots a stuck GET may still write into: taken, holding no block
        assert host(kv).leaks() == {"pinned": 0, "writing": 8} and host(kv).lookup(kv.keys(tokens)) == 0
        more = kv.store(prompt(16, start=1), data(16, seed=1)).result(30)
        assert (more.stored, more.dropped) == (8, 8)  # only the 8 free slots: the quarantined ones are not reused
        resumed = time.monotonic()
        server.cont()  # the server answers the stuck GET: the call returns and its slots come free
        wait_until(lambda: host(kv).leaks()["writing"] == 0, within=TIMEOUT)
        assert time.monotonic() - resumed < TIMEOUT and time.monotonic() - started < 2.5 * TIMEOUT
        assert_clean(kv)
        assert host(kv).usage().used == 8
        wait_until(lambda: kv.lookup(tokens) == 8, within=10 * TIMEOUT)  # once the link's backoff is over
        result, out = load(kv, tokens, 8)
        assert result.loaded == 8 and np.array_equal(out, blocks)  # the late bytes landed in no block


def test_a_hung_server_answers_lookups_within_the_timeout_and_stores_become_counted_drops(config, server):
    with KVTier.open(config()) as kv:
        local, fresh = prompt(2), prompt(4, start=2)
        kv.store(local, data(2)).result(30)
        kv.wait_idle()
        server.stop()
        started = time.monotonic()
        assert kv.lookup(local + fresh[32:]) == 2  # local hits; the rest a miss at the deadline
        assert time.monotonic() - started < TIMEOUT + 0.5
        started = time.monotonic()
        result = kv.store(fresh, data(4, seed=3)).result(30)
        assert result.stored == 4 and time.monotonic() - started < 0.5  # the engine never waits on the store
        wait_until(lambda: kv.stats()["remote"]["aborted"] == 4, within=2 * TIMEOUT)
        assert kv.stats()["remote"]["committed"] == 2
        server.cont()
        assert_clean(kv)


def test_after_a_restart_the_store_is_empty_and_new_stores_land_and_hit(config, server):
    before = prompt(4)
    stored(config(), before, data(4))
    with KVTier.open(config()) as kv:
        assert kv.lookup(before) == 4  # the store's answer counts for a few seconds...
        server.restart()
        result, _ = load(kv, before, 4)
        assert (result.hits, result.loaded) == (4, 0)  # ...so the load finds the store empty: all failed
        assert kv.lookup(before) == 0
        after, blocks = prompt(4, start=5), data(4, seed=5)
        assert kv.store(after, blocks).result(30).stored == 4
        kv.wait_idle()
        assert kv.stats()["remote"]["committed"] == 4  # the connections that broke were made again
    with KVTier.open(config()) as fresh:
        assert fresh.lookup(before) == 0
        result, out = load(fresh, after, 4)
        assert result.loaded == 4 and np.array_equal(out, blocks)


def test_the_stores_own_eviction_never_yields_wrong_bytes(tmp_path, config):
    with redis_server(tmp_path / "small", maxmemory="3mb") as small:
        cfg = config(host=8)
        cfg["tiers"][-1]["redis"]["url"] = small.url
        tokens, blocks = prompt(96), data(96)
        with KVTier.open(cfg) as kv:
            keys = kv.keys(tokens)
            for at in range(0, 96, 8):  # through a host tier of 8 blocks, each batch on to the store first
                assert kv.store(keys[at:at + 8], blocks[at:at + 8]).result(30).stored == 8
                kv.wait_idle()
            assert kv.stats()["remote"]["committed"] == 96
        assert small.client().info("stats")["evicted_keys"] > 0
        with KVTier.open(cfg) as reader:
            loaded = 0
            for i, key in enumerate(keys):  # block by block: eviction leaves holes in every prefix
                result, out = load(reader, [key], 1)
                if result.loaded:
                    loaded += 1
                    assert np.array_equal(out[0], blocks[i]), f"block {i} came back wrong"
            assert 0 < loaded < 96


def test_the_password_comes_from_the_environment(tmp_path, monkeypatch):
    with redis_server(tmp_path / "guarded", password="correct-horse-battery") as guarded:
        tier = RemoteTierConfig.model_validate({"medium": "remote", "backend": "redis", "redis": {
            "url": guarded.url, "password_env": "KVTIER_TEST_REDIS_PASSWORD"}})
        monkeypatch.delenv("KVTIER_TEST_REDIS_PASSWORD", raising=False)
        with pytest.raises(ConfigError, match="^password_env: the environment variable KVTIER_TEST_REDIS_PASSWORD "
                                              "is unset or empty"):
            connector(tier)
        monkeypatch.setenv("KVTIER_TEST_REDIS_PASSWORD", "correct-horse-battery")
        wired = connector(tier)
        assert wired.clients == 4 and "correct-horse-battery" not in wired.where
        assert wired.connect().exists(["kvtier/none"]) == [False]


def test_a_missing_mac_secret_opens_nothing(config, monkeypatch):
    monkeypatch.delenv("KVTIER_TEST_MAC", raising=False)
    with pytest.raises(ConfigError, match="^auth_key_env: the environment variable KVTIER_TEST_MAC is unset"):
        KVTier.open(config(auth_env="KVTIER_TEST_MAC"))
    assert threading.active_count() < 50
