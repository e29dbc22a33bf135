"""A Tier under random sequences of reserve / commit / abort / pin / unpin / evict / begin_evict /
end_evict / lookup, with fences (``is_fenced``) switched on and off, checked step by step against a
small model (8 slots, 13 keys, so the tier is often full and keys collide).

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

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.core.errors import FenceError, StateError
from kvtier.core.layout import BlockLayout
from kvtier.core.tier import BlockState
from kvtier.policies import LRUPolicy
from kvtier.tiers.host import host_tier

CAPACITY = 8
LAYOUT = BlockLayout((8, 24))
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
    def __init__(self) -> None:
        super().__init__()
        self.fenced: set[int] = set()  # slots a (pretend) job in flight still uses
        self.tier = host_tier("host", CAPACITY, LAYOUT, LRUPolicy(),
                              is_fenced=lambda name, slot: name == "host" and slot in self.fenced)
        self.blocks: dict[bytes, Block] = {}
        self.order: list[bytes] = []  # the LRU order the policy should hold: READY, not evicting
        self.evicted = 0

    # --- helpers ---------------------------------------------------------------------------

    def _read(self, slot: int) -> np.ndarray:
        addresses = self.tier.storage.fragment_addresses([slot])[0].tolist()
        fragments = zip(addresses, LAYOUT.fragment_bytes, strict=True)
        return np.frombuffer(b"".join(ctypes.string_at(a, n) for a, n in fragments), np.uint8)

    def _write(self, slot: int, data: np.ndarray) -> None:
        addresses = self.tier.storage.fragment_addresses([slot])[0].tolist()
        for a, off, n in zip(addresses, LAYOUT.offsets.tolist(), LAYOUT.fragment_bytes, strict=True):
            ctypes.memmove(a, data.ctypes.data + off, n)

    def _evict_model(self, n: int) -> list[bytes]:
        """What Tier.evict(n) should do: take the n least recent unprotected blocks, drop the unfenced
        ones, put the fenced ones back as most recent. Returns the dropped keys."""
        victims = [key for key in self.order if self.blocks[key].pins == 0][:max(n, 0)]
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
        return ({k: (b.slot, b.writing, b.reader_pins, b.evicting) for k, b in self.blocks.items()},
                list(self.order), self.tier.stats.as_dict())

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
        assert self.tier.leaks() == {"pinned": sum(1 for b in self.blocks.values() if b.pins),
                                     "writing": len(self._writing())}

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
        wrong = data.draw(st.sampled_from([key for key in POOL
                                           if not (key in self.blocks and self.blocks[key].writing)]))
        others = (data.draw(st.lists(st.sampled_from(self._writing()), max_size=2, unique=True))
                  if self._writing() else [])
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
            assert np.array_equal(self._read(block.slot), block.data)

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
        others = (data.draw(st.lists(st.sampled_from(self._reader_pinned()), max_size=1))
                  if self._reader_pinned() else [])
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
        dropped = [key for key in keys
                   if drop and self.blocks[key].reader_pins == 0 and self.blocks[key].slot not in self.fenced]
        for key in keys:
            # the victim is still READY and its bytes intact until now
            assert self.tier.lookup([key]) == 1
            assert np.array_equal(self._read(self.blocks[key].slot), self.blocks[key].data)
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
        assert tier.leaks() == {"pinned": sum(1 for b in self.blocks.values() if b.pins),
                                "writing": len(self._writing())}
        assert len(tier.policy) == len(self.order)
        assert tier.stats.evicted == self.evicted

    @invariant()
    def committed_bytes_intact(self):
        for block in self.blocks.values():
            if not block.writing:
                assert np.array_equal(self._read(block.slot), block.data)

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


TierMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
test_tier_state_machine = TierMachine.TestCase
