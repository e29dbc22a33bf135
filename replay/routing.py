"""Which engine serves each request when a replay splits a trace across several engines: routers that
ignore prefixes, one that keeps a conversation on one engine, and prefix-aware routers that learn where
blocks are from the engines' KV events, as llm-d's or Dynamo's routers do.

- ``round_robin``: request i to engine i mod N; ``random``: an engine drawn at random (seeded);
- ``session``: every request of a session to the engine its session was given first, sessions given
  out round robin in the order they first appear. A session is the request's conversation where the
  workload knows it (``Request.session``: the generated chat workload), else the request's first block
  (a Mooncake trace says nothing of conversations; requests that open alike, a shared system prompt
  with what follows it, go together: a router with prefix affinity);
- ``prefix_gpu``: to the engine whose GPU tier holds the longest prefix of the request, as a router that
  hears only the GPU's events (vLLM's own) knows it;
- ``prefix_tiered``: to the engine whose tiers hold the most valuable prefix, as a router that hears
  kvtier's events for every tier knows it: each block of the prefix counts by the tier it would load
  from (the best one holding it), worth the prefill time it saves net of its load time
  (``tier_weight``: load times measured as the replay goes, against recomputing at the assumed rate).

A block of a tier other engines load from too (a node daemon's, a shared store's: its events name an
owner) counts for every engine. Prefix routers choose among the engines that have taken at most
``LOAD_SLACK`` (a quarter) above the mean count of requests, as real routers weigh load beside
prefixes: one that followed prefixes alone sent 57% of the chat workload's requests to one of four
engines. They break ties (no engine holds any of the prefix, or several hold as much) by sending the
request to the engine that took the fewest requests so far: without it every cold request would go to
engine 0. They see exactly what the events say
(``core/events.py``): a block demoted, evicted or loaded back is known to them when its tier says so,
not before.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvtier.core.events import BlockEvents, where
from kvtier.core.stack import TierStack
from kvtier.core.tier import Tier
from kvtier.replay.trace import Request

LOAD_SLACK = 0.25
"""How far above the engines' mean count of requests (the new one counted) an engine may have taken and
still be chosen by a prefix router: a bound on load, as real routers weigh load beside prefixes."""

ROUTINGS = ("round_robin", "random", "session", "prefix_gpu", "prefix_tiered")
PREFIX_ROUTINGS = ("prefix_gpu", "prefix_tiered")


class Router:
    """Chooses the engine of each request in trace order (``choose``), told of the loads the engines timed."""

    def choose(self, index: int, request: Request, keys: list[bytes]) -> int:
        raise NotImplementedError

    def loaded(self, tier: str, blocks: int, seconds: float) -> None:
        """A load of ``blocks`` blocks that tier ``tier`` alone served took ``seconds``."""


class FixedRouter(Router):
    """Engines chosen up front, from the requests alone."""

    def __init__(self, engine_of: list[int]) -> None:
        self.engine_of = engine_of

    def choose(self, index: int, request: Request, keys: list[bytes]) -> int:
        return self.engine_of[index]


def route(requests: Sequence[Request], engines: int, routing: str, seed: int = 0) -> list[int]:
    """The engine (0 .. ``engines`` - 1) of each request under a routing that ignores what engines hold;
    ValueError for any other."""
    if engines < 1:
        raise ValueError(f"a replay needs at least one engine, not {engines}")
    if routing == "round_robin":
        return [i % engines for i in range(len(requests))]
    if routing == "random":
        draw = random.Random(seed)
        return [draw.randrange(engines) for _ in requests]
    if routing != "session":
        raise ValueError(f"unknown routing {routing!r} for requests alone; known: round_robin, random, session")
    given: dict[tuple[str, int | None], int] = {}
    return [given.setdefault(_session(request), len(given) % engines) for request in requests]


def _session(request: Request) -> tuple[str, int | None]:
    if request.session is not None:
        return "conversation", request.session
    return "first block", request.hash_ids[0] if request.hash_ids else None


def tier_weight(seconds_per_block: float | None, recompute_s_per_block: float) -> float:
    """What a hit from a tier is worth, 0 to 1: the share of the block's prefill time its load saves (1
    until a load from the tier was timed)."""
    if seconds_per_block is None:
        return 1.0
    return max(0.0, 1.0 - seconds_per_block / recompute_s_per_block)


class PrefixRouter(Router):
    """A prefix-aware router over ``stacks`` (one per engine) that hears the KV events of the tiers
    ``sees`` admits, and weighs a block held by a tier with ``tier_weight``, among the engines within
    ``LOAD_SLACK`` of the mean load."""

    def __init__(self, stacks: Sequence[TierStack], sees: str, recompute_s_per_block: float) -> None:
        if sees not in ("gpu", "every tier"):
            raise ValueError(f"a prefix router sees the gpu tier or every tier, not {sees!r}")
        self.recompute_s_per_block = recompute_s_per_block
        self.events: list[BlockEvents] = []
        self.views: list[dict[str, set[bytes]]] = []  # per engine, per tier: the blocks the events say it holds
        for stack in stacks:
            events = BlockEvents()
            events.watch([tier for tier in stack.tiers if sees != "gpu" or _is_gpu(tier)])
            self.events.append(events)
            self.views.append({})
        self.shared: dict[tuple[str, str], set[bytes]] = {}  # (tier, owner): blocks every engine may load
        self.routed = [0] * len(stacks)
        self._timed: dict[str, tuple[int, float]] = {}  # tier -> (blocks, seconds) of timed loads

    def loaded(self, tier: str, blocks: int, seconds: float) -> None:
        had_blocks, had_seconds = self._timed.get(tier, (0, 0.0))
        self._timed[tier] = (had_blocks + blocks, had_seconds + seconds)

    def weights(self) -> dict[str, float]:
        """Each tier's ``tier_weight`` now."""
        return {
            tier: tier_weight(seconds / blocks if blocks else None, self.recompute_s_per_block)
            for tier, (blocks, seconds) in self._timed.items()
        }

    def choose(self, index: int, request: Request, keys: list[bytes]) -> int:
        weights = self.weights()
        scores = []
        for events, view in zip(self.events, self.views, strict=True):
            _apply(events, view, self.shared)
        shared = [(tier, held) for (tier, _), held in self.shared.items()]
        for view in self.views:
            scores.append(_prefix_value(keys, [*view.items(), *shared], weights))
        mean = (sum(self.routed) + 1) / len(self.routed)  # (the new request counted)
        within = [i for i, n in enumerate(self.routed) if n <= mean * (1 + LOAD_SLACK)]  # (never empty)
        best = max(scores[i] for i in within)
        engine = min((i for i in within if scores[i] == best), key=lambda i: self.routed[i])
        self.routed[engine] += 1
        return engine


def _is_gpu(tier: Tier) -> bool:
    """Whether the tier's events are GPU memory's (the only ones a router hearing vLLM's own events gets),
    as its medium's registry entry names them."""
    place = where(tier)
    return place is not None and place.medium == "GPU"


def _apply(events: BlockEvents, view: dict[str, set[bytes]], shared: dict[tuple[str, str], set[bytes]]) -> None:
    """What the engine's tiers said since the last request, into its view (a tier with an owner: into
    the view shared by every engine, by tier and owner)."""
    batch = events.take()
    if batch.lost:  # (never in a replay: it takes after each request)
        view.clear()
    for run in batch.runs:
        owner = run.where.owner
        held = view.setdefault(run.tier, set()) if owner is None else shared.setdefault((run.tier, owner), set())
        if run.stored:
            held.update(run.keys)
        else:
            held.difference_update(run.keys)


def _prefix_value(keys: list[bytes], view: list[tuple[str, set[bytes]]], weights: dict[str, float]) -> float:
    """The worth of the leading blocks some tier of the view (tier, blocks it holds) holds, each by the
    best tier holding it."""
    value = 0.0
    for key in keys:
        best = max((weights.get(tier, 1.0) for tier, held in view if key in held), default=None)
        if best is None:
            break
        value += best
    return value
