"""The remote tier tests' server: a real redis-server per test (``helpers.redis_server``), skipped with
the install line when Redis is missing, failed instead under KVTIER_REQUIRE_REMOTE=1."""

from __future__ import annotations

import pytest

from helpers.redis_server import redis_server


@pytest.fixture
def server(tmp_path):
    with redis_server(tmp_path / "redis") as server:
        yield server
