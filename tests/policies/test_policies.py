"""Eviction policies, their lookup by name, and watermarks.

Invariants checked:
- LRU evicts in order of last insert or touch, skips protected keys without reordering them, and
  forgets exactly what it returns (what every policy must do besides is tests/contracts/test_eviction_policy.py);
- eviction_policy_class finds built-ins by short name and a user's class by dotted path (also
  ``module:Class``), and every failure (unknown name, missing module or attribute, not a subclass of
  EvictionPolicy) is a PolicyError (a ValueError) naming the policy; a loaded user policy really drives a tier;
- a watermark asks for nothing at or below its high mark and for enough to come down to its low
  mark above it; marks outside 0 < low < high <= 1 are refused.
"""

from __future__ import annotations

import sys
import textwrap

import pytest

from kvtier.core.layout import BlockLayout
from kvtier.policies import EVICTION_POLICIES, EvictionPolicy, LRUPolicy, PolicyError, Watermark, eviction_policy_class
from kvtier.tiers.host import host_tier


def lru_with(*keys: bytes) -> LRUPolicy:
    policy = LRUPolicy()
    for key in keys:
        policy.insert(key)
    return policy


# --- LRU ---------------------------------------------------------------------------------------


def test_lru_evicts_oldest_first():
    policy = lru_with(b"a", b"b", b"c", b"d")
    assert policy.evict(2, ()) == [b"a", b"b"]
    assert len(policy) == 2 and b"a" not in policy and b"c" in policy
    assert policy.evict(5, ()) == [b"c", b"d"]
    assert len(policy) == 0 and policy.evict(1, ()) == []


def test_touch_makes_a_key_most_recent():
    policy = lru_with(b"a", b"b", b"c")
    policy.touch(b"a")
    policy.touch(b"b")
    policy.touch(b"a")
    assert policy.evict(3, ()) == [b"c", b"b", b"a"]


def test_evict_skips_protected_keys_without_reordering_them():
    policy = lru_with(b"a", b"b", b"c", b"d")
    assert policy.evict(2, {b"a", b"c"}) == [b"b", b"d"]
    assert policy.evict(1, set()) == [b"a"]  # still the oldest
    assert policy.evict(1, {b"c"}) == []
    assert len(policy) == 1 and b"c" in policy


def test_a_reinserted_key_is_most_recent():
    policy = lru_with(b"a", b"b")
    assert policy.evict(1, ()) == [b"a"]
    policy.insert(b"a")
    assert policy.evict(2, ()) == [b"b", b"a"]


# --- lookup by name ----------------------------------------------------------------------------


POLICY_MODULE = '''
from collections import deque

from kvtier.policies.base import EvictionPolicy


class FIFOPolicy(EvictionPolicy):
    """First in, first out: reads do not matter."""

    def __init__(self):
        self._queue = deque()

    def insert(self, key):
        self._queue.append(key)

    def touch(self, key):
        pass

    def remove(self, key):
        self._queue.remove(key)

    def evict(self, n, protected):
        victims = [k for k in self._queue if k not in protected][:max(n, 0)]
        for k in victims:
            self._queue.remove(k)
        return victims

    def __len__(self):
        return len(self._queue)

    def __contains__(self, key):
        return key in self._queue


class NotAPolicy:
    pass


def not_a_class():
    return FIFOPolicy
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch, request):
    """A throwaway module on sys.path holding a user policy; its name is unique to the test."""
    name = "kvtier_user_policies_" + "".join(c if c.isalnum() else "_" for c in request.node.name)
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(POLICY_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_short_names():
    assert eviction_policy_class("lru") is LRUPolicy
    assert EVICTION_POLICIES["lru"] is LRUPolicy


def test_dotted_path_loads_a_user_policy_that_drives_a_tier(user_module):
    cls = eviction_policy_class(f"{user_module}.FIFOPolicy")
    assert cls.__name__ == "FIFOPolicy" and issubclass(cls, EvictionPolicy)
    assert eviction_policy_class(f"{user_module}:FIFOPolicy") is cls

    tier = host_tier("host", 3, BlockLayout.contiguous(8), cls())
    keys = [b"a", b"b", b"c"]
    tier.reserve(keys)
    tier.commit(keys)
    tier.pin([b"a"])  # a read: LRU would now evict b first, FIFO still evicts a
    tier.unpin([b"a"])
    assert tier.evict(1) == [b"a"]
    tier.check_invariants()
    tier.close()


def test_unknown_short_name_is_a_policy_error():
    with pytest.raises(PolicyError, match="unknown eviction policy 'fifo'.*lru"):
        eviction_policy_class("fifo")
    assert issubclass(PolicyError, ValueError)


def test_missing_module_is_a_policy_error():
    with pytest.raises(PolicyError, match="no_such_module_for_kvtier.Policy.*cannot be loaded"):
        eviction_policy_class("no_such_module_for_kvtier.Policy")


def test_missing_attribute_is_a_policy_error(user_module):
    with pytest.raises(PolicyError, match="cannot be loaded"):
        eviction_policy_class(f"{user_module}.NoSuchPolicy")


@pytest.mark.parametrize("attribute", ["NotAPolicy", "not_a_class", "EvictionPolicy.insert"])
def test_something_that_is_not_a_policy_class_is_a_policy_error(user_module, attribute):
    with pytest.raises(PolicyError):
        eviction_policy_class(f"{user_module}.{attribute}")


def test_a_path_to_a_non_policy_class_elsewhere_is_refused():
    with pytest.raises(PolicyError, match="not a subclass"):
        eviction_policy_class("collections.OrderedDict")


# --- watermark ---------------------------------------------------------------------------------


def test_watermark_excess():
    mark = Watermark(high=0.75, low=0.5)
    assert [mark.excess(used, 8) for used in range(9)] == [0, 0, 0, 0, 0, 0, 0, 3, 4]
    assert Watermark(high=0.9, low=0.5).excess(91, 100) == 41
    assert Watermark(high=0.9, low=0.5).excess(90, 100) == 0
    assert mark.excess(5, 0) == 0


def test_watermark_defaults():
    mark = Watermark()
    assert (mark.high, mark.low) == (0.95, 0.85)
    assert mark.excess(95, 100) == 0 and mark.excess(96, 100) == 11


def test_a_full_high_mark_never_asks_within_capacity():
    mark = Watermark(high=1.0, low=0.5)
    assert mark.excess(10, 10) == 0


@pytest.mark.parametrize(
    "high, low", [(0.5, 0.5), (0.5, 0.8), (1.1, 0.5), (0.9, 0.0), (0.9, -0.1), (float("nan"), 0.5)]
)
def test_watermark_validation(high, low):
    with pytest.raises(ValueError, match="0 < low < high <= 1"):
        Watermark(high=high, low=low)
