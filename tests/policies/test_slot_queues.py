"""``SlotQueues``, the slot-linked order under LRU and adaptive: a policy bound to a tier's index (the
tier numbers the keys) decides exactly as the same policy numbering its keys itself, and binding is
refused once keys are tracked."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from kvtier.policies import AdaptivePolicy, LRUPolicy
from kvtier.policies._slots import SlotQueues

CAPACITY = 8

operations = st.lists(
    st.tuples(st.sampled_from(["insert", "touch", "remove", "evict", "admit"]), st.integers(0, 11), st.integers(0, 3)),
    max_size=120,
)


class Tierlike:
    """The part of a tier a bound policy sees: a dict of key -> slot, slots handed out and given back."""

    def __init__(self) -> None:
        self.index: dict[bytes, int] = {}
        self.free = list(range(CAPACITY - 1, -1, -1))

    def add(self, key: bytes) -> None:
        self.index[key] = self.free.pop()

    def drop(self, key: bytes) -> None:
        self.free.append(self.index.pop(key))


@pytest.mark.parametrize("make", [LRUPolicy, lambda: AdaptivePolicy(capacity=CAPACITY)], ids=["lru", "adaptive"])
@settings(max_examples=200, deadline=None)
@given(ops=operations)
def test_a_bound_policy_decides_as_an_unbound_one(make, ops):
    bound, free = make(), make()
    tier = Tierlike()
    bound.bind(tier.index, CAPACITY)
    for kind, i, n in ops:
        key = b"k%02d" % i
        if kind == "insert" and key not in tier.index and tier.free:
            tier.add(key)
            bound.insert(key)
            free.insert(key)
        elif kind in ("touch", "remove") and key in tier.index:
            getattr(bound, kind)(key)
            getattr(free, kind)(key)
            if kind == "remove":
                tier.drop(key)
        elif kind == "admit" and key not in tier.index:
            assert bound.admit(key) == free.admit(key)
        elif kind == "evict":
            protected = {b"k%02d" % j for j in range(n)}
            victims = bound.evict(n, protected)
            assert victims == free.evict(n, protected)
            for victim in victims:
                tier.drop(victim)
        assert len(bound) == len(free) == len(tier.index)
        assert all(k in bound for k in tier.index)
    assert bound.evict(CAPACITY, ()) == free.evict(CAPACITY, ())


def test_binding_is_refused_once_keys_are_tracked():
    queues: SlotQueues[bytes] = SlotQueues()
    queues.push(b"a", 0)
    with pytest.raises(ValueError, match="before it tracks any key"):
        queues.bind({b"a": 0}, 4)


def test_protected_keys_keep_their_place_and_queues_stay_apart():
    queues: SlotQueues[int] = SlotQueues(2)
    for key in range(6):
        queues.push(key, key % 2)
    assert queues.take_oldest(0, 2, protected={0}) == [2, 4]
    assert list(queues.oldest_first(0)) == [0]
    queues.move(5, 0, oldest=True)
    assert list(queues.oldest_first(0)) == [5, 0] and list(queues.oldest_first(1)) == [1, 3]
    assert (queues.length(0), queues.length(1), len(queues)) == (2, 2, 4)
    with pytest.raises(KeyError):
        queues.remove(2)


@pytest.mark.parametrize("make", [LRUPolicy, AdaptivePolicy], ids=["lru", "adaptive"])
def test_a_bound_restore_in_numpy_steps_orders_as_pushes_one_by_one(make):
    """``restore`` of a bound policy links all the keys at once (``push_many``): the same order as an
    unbound one that pushes them one by one, and a key restored twice is refused."""
    bound, free = make(), make()
    tier = Tierlike()
    bound.bind(tier.index, CAPACITY)
    keys = [b"k%02d" % i for i in (5, 1, 7, 0, 3)]
    for key in keys:
        tier.add(key)
    bound.restore(keys)
    free.restore(keys)
    bound.touch(keys[2])
    free.touch(keys[2])
    assert len(bound) == len(free) == 5
    assert bound.evict(CAPACITY, {keys[0]}) == free.evict(CAPACITY, {keys[0]})
    with pytest.raises(KeyError):
        bound.restore([keys[0]])  # still tracked: it was protected


def test_extend_links_keys_as_pushes_one_by_one_and_refuses_without_a_change():
    """``extend`` (a run's inserts in one loop) orders as ``push`` one by one; a key already tracked
    or given twice is refused before any queue changes."""
    tier = Tierlike()
    bound: SlotQueues[bytes] = SlotQueues(2)
    bound.bind(tier.index, CAPACITY)
    free: SlotQueues[bytes] = SlotQueues(2)
    keys = [b"k%02d" % i for i in (4, 0, 6, 2)]
    for key in keys:
        tier.add(key)
    bound.push(keys[0], 1)
    free.push(keys[0], 1)
    bound.extend(keys[1:], 0)
    for key in keys[1:]:
        free.push(key, 0)
    for queues in (bound, free):
        assert list(queues.oldest_first(0)) == keys[1:] and list(queues.oldest_first(1)) == keys[:1]
    tier.add(b"new")
    for bad in ([b"new", keys[2]], [b"new", b"new"]):
        with pytest.raises(KeyError):
            bound.extend(bad, 0)
        assert list(bound.oldest_first(0)) == keys[1:] and bound.queue_of(b"new") is None and len(bound) == 4
