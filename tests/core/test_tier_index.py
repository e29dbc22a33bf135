"""The tier's index under churn (``Tier._compact``): a full tier that deletes a key for every key it
stores keeps its key -> slot dict at the table a copy of the same keys needs, and the compaction
changes nothing a reader or the policy sees.

Invariants checked: after every store of a churning tier, every stored key maps to the slot
``reserve`` gave it, the eviction order is exactly LRU's (an independent model), the policy still
reads the tier's own dict, and the index's table is never bigger than a fresh copy's; a tier filling
up (few deletions) grows its table as any dict does; the allocator's free stack (int32) hands back
slots freed in bulk.
"""

from __future__ import annotations

import random
import sys
from collections import OrderedDict

import numpy as np

from kvtier.core.layout import BlockLayout
from kvtier.core.planner import SlotCount
from kvtier.core.tier import SlotAllocator, Tier
from kvtier.policies import AdaptivePolicy, LRUPolicy

CAPACITY = 1000
BATCH = 32


def new_tier(policy) -> Tier:
    return Tier("t", "host", SlotCount(BlockLayout.contiguous(64), CAPACITY), policy)


def store(tier: Tier, keys: list[bytes]) -> list[int]:
    slots = tier.reserve(keys)
    assert slots is not None
    tier.commit(keys)
    return slots


def test_a_churning_tier_keeps_its_index_compact_and_every_mapping_and_the_lru_order():
    rng = random.Random(1)
    tier = new_tier(LRUPolicy())
    index = tier._slots
    model: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, oldest use first
    fresh_bytes = None
    for step in range(6 * CAPACITY // BATCH):
        keys = [rng.randbytes(16) for _ in range(BATCH)]
        before = list(model)
        if len(model) + BATCH > CAPACITY:  # what LRU must evict: the oldest, less any read just now
            for victim in before[: len(model) + BATCH - CAPACITY]:
                del model[victim]
        for key, slot in zip(keys, store(tier, keys), strict=True):
            model[key] = slot
        if step % 3 == 0 and len(model) > BATCH:  # a read moves a block to the young end
            read = list(model)[rng.randrange(len(model) - BATCH)]
            tier.pin([read])
            tier.unpin([read])
            model.move_to_end(read)
        assert tier._slots is index and tier.policy._order._index is index  # compacted in place
        assert dict(index) == dict(model)
        if step == CAPACITY // BATCH:
            fresh_bytes = sys.getsizeof(dict(index))
        if fresh_bytes is not None:
            assert sys.getsizeof(index) == sys.getsizeof(dict(index)) == fresh_bytes
    tier.check_invariants()
    assert tier.stats.evicted == tier.stats.committed - len(index) > 4 * CAPACITY
    assert tier.evict(CAPACITY) == list(model)  # the whole order, oldest first


def test_an_adaptive_tier_keeps_its_index_compact_under_churn():
    rng = random.Random(2)
    tier = new_tier(AdaptivePolicy())
    for _ in range(6 * CAPACITY // BATCH):
        keys = [rng.randbytes(16) for _ in range(BATCH)]
        admitted = tier.admit(keys)
        keys = keys[: admitted.index(False)] if False in admitted else keys
        if keys:
            store(tier, keys)
    assert tier.stats.evicted > 3 * CAPACITY
    assert sys.getsizeof(tier._slots) == sys.getsizeof(dict(tier._slots))
    tier.check_invariants()


def test_a_tier_filling_up_grows_its_index_as_a_dict_does():
    tier = new_tier(LRUPolicy())
    reference: dict[bytes, int] = {}
    for start in range(0, CAPACITY - BATCH, BATCH):
        keys = [b"%015d" % i for i in range(start, start + BATCH)]
        for key, slot in zip(keys, store(tier, keys), strict=True):
            reference[key] = slot
        assert sys.getsizeof(tier._slots) == sys.getsizeof(reference)
    assert tier._slots == reference


def test_slots_freed_in_bulk_go_back_on_the_int32_free_stack():
    alloc = SlotAllocator(6)
    assert alloc.claim_many(np.array([5, 1], dtype=np.int64)) is None
    assert alloc.allocate(4) == [0, 2, 3, 4]
    alloc.free_many(np.array([5, 1], dtype=np.int64))
    assert sorted(alloc.allocate(2)) == [1, 5]
    assert alloc.allocate(1) is None
