"""kvtier's contract suites, for a medium, a transfer backend, a store or an eviction policy of your own.

Each suite is a class of pytest tests: subclass it in a test module of your package, provide the fixture
it names (what it runs over), and pytest runs every test of the suite over your implementation; kvtier's
own tests/contracts are such subclasses, one for each built-in implementation. docs/extending.md shows
the subclass for each.

- ``EvictionPolicyTests`` (``kvtier.testing.policy``): an ``EvictionPolicy``; provide ``make_policy``;
- ``KeyedTierTests``, ``TierTests`` (``kvtier.testing.tier``): a tier addressed by key, a tier with slots
  (a medium's); provide ``tier_kind``;
- ``TransferBackendTests`` (``kvtier.testing.transfer``): a ``TransferBackend``; provide ``rig``;
- ``StoreClientTests`` (``kvtier.testing.store``): a shared store's ``StoreClient``, and
  ``RemoteStackTests`` (``kvtier.testing.remote_stack``): a whole stack over that store; provide
  ``store_class``, a ``StoreUnderTest`` of the store's servers.

This subpackage needs pytest and hypothesis (``pip install 'kvtier[testing]'``), which kvtier itself
never imports. Its asserts are rewritten by pytest, as a test module's are, so a failure shows its values.
"""

import pytest

# (the modules by name: this package is imported already, and naming it would only warn so)
pytest.register_assert_rewrite(
    *(f"kvtier.testing.{module}" for module in ("common", "policy", "remote_stack", "store", "tier", "transfer"))
)

from kvtier.testing.policy import EvictionPolicyTests  # noqa: E402 - after the rewrite is registered
from kvtier.testing.remote_stack import RemoteStackTests  # noqa: E402
from kvtier.testing.store import StoreClientTests, StoreUnderTest  # noqa: E402
from kvtier.testing.tier import KeyedTierTests, MemorySlots, TierKind, TierSpec, TierTests  # noqa: E402
from kvtier.testing.transfer import Rig, TransferBackendTests  # noqa: E402

__all__ = [
    "EvictionPolicyTests",
    "KeyedTierTests",
    "MemorySlots",
    "RemoteStackTests",
    "Rig",
    "StoreClientTests",
    "StoreUnderTest",
    "TierKind",
    "TierSpec",
    "TierTests",
    "TransferBackendTests",
]
