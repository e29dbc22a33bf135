"""Fair shares of one tier among its tenants: a tenant over its share gives up its own blocks first.

Each tenant (``keys.tenant_of`` of a block's key: the tag its keys begin with) has a share of the
tier's capacity, its quota: a named share, or the default one. Each tenant's blocks are ordered by a
policy of their own (the tier's policy, one instance per tenant), so a flood of one tenant's blocks
never reorders another's. Room is made by taking blocks from the tenant furthest over its quota (most
blocks beyond it), its own least valuable first, until another is as far over: while any tenant is
over its quota, a tenant within its quota loses nothing. Blocks a tenant is about to store count as
its own already (the tier asks ``admit`` for each before it makes room): a tenant at its quota that
stores more gives up its own blocks for them, rather than sharing the loss with a tenant at its quota.

Capacity no one's quota holds (shares summing to less than 1, tenants below theirs) is anyone's: a
tenant may grow past its quota while there is room, and is the first to give blocks back once there is
none. Shares are guarantees where they sum to at most 1; where the tenants present claim more, the one
furthest over its quota still gives first, so every tenant keeps as close to its share as fits.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Container, Hashable, Mapping, Sequence

import numpy as np

from kvtier.policies.base import EvictionPolicy, Key


class TenantShares(EvictionPolicy[Key]):
    """One ``make()`` policy per tenant, and each tenant's count of blocks against its quota
    (``share * capacity``, the capacity the tier ``bind``s, or ``capacity`` given here)."""

    def __init__(
        self,
        make: Callable[[], EvictionPolicy[Key]],
        tenant_of: Callable[[Key], Hashable],
        shares: Mapping[Hashable, float],
        default_share: float,
        capacity: int = 0,
    ) -> None:
        self._make = make
        self._tenant_of = tenant_of
        self._shares = dict(shares)
        self._default_share = default_share
        self._capacity = capacity
        self._policies: dict[Hashable, EvictionPolicy[Key]] = {}
        self._counts: dict[Hashable, int] = {}
        self._incoming: dict[Hashable, int] = {}  # blocks admitted since the last evict, not inserted yet

    def bind(self, index: Mapping[Key, int], capacity: int) -> None:
        """Takes the tier's capacity (its quotas are shares of it); the tenants' policies keep keys of
        their own, not bound to the tier's index (each would take arrays as long as the whole tier)."""
        self._capacity = capacity

    def quota(self, tenant: Hashable) -> float:
        """The blocks ``tenant``'s share guarantees it."""
        return self._shares.get(tenant, self._default_share) * self._capacity

    def held(self) -> dict[Hashable, int]:
        """Blocks each tenant holds now (tenants holding none left out)."""
        return {tenant: n for tenant, n in self._counts.items() if n}

    def _policy(self, tenant: Hashable) -> EvictionPolicy[Key]:
        policy = self._policies.get(tenant)
        if policy is None:
            policy = self._policies[tenant] = self._make()
            self._counts[tenant] = 0
        return policy

    def _forget_if_empty(self, tenant: Hashable) -> None:
        """A tenant holding no block is forgotten: a tier's tenants are those holding blocks, however
        many came and went."""
        if not self._counts[tenant]:
            del self._counts[tenant], self._policies[tenant]

    def admit(self, key: Key) -> bool:
        tenant = self._tenant_of(key)
        policy = self._policies.get(tenant)
        admitted = (self._make() if policy is None else policy).admit(key)
        if admitted:
            self._incoming[tenant] = self._incoming.get(tenant, 0) + 1
        return admitted

    def insert(self, key: Key) -> None:
        tenant = self._tenant_of(key)
        self._policy(tenant).insert(key)
        self._counts[tenant] += 1
        if self._incoming.get(tenant):
            self._incoming[tenant] -= 1

    def restore(self, keys: Sequence[Key], slots: Sequence[int] | np.ndarray | None = None) -> None:
        by_tenant: dict[Hashable, list[Key]] = {}
        for key in keys:
            by_tenant.setdefault(self._tenant_of(key), []).append(key)
        for tenant, own in by_tenant.items():
            self._policy(tenant).restore(own)
            self._counts[tenant] += len(own)

    def touch(self, key: Key) -> None:
        self._policies[self._tenant_of(key)].touch(key)

    def remove(self, key: Key) -> None:
        tenant = self._tenant_of(key)
        self._policies[tenant].remove(key)
        self._counts[tenant] -= 1
        self._forget_if_empty(tenant)

    def evict(self, n: int, protected: Container[Key]) -> list[Key]:
        """Up to ``n`` blocks, each taken from the tenant then furthest over its quota (counting the blocks
        it is about to store)."""
        incoming, self._incoming = self._incoming, {}
        if len(self._policies) == 1:  # one tenant: nobody else's share to keep
            ((tenant, policy),) = self._policies.items()
            victims = policy.evict(n, protected)
            self._counts[tenant] -= len(victims)
            self._forget_if_empty(tenant)
            return victims
        heap = [
            (self.quota(t) - count - incoming.get(t, 0), i, t)
            for i, (t, count) in enumerate(self._counts.items())
            if count
        ]
        heapq.heapify(heap)
        victims: list[Key] = []
        while heap and len(victims) < n:
            under, i, tenant = heapq.heappop(heap)
            # as many as bring it level with the next furthest over, at least one
            take = min(n - len(victims), max(1, int(heap[0][0] - under)) if heap else n)
            taken = self._policies[tenant].evict(take, protected)
            victims += taken
            self._counts[tenant] -= len(taken)
            if len(taken) == take and self._counts[tenant]:  # (fewer: the rest of its blocks are protected)
                heapq.heappush(heap, (under + len(taken), i, tenant))
            else:
                self._forget_if_empty(tenant)
        return victims

    def __len__(self) -> int:
        return sum(self._counts.values())

    def __contains__(self, key: object) -> bool:
        policy = self._policies.get(self._tenant_of(key))  # type: ignore[arg-type]
        return policy is not None and key in policy
