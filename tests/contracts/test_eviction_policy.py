"""The ``EvictionPolicy`` contract (``kvtier.testing.policy.EvictionPolicyTests``, whose docstring lists what it
checks), run over every policy registered in ``kvtier.policies.EVICTION_POLICIES`` as YAML builds it (its
short name, no arguments), over configured variants, and over tenant shares.

To add a policy: register it in ``EVICTION_POLICIES`` and every test of the suite runs over it; to also check
it with arguments, add an entry to ``POLICIES``. Each policy's own orderings (LRU's recency, ARC's ghosts,
S3-FIFO's queues, the adaptive filter, the shares) are tested in tests/policies.
"""

from __future__ import annotations

import pytest

from kvtier.policies import (
    EVICTION_POLICIES,
    AdaptivePolicy,
    ARCPolicy,
    LRUPolicy,
    PrefixS3FIFOPolicy,
    S3FIFOPolicy,
    eviction_policy_class,
)
from kvtier.policies.shares import TenantShares
from kvtier.testing.policy import EvictionPolicyTests

POLICIES = {name: eviction_policy_class(name) for name in EVICTION_POLICIES}
POLICIES.update(
    {
        "arc(capacity=4)": lambda: ARCPolicy(4),
        "s3fifo(capacity=4)": lambda: S3FIFOPolicy(4),
        "s3fifo(capacity=4, promote_after=2, small=0.5)": lambda: S3FIFOPolicy(4, small_fraction=0.5, promote_after=2),
        "s3fifo_prefix(capacity=4)": lambda: PrefixS3FIFOPolicy(4),
        "adaptive(capacity=4, every key sampled)": lambda: AdaptivePolicy(4, sample_every=1, score_limit=2),
    }
)
"""Every policy under test but the shares: the registered ones as YAML builds them, and configured variants."""

SHARES = {
    "shares(lru, 3 tenants)": lambda: TenantShares(LRUPolicy, lambda key: key[-1] % 3, {0: 0.5}, 0.25, capacity=8),
    "shares(adaptive, 2 tenants)": lambda: TenantShares(
        lambda: AdaptivePolicy(4, sample_every=1, score_limit=2), lambda key: key[-1] % 2, {}, 0.5, capacity=4
    ),
}
"""Tenant shares over policies: a tier's blocks shared out among tenants (the last byte of a key here)."""


class TestEvictionPolicies(EvictionPolicyTests):
    @pytest.fixture(params=sorted(POLICIES))
    def make_policy(self, request):
        return POLICIES[request.param]


class TestTenantShares(EvictionPolicyTests):
    RESTORES_IN_ORDER = False  # each tenant's blocks leave oldest first, the tenants by their shares

    @pytest.fixture(params=sorted(SHARES))
    def make_policy(self, request):
        return SHARES[request.param]
