"""The slot allocator every tier with slots stands on (``SlotAllocator``). The Tier contract itself, over every
kind of tier, and its state machine are in tests/contracts/test_tier.py.

Invariants checked: the allocator hands out each slot once, low slots first, refuses a double free
(DoubleFreeError) and a slot out of range (StateError), allocates all or nothing, and never hands out a
slot taken by ``claim`` (checked against a set of free slots over any sequence of calls).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, strategies as st

from kvtier.core.errors import DoubleFreeError, StateError
from kvtier.core.tier import SlotAllocator

# --- SlotAllocator -------------------------------------------------------------------------------


def test_allocator_hands_out_each_slot_once_low_slots_first():
    alloc = SlotAllocator(5)
    assert alloc.allocate(2) == [0, 1]
    assert alloc.allocate(3) == [2, 3, 4]
    assert alloc.num_free == 0
    assert alloc.allocate(1) is None
    assert alloc.allocate(0) == []


def test_allocator_free_and_reallocate():
    alloc = SlotAllocator(3)
    slots = alloc.allocate(3)
    alloc.free(1)
    assert alloc.num_free == 1
    assert alloc.allocate(1) == [1]
    for s in slots:
        alloc.free(s)
    assert sorted(alloc.allocate(3)) == [0, 1, 2]


def test_allocator_allocates_all_or_nothing():
    alloc = SlotAllocator(4)
    alloc.allocate(3)
    assert alloc.allocate(2) is None
    assert alloc.num_free == 1
    assert alloc.allocate(1) == [3]


def test_allocator_refuses_double_free():
    alloc = SlotAllocator(3)
    alloc.allocate(2)
    alloc.free(0)
    with pytest.raises(DoubleFreeError):
        alloc.free(0)
    with pytest.raises(DoubleFreeError):
        alloc.free(2)  # never allocated
    assert issubclass(DoubleFreeError, StateError)
    assert alloc.num_free == 2


@pytest.mark.parametrize("slot", [-1, 3, 100])
def test_allocator_refuses_slots_out_of_range(slot):
    alloc = SlotAllocator(3)
    alloc.allocate(3)
    with pytest.raises(StateError):
        alloc.free(slot)
    assert alloc.num_free == 0


def test_allocator_claims_particular_slots_all_or_none_and_never_hands_them_out():
    alloc = SlotAllocator(4)
    assert alloc.claim_many(np.array([0, 2])) is None
    assert alloc.num_free == 2 and not alloc.is_free(0) and alloc.is_free(1)
    assert alloc.claim_many(np.array([1, 2])) == 1  # taken: the index of the first bad one, none claimed
    assert alloc.claim_many(np.array([3, 4])) == 1  # out of range
    assert alloc.claim_many(np.array([1, 3, 1])) == 2  # given twice
    assert alloc.claim_many(np.array([-1])) == 0
    assert alloc.num_free == 2 and alloc.is_free(1) and alloc.is_free(3)
    alloc.free_many(np.array([0]))
    assert alloc.num_free == 3 and alloc.is_free(0)
    assert alloc.claim_many(np.array([0])) is None
    assert alloc.allocate(2) == [1, 3]
    alloc.free(2)
    assert alloc.allocate(1) == [2] and alloc.allocate(1) is None


@given(st.lists(st.tuples(st.sampled_from(["allocate", "free", "claim"]), st.integers(0, 9)), max_size=80))
def test_allocator_agrees_with_a_set_of_free_slots(ops):
    """Any sequence of allocations, frees and claims (a claimed slot stays in the free stack until it is
    popped and skipped, perhaps freed and pushed again meanwhile) hands out only free slots, each once."""
    alloc, free = SlotAllocator(8), set(range(8))
    for op, n in ops:
        if op == "allocate":
            slots = alloc.allocate(n)
            if n > len(free):
                assert slots is None
            else:
                assert slots is not None and len(set(slots)) == n and set(slots) <= free
                free -= set(slots)
        elif op == "free" and n < 8 and n not in free:
            alloc.free(n)
            free.add(n)
        elif op == "claim" and n in free:
            assert alloc.claim_many(np.array([n])) is None
            free.discard(n)
        assert alloc.num_free == len(free) and all(alloc.is_free(s) == (s in free) for s in range(8))
