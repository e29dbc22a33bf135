"""Replay a request trace through one cache, metadata only, to compare eviction policies with the optimum.

Why this exists
    An eviction policy is only as good as the hit ratio it gets on real traffic, and a hit ratio
    means little without the best one possible. This module replays a Mooncake request trace
    (``kvtier.replay.trace``: one JSON object a line, ``hash_ids`` naming the prompt's blocks)
    against a cache of ``capacity`` blocks driven by any ``EvictionPolicy``, and computes the
    offline optimum (Belady: evict the block whose next use is farthest away) on the same trace
    with the same rules, so a policy's figure can be read as a fraction of what is achievable.
    No bytes move: a block is its id, the cache is a set.

Hit semantics (the same for ``replay`` and ``belady``)
    For each request in file order:

    1. hits = the longest prefix of its ``hash_ids`` that is resident. A resident block after a
       missing one is not a hit: an engine recomputes from the first miss on (the ids are chained,
       so a block is only useful together with everything before it).
    2. Every block of the request is then referenced.
    3. hit_ratio = sum of prefix hits / sum of referenced blocks.

How blocks get in and out
    ``replay`` (online policies): resident blocks are touched and the policy is asked to ``admit``
    each missing one (in request order, as a tier's planner asks before it stores), then the
    missing blocks before the first declined one are inserted (in request order) after room was
    made with one ``policy.evict(n, protected=<the request's blocks>)`` call, just as a tier
    reserves a batch then commits it. That is what the planner stores (``_admitted_prefix``): a
    block after a declined one could never be a prefix hit. A request never evicts its own blocks,
    and every block of that admitted prefix is cached. If the policy hands
    back fewer victims than needed (everything else is protected), only the leading missing blocks
    that fit are inserted; with the shared trace this never happens (its longest request has 374
    blocks).

    ``belady`` (offline optimum): one reference at a time, a miss on a full cache drops whichever
    of the resident blocks and the incoming one is used again farthest in the future; dropping the
    incoming one means not caching it. It never drops a block the current request still needs (its
    next use is now). Not caching is what an online tier cannot do (it must store what it computed
    and can only evict it later), but it is part of the optimum, and the reference figures of the
    shared data README were computed this way (see ``belady``).

Keys handed to the policy are the trace's integer ids, not ``bytes``: every policy treats keys as
opaque hashables, and skipping 120,000 conversions keeps a replay well under a second.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass

from kvtier.core.errors import StateError
from kvtier.policies.base import EvictionPolicy
from kvtier.replay.trace import Request


@dataclass(frozen=True)
class ReplayResult:
    """What one replay counted: prefix-hit blocks, referenced blocks, and blocks evicted."""

    hits: int
    references: int
    evictions: int

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.references if self.references else 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {
            "hits": self.hits,
            "references": self.references,
            "evictions": self.evictions,
            "hit_ratio": self.hit_ratio,
        }


def prefix_hits(ids: Sequence[int], resident: Container) -> int:
    """How many of ``ids``, from the first on, are in ``resident``: the request's hit under the prefix rule."""
    n = 0
    for h in ids:
        if h not in resident:
            break
        n += 1
    return n


def replay(
    requests: Sequence[Request],
    capacity: int,
    policy: EvictionPolicy[int],
    on_request: Callable[[Request, int, int], None] | None = None,
) -> ReplayResult:
    """Run ``requests`` through a cache of ``capacity`` blocks ordered by ``policy`` (a fresh instance),
    each request's tenant named to it (``owner``: shares then ask no block its tenant).

    ``on_request(request, hits, resident)`` is called after each request with its prefix hits and
    the number of cached blocks (for progress, saved tokens and occupancy over time).
    Raises StateError if the policy breaks its contract (returns a protected or untracked key).
    """
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, not {capacity}")
    resident: set[int] = set()
    hits = references = evictions = 0
    for request in requests:
        ids = request.hash_ids
        references += len(ids)
        request_hits = prefix_hits(ids, resident)
        hits += request_hits
        missing = policy.access(ids, resident, request.tenant)
        need = len(resident) + len(missing) - capacity
        if need > 0:
            protected = set(ids)
            victims = policy.evict(need, protected)
            for v in victims:
                if v not in resident or v in protected:
                    raise StateError(
                        f"{type(policy).__name__} evicted {v!r}, which is "
                        f"{'protected' if v in protected else 'not cached'}"
                    )
                resident.remove(v)
            evictions += len(victims)
            if len(victims) < need:
                del missing[len(missing) - (need - len(victims)) :]
        resident.update(missing)
        policy.insert_many(missing, request.tenant)
        if on_request is not None:
            on_request(request, request_hits, len(resident))
    return ReplayResult(hits, references, evictions)


def belady(requests: Sequence[Request], capacity: int) -> ReplayResult:
    """The offline optimum: on every miss of a full cache, drop whichever of the resident blocks and
    the incoming one is used again farthest in the future (never-again first).

    Choosing the incoming block means not caching it (a bypass). That is what makes this the true
    optimum, and it is what the reference figures in the shared data README were computed with
    (LRU 0.083/0.230/0.530, Belady 0.277/0.493/0.640 at 1000/4000/16000 blocks). Forbidding it,
    i.e. protecting every block of the current request as ``replay`` does for online policies,
    gives 0.269 at 1000 blocks.

    Why it bounds every policy under prefix semantics: a request holding block c holds c's parent p
    before it, so p's next use always comes before c's. The farthest-next-use rule therefore never
    drops (or bypasses) a parent while its child stays, the resident set is always prefix-closed,
    and its prefix hits equal its plain hits, which no cache of the same size can beat. Blocks of
    the current request not yet referenced are never chosen (they are needed now), so the
    request's protection holds here too. A max-heap of (next use, id) with lazy deletion keeps it
    O(log n) per reference.
    """
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, not {capacity}")
    flat = [h for r in requests for h in r.hash_ids]
    never = len(flat)  # a position after every reference: "not used again"
    next_use = [never] * len(flat)
    last: dict[int, int] = {}
    for pos in range(len(flat) - 1, -1, -1):
        next_use[pos] = last.get(flat[pos], never)
        last[flat[pos]] = pos
    resident: dict[int, int] = {}  # id -> position of its next use
    heap: list[tuple[int, int]] = []  # (-next use, id); stale when it disagrees with ``resident``
    hits = references = evictions = 0
    pos = 0
    for request in requests:
        ids = request.hash_ids
        references += len(ids)
        hits += prefix_hits(ids, resident)
        for h in ids:
            n = next_use[pos]
            pos += 1
            if h not in resident:
                if len(resident) >= capacity:
                    while heap and resident.get(heap[0][1]) != -heap[0][0]:
                        heapq.heappop(heap)  # stale: used again since, or already gone
                    if not heap or -heap[0][0] <= n:
                        continue  # the incoming block is used farthest: do not cache it
                    del resident[heapq.heappop(heap)[1]]
                    evictions += 1
            resident[h] = n
            heapq.heappush(heap, (-n, h))
    return ReplayResult(hits, references, evictions)
