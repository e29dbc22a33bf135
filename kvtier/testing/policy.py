"""``EvictionPolicyTests``: the ``EvictionPolicy`` contract (kvtier.policies.base), for any policy.

A subclass provides the fixture ``make_policy``: a callable that builds a fresh policy with each call
(the tests build several, and one per random sequence); parametrize the fixture to run the suite over
several policies or configurations. What a policy may do differently is a class attribute:
``RESTORES_IN_ORDER``.

Invariants checked, for every policy:
- under any sequence of valid insert/touch/remove/evict/admit calls, ``evict(n, protected)`` returns
  distinct tracked keys, none protected, exactly min(n, unprotected tracked) of them, and forgets them;
  ``remove`` forgets a key; ``len`` and ``in`` always agree with a plain set model; misuse (insert of a
  tracked key, touch/remove of an untracked one) raises KeyError; whatever is left drains;
- ``evict`` of zero or a negative count, or with every key protected, takes nothing and forgets nothing;
- ``admit`` answers a bool and tracks nothing; a key evicted may be inserted again;
- misuse raises KeyError and changes nothing; ``restore`` of a key already tracked raises KeyError;
- ``insert_many`` is inserting one by one, and ``access`` is touching and admitting one by one;
- restored blocks are tracked, and leave oldest use first (``RESTORES_IN_ORDER``);
- the policy drives a real tier: a pinned block is never its victim.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvtier.core.layout import BlockLayout
from kvtier.policies.base import EvictionPolicy
from kvtier.policies.shares import TenantShares
from kvtier.tiers.host import host_tier

PolicyFactory = Callable[[], EvictionPolicy[bytes]]

# One operation: (kind, key index, n, protected key indexes); keys are drawn from a small pool so
# that reinsertion after eviction (ghost hits) happens often.
operations = st.lists(
    st.tuples(
        st.sampled_from(["insert", "insert", "touch", "touch", "remove", "evict", "admit"]),
        st.integers(0, 11),
        st.integers(0, 5),
        st.frozensets(st.integers(0, 11), max_size=6),
    ),
    max_size=80,
)


def key(i: int) -> bytes:
    return b"k%02d" % i


def filled(policy: EvictionPolicy[bytes], *keys: bytes) -> EvictionPolicy[bytes]:
    for k in keys:
        policy.insert(k)
    return policy


class EvictionPolicyTests:
    """The eviction policy contract; a subclass provides ``make_policy``."""

    RESTORES_IN_ORDER: ClassVar[bool] = True
    """Whether blocks restored together leave oldest use first (a policy that shares a tier out among
    owners orders each owner's blocks, and the owners by their shares: False)."""

    @pytest.fixture
    def make_policy(self) -> PolicyFactory:
        """A callable that builds a fresh policy of the kind under test."""
        raise NotImplementedError(f"{type(self).__name__} provides the fixture make_policy")

    @pytest.fixture
    def policy(self, make_policy: PolicyFactory) -> EvictionPolicy[bytes]:
        return make_policy()

    # (make_policy returns a factory: every example builds its own policy, so the fixture is no shared state)
    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(ops=operations)
    def test_contract_under_random_operations(self, make_policy, ops):
        policy = make_policy()
        tracked: set[bytes] = set()
        for kind, i, n, protected_ids in ops:
            k = key(i)
            if kind == "insert":
                if k in tracked:
                    with pytest.raises(KeyError):
                        policy.insert(k)
                else:
                    policy.insert(k)
                    tracked.add(k)
            elif kind == "admit":
                if k not in tracked:  # a tier asks only about blocks it does not hold; asking tracks nothing
                    assert isinstance(policy.admit(k), bool)
            elif kind in ("touch", "remove"):
                if k in tracked:
                    getattr(policy, kind)(k)
                    if kind == "remove":
                        tracked.discard(k)
                else:
                    with pytest.raises(KeyError):
                        getattr(policy, kind)(k)
            else:
                protected = {key(j) for j in protected_ids}
                victims = policy.evict(n, protected)
                assert len(victims) == len(set(victims)), "a key evicted twice"
                assert set(victims) <= tracked, "evicted a key that is not tracked"
                assert not set(victims) & protected, "evicted a protected key"
                assert len(victims) == min(max(n, 0), len(tracked - protected)), "evicted too few or too many"
                tracked -= set(victims)
            assert len(policy) == len(tracked)
            assert all(k in policy for k in tracked)
            assert all(key(j) not in policy for j in range(12) if key(j) not in tracked)
        # Whatever is left can be drained, and then nothing is tracked.
        assert sorted(policy.evict(len(tracked) + 1, ())) == sorted(tracked)
        assert len(policy) == 0

    def test_evict_of_nothing_or_of_protected_keys_only_takes_and_forgets_nothing(self, policy):
        filled(policy, b"a", b"b", b"c")
        assert policy.evict(0, ()) == [] and policy.evict(-2, ()) == []
        assert policy.evict(3, {b"a", b"b", b"c"}) == []
        assert len(policy) == 3 and all(k in policy for k in (b"a", b"b", b"c"))
        assert sorted(policy.evict(3, ())) == [b"a", b"b", b"c"]

    def test_admit_tracks_nothing_and_an_evicted_key_may_come_back(self, policy):
        filled(policy, b"a", b"b")
        assert isinstance(policy.admit(b"z"), bool)
        assert b"z" not in policy and len(policy) == 2
        (victim,) = policy.evict(1, ())
        assert victim not in policy
        policy.insert(victim)
        assert victim in policy and len(policy) == 2

    def test_remove_forgets_a_key_and_evict_never_returns_it(self, policy):
        filled(policy, b"a", b"b", b"c")
        policy.remove(b"b")
        assert b"b" not in policy and len(policy) == 2
        assert sorted(policy.evict(3, ())) == [b"a", b"c"]

    def test_misuse_raises_key_error_and_changes_nothing(self, policy):
        filled(policy, b"a")
        for misuse in (
            lambda: policy.insert(b"a"),
            lambda: policy.touch(b"zz"),
            lambda: policy.remove(b"zz"),
            lambda: policy.restore([b"a"]),
        ):
            with pytest.raises(KeyError):
                misuse()
        assert len(policy) == 1 and b"a" in policy and b"zz" not in policy
        assert policy.evict(2, ()) == [b"a"]

    def test_insert_many_is_inserting_one_by_one(self, make_policy):
        """A store's blocks inserted at once leave in the order, and at the times, they would one by one."""
        keys = [b"k%02d" % i for i in range(12)]
        one_by_one, at_once = filled(make_policy(), *keys[:6]), make_policy()
        at_once.insert_many(keys[:6])
        for policy in (one_by_one, at_once):
            policy.touch(keys[2])
        one_by_one = filled(one_by_one, *keys[6:])
        at_once.insert_many(keys[6:])
        assert len(at_once) == len(one_by_one) == 12
        assert [at_once.evict(3, {keys[0]}) for _ in range(4)] == [one_by_one.evict(3, {keys[0]}) for _ in range(4)]

    def test_restored_blocks_are_tracked_and_leave_oldest_first(self, policy):
        """A disk tier restored at start hands its blocks oldest use first: they must leave in that order,
        also under a policy that reorders batches of inserts (kvtier's s3fifo_prefix reverses a chain)."""
        restored = [b"a", b"b", b"c", b"d"]
        policy.restore(restored)
        assert len(policy) == 4 and b"d" in policy
        victims = policy.evict(4, ())
        assert (victims if self.RESTORES_IN_ORDER else sorted(victims)) == restored

    def test_it_drives_a_tier_and_never_takes_a_pinned_block(self, policy):
        tier = host_tier("host", 4, BlockLayout.contiguous(8), policy)
        for batch in ([b"a", b"b", b"c"], [b"d"], [b"e", b"f"]):
            tier.reserve(batch)
            tier.commit(batch)
            tier.check_invariants()
        assert tier.usage().used == 4 and tier.stats.evicted == 2  # the last batch made room
        tier.pin([b"f"])
        assert b"f" not in tier.evict(4) and tier.lookup([b"f"]) == 1
        tier.unpin([b"f"])
        tier.check_invariants()
        tier.close()

    def test_access_is_touching_and_admitting_one_by_one(self, make_policy):
        """A request's blocks handed over at once (``access``, the cache replay's call) leave the policy as
        touching the resident ones and asking ``admit`` of the others one by one, then making room for and
        storing those admitted before the first declined, would."""
        keys = [b"k%02d" % i for i in range(16)]
        at_once, one_by_one = filled(make_policy(), *keys[:8]), filled(make_policy(), *keys[:8])
        resident = set(keys[:8])
        for request in (keys[2:12], keys[5:16:2], keys[0:16:3]):
            admitted = at_once.access(request, resident)
            expected: list[bytes] = []
            declined = False
            for k in request:
                if k in resident:
                    one_by_one.touch(k)
                elif one_by_one.admit(k) and not declined:
                    expected.append(k)
                else:
                    declined = True
            if one_by_one.expects:
                one_by_one.expect(expected)
            assert admitted == expected
            need = len(resident) + len(admitted) - 10  # room for them in a cache of 10, as the replay makes it
            victims = at_once.evict(need, set(request))
            assert victims == one_by_one.evict(need, set(request))
            resident.difference_update(victims)
            for policy in (at_once, one_by_one):
                policy.insert_many(admitted)
            resident.update(admitted)
        assert len(at_once) == len(one_by_one) == len(resident)
        if isinstance(at_once, TenantShares) and isinstance(one_by_one, TenantShares):
            assert at_once.counts() == one_by_one.counts()  # reads and stores counted alike
        assert [at_once.evict(3, {keys[0]}) for _ in range(6)] == [one_by_one.evict(3, {keys[0]}) for _ in range(6)]
