"""Fair shares of one tier among its tenants: a tenant over its share gives up its own blocks first.

Each tenant (``keys.tenant_of`` of a block's key: the tag its keys begin with) has a share of the
tier's capacity, its quota: a named share, or the default one. Each tenant's blocks are ordered by a
policy of their own (the tier's policy, one instance per tenant), so a flood of one tenant's blocks
never reorders another's. Room is made by taking blocks from the tenant furthest over its quota (most
blocks beyond it), its own least valuable first, until another is as far over: while any tenant is
over its quota, a tenant within its quota loses nothing. Blocks a tenant is about to store count as
its own already (the tier says which, ``expect``, before it makes room): a tenant at its quota that
stores more gives up its own blocks for them, rather than sharing the loss with a tenant at its quota.

Capacity no one's quota holds (shares summing to less than 1, tenants below theirs) is anyone's: a
tenant may grow past its quota while there is room, and is the first to give blocks back once there is
none. Shares are guarantees where they sum to at most 1; where the tenants present claim more, the one
furthest over its quota still gives first, so every tenant keeps as close to its share as fits.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Container, Hashable, Mapping, Sequence
from typing import Generic, TypeVar, cast

import numpy as np

from kvtier.policies.base import EvictionPolicy, Key

Tenant = TypeVar("Tenant", bound=Hashable)
"""What ``tenant_of`` names a tenant by: a tier's tag (``bytes``), the replay's tenant name."""


def level(over: Mapping[Tenant, float], n: int) -> dict[Tenant, int]:
    """How many blocks each tenant gives so that ``n`` taken from those furthest over (``over``: blocks
    beyond the quota, negative below it) leave them level, none giving more than brings it to the
    level of the next: water-filling. Each part is whole, the remainder taken from those left furthest over."""
    top, first, second = next(iter(over)), -math.inf, -math.inf  # (the one furthest over, its excess, the next's)
    for name, excess in over.items():
        if excess > first:
            top, first, second = name, excess, first
        elif excess > second:
            second = excess
    if first - n >= second:  # (the usual eviction: the one furthest over gives them all, found without sorting)
        return {top: n}
    ranked = sorted(over.items(), key=lambda item: -item[1])
    total, waterline, k = 0.0, 0.0, 0
    for k, (_, excess) in enumerate(ranked, 1):
        total += excess
        waterline = (total - n) / k
        if k == len(ranked) or ranked[k][1] <= waterline:
            break
    parts = {name: max(0, math.floor(excess - waterline)) for name, excess in ranked[:k]}
    short = n - sum(parts.values())
    for name, _ in sorted(ranked[:k], key=lambda item: parts[item[0]] - item[1])[:short]:
        parts[name] += 1  # the blocks the floors left: one each from those left furthest over
    return {name: part for name, part in parts.items() if part}


COUNTS = ("stored", "read", "evicted")
"""What each tenant's blocks went through in the tier (``TenantShares.counts``), with ``held`` now and
``caused``: the evictions its stores caused (split by the blocks each tenant was about to store)."""


class _Tenant:
    """One tenant's policy, the blocks it ``held`` (as its policy's length says, counted here: a policy's
    ``len`` is a call or two, asked several times per request), the blocks expected since the last
    ``evict`` (``expect``: not inserted yet), and its ``COUNTS``. The policy's per-block calls are kept
    bound (``admit`` None where the policy admits everything): they run once per block, where one
    lookup more shows."""

    __slots__ = ("admit", "evicted", "held", "incoming", "insert", "policy", "read", "stored", "touch")

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self.admit = None if type(policy).admit is EvictionPolicy.admit else policy.admit
        self.insert = policy.insert
        self.touch = policy.touch
        self.held = self.incoming = self.stored = self.read = self.evicted = 0


class TenantShares(EvictionPolicy[Key], Generic[Key, Tenant]):
    """One ``make()`` policy per tenant, and each tenant's count of blocks against its quota
    (``share * capacity``, the capacity the tier ``bind``s, or ``capacity`` given here). ``counts``
    reports the tenants by ``label_of(tenant)`` (by default all as one): a tier names the tenants of its
    shares and sums the rest, so that however many tenants come, the labels stay few."""

    expects = True

    def __init__(
        self,
        make: Callable[[], EvictionPolicy[Key]],
        tenant_of: Callable[[Key], Tenant],
        shares: Mapping[Tenant, float],
        default_share: float,
        capacity: int = 0,
        label_of: Callable[[Tenant], str] = lambda _: "all",
    ) -> None:
        self._make = make
        self._label_of = label_of
        self._gone: dict[str, dict[str, int]] = {}  # the COUNTS of tenants forgotten, by label
        self._caused: dict[str, int] = {}  # evictions caused, by label
        self._tenant_of = tenant_of
        self._shares = dict(shares)
        self._default_share = default_share
        self._capacity = capacity
        self._tenants: dict[Tenant, _Tenant] = {}

    def bind(self, index: Mapping[Key, int], capacity: int) -> None:
        """Takes the tier's capacity (its quotas are shares of it); the tenants' policies keep keys of
        their own, not bound to the tier's index (each would take arrays as long as the whole tier)."""
        self._capacity = capacity

    def held(self) -> dict[Tenant, int]:
        """Blocks each tenant holds now (tenants holding none left out)."""
        return {name: tenant.held for name, tenant in self._tenants.items() if tenant.held}

    def counts(self) -> dict[str, dict[str, int]]:
        """Per label (``label_of``): blocks stored, read and evicted so far, and held now."""
        blank = {**dict.fromkeys(COUNTS, 0), "held": 0, "caused": 0}
        out = {label: {**blank, **counts} for label, counts in self._gone.items()}
        for name, tenant in self._tenants.items():
            counts = out.setdefault(self._label_of(name), dict(blank))
            for what in COUNTS:
                counts[what] += getattr(tenant, what)
            counts["held"] += tenant.held
        for label, n in self._caused.items():
            out.setdefault(label, dict(blank))["caused"] += n
        return out

    def _drop(self, name: Tenant) -> None:
        """Forget a tenant, keeping its counts under its label."""
        tenant = self._tenants.pop(name)
        gone = self._gone.setdefault(self._label_of(name), dict.fromkeys(COUNTS, 0))
        for what in COUNTS:
            gone[what] += getattr(tenant, what)

    def _new(self, name: Tenant) -> _Tenant:
        tenant = self._tenants[name] = _Tenant(self._make())
        return tenant

    def _tenant(self, name: Tenant) -> _Tenant:
        """The tenant ``name``, new where it holds nothing yet (per batch; per block, inline)."""
        return self._tenants.get(name) or self._new(name)

    def _forget_if_empty(self, name: Tenant) -> None:
        """A tenant holding no block is forgotten: a tier's tenants are those holding blocks, however
        many came and went."""
        tenant = self._tenants[name]
        if not tenant.held and not tenant.incoming:
            self._drop(name)

    # (admit, insert and touch run once per block stored or read: each looks its tenant up once, inline)

    def admit(self, key: Key) -> bool:
        name = self._tenant_of(key)
        try:
            tenant = self._tenants[name]
        except KeyError:
            tenant = self._new(name)
        if tenant.admit is None or tenant.admit(key):
            return True
        self._forget_if_empty(name)
        return False

    def expect(self, keys: Sequence[Key]) -> None:
        """Each tenant's coming blocks count as its own from now until they are inserted (or the next
        eviction is over). The same store may be announced twice (before the stack makes room, then
        before the tier reserves it): a tenant's coming blocks are the most announced at once."""
        names = set(map(self._tenant_of, keys))
        counted = {names.pop(): len(keys)} if len(names) == 1 else Counter(map(self._tenant_of, keys))
        for name, n in counted.items():
            tenant = self._tenant(name)
            tenant.incoming = max(tenant.incoming, n)

    def insert(self, key: Key) -> None:
        name = self._tenant_of(key)
        try:
            tenant = self._tenants[name]
        except KeyError:
            tenant = self._new(name)
        tenant.insert(key)
        tenant.held += 1
        tenant.stored += 1
        if tenant.incoming:
            tenant.incoming -= 1

    def insert_many(self, keys: Sequence[Key], owner: Hashable | None = None) -> None:
        """Each run of one tenant's keys (a store's are all one tenant's, ``owner``'s where named)
        inserted at once."""
        for name, own in self._runs(keys, owner):
            tenant = self._tenant(name)
            tenant.policy.insert_many(own)
            tenant.held += len(own)
            tenant.stored += len(own)
            tenant.incoming = max(0, tenant.incoming - len(own))

    def access(self, keys: Sequence[Key], resident: Container[Key], owner: Hashable | None = None) -> list[Key]:
        """Each run of one tenant's keys (a request's are all one tenant's, ``owner``'s where named)
        handed to its policy at once, what it admits counted as coming (``expect``)."""
        runs = self._runs(keys, owner)
        if len(runs) == 1:  # (the usual request: one tenant's blocks, its policy's answer as it is)
            name = runs[0][0]
            tenant = self._tenant(name)
            tenant.read += sum(map(resident.__contains__, keys))
            admitted = tenant.policy.access(keys, resident)
            tenant.incoming = max(tenant.incoming, len(admitted))
            self._forget_if_empty(name)
            return admitted
        admitted = []
        declined = False
        for name, own in runs:
            tenant = self._tenant(name)
            reads = sum(map(resident.__contains__, own))
            got = tenant.policy.access(own, resident)
            tenant.read += reads
            if not declined:
                admitted += got
                declined = len(got) < len(own) - reads
        self.expect(admitted)
        for name in {name for name, _ in runs}:
            self._forget_if_empty(name)
        return admitted

    def _runs(self, keys: Sequence[Key], owner: Hashable | None = None) -> list[tuple[Tenant, Sequence[Key]]]:
        """``keys`` in runs of one tenant's, in order: one run, not copied, where all are one tenant's
        (``owner``'s, asking no key, where the caller named it)."""
        if owner is not None:
            return [(cast(Tenant, owner), keys)]  # (a tenant as ``tenant_of`` names it: the caller's word)
        names = set(map(self._tenant_of, keys))
        if len(names) == 1:
            return [(names.pop(), keys)]
        return [(name, list(run)) for name, run in itertools.groupby(keys, self._tenant_of)]

    def restore(self, keys: Sequence[Key], slots: Sequence[int] | np.ndarray | None = None) -> None:
        by_tenant: dict[Tenant, list[Key]] = {}
        for key in keys:
            by_tenant.setdefault(self._tenant_of(key), []).append(key)
        for name, own in by_tenant.items():
            tenant = self._tenant(name)
            tenant.policy.restore(own)
            tenant.held += len(own)

    def touch(self, key: Key) -> None:
        tenant = self._tenants[self._tenant_of(key)]
        tenant.touch(key)
        tenant.read += 1

    def remove(self, key: Key) -> None:
        name = self._tenant_of(key)
        tenant = self._tenants[name]
        tenant.policy.remove(key)
        tenant.held -= 1
        self._forget_if_empty(name)

    def evict(self, n: int, protected: Container[Key]) -> list[Key]:
        """Up to ``n`` blocks, from the tenants furthest over their quotas (counting the blocks each is
        about to store), so many from each that they end level (``level``): one call of each tenant's
        policy, again only where one could not give its part (its other blocks in use)."""
        tenants = self._tenants
        victims: list[Key] = []
        if len(tenants) == 1:  # (one tenant: nobody else's share to keep)
            ((name, tenant),) = tenants.items()
            coming = tenant.incoming
            victims = self._take(name, tenant, n, protected)
            if coming and victims:
                self._blame({name: coming}, len(victims))
            return victims
        shares, default, capacity = self._shares, self._default_share, self._capacity
        over, incoming = {}, {}
        for name, t in tenants.items():
            over[name] = t.held + t.incoming - shares.get(name, default) * capacity
            if t.incoming:  # (counted now; what is admitted but not stored by the end is not coming)
                incoming[name] = t.incoming
                t.incoming = 0
        while len(victims) < n and over:
            for name, take in level(over, n - len(victims)).items():
                taken = self._take(name, tenants[name], take, protected)
                victims += taken
                over[name] -= len(taken)
                if len(taken) < take or name not in tenants:  # it gave all it could
                    del over[name]
        for name in [name for name, t in tenants.items() if not t.held]:  # (only coming or admitted)
            self._drop(name)
        self._blame(incoming, len(victims))
        return victims

    def _blame(self, incoming: dict[Tenant, int], evicted: int) -> None:
        """Count ``evicted`` blocks as caused by the tenants about to store (``incoming``), in proportion
        (none where nobody was: a watermark's eviction in the background)."""
        if len(incoming) == 1:
            ((name, coming),) = incoming.items()
            if coming and evicted:
                label = self._label_of(name)
                self._caused[label] = self._caused.get(label, 0) + evicted
            return
        total = sum(incoming.values())
        if not total or not evicted:
            return
        parts = {name: evicted * k // total for name, k in incoming.items()}
        for name in sorted(incoming, key=incoming.__getitem__, reverse=True)[: evicted - sum(parts.values())]:
            parts[name] += 1
        for name, part in parts.items():
            label = self._label_of(name)
            self._caused[label] = self._caused.get(label, 0) + part

    def _take(self, name: Tenant, tenant: _Tenant, n: int, protected: Container[Key]) -> list[Key]:
        """Up to ``n`` of one tenant's blocks, by its own policy; a tenant left with none is forgotten."""
        tenant.incoming = 0
        taken = tenant.policy.evict(n, protected)
        tenant.held -= len(taken)
        tenant.evicted += len(taken)
        if not tenant.held:
            self._drop(name)
        return taken

    def __len__(self) -> int:
        return sum(tenant.held for tenant in self._tenants.values())

    def __contains__(self, key: object) -> bool:
        tenant = self._tenants.get(self._tenant_of(key))  # type: ignore[arg-type]
        return tenant is not None and key in tenant.policy
