"""The block interface of one tier (SlotAllocator and Tier), driven by hand through each state.

Invariants checked:
- the allocator hands out each slot once, refuses a double free (DoubleFreeError) and a slot out of
  range (StateError), and allocates all or nothing;
- readers only see READY blocks: lookup counts leading READY keys only, a WRITING block cannot be
  pinned, and pin is all or nothing;
- reserve -> commit publishes, reserve -> abort releases; misuse (commit or abort of a key that was
  not reserved, a key twice, reserve of a present key) raises StateError and changes nothing;
  more keys than the tier holds raise CapacityError;
- pins are counted: a block is protected until every pin is released; an unpin below zero raises
  and releases nothing;
- eviction follows LRU and never takes a pinned, WRITING or evicting block; when room cannot be
  made reserve returns None and claims nothing;
- begin_evict keeps the victim READY and readable until end_evict; a reader that pins it meanwhile,
  drop=False, or a fence on its slot keeps it (back in the policy);
- a fence (is_fenced) refuses to free a slot: abort raises FenceError and keeps every entry;
- close() refuses while blocks are pinned or being written; stats count what happened;
- committed bytes survive every other operation on the tier; ``check_invariants`` holds throughout.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvtier.core.errors import CapacityError, DoubleFreeError, FenceError, StateError, TransferError
from kvtier.core.layout import BlockLayout
from kvtier.core.tier import BlockState, SlotAllocator, Tier, Usage
from kvtier.policies import LRUPolicy, Watermark
from kvtier.tiers.host import host_tier

LAYOUT = BlockLayout((16, 48))


def k(i: int) -> bytes:
    return b"key-%03d" % i


def make_tier(capacity: int = 4, watermark: Watermark | None = None, is_fenced=None) -> Tier:
    return host_tier("host", capacity, LAYOUT, LRUPolicy(), watermark, is_fenced)


def fill(tier: Tier, keys: list[bytes]) -> list[int]:
    slots = tier.reserve(keys)
    assert slots is not None
    tier.commit(keys)
    return slots


@pytest.fixture
def tier():
    t = make_tier()
    yield t
    t.check_invariants()


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


# --- lookup, reserve, commit, abort --------------------------------------------------------------


def test_lookup_counts_leading_ready_keys_only(tier):
    fill(tier, [k(0), k(2)])
    assert tier.reserve([k(1)]) is not None  # WRITING
    assert tier.lookup([k(0), k(1), k(2)]) == 1
    assert tier.lookup([k(0), k(2)]) == 2
    assert tier.lookup([k(2), k(0), k(9)]) == 2
    assert tier.lookup([k(9), k(0)]) == 0
    assert tier.lookup([k(1)]) == 0
    assert tier.lookup([]) == 0
    tier.commit([k(1)])
    assert tier.lookup([k(0), k(1), k(2)]) == 3
    assert tier.leaks() == {"pinned": 0, "writing": 0}


def test_writing_blocks_are_invisible_to_pin(tier):
    fill(tier, [k(0)])
    tier.reserve([k(1)])
    assert tier.state(k(1)) is BlockState.WRITING
    with pytest.raises(StateError):
        tier.pin([k(1)])
    with pytest.raises(StateError):
        tier.pin([k(0), k(1)])  # all or nothing: k(0) is not pinned either
    with pytest.raises(StateError):
        tier.pin([k(7)])
    assert tier.leaks() == {"pinned": 0, "writing": 1}
    with pytest.raises(StateError):
        tier.unpin([k(0)])


def test_reserve_commit_publishes_and_counts(tier, blockio, rng):
    keys = [k(0), k(1), k(2)]
    slots = tier.reserve(keys)
    assert len(set(slots)) == 3 and all(0 <= s < 4 for s in slots)
    assert tier.usage().used == 3 and tier.usage().free == 1
    assert [tier.state(key) for key in keys] == [BlockState.WRITING] * 3
    assert tier.slots(keys) == slots
    data = rng.integers(0, 256, (3, LAYOUT.block_bytes), dtype=np.uint8)
    for slot, row in zip(slots, data, strict=True):
        blockio.write(tier.storage, slot, row)
    tier.commit(keys)
    assert [tier.state(key) for key in keys] == [BlockState.READY] * 3
    assert tier.pin(keys) == slots
    for slot, row in zip(slots, data, strict=True):
        assert np.array_equal(blockio.read(tier.storage, slot), row)
    tier.unpin(keys)
    assert tier.stats.committed == 3
    assert tier.stats.bytes_in == 3 * LAYOUT.block_bytes
    assert tier.leaks() == {"pinned": 0, "writing": 0}


def test_commit_without_reserve_raises_and_commits_none(tier):
    tier.reserve([k(0)])
    with pytest.raises(StateError):
        tier.commit([k(9)])
    with pytest.raises(StateError):
        tier.commit([k(0), k(9)])
    assert tier.state(k(0)) is BlockState.WRITING
    tier.commit([k(0)])
    with pytest.raises(StateError):
        tier.commit([k(0)])  # already READY
    assert tier.stats.committed == 1


def test_commit_or_abort_of_the_same_key_twice_raises_and_changes_nothing(tier):
    tier.reserve([k(0), k(1)])
    with pytest.raises(StateError):
        tier.commit([k(0), k(0)])
    with pytest.raises(StateError):
        tier.abort([k(1), k(1)])
    assert tier.state(k(0)) is BlockState.WRITING and tier.state(k(1)) is BlockState.WRITING
    assert tier.stats.committed == 0 and tier.stats.aborted == 0
    tier.commit([k(0)])
    tier.abort([k(1)])
    assert tier.usage().used == 1


def test_commit_with_pin_pins_in_the_same_step(tier):
    tier.reserve([k(0), k(1)])
    tier.commit([k(0), k(1)], pin=True)
    assert tier.leaks() == {"pinned": 2, "writing": 0}
    assert tier.evict(4) == []
    tier.unpin([k(0), k(1)])
    assert sorted(tier.evict(4)) == [k(0), k(1)]


def test_abort_releases_the_slots(tier):
    slots = tier.reserve([k(0), k(1)])
    tier.abort([k(0), k(1)])
    assert tier.state(k(0)) is BlockState.FREE and tier.state(k(1)) is BlockState.FREE
    assert tier.usage().used == 0
    assert tier.stats.aborted == 2 and tier.stats.committed == 0
    assert sorted(tier.reserve([k(2), k(3), k(4), k(5)])) == [0, 1, 2, 3]
    assert set(slots) <= {0, 1, 2, 3}


def test_abort_of_a_ready_or_absent_key_raises_and_aborts_none(tier):
    fill(tier, [k(0)])
    tier.reserve([k(1)])
    with pytest.raises(StateError):
        tier.abort([k(1), k(0)])
    with pytest.raises(StateError):
        tier.abort([k(1), k(9)])
    assert tier.state(k(0)) is BlockState.READY and tier.state(k(1)) is BlockState.WRITING
    assert tier.stats.aborted == 0


def test_reserve_more_than_capacity_raises_capacity_error(tier):
    with pytest.raises(CapacityError):
        tier.reserve([k(i) for i in range(5)])
    assert issubclass(CapacityError, ValueError)
    assert tier.usage().used == 0


def test_reserve_of_a_present_or_repeated_key_raises_and_claims_nothing(tier):
    fill(tier, [k(0)])
    tier.reserve([k(1)])
    with pytest.raises(StateError):
        tier.reserve([k(2), k(0)])  # READY
    with pytest.raises(StateError):
        tier.reserve([k(1), k(3)])  # WRITING
    with pytest.raises(StateError):
        tier.reserve([k(2), k(2)])
    assert tier.usage().used == 2
    assert tier.state(k(2)) is BlockState.FREE and tier.state(k(3)) is BlockState.FREE


def test_slots_of_an_absent_key_raises(tier):
    fill(tier, [k(0)])
    with pytest.raises(StateError):
        tier.slots([k(0), k(1)])


# --- pins ------------------------------------------------------------------------------------------


def test_pins_are_counted(tier):
    fill(tier, [k(0), k(1)])
    tier.pin([k(0)])
    tier.pin([k(0)])
    assert tier.leaks()["pinned"] == 1
    tier.unpin([k(0)])
    assert tier.evict(4) == [k(1)]  # k(0) still has one pin
    tier.unpin([k(0)])
    assert tier.leaks()["pinned"] == 0
    assert tier.evict(4) == [k(0)]


def test_a_pin_that_is_no_use_leaves_the_eviction_order_alone(tier):
    fill(tier, [k(0), k(1)])  # LRU: k(0) is the oldest
    tier.pin([k(0)], use=False)
    tier.unpin([k(0)])
    assert tier.evict(1) == [k(0)]  # still the oldest
    fill(tier, [k(0)])
    tier.pin([k(1)])  # a use: k(1) becomes the newest
    tier.unpin([k(1)])
    assert tier.evict(1) == [k(0)]


def test_pin_the_same_key_twice_in_one_call_counts_twice(tier):
    fill(tier, [k(0)])
    tier.pin([k(0), k(0)])
    tier.unpin([k(0)])
    assert tier.evict(1) == []
    tier.unpin([k(0)])
    assert tier.evict(1) == [k(0)]


def test_unpin_of_an_unpinned_block_raises_and_releases_none(tier):
    fill(tier, [k(0), k(1)])
    with pytest.raises(StateError):
        tier.unpin([k(0)])
    tier.pin([k(0)])
    with pytest.raises(StateError):
        tier.unpin([k(0), k(1)])
    with pytest.raises(StateError):
        tier.unpin([k(0), k(0)])  # one pin, two releases
    with pytest.raises(StateError):
        tier.unpin([k(0), k(9)])
    assert tier.leaks()["pinned"] == 1
    assert tier.evict(4) == [k(1)]
    tier.unpin([k(0)])
    assert tier.leaks()["pinned"] == 0


# --- eviction --------------------------------------------------------------------------------------


def test_reserve_evicts_the_least_recently_used(tier):
    fill(tier, [k(0), k(1), k(2), k(3)])
    tier.pin([k(0)])
    tier.unpin([k(0)])  # a read: k(0) is now the most recent
    assert tier.reserve([k(4)]) is not None
    assert tier.state(k(1)) is BlockState.FREE
    assert tier.lookup([k(0)]) == 1 and tier.lookup([k(2), k(3)]) == 2
    assert tier.stats.evicted == 1
    tier.commit([k(4)])
    assert tier.reserve([k(5), k(6)]) is not None
    assert tier.state(k(2)) is BlockState.FREE and tier.state(k(3)) is BlockState.FREE
    assert tier.lookup([k(0), k(4)]) == 2
    assert tier.stats.evicted == 3
    tier.abort([k(5), k(6)])


def test_reserve_never_evicts_pinned_writing_or_evicting_blocks(tier):
    fill(tier, [k(0), k(2), k(3)])
    tier.pin([k(0)])
    tier.reserve([k(1)])  # WRITING
    victims = tier.begin_evict(1)
    assert [key for key, _ in victims] == [k(2)]
    assert tier.reserve([k(4)]) is not None  # only k(3) may go
    assert tier.state(k(3)) is BlockState.FREE
    assert tier.reserve([k(5)]) is None
    assert tier.state(k(5)) is BlockState.FREE
    assert tier.state(k(0)) is BlockState.READY
    assert tier.state(k(1)) is BlockState.WRITING
    assert tier.state(k(2)) is BlockState.READY
    assert tier.usage().used == 4
    tier.check_invariants()
    tier.end_evict([k(2)])
    tier.unpin([k(0)])
    tier.abort([k(1), k(4)])


def test_reserve_returns_none_and_claims_nothing_when_room_cannot_be_made(tier):
    fill(tier, [k(0), k(1), k(2), k(3)])
    tier.pin([k(0), k(1), k(2)])
    assert tier.reserve([k(5), k(6)]) is None
    assert tier.state(k(5)) is BlockState.FREE and tier.state(k(6)) is BlockState.FREE
    assert tier.lookup([k(0), k(1), k(2)]) == 3
    assert tier.leaks() == {"pinned": 3, "writing": 0}
    tier.unpin([k(0), k(1), k(2)])


def test_reserve_without_eviction_returns_none_when_full(tier):
    fill(tier, [k(0), k(1), k(2)])
    assert tier.reserve([k(3), k(4)], allow_evict=False) is None
    assert tier.lookup([k(0), k(1), k(2)]) == 3
    assert tier.stats.evicted == 0
    assert tier.reserve([k(3)], allow_evict=False) is not None


def test_evict_takes_up_to_n_unpinned_in_lru_order(tier):
    fill(tier, [k(0), k(1), k(2), k(3)])
    tier.pin([k(1)])
    assert tier.evict(2) == [k(0), k(2)]
    assert tier.evict(5) == [k(3)]
    assert tier.evict(5) == []
    assert tier.evict(0) == []
    assert tier.lookup([k(1)]) == 1 and tier.usage().used == 1
    assert tier.stats.evicted == 3
    tier.unpin([k(1)])


def test_begin_evict_keeps_the_victim_readable_until_end_evict(tier, blockio, rng):
    slots = fill(tier, [k(0), k(1)])
    data = rng.integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8)
    blockio.write(tier.storage, slots[0], data)
    assert tier.begin_evict(1) == [(k(0), slots[0])]
    assert tier.state(k(0)) is BlockState.READY
    assert tier.lookup([k(0), k(1)]) == 2
    assert np.array_equal(blockio.read(tier.storage, slots[0]), data)
    assert tier.begin_evict(4) == [(k(1), slots[1])]  # the policy no longer offers k(0)
    assert tier.evict(4) == []
    with pytest.raises(StateError):
        tier.reserve([k(0)])
    assert tier.leaks()["pinned"] == 2  # victims are pinned while they are copied out
    assert tier.usage().evicting == 2  # and their slots free once their copies land
    with pytest.raises(StateError):
        tier.close()
    tier.check_invariants()
    assert tier.end_evict([k(0), k(1)]) == [k(0), k(1)]
    assert tier.state(k(0)) is BlockState.FREE and tier.usage() == Usage(0, tier.capacity, 0)
    assert tier.stats.evicted == 2


def test_end_demotion_drops_landed_and_refused_victims_and_keeps_failed_ones(tier):
    fill(tier, [k(0), k(1), k(2)])
    assert [key for key, _ in tier.begin_evict(3)] == [k(0), k(1), k(2)]
    assert tier.end_demotion(ok=[k(0)], failed=[k(1), k(2)], refused=[k(2)]) == [k(0), k(2)]
    assert [tier.state(key) for key in (k(0), k(1), k(2))] == [BlockState.FREE, BlockState.READY, BlockState.FREE]
    assert (tier.stats.demoted, tier.stats.demotion_refused, tier.stats.evicted) == (1, 1, 2)
    assert tier.leaks()["pinned"] == 0 and tier.begin_evict(1) == [(k(1), tier.slots([k(1)])[0])]  # offered again


def test_pin_leading_pins_the_ready_run_only(tier):
    slots = fill(tier, [k(0), k(1), k(3)])
    assert tier.pin_leading([k(0), k(1), k(2), k(3)]) == slots[:2]
    assert tier.leaks()["pinned"] == 2 and tier.pin_leading([k(2), k(3)]) == []
    tier.unpin([k(0), k(1)])


def test_a_reader_pinning_a_victim_keeps_it(tier):
    fill(tier, [k(0), k(1)])
    tier.begin_evict(1)
    assert tier.pin([k(0)]) == tier.slots([k(0)])
    assert tier.end_evict([k(0)]) == []
    assert tier.state(k(0)) is BlockState.READY
    assert tier.evict(4) == [k(1)]  # still pinned by the reader
    tier.unpin([k(0)])
    tier.check_invariants()
    assert tier.evict(4) == [k(0)]  # back in the policy once released
    assert tier.stats.evicted == 2


def test_end_evict_without_drop_puts_the_block_back_as_most_recent(tier):
    fill(tier, [k(0), k(1), k(2)])
    assert [key for key, _ in tier.begin_evict(1)] == [k(0)]
    assert tier.end_evict([k(0)], drop=False) == []
    assert tier.lookup([k(0)]) == 1
    assert tier.leaks()["pinned"] == 0
    assert tier.evict(3) == [k(1), k(2), k(0)]
    assert tier.stats.evicted == 3


def test_end_evict_of_a_block_not_being_evicted_raises_and_finishes_none(tier):
    fill(tier, [k(0), k(1)])
    tier.begin_evict(1)
    with pytest.raises(StateError):
        tier.end_evict([k(0), k(1)])
    with pytest.raises(StateError):
        tier.end_evict([k(0), k(0)])
    with pytest.raises(StateError):
        tier.end_evict([k(9)])
    assert tier.state(k(0)) is BlockState.READY and tier.leaks()["pinned"] == 1
    assert tier.end_evict([k(0)]) == [k(0)]


# --- watermark, fences, close, stats ---------------------------------------------------------------


def test_excess_follows_the_watermark():
    tier = make_tier(8, Watermark(high=0.75, low=0.5))
    fill(tier, [k(i) for i in range(6)])
    assert tier.excess() == 0  # at the high mark
    fill(tier, [k(6)])
    assert tier.excess() == 3  # 7 used, down to 4
    fill(tier, [k(7)])
    assert tier.excess() == 4
    tier.evict(tier.excess())
    assert tier.usage().used == 4 and tier.excess() == 0
    assert make_tier(8).excess() == 0


def test_a_fence_refuses_abort_and_keeps_every_entry():
    fenced: set[tuple[str, int]] = set()
    tier = make_tier(is_fenced=lambda name, slot: (name, slot) in fenced)
    slots = tier.reserve([k(0), k(1)])
    fenced.add(("host", slots[1]))
    with pytest.raises(FenceError):
        tier.abort([k(0), k(1)])
    assert issubclass(FenceError, StateError)
    assert tier.state(k(0)) is BlockState.WRITING and tier.state(k(1)) is BlockState.WRITING
    assert tier.usage().used == 2 and tier.stats.aborted == 0
    tier.check_invariants()
    tier.abort([k(0)])
    fenced.clear()
    tier.abort([k(1)])
    assert tier.usage().used == 0 and tier.stats.aborted == 2


def test_a_fenced_victim_is_kept_and_stays_evictable():
    fenced: set[int] = set()
    tier = make_tier(2, is_fenced=lambda name, slot: slot in fenced)
    slots = fill(tier, [k(0), k(1)])
    fenced.add(slots[0])
    assert tier.begin_evict(2) == [(k(0), slots[0]), (k(1), slots[1])]
    assert tier.end_evict([k(0), k(1)]) == [k(1)]
    assert tier.state(k(0)) is BlockState.READY and tier.state(k(1)) is BlockState.FREE
    assert tier.leaks() == {"pinned": 0, "writing": 0}
    tier.check_invariants()
    assert tier.reserve([k(2)]) is not None  # takes the free slot
    assert tier.reserve([k(3)]) is None  # the only candidate is still fenced
    assert tier.state(k(0)) is BlockState.READY
    tier.check_invariants()
    fenced.clear()
    assert tier.reserve([k(3)]) == slots[:1]
    assert tier.state(k(0)) is BlockState.FREE
    tier.abort([k(2), k(3)])


def test_close_refuses_pinned_or_writing_blocks():
    tier = make_tier()
    fill(tier, [k(0)])
    tier.pin([k(0)])
    tier.reserve([k(1)])
    with pytest.raises(StateError, match="pinned"):
        tier.close()
    tier.unpin([k(0)])
    with pytest.raises(StateError, match="writing"):
        tier.close()
    tier.commit([k(1)])
    tier.close()
    with pytest.raises(TransferError):
        tier.storage.fragment_addresses([0])


def test_stats_and_record():
    tier = make_tier()
    fill(tier, [k(0), k(1), k(2)])
    tier.reserve([k(3)])
    tier.abort([k(3)])
    tier.evict(2)
    tier.record(hits=2, bytes_out=128)
    tier.record(hits=1)
    assert tier.stats.as_dict() == {"committed": 3, "aborted": 1, "evicted": 2, "demoted": 0, "hits": 3,
                                    "bytes_in": 3 * LAYOUT.block_bytes, "bytes_out": 128, "read_errors": 0,
                                    "damaged": 0, "incompressible": 0, "demotion_refused": 0, "declined": 0}
    with pytest.raises(AttributeError):
        tier.record(nonsense=1)


def test_usage_and_repr():
    tier = make_tier(8)
    fill(tier, [k(0), k(1)])
    usage = tier.usage()
    assert (usage.used, usage.capacity, usage.free, usage.fraction) == (2, 8, 6, 0.25)
    assert tier.capacity == 8 and tier.block_bytes == 64
    text = repr(tier)
    assert "name='host'" in text and "medium='host'" in text and "used=2/8" in text and "64 B" in text


def test_committed_bytes_survive_other_traffic(blockio, rng):
    tier = make_tier(6)
    written = {}
    for i in range(30):
        key = k(i)
        slots = tier.reserve([key])
        data = rng.integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8)
        blockio.write(tier.storage, slots[0], data)
        if i % 7 == 3:
            tier.abort([key])
            continue
        tier.commit([key])
        written[key] = data
        if i % 4 == 0 and tier.lookup([k(i // 2)]):  # a read keeps an older block recent
            tier.pin([k(i // 2)])
            tier.unpin([k(i // 2)])
        tier.check_invariants()
        for other, expected in written.items():
            if tier.lookup([other]):
                (slot,) = tier.pin([other])
                assert np.array_equal(blockio.read(tier.storage, slot), expected), other
                tier.unpin([other])
    assert tier.usage().used == 6
    assert tier.leaks() == {"pinned": 0, "writing": 0}
    tier.close()


def test_concurrent_callers_keep_the_tier_consistent(blockio):
    tier = make_tier(16)
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def worker(w: int) -> None:
        try:
            barrier.wait()
            for i in range(150):
                key = b"w%d-%d" % (w, i)
                slots = tier.reserve([key])
                if slots is None:
                    continue
                blockio.write(tier.storage, slots[0], np.full(LAYOUT.block_bytes, w * 50 + i % 50, np.uint8))
                tier.commit([key])
                try:
                    (slot,) = tier.pin([key])
                except StateError:
                    continue  # another worker's reserve evicted it first
                assert np.all(blockio.read(tier.storage, slot) == w * 50 + i % 50)
                tier.unpin([key])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    tier.check_invariants()
    assert tier.leaks() == {"pinned": 0, "writing": 0}
    assert tier.stats.committed == 600
    assert tier.stats.evicted == 600 - tier.usage().used
    tier.close()
