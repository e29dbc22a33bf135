"""An eviction policy with a bug (it raises, or evicts a block it may not) costs hit ratio, nothing else:
the tier logs it, counts it (``policy_errors``) and goes on under an LRU order rebuilt from its readable
blocks, finishing the call it was in. Every policy call a tier makes is tried, in a tier driven directly
and in a real stack under stores and loads: no pin or slot stays held, every block loaded comes back
bit-exact, the tier's invariants hold. And where finishing a plan raises anyway (a bug of kvtier's own),
the caller waiting on the store hears the error instead of waiting forever."""

from __future__ import annotations

import logging

import pytest

from helpers.stack_helpers import LAYOUT, assert_loaded_exact, assert_no_leaks, key, load, store
from kvtier.core.errors import StateError
from kvtier.core.jobs import JobManager
from kvtier.core.stack import TierStack
from kvtier.core.tier import BlockState
from kvtier.policies import LRUPolicy
from kvtier.tiers.gpu import gpu_tier
from kvtier.tiers.host import host_tier
from kvtier.transfers.cpu import CPUBackend

CALLS = ("admit", "expect", "insert", "touch", "remove", "evict", "restore")


class Faulty(LRUPolicy):
    """LRU that raises in its ``fails``-th call of ``method`` (counted over every instance: a stack's
    tiers share the count), and is told blocks are coming (``expects``) so that ``expect`` is called."""

    expects = True

    def __init__(self, method: str, fails: int, calls: dict[str, int]) -> None:
        super().__init__()
        self.method, self.fails, self.calls = method, fails, calls

    def _call(self, method: str) -> None:
        if method == self.method:
            self.calls[method] = self.calls.get(method, 0) + 1
            if self.calls[method] == self.fails:
                raise RuntimeError(f"bug in {method}")

    def admit(self, key):
        self._call("admit")
        return True

    def expect(self, keys):
        self._call("expect")

    def insert(self, key):
        self._call("insert")
        super().insert(key)

    def touch(self, key):
        self._call("touch")
        super().touch(key)

    def remove(self, key):
        self._call("remove")
        super().remove(key)

    def evict(self, n, protected):
        self._call("evict")
        return super().evict(n, protected)

    def restore(self, keys, slots=None):
        self._call("restore")
        super().restore(keys, slots)


def tier_of(policy, slots: int = 8):
    return host_tier("host", slots, LAYOUT, policy)


def fill(tier, keys):
    tier.reserve(keys)
    tier.commit(keys)


def check_replaced(tier, caplog) -> None:
    """The tier runs on LRU now, counted once and logged naming the call; its index and policy agree."""
    assert type(tier.policy) is LRUPolicy and tier.stats.policy_errors == 1
    assert "eviction policy Faulty failed in" in caplog.text and "the tier goes on with LRU" in caplog.text
    tier.check_invariants()


@pytest.mark.parametrize("method", CALLS)
def test_a_tier_whose_policy_raises_finishes_the_call_and_goes_on_with_lru(method, caplog):
    caplog.set_level(logging.ERROR, "kvtier.core.tier")
    tier = tier_of(Faulty(method, 1, {}))
    keys = [key(i) for i in range(12)]
    if method == "restore":
        slots = tier.claim([0, 1, 2])
        assert tier.restore_claimed(keys[:3], slots) == 3
    else:
        assert tier.admit(keys[:3]) == [True] * 3
        tier.expect(keys[:3])
        fill(tier, keys[:3])
    assert tier.pin(keys[:2]) == [tier.slots([k])[0] for k in keys[:2]]  # touches
    tier.unpin(keys[:2])
    assert tier.discard(keys[2:3]) == keys[2:3]  # removes
    fill(tier, keys[3:8])
    tier.pin([keys[3]])
    fill(tier, keys[8:12])  # room for 4 more: evicts 3, the pinned block stays
    check_replaced(tier, caplog)
    assert tier.state(keys[3]) is BlockState.READY and tier.usage().used == 8
    assert [tier.state(k) for k in keys[8:12]] == [BlockState.READY] * 4
    victims = tier.begin_evict(2)  # the victims kept go back into the (replaced) policy: inserts
    tier.end_evict([k for k, _ in victims], drop=False)
    tier.unpin([keys[3]])
    tier.check_invariants()
    assert tier.leaks() == {"pinned": 0, "writing": 0}


@pytest.mark.parametrize("choice", ["pinned", "absent", "twice"])
def test_a_policy_that_evicts_a_block_it_may_not_is_replaced_and_the_block_stays(choice, caplog):
    caplog.set_level(logging.ERROR, "kvtier.core.tier")
    keys = [key(i) for i in range(8)]

    class Wrong(LRUPolicy):
        def evict(self, n, protected):
            chosen = {"pinned": [keys[0]], "absent": [key(99)], "twice": [keys[1], keys[1]]}[choice]
            return chosen + super().evict(n - len(chosen), protected)

    tier = tier_of(Wrong(), 4)
    fill(tier, keys[:4])
    tier.pin([keys[0]])
    fill(tier, keys[4:6])
    assert type(tier.policy) is LRUPolicy and tier.stats.policy_errors == 1
    assert "evict chose blocks it may not" in caplog.text
    assert tier.state(keys[0]) is BlockState.READY  # pinned: kept
    tier.unpin([keys[0]])
    tier.check_invariants()


@pytest.mark.parametrize("method", ["admit", "expect", "insert", "touch", "evict"])
@pytest.mark.parametrize("fails", [1, 5, 15])  # (this run calls evict 16 times, the others 37-74)
def test_a_stack_whose_policies_raise_loads_every_block_exact_and_leaks_nothing(method, fails):
    calls: dict[str, int] = {}
    jobs = JobManager()
    tiers = [
        gpu_tier("gpu", 6, LAYOUT, Faulty(method, fails, calls), None, jobs.is_fenced),
        host_tier("host", 16, LAYOUT, Faulty(method, fails, calls), None, jobs.is_fenced),
    ]
    stack = TierStack(tiers, [CPUBackend(2)], jobs, "write_back")
    try:
        prompts = [[key(100 * p + i) for i in range(4)] for p in range(8)]
        for round_ in range(3):
            for p, keys in enumerate(prompts):
                if round_ == 0 or p % 2:
                    store(stack, keys)
                result, out = load(stack, keys)
                assert_loaded_exact(keys, result, out)
        assert_no_leaks(stack)
        assert calls[method] > fails  # (the run went on past the failing call)
        assert sorted(stack.stats()[t.name]["policy_errors"] for t in stack.tiers) == [0, 1]
    finally:
        stack.close()


def test_a_store_whose_plan_cannot_be_finished_fails_instead_of_waiting_forever(monkeypatch):
    jobs = JobManager()
    tiers = [gpu_tier("gpu", 4, LAYOUT, LRUPolicy(), None, jobs.is_fenced)]
    stack = TierStack(tiers, [CPUBackend(1)], jobs, "write_back")

    def broken(plan, job, pin_stored=()):
        raise RuntimeError("a bug while finishing")

    monkeypatch.setattr(stack.planner, "finish", broken)
    future = stack.store([key(1)], host_tier("src", 1, LAYOUT, LRUPolicy()).storage, [0])
    with pytest.raises(RuntimeError, match="a bug while finishing"):
        future.result(timeout=10)
    with pytest.raises(StateError, match="in use"):  # (the plan never finished: its block is writing still)
        stack.close()
