"""The connector over a tier by key shared between engines, under vLLM's real Scheduler, once over a real
redis-server (the remote tier) and once over a real node daemon (the node tier): what both must do alike.

A second engine finds the first one's blocks and loads them bit-exact; under tensor parallelism each
rank's shard is a block of its own and a block is a hit only when every rank's is there, while with
MLA one copy serves every rank; a hybrid model's groups are blocks of their own; blocks another engine
stored meanwhile are skipped and counted; a shared tier that hangs answers "miss" within the tier's
timeout. What only one of them does: ``test_remote.py`` and ``test_node.py``.
"""

from __future__ import annotations

import contextlib
import time

import pytest

from helpers.node_daemon import node_daemon
from helpers.redis_server import redis_server
from helpers.vllm_helpers import BLOCK, prompt, step_until_scheduled
from helpers.vllm_keyed import WAIT, answer, assert_second_engine_hit, publish
from kvtier.core.keys import chain_hashes
from kvtier.tiers.node.protocol import Op

TIMEOUT = 1.0


class SharedRedis:
    """A redis-server under the remote tier."""

    tier = "remote"
    staged = True  # (under vLLM a store's loads go through a host slot: ``tiers.remote.factory.remote_tier``)

    def __init__(self, server):
        self.server = server

    def config(self) -> dict:
        remote = {"medium": "remote", "backend": "redis", "timeout": TIMEOUT, "redis": {"url": self.server.url}}
        return {"tiers": [{"medium": "host", "capacity_blocks": 32}, remote]}

    @contextlib.contextmanager
    def hung(self):
        self.server.stop()
        try:
            yield
        finally:
            self.server.cont()

    def blocks(self) -> int:
        with self._client() as client:
            return client.dbsize()

    def drop(self, engine, tokens: list[int], rank: int, index: int) -> None:
        """Delete rank ``rank``'s record of block ``index`` of ``tokens``."""
        with self._client() as client:
            assert client.delete(engine.kvtier.keyed.records[rank].name(_keys(engine, tokens)[index])) == 1

    @contextlib.contextmanager
    def _client(self):
        import redis

        client = redis.Redis.from_url(self.server.url)
        try:
            yield client
        finally:
            client.close()


class SharedNode:
    """A node daemon under the node tier."""

    tier = "node"
    staged = False  # (the engine's own copies, from the slab into vLLM's blocks in host memory)

    def __init__(self, daemon):
        self.daemon = daemon

    def config(self) -> dict:
        return {"tiers": [{"medium": "host", "capacity_blocks": 32}, self.daemon.tier(timeout=TIMEOUT)]}

    @contextlib.contextmanager
    def hung(self):
        self.daemon.pause()
        try:
            yield
        finally:
            self.daemon.resume()

    def blocks(self) -> int:
        return self.daemon.stats()["used_slots"]

    def drop(self, engine, tokens: list[int], rank: int, index: int) -> None:
        """Drop rank ``rank``'s copy of block ``index`` of ``tokens``, as a load that found it damaged does."""
        tier = engine.kvtier.keyed
        (name,) = tier.storage.node_keys([_keys(engine, tokens)[index]], tier._rank_namespaces[rank][0])
        client = tier.storage.client
        (pinned,), epoch, _ = client.call(Op.PIN, [name], tier.block_bytes)
        client.post(Op.RELEASE, epoch, [name])
        client.post(Op.DROP, epoch, [[name, pinned[0][1]]])
        deadline = time.monotonic() + WAIT
        while True:  # (posted: the daemon takes it in its own time)
            (found,), _, _ = client.call(Op.LOOKUP, [name])
            if not found[0]:
                return
            assert time.monotonic() < deadline, "the daemon never dropped the block"
            time.sleep(0.01)


def _keys(engine, tokens: list[int]) -> list[bytes]:
    return chain_hashes(tokens[: len(tokens) // BLOCK * BLOCK], BLOCK, engine.kvtier.request_namespace())


@pytest.fixture(params=["redis", "node"])
def shared(request, tmp_path):
    if request.param == "redis":
        with redis_server(tmp_path / "redis") as server:
            yield SharedRedis(server)
    else:
        with node_daemon(tmp_path / "node", capacity="16MiB", block_bytes="512KiB", max_held=1.0) as daemon:
            yield SharedNode(daemon)


def test_a_second_engine_loads_the_first_ones_prefix(make_engine, shared):
    assert_second_engine_hit(make_engine, shared.config(), shared.tier, shared.staged)


def test_tp2_a_block_is_a_hit_only_when_every_ranks_copy_exists(make_engine, shared):
    config = shared.config()
    tokens = prompt(4, 5, seed=1)
    writer = publish(make_engine, config, tokens, tp=2)
    assert shared.blocks() == 4 * 2  # every rank's copy of every block
    shared.drop(writer, tokens, rank=1, index=2)
    reader = make_engine(config, tp=2)
    again = reader.add(prompt(4, 9, seed=2), max_tokens=2)
    assert answer(reader, again) == (2 * BLOCK, True)  # blocks 0 and 1 only: rank 1 lacks block 2
    out = step_until_scheduled(reader, again)
    assert out.num_scheduled_tokens[again.request_id] == 2 * BLOCK + 9
    assert reader.blocks_match(again, range(4)) and not reader.load_errors
    reader.run([again])
    reader.assert_no_leaks()


def test_a_hung_shared_tier_is_a_miss_within_the_timeout(make_engine, shared):
    config = shared.config()
    publish(make_engine, config, prompt(4, 5, seed=1))
    reader = make_engine(config)
    with shared.hung():
        request = reader.add(prompt(4, 9, seed=2), max_tokens=2)
        start = time.monotonic()
        assert answer(reader, request) == (0, False)
        assert time.monotonic() - start < TIMEOUT + 1.0
        assert reader.kvtier.keyed.stats.lookup_errors == 1
        out = step_until_scheduled(reader, request)
        assert out.num_scheduled_tokens[request.request_id] == 4 * BLOCK + 9  # computed from scratch
        assert reader.blocks_match(request, range(4)) and not reader.load_errors
    reader.run([request])
    reader.assert_no_leaks()


def test_mla_under_tp2_is_one_copy_per_block_written_once_and_loaded_by_every_rank(make_engine, shared):
    """MLA's latent KV is the same on every rank: the shared tier holds one copy per block, not one per
    rank (rank 0 writes it, the other rank's report vouches for it), and every rank loads it."""
    config = shared.config()
    publish(make_engine, config, prompt(4, 5, seed=1), tp=2, mla=True)
    assert shared.blocks() == 4
    reader = make_engine(config, tp=2, mla=True)
    again = reader.add(prompt(4, 9, seed=2), max_tokens=2)
    assert answer(reader, again) == (4 * BLOCK, True)
    out = step_until_scheduled(reader, again)
    assert out.num_scheduled_tokens[again.request_id] == 9
    assert reader.blocks_match(again, range(4)) and not reader.load_errors  # on both ranks
    reader.run([again])
    reader.assert_no_leaks()


def test_a_hybrid_models_groups_come_back_each_as_its_own_block(make_engine, shared):
    """Full-attention and sliding-window groups: every group's block is one of its own (its key tagged
    with the group); another engine loads the full group's 6 blocks and the window's last 2."""
    config = shared.config()
    publish(make_engine, config, prompt(6, 5, seed=1), window=2 * BLOCK + 1)
    reader = make_engine(config, window=2 * BLOCK + 1)
    again = reader.add(prompt(6, 9, seed=2), max_tokens=2)
    assert answer(reader, again) == (6 * BLOCK, True)
    out = step_until_scheduled(reader, again)
    assert out.num_scheduled_tokens[again.request_id] == 9
    assert reader.blocks_match(again, range(6)) and not reader.failed_loads
    reader.run([again])
    assert sum(s.get(f"hit_blocks_{shared.tier}", 0) for s in reader.stats) == 6 + 2
    reader.assert_no_leaks()


def test_blocks_another_engine_stored_meanwhile_are_skipped_and_counted(make_engine, shared):
    """Two engines compute the same prompt at once (the tier held none of it when each asked): the
    second to store finds the first one's blocks there, writes none of them again, and its workers
    count them (``skipped_existing``, one per rank's copy) in the stats vLLM collects."""
    config = shared.config()
    tokens = prompt(4, 5, seed=1)
    first, second = make_engine(config, tp=2), make_engine(config, tp=2)
    a, b = first.add(tokens, max_tokens=2), second.add(tokens, max_tokens=2)
    assert answer(first, a) == answer(second, b) == (0, False)
    first.run([a])
    second.run([b])
    for engine in (first, second):
        deadline = time.monotonic() + WAIT
        while engine.kvtier.keyed.stats.committed < 4:  # a skipped block counts as stored
            assert time.monotonic() < deadline
            engine.step()
        engine.assert_no_leaks()
    skipped = [sum(s.get("skipped_existing", 0) for s in engine.stats) for engine in (first, second)]
    assert skipped == [0, 4 * 2]
    assert shared.blocks() == 4 * 2
    reader = make_engine(config, tp=2)  # and the blocks are whole: a third engine loads them bit-exact
    again = reader.add(prompt(4, 9, seed=2), max_tokens=2)
    assert answer(reader, again) == (4 * BLOCK, True)
    step_until_scheduled(reader, again)
    assert reader.blocks_match(again, range(4)) and not reader.load_errors
