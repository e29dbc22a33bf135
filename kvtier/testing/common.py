"""What the suites share: ``ContractTests``, whose ``rng`` fixture seeds a numpy generator from the test's
id (so a failure reproduces), and ``assert_clean`` for a stack with nothing left in flight."""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

import numpy as np
import pytest

if TYPE_CHECKING:
    from kvtier.api import KVTier


def seeded_rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A numpy generator seeded from the requesting test's id: the same bytes on every run of that test."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


class ContractTests:
    """The base of the suites that draw random bytes."""

    @pytest.fixture
    def rng(self, request: pytest.FixtureRequest) -> np.random.Generator:
        return seeded_rng(request)


def assert_clean(kv: KVTier) -> None:
    """A ``KVTier`` with nothing in flight: every tier consistent, nothing pinned or being written, no
    error from its background work."""
    kv.wait_idle()
    for tier in kv.stack.tiers:
        tier.check_invariants()
        assert tier.leaks() == {"pinned": 0, "writing": 0}, tier.name
    assert kv.stack.background_errors == []
