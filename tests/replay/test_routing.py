"""Prefix-aware routers (``kvtier.replay.routing``) fed by the engines' KV events, on figures worked out by
hand: two engines, each a GPU tier of 2 blocks over a host tier of 8 (LRU, write-back).

r0 [1, 2] and r1 [3, 4] find nothing anywhere: engine 0, then engine 1 (the fewer requests so far);
r2 [5, 6] likewise to engine 0, whose GPU tier demotes [1, 2] to its host tier to make room. r3 [1, 2, 7]:
a router that sees only GPU tiers finds [1, 2] nowhere and sends it to engine 1 (a miss); one that sees
every tier finds them in engine 0's host tier and sends it there (a hit of 2, loaded bit-exact).
"""

from __future__ import annotations

import pytest

from kvtier.builder import build_stack
from kvtier.core.config import load_config
from kvtier.replay.routing import PrefixRouter, tier_weight
from kvtier.replay.stack import replay_through_engines
from kvtier.replay.trace import Request

TRACE = [[1, 2], [3, 4], [5, 6], [1, 2, 7]]


def stacks(engines: int = 2) -> list:
    tiers = [
        {"medium": "gpu", "capacity_blocks": 2, "eviction": "lru"},
        {"medium": "host", "capacity_blocks": 8, "eviction": "lru"},
    ]
    return [build_stack(load_config({"block_bytes": 4096, "tiers": tiers})) for _ in range(engines)]


def replay(sees: str, trace=TRACE) -> tuple[list, PrefixRouter]:
    engines = stacks()
    try:
        router = PrefixRouter(engines, sees, recompute_s_per_block=0.05)
        requests = [Request(0, 0, 0, tuple(ids)) for ids in trace]
        return replay_through_engines(requests, engines, router, block_tokens=512), router
    finally:
        for stack in engines:
            stack.close()


def test_a_router_that_sees_every_tier_finds_a_prefix_demoted_out_of_gpu_memory():
    results, router = replay("every tier")
    assert [r.requests for r in results] == [3, 1]
    assert [(r.hits, r.verified_blocks, r.corrupt_blocks) for r in results] == [(2, 2, 0), (0, 0, 0)]
    assert results[0].tiers["host"]["hits"] == 2
    assert router.routed == [3, 1]


def test_a_router_that_sees_only_gpu_memory_misses_it():
    results, router = replay("gpu")
    assert [r.requests for r in results] == [2, 2]
    assert sum(r.hits for r in results) == 0
    assert set(router.views[0]) == {"gpu"} and len(router.views[0]["gpu"]) == 2  # (what engine 0's GPU holds)


def test_an_engine_past_the_bound_on_load_is_passed_over_whatever_it_holds():
    """r4 [1, 2, 8] goes to engine 0 too, which holds [1, 2]: it had taken 3 of 4 requests, within 1.25 x
    the mean counting the new request (a bound of 3.125); for r5 [1, 2, 9] it had taken 4 of 5, past the
    bound of 3.75: engine 1, a miss."""
    results, router = replay("every tier", TRACE + [[1, 2, 8], [1, 2, 9]])
    assert router.routed == [4, 2] and [r.requests for r in results] == [4, 2]
    assert [r.hits for r in results] == [4, 0]


def test_a_tier_is_worth_what_its_load_saves_of_the_recompute():
    assert tier_weight(None, 0.05) == 1.0
    assert tier_weight(0.01, 0.05) == pytest.approx(0.8)
    assert tier_weight(0.2, 0.05) == 0.0  # (slower than recomputing: worth nothing, never negative)


def test_a_prefix_router_sees_the_gpu_tier_or_every_tier():
    with pytest.raises(ValueError, match="sees the gpu tier or every tier"):
        PrefixRouter([], "host", 0.05)
