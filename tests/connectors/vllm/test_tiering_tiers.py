"""kvtier's disk, remote and node tiers inside vLLM's own tiered offloading: vLLM 0.33's real
``TieringOffloadingSpec`` and ``TieringOffloadingManager`` on CPU, built by vLLM's connector factory from
an extra config exactly as a user writes it (helpers/vllm_tiering.py plays vLLM's GPU worker only).

Chunks stored into vLLM's CPU tier cascade to kvtier's tier, leave the CPU tier when it evicts them,
and come back bit-exact on lookup (promotion); a new engine on the same disk directory finds them; a
damaged slot is a miss and its bytes are never promoted; a store on another engine's redis-server
serves a second engine, as a node daemon does; a stopped server or daemon gives misses within the
timeout and never blocks a step;
vLLM's backpressure detector then drops stores. A wrong entry stops vLLM's start with kvtier's error.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from vllm.v1.kv_offload.base import Locality, LookupResult, Medium

from helpers.mooncake_server import MooncakeMaster, SegmentOwner
from helpers.node_daemon import node_daemon
from helpers.redis_server import redis_server
from helpers.vllm_harness import hybrid_kv_cache_config
from helpers.vllm_tiering import TieringEngine, chunk_bytes, chunk_key, kvtier_tier
from kvtier.core.errors import ConfigError

CPU_CHUNKS = 4
TIMEOUT = 1.0


@pytest.fixture
def engines(model_dir):
    """``make(secondary_tiers, **kwargs)``: a TieringEngine, shut down after the test."""
    made: list[TieringEngine] = []

    def make(tiers, **kwargs) -> TieringEngine:
        engine = TieringEngine(model_dir, tiers, cpu_chunks=kwargs.pop("cpu_chunks", CPU_CHUNKS), **kwargs)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        if engine.rows is not None:
            engine.shutdown()


def disk_tier(path: Path, **settings) -> dict:
    return kvtier_tier("KVTierDisk", path=str(path), capacity_blocks=settings.pop("capacity_blocks", 64), **settings)


def remote_tier(server, **settings) -> dict:
    return kvtier_tier("KVTierRemote", backend="redis", timeout=TIMEOUT, redis={"url": server.url}, **settings)


def assert_promoted_exact(engine: TieringEngine, keys) -> None:
    """Every key is found (promoted into the CPU tier if it had left it) and its row is what was written."""
    assert engine.lookup(keys) == len(keys)
    for key, row in zip(keys, engine.read(keys), strict=True):
        assert np.array_equal(row, chunk_bytes(key, engine.chunk_size)), f"chunk {key[:4].hex()} differs"


def in_cpu_tier(engine: TieringEngine, key) -> bool:
    """Whether vLLM's CPU tier holds the chunk readable (asked of it alone: no promotion starts)."""
    ctx = engine.request()
    with engine.manager.lock:
        found = engine.manager.primary_tier.lookup(key, ctx) is LookupResult.HIT
    engine.finish(ctx)
    return found


def counters(engine: TieringEngine) -> dict[str, int]:
    """kvtier's counters of the engine's first secondary tier since the last call, from vLLM's stats
    payload (taking it resets them, as vLLM's stats loop does)."""
    stats = engine.manager.get_stats()
    values = stats.reduce() if stats is not None else {}
    label = f":('{engine.tiers[0].tier_type}',)"
    return {
        name: int(values.get(f"vllm:kvtier_tier_{name}{label}", 0))
        for name in ("stored_chunks", "dropped_chunks", "failed_load_chunks")
    }


# --- the disk tier ---------------------------------------------------------------------------------


def test_chunks_cascade_to_disk_leave_the_cpu_tier_and_come_back_bit_exact(engines, tmp_path):
    engine = engines([disk_tier(tmp_path / "disk")])
    keys = [chunk_key(i) for i in range(10)]
    for key in keys:
        assert engine.store([key]) == [key]
    assert counters(engine)["stored_chunks"] == 10
    assert sum(in_cpu_tier(engine, key) for key in keys) == CPU_CHUNKS  # the CPU tier kept the last ones only
    assert_promoted_exact(engine, keys[:3])  # evicted from the CPU tier long ago: promoted from disk
    assert_promoted_exact(engine, keys[3:6])


def test_the_example_config_runs_as_written(engines, tmp_path):
    """examples/vllm/tiering.json, its disk path and size and the CPU tier's size changed: vLLM builds kvtier's
    disk tier with vLLM's backpressure detector and kvtier's policy for its CPU tier, and chunks cascade
    and come back."""
    example = json.loads((Path(__file__).parents[3] / "examples" / "vllm" / "tiering.json").read_text())
    extra = example["kv_connector_extra_config"]
    (entry,) = extra["secondary_tiers"]
    entry.update(path=str(tmp_path / "disk"), capacity="1MiB")
    engine = engines([entry], eviction_policy=extra["eviction_policy"])
    assert type(engine.manager.primary_tier._policy).__name__ == "KVTierAdaptive"
    assert engine.tiers[0].bp_detector is not None
    keys = [chunk_key(i) for i in range(8)]
    for key in keys:
        engine.store([key])
    assert_promoted_exact(engine, keys[:3])


def test_both_groups_of_a_hybrid_model_cascade_and_come_back(engines, tmp_path):
    """A full-attention and a sliding-window group (vLLM's hybrid KV cache manager): each group's chunks
    are kvtier blocks of their own (the OffloadKey names the group), promoted bit-exact; the groups and
    the window are part of the namespace."""
    engine = engines([disk_tier(tmp_path / "disk")], kv_config=hybrid_kv_cache_config(64, window=32))
    keys = [chunk_key(i, group) for i in range(4) for group in (0, 1)]
    for key in keys:
        engine.store([key])
    assert_promoted_exact(engine, keys[:2])
    assert_promoted_exact(engine, keys[2:4])
    groups = json.loads(engine.tiers[0].config.namespace)["groups"]
    assert [window for _, _, window in groups] == [None, 2]  # vLLM's window of 32 tokens, in 16-token chunks


def test_under_tensor_parallelism_a_chunk_holds_every_ranks_shard(engines, tmp_path):
    """With TP=2 vLLM's CPU tier row holds both ranks' shards side by side: kvtier stores the row as one
    block, and the TP size enters the namespace, so a TP=1 engine on the same directory finds none."""
    keys = [chunk_key(i) for i in range(6)]
    wide = engines([disk_tier(tmp_path / "disk")], tp=2)
    namespace = json.loads(wide.tiers[0].config.namespace)
    assert namespace["parallel"][:2] == [2, 2]  # world size, TP size
    assert wide.chunk_size == 2 * namespace["worker_block_bytes"]  # two 2 KiB shards in one 4 KiB row
    for key in keys:
        wide.store([key])
    assert_promoted_exact(wide, keys[:3])
    wide.shutdown()
    narrow = engines([disk_tier(tmp_path / "disk", reinitialise=True)])
    assert narrow.lookup(keys[:3]) == 0


def test_a_new_engine_on_the_same_directory_finds_the_chunks(engines, tmp_path):
    keys = [chunk_key(i) for i in range(8)]
    first = engines([disk_tier(tmp_path / "disk")])
    for key in keys:
        first.store([key])
    first.shutdown()
    again = engines([disk_tier(tmp_path / "disk")])
    assert_promoted_exact(again, keys[: CPU_CHUNKS - 1])
    assert_promoted_exact(again, keys[CPU_CHUNKS : CPU_CHUNKS + 2])


def test_a_damaged_slot_is_a_miss_and_never_promoted(engines, tmp_path):
    keys = [chunk_key(i) for i in range(6)]
    first = engines([disk_tier(tmp_path / "disk")])
    for key in keys:
        first.store([key])
    size = first.chunk_size
    first.shutdown()
    flip_byte_of(tmp_path / "disk", chunk_bytes(keys[1], size))
    again = engines([disk_tier(tmp_path / "disk")])
    assert again.lookup(keys[:3]) == 1  # chunk 0 is promoted; chunk 1's copy fails its checksum: the prefix ends
    assert counters(again)["failed_load_chunks"] == 1
    assert again.lookup(keys[1:2]) == 0  # and it stays a miss: the slot is dropped, not asked for again
    assert not in_cpu_tier(again, keys[1])  # never promoted: a request recomputes it
    assert_promoted_exact(again, keys[2:4])  # the other chunks are intact


def flip_byte_of(directory: Path, chunk: np.ndarray) -> None:
    """Flip one byte of the chunk's copy in the slab file under ``directory`` (found by its bytes)."""
    slab = max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(slab.read_bytes())
    at = data.find(chunk.tobytes())
    assert at >= 0, "the chunk's bytes are not in the slab"
    with open(slab, "r+b") as f:
        f.seek(at + 100)
        f.write(bytes([data[at + 100] ^ 0x01]))


def test_a_touched_chunk_outlives_an_untouched_one_on_disk(engines, tmp_path):
    engine = engines([disk_tier(tmp_path / "disk", capacity_blocks=4, eviction="lru")], cpu_chunks=2)
    keys = [chunk_key(i) for i in range(5)]
    for key in keys[:4]:
        engine.store([key])
    ctx = engine.request()
    with engine.manager.lock:
        engine.manager.touch(keys[:1], ctx)  # the oldest chunk, used again
    engine.finish(ctx)
    engine.store(keys[4:])  # a full disk tier makes room: its LRU victim is the oldest untouched chunk
    assert [tier_holds(engine, key) for key in keys] == [True, False, True, True, True]


def tier_holds(engine: TieringEngine, key) -> bool:
    """Whether the first secondary tier itself answers HIT (no promotion starts)."""
    ctx = engine.request()
    with engine.manager.lock:
        found = engine.tiers[0].lookup(key, ctx) is LookupResult.HIT
    engine.finish(ctx)
    return found


def test_stored_chunks_are_announced_with_the_tiers_medium_and_locality(engines, tmp_path):
    engine = engines([disk_tier(tmp_path / "disk", enable_kv_events=True)], kv_events=True)
    keys = [chunk_key(i) for i in range(3)]
    for key in keys:
        engine.store([key])
    with engine.manager.lock:
        events = [e for e in engine.manager.take_events() if e.medium is Medium.STORAGE]
    assert [k for e in events for k in e.keys] == keys
    assert all(not e.removed and e.locality is Locality.LOCAL for e in events)


def test_a_chunk_evicted_from_the_tier_is_announced_removed_and_the_view_ends_as_the_tier(engines, tmp_path):
    """A disk tier of 2 chunks (LRU) given 4: the first two leave it, each announced removed after its
    store; replayed in order, the events leave exactly the chunks the tier holds."""
    engine = engines([disk_tier(tmp_path / "disk", capacity_blocks=2, enable_kv_events=True)], kv_events=True)
    keys = [chunk_key(i) for i in range(4)]
    for key in keys:
        engine.store([key])
    with engine.manager.lock:
        events = [e for e in engine.manager.take_events() if e.medium is Medium.STORAGE]
    view: set = set()
    for event in events:
        (view.difference_update if event.removed else view.update)(event.keys)
    assert view == set(keys[2:]) and [tier_holds(engine, key) for key in keys] == [False, False, True, True]
    assert [k for e in events if e.removed for k in e.keys] == keys[:2]
    assert all(e.locality is Locality.LOCAL for e in events)


def test_a_cache_reset_waits_for_the_tiers_jobs_and_keeps_the_disk(engines, tmp_path):
    """vLLM's reset_cache (sleep, weight update) drains every tier's jobs before it frees the CPU tier's
    chunks: no copy may still read one. kvtier's disk keeps what it stored."""
    engine = engines([disk_tier(tmp_path / "disk")], cpu_chunks=16)
    keys = [chunk_key(i) for i in range(12)]
    ctx = engine.request()
    with engine.manager.lock:
        out = engine.manager.prepare_store(keys, ctx)
    for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
        engine.rows[chunk] = chunk_bytes(key, engine.chunk_size)
    with engine.manager.lock:
        engine.manager.complete_store(keys, ctx)  # 12 chunks cascade; the reset comes while they are in flight
        engine.manager.reset_cache()
        assert not engine.manager.has_pending_work()
    engine.finish(ctx)
    with engine.manager.lock:
        engine.manager.on_reset_flushed()
    assert not any(in_cpu_tier(engine, key) for key in keys)
    assert_promoted_exact(engine, keys[:8])


def test_the_tier_takes_its_settings_from_the_entry(engines, tmp_path):
    engine = engines([disk_tier(tmp_path / "disk", capacity_blocks=None, capacity="1MiB", compression="lz4")])
    tier = engine.tiers[0].stack.tiers[0]
    assert tier.medium == "disk" and engine.tiers[0].config.tiers[0].compression == "lz4"
    assert engine.chunk_size == 4096 and tier.capacity == 1024 * 1024 // (4096 + 4096)  # a slot: header + room
    keys = [chunk_key(i) for i in range(6)]
    for key in keys:  # random bytes do not compress: the tier stores none, and says so
        engine.store([key])
    assert counters(engine) == {"stored_chunks": 0, "dropped_chunks": 6, "failed_load_chunks": 0}
    assert engine.lookup(keys[:1]) == 0


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"capacity_blocks": 8, "bogus": 1}, "unknown key 'bogus'"),
        ({"capacity": "lots"}, "capacity: 'lots' is not a size"),
        ({"capacity": "1KiB"}, "capacity: 1KiB (1024 bytes) holds no block"),
        ({"capacity_blocks": 8, "compression": "zip"}, "compression: 'zip' is not allowed"),
        ({"capacity_blocks": 8, "medium": "host"}, "medium: 'host': the type sets the medium"),
        ({"capacity": "lots", "compression": "zip"}, "capacity: 'lots' is not a size"),
        ({"capacity_blocks": 8, "staging_blocks": 4}, "unknown key 'staging_blocks'"),
        ({"capacity_blocks": 8, "enable_kv_events": "yes"}, "enable_kv_events: Input should be a valid boolean"),
    ],
)
def test_a_wrong_entry_stops_vllms_start_naming_the_key(engines, tmp_path, entry, message):
    with pytest.raises(ConfigError) as raised:
        engines([kvtier_tier("KVTierDisk", path=str(tmp_path / "disk"), **entry)])
    assert str(raised.value).startswith("secondary_tiers entry 'KVTierDisk': ")
    assert message in str(raised.value) and "\n" not in str(raised.value)  # one line, naming the key


def test_a_remote_entry_needs_its_backend(engines, tmp_path):
    with pytest.raises(ConfigError, match="missing key 'redis'"):
        engines([kvtier_tier("KVTierRemote", backend="redis")])


def test_the_namespace_keeps_other_engines_chunks_apart(engines, tmp_path):
    """Another kvtier ``namespace`` (as another model, dtype or chunk geometry would give) finds none of
    the first engine's chunks on the same disk, and the config info shows the two digests differ."""
    keys = [chunk_key(i) for i in range(3)]
    first = engines([disk_tier(tmp_path / "disk", namespace="a")])
    for key in keys:
        first.store([key])
    digest = first.tiers[0].config_info()["kvtier_namespace"]
    first.shutdown()
    other = engines([disk_tier(tmp_path / "disk", namespace="b", reinitialise=True)])
    assert other.tiers[0].config_info()["kvtier_namespace"] != digest
    assert other.lookup(keys) == 0


# --- the remote tier -------------------------------------------------------------------------------


@pytest.fixture
def redis(tmp_path):
    with redis_server(tmp_path / "redis") as server:
        yield server


def test_a_second_engine_promotes_the_first_ones_chunks_from_the_store(engines, redis):
    keys = [chunk_key(i) for i in range(6)]
    first = engines([remote_tier(redis)])
    for key in keys:
        first.store([key])
    first.tiers[0].stack.wait_idle()  # the copies from the staging tier on to the store
    assert len(redis.client().keys("*")) == len(keys)
    second = engines([remote_tier(redis)])
    assert_promoted_exact(second, keys[:3])
    assert counters(second)["failed_load_chunks"] == 0


def test_a_mooncake_store_serves_a_second_engine(engines):
    keys = [chunk_key(i) for i in range(4)]
    with MooncakeMaster() as master, SegmentOwner(master, "64MB"):
        entry = kvtier_tier(
            "KVTierRemote",
            backend="mooncake",
            timeout=TIMEOUT,
            mooncake={"master": master.address, "metadata_server": master.metadata_url},
        )
        first = engines([entry])
        for key in keys:
            first.store([key])
        first.tiers[0].stack.wait_idle()
        second = engines([entry])
        assert_promoted_exact(second, keys[:3])
        first.shutdown()
        second.shutdown()


def test_records_without_the_right_mac_are_misses(engines, redis, monkeypatch):
    monkeypatch.setenv("KVTIER_TEST_MAC", "a" * 32)
    keys = [chunk_key(i) for i in range(2)]
    first = engines([remote_tier(redis, auth_key_env="KVTIER_TEST_MAC")])
    for key in keys:
        first.store([key])
    first.tiers[0].stack.wait_idle()
    monkeypatch.setenv("KVTIER_TEST_MAC", "b" * 32)  # another tenant's secret: its records do not verify
    second = engines([remote_tier(redis, auth_key_env="KVTIER_TEST_MAC")])
    assert second.lookup(keys) == 0
    assert counters(second)["failed_load_chunks"] >= 1
    assert not in_cpu_tier(second, keys[0])


def test_a_stopped_store_gives_misses_within_the_timeout_and_never_blocks_a_step(engines, redis):
    keys = [chunk_key(i) for i in range(3)]
    engine = engines([remote_tier(redis)])
    redis.stop()
    started = time.monotonic()
    assert engine.lookup(keys, timeout=10 * TIMEOUT) == 0
    assert time.monotonic() - started < 5 * TIMEOUT
    slowest = 0.0
    for key in keys:  # stores cascade while the server hangs: each step returns at once
        ctx = engine.request()
        with engine.manager.lock:
            out = engine.manager.prepare_store([key], ctx)
        assert out is not None
        began = time.monotonic()
        with engine.manager.lock:
            engine.manager.complete_store([key], ctx)
        engine.finish(ctx)
        engine.step()
        slowest = max(slowest, time.monotonic() - began)
    assert slowest < 0.2
    engine.settle(timeout=20 * TIMEOUT)  # every cascade job ends (its copy to the store timed out)
    redis.cont()


def test_backpressure_drops_stores(engines, tmp_path):
    """vLLM's EMA detector, set to find any disk write too slow once it has seen two: the cascades after
    them are dropped (never submitted), and the chunks they carried are gone once the CPU tier evicts
    them, while the two stored before are promoted from disk."""
    backpressure = {
        "backpressure_cls": "EMABackpressureDetector",
        "high_water_s": 1e-9,
        "low_water_s": 1e-10,
        "warmup_completions": 1,
        "cooldown_s": 60.0,
    }
    engine = engines([disk_tier(tmp_path / "disk", backpressure=backpressure)])
    keys = [chunk_key(i) for i in range(6)]
    engine.store(keys[:1])
    engine.store(keys[1:2])
    assert engine.tiers[0].bp_detector.is_under_pressure()
    for key in keys[2:]:
        engine.store([key])
    assert counters(engine)["stored_chunks"] == 2
    assert engine.lookup(keys[:2]) == 2  # left the CPU tier (4 chunks), promoted from disk
    assert engine.lookup(keys[2:3]) == 0  # its cascade was dropped: gone with the CPU tier's eviction


@pytest.fixture
def node(tmp_path):
    with node_daemon(tmp_path / "node", capacity="16MiB", block_bytes="2MiB", max_held=1.0) as daemon:
        yield daemon


def node_tier(daemon, **settings) -> dict:
    return kvtier_tier("KVTierNode", socket=daemon.socket, timeout=TIMEOUT, **settings)


def test_a_second_engine_promotes_the_first_ones_chunks_from_the_node_daemon(engines, node):
    keys = [chunk_key(i) for i in range(6)]
    first = engines([node_tier(node)])
    assert [t.medium for t in first.tiers[0].stack.tiers] == ["node"]  # no staging: copies end when they end
    for key in keys:
        first.store([key])
    first.tiers[0].stack.wait_idle()
    node.wait_stores(len(keys))
    second = engines([node_tier(node)])
    assert_promoted_exact(second, keys[:3])
    assert counters(second)["failed_load_chunks"] == 0
    assert second.tiers[0].locality is Locality.LOCAL


def test_a_stopped_node_daemon_gives_misses_within_the_timeout(engines, node):
    keys = [chunk_key(i) for i in range(3)]
    engine = engines([node_tier(node)])
    node.pause()
    try:
        started = time.monotonic()
        assert engine.lookup(keys, timeout=10 * TIMEOUT) == 0
        assert time.monotonic() - started < 5 * TIMEOUT
    finally:
        node.resume()
