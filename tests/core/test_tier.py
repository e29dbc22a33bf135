"""The slot allocator every tier with slots stands on (``SlotAllocator``). The Tier contract itself, over every
kind of tier, and its state machine are in tests/contracts/test_tier.py.

Invariants checked: the allocator hands out each slot once, low slots first, refuses a double free
(DoubleFreeError) and a slot out of range (StateError), and allocates all or nothing.
"""

from __future__ import annotations

import pytest

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
