"""Real Redis clients of kvtier's with one property changed, for the link's and the remote backend's tests."""

from __future__ import annotations

from kvtier.tiers.remote.redis_client import RedisClient


class Uninterruptible(RedisClient):
    """A real Redis client whose calls the link cannot interrupt (as Mooncake's): a hung one ends only when
    the server answers (or its socket times out). Notes every close (``closed``: clear it before use)."""

    interruptible = False
    closed: list[Uninterruptible] = []

    def close(self) -> None:
        super().close()
        Uninterruptible.closed.append(self)
