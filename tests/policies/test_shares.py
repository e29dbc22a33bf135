"""Fair shares among tenants (``kvtier.policies.shares.TenantShares``, a tier's ``tenants:`` settings): a
tenant over its share gives up its own blocks first and never pushes another below its share; room no
share holds is anyone's; the tenant holding most gives first where none is named; each tenant's blocks
keep their own order; a tenant holding nothing is forgotten. Then the same through a real host tier of a
``KVTier`` stack: a tenant flooding the tier leaves a steady tenant's blocks in place with shares, and
evicts them without.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, strategies as st

from kvtier import KVTier
from kvtier.core.config import load_config
from kvtier.core.errors import ConfigError
from kvtier.node_config import load_node_config
from kvtier.policies import AdaptivePolicy, LRUPolicy
from kvtier.policies.shares import TenantShares, level
from kvtier.replay.cache import replay
from kvtier.replay.tenants import keep_tenants_apart
from kvtier.replay.workload import WORKLOADS, generate


def tenant(key: tuple[str, int]) -> str:
    return key[0]


def cache(shares: dict[str, float], default: float = 0.0, capacity: int = 10) -> TenantShares:
    return TenantShares(LRUPolicy, tenant, shares, default, capacity=capacity)


def fill(policy: TenantShares, who: str, n: int, start: int = 0) -> list[tuple[str, int]]:
    keys = [(who, i) for i in range(start, start + n)]
    for key in keys:
        policy.insert(key)
    return keys


def test_a_tenant_over_its_share_gives_its_own_blocks_first_oldest_first():
    policy = cache({"steady": 0.5})
    steady = fill(policy, "steady", 4)
    flood = fill(policy, "flood", 6)
    assert policy.evict(3, set()) == flood[:3]
    assert policy.held() == {"steady": 4, "flood": 3}
    policy.touch(steady[0])
    assert policy.evict(3, set()) == flood[3:]  # flood gives all it holds before steady gives one
    assert policy.evict(2, set()) == [steady[1], steady[2]]  # then steady, least recent first


def test_room_no_share_holds_is_anyones_and_the_tenant_furthest_over_gives_first():
    policy = cache({"a": 0.2, "b": 0.2})
    a = fill(policy, "a", 7)  # alone: a grows far past its share
    fill(policy, "b", 3)
    assert len(policy) == 10 and policy.held() == {"a": 7, "b": 3}
    victims = policy.evict(4, set())
    assert victims == a[:4]  # a is 5 over its 2, b 1 over: a gives until as far over as b
    victims = policy.evict(2, set())
    assert sorted(v[0] for v in victims) == ["a", "b"]  # level: one each


def test_without_named_shares_the_tenant_holding_most_gives_first():
    policy = cache({}, default=0.0)
    fill(policy, "x", 6)
    fill(policy, "y", 2)
    fill(policy, "z", 2)
    victims = policy.evict(5, set())
    assert [v[0] for v in victims[:4]] == ["x"] * 4  # x down to the others' 2, then one of the three
    assert sorted(policy.held().values()) == [1, 2, 2]


def test_protected_blocks_stay_and_the_next_tenant_gives_instead():
    policy = cache({"steady": 0.5})
    steady = fill(policy, "steady", 4)
    flood = fill(policy, "flood", 6)
    assert policy.evict(2, set(flood)) == steady[:2]  # flood's are all in use: only steady's can go
    assert policy.evict(20, set(flood) | set(steady)) == []


def test_a_tenant_holding_nothing_is_forgotten():
    policy = cache({})
    keys = fill(policy, "gone", 2)
    fill(policy, "stays", 1)
    policy.remove(keys[0])
    assert policy.evict(1, set()) in ([keys[1]], [("stays", 0)])
    policy.remove(keys[1]) if keys[1] in policy else None
    assert "gone" not in policy.held() and len(policy._tenants) == 1


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["insert", "insert_many", "remove", "evict", "access", "restore"]), st.integers(0, 5)
        ),
        max_size=60,
    )
)
def test_what_each_tenant_holds_follows_every_call_that_adds_or_takes_blocks(calls):
    """Each tenant's held count (kept beside its policy, not asked of it) against a model of the blocks
    stored: inserts, stores of several, removals, evictions, restores and requests in any order."""
    policy = TenantShares(AdaptivePolicy, tenant, {"a": 0.5}, 0.25, capacity=8)
    model: set[tuple[str, int]] = set()
    fresh = iter(range(10_000))
    for call, n in calls:
        who = "abcc"[n % 4]
        if call == "insert":
            key = (who, next(fresh))
            policy.insert(key)
            model.add(key)
        elif call in ("insert_many", "restore"):
            keys = [(who, next(fresh)) for _ in range(n)]
            if call == "insert_many":
                policy.insert_many(keys)
            else:
                policy.restore(keys)
            model.update(keys)
        elif call == "remove" and model:
            key = sorted(model)[n % len(model)]
            policy.remove(key)
            model.discard(key)
        elif call == "evict":
            taken = policy.evict(n, set())
            assert set(taken) <= model and len(taken) == min(n, len(model))
            model.difference_update(taken)
        elif call == "access":
            keys = sorted(k for k in model if k[0] == who)[:n] + [(who, next(fresh))]
            admitted = policy.access(keys, model)
            policy.insert_many(admitted)
            model.update(admitted)
        assert policy.held() == Counter(name for name, _ in model) and len(policy) == len(model)
        assert all(key in policy for key in model)


def test_a_tenant_admitted_but_never_stored_is_forgotten_at_the_next_eviction():
    """A tier may ask about a block and then not store it: the tenant it made for it holds nothing and
    is not kept (however many such tenants come)."""
    policy = cache({})
    fill(policy, "a", 3)
    fill(policy, "b", 3)
    assert policy.admit(("asked", 0)) and "asked" in policy._tenants
    assert len(policy.evict(1, set())) == 1
    assert set(policy._tenants) == {"a", "b"}


def test_shares_that_claim_more_than_the_tier_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.tenants: the named shares add up to 1.2"):
        load_config(
            {
                "block_bytes": 4096,
                "tiers": [{"medium": "host", "capacity_blocks": 8, "tenants": {"shares": {"a": 0.7, "b": 0.5}}}],
            }
        )


# --- through a real tier ---------------------------------------------------------------------------

BLOCK = 4096
TOKENS = 16


def stack(shares: dict | None) -> dict:
    host = {"medium": "host", "capacity_blocks": 8, "eviction": "lru"}
    if shares is not None:
        host["tenants"] = shares
    return {"block_tokens": TOKENS, "block_bytes": BLOCK, "tiers": [host]}


@pytest.mark.parametrize("shares", [{"shares": {"steady": 0.5}}, None], ids=["shares", "no shares"])
def test_a_flooding_tenant_leaves_a_steady_tenants_blocks_in_a_host_tier_with_shares(shares):
    steady = list(range(4 * TOKENS))
    blocks = np.random.default_rng(0).integers(0, 256, (4, BLOCK), dtype=np.uint8)
    with KVTier.open(stack(shares)) as kv:
        assert kv.store_now(steady, blocks, tenant="steady").stored == 4
        for i in range(10):  # unique prefixes, 4 blocks each: 40 blocks into an 8-block tier
            flood = list(range(10_000 * (i + 1), 10_000 * (i + 1) + 4 * TOKENS))
            kv.store_now(flood, blocks, tenant="flood")
        held = kv.lookup(steady, tenant="steady")
        if shares is None:
            assert held == 0  # LRU alone: the flood pushed every steady block out
        else:
            assert held == 4
            out = np.zeros_like(blocks)
            assert kv.load_now(steady, out, tenant="steady").loaded == 4 and np.array_equal(out, blocks)


def test_tiers_kvtier_does_not_evict_from_and_those_below_a_node_slab_refuse_shares_saying_why(tmp_path):
    remote = {"medium": "remote", "backend": "redis", "redis": {"url": "redis://127.0.0.1:1"}, "tenants": {}}
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.tenants: a remote tier has no tenant shares: the store"):
        load_config({"block_bytes": 4096, "tiers": [{"medium": "host", "capacity_blocks": 8}, remote]})
    daemon = {
        "node": {"socket": str(tmp_path / "s")},
        "block_bytes": 4096,
        "tiers": [
            {"medium": "host", "capacity_blocks": 8, "tenants": {"shares": {"a": 0.5}}},
            {"medium": "disk", "path": str(tmp_path / "d"), "capacity_blocks": 8, "tenants": {}},
        ],
    }
    with pytest.raises(ConfigError, match=r"tiers\[1\]: tenants: only the slab \(tiers\[0\]\) has tenant shares"):
        load_node_config(daemon)


def test_a_tier_with_shares_counts_its_named_tenants_by_name_and_sums_the_others():
    blocks = np.random.default_rng(1).integers(0, 256, (4, BLOCK), dtype=np.uint8)
    with KVTier.open(stack({"shares": {"steady": 0.5}})) as kv:
        steady = list(range(4 * TOKENS))
        kv.store_now(steady, blocks, tenant="steady")
        for i, who in enumerate(["a", "b", "c", None]):  # 16 more blocks into an 8-block tier
            kv.store_now(list(range(1000 * (i + 1), 1000 * (i + 1) + 4 * TOKENS)), blocks, tenant=who)
        assert kv.load_now(steady, np.zeros_like(blocks), tenant="steady").loaded == 4
        counts = kv.stats()["host"]["tenants"]
    assert set(counts) == {"steady", "other", "none"}  # however many tenants came: the named ones, then sums
    assert counts["steady"] == {"stored": 4, "read": 4, "evicted": 0, "held": 4, "caused": 0, "held_bytes": 4 * BLOCK}
    assert sum(c["caused"] for c in counts.values()) == sum(c["evicted"] for c in counts.values()) == 12
    assert counts["other"]["stored"] == 12 and counts["none"]["stored"] == 4
    assert sum(c["held"] for c in counts.values()) == 8
    assert sum(c["stored"] - c["evicted"] for c in counts.values()) == 8


@given(
    st.dictionaries(st.sampled_from("abcdefgh"), st.floats(-50, 50, allow_nan=False), min_size=1),
    st.integers(1, 200),
)
def test_level_takes_n_from_those_furthest_over_and_leaves_them_level(over, n):
    parts = level(over, n)
    assert sum(parts.values()) == n and all(part > 0 for part in parts.values())
    after = {tenant: excess - parts.get(tenant, 0) for tenant, excess in over.items()}
    for giver in parts:  # none gave so much that it ended more than a block below another
        assert all(after[giver] >= other - 1 - 1e-9 for other in after.values())


@pytest.mark.parametrize("workload", ["chat", "documents"])
def test_a_replay_that_names_each_requests_tenant_evicts_and_counts_as_one_that_does_not(workload):
    """The replay hands each request's tenant to ``access`` and ``insert_many`` (``owner``), and shares
    then ask no key its tenant: three tenants, shares of their own and the default, leveled evictions."""
    named = keep_tenants_apart(
        [
            replace(r, tenant="abc"[(i if r.session is None else r.session) % 3])
            for i, r in enumerate(generate(WORKLOADS[workload]))
        ]
    )
    owner = {h: r.tenant for r in named for h in r.hash_ids}
    unnamed = [replace(r, tenant=None) for r in named]

    def shares() -> TenantShares:
        return TenantShares(AdaptivePolicy, owner.__getitem__, {"a": 0.5, "b": 0.3}, 0.1, 600, label_of=str)

    told, asked = shares(), shares()
    result = replay(named, 600, told)
    assert result == replay(unnamed, 600, asked)
    assert result.evictions > 1000 and told.counts() == asked.counts()
    assert {label for label, c in told.counts().items() if c["evicted"]} == {"a", "b", "c"}


def test_a_share_cannot_name_a_tenant_after_a_counting_label():
    with pytest.raises(ConfigError, match="'other' is the label of the tenants the shares do not name"):
        load_config(
            {
                "block_bytes": 4096,
                "tiers": [{"medium": "host", "capacity_blocks": 8, "tenants": {"shares": {"other": 0.2}}}],
            }
        )


def test_a_tenant_at_its_share_that_stores_more_gives_its_own_blocks_for_them():
    """Both tenants at their quota, the tier full: what one stores next comes out of its own blocks (the
    stack tells the policy whose blocks are coming before it makes room), and it caused those evictions."""
    blocks = np.random.default_rng(2).integers(0, 256, (4, BLOCK), dtype=np.uint8)
    with KVTier.open(stack({"shares": {"a": 0.5, "b": 0.5}})) as kv:
        a, b = list(range(4 * TOKENS)), list(range(5000, 5000 + 4 * TOKENS))
        kv.store_now(a, blocks, tenant="a")
        kv.store_now(b, blocks, tenant="b")
        more = list(range(9000, 9000 + 2 * TOKENS))
        assert kv.store_now(more, blocks[:2], tenant="a").stored == 2
        assert kv.lookup(b, tenant="b") == 4 and kv.lookup(more, tenant="a") == 2
        counts = kv.stats()["host"]["tenants"]
    assert (counts["a"]["evicted"], counts["a"]["caused"], counts["b"]["evicted"], counts["b"]["caused"]) == (
        2,
        2,
        0,
        0,
    )


def test_expected_blocks_count_once_however_often_a_store_is_announced():
    policy = cache({"a": 0.5, "b": 0.5}, capacity=8)
    fill(policy, "a", 4)
    b = fill(policy, "b", 4)
    coming = [("a", 10), ("a", 11)]
    policy.expect(coming)
    policy.expect(coming)  # (the stack, then the tier's reserve)
    assert policy.evict(2, set()) == [("a", 0), ("a", 1)]
    policy.insert_many(coming)
    assert policy.evict(1, set()) in ([("a", 2)], [b[0]])  # nothing stale left: both at quota again
    assert policy.counts()["all"]["caused"] == 2
