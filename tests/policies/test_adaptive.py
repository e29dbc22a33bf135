"""The adaptive policy (kvtier.policies.adaptive), driven through the cache replay with hand-computed
outcomes. Every stream uses a cache of 2 blocks (so no protected segment: 0.3 x 2 rounds to 0),
miniatures that see every key (``sample_every=1``) and histories of 4 keys, so each step can be
followed by hand; the comments give the reasoning.

Invariants checked:
- where recency wins (keys come back while LRU still holds them), the score only falls, the filter
  never turns on, and the policy hits exactly what LRU hits;
- where admission wins (two hot keys between one-off keys that push LRU's copies out), the filter
  turns on on the third round and from the fourth round on both hot keys hit, where LRU hits none;
- a stream that switches from the second kind to the first turns the filter off again once the
  prefix hits only plain LRU's miniature had make up the score, and then hits like LRU;
- a run leaves deepest first (a chain loses its tail before its head), its last inserted block
  (a prompt's partial tail) before every older block, and a read block after unread ones;
- the history stays within history_factor x capacity; bad parameters raise ValueError.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

import pytest

from kvtier.core.keys import tenant_tag
from kvtier.policies import AdaptivePolicy, LRUPolicy, adaptive as adaptive_module
from kvtier.replay.cache import replay
from kvtier.replay.trace import Request
from kvtier.replay.workload import WORKLOADS, generate


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
    # 1 2 1 2 ...: the first two requests are runs of one insert each; then the touches of 1 and 2
    # form one run (no insert between them) that ends when 1 comes again. In that first run of
    # touches plain LRU's miniature hits 1 and 2 (prefix hits 2); the filtering one declined both at
    # first sight, so 1 misses (prefix hits 0) and both are admitted now: the score is 0 - 2 = -2.
    # From then on both miniatures hit both: the score stays -2, the filter never turns on.
    stream = requests([1, 2] * 10)
    policy = adaptive()
    result = replay(stream, 2, policy)
    assert result.hits == replay(stream, 2, LRUPolicy()).hits == 18
    assert (policy.score, policy.filtering) == (-2, False)


def test_where_admission_wins_the_filter_turns_on_and_keeps_the_hot_keys():
    # LRU (2 blocks) loses 1 and 2 to every one-off key: no hit at all. Rounds 1 and 2 score 0 (the
    # filtering miniature declines 1, 2 and 100 at first sight, admits 1 and 2 at the second, and
    # both miniatures miss). In round 3 the filtering miniature holds 1 and 2 and hits both (prefix
    # hits 2), the plain one lost them to 101: the score is 2, and the filter is on. The tier held
    # 1 and 2 in round 3 too (it admitted everything until then, and remembered what it evicted), so
    # round 3 admits them from the history; from round 4 on the one-off keys are declined and 1 and
    # 2 hit every round. After that, 1, 2 and the declined key form one run (nothing is inserted),
    # which both miniatures apply whole before evicting: both hit 1 and 2, and the score stays 2.
    rounds = 10
    stream = requests(hot_pair_rounds(rounds))
    policy = adaptive()
    assert replay(stream, 2, LRUPolicy()).hits == 0
    assert replay(stream, 2, policy).hits == 2 * (rounds - 3)
    assert (policy.score, policy.filtering) == (2, True)


def test_a_stream_that_switches_halfway_turns_the_filter_off_again():
    # Admission wins for 10 rounds (14 hits, score 2), then keys come in pairs: plain LRU hits every
    # second sight, the filtering miniature never does (it declines the first, admits the second).
    # While the filter is on, a pair's first sight is declined and its second admitted from the
    # history and stored: a miss. Each stored second sight is a run of one, scored when the next
    # pair starts: the plain miniature hits it, the filtering one does not, -1. After pairs 2 and 3
    # the score is 0 and the filter is off as pair 4 starts; from pair 4 on every second sight
    # hits, as under LRU: 14 + 9.
    m = 12
    stream = requests(hot_pair_rounds(10) + pairs(m))
    policy = adaptive()
    assert replay(stream, 2, LRUPolicy()).hits == m
    assert replay(stream, 2, policy).hits == 2 * (10 - 3) + (m - 3)
    assert not policy.filtering


def test_a_run_leaves_deepest_first_and_its_last_inserted_block_first_of_all():
    policy = AdaptivePolicy(capacity=8)
    policy.admit(b"o")
    policy.insert(b"o")  # a request of one block: no chain, no tail
    for key in (b"a", b"b", b"c"):  # the next request: three blocks in chain order
        assert policy.admit(key)
    for key in (b"a", b"b", b"c"):
        policy.insert(key)
    policy.touch(b"o")  # the next request reads o (a touch ends the run of inserts)
    policy.admit(b"d")
    policy.insert(b"d")
    # Run [a, b, c] queues c, b, a after o, then its last block c goes to the old end: c, o, b, a.
    # The run [o (touched), d (inserted)] moves o to the protected segment, and d, its last block,
    # to probation's old end: probation d, c, b, a leaves first, then the protected o.
    assert policy.evict(5, ()) == [b"d", b"c", b"b", b"a", b"o"]


def test_the_history_stays_within_its_share_of_the_capacity():
    policy = AdaptivePolicy(capacity=2, sample_every=1, history_factor=2.0, score_limit=4)
    replay(requests(hot_pair_rounds(10)), 2, policy)
    assert policy.filtering
    for key in range(500, 520):  # all declined: each is remembered, the oldest forgotten
        assert not policy.admit(key)
    # Two generations of 2 keys each (history_factor x capacity = 4 keys): the last 2 to 4 keys.
    assert len(policy._history) <= 4
    assert policy.admit(519) and policy.admit(518)
    assert not policy.admit(515)  # five back: forgotten


@pytest.mark.parametrize(
    "kwargs",
    [
        {"capacity": 0},
        {"sample_every": 0},
        {"sample_every": 6},
        {"history_factor": 0},
        {"score_limit": 0},
        {"protected_share": 1.0},
    ],
)
def test_bad_parameters(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs)).split("_")[0]):
        AdaptivePolicy(**kwargs)


def two_block_requests(chains: list[tuple[int, int]]) -> list[Request]:
    return [Request(0, 1024, 1, chain) for chain in chains]


@pytest.mark.parametrize("sample_cap", [None, 64], ids=["every-sampled-key", "a-further-sample"])
def test_the_last_block_rule_holds_while_run_tails_are_not_read_again_and_stops_when_they_are(monkeypatch, sample_cap):
    # Each request is a chain of two blocks, so its last inserted block is the run's tail. In the
    # first stream a chain's head comes back under another tail and no tail ever does (a prompt's
    # partial last block): the rule stays. In the second every chain comes back whole, tails
    # included, as often as heads (a demotion batch's youngest victim): the rule is dropped. With a
    # sample cap of 64 the watch sees 1 in 4 of the 200 x 4 x 1 sampled keys' window, the
    # miniatures 1 in 2: the evidence is thinner, the decisions the same.
    if sample_cap:
        monkeypatch.setattr(adaptive_module, "SAMPLE_CAP", sample_cap)
    tails_never_back = two_block_requests([pair for k in range(200) for pair in ((k, 1000 + k), (k, 2000 + k))])
    tails_back = two_block_requests([(k, 1000 + k) for k in range(200) for _ in range(2)])
    for stream, kept in ((tails_never_back, True), (tails_back, False)):
        policy = AdaptivePolicy(capacity=100, sample_every=1)
        assert (policy._watch_mask, policy._mini_mask) == ((3, 1) if sample_cap else (0, 0))
        replay(stream, 100, policy)
        assert policy.tail_first is kept


def test_above_the_sample_cap_the_miniatures_and_the_watch_keep_a_fixed_number_of_keys(monkeypatch):
    """What a tier of 10 M blocks gets (~16 K keys per miniature and watch generation), scaled down: a cap of
    16 keys, a tier of 1,000 blocks taking 20,000 one-off keys. Each structure holds only keys of its further
    sample, and at most the cap (the miniatures' segments together; a watch generation: it rolls over there)."""
    monkeypatch.setattr(adaptive_module, "SAMPLE_CAP", 16)
    policy = AdaptivePolicy(capacity=1000, sample_every=1)
    for start in range(0, 20_000, 5):  # runs of five new blocks
        keys = [hashlib.blake2b(b"%d" % i, digest_size=16).digest() for i in range(start, start + 5)]  # as a tier's
        for key in keys:
            assert policy.admit(key)
        for key in keys:
            policy.insert(key)
        policy.evict(max(0, len(policy) - 1000), ())
    for mini in (policy._plain, policy._filtering):
        held = [*mini._probation, *mini._protected]
        assert len(held) <= 16 and all(adaptive_module._thinned(key, policy._mini_mask) for key in held)
    assert len(policy._plain._probation) > 8  # it did fill (with one-off keys: the plain one admits them)
    for watched in (policy._watched, policy._watched_old):
        assert 0 < len(watched) <= 16 and all(adaptive_module._thinned(key, policy._watch_mask) for key in watched)


def test_a_history_resized_for_more_keys_does_not_say_it_saw_every_key():
    """A Bloom filter sized for few keys fills up and then finds every key: growing the history starts a
    generation of the new size, so first-seen keys are still declined while the filter is on."""
    policy = AdaptivePolicy(capacity=2)
    policy._resize(100_000)  # a tier that turned out far larger than first thought
    history = policy._history
    for i in range(50_000):
        history.add(b"seen-%d" % i)
    assert all(history.take(b"seen-%d" % i) for i in range(0, 50_000, 997))
    unseen = sum(history.take(b"never-%d" % i) for i in range(10_000))
    assert unseen < 300, f"{unseen} of 10,000 keys never added look remembered"


@pytest.mark.parametrize(
    ("prefix", "suffix"),
    [(tenant_tag(f"tenant-{name}"), b"") for name in "abcd"] + [(b"", (0).to_bytes(4, "big")), (b"", b"\x00\x01")],
    ids=["tenant-a", "tenant-b", "tenant-c", "tenant-d", "vllm-group-0", "kvtier-group-1"],
)
def test_keys_that_share_their_first_or_last_bytes_are_sampled_and_hit_as_plain_digests(prefix, suffix):
    """A tenant's keys all begin with its tag; vLLM's offload keys end in their KV cache group's index,
    and kvtier's keys of a hybrid model in theirs. Sampled by a fixed byte, such keys were all sampled or
    none (by the first byte, a tenant's: with none the policy learned nothing, 0.479 for 0.528 here).
    Sampled by a hash of the whole key they hit as plain digests do, give or take which keys make the
    sample (the generated documents workload at 1,000 blocks, where the policy beats LRU by a fifth)."""
    workload = generate(WORKLOADS["documents"])
    digest = {
        h: hashlib.blake2b(h.to_bytes(8, "little"), digest_size=16).digest() for r in workload for h in r.hash_ids
    }

    def keyed(before: bytes, after: bytes) -> list[Request]:
        return [replace(r, hash_ids=tuple(before + digest[h] + after for h in r.hash_ids)) for r in workload]

    plain = replay(keyed(b"", b""), 1000, AdaptivePolicy()).hit_ratio
    assert plain > replay(keyed(b"", b""), 1000, LRUPolicy()).hit_ratio + 0.05
    assert abs(replay(keyed(prefix, suffix), 1000, AdaptivePolicy()).hit_ratio - plain) < 0.02
