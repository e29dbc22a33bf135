"""What the Redis client does beyond the StoreClient contract (tests/contracts/test_store_client.py runs
that against Redis too): the password comes from the caller (the environment, through the factory), the
server requires it, and no message ever shows it, neither the right one nor a wrong one."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.redis_server import redis_server
from kvtier.tiers.remote.client import StoreError
from kvtier.tiers.remote.redis_client import RedisClient

N, HEAD, BODY = 6, 40, 64 * 1024
TIMEOUT = 0.5
NAMES = [f"kvtier/test/{i}" for i in range(N)]
PASSWORD = "correct-horse-battery"


@pytest.fixture
def guarded(tmp_path):
    with redis_server(tmp_path / "redis", password=PASSWORD) as server:
        yield server


def test_the_password_is_required_and_never_shown(guarded):
    data = np.random.default_rng(1).integers(0, 256, (N, HEAD + BODY), dtype=np.uint8)
    records = [[(row.ctypes.data, HEAD), (row.ctypes.data + HEAD, BODY)] for row in data]
    assert RedisClient(guarded.url, timeout=TIMEOUT, password=PASSWORD).put(NAMES, records) == [True] * N
    assert guarded.client().get(NAMES[2]) == data[2].tobytes()
    for password in (None, "wrong-password-here"):
        with pytest.raises(StoreError) as info:
            RedisClient(guarded.url, timeout=TIMEOUT, password=password).exists(NAMES)
        assert PASSWORD not in str(info.value)
        if password is not None:
            assert password not in str(info.value)
