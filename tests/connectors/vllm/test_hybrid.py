"""Hybrid models under vLLM's real Scheduler and its hybrid KV cache manager: a full-attention group and
a sliding-window group (``hybrid_kv_cache_config``: layers 0 and 2 full, 1 and 3 windowed). kvtier
keeps vLLM's hybrid manager on (``SupportsHMA``), stores every group's blocks under keys tagged with the
group, and loads a prefix hit into every group's blocks vLLM allocated: all of the full-attention
group's, only the window's worth of the sliding-window group's (vLLM keeps nothing older there)."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import RequestStatus

from helpers.vllm_harness import HYBRID_LAYERS, Engine
from helpers.vllm_helpers import BLOCK, assert_loads_back, forget_gpu, prompt, scheduled_load, step_until_scheduled
from kvtier.connectors.vllm.geometry import ServedGroup, replicated, served_groups
from kvtier.core.errors import ConfigError
from kvtier.core.keys import chain_hashes

HOST_ONLY = {"tiers": [{"medium": "host", "capacity_blocks": 64}]}
WINDOW = 2 * BLOCK + 1
"""Tokens of the sliding window: a hit's last 2 blocks are all its windowed layers keep."""


@pytest.fixture
def hybrid(make_engine):
    return lambda config=HOST_ONLY, **kwargs: make_engine(config, window=WINDOW, **kwargs)


def group_keys(engine, tokens: list[int], group: int) -> list[bytes]:
    keys = chain_hashes(tokens[: len(tokens) // BLOCK * BLOCK], BLOCK, engine.kvtier.request_namespace())
    return [key + group.to_bytes(2, "big") for key in keys]


def test_kvtier_keeps_vllms_hybrid_manager_on(make_config, caplog):
    with caplog.at_level(logging.WARNING):
        config = make_config(HOST_ONLY)
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert "Turning off hybrid kv cache manager" not in caplog.text


def test_both_groups_are_served_the_window_as_far_as_it_reaches(hybrid):
    engine = hybrid()
    assert served_groups(engine.kv_config) == [ServedGroup(0), ServedGroup(1, window_blocks=2)]


def test_a_prefix_longer_than_the_window_loads_into_every_groups_blocks_bit_exact(hybrid):
    engine = hybrid()
    first = engine.add(prompt(6, 5, seed=1), max_tokens=2)
    engine.run([first])
    host = engine.kvtier.tier("host")
    assert host.usage().used == 12  # 6 blocks of each group, stored while vLLM still held them all
    forget_gpu(engine)

    second = engine.add(prompt(6, 9, seed=2), max_tokens=2)
    assert engine.connector.get_num_new_matched_tokens(second, 0) == (6 * BLOCK, True)
    job = scheduled_load(engine, second.request_id)
    assert job.num_blocks == 6 + 2 and job.missing == ()  # the window's group: its last 2 blocks only
    out = step_until_scheduled(engine, second)
    assert out.num_scheduled_tokens[second.request_id] == 9
    tables = engine.scheduler.kv_cache_manager.get_block_ids(second.request_id)
    assert [b != 0 for b in tables[1][:6]] == [False] * 4 + [True] * 2  # vLLM keeps only the window
    assert engine.blocks_match(second, range(6)) and not engine.failed_loads
    engine.run([second])
    assert sum(s["hit_blocks_host"] for s in engine.stats) == 8
    engine.assert_no_leaks()


def test_a_window_block_missing_ends_the_hit_where_the_window_is_whole(hybrid):
    """The full-attention group holds all 6 blocks; the window's group lacks block 5, so a hit at 6 is
    not whole. At 5 the window needs blocks 3 and 4, which are there: 5 blocks."""
    engine = hybrid()
    engine.run([engine.add(prompt(6, 5, seed=1), max_tokens=2)])
    engine.kvtier.tier("host").discard([group_keys(engine, prompt(6, 0, seed=0), 1)[5]])
    forget_gpu(engine)
    again = engine.add(prompt(6, 9, seed=2), max_tokens=2)
    assert engine.connector.get_num_new_matched_tokens(again, 0) == (5 * BLOCK, True)
    out = step_until_scheduled(engine, again)
    assert out.num_scheduled_tokens[again.request_id] == BLOCK + 9
    assert engine.blocks_match(again, range(6)) and not engine.failed_loads
    engine.run([again])
    engine.assert_no_leaks()


def test_a_failed_load_recomputes_the_whole_request(hybrid, tmp_path):
    """With several groups vLLM takes no failed block ids: the request is reported failed, and vLLM
    starts it over: its lookup now finds blocks 0 and 1 (block 2's damaged copy was dropped), loads them
    again and computes the rest, with the right KV."""
    disk = tmp_path / "disk"
    config = {
        "placement": "write_through",
        "tiers": [
            {"medium": "host", "capacity_blocks": 8},
            {"medium": "disk", "capacity_blocks": 32, "path": str(disk), "o_direct": "off"},
        ],
    }
    engine = hybrid(config)
    engine.run([engine.add(prompt(4, 5, seed=1, prefix=1), max_tokens=2)])
    key = group_keys(engine, prompt(4, 0, seed=0, prefix=1), 0)[2]
    slot = engine.kvtier.tier("disk").slots([key])[0]
    slab = engine.workers[0].connector.worker_side.storages["disk"].slab
    with open(slab.path, "r+b") as f:  # flip bytes inside block 2's data (full-attention group) on disk
        f.seek(slab.slot_offset(slot) + 4096 + 100)
        f.write(b"\x00\xff" * 8)
    engine.run([engine.add(prompt(4, 5, seed=2, prefix=2), max_tokens=2)])  # pushes prefix 1 out of host
    forget_gpu(engine)
    again = engine.add(prompt(4, 7, seed=3, prefix=1), max_tokens=2)
    assert engine.connector.get_num_new_matched_tokens(again, 0) == (4 * BLOCK, True)
    out = step_until_scheduled(engine, again)
    assert engine.failed_loads == {again.request_id} and not engine.load_errors
    assert out.num_scheduled_tokens[again.request_id] == 2 * BLOCK + 7  # from block 2 on, after a second load
    assert engine.blocks_match(again, range(4))
    engine.run([again])
    assert engine.kvtier.tier("disk").stats.read_errors == 1
    engine.assert_no_leaks()


def test_abort_mid_load_releases_everything(hybrid):
    engine = hybrid(num_gpu_blocks=32)
    engine.run([engine.add(prompt(4, 5, seed=1), max_tokens=2)])
    forget_gpu(engine)
    second = engine.add(prompt(4, 9, seed=2), max_tokens=4)
    out, _ = engine.step(report_ranks=set())  # the load ran on the worker; its report is held back
    assert [j.req_id for j in out.kv_connector_metadata.loads] == [second.request_id]
    assert engine.kvtier.tier("host").leaks()["pinned"] == 4 + 2
    engine.scheduler.finish_requests(second.request_id, RequestStatus.FINISHED_ABORTED)
    for _ in range(3):
        engine.step()
    engine.drain()
    engine.assert_no_leaks()
    assert engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 32 - 1


def test_preemption_keeps_every_groups_kv_exact(hybrid):
    """Two requests outgrow 16 GPU blocks (shared by both groups), so vLLM preempts one; reports held
    back every other step keep stores in flight while vLLM reuses blocks. Everything stored loads back
    as the KV its tokens give, in both groups."""
    engine = hybrid(num_gpu_blocks=16)
    reqs = [engine.add(prompt(3, 8, seed=s, prefix=s), max_tokens=40) for s in (1, 2)]
    preempted = set()
    for step in range(400):
        out, _ = engine.step(report_ranks=None if step % 2 else set())
        preempted |= out.preempted_req_ids or set()
        if all(r.request_id not in engine.scheduler.requests for r in reqs):
            break
    engine.drain()
    assert preempted
    engine.assert_no_leaks()
    forget_gpu(engine)
    for s in (1, 2):
        again = engine.add(prompt(3, 8, seed=s, prefix=s) + [1000 + i for i in range(24)], max_tokens=2)
        out = step_until_scheduled(engine, again)
        assert engine.blocks_match(again, range(len(again.prompt_token_ids) // BLOCK)) and not engine.failed_loads
        engine.run([again])
    engine.assert_no_leaks()


def test_two_ranks_load_every_groups_blocks_bit_exact(model_dir):
    engine = Engine(model_dir, HOST_ONLY, tp=2, window=WINDOW)
    try:
        engine.run([engine.add(prompt(5, 5, seed=1), max_tokens=2)])
        assert_loads_back(engine, prompt(5, 9, seed=2), computed=9, blocks=5)
    finally:
        engine.shutdown()


def test_with_a_mamba_state_group_kvtier_serves_no_hit_and_the_engine_runs(make_engine, caplog):
    """A Mamba group's state at a hit's end is not a kvtier block, so no hit could be whole: kvtier
    says so at start, answers every lookup with a miss, stores nothing, and the engine runs as without it."""
    with caplog.at_level(logging.WARNING):
        engine = make_engine(HOST_ONLY, mamba=True)
    assert "serves no prefix hits for this model" in caplog.text
    assert engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
    engine.run([engine.add(prompt(4, 5, seed=1), max_tokens=2)])
    forget_gpu(engine)
    again = engine.add(prompt(4, 9, seed=2), max_tokens=2)
    assert engine.connector.get_num_new_matched_tokens(again, 0) == (0, False)
    out = step_until_scheduled(engine, again)
    # computed from its first token (in block-aligned chunks, as vLLM schedules Mamba's "align" mode)
    assert again.num_computed_tokens == out.num_scheduled_tokens[again.request_id]
    assert not out.kv_connector_metadata.loads
    engine.run([again])
    assert engine.kvtier.tier("host").usage().used == 0 and not engine.stats
    engine.assert_no_leaks()


def test_lazy_stores_save_each_groups_blocks_before_vllm_reuses_them(hybrid):
    """``store: lazy`` copies blocks as vLLM's free queue is about to hand them out again: a window's
    blocks reach that queue while the request still runs, the full-attention ones when it ends; both
    load back bit-exact once another prefix has overwritten them."""
    engine = hybrid(num_gpu_blocks=24, extra={"store": "lazy", "lazy_ahead": 1.0})
    engine.run([engine.add(prompt(6, 5, seed=1, prefix=1), max_tokens=2)])
    engine.step()  # its blocks are free now, and everything free is about to be reused
    engine.drain()
    assert engine.kvtier.tier("host").usage().used == 12
    engine.run([engine.add(prompt(10, 5, seed=2, prefix=2), max_tokens=2)])  # takes most GPU blocks
    assert_loads_back(engine, prompt(6, 9, seed=3, prefix=1), computed=9, blocks=6)


def test_both_groups_disk_blocks_are_loaded_after_a_restart_bit_exact(hybrid, tmp_path):
    """The disk tier keeps every group's blocks (group-tagged keys in its slot headers) across a
    restart: a new engine on the same directory loads the full group's 6 and the window's last 2."""
    config = {
        "placement": "write_through",
        "tiers": [
            {"medium": "host", "capacity_blocks": 12},
            {"medium": "disk", "capacity_blocks": 32, "path": str(tmp_path / "disk")},
        ],
    }
    before = hybrid(config)
    before.run([before.add(prompt(6, 5, seed=1), max_tokens=2)])
    assert before.kvtier.tier("disk").usage().used == 12
    before.assert_no_leaks()
    before.shutdown()

    after = hybrid(config)
    assert after.kvtier.tier("disk").usage().used == 12 and after.kvtier.tier("host").usage().used == 0
    again = after.add(prompt(6, 9, seed=2), max_tokens=2)
    assert after.connector.get_num_new_matched_tokens(again, 0) == (6 * BLOCK, True)
    out = step_until_scheduled(after, again)
    assert out.num_scheduled_tokens[again.request_id] == 9
    assert after.blocks_match(again, range(6)) and not after.failed_loads
    after.run([again])
    assert sum(s["hit_blocks_disk"] for s in after.stats) == 6 + 2
    after.assert_no_leaks()


def two_groups(second) -> KVCacheConfig:
    """A full-attention group (layers 0 and 2) and ``second`` (layers 1 and 3) over one buffer."""
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float16)
    groups = [
        KVCacheGroupSpec([HYBRID_LAYERS[0], HYBRID_LAYERS[2]], full),
        KVCacheGroupSpec([HYBRID_LAYERS[1], HYBRID_LAYERS[3]], second),
    ]
    tensors = [
        KVCacheTensor(
            size=1 << 20, layers=list(g.layer_names), layer_stride=1 << 19, block_stride=g.kv_cache_spec.page_size_bytes
        )
        for g in groups
    ]
    return KVCacheConfig(num_blocks=32, kv_cache_tensors=tensors, kv_cache_groups=groups, kv_cache_layout="LBHNC")


@pytest.mark.parametrize(
    ("second", "named"),
    [
        (
            ChunkedLocalAttentionSpec(
                block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float16, attention_chunk_size=64
            ),
            "ChunkedLocalAttentionSpec",
        ),
        (
            SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float16, sliding_window=64),
            "(page bytes, layers)",
        ),
    ],
)
def test_groups_kvtier_cannot_serve_are_refused_at_start_naming_them(second, named):
    """Another kind of group, or groups whose blocks differ in size, is a ConfigError when the connector
    starts, never a copy of the wrong bytes."""
    with pytest.raises(ConfigError, match=re.escape(named)):
        served_groups(two_groups(second))


def test_only_mla_with_replicas_counts_as_the_same_kv_on_every_rank():
    mla = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=32, dtype=torch.float16)
    config = two_groups(
        SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float16, sliding_window=64)
    )
    assert not replicated(config)  # GQA: each rank holds its own heads
    config.kv_tp_replicas = 2
    assert not replicated(config)  # (not MLA)
    one = KVCacheConfig(
        num_blocks=32,
        kv_cache_tensors=[
            KVCacheTensor(size=1 << 20, layers=[HYBRID_LAYERS[0]], layer_stride=1 << 19, block_stride=1024)
        ],
        kv_cache_groups=[KVCacheGroupSpec([HYBRID_LAYERS[0]], mla)],
        kv_tp_replicas=2,
    )
    assert replicated(one)
    one.kv_tp_replicas = 1
    assert not replicated(one)
