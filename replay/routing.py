"""Which engine serves each request when a replay splits a trace across several engines: the two
routings every fleet has, one that ignores prefixes and one that keeps a conversation on one engine.

- ``round_robin``: request i to engine i mod N;
- ``session``: every request of a session to the engine its session was given first, sessions given
  out round robin in the order they first appear. A session is the request's conversation where the
  workload knows it (``Request.session``: the generated chat workload), else the request's first block
  (a Mooncake trace says nothing of conversations; requests that open alike, a shared system prompt
  with what follows it, go together: a router with prefix affinity).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.replay.trace import Request

SPLITS = ("round_robin", "session")


def route(requests: Sequence[Request], engines: int, split: str) -> list[int]:
    """The engine (0 .. ``engines`` - 1) of each request under ``split``; ValueError for an unknown split."""
    if engines < 1:
        raise ValueError(f"a replay needs at least one engine, not {engines}")
    if split == "round_robin":
        return [i % engines for i in range(len(requests))]
    if split != "session":
        raise ValueError(f"unknown split {split!r}; known: {', '.join(SPLITS)}")
    given: dict[tuple[str, int | None], int] = {}
    return [given.setdefault(_session(request), len(given) % engines) for request in requests]


def _session(request: Request) -> tuple[str, int | None]:
    if request.session is not None:
        return "conversation", request.session
    return "first block", request.hash_ids[0] if request.hash_ids else None
