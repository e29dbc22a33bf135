"""Replay through a real tier stack (kvtier.replay.stack).

Invariants checked:
- on a hand-made trace through GPU -> host and host -> disk stacks (LRU, write-back, no watermark),
  the hits per tier, stores, demotions, evictions and bytes in/out are exactly the hand-computed ones;
- with one tier, no watermark and LRU the real replay's hits and evictions equal the metadata
  replay's, on random prefix-chained traces whose requests fit the tier;
- every hit is compared with the bytes stored for its id: a block damaged in a tier's memory is
  counted corrupt, ends the request's prefix, and is not a hit;
- prefill tokens saved are capped by the prompt length; block contents differ per id and per word;
- a stack that already holds blocks is refused; nothing stays pinned after a replay (close() checks);
- load bandwidth is timed per tier on the loads one tier served alone: their bytes exactly, a load
  that read from two tiers left out.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from helpers.replay_helpers import BB, TRACE, chained_traces, requests_from_ids
from kvtier.builder import build_stack
from kvtier.core.config import load_config
from kvtier.core.tier import BlockState
from kvtier.policies import LRUPolicy
from kvtier.replay.cache import replay
from kvtier.replay.stack import block_content, block_key, prefill_tokens_saved, replay_through_stack
from kvtier.replay.trace import Request


def two_tier(upper: dict, lower: dict):
    """Both tiers evict in LRU order, as the hand-computed traces here assume."""
    tiers = [{**upper, "eviction": "lru"}, {**lower, "eviction": "lru"}]
    return build_stack(load_config({"block_bytes": BB, "tiers": tiers, "placement": "write_back"}))


def check_hand_trace(stack, upper: str, lower: str) -> None:
    # Upper tier U (2 blocks, LRU), lower tier L (4 blocks, LRU); a hit is read from where it is and
    # not promoted; a store goes into U and pushes U's least recently used block down into L.
    #  [1,2]   miss, miss                      U {1,2}
    #  [1,3]   1 from U; 3 pushes 2 down        U {1,3}  L {2}
    #  [2,4]   2 from L; 4 pushes 1 down        U {3,4}  L {2,1}
    #  [1,2,5] 1,2 from L; 5 pushes 3 down      U {4,5}  L {2,1,3}
    #  [4,5,6] 4,5 from U; 6 pushes 4 down      U {5,6}  L {2,1,3,4}
    #  [3,7]   3 from L; 7 pushes 5 down, L is full: its LRU block 1 leaves the stack
    #                                           U {6,7}  L {2,3,4,5}
    #  [1,2]   1 missing: no hit; 2 (in L) is referenced (pinned); 1 pushes 6 down, L drops 4
    #                                           U {7,1}  L {2,3,5,6}
    # Hits: U 1+2 = 3, L 1+2+1 = 4; 8 blocks stored, 6 demoted, 2 evicted from L.
    result = replay_through_stack(requests_from_ids(TRACE), stack, block_tokens=16)
    assert (result.hits, result.references, result.requests) == (7, 16, 7)
    assert result.verified_blocks == 7 and result.corrupt_blocks == 0 and result.failed_blocks == 0
    assert result.stored_blocks == 8
    assert result.prefill_tokens_saved == 7 * 16 and result.prefill_tokens == 16 * 16
    u, lo = result.tiers[upper], result.tiers[lower]
    assert (u["hits"], u["committed"], u["demoted"], u["evicted"], u["used"]) == (3, 8, 6, 6, 2)
    assert (lo["hits"], lo["committed"], lo["demoted"], lo["evicted"], lo["used"]) == (4, 6, 0, 2, 4)
    assert u["bytes_in"] == 8 * BB and u["bytes_out"] == (6 + 3) * BB
    assert lo["bytes_in"] == 6 * BB and lo["bytes_out"] == 4 * BB
    assert result.occupancy[-1] == (6, {upper: 2, lower: 4})
    # Every load here reads one tier: U serves 1 then 4,5; L serves 2, then 1,2, then 3.
    assert result.loads.bytes_loaded == {upper: 3 * BB, lower: 4 * BB}
    assert set(result.loads.seconds) == set(result.loads.gbps()) == {upper, lower}
    for name, seconds in result.loads.seconds.items():
        assert seconds > 0 and result.loads.gbps()[name] == result.loads.bytes_loaded[name] / seconds / 1e9
    held = [[k for k in range(1, 8) if t.state(block_key(k)) is BlockState.READY] for t in stack.tiers]
    assert held == [[1, 7], [2, 3, 5, 6]]
    stack.close()


def test_gpu_over_host_by_hand():
    check_hand_trace(
        two_tier({"medium": "gpu", "capacity_blocks": 2}, {"medium": "host", "capacity_blocks": 4}), "gpu", "host"
    )


def test_host_over_disk_by_hand(tmp_path):
    stack = two_tier(
        {"medium": "host", "capacity_blocks": 2},
        {"medium": "disk", "capacity_blocks": 4, "path": str(tmp_path / "disk")},
    )
    check_hand_trace(stack, "host", "disk")


@settings(max_examples=25, deadline=None)
@given(chains=chained_traces(max_requests=20, max_new=4), capacity=st.integers(4, 12))
def test_one_tier_lru_equals_the_metadata_replay(chains, capacity):
    # Only requests that fit: a longer one may evict its own just-loaded prefix in the real stack
    # (loads unpin when done), where the metadata replay protects every block of the request.
    assume(max(len(c) for c in chains) <= capacity)
    trace = requests_from_ids(chains)
    stack = build_stack(
        load_config({"block_bytes": BB, "tiers": [{"medium": "host", "capacity_blocks": capacity, "eviction": "lru"}]})
    )
    try:
        real = replay_through_stack(trace, stack)
    finally:
        stack.close()
    expected = replay(trace, capacity, LRUPolicy())
    assert (real.hits, real.references) == (expected.hits, expected.references)
    assert real.tiers["host"]["evicted"] == expected.evictions
    assert real.verified_blocks == real.hits and real.corrupt_blocks == 0


def test_a_load_from_two_tiers_is_not_timed():
    # U (2 blocks) over L: [1,2] fills U; [3] pushes 1 down to L; [1,2] reads 1 from L and 2 from U in
    # one load (left out of both tiers' timing); [2] then reads 2 from U alone.
    stack = two_tier({"medium": "gpu", "capacity_blocks": 2}, {"medium": "host", "capacity_blocks": 4})
    try:
        result = replay_through_stack(requests_from_ids([[1, 2], [3], [1, 2], [2]]), stack)
    finally:
        stack.close()
    assert (result.tiers["gpu"]["hits"], result.tiers["host"]["hits"]) == (2, 1)
    assert result.loads.bytes_loaded == {"gpu": BB} and set(result.loads.gbps()) == {"gpu"}


def test_a_stack_that_holds_blocks_is_refused():
    stack = build_stack(load_config({"block_bytes": BB, "tiers": [{"medium": "host", "capacity_blocks": 8}]}))
    replay_through_stack(requests_from_ids([[1, 2, 3]]), stack)
    with pytest.raises(ValueError, match="needs an empty stack.*'host': 3"):
        replay_through_stack(requests_from_ids([[1, 2, 3]]), stack)
    stack.close()


def test_damage_during_a_replay_is_caught(blockio):
    # Damage block 2 right after the first request by wrapping the progress callback.
    stack = build_stack(load_config({"block_bytes": BB, "tiers": [{"medium": "host", "capacity_blocks": 8}]}))
    host = stack.tiers[0]

    def damage(index: int) -> None:
        if index == 0:
            slot = host.slots([block_key(2)])[0]
            data = blockio.read(host.storage, slot)
            data[-1] ^= 0x80
            blockio.write(host.storage, slot, data)

    result = replay_through_stack(requests_from_ids([[1, 2, 3], [1, 2, 3]]), stack, on_request=damage)
    assert result.corrupt_blocks == 1
    assert result.hits == 1 and result.verified_blocks == 1  # block 1 only: the prefix ends at the damage
    stack.close()


def test_block_content_and_tokens_saved():
    a, b = block_content(7, 4096), block_content(8, 4096)
    assert a.dtype == np.uint8 and a.size == 4096 and np.array_equal(a, block_content(7, 4096))
    assert not np.any(a.view(np.uint64) == b.view(np.uint64)), "no word equal between two blocks"
    assert block_content(2**64 - 1, 12).size == 12
    assert block_key(5) == (5).to_bytes(8, "little")
    request = Request(0, 1100, 1, (1, 2, 3))  # 2 full 512-token blocks and a 76-token tail
    assert prefill_tokens_saved(request, 2, 512) == 1024
    assert prefill_tokens_saved(request, 3, 512) == 1100
    assert prefill_tokens_saved(Request(0, 0, 0, (1, 2)), 2, 512) == 1024
