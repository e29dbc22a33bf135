"""What a stack over Redis does beyond the suite every store runs (tests/contracts/test_remote_stack.py),
against a real redis-server that the tests stop (SIGSTOP: a hung server), kill and resume.

What it shows: a server killed while a load waits on it fails exactly the blocks it was serving, at once,
and local hits go on; a hung server fails a load at the deadline, and the stuck read's reply, when it
comes, writes nowhere (Redis loads go straight into the caller's blocks: no host slot is staged or held);
a load waited for on the caller's thread (``load_now``) is back at the deadline too; a burst of stores
bigger than the host tier reaches the store whole (no block evicted before its copy
to the store was planned); a hung server answers lookups within the timeout and stores become counted
drops, the engine never waiting; the server's password comes from the environment.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from helpers.redis_server import redis_server
from kvtier import KVTier
from kvtier.core.errors import ConfigError
from kvtier.testing.common import assert_clean
from kvtier.tiers.remote.config import RemoteTierConfig
from kvtier.tiers.remote.factory import connector
from kvtier.tiers.remote.transfer import RemoteBackend

BLOCK = 64 * 1024
TIMEOUT = 1.0


def prompt(n: int, start: int = 0) -> list[int]:
    """Token ids of ``n`` full blocks (16 tokens each); ``start`` makes another prompt."""
    return list(range(start * 1000, start * 1000 + 16 * n))


def data(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, BLOCK), dtype=np.uint8)


@pytest.fixture
def config(server):
    """``config(host=16)``: a stack config dict, a host tier over the test's server."""

    def make(host: int = 16) -> dict:
        remote = {"medium": "remote", "backend": "redis", "timeout": TIMEOUT, "redis": {"url": server.url}}
        return {
            "block_bytes": BLOCK,
            "namespace": "model-a",
            "tiers": [{"medium": "host", "capacity_blocks": host}, remote],
        }

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


def host(kv: KVTier):
    return kv.stack.tiers[0]


def wait_until(condition, within: float) -> float:
    """Poll ``condition`` until it holds; the seconds it took (fails after ``within``)."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < within, "the condition did not come true in time"
        time.sleep(0.01)
    return time.monotonic() - started


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


def test_a_hung_server_fails_a_load_at_the_deadline_and_its_late_reply_writes_nowhere(config, server):
    tokens, blocks = prompt(8), data(8)
    stored(config(), tokens, blocks)
    with KVTier.open(config(host=16)) as kv:
        assert kv.lookup(tokens) == 8
        backend = next(b for b in kv.stack.transfers.backends if isinstance(b, RemoteBackend))
        server.stop()
        started = time.monotonic()
        out = np.full((8, BLOCK), 0xA5, np.uint8)  # the caller's blocks, which it reuses once the load failed
        result = kv.load(tokens, out).result(30)
        took = time.monotonic() - started
        assert result.failed == list(range(8)) and TIMEOUT - 0.05 < took < TIMEOUT + 0.5
        assert result.per_tier == {"remote": 8}  # straight into the caller's blocks: no host slot staged or held
        assert host(kv).leaks() == {"pinned": 0, "writing": 0}
        server.cont()  # the server answers the stuck GET...
        wait_until(lambda: not backend.link._unsettled, within=TIMEOUT)  # ...and the abandoned call returns
        assert (out == 0xA5).all()  # its reply landed nowhere: the caller's blocks are as it left them
        more = kv.store(prompt(16, start=1), data(16, seed=1)).result(30)
        assert (more.stored, more.dropped) == (16, 0)  # every host slot free
        assert_clean(kv)
        wait_until(lambda: kv.lookup(tokens) == 8, within=10 * TIMEOUT)  # once the link's backoff is over
        result, out = load(kv, tokens, 8)
        assert result.loaded == 8 and np.array_equal(out, blocks)


def test_a_load_waited_for_on_the_callers_thread_is_back_at_the_deadline_from_a_hung_server(config, server):
    tokens, blocks = prompt(8), data(8)
    stored(config(), tokens, blocks)
    with KVTier.open(config()) as kv:
        out = np.zeros((8, BLOCK), np.uint8)
        result = kv.load_now(tokens, out, 30)
        assert (result.hits, result.loaded) == (8, 8) and np.array_equal(out, blocks)
        server.stop()
        started = time.monotonic()
        result = kv.load_now(tokens, np.zeros((8, BLOCK), np.uint8), 30)  # its fetch runs here, and hangs...
        took = time.monotonic() - started
        assert result.failed == list(range(8)) and TIMEOUT - 0.05 < took < TIMEOUT + 0.5  # ...until interrupted
        server.cont()
        assert_clean(kv)
        wait_until(lambda: kv.lookup(tokens) == 8, within=10 * TIMEOUT)  # once the link's backoff is over
        out[:] = 0
        assert kv.load_now(tokens, out, 30).loaded == 8 and np.array_equal(out, blocks)


def test_a_burst_of_stores_larger_than_the_host_tier_reaches_the_store_whole(config, server):
    """A remote tier placed write-through takes no demotions: blocks reach it by copies planned once they
    are in host memory. Stores coming faster than those copies are planned must not evict blocks still
    waiting for theirs (they would reach no tier): every block a store reports stored ends up in the store."""
    prompts, blocks = [prompt(4, start=i) for i in range(12)], [data(4, seed=i) for i in range(12)]
    with KVTier.open(config(host=8)) as kv:
        futures = [kv.store(tokens, block) for tokens, block in zip(prompts, blocks, strict=True)]
        results = [future.result(30) for future in futures]
        assert_clean(kv)
        stored = [result.stored for result in results]
        assert sum(stored) > 8 and all(result.failed == [] for result in results)  # more than the host holds
        assert kv.stats()["remote"]["committed"] == sum(stored)
    with KVTier.open(config()) as reader:
        for tokens, block, result in zip(prompts, blocks, results, strict=True):
            got, out = load(reader, tokens, 4)
            assert result.dropped or got.loaded == 4 and np.array_equal(out, block)


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


def test_the_password_comes_from_the_environment(tmp_path, monkeypatch):
    with redis_server(tmp_path / "guarded", password="correct-horse-battery") as guarded:
        tier = RemoteTierConfig.model_validate(
            {
                "medium": "remote",
                "backend": "redis",
                "redis": {"url": guarded.url, "password_env": "KVTIER_TEST_REDIS_PASSWORD"},
            }
        )
        monkeypatch.delenv("KVTIER_TEST_REDIS_PASSWORD", raising=False)
        with pytest.raises(
            ConfigError, match="^password_env: the environment variable KVTIER_TEST_REDIS_PASSWORD is unset or empty"
        ):
            connector(tier)
        monkeypatch.setenv("KVTIER_TEST_REDIS_PASSWORD", "correct-horse-battery")
        wired = connector(tier)
        assert wired.clients == 4 and "correct-horse-battery" not in wired.where
        assert wired.connect().exists(["kvtier/none"]) == [False]
