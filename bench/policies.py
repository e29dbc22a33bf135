"""Eviction policies on a real request trace, as a fraction of the offline optimum measured in the same run.

What is measured
    Every registered eviction policy (``kvtier.policies.EVICTION_POLICIES``) replays the Mooncake
    trace through one cache of N blocks, metadata only (``kvtier.replay.cache.replay``): a request
    hits the longest resident prefix of its block ids, then all its blocks are referenced. The hit
    ratio is prefix-hit blocks / referenced blocks.

Reference, measured in the same run
    Belady's offline optimum on the same trace and size (``kvtier.replay.cache.belady``): evict the
    block used again farthest in the future. No policy that only sees the past can beat it, so
    policy / Belady says how much of the achievable hit ratio a policy gets.

Context (not policies, not in ``ratio``; both read the future)
    ``lru+oracle-adm.``: LRU that only caches blocks the trace will reference again, i.e. an
    admission filter that never errs. It shows how much of the gap to Belady is "caching blocks that
    are never reused" (which an admission policy can learn to avoid) and how much is "not knowing
    when a reused block comes back" (which no online policy can know).
    ``future-count``: evict the block with the fewest references left in the trace (ties: least
    recently used), i.e. perfect frequency knowledge without timing. Whatever a frequency- or
    admission-based policy learns, it cannot know more than this; where this stays below a target
    share of Belady, no such policy reaches it.
    ``reuse-oracle``: LRU that knows, at every reference, whether the block is referenced again
    within the next 4 x capacity references, and evicts the blocks that are not first. This is the
    binary question learned policies (e.g. "learning relaxed Belady") try to answer from features;
    answered perfectly it still stays short of Belady, so it bounds what such a predictor can give.

Why
    Which policy a tier should default to is a question about traffic, not about code. These
    traces are chains of shared prefixes where most blocks are never read again; this shows how
    much each policy gains over LRU there, and how far all of them stay from the optimum.

The last line printed is one JSON object: ``ratio`` is the best policy's hit ratio / Belady's,
taking the minimum over sizes, plus every figure.

Run: ``.venv/bin/python bench/policies.py [--trace PATH|generated] [--capacities 1000,4000,16000]``
(``generated``: the seeded chat workload of ``kvtier replay`` without a trace).
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from pathlib import Path

from kvtier.policies import EVICTION_POLICIES
from kvtier.replay.cache import ReplayResult, belady, prefix_hits, replay
from kvtier.replay.trace import Request, load_trace
from kvtier.replay.workload import generate

DEFAULT_TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"


def lru_oracle_admission(requests: Sequence[Request], capacity: int) -> ReplayResult:
    """LRU over only the blocks that are referenced again later (an offline admission filter)."""
    remaining: dict[int, int] = {}
    for r in requests:
        for h in r.hash_ids:
            remaining[h] = remaining.get(h, 0) + 1
    order: OrderedDict[int, None] = OrderedDict()
    hits = references = evictions = 0
    for r in requests:
        ids = r.hash_ids
        references += len(ids)
        hits += prefix_hits(ids, order)
        for h in ids:
            remaining[h] -= 1
            if h in order:
                order.move_to_end(h)
            elif remaining[h] and capacity:
                order[h] = None
        protected = set(ids)
        while len(order) > capacity:  # oldest unprotected first; a request never exceeds capacity here
            victim = next((k for k in order if k not in protected), None)
            if victim is None:
                break
            del order[victim]
            evictions += 1
    return ReplayResult(hits, references, evictions)


def future_count(requests: Sequence[Request], capacity: int) -> ReplayResult:
    """Evict the block with the fewest references left (ties: least recently used); the request's own
    blocks are protected and every missing block is cached, as in ``replay``."""
    remaining = Counter(h for r in requests for h in r.hash_ids)
    resident: dict[int, tuple[int, int]] = {}  # id -> its heap priority (references left, last use)
    heap: list[tuple[tuple[int, int], int]] = []
    hits = references = evictions = clock = 0
    for r in requests:
        ids = r.hash_ids
        references += len(ids)
        hits += prefix_hits(ids, resident)
        missing = [h for h in ids if h not in resident]
        need = len(resident) + len(missing) - capacity
        parked = []
        while need > 0 and heap:
            priority, victim = heapq.heappop(heap)
            if resident.get(victim) != priority:
                continue  # stale
            if victim in ids:
                parked.append((priority, victim))
                continue
            del resident[victim]
            evictions += 1
            need -= 1
        for item in parked:
            heapq.heappush(heap, item)
        if need > 0:
            missing = missing[:len(missing) - need]
        admitted = set(missing)
        for h in ids:
            remaining[h] -= 1
            clock += 1
            if h in resident or h in admitted:
                resident[h] = (remaining[h], clock)
                heapq.heappush(heap, (resident[h], h))
    return ReplayResult(hits, references, evictions)


def reuse_oracle(requests: Sequence[Request], capacity: int, horizon: int) -> ReplayResult:
    """LRU in two classes: blocks not referenced again within ``horizon`` references of their last
    reference are evicted first. The request's own blocks are protected and every missing block is
    cached, as in ``replay``."""
    flat = [h for r in requests for h in r.hash_ids]
    soon = [False] * len(flat)
    last: dict[int, int] = {}
    for pos in range(len(flat) - 1, -1, -1):
        soon[pos] = last.get(flat[pos], len(flat)) - pos <= horizon
        last[flat[pos]] = pos
    queues: tuple[OrderedDict[int, None], OrderedDict[int, None]] = (OrderedDict(), OrderedDict())  # not soon, soon
    resident: dict[int, int] = {}  # id -> index of its queue
    hits = references = evictions = pos = 0
    for r in requests:
        ids = r.hash_ids
        references += len(ids)
        hits += prefix_hits(ids, resident)
        for h in ids:
            if h in resident:
                del queues[resident[h]][h]
            resident[h] = int(soon[pos])
            queues[resident[h]][h] = None
            pos += 1
        protected = set(ids)
        for queue in queues:
            victims = [k for k in queue if k not in protected][:max(0, len(resident) - capacity)]
            for victim in victims:
                del queue[victim], resident[victim]
            evictions += len(victims)
    return ReplayResult(hits, references, evictions)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE),
                        help="Mooncake JSONL trace, or 'generated' for the seeded chat workload")
    parser.add_argument("--capacities", default="1000,4000,16000", help="cache sizes in blocks, comma separated")
    args = parser.parse_args(argv)
    capacities = [int(c) for c in args.capacities.split(",")]
    if args.trace == "generated":
        requests, name = generate(), "generated chat workload (seed 0)"
    elif Path(args.trace).is_file():
        requests, name = load_trace(args.trace), f"trace {Path(args.trace).name}"
    else:
        print(f"trace not found: {args.trace} (pass --trace)", file=sys.stderr)
        return 2
    references = sum(len(r.hash_ids) for r in requests)
    print(f"{name}: {len(requests)} requests, {references} block references, "
          f"{len({h for r in requests for h in r.hash_ids})} distinct blocks")

    figures: dict[str, dict[str, float]] = {}
    optimum = {}
    for capacity in capacities:
        optimum[capacity] = belady(requests, capacity).hit_ratio
    for name, cls in EVICTION_POLICIES.items():
        figures[name] = {}
        for capacity in capacities:
            start = time.perf_counter()
            result = replay(requests, capacity, cls())
            figures[name][str(capacity)] = result.hit_ratio
            figures[name][f"{capacity}_seconds"] = time.perf_counter() - start

    header = f"{'policy':<15}" + "".join(f"{f'{c} blocks':>22}" for c in capacities)
    print(header)
    print("-" * len(header))
    print(f"{'belady':<15}" + "".join(f"{optimum[c]:>14.3f} (1.000)" for c in capacities))
    for name in figures:
        print(f"{name:<15}" + "".join(
            f"{figures[name][str(c)]:>14.3f} ({figures[name][str(c)] / optimum[c]:.3f})" for c in capacities))
    context = {c: lru_oracle_admission(requests, c).hit_ratio for c in capacities}
    counted = {c: future_count(requests, c).hit_ratio for c in capacities}
    predicted = {c: reuse_oracle(requests, c, 4 * c).hit_ratio for c in capacities}
    for label, figures_of in (("lru+oracle-adm.", context), ("future-count", counted), ("reuse-oracle", predicted)):
        print(f"{label:<15}" + "".join(
            f"{figures_of[c]:>14.3f} ({figures_of[c] / optimum[c]:.3f})" for c in capacities))
    print("(hit ratio, and in brackets the ratio to Belady at the same size; the last three read the future:"
          " context, not online policies)")

    best_per_size = {}
    for c in capacities:
        name = max(figures, key=lambda n: figures[n][str(c)])
        best_per_size[str(c)] = {"policy": name, "hit_ratio": figures[name][str(c)],
                                 "ratio": figures[name][str(c)] / optimum[c] if optimum[c] else 1.0}
    # The best single policy is the one whose worst size is best.
    def worst(name: str) -> float:
        return min(figures[name][str(c)] / optimum[c] if optimum[c] else 1.0 for c in capacities)
    best = max(figures, key=worst)
    print(f"best policy over all sizes: {best}, worst ratio to Belady {worst(best):.3f}")
    print(json.dumps({
        "ratio": round(worst(best), 4),
        "best_policy": best,
        "best_per_size": best_per_size,
        "belady": {str(c): optimum[c] for c in capacities},
        "hit_ratio": {n: {str(c): figures[n][str(c)] for c in capacities} for n in figures},
        "ratio_to_belady": {n: {str(c): figures[n][str(c)] / optimum[c] if optimum[c] else 1.0
                                for c in capacities} for n in figures},
        "context_lru_oracle_admission": {str(c): context[c] for c in capacities},
        "context_future_count": {str(c): counted[c] for c in capacities},
        "context_reuse_oracle": {str(c): predicted[c] for c in capacities},
        "trace": str(args.trace), "requests": len(requests), "references": references,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
