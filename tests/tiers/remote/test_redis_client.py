"""The Redis client against a real redis-server: records round-trip bit-exact from and into separate
pieces (a header and a slot), a record of another size or a missing one is False, a failure before any
reply is a StoreError (within the socket timeout for a hung server, at once for a dead one), and the
password comes from the environment, never shows in a message, and is required by the server."""

from __future__ import annotations

import time

import numpy as np
import pytest

from helpers.redis_server import redis_server
from kvtier.tiers.remote.client import StoreError
from kvtier.tiers.remote.redis_client import SOCKET_TIMEOUT_FACTOR, RedisClient

N, HEAD, BODY = 6, 40, 64 * 1024
TIMEOUT = 0.5


class Buffers:
    """Headers and bodies in separate arrays, as records of two pieces each."""

    def __init__(self, seed: int | None = None) -> None:
        """Random bytes from ``seed``, or zeros without one."""
        rng = np.random.default_rng(seed)
        self.head, self.body = (rng.integers(0, 256 if seed is not None else 1, (N, size), dtype=np.uint8)
                                for size in (HEAD, BODY))

    def records(self) -> list[list[tuple[int, int]]]:
        return [[(self.head[i].ctypes.data, HEAD), (self.body[i].ctypes.data, BODY)] for i in range(N)]

    def same(self, other: Buffers, i: int) -> bool:
        return np.array_equal(self.head[i], other.head[i]) and np.array_equal(self.body[i], other.body[i])


NAMES = [f"kvtier/test/{i}" for i in range(N)]


def client(server, timeout: float = TIMEOUT, password: str | None = None) -> RedisClient:
    return RedisClient(server.url, timeout=timeout, password=password)


def test_records_round_trip_from_and_into_pieces(server):
    source, target = Buffers(seed=1), Buffers()
    c = client(server)
    assert c.exists(NAMES) == [False] * N
    assert c.put(NAMES, source.records()) == [True] * N
    assert server.client().get(NAMES[2]) == source.head[2].tobytes() + source.body[2].tobytes()
    assert c.exists(NAMES + ["kvtier/test/other"]) == [True] * N + [False]
    assert c.get(NAMES, target.records()) == [True] * N
    assert all(source.same(target, i) for i in range(N))
    replacement = Buffers(seed=2)
    assert c.put(NAMES[:1], replacement.records()[:1]) == [True]
    assert c.get(NAMES[:1], target.records()[:1]) == [True] and replacement.same(target, 0)
    c.remove(NAMES[:3])
    assert c.exists(NAMES) == [False] * 3 + [True] * 3
    c.close()


def test_a_record_of_another_size_or_a_missing_one_is_false(server):
    source, target = Buffers(seed=1), Buffers()
    c = client(server)
    c.put(NAMES, source.records())
    raw = server.client()
    raw.set(NAMES[1], b"short")
    raw.set(NAMES[2], source.head[2].tobytes() + source.body[2].tobytes() + b"x")
    raw.delete(NAMES[3])
    assert c.get(NAMES, target.records()) == [True, False, False, False, True, True]
    assert source.same(target, 0) and source.same(target, 5)


def test_a_restarted_server_is_reached_again_without_an_error(server):
    c = client(server)
    c.put(NAMES, Buffers(seed=1).records())
    server.restart()
    assert c.exists(NAMES) == [False] * N  # the idle connection broke; the call went once more on a new one


def test_a_hung_server_fails_a_call_after_the_socket_timeout(server):
    c = client(server)
    assert c.exists(NAMES) == [False] * N
    server.stop()
    started = time.monotonic()
    with pytest.raises(StoreError, match="Timeout"):
        c.exists(NAMES)
    took = time.monotonic() - started
    server.cont()
    assert TIMEOUT * SOCKET_TIMEOUT_FACTOR - 0.1 < took < TIMEOUT * SOCKET_TIMEOUT_FACTOR + 1.0


def test_a_dead_server_fails_a_call_at_once(server):
    c = client(server)
    c.exists(NAMES)
    server.kill()
    started = time.monotonic()
    with pytest.raises(StoreError, match="refused"):
        c.get(NAMES, Buffers().records())
    assert time.monotonic() - started < 0.5


@pytest.fixture
def guarded(tmp_path):
    with redis_server(tmp_path / "redis", password="correct-horse-battery") as server:
        yield server


def test_the_password_is_required_and_never_shown(guarded):
    records = Buffers(seed=1).records()
    assert client(guarded, password="correct-horse-battery").put(NAMES, records) == [True] * N
    for password in (None, "wrong-password-here"):
        with pytest.raises(StoreError) as info:
            client(guarded, password=password).exists(NAMES)
        assert "correct-horse-battery" not in str(info.value)
        if password is not None:
            assert password not in str(info.value)
