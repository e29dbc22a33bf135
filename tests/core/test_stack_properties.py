"""Property test of the whole stack: random sequences of stores, loads, reader pins and unpins on a
small GPU-over-host stack, in both placements, with watermarks. After every step: each tier's index,
allocator and policy agree; usage never exceeds capacity; a block pinned by a reader stays readable
until it is unpinned; everything lookup reports present loads back bit-exact; after close nothing leaks."""

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from helpers.stack_helpers import assert_loaded_exact, key, load, make_stack, store
from kvtier.core.tier import BlockState
from kvtier.policies import Watermark

POOL = [key(i) for i in range(24)]


class StackMachine(RuleBasedStateMachine):
    @initialize(
        placement=st.sampled_from(["write_back", "write_through"]),
        gpu=st.integers(2, 6),
        host=st.integers(4, 12),
        watermarks=st.booleans(),
    )
    def build(self, placement, gpu, host, watermarks):
        self.stack = make_stack(
            gpu=gpu,
            host=host,
            placement=placement,
            gpu_watermark=Watermark(0.9, 0.5) if watermarks else None,
            host_watermark=Watermark(0.9, 0.6) if watermarks else None,
        )
        self.reader_pins: list[bytes] = []  # blocks pinned in the GPU tier by an outside reader

    @rule(picks=st.lists(st.integers(0, len(POOL) - 1), min_size=1, max_size=6, unique=True))
    def store_blocks(self, picks):
        keys = [POOL[i] for i in picks]
        gpu = self.stack.tiers[0]
        if len(keys) > gpu.capacity:
            return
        result = store(self.stack, keys)
        assert result.stored + result.present + result.dropped == len(keys)
        assert result.failed == []

    @rule(start=st.integers(0, len(POOL) - 1), length=st.integers(1, 8))
    def load_blocks(self, start, length):
        keys = POOL[start : start + length]
        expected = self.stack.lookup(keys).hits
        loaded, out = load(self.stack, keys)
        assert loaded.hits == expected and loaded.failed == []
        assert_loaded_exact(keys, loaded, out)
        assert not out[loaded.hits :].any()

    @rule(index=st.integers(0, len(POOL) - 1))
    def reader_pins_a_block(self, index):
        gpu = self.stack.tiers[0]
        if gpu.state(POOL[index]) is BlockState.READY and len(self.reader_pins) < gpu.capacity - 1:
            gpu.pin([POOL[index]])
            self.reader_pins.append(POOL[index])

    @rule()
    def reader_unpins_a_block(self):
        if self.reader_pins:
            self.stack.tiers[0].unpin([self.reader_pins.pop(0)])

    @invariant()
    def tiers_are_consistent(self):
        if not hasattr(self, "stack"):
            return
        self.stack.wait_idle()
        for tier in self.stack.tiers:
            tier.check_invariants()
            usage = tier.usage()
            assert 0 <= usage.used <= usage.capacity
            assert tier.leaks()["writing"] == 0
        gpu = self.stack.tiers[0]
        for k in self.reader_pins:
            assert gpu.state(k) is BlockState.READY, "a pinned block was evicted"
        assert self.stack.background_errors == []

    def teardown(self):
        if not hasattr(self, "stack"):
            return
        self.stack.tiers[0].unpin(self.reader_pins)
        self.stack.wait_idle()
        for tier in self.stack.tiers:
            assert tier.leaks() == {"pinned": 0, "writing": 0}
        self.stack.close()
        assert self.stack.jobs.in_flight() == []


StackMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestStackProperties = StackMachine.TestCase
