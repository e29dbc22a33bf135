"""The connector over the machine's node daemon, under vLLM's real Scheduler: engines share prefixes through
a real daemon process (``tests/helpers/node_daemon.py``), each with a host tier of its own above the node
tier.

A second engine finds the first one's blocks at the daemon: its lookup answers "ask again" while the one
batched LOOKUP is in flight and the hit once it is in; the load stages the blocks through its host tier
into vLLM's blocks bit-exact (each checked against its slot header). Under tensor parallelism each
rank's shard is a block of its own at the daemon and a block is a hit only when every rank's is there;
with MLA one copy serves every rank. A daemon that is stopped answers "miss" within the tier's timeout.
"""

from __future__ import annotations

import time

import pytest
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from helpers.node_daemon import node_daemon
from helpers.vllm_helpers import BLOCK, prompt, step_until_scheduled
from kvtier.core.keys import chain_hashes
from kvtier.tiers.node.protocol import Op

TIMEOUT = 1.0
WAIT = 10.0


@pytest.fixture
def daemon(tmp_path):
    with node_daemon(tmp_path / "node", capacity="16MiB", block_bytes="512KiB", max_held=1.0) as running:
        yield running


def node_config(daemon) -> dict:
    return {"tiers": [{"medium": "host", "capacity_blocks": 32}, daemon.tier(timeout=TIMEOUT)]}


def answer(engine, request, computed: int = 0) -> tuple[int | None, bool]:
    """The lookup once the daemon has answered (None, "ask again", while the query is in flight)."""
    lookup = engine.connector.get_num_new_matched_tokens
    deadline = time.monotonic() + WAIT
    while (found := lookup(request, computed))[0] is None:
        assert time.monotonic() < deadline, "the daemon's answer never came"
        time.sleep(0.01)
    return found


def publish(make_engine, config: dict, tokens: list[int], **kwargs):
    """A first engine computes ``tokens``; its blocks reach the daemon (host tier, then a copy on)."""
    writer = make_engine(config, **kwargs)
    request = writer.add(tokens, max_tokens=2)
    assert answer(writer, request) == (0, False)
    writer.run([request])
    stored = len(tokens) // BLOCK * len(writer.kvtier.groups)
    deadline = time.monotonic() + WAIT
    while writer.kvtier.keyed.stats.committed < stored:  # (the copy on to the daemon is a job of its own)
        assert time.monotonic() < deadline
        writer.step()
    writer.assert_no_leaks()
    return writer


def test_a_second_engine_loads_the_first_ones_prefix_from_the_node_daemon(make_engine, daemon):
    config = node_config(daemon)
    publish(make_engine, config, prompt(4, 5, seed=1))
    reader = make_engine(config)
    again = reader.add(prompt(4, 9, seed=2), max_tokens=2)
    assert answer(reader, again) == (4 * BLOCK, True)
    assert reader.connector.get_external_cache_hit_sources(again, 4 * BLOCK) == {
        CacheHitSource.EXTERNAL_UNSPECIFIED: 4 * BLOCK
    }
    out = step_until_scheduled(reader, again)
    assert out.num_scheduled_tokens[again.request_id] == 9  # the tail only: 4 blocks came from the daemon
    assert reader.blocks_match(again, range(4)) and not reader.load_errors
    reader.run([again])
    totals = {k: sum(s.get(k, 0) for s in reader.stats) for k in ("hit_blocks_node", "hit_blocks_host")}
    assert totals == {"hit_blocks_node": 4, "hit_blocks_host": 0}
    assert reader.kvtier.tier("host").usage().used >= 4  # staged through the host tier, where they stay
    reader.assert_no_leaks()
    assert daemon.stats()["held"] == 0


def node_names(engine, tokens: list[int], rank: int | None) -> list[bytes]:
    """The node keys rank ``rank``'s copies of ``tokens``' blocks are stored under."""
    keys = chain_hashes(tokens[: len(tokens) // BLOCK * BLOCK], BLOCK, engine.kvtier.request_namespace())
    tier = engine.kvtier.keyed
    return tier.storage.node_keys(keys, tier._rank_namespaces[0 if rank is None else rank])


def test_tp2_a_block_is_a_hit_only_when_every_ranks_copy_exists(make_engine, daemon):
    config = node_config(daemon)
    shared = prompt(4, 5, seed=1)
    writer = publish(make_engine, config, shared, tp=2)
    client = writer.kvtier.keyed.storage.client
    (found,), _, _ = client.call(Op.LOOKUP, node_names(writer, shared, 0) + node_names(writer, shared, 1))
    assert all(found)  # every rank's copy of every block
    names = node_names(writer, shared, 1)
    (pinned,), epoch, _ = client.call(
        Op.PIN, [names[2]], writer.kvtier.keyed.block_bytes
    )  # rank 1's shard of block 2 ...
    client.post(Op.RELEASE, epoch, [names[2]])
    client.post(Op.DROP, epoch, [[names[2], pinned[0][1]]])  # ... dropped, as a load that found it damaged does
    time.sleep(0.2)
    reader = make_engine(config, tp=2)
    again = reader.add(prompt(4, 9, seed=2), max_tokens=2)
    assert answer(reader, again) == (2 * BLOCK, True)  # blocks 0 and 1 only: rank 1 lacks block 2
    out = step_until_scheduled(reader, again)
    assert out.num_scheduled_tokens[again.request_id] == 2 * BLOCK + 9
    assert reader.blocks_match(again, range(4)) and not reader.load_errors
    reader.run([again])
    reader.assert_no_leaks()


def test_a_stopped_daemon_is_a_miss_within_the_timeout(make_engine, daemon):
    config = node_config(daemon)
    publish(make_engine, config, prompt(4, 5, seed=1))
    reader = make_engine(config)
    daemon.pause()
    try:
        request = reader.add(prompt(4, 9, seed=2), max_tokens=2)
        start = time.monotonic()
        assert answer(reader, request) == (0, False)
        assert time.monotonic() - start < TIMEOUT + 1.0
        assert reader.kvtier.keyed.stats.lookup_errors == 1
        out = step_until_scheduled(reader, request)
        assert out.num_scheduled_tokens[request.request_id] == 4 * BLOCK + 9  # computed from scratch
        assert reader.blocks_match(request, range(4)) and not reader.load_errors
    finally:
        daemon.resume()
    reader.run([request])
    reader.assert_no_leaks()


def test_mla_under_tp2_is_one_block_at_the_daemon_written_once_and_loaded_by_every_rank(make_engine, daemon):
    """MLA's latent KV is the same on every rank: the daemon holds one copy per block (rank 0 writes it)."""
    config = node_config(daemon)
    shared = prompt(4, 5, seed=1)
    writer = publish(make_engine, config, shared, tp=2, mla=True)
    assert daemon.stats()["stores"] == 4 and len(writer.kvtier.keyed._rank_namespaces) == 1
    reader = make_engine(config, tp=2, mla=True)
    again = reader.add(prompt(4, 9, seed=2), max_tokens=2)
    assert answer(reader, again) == (4 * BLOCK, True)
    out = step_until_scheduled(reader, again)
    assert out.num_scheduled_tokens[again.request_id] == 9
    assert reader.blocks_match(again, range(4)) and not reader.load_errors  # on both ranks
    reader.run([again])
    reader.assert_no_leaks()


def test_a_hybrid_models_groups_come_from_the_daemon_each_as_its_own_block(make_engine, daemon):
    config = node_config(daemon)
    publish(make_engine, config, prompt(6, 5, seed=1), window=2 * BLOCK + 1)
    reader = make_engine(config, window=2 * BLOCK + 1)
    again = reader.add(prompt(6, 9, seed=2), max_tokens=2)
    assert answer(reader, again) == (6 * BLOCK, True)
    out = step_until_scheduled(reader, again)
    assert out.num_scheduled_tokens[again.request_id] == 9
    assert reader.blocks_match(again, range(6)) and not reader.failed_loads
    reader.run([again])
    assert sum(s.get("hit_blocks_node", 0) for s in reader.stats) == 6 + 2
    reader.assert_no_leaks()


def test_blocks_another_engine_stored_meanwhile_are_skipped_and_counted(make_engine, daemon):
    config = node_config(daemon)
    shared = prompt(4, 5, seed=1)
    first, second = make_engine(config, tp=2), make_engine(config, tp=2)
    a, b = first.add(shared, max_tokens=2), second.add(shared, max_tokens=2)
    assert answer(first, a) == answer(second, b) == (0, False)
    first.run([a])
    second.run([b])
    for engine in (first, second):
        deadline = time.monotonic() + WAIT
        while engine.kvtier.keyed.stats.committed < 4:
            assert time.monotonic() < deadline
            engine.step()
        engine.assert_no_leaks()
    skipped = [sum(s.get("skipped_existing", 0) for s in engine.stats) for engine in (first, second)]
    assert skipped == [0, 4 * 2]  # one per rank's copy
    assert daemon.stats()["stores"] == 4 * 2
