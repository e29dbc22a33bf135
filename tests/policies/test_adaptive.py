"""The adaptive policy (kvtier.policies.adaptive), driven through the cache replay with hand-computed
outcomes. Every stream uses a cache of 2 blocks, miniatures that see every key (``sample_every=1``)
and histories of 4 keys, so each step can be followed by hand; the comments give the reasoning.

Invariants checked:
- where recency wins (keys come back while LRU still holds them), the score only falls, the filter
  never turns on, and the policy hits exactly what LRU hits;
- where admission wins (two hot keys between one-off keys that push LRU's copies out), the filter
  turns on on the third round and from the fourth round on both hot keys hit, where LRU hits none;
- a stream that switches from the second kind to the first turns the filter off again after
  ``score_limit`` references that only plain LRU hits, and then hits like LRU;
- a run of inserts leaves deepest first (a chain loses its tail before its head);
- the history stays within history_factor x capacity; bad parameters raise ValueError.
"""

from __future__ import annotations

import pytest

from kvtier.policies import AdaptivePolicy, LRUPolicy
from kvtier.replay.cache import replay
from kvtier.replay.trace import Request


def requests(keys: list[int]) -> list[Request]:
    """One single-block request per key."""
    return [Request(0, 512, 1, (key,)) for key in keys]


def adaptive() -> AdaptivePolicy:
    return AdaptivePolicy(capacity=2, sample_every=1, history_factor=2.0, score_limit=4)


def hot_pair_rounds(n: int) -> list[int]:
    """Round k: hot keys 1 and 2, then one-off key 100 + k."""
    return [key for k in range(n) for key in (1, 2, 100 + k)]


def pairs(m: int, first: int = 1000) -> list[int]:
    """Each key twice in a row: a second sight that LRU always hits."""
    return [key for j in range(m) for key in (first + j, first + j)]


def test_where_recency_wins_the_filter_stays_off_and_the_policy_is_lru():
    # 1 2 1 2 ...: plain LRU misses twice, then hits. The filtering miniature declines 1 and 2 at
    # first sight, admits them at the second (misses) and hits from the fifth reference on: it only
    # ever loses, so the score goes to -2 and stays there.
    stream = requests([1, 2] * 10)
    policy = adaptive()
    result = replay(stream, 2, policy)
    assert result.hits == replay(stream, 2, LRUPolicy()).hits == 18
    assert (policy.score, policy.filtering) == (-2, False)


def test_where_admission_wins_the_filter_turns_on_and_keeps_the_hot_keys():
    # LRU (2 blocks) loses 1 and 2 to every one-off key: no hit at all. The filtering miniature
    # declines everything in round 1, admits 1 and 2 in round 2 (in its history) and hits them from
    # round 3 on, while plain LRU misses: the score is 1 at round 3's first reference, so the filter
    # is on. The tier held 1 and 2 in round 2 too (it admitted everything then, and remembered what
    # it evicted), so round 3 admits them from the history, and from round 4 on the one-off keys
    # are declined and 1 and 2 hit every round.
    rounds = 10
    stream = requests(hot_pair_rounds(rounds))
    policy = adaptive()
    assert replay(stream, 2, LRUPolicy()).hits == 0
    assert replay(stream, 2, policy).hits == 2 * (rounds - 3)
    assert (policy.score, policy.filtering) == (4, True)  # clamped at score_limit


def test_a_stream_that_switches_halfway_turns_the_filter_off_again():
    # Admission wins for 10 rounds (14 hits, score 4), then keys come in pairs: plain LRU hits every
    # second sight, the filtering miniature never does (it declines the first, admits the second),
    # so each pair takes 1 off the score. For pairs 1 to 3 the filter is still on at both sights:
    # the first is declined, the second admitted (a miss). At pair 4's second sight the score
    # reaches 0 and the filter turns off: admitted, still a miss. From pair 5 on every second sight
    # hits, as under LRU.
    m = 12
    stream = requests(hot_pair_rounds(10) + pairs(m))
    policy = adaptive()
    assert replay(stream, 2, LRUPolicy()).hits == m
    assert replay(stream, 2, policy).hits == 2 * (10 - 3) + (m - 4)
    assert (policy.score, policy.filtering) == (-4, False)


def test_a_run_of_inserts_leaves_deepest_first():
    policy = AdaptivePolicy(capacity=8)
    for key in (b"a", b"b", b"c"):  # one request's new blocks, in chain order
        policy.insert(key)
    policy.touch(b"c")  # any other call ends the run
    policy.insert(b"d")
    assert policy.evict(4, ()) == [b"b", b"a", b"c", b"d"]


def test_the_history_stays_within_its_share_of_the_capacity():
    policy = AdaptivePolicy(capacity=2, sample_every=1, history_factor=2.0, score_limit=4)
    replay(requests(hot_pair_rounds(10)), 2, policy)
    assert policy.filtering
    for key in range(500, 520):  # all declined: each is remembered, the oldest forgotten
        assert not policy.admit(key)
    assert policy.admit(519) and policy.admit(518) and policy.admit(517) and policy.admit(516)
    assert not policy.admit(515)  # five back: forgotten (4 keys of history)


@pytest.mark.parametrize("kwargs", [{"capacity": 0}, {"sample_every": 0}, {"sample_every": 6},
                                    {"history_factor": 0}, {"score_limit": 0}])
def test_bad_parameters(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs)).split("_")[0]):
        AdaptivePolicy(**kwargs)
