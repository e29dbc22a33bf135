"""``TierTests`` and ``KeyedTierTests``: the ``Tier`` contract (kvtier.core.tier), for any kind of tier.

``KeyedTierTests`` checks the block life every tier shares (reserve, commit, abort, pins that hold
nothing, leaks, keys): all a tier addressed by key does, whose index is its owner's answers (a shared
store's, a node daemon's: by design it has no slots, pins or eviction, and a present key may be stored
again: the owner decides). ``TierTests`` adds what a tier with slots does (a medium's), and a hypothesis
state machine that drives it through random sequences against a model.

A subclass provides the fixture ``tier_kind``: a ``TierKind``, which says how to build a tier of the
kind (``make``, given a ``TierSpec``) and how to reach its slots' bytes (``slots``); parametrize the
fixture to run the suite over several kinds.

Invariants checked (the state machine's in its docstring):
- readers only see READY blocks: lookup counts leading READY keys only, a WRITING block cannot be pinned,
  pin is all or nothing, and try_pin says READY or not;
- reserve -> commit publishes, reserve -> abort releases; misuse (commit or abort of a key that was not
  reserved, a key twice, reserve of a present key, a key that is not 1 to 64 bytes) raises and changes
  nothing; more keys than the tier holds raise CapacityError;
- pins are counted: a block is protected until every pin is released; an unpin below zero raises and
  releases nothing;
- eviction follows the policy (LRU here) and never takes a pinned, WRITING or evicting block; when room
  cannot be made reserve returns None and claims nothing;
- begin_evict keeps the victim READY and readable until end_evict; a reader that pins it meanwhile,
  drop=False, or a fence on its slot keeps it (back in the policy); end_demotion drops what landed or was
  refused for good and keeps what failed;
- a fence (is_fenced) refuses to free a slot: abort raises FenceError and keeps every entry;
- quarantined slots stay taken, out of reach, until released; discard drops unreadable READY blocks but
  not pinned or evicting ones; abort names the blocks refused for good; restore puts blocks back READY
  (a slot taken, given twice or out of range changes nothing; a key present or given twice keeps the
  block that came first and frees the other's slot); claim takes slots that are neither free nor
  readable until restore_claimed puts their blocks back, or release frees them;
- close() refuses while blocks are pinned or being written, and a second close() does nothing; stats
  count what happened;
- committed bytes survive every other operation on the tier, also with four threads at once;
  ``check_invariants`` holds throughout.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvtier.core.errors import CapacityError, FenceError, StateError, TransferError
from kvtier.core.keys import MAX_KEY_BYTES
from kvtier.core.layout import BlockLayout
from kvtier.core.storage import BlockStorage
from kvtier.core.tier import BlockState, Tier, Usage
from kvtier.policies import LRUPolicy, Watermark
from kvtier.policies.base import EvictionPolicy
from kvtier.testing.common import ContractTests

LAYOUT = BlockLayout((16, 48))
"""The blocks of every tier the suite builds: two fragments of different sizes."""


@dataclass(frozen=True)
class TierSpec:
    """The tier a ``TierKind.make`` builds: ``capacity`` slots (a tier addressed by key has none) of
    ``layout``, ordered by ``policy`` with ``watermark``, asking ``is_fenced(name, slot)`` before it frees
    a slot; ``directory``, not yet made, is the tier's own (for a medium that keeps files)."""

    name: str
    capacity: int
    layout: BlockLayout
    policy: EvictionPolicy[bytes]
    watermark: Watermark | None
    is_fenced: Callable[[str, int], bool] | None
    directory: Path


class SlotIO(Protocol):
    """Raw access to a slot's bytes (those of its fragments in layout order), independent of any transfer
    backend: the oracle the suite checks a tier's slots against."""

    def write(self, storage: BlockStorage, slot: int, data: np.ndarray) -> None: ...

    def read(self, storage: BlockStorage, slot: int) -> np.ndarray: ...


class MemorySlots:
    """A slot's bytes in this process's memory (a host slab, CPU tensors, a numpy array): each fragment at
    the address its storage gives, read and written with plain ctypes."""

    @staticmethod
    def write(storage: BlockStorage, slot: int, data: np.ndarray) -> None:
        data = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
        layout = storage.layout
        assert data.nbytes == layout.block_bytes
        addresses = storage.fragment_addresses([slot])[0].tolist()
        for address, offset, size in zip(addresses, layout.offsets.tolist(), layout.fragment_bytes, strict=True):
            ctypes.memmove(address, data.ctypes.data + offset, size)

    @staticmethod
    def read(storage: BlockStorage, slot: int) -> np.ndarray:
        addresses = storage.fragment_addresses([slot])[0].tolist()
        raw = b"".join(ctypes.string_at(a, n) for a, n in zip(addresses, storage.layout.fragment_bytes, strict=True))
        return np.frombuffer(raw, np.uint8).copy()


@dataclass(frozen=True)
class TierKind:
    """A kind of tier under test: ``medium``, what its tiers report (the suite names them after it too);
    ``make``, a new tier of the kind as ``TierSpec`` says; ``slots``, how to reach a slot's bytes (for
    ``TierTests``); ``machine_examples``, the random sequences the state machine runs over it."""

    medium: str
    make: Callable[[TierSpec], Tier]
    slots: SlotIO = MemorySlots
    machine_examples: int = 50


def build(
    kind: TierKind,
    directory: Path,
    capacity: int = 4,
    watermark: Watermark | None = None,
    is_fenced: Callable[[str, int], bool] | None = None,
) -> Tier:
    """A tier of ``kind``, named after its medium, LRU-ordered."""
    return kind.make(TierSpec(kind.medium, capacity, LAYOUT, LRUPolicy(), watermark, is_fenced, directory))


def k(i: int) -> bytes:
    return b"key-%03d" % i


def fill(tier: Tier, keys: list[bytes]) -> list[int]:
    slots = tier.reserve(keys)
    assert slots is not None
    tier.commit(keys)
    return slots


class KeyedTierTests(ContractTests):
    """The block life every tier shares, all a tier addressed by key does; a subclass provides ``tier_kind``."""

    @pytest.fixture
    def tier_kind(self) -> TierKind:
        """The kind of tier under test."""
        raise NotImplementedError(f"{type(self).__name__} provides the fixture tier_kind")

    @pytest.fixture
    def make_tier(self, tier_kind: TierKind, tmp_path: Path) -> Iterator[Callable[..., Tier]]:
        """``make_tier(capacity=4, watermark=None, is_fenced=None)``: a tier of the kind under test (a
        directory of its own); checked, and closed unless blocks are in use, at the end of the test."""
        made: list[Tier] = []
        directories = itertools.count()

        def make(
            capacity: int = 4, watermark: Watermark | None = None, is_fenced: Callable[[str, int], bool] | None = None
        ) -> Tier:
            tier = build(tier_kind, tmp_path / f"tier{next(directories)}", capacity, watermark, is_fenced)
            made.append(tier)
            return tier

        yield make
        for tier in made:
            tier.check_invariants()
            if not any(tier.leaks().values()):
                tier.close()  # (again, for a test that closed it: a second close does nothing)

    @pytest.fixture
    def tier(self, make_tier: Callable[..., Tier]) -> Tier:
        return make_tier()

    # --- the block life every tier shares ------------------------------------------------------------

    def test_reserve_then_commit_publishes_and_abort_releases(self, tier):
        assert tier.reserve([k(0), k(1), k(2)]) is not None
        assert [tier.state(key) for key in (k(0), k(1), k(2))] == [BlockState.WRITING] * 3
        assert tier.lookup([k(0)]) == 0 and not tier.try_pin(k(0))
        assert tier.leaks() == {"pinned": 0, "writing": 3}
        tier.commit([k(0), k(1)])
        assert tier.abort([k(2)]) == []
        assert tier.lookup([k(0), k(1), k(2)]) == 2
        assert [tier.state(key) for key in (k(0), k(1), k(2))] == [BlockState.READY] * 2 + [BlockState.FREE]
        assert (tier.stats.committed, tier.stats.aborted, tier.stats.bytes_in) == (2, 1, 2 * LAYOUT.block_bytes)
        assert tier.try_pin(k(0))
        tier.unpin([k(0)])
        assert tier.leaks() == {"pinned": 0, "writing": 0}

    def test_commit_or_abort_of_a_key_not_reserved_or_twice_raises_and_changes_nothing(self, tier):
        tier.reserve([k(0), k(1)])
        for bad in ([k(0), k(9)], [k(0), k(0)]):
            for method in (tier.commit, tier.abort):
                with pytest.raises(StateError):
                    method(bad)
        assert tier.state(k(0)) is tier.state(k(1)) is BlockState.WRITING
        assert (tier.stats.committed, tier.stats.aborted) == (0, 0)
        tier.commit([k(0)])
        with pytest.raises(StateError):
            tier.commit([k(0)])  # READY now
        tier.abort([k(1)])

    def test_a_key_reserved_twice_raises_and_claims_nothing(self, tier):
        tier.reserve([k(1)])
        with pytest.raises(StateError):
            tier.reserve([k(2), k(1)])  # WRITING already
        with pytest.raises(StateError):
            tier.reserve([k(3), k(3)])
        assert tier.state(k(2)) is tier.state(k(3)) is BlockState.FREE
        assert tier.leaks()["writing"] == 1
        tier.abort([k(1)])

    @pytest.mark.parametrize("bad", [b"", b"x" * (MAX_KEY_BYTES + 1), "text", 7], ids=["empty", "long", "str", "int"])
    def test_a_key_that_is_not_1_to_64_bytes_is_refused_before_anything_is_reserved(self, tier, bad):
        with pytest.raises((TypeError, ValueError)):
            tier.reserve([k(0), bad])
        assert tier.state(k(0)) is BlockState.FREE and tier.leaks()["writing"] == 0

    def test_close_refuses_blocks_being_written(self, tier):
        tier.reserve([k(0)])
        with pytest.raises(StateError, match="writing|being stored"):
            tier.close()
        tier.commit([k(0)])
        tier.close()


class TierTests(KeyedTierTests):
    """The tier contract of a tier with slots; a subclass provides ``tier_kind``."""

    @pytest.fixture
    def slot_io(self, tier_kind: TierKind) -> SlotIO:
        return tier_kind.slots

    # --- lookup, reserve, commit, abort --------------------------------------------------------------

    def test_lookup_counts_leading_ready_keys_only(self, tier):
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
        assert tier.ready_keys() == [k(0), k(2), k(1)]
        assert tier.leaks() == {"pinned": 0, "writing": 0}

    def test_writing_blocks_are_invisible_to_pin(self, tier):
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
        tier.commit([k(1)])

    def test_reserve_commit_publishes_and_counts(self, tier, slot_io, rng):
        keys = [k(0), k(1), k(2)]
        slots = tier.reserve(keys)
        assert len(set(slots)) == 3 and all(0 <= s < 4 for s in slots)
        assert tier.usage().used == 3 and tier.usage().free == 1
        assert [tier.state(key) for key in keys] == [BlockState.WRITING] * 3
        assert tier.slots(keys) == slots
        data = rng.integers(0, 256, (3, LAYOUT.block_bytes), dtype=np.uint8)
        for slot, row in zip(slots, data, strict=True):
            slot_io.write(tier.storage, slot, row)
        tier.commit(keys)
        assert [tier.state(key) for key in keys] == [BlockState.READY] * 3
        assert tier.pin(keys) == slots
        for slot, row in zip(slots, data, strict=True):
            assert np.array_equal(slot_io.read(tier.storage, slot), row)
        tier.unpin(keys)
        assert tier.stats.committed == 3
        assert tier.stats.bytes_in == 3 * LAYOUT.block_bytes
        assert tier.leaks() == {"pinned": 0, "writing": 0}

    def test_commit_with_pin_pins_in_the_same_step(self, tier):
        tier.reserve([k(0), k(1)])
        tier.commit([k(0), k(1)], pin=True)
        assert tier.leaks() == {"pinned": 2, "writing": 0}
        assert tier.evict(4) == []
        tier.unpin([k(0), k(1)])
        assert sorted(tier.evict(4)) == [k(0), k(1)]

    def test_abort_releases_the_slots(self, tier):
        slots = tier.reserve([k(0), k(1)])
        tier.abort([k(0), k(1)])
        assert tier.state(k(0)) is BlockState.FREE and tier.state(k(1)) is BlockState.FREE
        assert tier.usage().used == 0
        assert tier.stats.aborted == 2 and tier.stats.committed == 0
        assert sorted(tier.reserve([k(2), k(3), k(4), k(5)])) == [0, 1, 2, 3]
        assert set(slots) <= {0, 1, 2, 3}
        tier.abort([k(2), k(3), k(4), k(5)])

    def test_abort_of_a_ready_or_absent_key_raises_and_aborts_none(self, tier):
        fill(tier, [k(0)])
        tier.reserve([k(1)])
        with pytest.raises(StateError):
            tier.abort([k(1), k(0)])
        with pytest.raises(StateError):
            tier.abort([k(1), k(9)])
        assert tier.state(k(0)) is BlockState.READY and tier.state(k(1)) is BlockState.WRITING
        assert tier.stats.aborted == 0
        tier.abort([k(1)])

    def test_reserve_more_than_capacity_raises_capacity_error(self, tier):
        with pytest.raises(CapacityError):
            tier.reserve([k(i) for i in range(5)])
        assert issubclass(CapacityError, ValueError)
        assert tier.usage().used == 0

    def test_reserve_of_a_present_key_raises_and_claims_nothing(self, tier):
        fill(tier, [k(0)])
        with pytest.raises(StateError):
            tier.reserve([k(2), k(0)])  # READY
        assert tier.usage().used == 1 and tier.state(k(2)) is BlockState.FREE

    def test_slots_of_an_absent_key_raises(self, tier):
        fill(tier, [k(0)])
        with pytest.raises(StateError):
            tier.slots([k(0), k(1)])

    # --- pins ------------------------------------------------------------------------------------------

    def test_pins_are_counted(self, tier):
        fill(tier, [k(0), k(1)])
        tier.pin([k(0)])
        tier.pin([k(0)])
        assert tier.leaks()["pinned"] == 1
        tier.unpin([k(0)])
        assert tier.evict(4) == [k(1)]  # k(0) still has one pin
        tier.unpin([k(0)])
        assert tier.leaks()["pinned"] == 0
        assert tier.evict(4) == [k(0)]

    def test_a_pin_that_is_no_use_leaves_the_eviction_order_alone(self, tier):
        fill(tier, [k(0), k(1)])  # LRU: k(0) is the oldest
        tier.pin([k(0)], use=False)
        tier.unpin([k(0)])
        assert tier.evict(1) == [k(0)]  # still the oldest
        fill(tier, [k(0)])
        tier.pin([k(1)])  # a use: k(1) becomes the newest
        tier.unpin([k(1)])
        assert tier.evict(1) == [k(0)]

    def test_pin_the_same_key_twice_in_one_call_counts_twice(self, tier):
        fill(tier, [k(0)])
        tier.pin([k(0), k(0)])
        tier.unpin([k(0)])
        assert tier.evict(1) == []
        tier.unpin([k(0)])
        assert tier.evict(1) == [k(0)]

    def test_try_pin_pins_a_ready_block_only(self, tier):
        fill(tier, [k(0)])
        tier.reserve([k(1)])
        assert tier.try_pin(k(0)) and not tier.try_pin(k(1)) and not tier.try_pin(k(9))
        assert tier.leaks() == {"pinned": 1, "writing": 1}
        assert tier.evict(4) == []
        tier.unpin([k(0)])
        tier.commit([k(1)])

    def test_unpin_of_an_unpinned_block_raises_and_releases_none(self, tier):
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

    def test_reserve_evicts_the_least_recently_used(self, tier):
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

    def test_reserve_never_evicts_pinned_writing_or_evicting_blocks(self, tier):
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

    def test_reserve_returns_none_and_claims_nothing_when_room_cannot_be_made(self, tier):
        fill(tier, [k(0), k(1), k(2), k(3)])
        tier.pin([k(0), k(1), k(2)])
        assert tier.reserve([k(5), k(6)]) is None
        assert tier.state(k(5)) is BlockState.FREE and tier.state(k(6)) is BlockState.FREE
        assert tier.lookup([k(0), k(1), k(2)]) == 3
        assert tier.leaks() == {"pinned": 3, "writing": 0}
        tier.unpin([k(0), k(1), k(2)])

    def test_reserve_without_eviction_returns_none_when_full(self, tier):
        fill(tier, [k(0), k(1), k(2)])
        assert tier.reserve([k(3), k(4)], allow_evict=False) is None
        assert tier.lookup([k(0), k(1), k(2)]) == 3
        assert tier.stats.evicted == 0
        assert tier.reserve([k(3)], allow_evict=False) is not None
        tier.abort([k(3)])

    def test_evict_takes_up_to_n_unpinned_in_lru_order(self, tier):
        fill(tier, [k(0), k(1), k(2), k(3)])
        tier.pin([k(1)])
        assert tier.evict(2) == [k(0), k(2)]
        assert tier.evict(5) == [k(3)]
        assert tier.evict(5) == []
        assert tier.evict(0) == []
        assert tier.lookup([k(1)]) == 1 and tier.usage().used == 1
        assert tier.stats.evicted == 3
        tier.unpin([k(1)])

    def test_begin_evict_keeps_the_victim_readable_until_end_evict(self, tier, slot_io, rng):
        slots = fill(tier, [k(0), k(1)])
        data = rng.integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8)
        slot_io.write(tier.storage, slots[0], data)
        assert tier.begin_evict(1) == [(k(0), slots[0])]
        assert tier.state(k(0)) is BlockState.READY
        assert tier.lookup([k(0), k(1)]) == 2
        assert np.array_equal(slot_io.read(tier.storage, slots[0]), data)
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

    def test_end_demotion_drops_landed_and_refused_victims_and_keeps_failed_ones(self, tier):
        fill(tier, [k(0), k(1), k(2)])
        assert [key for key, _ in tier.begin_evict(3)] == [k(0), k(1), k(2)]
        assert tier.end_demotion(ok=[k(0)], failed=[k(1), k(2)], refused=[k(2)]) == [k(0), k(2)]
        assert [tier.state(key) for key in (k(0), k(1), k(2))] == [BlockState.FREE, BlockState.READY, BlockState.FREE]
        assert (tier.stats.demoted, tier.stats.demotion_refused, tier.stats.evicted) == (1, 1, 2)
        assert tier.leaks()["pinned"] == 0 and tier.begin_evict(1) == [(k(1), tier.slots([k(1)])[0])]  # offered again
        tier.end_evict([k(1)], drop=False)

    def test_pin_leading_pins_the_ready_run_only(self, tier):
        slots = fill(tier, [k(0), k(1), k(3)])
        assert tier.pin_leading([k(0), k(1), k(2), k(3)]) == slots[:2]
        assert tier.leaks()["pinned"] == 2 and tier.pin_leading([k(2), k(3)]) == []
        tier.unpin([k(0), k(1)])

    def test_a_reader_pinning_a_victim_keeps_it(self, tier):
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

    def test_end_evict_without_drop_puts_the_block_back_as_most_recent(self, tier):
        fill(tier, [k(0), k(1), k(2)])
        assert [key for key, _ in tier.begin_evict(1)] == [k(0)]
        assert tier.end_evict([k(0)], drop=False) == []
        assert tier.lookup([k(0)]) == 1
        assert tier.leaks()["pinned"] == 0
        assert tier.evict(3) == [k(1), k(2), k(0)]
        assert tier.stats.evicted == 3

    def test_end_evict_of_a_block_not_being_evicted_raises_and_finishes_none(self, tier):
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

    # --- quarantine, discard, refuse, restore ----------------------------------------------------------

    def test_quarantined_slots_stay_taken_and_out_of_reach_until_released(self, tier):
        slots = tier.reserve([k(0), k(1)])
        assert sorted(tier.quarantine([k(0), k(1)])) == sorted(slots)
        assert tier.state(k(0)) is BlockState.FREE and tier.stats.aborted == 2  # the keys left...
        assert tier.usage().used == 2 and tier.leaks() == {"pinned": 0, "writing": 2}  # ...their slots did not
        with pytest.raises(StateError):
            tier.close()
        fresh = tier.reserve([k(0), k(2)])  # a key that was quarantined may be written again, elsewhere
        assert not set(fresh) & set(slots)
        assert tier.reserve([k(3)], allow_evict=True) is None  # the quarantined slots are not free
        with pytest.raises(StateError):
            tier.lift_quarantine([fresh[0]])  # not quarantined
        with pytest.raises(StateError):
            tier.lift_quarantine([slots[0], slots[0]])
        tier.lift_quarantine(slots)
        assert tier.usage().used == 2 and tier.leaks() == {"pinned": 0, "writing": 2}
        tier.abort([k(0), k(2)])
        assert tier.usage().used == 0

    def test_quarantine_of_a_key_not_being_written_raises_and_quarantines_none(self, tier):
        fill(tier, [k(0)])
        tier.reserve([k(1)])
        with pytest.raises(StateError):
            tier.quarantine([k(1), k(0)])
        assert tier.state(k(1)) is BlockState.WRITING and tier.usage().used == 2
        tier.abort([k(1)])

    def test_discard_drops_unreadable_blocks_but_not_pinned_or_evicting_ones(self, tier):
        fill(tier, [k(0), k(1), k(2)])
        tier.reserve([k(3)])
        tier.pin([k(1)])
        tier.begin_evict(1)  # k(0)
        assert tier.discard([k(0), k(1), k(2), k(3), k(9)]) == [k(2)]
        assert tier.state(k(2)) is BlockState.FREE and tier.stats.read_errors == 1
        assert tier.state(k(0)) is tier.state(k(1)) is BlockState.READY and tier.state(k(3)) is BlockState.WRITING
        tier.end_evict([k(0)], drop=False)
        tier.unpin([k(1)])
        tier.abort([k(3)])

    def test_abort_names_the_blocks_the_storage_refused_for_good(self, tier):
        tier.reserve([k(0), k(1), k(2)])
        tier.refuse([k(1)])
        with pytest.raises(StateError):
            tier.refuse([k(2), k(9)])  # not reserved: marks none
        assert tier.abort([k(0), k(1), k(2)]) == [k(1)]
        assert tier.usage().used == 0

    def test_restore_puts_blocks_back_ready_oldest_use_first(self, tier):
        assert tier.restore([k(5), k(6)], [2, 0]) == 2
        assert tier.lookup([k(5), k(6)]) == 2 and tier.slots([k(5), k(6)]) == [2, 0]
        tier.reserve([k(7)])  # being written: not READY, so not among the blocks a snapshot lists
        assert tier.ready_blocks() == ([k(5), k(6)], [2, 0]) == (tier.ready_keys(), tier.slots(tier.ready_keys()))
        tier.abort([k(7)])
        with pytest.raises(StateError):
            tier.restore([k(7)], [2])  # a slot taken
        assert tier.reserve([k(8), k(9)]) is not None and tier.reserve([k(10)]) is not None  # evicts k(5), the oldest
        assert tier.state(k(5)) is BlockState.FREE and tier.state(k(6)) is BlockState.READY
        tier.abort([k(8), k(9), k(10)])

    @pytest.mark.parametrize(
        "blocks",
        [
            [(k(1), 1), (k(2), 0)],  # a slot taken
            [(k(1), 1), (k(2), 1)],  # a slot twice in one call
            [(k(1), 1), (k(2), 4)],  # a slot out of range
            [(k(1), 1), (k(2), -1)],
        ],
        ids=["slot-taken", "slot-twice", "slot-past-end", "slot-negative"],
    )
    def test_a_restore_naming_a_slot_it_cannot_take_changes_nothing(self, tier_kind, tmp_path, blocks):
        tier = build(tier_kind, tmp_path)  # not make_tier's: it checks at the end
        try:
            tier.restore([k(0)], [0])
            with pytest.raises(StateError):
                tier.restore([key for key, _ in blocks], [slot for _, slot in blocks])
            tier.check_invariants()
            assert tier.state(k(1)) is tier.state(k(2)) is BlockState.FREE and tier.usage().used == 1
            tier.restore([k(1), k(2)], [1, 2])  # the slots the failed call named are still free
            tier.check_invariants()
            assert tier.evict(3) == [k(0), k(1), k(2)]  # and every restored block is known to the policy
        finally:
            tier.close()

    @pytest.mark.parametrize(
        "keys,slots,freed",
        [
            ([k(1), k(0), k(2)], [1, 3], 2),  # a key already here (k(0), in slot 0)
            ([k(1), k(2), k(1)], [1, 2], 3),  # a key twice in one call: its first slot
        ],
        ids=["key-present", "key-twice"],
    )
    def test_a_restore_naming_a_key_the_tier_holds_keeps_what_came_first(self, make_tier, keys, slots, freed):
        tier = make_tier()
        tier.restore([k(0)], [0])
        assert tier.restore(keys, [1, 2, 3]) == 2
        assert tier.ready_keys() == [k(0), k(1), k(2)] and tier.slots([k(0), k(1), k(2)]) == [0, *slots]
        assert tier.usage().used == 3  # the other slot is free again
        tier.check_invariants()
        assert tier.reserve([k(9)]) == [freed]
        tier.abort([k(9)])
        assert tier.evict(3) == [k(0), k(1), k(2)]  # every block back is known to the policy, in order

    def test_claimed_slots_are_taken_yet_unreadable_until_their_blocks_come_back(self, make_tier):
        tier = make_tier()
        fill(tier, [k(0)])  # slot 0
        claimed = tier.claim([3, 1])
        assert tier.usage().used == 3 and tier.lookup([k(1)]) == 0 and tier.state(k(1)) is BlockState.FREE
        tier.check_invariants()
        assert tier.reserve([k(1)]) == [2]  # a store of a key whose block waits here wins ...
        tier.commit([k(1)])
        assert tier.reserve([k(8)], allow_evict=False) is None  # (no slot is free, none claimed is handed out)
        with pytest.raises(StateError):
            tier.claim([1])  # claimed already
        assert tier.restore_claimed([k(1), k(3)], claimed) == 1  # ... its block from slot 3 is dropped
        assert tier.slots([k(1), k(3)]) == [2, 1] and tier.usage().used == 3
        with pytest.raises(StateError):
            tier.restore_claimed([k(4)], claimed[:1])  # slot 3 is free again, not claimed
        with pytest.raises(StateError):
            tier.release(claimed[1:])  # slot 1 holds k(3) now
        tier.check_invariants()
        again = tier.claim([3])
        tier.release(again)
        assert tier.usage().used == 3 and tier.reserve([k(9)]) == [3]
        tier.abort([k(9)])
        tier.check_invariants()

    # --- watermark, fences, close, stats ---------------------------------------------------------------

    def test_excess_follows_the_watermark(self, make_tier):
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

    def test_a_fence_refuses_abort_and_keeps_every_entry(self, make_tier):
        fenced: set[tuple[str, int]] = set()
        tier = make_tier(is_fenced=lambda name, slot: (name, slot) in fenced)  # asked with the tier's name
        slots = tier.reserve([k(0), k(1)])
        fenced.add((tier.name, slots[1]))
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

    def test_a_fenced_victim_is_kept_and_stays_evictable(self, make_tier):
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

    def test_close_refuses_pinned_or_writing_blocks(self, tier):
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

    def test_stats_and_record(self, tier):
        fill(tier, [k(0), k(1), k(2)])
        tier.reserve([k(3)])
        tier.abort([k(3)])
        tier.evict(2)
        tier.count(hits=2, bytes_out=128)
        tier.count(hits=1)
        assert tier.stats.as_dict() == {
            "committed": 3,
            "aborted": 1,
            "evicted": 2,
            "demoted": 0,
            "hits": 3,
            "bytes_in": 3 * LAYOUT.block_bytes,
            "bytes_out": 128,
            "read_errors": 0,
            "damaged": 0,
            "incompressible": 0,
            "demotion_refused": 0,
            "declined": 0,
            "policy_errors": 0,
        }
        with pytest.raises(AttributeError):
            tier.count(nonsense=1)

    def test_usage_and_repr(self, make_tier, tier_kind):
        tier = make_tier(8)
        fill(tier, [k(0), k(1)])
        usage = tier.usage()
        assert (usage.used, usage.capacity, usage.free, usage.fraction) == (2, 8, 6, 0.25)
        assert tier.capacity == 8 and tier.block_bytes == 64
        text = repr(tier)
        assert tier.name == tier.medium == tier_kind.medium
        assert f"name='{tier.name}'" in text and f"medium='{tier.medium}'" in text
        assert "used=2/8" in text and "64 B" in text

    def test_committed_bytes_survive_other_traffic(self, make_tier, slot_io, rng):
        tier = make_tier(6)
        written = {}
        for i in range(30):
            key = k(i)
            slots = tier.reserve([key])
            data = rng.integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8)
            slot_io.write(tier.storage, slots[0], data)
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
                    assert np.array_equal(slot_io.read(tier.storage, slot), expected), other
                    tier.unpin([other])
        assert tier.usage().used == 6
        assert tier.leaks() == {"pinned": 0, "writing": 0}

    def test_concurrent_callers_keep_the_tier_consistent(self, make_tier, slot_io):
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
                    slot_io.write(tier.storage, slots[0], np.full(LAYOUT.block_bytes, w * 50 + i % 50, np.uint8))
                    tier.commit([key])
                    try:
                        (slot,) = tier.pin([key])
                    except StateError:
                        continue  # another worker's reserve evicted it first
                    assert np.all(slot_io.read(tier.storage, slot) == w * 50 + i % 50)
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

    def test_tier_state_machine(self, tier_kind, tmp_path):
        directories = itertools.count()  # a directory per run: a disk slab is locked until its tier closes

        class Machine(TierMachine):
            def __init__(self) -> None:
                super().__init__(tier_kind, tmp_path / f"run{next(directories)}")

        run_state_machine_as_test(
            Machine,
            settings=settings(
                max_examples=tier_kind.machine_examples,
                stateful_step_count=50,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )


# --- the state machine -----------------------------------------------------------------------------


CAPACITY = 8
POOL = [b"k%02d" % i for i in range(13)]


@dataclass
class Block:
    slot: int
    writing: bool = True
    reader_pins: int = 0
    evicting: bool = False
    data: np.ndarray | None = None

    @property
    def pins(self) -> int:
        return self.reader_pins + (1 if self.evicting else 0)


class TierMachine(RuleBasedStateMachine):
    """A tier with slots under random sequences of reserve / commit / abort / pin / unpin / evict /
    begin_evict / end_evict / lookup, with fences (``is_fenced``) switched on and off, checked step by step
    against a small model (8 slots, 13 keys, so the tier is often full and keys collide).

    Invariants checked after every step (besides ``Tier.check_invariants``):
    - usage never exceeds capacity and equals the number of present blocks;
    - no slot is owned by two keys; every present key keeps the slot reserve gave it;
    - every key's state (FREE / WRITING / READY) is the model's: so a pinned, WRITING or evicting block is
      never dropped, and an uncommitted block is never visible to lookup or pin;
    - eviction takes exactly the least recently used unprotected blocks, in order;
    - pin counts are the model's (never negative); misuse (reserve of a present key, commit or abort of
      a key not reserved, pin of a block not READY, unpin below zero) raises and changes nothing;
    - a fenced slot is never freed: abort raises FenceError and keeps everything, a fenced victim stays;
    - the bytes written into a slot before commit are unchanged whenever the READY block is read.
    At teardown every pin, eviction and write is released, ``leaks()`` is all zero and close() succeeds.
    """

    def __init__(self, kind: TierKind, directory: Path) -> None:
        super().__init__()
        self.fenced: set[int] = set()  # slots a (pretend) job in flight still uses
        self.slot_io = kind.slots
        self.tier = build(
            kind, directory, CAPACITY, None, lambda name, slot: name == kind.medium and slot in self.fenced
        )
        self.blocks: dict[bytes, Block] = {}
        self.order: list[bytes] = []  # the LRU order the policy should hold: READY, not evicting
        self.evicted = 0

    # --- helpers ---------------------------------------------------------------------------

    def _read(self, slot: int) -> np.ndarray:
        return self.slot_io.read(self.tier.storage, slot)

    def _write(self, slot: int, data: np.ndarray) -> None:
        self.slot_io.write(self.tier.storage, slot, data)

    def _intact(self, block: Block) -> bool:
        """Whether a committed block's slot holds the bytes written before its commit."""
        return block.data is not None and np.array_equal(self._read(block.slot), block.data)

    def _evict_model(self, n: int) -> list[bytes]:
        """What Tier.evict(n) should do: take the n least recent unprotected blocks, drop the unfenced
        ones, put the fenced ones back as most recent. Returns the dropped keys."""
        victims = [key for key in self.order if self.blocks[key].pins == 0][: max(n, 0)]
        dropped = [key for key in victims if self.blocks[key].slot not in self.fenced]
        for key in victims:
            self.order.remove(key)
        for key in victims:
            if key in dropped:
                del self.blocks[key]
                self.evicted += 1
            else:
                self.order.append(key)
        return dropped

    def _snapshot(self):
        return (
            {k: (b.slot, b.writing, b.reader_pins, b.evicting) for k, b in self.blocks.items()},
            list(self.order),
            self.tier.stats.as_dict(),
        )

    def _assert_unchanged(self, snapshot) -> None:
        blocks, order, stats = snapshot
        for key in POOL:
            if key in blocks:
                slot, writing, _, _ = blocks[key]
                assert self.tier.state(key) is (BlockState.WRITING if writing else BlockState.READY)
                assert self.tier.slots([key]) == [slot]
            else:
                assert self.tier.state(key) is BlockState.FREE
        assert self.tier.stats.as_dict() == stats
        assert self.tier.leaks() == {
            "pinned": sum(1 for b in self.blocks.values() if b.pins),
            "writing": len(self._writing()),
        }

    def _keys(self, which) -> list[bytes]:
        return sorted(key for key, b in self.blocks.items() if which(b))

    def _writing(self) -> list[bytes]:
        return self._keys(lambda b: b.writing)

    def _ready(self) -> list[bytes]:
        return self._keys(lambda b: not b.writing)

    def _evicting(self) -> list[bytes]:
        return self._keys(lambda b: b.evicting)

    def _reader_pinned(self) -> list[bytes]:
        return self._keys(lambda b: b.reader_pins > 0)

    def _absent(self) -> list[bytes]:
        return [key for key in POOL if key not in self.blocks]

    # --- writing ---------------------------------------------------------------------------

    @rule(data=st.data(), allow_evict=st.booleans())
    def reserve(self, data, allow_evict):
        keys = data.draw(st.lists(st.sampled_from(self._absent()), min_size=1, max_size=4, unique=True))
        short = len(keys) - (CAPACITY - len(self.blocks))
        dropped = self._evict_model(short) if short > 0 and allow_evict else []
        slots = self.tier.reserve(keys, allow_evict)
        if short > 0 and len(dropped) < short:
            assert slots is None
            for key in keys:
                assert self.tier.state(key) is BlockState.FREE
            return
        assert slots is not None and len(slots) == len(keys)
        owned = {b.slot for b in self.blocks.values()}
        assert len(set(slots)) == len(slots) and not owned & set(slots)
        assert all(0 <= s < CAPACITY for s in slots)
        for key, slot in zip(keys, slots, strict=True):
            self.blocks[key] = Block(slot)

    @precondition(lambda self: self.blocks)
    @rule(data=st.data())
    def reserve_present(self, data):
        present = data.draw(st.sampled_from(sorted(self.blocks)))
        others = data.draw(st.lists(st.sampled_from(self._absent()), max_size=2, unique=True))
        keys = data.draw(st.permutations([present, *others]))
        snapshot = self._snapshot()
        with pytest.raises(StateError):
            self.tier.reserve(keys)
        self._assert_unchanged(snapshot)

    @precondition(lambda self: self._writing())
    @rule(data=st.data(), pin=st.booleans(), seed=st.integers(0, 2**32 - 1))
    def commit(self, data, pin, seed):
        keys = data.draw(st.lists(st.sampled_from(self._writing()), min_size=1, unique=True))
        rng = np.random.default_rng(seed)
        for key in keys:  # the job's copy lands before the commit
            block = self.blocks[key]
            block.data = rng.integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8)
            self._write(block.slot, block.data)
        self.tier.commit(keys, pin=pin)
        for key in keys:
            block = self.blocks[key]
            block.writing = False
            block.reader_pins += int(pin)
            self.order.append(key)

    @rule(data=st.data(), what=st.sampled_from(["commit", "abort"]))
    def commit_or_abort_not_reserved(self, data, what):
        wrong = data.draw(
            st.sampled_from([key for key in POOL if not (key in self.blocks and self.blocks[key].writing)])
        )
        others = (
            data.draw(st.lists(st.sampled_from(self._writing()), max_size=2, unique=True)) if self._writing() else []
        )
        keys = data.draw(st.permutations([wrong, *others]))
        snapshot = self._snapshot()
        with pytest.raises(StateError):
            getattr(self.tier, what)(keys)
        self._assert_unchanged(snapshot)

    @precondition(lambda self: self._writing())
    @rule(data=st.data())
    def abort(self, data):
        keys = data.draw(st.lists(st.sampled_from(self._writing()), min_size=1, unique=True))
        if any(self.blocks[key].slot in self.fenced for key in keys):
            snapshot = self._snapshot()
            with pytest.raises(FenceError):
                self.tier.abort(keys)
            self._assert_unchanged(snapshot)
            return
        self.tier.abort(keys)
        for key in keys:
            del self.blocks[key]

    @rule(slot=st.integers(0, CAPACITY - 1), on=st.booleans())
    def fence(self, slot, on):
        (self.fenced.add if on else self.fenced.discard)(slot)

    # --- reading ---------------------------------------------------------------------------

    @precondition(lambda self: self._ready())
    @rule(data=st.data())
    def pin(self, data):
        keys = data.draw(st.lists(st.sampled_from(self._ready()), min_size=1, max_size=3))
        slots = self.tier.pin(keys)
        assert slots == [self.blocks[key].slot for key in keys]
        for key in keys:
            block = self.blocks[key]
            block.reader_pins += 1
            if not block.evicting:
                self.order.remove(key)
                self.order.append(key)
            assert self._intact(block)

    @rule(data=st.data())
    def pin_not_ready(self, data):
        wrong = data.draw(st.sampled_from([key for key in POOL if key not in self.blocks or self.blocks[key].writing]))
        others = data.draw(st.lists(st.sampled_from(self._ready()), max_size=2)) if self._ready() else []
        keys = data.draw(st.permutations([wrong, *others]))
        snapshot = self._snapshot()
        with pytest.raises(StateError):
            self.tier.pin(keys)
        self._assert_unchanged(snapshot)

    @precondition(lambda self: self._reader_pinned())
    @rule(data=st.data())
    def unpin(self, data):
        keys = data.draw(st.lists(st.sampled_from(self._reader_pinned()), min_size=1, max_size=3))
        counts = {key: keys.count(key) for key in keys}
        if any(counts[key] > self.blocks[key].reader_pins for key in counts):
            return  # would release a pin this reader does not hold
        self.tier.unpin(keys)
        for key in keys:
            self.blocks[key].reader_pins -= 1

    @rule(data=st.data())
    def unpin_below_zero(self, data):
        key = data.draw(st.sampled_from(POOL))
        held = self.blocks[key].pins if key in self.blocks else 0
        others = (
            data.draw(st.lists(st.sampled_from(self._reader_pinned()), max_size=1)) if self._reader_pinned() else []
        )
        keys = data.draw(st.permutations([key] * (held + 1) + [o for o in others if o != key]))
        snapshot = self._snapshot()
        with pytest.raises(StateError):
            self.tier.unpin(keys)
        self._assert_unchanged(snapshot)

    @rule(keys=st.lists(st.sampled_from(POOL), max_size=5))
    def lookup(self, keys):
        expected = 0
        for key in keys:
            if key not in self.blocks or self.blocks[key].writing:
                break
            expected += 1
        assert self.tier.lookup(keys) == expected

    # --- eviction --------------------------------------------------------------------------

    @rule(n=st.integers(0, 4))
    def evict(self, n):
        assert self.tier.evict(n) == self._evict_model(n)

    @rule(n=st.integers(0, 3))
    def begin_evict(self, n):
        expected = [key for key in self.order if self.blocks[key].pins == 0][:n]
        got = self.tier.begin_evict(n)
        assert got == [(key, self.blocks[key].slot) for key in expected]
        for key in expected:
            self.order.remove(key)
            self.blocks[key].evicting = True

    @precondition(lambda self: self._evicting())
    @rule(data=st.data(), drop=st.booleans())
    def end_evict(self, data, drop):
        keys = data.draw(st.lists(st.sampled_from(self._evicting()), min_size=1, unique=True))
        dropped = [
            key
            for key in keys
            if drop and self.blocks[key].reader_pins == 0 and self.blocks[key].slot not in self.fenced
        ]
        for key in keys:
            # the victim is still READY and its bytes intact until now
            assert self.tier.lookup([key]) == 1
            assert self._intact(self.blocks[key])
        assert self.tier.end_evict(keys, drop=drop) == dropped
        for key in keys:
            self.blocks[key].evicting = False
            if key in dropped:
                del self.blocks[key]
                self.evicted += 1
            else:
                self.order.append(key)

    # --- invariants ------------------------------------------------------------------------

    @invariant()
    def consistent(self):
        tier = self.tier
        tier.check_invariants()
        usage = tier.usage()
        assert usage.used == len(self.blocks) <= CAPACITY
        assert usage.evicting == len(self._evicting())
        slots = [b.slot for b in self.blocks.values()]
        assert len(slots) == len(set(slots))
        for key in POOL:
            block = self.blocks.get(key)
            if block is None:
                assert tier.state(key) is BlockState.FREE
            else:
                assert tier.state(key) is (BlockState.WRITING if block.writing else BlockState.READY)
                assert tier.slots([key]) == [block.slot]
                assert block.reader_pins >= 0
                if block.writing:
                    assert tier.lookup([key]) == 0
        assert tier.leaks() == {
            "pinned": sum(1 for b in self.blocks.values() if b.pins),
            "writing": len(self._writing()),
        }
        assert len(tier.policy) == len(self.order)
        assert tier.stats.evicted == self.evicted

    @invariant()
    def committed_bytes_intact(self):
        for block in self.blocks.values():
            if not block.writing:
                assert self._intact(block)

    def teardown(self):
        tier = self.tier
        self.fenced.clear()
        evicting = self._evicting()
        if evicting:
            tier.end_evict(evicting, drop=False)
        for key in self._reader_pinned():
            tier.unpin([key] * self.blocks[key].reader_pins)
        writing = self._writing()
        if writing:
            tier.abort(writing)
        tier.check_invariants()
        assert tier.leaks() == {"pinned": 0, "writing": 0}
        tier.close()
