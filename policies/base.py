"""The eviction strategy interface: which blocks leave a tier.

A tier tells its policy about every readable block (``insert``), every read (``touch``) and every
block that left for another reason (``remove``); when it needs room it asks ``evict(n, protected)``
for victims. Before a block is written into the tier, the planner asks ``admit(key)``: a policy may
decline blocks it expects never to be read (the block is then simply not stored in that tier). The
tier owns the lock: a policy is only ever called under it and needs none itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container, Hashable, Mapping, Sequence
from typing import Generic, TypeVar

import numpy as np


class PolicyError(ValueError):
    """A policy name that names no usable policy: unknown, not importable, or not an ``EvictionPolicy``.
    Policies know nothing of configuration files; the config turns this into a ConfigError naming the key."""


Key = TypeVar("Key", bound=Hashable)
"""What a policy orders: a tier's block keys (``bytes``), or any hashable (the cache replay's block ids)."""


class EvictionPolicy(ABC, Generic[Key]):
    """Orders a tier's readable blocks for eviction. Keys are opaque: a tier's are ``bytes``."""

    expects = False
    """Whether ``expect`` does anything: a tier skips the call (and its lock) for a policy where it does not."""

    def admit(self, key: Key) -> bool:
        """Whether a block that is not in the tier should be written into it; asked once per block
        about to be stored, before room is made for it. A declined block is not stored and no
        ``insert`` follows; asking is also what a policy can learn from (the key was wanted). The
        default admits every block."""
        return True

    def expect(self, keys: Sequence[Key]) -> None:
        """Blocks about to be written into the tier, for which room is made next (each is then inserted,
        or not). A policy that shares the tier out among owners counts them as their owners' already
        (``TenantShares``); the default ignores them."""

    def bind(self, index: Mapping[Key, int], capacity: int) -> None:
        """A tier hands over its index (key -> slot below ``capacity``) once, before the policy tracks
        any key: every key inserted has its slot there until ``remove`` or ``evict`` gave it up. A
        policy may order its keys by slot instead of keeping a dict of its own (``LRUPolicy`` does);
        the default ignores it."""

    @abstractmethod
    def insert(self, key: Key) -> None:
        """A block became readable in the tier. The key is not tracked yet."""

    def restore(self, keys: Sequence[Key], slots: Sequence[int] | np.ndarray | None = None) -> None:
        """Blocks a tier found again in persistent storage at start, oldest use first: they should
        leave in that order; ``slots``, where a tier that ``bind``s its index has them. Policies that
        reorder batches of inserts, or link keys by slot, override this."""
        for key in keys:
            self.insert(key)

    def insert_many(self, keys: Sequence[Key], owner: Hashable | None = None) -> None:
        """``insert`` of each key, in order: blocks that became readable together (one store's). A
        policy, or a wrapper of policies, may do better at once; the default inserts one by one.
        ``owner``: as for ``access``."""
        for key in keys:
            self.insert(key)

    @abstractmethod
    def touch(self, key: Key) -> None:
        """A tracked block was read."""

    def access(self, keys: Sequence[Key], resident: Container[Key], owner: Hashable | None = None) -> list[Key]:
        """One request's blocks in order, as a cache replay sees them: ``touch`` each one in ``resident``
        and ask ``admit`` of each other one; returns those admitted before the first declined (later
        ones are asked, what a policy learns from, but could not be prefix hits: not stored), which are
        then about to be stored (``expect``ed). A wrapper of policies hands each owner's blocks over at
        once; the default calls one by one.

        ``owner``: the tenant all ``keys`` belong to, where the caller knows it (a replayed request
        names its tenant), as the policy's own ``tenant_of`` would name it: a policy that shares a tier
        among tenants (``TenantShares``) then asks no key its tenant. None: not known; others ignore it."""
        admitted: list[Key] = []
        declined = False
        touch, admit = self.touch, self.admit
        for key in keys:
            if key in resident:
                touch(key)
            elif admit(key) and not declined:
                admitted.append(key)
            else:
                declined = True
        if self.expects:
            self.expect(admitted)
        return admitted

    @abstractmethod
    def remove(self, key: Key) -> None:
        """A tracked block left the tier without being chosen by ``evict``; forget it."""

    @abstractmethod
    def evict(self, n: int, protected: Container[Key]) -> list[Key]:
        """Choose up to ``n`` tracked keys not in ``protected``, forget them, and return them in eviction order.

        Returns fewer than ``n`` (possibly none) when fewer unprotected keys are tracked.
        """

    @abstractmethod
    def __len__(self) -> int:
        """Number of tracked keys."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is tracked."""
