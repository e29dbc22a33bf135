"""A store backend registered from outside kvtier is one a remote tier's YAML can name: its settings are
validated by its own model under the backend's name, with the same messages as the built-in ones', and
its connector is what the remote tier's factory uses; unregistered, it is refused again. A second,
different entry under a taken name is refused."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
from pydantic import Field

from helpers.config_helpers import error_of
from kvtier.core.config import load_config
from kvtier.core.tier_config import ConfigModel
from kvtier.tiers.remote.config import (
    StoreBackend,
    register_store_backend,
    store_backend,
    store_backends,
    unregister_store_backend,
)
from kvtier.tiers.remote.factory import connector
from kvtier.tiers.remote.link import Connector

HOST = {"medium": "host", "capacity_blocks": 4}


class ShelfSettings(ConfigModel):
    """A made-up store's settings."""

    shelf: str = Field(min_length=1)
    slots: int = Field(16, ge=1)


def _open(settings: ShelfSettings, timeout: float, lends_memory: bool) -> Connector:
    return Connector(lambda: None, settings.slots, f"shelf {settings.shelf} ({timeout} s, lends {lends_memory})")


SHELF = StoreBackend("shelf", ShelfSettings, _open)


@contextlib.contextmanager
def registered():
    register_store_backend(SHELF)
    try:
        yield
    finally:
        unregister_store_backend(SHELF.name)


def config(**tier) -> dict:
    return {"block_bytes": 4096, "tiers": [HOST, {"medium": "remote", "backend": "shelf", **tier}]}


def test_a_registered_backend_is_configured_and_connected_like_a_built_in_one():
    assert error_of(config(shelf={"shelf": "a"})) == (
        "config: tiers[1].backend: 'shelf' is not allowed; allowed: mooncake, redis"
    )
    with registered():
        assert store_backends() == ("mooncake", "redis", "shelf")
        tier = load_config(config(shelf={"shelf": "a"}, timeout=0.5)).tiers[1]
        assert tier.settings == ShelfSettings(shelf="a", slots=16)
        wired = connector(tier, lends_memory=False)
        assert (wired.clients, wired.where) == (16, "shelf a (0.5 s, lends False)")
        assert error_of(config(shelf={"shelf": "a", "slots": 0})) == (
            "config: tiers[1].shelf.slots: 0 is too small; must be at least 1"
        )
        assert error_of(config(shelf={"slots": 2})) == "config: tiers[1].shelf: missing key 'shelf'"
        assert (
            error_of(config()) == "config: tiers[1]: missing key 'shelf': the shelf backend's settings (shelf, slots)"
        )
        assert error_of(config(shelf={"shelf": "a"}, redis={"url": "redis://h:1/0"})) == (
            "config: tiers[1].redis: settings for redis but the backend is shelf; remove them or set backend: redis"
        )
        assert error_of(config(shelf={"shelf": "a"}, shelves=1)).startswith(
            "config: tiers[1].shelves: unknown key 'shelves'; allowed: medium, name,"
        )
    assert "shelf" not in store_backends()


def test_a_taken_name_is_refused():
    with registered():
        register_store_backend(SHELF)  # the same entry again: a module imported twice
        with pytest.raises(ValueError, match="a store backend named 'shelf' is registered already"):
            register_store_backend(dataclasses.replace(SHELF, settings=ConfigModel))
        with pytest.raises(ValueError, match="a store backend named 'redis' is registered already"):
            register_store_backend(dataclasses.replace(store_backend("redis"), connector=_open))
