"""Fixtures of the contract suites: one parameter per implementation, so a new implementation gets every
test of a suite by one entry in the registry its fixture reads.

- ``store`` (one for the whole run) and ``fresh_store`` (one per test, for tests that kill, stop or
  restart it): a running store of each kind in ``helpers.stores.STORES``; ``store_class`` the kind itself;
- ``names``: record names unique to the test, so tests can share a store.

The transfer backends', tiers' and policies' fixtures live beside their suites (``test_transfer_backend``,
``test_tier``, ``test_eviction_policy``), each with its own registry.
"""

from __future__ import annotations

import pytest

from helpers.stores import STORES, StoreUnderTest


@pytest.fixture(scope="session", params=sorted(STORES))
def store(request, tmp_path_factory) -> StoreUnderTest:
    """A store of each kind, shared by the tests that do it no harm (each names its records its own way)."""
    with STORES[request.param](tmp_path_factory.mktemp(request.param)) as running:
        yield running


@pytest.fixture(params=sorted(STORES))
def fresh_store(request, tmp_path) -> StoreUnderTest:
    """A store of each kind of the test's own: the test may kill, stop or restart it."""
    with STORES[request.param](tmp_path) as running:
        yield running


@pytest.fixture(params=sorted(STORES))
def store_class(request) -> type[StoreUnderTest]:
    """Each kind of store, not started (a test that starts a special one, ``small()``)."""
    return STORES[request.param]


@pytest.fixture
def names(request):
    """``names(count, tag="")``: record names unique to the test (the store is shared)."""
    return lambda count, tag="": [f"{request.node.name}/{tag}{i}" for i in range(count)]
