"""ARC, S3-FIFO and prefix-ordered S3-FIFO: their own orderings. The EvictionPolicy contract, over every
registered policy, is tests/contracts/test_eviction_policy.py.

Invariants checked:
- ARC: a key read twice survives a scan of one-time keys that pushes LRU's copy out; a key
  inserted again while in a ghost list lands in T2 and moves the T1 target; ghost lists stay within
  ARC's bounds (|T1|+|B1| <= c, all four <= 2c); capacity None learns the most keys ever tracked;
- S3-FIFO: one-hit keys leave from the small queue first; a key read while in small moves to main
  and survives; a key inserted again while in the ghost queue goes straight to main; the ghost queue
  stays within its share;
- prefix-ordered S3-FIFO: a batch of consecutive inserts leaves deepest (last inserted) first, and
  pending keys count as tracked.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from kvtier.policies import (
    ARCPolicy,
    LRUPolicy,
    PrefixS3FIFOPolicy,
    S3FIFOPolicy,
)


def key(i: int) -> bytes:
    return b"k%02d" % i


def filled(policy, *keys):
    for k in keys:
        policy.insert(k)
    return policy


# --- ARC ---------------------------------------------------------------------------------------


def test_arc_keeps_a_reused_key_through_a_scan():
    arc, lru = filled(ARCPolicy(4), b"hot"), filled(LRUPolicy(), b"hot")
    arc.touch(b"hot")
    lru.touch(b"hot")
    for i in range(20):  # a scan of one-time keys, one eviction per key once full
        for p in (arc, lru):
            if len(p) == 4:
                p.evict(1, ())
            p.insert(b"scan%d" % i)
    assert b"hot" in arc and b"hot" not in lru


def test_arc_ghost_hit_goes_to_t2_and_adapts_the_target():
    arc = filled(ARCPolicy(2), b"a", b"b")
    assert arc.evict(1, ()) == [b"a"]  # T1 is over its target (0): its oldest leaves, into B1
    assert arc._p == 0
    arc.insert(b"a")  # remembered in B1: T1 was too small
    assert arc._p == 1
    arc.insert(b"c")  # T1 = [b, c], T2 = [a]
    assert arc.evict(1, ()) == [b"b"]  # |T1| = 2 > p = 1
    assert arc.evict(1, ()) == [b"a"]  # |T1| = 1, not over p: T2's oldest
    assert arc.evict(1, ()) == [b"c"]
    assert len(arc) == 0


def test_arc_falls_back_to_the_other_list_when_one_is_all_protected():
    arc = filled(ARCPolicy(3), b"a", b"b")
    arc.touch(b"a")  # T2 = [a], T1 = [b]; T1 is over target, but b is protected
    assert arc.evict(1, {b"b"}) == [b"a"]
    assert arc.evict(1, {b"b"}) == []
    assert b"b" in arc


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 30)), max_size=200))
def test_arc_ghost_lists_stay_bounded(ops):
    c = 5
    arc = ARCPolicy(c)
    for is_touch, i in ops:
        k = key(i)
        if k in arc:
            if is_touch:
                arc.touch(k)
        else:
            if len(arc) == c:
                arc.evict(1, ())
            arc.insert(k)
        assert len(arc._t1) + len(arc._b1) <= c
        assert len(arc) + len(arc._b1) + len(arc._b2) <= 2 * c
        assert 0 <= arc._p <= c


def test_arc_without_capacity_learns_the_largest_size_tracked():
    arc = filled(ARCPolicy(), b"a", b"b", b"c")
    assert arc.capacity == 3
    arc.evict(2, ())
    arc.insert(b"d")
    assert arc.capacity == 3
    with pytest.raises(ValueError):
        ARCPolicy(0)


# --- S3-FIFO -----------------------------------------------------------------------------------


def test_s3fifo_evicts_one_hit_keys_and_promotes_read_ones():
    s3 = filled(S3FIFOPolicy(10), b"a", b"b", b"c")  # all in small (share 1)
    s3.touch(b"a")
    # a was read while in small: it moves to main; b was not: it is the first victim.
    assert s3.evict(1, ()) == [b"b"]
    assert s3.evict(1, ()) == [b"c"]  # small = [c] still holds its share (1 of 10): c leaves
    assert s3.evict(1, ()) == [b"a"]  # small is empty; main's a was not read since it arrived


def test_s3fifo_main_gives_read_keys_another_round():
    s3 = filled(S3FIFOPolicy(10, small_fraction=0.1), b"a", b"b")
    s3.touch(b"a")
    s3.touch(b"b")
    assert s3.evict(0, ()) == []
    filled(s3, b"x")
    assert s3.evict(1, ()) == [b"x"]  # a and b were promoted to main on the way, x (unread) left
    s3.touch(b"b")  # b read again while in main
    assert s3.evict(1, ()) == [b"a"]  # b gets another round, a does not
    assert s3.evict(1, ()) == [b"b"]


def test_s3fifo_ghost_hit_goes_to_main():
    s3 = filled(S3FIFOPolicy(4), b"a", b"b")
    assert s3.evict(1, ()) == [b"a"]  # remembered in the ghost queue
    s3.insert(b"a")  # straight to main
    filled(s3, b"c")
    # small = [b, c] >= its share: small's unread oldest leaves before main's a.
    assert s3.evict(2, ()) == [b"b", b"c"]
    assert list(s3._main) == [b"a"]


def test_s3fifo_skips_protected_keys_without_reordering():
    s3 = filled(S3FIFOPolicy(10), b"a", b"b", b"c")
    assert s3.evict(1, {b"a"}) == [b"b"]
    assert s3.evict(1, ()) == [b"a"]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=200))
def test_s3fifo_ghost_queue_stays_within_its_share(ids):
    s3 = S3FIFOPolicy(5, ghost_fraction=0.8)
    for i in ids:
        k = key(i)
        if k in s3:
            s3.touch(k)
            continue
        if len(s3) == 5:
            s3.evict(1, ())
        s3.insert(k)
        assert len(s3._ghost) <= 4


def test_s3fifo_argument_checks():
    for kwargs in (
        {"capacity": 0},
        {"small_fraction": 0.0},
        {"small_fraction": 1.0},
        {"ghost_fraction": -1.0},
        {"promote_after": 0},
        {"promote_after": 4},
    ):
        with pytest.raises(ValueError):
            S3FIFOPolicy(**kwargs)


# --- prefix-ordered S3-FIFO ---------------------------------------------------------------------


def test_prefix_s3fifo_evicts_a_batch_deepest_first():
    plain = filled(S3FIFOPolicy(), b"a", b"b", b"c")
    prefix = filled(PrefixS3FIFOPolicy(), b"a", b"b", b"c")
    assert plain.evict(1, ()) == [b"a"]
    assert prefix.evict(1, ()) == [b"c"]
    filled(prefix, b"d", b"e")  # a second batch queues behind the first
    assert prefix.evict(4, ()) == [b"b", b"a", b"e", b"d"]


def test_prefix_s3fifo_counts_pending_keys():
    prefix = filled(PrefixS3FIFOPolicy(), b"a", b"b")
    assert len(prefix) == 2 and b"a" in prefix and b"z" not in prefix
    with pytest.raises(KeyError):
        prefix.insert(b"a")
    prefix.remove(b"a")
    assert len(prefix) == 1 and b"a" not in prefix
    prefix.touch(b"b")
    assert prefix.evict(5, ()) == [b"b"]


def test_prefix_s3fifo_restore_after_a_pending_batch():
    prefix = filled(PrefixS3FIFOPolicy(), b"a", b"b")
    prefix.restore([b"c", b"d"])
    assert prefix.evict(4, ()) == [b"b", b"a", b"c", b"d"]
    with pytest.raises(KeyError):
        prefix.restore([b"e", b"e"])
