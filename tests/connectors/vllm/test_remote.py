"""The connector over a shared remote store, under vLLM's real Scheduler: what only a remote store does
(what every shared tier does, on Redis and on a node daemon alike: ``test_keyed.py``). Engines share
prefixes through a real redis-server (and once a real Mooncake Store), each with a host tier of its own.

A host hit never asks the store, and a lookup asks only for the blocks past the host hit; another model
finds nothing; the lookup says "ask again" while the store hangs, and a load the store fails is
recomputed by vLLM; a Redis reply that comes after the deadline writes nowhere (its records are fetched
into the client's own bytes), while host blocks a hung store call may still read stay out of use until
the worker lifts them; placed write-back, the store gets the host tier's victims.
"""

from __future__ import annotations

import json
import time

import pytest
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from helpers.mooncake_server import MooncakeMaster, SegmentOwner
from helpers.redis_server import redis_server
from helpers.vllm_harness import MODEL_JSON, Engine
from helpers.vllm_helpers import BLOCK, forget_gpu, prompt, step_until_scheduled
from helpers.vllm_keyed import WAIT, answer, assert_second_engine_hit, publish
from kvtier.core.keys import chain_hashes
from kvtier.tiers.remote.redis_client import RedisClient

TIMEOUT = 1.0


def redis_config(server) -> dict:
    return {
        "tiers": [
            {"medium": "host", "capacity_blocks": 32},
            {"medium": "remote", "backend": "redis", "timeout": TIMEOUT, "redis": {"url": server.url}},
        ]
    }


def mooncake_config(master: MooncakeMaster) -> dict:
    return {
        "tiers": [
            {"medium": "host", "capacity_blocks": 32},
            {
                "medium": "remote",
                "backend": "mooncake",
                "timeout": TIMEOUT,
                "mooncake": {"master": master.address, "metadata_server": master.metadata_url},
            },
        ]
    }


@pytest.fixture
def redis(tmp_path):
    with redis_server(tmp_path / "redis") as server:
        yield server


def second_engine(make_engine, config: dict):
    """A first engine publishes a 4-block prefix; a second one, with a request sharing it: (engine, request)."""
    publish(make_engine, config, prompt(4, 5, seed=1))
    reader = make_engine(config)
    return reader, reader.add(prompt(4, 9, seed=2), max_tokens=2)


def test_a_second_engine_loads_the_first_ones_prefix_from_mooncake(make_engine):
    with MooncakeMaster() as master, SegmentOwner(master, "64MB"):
        assert_second_engine_hit(make_engine, mooncake_config(master), "remote", staged=True)


def test_a_host_hit_never_asks_the_store(make_engine, redis):
    engine = make_engine(redis_config(redis), extra={"host_hits": "in_step"})
    engine.run([engine.add(prompt(4, 5, seed=1), max_tokens=2)])
    forget_gpu(engine)
    again = engine.add(prompt(4, 9, seed=2), max_tokens=2)
    redis.stop()  # a question to the store now would wait for its deadline and count a lookup error
    try:
        start = time.monotonic()
        assert engine.connector.get_num_new_matched_tokens(again, 0) == (4 * BLOCK, False)  # at once, in step
        assert time.monotonic() - start < TIMEOUT / 2
        assert engine.kvtier.requests.get(again.request_id).store_query is None
        out = step_until_scheduled(engine, again)
        assert out.num_scheduled_tokens[again.request_id] == 9 and engine.blocks_match(again, range(4))
    finally:
        redis.cont()
    engine.run([again])
    assert engine.kvtier.keyed.stats.lookup_errors == 0
    engine.assert_no_leaks()


def test_only_the_blocks_past_the_local_hit_are_asked_for(make_engine, redis):
    config = redis_config(redis)
    shared = prompt(6, 5, seed=1)
    publish(make_engine, config, shared)
    reader = make_engine(config)
    reader.run([reader.add(prompt(2, 3, seed=3), max_tokens=2)])  # the first 2 blocks now in its host tier
    forget_gpu(reader)
    before = sum(s.get("hit_blocks_remote", 0) for s in reader.stats)
    again = reader.add(prompt(6, 9, seed=2), max_tokens=2)
    assert answer(reader, again) == (6 * BLOCK, True)
    query = reader.kvtier.requests.get(again.request_id).store_query
    assert (query.first, query.end) == (2, 6)
    job = next(_loads(reader, again))
    # the 4 blocks past the host hit staged from the store, then all 6 from the host tier into vLLM's blocks
    assert [[(c.src.tier, c.dst.tier, len(c.blocks)) for c in stage] for stage in job.stages] == [
        [("remote", "host", 4)],
        [("host", None, 6)],
    ]
    assert reader.connector.get_external_cache_hit_sources(again, 6 * BLOCK) == {
        CacheHitSource.HOST: 2 * BLOCK,
        CacheHitSource.EXTERNAL_UNSPECIFIED: 4 * BLOCK,
    }
    out = step_until_scheduled(reader, again)
    assert out.num_scheduled_tokens[again.request_id] == 9 and reader.blocks_match(again, range(6))
    reader.run([again])
    assert sum(s.get("hit_blocks_remote", 0) for s in reader.stats) - before == 4
    reader.assert_no_leaks()


def _loads(engine, request):
    """Steps until the request's load is planned; yields it as the workers received it."""
    for _ in range(5):
        out, _ = engine.step()
        yield from (job for job in out.kv_connector_metadata.loads if job.req_id == request.request_id)


def test_another_model_finds_nothing(make_engine, redis, tmp_path):
    config = redis_config(redis)
    publish(make_engine, config, prompt(4, 5, seed=1))
    other_model = tmp_path / "another-model"
    other_model.mkdir()
    (other_model / "config.json").write_text(json.dumps(MODEL_JSON))  # same shapes, another model
    other = Engine(other_model, config)
    try:
        request = other.add(prompt(4, 9, seed=2), max_tokens=2)
        assert answer(other, request) == (0, False)
        other.run([request])
        other.assert_no_leaks()
    finally:
        other.shutdown()


def test_the_lookup_says_ask_again_until_the_store_answers(make_engine, redis):
    """vLLM's scheduler steps on meanwhile: the request waits, nothing blocks on the network."""
    reader, request = second_engine(make_engine, redis_config(redis))
    redis.stop()  # the query hangs until the server runs again
    try:
        for _ in range(3):
            start = time.monotonic()
            out, _ = reader.step()
            assert time.monotonic() - start < TIMEOUT / 2 and request.request_id not in out.num_scheduled_tokens
            assert reader.connector.get_num_new_matched_tokens(request, 0) == (None, False)
    finally:
        redis.cont()
    assert answer(reader, request) == (4 * BLOCK, True)
    out = step_until_scheduled(reader, request)
    assert out.num_scheduled_tokens[request.request_id] == 9 and reader.blocks_match(request, range(4))
    reader.run([request])
    assert reader.kvtier.keyed.stats.lookup_errors == 0
    reader.assert_no_leaks()


def test_store_killed_after_the_lookup_the_load_fails_and_vllm_recomputes(make_engine, redis):
    reader, again = second_engine(make_engine, redis_config(redis))
    assert answer(reader, again) == (4 * BLOCK, True)
    redis.kill()
    out = step_until_scheduled(reader, again)
    (block_ids,) = reader.scheduler.kv_cache_manager.get_block_ids(again.request_id)
    assert set(block_ids[:4]) <= reader.load_errors
    assert out.num_scheduled_tokens[again.request_id] == 4 * BLOCK + 9  # vLLM computes it all
    assert reader.blocks_match(again, range(4))
    reader.run([again])
    assert sum(s.get("failed_load_blocks", 0) for s in reader.stats) == 4
    assert reader.kvtier.tier("host").usage().used == 4  # its own blocks, computed and stored again
    reader.assert_no_leaks()
    # the store's blocks this engine found gone are announced removed, as the store's
    gone = [e for e in reader.events if type(e).__name__ == "BlockRemoved" and e.locality == "REMOTE"]
    keys = chain_hashes(prompt(4, 0, seed=2), BLOCK, reader.kvtier.request_namespace())
    assert [h for e in gone for h in e.block_hashes] == keys
    assert {(e.medium, e.ownership) for e in gone} == {("STORAGE", f"redis at {redis.url}")}


def test_a_hung_load_fails_at_its_deadline_and_its_late_reply_writes_nowhere(make_engine, redis):
    reader, again = second_engine(make_engine, redis_config(redis))
    assert answer(reader, again) == (4 * BLOCK, True)
    host = reader.kvtier.tier("host")
    redis.stop()  # the load's GET hangs past its deadline
    try:
        out = step_until_scheduled(reader, again)
        assert out.num_scheduled_tokens[again.request_id] == 4 * BLOCK + 9  # failed: vLLM computes it all
        assert reader.blocks_match(again, range(4))
        assert reader.kvtier.jobs.held() == []  # a fetch writes only in time: nothing to keep out of use
        assert host.leaks()["writing"] == 0
    finally:
        redis.cont()
    reader.run([again])  # (the GET's late reply is dropped with its call: tests/transfers/test_remote.py)
    reader.assert_no_leaks()


def test_host_blocks_a_hung_store_may_read_stay_out_of_use_until_the_worker_lifts_them(make_engine, redis, monkeypatch):
    # A store whose calls the deadline cannot interrupt (as Mooncake's): Redis's own are interrupted at the
    # deadline and return at once (tests/transfers/test_remote.py), which would lift the hold before it is seen.
    monkeypatch.setattr(RedisClient, "interruptible", False)
    writer = make_engine(redis_config(redis))
    request = writer.add(prompt(4, 5, seed=3), max_tokens=2)
    host = writer.kvtier.tier("host")
    redis.stop()  # the copy of its blocks to the store hangs past its deadline: the SET may still read them
    try:
        writer.run([request])
        deadline = time.monotonic() + WAIT
        while not writer.kvtier.jobs.held():  # the copy fails at its deadline, its sources held
            assert time.monotonic() < deadline, "the copy to the store never failed"
            writer.step()
            time.sleep(0.01)
        assert [job.kind for job in writer.kvtier.jobs.held()] == ["store"]
        assert host.leaks()["pinned"] == 4  # the 4 blocks the stuck SET may still read, kept in place
        for _ in range(5):  # steps while the server hangs lift nothing
            writer.step()
        assert host.leaks()["pinned"] == 4
    finally:
        redis.cont()
    deadline = time.monotonic() + WAIT
    while writer.kvtier.jobs.held():  # the SET returns, its client is closed: the next steps report the lift
        assert time.monotonic() < deadline, "the hold was never lifted"
        writer.step()
        time.sleep(0.01)
    writer.assert_no_leaks()


def test_placed_write_back_the_store_gets_the_host_tiers_victims(make_engine, redis):
    config = {
        "tiers": [
            {"medium": "host", "capacity_blocks": 4},
            {
                "medium": "remote",
                "backend": "redis",
                "timeout": TIMEOUT,
                "placement": "write_back",
                "redis": {"url": redis.url},
            },
        ]
    }
    writer = make_engine(config)
    first = prompt(4, 5, seed=1, prefix=1)
    for p in (1, 2):  # the second prefix pushes the first out of the 4-block host tier, into the store
        request = writer.add(prompt(4, 5, seed=p, prefix=p), max_tokens=2)
        answer(writer, request)
        writer.run([request])
    assert writer.kvtier.keyed.stats.committed == 4
    writer.assert_no_leaks()
    reader = make_engine(config)
    again = reader.add(first, max_tokens=2)
    assert answer(reader, again) == (4 * BLOCK, True)
    out = step_until_scheduled(reader, again)
    assert out.num_scheduled_tokens[again.request_id] == 5 and reader.blocks_match(again, range(4))
    reader.run([again])
    reader.assert_no_leaks()
