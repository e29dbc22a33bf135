"""The connector under vLLM's real scheduler: a later request sharing a prefix gets it from kvtier's
host tier, then from the disk tier once the host tier is full, with exact token counts and bit-exact
KV; preemption, aborts mid-load and mid-store, and a cache reset leave no pins, slots or jobs behind."""

from __future__ import annotations

import os

import pytest
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from helpers.vllm_helpers import (
    BLOCK,
    assert_loads_back,
    assert_recomputed_from,
    forget_gpu,
    held_by,
    prompt,
    scheduled_load,
    step_until_scheduled,
)
from kvtier.core.keys import chain_hashes

HOST_ONLY = {"tiers": [{"medium": "host", "capacity_blocks": 32}]}
IN_STEP = {"host_hits": "in_step"}  # host hits loaded in the step that computes the prompt's rest (async by default)


@pytest.mark.parametrize("host_hits", ["in_step", "async"])
def test_prefix_hit_from_host_is_exact_and_bit_exact(make_engine, host_hits):
    """In step (the default): vLLM computes the tail in the step that loads the prefix. Async: the
    request waits for a later step to report its load."""
    engine = make_engine(HOST_ONLY, extra={"host_hits": host_hits})
    first = engine.add(prompt(4, 5, seed=1), max_tokens=3)
    engine.run([first])
    assert engine.kvtier.tier("host").usage().used == 4  # 4 full prompt blocks; the 5-token tail has no key
    forget_gpu(engine)

    second = engine.add(prompt(4, 9, seed=2), max_tokens=2)
    n, is_async = engine.connector.get_num_new_matched_tokens(second, 0)
    assert (n, is_async) == (4 * BLOCK, host_hits == "async")
    out, _ = engine.step()
    (job,) = out.kv_connector_metadata.loads
    assert job.num_blocks == 4 and job.missing == () and job.in_step == (host_hits == "in_step")
    assert engine.connector.get_external_cache_hit_sources(second, 4 * BLOCK) == {CacheHitSource.HOST: 4 * BLOCK}
    if host_hits == "async":
        assert second.request_id not in out.num_scheduled_tokens
        out = step_until_scheduled(engine, second)
    assert out.num_scheduled_tokens[second.request_id] == 9  # the tail only: 4 blocks came from kvtier
    assert engine.blocks_match(second, range(4))
    engine.run([second])
    totals = {k: sum(s[k] for s in engine.stats) for k in engine.stats[0]}
    block_bytes = engine.kvtier.tier("host").block_bytes
    assert totals["hit_blocks_host"] == 4 and totals["stored_blocks"] == 4  # the second prompt's tail is not full
    assert totals["load_bytes"] == 4 * block_bytes and totals["store_bytes"] == 4 * block_bytes
    assert totals["load_seconds"] > 0 and totals["store_seconds"] > 0
    engine.assert_no_leaks()


def test_lookup_counts_whole_blocks_and_leaves_the_last_token(make_engine):
    engine = make_engine(HOST_ONLY, extra=IN_STEP)
    first = engine.add(prompt(4, 3, seed=1), max_tokens=2)
    engine.run([first])
    lookup = engine.connector.get_num_new_matched_tokens
    # 2 shared blocks then a different third block: 2 blocks
    diverging = engine.add(prompt(2, 40, seed=3), max_tokens=1)
    assert lookup(diverging, 0) == (2 * BLOCK, False)  # (host memory holds them: loaded in step)
    # exactly the 4 stored blocks and nothing else: the last token is computed, so 3 blocks load
    exact = engine.add(prompt(4, 0, seed=4), max_tokens=1)
    assert lookup(exact, 0) == (3 * BLOCK, False)
    # past vLLM's own hit of 1 block: the 3 blocks after it
    past = engine.add(prompt(4, 3, seed=5), max_tokens=1)
    assert lookup(past, BLOCK) == (3 * BLOCK, False)
    # another prefix: a miss, and asking twice gives the same
    other = engine.add(prompt(4, 3, seed=6, prefix=9), max_tokens=1)
    assert lookup(other, 0) == lookup(other, 0) == (0, False)
    # the hits hold their blocks for the loads vLLM plans in this step, until the step ends
    assert engine.kvtier.tier("host").leaks() == {"pinned": 4, "writing": 0}
    engine.run([diverging, exact, past, other])
    engine.assert_no_leaks()


@pytest.mark.parametrize("placement", ["write_through", "write_back"])
def test_prefix_from_disk_once_host_is_full(make_engine, tmp_path, placement):
    config = {
        "placement": placement,
        "tiers": [
            {"medium": "host", "capacity_blocks": 4},
            {"medium": "disk", "capacity_blocks": 64, "path": str(tmp_path / "disk")},
        ],
    }
    engine = make_engine(config)
    first = engine.add(prompt(4, 5, seed=1, prefix=1), max_tokens=2)
    engine.run([first])
    for p in (2, 3):  # two more prefixes push the first out of the 4-block host tier
        engine.run([engine.add(prompt(4, 5, seed=p, prefix=p), max_tokens=2)])
    keys = chain_hashes(prompt(4, 0, seed=0, prefix=1), BLOCK, engine.kvtier.request_namespace())
    assert held_by(engine, keys) == ["disk"] * 4
    forget_gpu(engine)

    again = engine.add(prompt(4, 11, seed=4, prefix=1), max_tokens=2)
    job = scheduled_load(engine, again.request_id)
    assert job.num_blocks == 4 and [c.src.tier for stage in job.stages for c in stage] == ["disk", "host"]
    assert engine.connector.get_external_cache_hit_sources(again, 4 * BLOCK) == {CacheHitSource.DISK: 4 * BLOCK}
    out = step_until_scheduled(engine, again)
    assert out.num_scheduled_tokens[again.request_id] == 11
    assert engine.blocks_match(again, range(4))
    engine.run([again])
    assert sum(s["hit_blocks_disk"] for s in engine.stats) == 4
    assert sum(s["hit_blocks_host"] for s in engine.stats) == 0
    assert held_by(engine, keys) == ["host"] * 4  # staged blocks stay cached
    engine.assert_no_leaks()


def test_failed_disk_load_is_recomputed(make_engine, tmp_path):
    """A block whose bytes on disk are damaged fails its checksum: vLLM is told exactly which GPU
    blocks did not arrive, recomputes from there, and the output KV is still right."""
    disk = tmp_path / "disk"
    config = {
        "placement": "write_through",
        "tiers": [
            {"medium": "host", "capacity_blocks": 4},
            {"medium": "disk", "capacity_blocks": 16, "path": str(disk), "o_direct": "off"},
        ],
    }
    engine = make_engine(config)
    first = engine.add(prompt(4, 5, seed=1, prefix=1), max_tokens=2)
    engine.run([first])
    keys = chain_hashes(prompt(4, 0, seed=0, prefix=1), BLOCK, engine.kvtier.request_namespace())
    damaged_slot = engine.kvtier.tier("disk").slots([keys[2]])[0]
    slab = engine.workers[0].connector.worker_side.storages["disk"].slab
    with open(slab.path, "r+b") as f:  # flip bytes inside block 2's data on disk
        f.seek(slab.slot_offset(damaged_slot) + 4096 + 100)
        f.write(b"\x00\xff" * 8)
    engine.run([engine.add(prompt(4, 5, seed=p, prefix=p), max_tokens=2) for p in (2,)])  # evicts host

    again = assert_recomputed_from(
        engine, prompt(4, 7, seed=3, prefix=1), damaged=2, blocks=4, computed=2 * BLOCK + 7
    )  # recomputed from block 2 on
    engine.run([again])
    assert sum(s["failed_load_blocks"] for s in engine.stats) == 1
    # the damaged copy was dropped (the recomputed block is stored anew)
    assert engine.kvtier.tier("disk").stats.read_errors == 1
    removed = [
        h for e in engine.events if type(e).__name__ == "BlockRemoved" and e.medium == "STORAGE" for h in e.block_hashes
    ]
    assert keys[2] in removed  # and its event says so
    engine.assert_no_leaks()


@pytest.mark.parametrize("names", [["host"], ["host", "disk"]])
def test_one_planner_serves_one_tier_or_two(make_engine, tmp_path, names):
    """The scheduler side works over the tiers the configuration lists, through one planner: with a
    host tier alone a prefix pushed out of it is gone; with a disk tier below, it is demoted there
    (the bytes read out of host memory counted, as the stack counts them) and loads back through
    host memory, bit-exact."""
    tiers = [{"medium": "host", "capacity_blocks": 4}, {"medium": "disk", "capacity_blocks": 16, "path": str(tmp_path)}]
    engine = make_engine({"tiers": tiers[: len(names)]})
    side = engine.kvtier
    assert [t.name for t in side.tiers] == names and side.planner.tiers == side.tiers
    for p in (1, 2):  # the second prefix pushes the first out of the 4-block host tier
        engine.run([engine.add(prompt(4, 5, seed=p, prefix=p), max_tokens=2)])
    keys = chain_hashes(prompt(4, 0, seed=0, prefix=1), BLOCK, side.request_namespace())
    host = side.tier("host")
    assert host.stats.evicted == 4
    if names == ["host"]:
        assert held_by(engine, keys) == [None] * 4 and (host.stats.demoted, host.stats.bytes_out) == (0, 0)
        again = engine.add(prompt(4, 9, seed=3, prefix=1), max_tokens=2)
        assert engine.connector.get_num_new_matched_tokens(again, 0) == (0, False)
        engine.run([again])
        engine.assert_no_leaks()
    else:
        assert held_by(engine, keys) == ["disk"] * 4
        assert (host.stats.demoted, host.stats.bytes_out) == (4, 4 * host.block_bytes)
        assert_loads_back(engine, prompt(4, 9, seed=3, prefix=1), computed=9, blocks=4)


def test_events_name_blocks_stored_and_removed_per_tier(make_engine):
    engine = make_engine({"tiers": [{"medium": "host", "capacity_blocks": 4}]})
    first = engine.add(prompt(4, 5, seed=1, prefix=1), max_tokens=2)
    engine.run([first])
    keys = chain_hashes(prompt(4, 0, seed=0, prefix=1), BLOCK, engine.kvtier.request_namespace())
    stored = [e for e in engine.events if type(e).__name__ == "BlockStored"]
    assert [h for e in stored for h in e.block_hashes] == keys and {e.medium for e in stored} == {"CPU"}
    tokens = prompt(4, 0, seed=0, prefix=1)
    # each block with its own tokens and its parent's key: a router that hashes tokens itself (llm-d's
    # indexer) chains every block to the one before it
    assert [(e.token_ids, e.parent_block_hash) for e in stored] == [
        (tokens[i * BLOCK : (i + 1) * BLOCK], keys[i - 1] if i else None) for i in range(4)
    ]
    assert {e.locality for e in stored} == {"LOCAL"}
    engine.run([engine.add(prompt(4, 5, seed=2, prefix=2), max_tokens=2)])  # evicts the first prefix
    removed = [h for e in engine.events if type(e).__name__ == "BlockRemoved" for h in e.block_hashes]
    assert sorted(removed) == sorted(keys)


def test_a_demoted_block_is_announced_with_the_tokens_and_parent_of_its_store(make_engine, tmp_path):
    """The disk tier's BlockStored for a block the host tier pushed down names the tokens and parent its
    store named (llm-d's indexer hashes tokens itself): kept while a tier holds the block, let go when
    none does; kept only where vLLM's KV events are on."""
    tiers = [{"medium": "host", "capacity_blocks": 4}, {"medium": "disk", "capacity_blocks": 16, "path": str(tmp_path)}]
    assert make_engine(HOST_ONLY).kvtier.events.tokens is None  # (events off: nobody reads them)
    engine = make_engine({"tiers": tiers}, kv_events=True)
    for p in (1, 2):  # the second prefix pushes the first down to disk
        engine.run([engine.add(prompt(4, 5, seed=p, prefix=p), max_tokens=2)])
    keys = chain_hashes(prompt(4, 0, seed=0, prefix=1), BLOCK, engine.kvtier.request_namespace())
    tokens = prompt(4, 0, seed=0, prefix=1)
    expected = [(tokens[i * BLOCK : (i + 1) * BLOCK], keys[i - 1] if i else None) for i in range(4)]
    stored = {
        m: [e for e in engine.events if type(e).__name__ == "BlockStored" and e.medium == m] for m in ("CPU", "STORAGE")
    }
    for medium in ("CPU", "STORAGE"):
        first = [e for e in stored[medium] if e.block_hashes[0] in keys]
        assert [h for e in first for h in e.block_hashes] == keys, medium
        assert [(e.token_ids, e.parent_block_hash) for e in first] == expected, medium
    events = engine.kvtier.events
    assert len(events.tokens) == 8  # two prefixes, each held by one tier or two
    engine.connector.reset_cache()
    assert len(events.tokens) == 0  # every tier let every block go


def test_preemption_flushes_in_flight_stores_and_keeps_kv_exact(make_engine):
    """Two requests outgrow 12 GPU blocks, so vLLM preempts one. Reports are held back every other
    step, so stores are still in flight on the scheduler side when their blocks are reused: the
    fence names them, and what was stored is still the right KV afterwards."""
    engine = make_engine(HOST_ONLY, num_gpu_blocks=12)
    reqs = [engine.add(prompt(3, 8, seed=s, prefix=s), max_tokens=60) for s in (1, 2)]
    preempted, flushed = set(), set()
    for step in range(400):
        out, _ = engine.step(report_ranks=None if step % 2 else set())
        preempted |= out.preempted_req_ids or set()
        flushed |= out.kv_connector_metadata.flush
        if all(r.request_id not in engine.scheduler.requests for r in reqs):
            break
    engine.drain()
    assert preempted and flushed
    engine.assert_no_leaks()
    forget_gpu(engine)
    for s in (1, 2):  # every stored block of both requests loads back as the KV its tokens give
        # the prompt continues with what the stand-in model sampled (1000, 1001, ...): decode blocks too
        again = engine.add(prompt(3, 8, seed=s, prefix=s) + [1000 + i for i in range(40)], max_tokens=2)
        out = step_until_scheduled(engine, again)
        assert out.num_scheduled_tokens[again.request_id] == BLOCK  # 5 of 6 blocks loaded, the last computed
        assert engine.blocks_match(again, range(6))
        engine.run([again])
    engine.assert_no_leaks()


def test_abort_mid_load_releases_everything(make_engine):
    engine = make_engine(HOST_ONLY, num_gpu_blocks=32)
    engine.run([engine.add(prompt(4, 5, seed=1), max_tokens=2)])
    forget_gpu(engine)
    second = engine.add(prompt(4, 9, seed=2), max_tokens=4)
    out, _ = engine.step(report_ranks=set())  # the load ran on the worker; its report is held back
    assert [j.req_id for j in out.kv_connector_metadata.loads] == [second.request_id]
    assert engine.kvtier.tier("host").leaks()["pinned"] == 4
    engine.scheduler.finish_requests(second.request_id, RequestStatus.FINISHED_ABORTED)
    for _ in range(3):
        engine.step()
    engine.drain()
    engine.assert_no_leaks()
    assert second.request_id not in engine.scheduler.requests
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == 32 - 1  # vLLM got every block back once the load reported


def test_abort_mid_store_releases_everything(make_engine):
    engine = make_engine(HOST_ONLY, num_gpu_blocks=12)
    first = engine.add(prompt(4, 5, seed=1), max_tokens=8)
    out, _ = engine.step(report_ranks=set())  # prefill: the store ran, its report is held back
    assert [j.kind for j in out.kv_connector_metadata.stores] == ["store"]
    assert engine.kvtier.tier("host").leaks()["writing"] == 4
    engine.scheduler.finish_requests(first.request_id, RequestStatus.FINISHED_ABORTED)
    reuse = engine.add(prompt(8, 5, seed=7, prefix=7), max_tokens=1)  # needs the freed blocks too
    out, _ = engine.step()
    assert out.kv_connector_metadata.flush  # the store still read blocks handed out again
    engine.run([reuse])
    engine.assert_no_leaks()
    assert engine.kvtier.tier("host").usage().used == 12  # the aborted request's 4 blocks landed, then reuse's 8


def test_reset_drops_every_block_not_in_use(make_engine):
    engine = make_engine(HOST_ONLY)
    engine.run([engine.add(prompt(4, 5, seed=1), max_tokens=2)])
    forget_gpu(engine)
    loading = engine.add(prompt(4, 9, seed=2), max_tokens=2)
    engine.step(report_ranks=set())  # a load holds 4 host blocks
    assert engine.connector.reset_cache() is False  # pinned blocks stay until the load reports
    assert engine.kvtier.tier("host").usage().used == 4
    engine.run([loading])
    assert engine.scheduler.reset_prefix_cache(reset_connector=True)
    assert engine.kvtier.tier("host").usage().used == 0
    assert len([h for e in engine.connector.take_events() for h in e.block_hashes]) == 4
    assert engine.connector.get_num_new_matched_tokens(engine.add(prompt(4, 9, seed=3), max_tokens=1), 0) == (0, False)
    engine.assert_no_leaks()


def test_two_ranks_a_job_ends_only_when_both_reported(make_engine):
    engine = make_engine(HOST_ONLY, tp=2, extra=IN_STEP)
    first = engine.add(prompt(4, 5, seed=1), max_tokens=3)
    out, _ = engine.step(report_ranks={0})  # rank 1's report comes a step later
    (store,) = out.kv_connector_metadata.stores
    job = engine.kvtier.jobs.get(store.job_id)
    assert (job.reports, job.expected_reports) == (1, 2) and job.state.value == "running"
    assert engine.kvtier.tier("host").leaks()["writing"] == 4  # not readable before every rank has its shard
    engine.step()
    assert job.state.value == "done" and engine.kvtier.tier("host").usage().used == 4
    engine.run([first])
    forget_gpu(engine)
    second = engine.add(prompt(4, 9, seed=2), max_tokens=2)
    out, _ = engine.step(report_ranks={1})
    (load,) = out.kv_connector_metadata.loads
    assert engine.kvtier.jobs.get(load.job_id).reports == 1 and engine.kvtier.tier("host").leaks()["pinned"] == 4
    assert out.num_scheduled_tokens[second.request_id] == 9  # (loaded in step: both ranks waited for it)
    assert engine.blocks_match(second, range(4))  # both ranks' shards arrived
    engine.run([second])
    engine.assert_no_leaks()


def test_block_evicted_between_lookup_and_allocation_is_recomputed(make_engine):
    """vLLM counted 4 blocks as hits, then 2 of them left the host tier before the load was planned
    (as another request's staging or a reset can do within one schedule()): the load covers the 2
    that are left, the other GPU blocks are reported failed, and vLLM recomputes them (an async load:
    an in-step load's blocks cannot leave, below)."""
    engine = make_engine(HOST_ONLY, extra={"host_hits": "async"})
    engine.run([engine.add(prompt(4, 5, seed=1), max_tokens=2)])
    forget_gpu(engine)
    keys = chain_hashes(prompt(4, 0, seed=0), BLOCK, engine.kvtier.request_namespace())
    lookup = engine.connector.get_num_new_matched_tokens

    def lookup_then_lose_two(request, num_computed_tokens):
        result = lookup(request, num_computed_tokens)
        host = engine.kvtier.tier("host")
        chosen = [k for k, _ in host.begin_evict(4)]
        host.end_evict([k for k in chosen if k in keys[2:]])  # dropped
        host.end_evict([k for k in chosen if k not in keys[2:]], drop=False)  # kept
        return result

    engine.connector.get_num_new_matched_tokens = lookup_then_lose_two
    again = engine.add(prompt(4, 9, seed=2), max_tokens=2)
    job = scheduled_load(engine, again.request_id)
    engine.connector.get_num_new_matched_tokens = lookup
    assert job.num_blocks == 2 and len(job.missing) == 2
    out = step_until_scheduled(engine, again)
    assert out.num_scheduled_tokens[again.request_id] == 2 * BLOCK + 9  # blocks 2 and 3 recomputed
    assert set(job.missing) <= engine.load_errors
    assert engine.blocks_match(again, range(4))
    engine.run([again])
    engine.assert_no_leaks()


def test_an_in_step_hits_blocks_cannot_leave_host_memory_before_the_load_is_planned(make_engine):
    """vLLM reads an in-step load in the very step it plans it, and a failed block there could only be
    recomputed after vLLM computed on it: so the lookup pins the blocks it offers."""
    engine = make_engine(HOST_ONLY, extra=IN_STEP)
    engine.run([engine.add(prompt(4, 5, seed=1), max_tokens=2)])
    forget_gpu(engine)
    host = engine.kvtier.tier("host")
    again = engine.add(prompt(4, 9, seed=2), max_tokens=2)
    assert engine.connector.get_num_new_matched_tokens(again, 0) == (4 * BLOCK, False)
    assert host.leaks()["pinned"] == 4 and host.begin_evict(4) == []  # no victim among them
    out, _ = engine.step()
    assert out.num_scheduled_tokens[again.request_id] == 9 and not engine.load_errors
    assert engine.blocks_match(again, range(4))
    engine.run([again])
    engine.assert_no_leaks()


def test_blocks_a_lookup_reserved_are_let_go_when_vllm_does_not_allocate(make_engine):
    engine = make_engine(HOST_ONLY, extra=IN_STEP)
    engine.run([engine.add(prompt(4, 5, seed=1), max_tokens=2)])
    again = engine.add(prompt(4, 9, seed=2), max_tokens=2)
    assert engine.connector.get_num_new_matched_tokens(again, 0) == (4 * BLOCK, False)
    engine.scheduler.finish_requests(again.request_id, RequestStatus.FINISHED_ABORTED)
    engine.step()  # vLLM never allocated for it: the step's end lets its blocks go
    assert engine.kvtier.tier("host").leaks()["pinned"] == 0
    engine.assert_no_leaks()


@pytest.mark.parametrize("placement", ["write_through", "write_back"])
def test_disk_refusing_a_block_drops_it_from_host(make_engine, tmp_path, placement):
    """A compressing disk tier cannot hold a block whose compressed bytes outgrow its slot (the test
    model's KV is random bytes: 16 KiB blocks, 12 KiB zstd slots). The worker reports the refusal
    with the job, so the scheduler drops the host copy instead of keeping it to offer again and
    again: the host tier keeps taking new prefixes, and a later request is a clean miss."""
    config = {
        "placement": placement,
        "tiers": [
            {"medium": "host", "capacity_blocks": 4},
            {"medium": "disk", "capacity_blocks": 64, "path": str(tmp_path / "disk"), "compression": "zstd"},
        ],
    }
    engine = make_engine(config, head_size=64)
    assert engine.kvtier.tier("host").block_bytes == 16 * 1024
    for p in (1, 2, 3):  # each prefix pushes the previous one out of the 4-block host tier
        engine.run([engine.add(prompt(4, 5, seed=p, prefix=p), max_tokens=2)])
    namespace = engine.kvtier.request_namespace()
    holding = lambda p: held_by(engine, chain_hashes(prompt(4, 0, seed=0, prefix=p), BLOCK, namespace))  # noqa: E731
    assert holding(1) == [None] * 4  # refused by the disk, dropped from host
    assert holding(3) == ["host"] * 4  # room was made: the newest prefix is stored
    host, disk = engine.kvtier.tier("host").stats, engine.kvtier.tier("disk").stats
    assert host.demotion_refused == host.evicted >= 4 and host.demoted == 0
    assert disk.incompressible >= 4 and disk.committed == 0 and engine.kvtier.tier("disk").usage().used == 0
    forget_gpu(engine)

    again = engine.add(prompt(4, 11, seed=4, prefix=1), max_tokens=2)
    assert engine.connector.get_num_new_matched_tokens(again, 0) == (0, False)
    engine.run([again])
    engine.assert_no_leaks()


def test_blocks_that_find_no_host_room_are_stored_at_a_later_step(make_engine, tmp_path):
    """A full host tier makes room by demoting to disk, and the slots free only when those jobs end.
    The blocks that found no room are stored at the request's next step, once they have; meanwhile
    the demotions in flight count as room, so the retry evicts nothing more."""
    config = {
        "tiers": [
            {"medium": "host", "capacity_blocks": 4},
            {"medium": "disk", "capacity_blocks": 64, "path": str(tmp_path / "disk")},
        ]
    }
    engine = make_engine(config)
    engine.run([engine.add(prompt(4, 5, seed=1, prefix=1), max_tokens=2)])
    second = engine.add(prompt(4, 5, seed=2, prefix=2), max_tokens=4)
    out, _ = engine.step()  # prefill: no free host slot yet, the first prefix is being demoted
    assert [j.kind for j in out.kv_connector_metadata.stores] == ["demote"]
    engine.run([second])
    namespace = engine.kvtier.request_namespace()
    for p, tier in ((1, "disk"), (2, "host")):
        keys = chain_hashes(prompt(4, 0, seed=0, prefix=p), BLOCK, namespace)
        assert held_by(engine, keys) == [tier] * 4
    assert (engine.kvtier.tier("host").stats.evicted, engine.kvtier.tier("host").stats.demoted) == (4, 4)
    assert_loads_back(engine, prompt(4, 9, seed=3, prefix=2), computed=9, blocks=4)


def test_a_full_disk_under_write_through_keeps_the_host_copies(make_engine, tmp_path):
    """Every disk write fails with ENOSPC (the disk file is swapped for /dev/full): the disk stage of
    each write-through store fails, but the host copy landed before it and stays; a later request
    gets its prefix from host memory, bit-exact, and the disk tier holds nothing."""
    config = {
        "placement": "write_through",
        "tiers": [
            {"medium": "host", "capacity_blocks": 8},
            {"medium": "disk", "capacity_blocks": 16, "path": str(tmp_path / "disk"), "o_direct": "off"},
        ],
    }
    engine = make_engine(config)
    slab = engine.workers[0].connector.worker_side.storages["disk"].slab
    full = os.open("/dev/full", os.O_RDWR)
    saved = os.dup(slab.fd)
    os.dup2(full, slab.fd)
    try:
        engine.run([engine.add(prompt(4, 5, seed=1, prefix=1), max_tokens=2)])
    finally:
        os.dup2(saved, slab.fd)
        os.close(saved)
        os.close(full)
    keys = chain_hashes(prompt(4, 0, seed=0, prefix=1), BLOCK, engine.kvtier.request_namespace())
    assert held_by(engine, keys) == ["host"] * 4
    assert engine.kvtier.tier("disk").usage().used == 0 and engine.kvtier.tier("disk").stats.aborted == 4
    assert_loads_back(engine, prompt(4, 9, seed=2, prefix=1), computed=9, blocks=4)


def test_blocks_the_host_tiers_policy_declines_are_not_offered_again_by_that_request(make_engine):
    """The policy is asked about each block once per request that computes it: asking again at the
    request's next step would make a block seen once look seen twice. A second request computing the
    same prefix is a second sight: then its blocks are stored, and they load back bit-exact."""
    engine = make_engine(
        {"tiers": [{"medium": "host", "capacity_blocks": 32, "eviction": "helpers.admission.AdmitOnSecondAsk"}]}
    )
    host = engine.kvtier.tier("host")
    engine.run([engine.add(prompt(4, 5, seed=1), max_tokens=20)])  # decodes past a fifth full block
    assert host.usage().used == 0 and host.stats.declined == 5
    forget_gpu(engine)
    engine.run([engine.add(prompt(4, 5, seed=1), max_tokens=2)])
    assert host.usage().used == 4 and host.stats.declined == 5
    assert_loads_back(engine, prompt(4, 9, seed=3), computed=9, blocks=4)
