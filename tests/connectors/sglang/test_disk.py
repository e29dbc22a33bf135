"""kvtier's SGLang storage backend over a disk tier, on SGLang's real host pools (MHA and MLA, every layout
with strided pages), created through SGLang's own storage factory.

What it shows: pages round-trip bit-exact by the zero-copy path and by the generic one, each serving
what the other stored, without touching any other page of the pool; ``batch_exists`` counts leading
hits only; a restart over the same directory finds the pages; a damaged slot is a miss and never
loaded; another model, dtype, page geometry or TP rank misses; SGLang's keys never reach the disk;
bad host indices fail the call, not the engine; the counters SGLang and Prometheus read add up.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from prometheus_client import REGISTRY

from helpers.sglang_pools import PAGE, fill, indices, keys, mha_host_pool, mla_host_pool, page_bytes

LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]


def disk(tmp_path, **more) -> dict:
    return {"tiers": [{"medium": "disk", "path": str(tmp_path / "kv"), "capacity": "4MiB", **more}]}


def stored_pages(backend, pool, names: list[str], pages: range, seed: int = 1) -> list[torch.Tensor]:
    """Random pages stored under ``names``; their bytes. The pool is zeroed afterwards (poisoned)."""
    fill(pool, seed)
    before = [page_bytes(pool, p) for p in pages]
    assert backend.batch_set_v1(names, indices(pages)) == [True] * len(names)
    pool.kv_buffer.view(torch.uint8).zero_()
    return before


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_round_trip_bit_exact_into_other_pages_and_nothing_else(tmp_path, backends, layout):
    pool = mha_host_pool(layout)
    backend = backends(pool, disk(tmp_path))
    names = keys(8)
    before = stored_pages(backend, pool, names, range(2, 10))
    assert backend.batch_exists(names + keys(2, "x")) == 8
    assert backend.batch_get_v1(names, indices(range(40, 48))) == [True] * 8
    for page, expected in zip(range(40, 48), before, strict=True):
        assert torch.equal(page_bytes(pool, page), expected)
    others = [p for p in range(pool.size // PAGE) if not 40 <= p < 48]
    assert all(not page_bytes(pool, p).any() for p in others)  # no byte written outside the loaded pages


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_mla_pages_round_trip(tmp_path, backends, layout):
    pool = mla_host_pool(layout)
    backend = backends(pool, disk(tmp_path), mla=True)
    before = stored_pages(backend, pool, keys(4), range(0, 4))
    assert backend.batch_get_v1(keys(4), indices(range(10, 14))) == [True] * 4
    assert all(torch.equal(page_bytes(pool, p), b) for p, b in zip(range(10, 14), before, strict=True))


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_the_generic_and_the_zero_copy_paths_serve_each_other(tmp_path, backends, layout):
    pool = mha_host_pool(layout)
    generic = backends(pool, disk(tmp_path), interface_v1=0)
    fill(pool, 2)
    flat = [pool.get_data_page(p * PAGE, flat=True) for p in range(4)]  # what SGLang's generic store passes
    assert generic.batch_set(keys(4), flat) is True
    generic.close()
    pool.kv_buffer.view(torch.uint8).zero_()
    zero_copy = backends(pool, disk(tmp_path))
    assert zero_copy.batch_get_v1(keys(4), indices(range(20, 24))) == [True] * 4
    assert all(torch.equal(page_bytes(pool, 20 + i), f.view(torch.uint8)) for i, f in enumerate(flat))
    dummies = [pool.get_dummy_flat_data_page() for _ in range(5)]
    got = zero_copy.batch_get(keys(4) + ["absent"], dummies)
    assert got[4] is None and all(g is d for g, d in zip(got[:4], dummies, strict=False))
    assert all(torch.equal(g.view(torch.uint8), f.view(torch.uint8)) for g, f in zip(got[:4], flat, strict=False))


def test_a_hit_stops_at_the_first_missing_page(tmp_path, backends):
    pool = mha_host_pool()
    backend = backends(pool, disk(tmp_path))
    names = keys(6)
    stored_pages(backend, pool, names[:2] + names[3:], range(0, 5))  # page 2 of the chain is missing
    assert backend.batch_exists(names) == 2
    assert backend.batch_get_v1(names, indices(range(10, 16))) == [True, True] + [False] * 4


def test_a_restart_over_the_same_directory_finds_the_pages(tmp_path, backends):
    pool = mha_host_pool()
    first = backends(pool, disk(tmp_path))
    before = stored_pages(first, pool, keys(5), range(0, 5))
    first.close()
    again = backends(pool, disk(tmp_path))
    assert again.batch_exists(keys(5)) == 5
    assert again.batch_get_v1(keys(5), indices(range(30, 35))) == [True] * 5
    assert all(torch.equal(page_bytes(pool, 30 + i), b) for i, b in enumerate(before))


def test_a_damaged_slot_is_a_miss_and_is_never_loaded(tmp_path, backends):
    pool = mha_host_pool()
    first = backends(pool, disk(tmp_path))
    before = stored_pages(first, pool, keys(4), range(0, 4))
    first.close()
    slab = next((tmp_path / "kv").rglob("slab.kvt"))
    data = bytearray(slab.read_bytes())
    for block in before[1:2]:  # flip one byte inside page 1's payload wherever it lies
        at = bytes(data).find(block.numpy().tobytes())
        assert at > 0
        data[at + 7] ^= 0xFF
    slab.write_bytes(bytes(data))
    again = backends(pool, disk(tmp_path))
    result = again.batch_get_v1(keys(4), indices(range(30, 34)))
    assert result[0] and not result[1]
    assert torch.equal(page_bytes(pool, 30), before[0])
    assert again.batch_exists(keys(4)) == 1  # dropped once found damaged: a miss from now on


@pytest.mark.parametrize(
    "other",
    [
        {"model": "another-model"},
        {"tp_rank": 1, "tp_size": 2},
        {"dtype": torch.float16},
        {"heads": 4},
        {"layout": "page_first"},
    ],
)
def test_another_model_dtype_geometry_rank_or_layout_misses(tmp_path, backends, other):
    pool = mha_host_pool()
    first = backends(pool, disk(tmp_path))
    stored_pages(first, pool, keys(3), range(0, 3))
    first.close()
    pool_options = {k: other[k] for k in ("dtype", "heads", "layout") if k in other}
    backend_options = {k: other[k] for k in ("model", "tp_rank", "tp_size") if k in other}
    other_pool = mha_host_pool(**pool_options)
    if "tp_rank" in other:  # another rank keeps a slab of its own: it misses even over a copy of rank 0's
        shutil.copytree(tmp_path / "kv" / "rank0", tmp_path / "kv" / "rank1")
    backend = backends(other_pool, disk(tmp_path), **backend_options)
    assert backend.batch_exists(keys(3)) == 0
    assert backend.batch_get_v1(keys(3), indices(range(0, 3))) == [False] * 3


def test_two_tp_ranks_keep_separate_shards(tmp_path, backends):
    pool0, pool1 = mha_host_pool(), mha_host_pool()
    rank0 = backends(pool0, disk(tmp_path), tp_rank=0, tp_size=2)
    rank1 = backends(pool1, disk(tmp_path), tp_rank=1, tp_size=2)
    shard0 = stored_pages(rank0, pool0, keys(2), range(0, 2), seed=3)
    shard1 = stored_pages(rank1, pool1, keys(2), range(0, 2), seed=4)
    assert sorted(p.name for p in (tmp_path / "kv").iterdir()) == ["rank0", "rank1"]
    assert rank0.batch_get_v1(keys(2), indices(range(5, 7))) == [True, True]
    assert rank1.batch_get_v1(keys(2), indices(range(5, 7))) == [True, True]
    assert torch.equal(page_bytes(pool0, 5), shard0[0]) and torch.equal(page_bytes(pool1, 5), shard1[0])
    assert not torch.equal(shard0[0], shard1[0])


def test_sglang_keys_never_reach_the_disk(tmp_path, backends):
    pool = mha_host_pool()
    backend = backends(pool, disk(tmp_path))
    names = [os.urandom(32).hex() for _ in range(3)]
    stored_pages(backend, pool, names, range(0, 3))
    backend.close()
    slab = next((tmp_path / "kv").rglob("slab.kvt")).read_bytes()
    for name in names:
        assert name.encode() not in slab and bytes.fromhex(name) not in slab
    assert all(len(p.name) < 16 for p in (tmp_path / "kv").rglob("*"))  # no file named after a key


@pytest.mark.parametrize(
    "bad",
    [torch.arange(1, 5), torch.arange(0, 6), torch.tensor([0, 1, 3, 2]), torch.arange(10_000 * PAGE, 10_001 * PAGE)],
)
def test_indices_that_are_not_whole_pages_of_the_pool_fail_the_call_only(tmp_path, backends, bad):
    pool = mha_host_pool()
    backend = backends(pool, disk(tmp_path))
    stored_pages(backend, pool, keys(1), range(0, 1))
    n = max(1, bad.numel() // PAGE)
    assert backend.batch_set_v1(keys(n, "y"), bad) == [False] * n
    assert backend.batch_get_v1(keys(n), bad) == [False] * n
    assert not pool.kv_buffer.view(torch.uint8).any()


def test_block_tokens_other_than_the_page_size_is_refused(tmp_path):
    from helpers.sglang_pools import open_backend
    from kvtier.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^block_tokens: 16 differs from SGLang's page size 4"):
        open_backend(mha_host_pool(), {**disk(tmp_path), "block_tokens": 16})


def test_counters_add_up_for_sglang_and_prometheus(tmp_path, backends):
    pool = mha_host_pool()
    backend = backends(pool, disk(tmp_path), tp_rank=0)

    def counter(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(f"sglang:kvtier_{name}_total", {"tp_rank": "0", **labels}) or 0.0

    names = ("stored_blocks", "failed_load_blocks", "load_bytes", "store_bytes")
    hits, before = counter("hit_blocks", tier="disk"), {name: counter(name) for name in names}
    backend.get_stats()  # empties the per-call figures
    stored_pages(backend, pool, keys(6), range(0, 6))
    assert backend.batch_get_v1(keys(7), indices(range(10, 17))) == [True] * 6 + [False]
    stats = backend.get_stats()
    assert (stats.backup_pgs, stats.prefetch_pgs) == ([6], [6])
    assert all(b > 0 for b in stats.prefetch_bandwidth + stats.backup_bandwidth)
    block = backend.pages.layout.block_bytes
    assert counter("hit_blocks", tier="disk") - hits == 6
    assert {name: counter(name) - before[name] for name in names} == {
        "stored_blocks": 6,
        "failed_load_blocks": 0,
        "load_bytes": 6 * block,
        "store_bytes": 6 * block,
    }


def test_a_lookup_that_misses_counts_its_reason_on_prometheus(tmp_path, backends):
    """``batch_exists`` is SGLang's lookup: one that ends before its last page counts once, by why its first
    missing page is not there, in total and for the tier (``sglang:kvtier_miss_reason_total``)."""
    pool = mha_host_pool()  # 128 host pages
    backend = backends(
        pool,
        {"tiers": [{"medium": "disk", "path": str(tmp_path / "kv"), "capacity_blocks": 128, "eviction": "lru"}]},
        tp_rank=0,
    )

    def counted(reason: str, tier: str) -> float:
        labels = {"tp_rank": "0", "reason": reason, "tier": tier}
        return REGISTRY.get_sample_value("sglang:kvtier_miss_reason_total", labels) or 0.0

    rows = [(reason, tier) for reason in ("evicted", "never_stored") for tier in ("all", "disk")]
    before = {row: counted(*row) for row in rows}
    fill(pool, 3)
    assert backend.batch_set_v1(keys(128), indices(range(128))) == [True] * 128
    assert backend.batch_set_v1(keys(8, "y"), indices(range(8))) == [True] * 8  # evicts the 8 oldest pages
    assert backend.batch_exists(keys(8, "y")) == 8  # a full hit: no miss
    assert backend.batch_exists(keys(16)) == 0  # page 0 was evicted
    assert backend.batch_exists(keys(8, "y") + keys(2, "z")) == 8  # page "z0" was never stored
    assert {row: counted(*row) - before[row] for row in rows} == {
        ("evicted", "all"): 1,
        ("evicted", "disk"): 1,
        ("never_stored", "all"): 1,
        ("never_stored", "disk"): 1,
    }
