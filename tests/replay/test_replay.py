"""Trace replay and the offline optimum.

Invariants checked:
- a request hits the longest resident prefix of its blocks and nothing else (a resident block after
  a missing one is referenced but not a hit); every block is referenced; a request never evicts
  its own blocks; a request larger than the cache keeps only its leading blocks; a block after a
  declined one is asked about but not stored (as the planner stores only the admitted prefix);
- hand-computed hit counts on small traces for LRU, ARC, S3-FIFO and Belady;
- Belady equals an exhaustive search over every eviction and bypass choice on tiny traces, and is
  at least as good as every registered policy on random prefix-chained traces;
- a policy that breaks its contract (returns a protected block) is caught;
- load_trace reads the Mooncake format, skips blank lines, and names the line of a bad one;
- on the shared Mooncake trace, LRU and Belady reproduce the reference figures of the data README
  within 0.005 (skipped when the trace is not there).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from helpers.replay_helpers import chained_traces, requests_from_ids
from kvtier.core.errors import StateError
from kvtier.policies import EVICTION_POLICIES, ARCPolicy, LRUPolicy, PrefixS3FIFOPolicy, S3FIFOPolicy
from kvtier.policies.base import EvictionPolicy
from kvtier.replay.cache import ReplayResult, belady, replay
from kvtier.replay.trace import load_trace

TRACE = Path(__file__).resolve().parents[3] / "shared" / "data" / "mooncake_synthetic_trace.jsonl"


# --- hand-made traces --------------------------------------------------------------------------


def test_lru_and_belady_by_hand():
    # capacity 3.  LRU:  [1,2] miss miss -> {1,2};  [1,3] hit, 3 in -> 2,1,3;  [4] evicts 2 -> 1,3,4;
    # [1,2] hit 1, 2 evicts 3 -> 4,1,2;  [1,3] hit 1, 3 evicts 4.  3 hits.
    # Belady: same until [4], which is never used again and is not cached; then [1,2] and [1,3]
    # hit fully.  5 hits.
    trace = requests_from_ids([[1, 2], [1, 3], [4], [1, 2], [1, 3]])
    assert replay(trace, 3, LRUPolicy()) == ReplayResult(hits=3, references=9, evictions=3)
    assert belady(trace, 3) == ReplayResult(hits=5, references=9, evictions=0)


def test_scan_resistance_by_hand():
    # capacity 3; one block per request.
    # LRU: hits at [1] (2nd) and the last [2]; the read 1 is pushed out by the scan 2, 3, 4.
    # ARC: 1 is read once so sits in T2; the scan churns T1; the 1 comes back as a hit, 2 is a
    #      ghost hit (B1) at its return and lands in T2, and then T2's oldest (1) makes room for 5.
    # S3-FIFO: 1 is read while in the small queue, so it moves to main at the first eviction
    #      while 2 leaves (ghost); 2's return goes to main; 3 and 4 leave from small.
    # S3-FIFO, prefix-ordered: no other call separates the inserts of [2] and [3], so they form
    #      one batch and queue as 3, 2: 3 leaves instead of 2, and [2] hits on its first return too.
    # Belady: 4 and 5 are never used again and are not cached; every other return hits.
    trace = requests_from_ids([[1], [1], [2], [3], [4], [1], [2], [5], [2]])
    assert replay(trace, 3, LRUPolicy()).hits == 2
    assert replay(trace, 3, ARCPolicy()).hits == 3
    assert replay(trace, 3, ARCPolicy(3)).hits == 3
    assert replay(trace, 3, S3FIFOPolicy()).hits == 3
    assert replay(trace, 3, PrefixS3FIFOPolicy()).hits == 4
    assert belady(trace, 3).hits == 4


def test_only_the_leading_resident_blocks_are_hits():
    # [1,2,3] fills the cache; [4] evicts 1 (LRU); then [1,2,3]: 1 is missing, so 2 and 3 are
    # resident but not hits; the request still references (touches) them.
    trace = requests_from_ids([[1, 2, 3], [4], [1, 2, 3]])
    result = replay(trace, 3, LRUPolicy())
    assert (result.hits, result.references) == (0, 7)
    assert result.hit_ratio == 0.0
    assert belady(trace, 3).hits == 3  # 4 is bypassed


def test_a_request_never_evicts_its_own_blocks_and_keeps_its_head_when_too_large():
    trace = requests_from_ids([[1, 2, 3, 4, 5], [1, 2, 3]])
    for policy in (LRUPolicy(), ARCPolicy(), S3FIFOPolicy(), PrefixS3FIFOPolicy()):
        result = replay(trace, 3, policy)
        assert result.hits == 3 and result.evictions == 0 and len(policy) == 3
    assert belady(trace, 3).hits == 3
    assert replay(trace, 0, LRUPolicy()).hits == 0 and belady(trace, 0).hits == 0


def test_only_the_missing_blocks_before_the_first_declined_one_are_stored():
    # Capacity 10, nothing resident at first. The policy declines 3: it is asked about 1 to 5 (all
    # missing), and only 1 and 2 are stored, as the planner stores only the admitted prefix. Then
    # [1, 2, 6, 3, 7]: 1 and 2 hit, 6 is admitted and stored, 3 declined, 7 asked but not stored.
    class DeclinesThree(LRUPolicy):
        def __init__(self):
            super().__init__()
            self.asked = []

        def admit(self, key):
            self.asked.append(key)
            return key != 3

    policy = DeclinesThree()
    result = replay(requests_from_ids([[1, 2, 3, 4, 5], [1, 2, 6, 3, 7]]), 10, policy)
    assert policy.asked == [1, 2, 3, 4, 5, 6, 3, 7]
    assert [key for key in range(1, 8) if key in policy] == [1, 2, 6]
    assert (result.hits, result.references) == (2, 10)


def test_a_policy_that_evicts_a_protected_block_is_caught():
    class MostRecent(LRUPolicy):  # evicts the newest keys, protected or not
        def evict(self, n, protected):
            victims = list(self._order.oldest_first(0))[-n:]
            for k in victims:
                self.remove(k)
            return victims

    with pytest.raises(StateError, match="MostRecent evicted 1, which is protected"):
        replay(requests_from_ids([[1, 2], [1, 3]]), 2, MostRecent())


def test_empty_and_negative():
    assert replay([], 5, LRUPolicy()) == ReplayResult(0, 0, 0)
    assert belady([], 5).hit_ratio == 0.0
    with pytest.raises(ValueError):
        replay([], -1, LRUPolicy())
    with pytest.raises(ValueError):
        belady([], -1)


# --- Belady is the optimum ---------------------------------------------------------------------


def exhaustive_optimum(chains: list[list[int]], capacity: int) -> int:
    """Most prefix hits any cache of ``capacity`` can get: on each miss, try not caching the block
    and caching it after dropping any resident block (or none, when there is room)."""
    flat = [(i, h) for i, ids in enumerate(chains) for h in ids]
    starts = {sum(len(c) for c in chains[:i]) for i in range(len(chains))}

    @functools.cache
    def best(pos: int, resident: frozenset) -> int:
        if pos == len(flat):
            return 0
        gained = 0
        if pos in starts:
            for h in chains[flat[pos][0]]:
                if h not in resident:
                    break
                gained += 1
        h = flat[pos][1]
        if h in resident:
            return gained + best(pos + 1, resident)
        options = [resident]  # do not cache h
        if capacity:
            if len(resident) < capacity:
                options.append(resident | {h})
            else:
                options.extend((resident - {v}) | {h} for v in resident)
        return gained + max(best(pos + 1, r) for r in options)

    return best(0, frozenset())


@settings(max_examples=60, deadline=None)
@given(chains=chained_traces(max_requests=5, max_new=3), capacity=st.integers(0, 3))
def test_belady_matches_an_exhaustive_search(chains, capacity):
    assert belady(requests_from_ids(chains), capacity).hits == exhaustive_optimum(chains, capacity)


@settings(max_examples=150, deadline=None)
@given(chains=chained_traces(max_requests=25, max_new=5), capacity=st.integers(0, 12))
def test_belady_is_at_least_every_policy(chains, capacity):
    trace = requests_from_ids(chains)
    optimum = belady(trace, capacity).hits
    for name, cls in EVICTION_POLICIES.items():
        assert replay(trace, capacity, cls()).hits <= optimum, name
    if capacity:
        for policy in (ARCPolicy(capacity), S3FIFOPolicy(capacity), PrefixS3FIFOPolicy(capacity)):
            assert replay(trace, capacity, policy).hits <= optimum


# --- trace files -------------------------------------------------------------------------------


def test_load_trace(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 1024, "output_length": 3, "hash_ids": [0, 1]},
        {"timestamp": 40, "input_length": 600, "output_length": 9, "hash_ids": [0, 2]},
    ]
    path.write_text(json.dumps(lines[0]) + "\n\n" + json.dumps(lines[1]) + "\n")
    trace = load_trace(path)
    assert [r.hash_ids for r in trace] == [(0, 1), (0, 2)]
    assert (trace[1].timestamp, trace[1].input_length, trace[1].output_length) == (40, 600, 9)
    assert replay(trace, 10, LRUPolicy()).hits == 1


@pytest.mark.parametrize(
    "line", ['{"hash_ids": [1, 2', '{"timestamp": 0}', '{"hash_ids": [1, 1]}', '{"hash_ids": ["a"]}', '{"hash_ids": 3}']
)
def test_a_bad_line_is_named(tmp_path, line):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"hash_ids": [1]}\n' + line + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not a Mooncake trace line"):
        load_trace(path)


@pytest.mark.skipif(not TRACE.is_file(), reason=f"shared trace not found at {TRACE}")
@pytest.mark.parametrize(
    "capacity, lru_ref, belady_ref", [(1000, 0.083, 0.277), (4000, 0.230, 0.493), (16000, 0.530, 0.640)]
)
def test_reference_figures_on_the_mooncake_trace(capacity, lru_ref, belady_ref):
    trace = _shared_trace()
    assert sum(len(r.hash_ids) for r in trace) == 121_877
    assert replay(trace, capacity, LRUPolicy()).hit_ratio == pytest.approx(lru_ref, abs=0.005)
    assert belady(trace, capacity).hit_ratio == pytest.approx(belady_ref, abs=0.005)


@functools.lru_cache(maxsize=1)
def _shared_trace():
    return load_trace(TRACE)


def test_policies_used_here_are_policies():
    assert all(issubclass(cls, EvictionPolicy) for cls in EVICTION_POLICIES.values())
