"""Eviction policies over many workloads and sizes, against LRU and the offline optimum measured in the same run.

What is measured
    Every registered eviction policy (``kvtier.policies.EVICTION_POLICIES``) replays each workload
    through one cache of N blocks, metadata only (``kvtier.replay.cache.replay``): a request hits
    the longest resident prefix of its block ids, then all its blocks are referenced (a policy may
    decline to store a missing one: ``admit``). The hit ratio is prefix-hit blocks / referenced
    blocks. Workloads: the shared Mooncake synthetic trace and the generated ones of
    ``kvtier.replay.workload.WORKLOADS`` (chat, long and short conversations, shared documents, a
    scan mixed into chat), each at every size, with the same policy constants in every cell.

References, measured in the same run
    LRU (what vLLM and LMCache ship): each cell shows a policy's hit ratio and its share of LRU's.
    Belady's offline optimum on the same workload and size (``kvtier.replay.cache.belady``): no
    policy that only sees the past can beat it. ``refs/s`` is block references replayed per second
    (the replay loop included), summed over every cell: the cost of each policy.

Context (not policies; they read the future)
    ``lru+oracle-adm.``: LRU that only caches blocks the trace will reference again, i.e. an
    admission filter that never errs. ``future-count``: evict the block with the fewest references
    left (ties: least recently used), perfect frequency knowledge without timing. ``reuse-oracle``:
    LRU that knows, at every reference, whether the block is referenced again within the next
    4 x capacity references, and evicts the blocks that are not first.

Cost of fair shares
    The ``--policy`` again, over the same workloads split between two tenants (alternate sessions),
    plain and shared out by ``TenantShares`` (half the capacity each, ``policies/shares.py``), each
    cell the best of ``--repeat`` runs of each side in turn: refs/s with shares / without is
    ``shares_refs_ratio`` (goal >= 0.9), and each one's hit ratio beside it.
    Then stores into a real, full host tier of 4 KiB blocks (``KVTier.store_now``, every store evicting),
    two tenants in turn: stores/s with shares / without is ``shares_tier_ratio``, what shares cost on
    eviction where blocks move.

Why
    The default policy must be at least as good as LRU on every workload and size, and much better
    where LRU is weak; one trace cannot show either.

The last line printed is one JSON object: ``ratio`` is the ``--policy`` (default ``adaptive``) hit
ratio / LRU's, the minimum over every cell; ``vs_lru_small`` the same over the two smallest sizes;
then every figure.

Run: ``.venv/bin/python bench/policies.py [--trace PATH] [--workloads mooncake,chat,...]
[--capacities 1000,4000,16000] [--policy adaptive] [--repeat 3]`` (about two minutes on two cores).
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from kvtier import KVTier
from kvtier.policies import EVICTION_POLICIES
from kvtier.policies.shares import TenantShares
from kvtier.replay.cache import ReplayResult, belady, prefix_hits, replay
from kvtier.replay.tenants import keep_tenants_apart
from kvtier.replay.trace import Request, load_trace
from kvtier.replay.workload import WORKLOADS, generate

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
            missing = missing[: len(missing) - need]
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
            victims = [k for k in queue if k not in protected][: max(0, len(resident) - capacity)]
            for victim in victims:
                del queue[victim], resident[victim]
            evictions += len(victims)
    return ReplayResult(hits, references, evictions)


CONTEXT = {
    "lru+oracle-adm.": lru_oracle_admission,
    "future-count": future_count,
    "reuse-oracle": lambda requests, capacity: reuse_oracle(requests, capacity, 4 * capacity),
}


def two_tenants(requests: Sequence[Request]) -> list[Request]:
    """The requests split between tenants ``t0`` and ``t1``, alternate sessions (alternate requests where
    the workload has none), their blocks kept apart."""
    return keep_tenants_apart(
        [replace(r, tenant=f"t{(i if r.session is None else r.session) % 2}") for i, r in enumerate(requests)]
    )


def shares_cost(requests: Sequence[Request], capacity: int, policy: str, repeat: int) -> dict[str, float]:
    """``policy`` over two tenants' requests, plain and shared half and half: the best seconds of
    ``repeat`` runs of each (in turn, the first of each pair alternating: this VM's speed drifts over
    seconds) and hit ratio of each. The replay names each request's tenant (``access``'s ``owner``), as
    ``kvtier replay`` does."""
    split = two_tenants(requests)
    owner = {h: r.tenant for r in split for h in r.hash_ids}
    cls = EVICTION_POLICIES[policy]
    made = {
        "plain": cls,
        "shares": lambda: TenantShares(cls, owner.__getitem__, {"t0": 0.5, "t1": 0.5}, 0.0, capacity),
    }
    out: dict[str, float] = {f"{label}_seconds": float("inf") for label in made}
    for i in range(repeat):
        for label in list(made)[:: 1 if i % 2 == 0 else -1]:
            start = time.perf_counter()
            out[f"{label}_hit_ratio"] = replay(split, capacity, made[label]()).hit_ratio
            out[f"{label}_seconds"] = min(out[f"{label}_seconds"], time.perf_counter() - start)
    return out


def tier_shares_cost(capacity: int, policy: str, stores: int = 4000, blocks: int = 8) -> float:
    """Stores/s into a real host tier of ``capacity`` 4 KiB blocks evicting by ``policy``, full, so that
    every store evicts: two tenants storing new prefixes of ``blocks`` blocks in turn, with shares half
    and half / without (best of three runs each, interleaved)."""
    data = np.zeros((blocks, 4096), np.uint8)
    prompts = [[i * blocks * 16 + t for t in range(blocks * 16)] for i in range(stores)]
    best = {False: float("inf"), True: float("inf")}
    for _ in range(3):
        for shared in (False, True):
            host = {"medium": "host", "capacity_blocks": capacity, "eviction": policy}
            if shared:
                host["tenants"] = {"shares": {"t0": 0.5, "t1": 0.5}}
            with KVTier.open({"block_tokens": 16, "block_bytes": 4096, "tiers": [host]}) as kv:
                started = time.perf_counter()
                for i, tokens in enumerate(prompts):
                    kv.store_now(tokens, data, tenant=f"t{i % 2}")
                best[shared] = min(best[shared], time.perf_counter() - started)
    return best[False] / best[True]


def workload(name: str, trace: Path) -> list[Request]:
    """The requests of a named workload: ``mooncake`` reads ``trace``, the others are generated."""
    return load_trace(trace) if name == "mooncake" else generate(WORKLOADS[name])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE), help="the Mooncake JSONL trace of workload 'mooncake'")
    parser.add_argument(
        "--workloads",
        default=",".join(["mooncake", *WORKLOADS]),
        help="comma separated: mooncake and the names of kvtier.replay.workload.WORKLOADS",
    )
    parser.add_argument("--capacities", default="1000,4000,16000", help="cache sizes in blocks, comma separated")
    parser.add_argument("--policy", default="adaptive", help="the policy the JSON line judges against LRU")
    parser.add_argument(
        "--repeat", type=int, default=3, help="runs of each side of the cost of shares (the best counts)"
    )
    return parser.parse_args(argv)


def bad_args(args: argparse.Namespace, names: list[str]) -> str | None:
    """Why the arguments cannot run, or None."""
    unknown = [n for n in names if n != "mooncake" and n not in WORKLOADS]
    if unknown or args.policy not in EVICTION_POLICIES:
        return f"unknown workload or policy: {unknown or args.policy}"
    if "mooncake" in names and not Path(args.trace).is_file():
        return f"trace not found: {args.trace} (pass --trace, or leave mooncake out of --workloads)"
    return None


def measure(
    requests: Sequence[Request], capacities: list[int], policy: str, repeat: int, seconds: dict[str, float]
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """One workload at every size: each row's hit ratio, and what shares cost ``policy``; each policy's
    replay seconds added to ``seconds``."""
    cells, shares = {}, {}
    for capacity in capacities:
        row = cells[str(capacity)] = {"belady": belady(requests, capacity).hit_ratio}
        for name, cls in EVICTION_POLICIES.items():
            start = time.perf_counter()
            row[name] = replay(requests, capacity, cls()).hit_ratio
            seconds[name] += time.perf_counter() - start
        for label, oracle in CONTEXT.items():
            row[label] = oracle(requests, capacity).hit_ratio
        shares[str(capacity)] = shares_cost(requests, capacity, policy, repeat)
    return cells, shares


def print_workload(cells: dict[str, dict[str, float]], capacities: list[int]) -> None:
    header = f"{'':<16}" + "".join(f"{f'{c} blocks':>18}" for c in capacities)
    print(header)
    print("-" * len(header))
    for label in ["belady", *EVICTION_POLICIES, *CONTEXT]:
        print(
            f"{label:<16}"
            + "".join(
                f"{cells[str(c)][label]:>9.3f} ({cells[str(c)][label] / cells[str(c)]['lru']:.2f}x)"
                if cells[str(c)]["lru"]
                else f"{cells[str(c)][label]:>18.3f}"
                for c in capacities
            )
        )


def print_shares(policy: str, shares: dict, refs_ratio: float, tier_ratio: float, capacity: int) -> None:
    print(
        f"{policy} over two tenants: refs/s with shares {refs_ratio:.3f}x without (stores into a full "
        f"host tier of {capacity} blocks: {tier_ratio:.3f}x); hit ratio "
        + ", ".join(
            f"{n}@{c} {v['shares_hit_ratio']:.3f} ({v['plain_hit_ratio']:.3f} plain)"
            for n, by_size in shares.items()
            for c, v in by_size.items()
        )
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    capacities = sorted(int(c) for c in args.capacities.split(","))
    names = args.workloads.split(",")
    problem = bad_args(args, names)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    cells: dict[str, dict[str, dict[str, float]]] = {}  # workload -> size -> row -> hit ratio
    shares: dict[str, dict[str, dict[str, float]]] = {}  # workload -> size -> shares_cost
    seconds = dict.fromkeys(EVICTION_POLICIES, 0.0)
    replayed = 0
    for name in names:
        requests = workload(name, Path(args.trace))
        references = sum(len(r.hash_ids) for r in requests)
        print(
            f"\n{name}: {len(requests)} requests, {references} block references, "
            f"{len({h for r in requests for h in r.hash_ids})} distinct blocks"
        )
        cells[name], shares[name] = measure(requests, capacities, args.policy, args.repeat, seconds)
        replayed += references * len(capacities)
        print_workload(cells[name], capacities)
    print("\n(hit ratio, and in brackets its share of LRU's at the same size; the last three read the future)")
    per_second = {policy: replayed / seconds[policy] for policy in EVICTION_POLICIES}
    print("refs/s (every cell): " + ", ".join(f"{p} {per_second[p]:,.0f}" for p in EVICTION_POLICIES))
    plain_s = sum(c["plain_seconds"] for by_size in shares.values() for c in by_size.values())
    shares_refs_ratio = plain_s / sum(c["shares_seconds"] for by_size in shares.values() for c in by_size.values())
    shares_tier_ratio = tier_shares_cost(capacities[0], args.policy)
    print_shares(args.policy, shares, shares_refs_ratio, shares_tier_ratio, capacities[0])

    def share(name: str, capacity: int, label: str) -> float:
        row = cells[name][str(capacity)]
        return row[label] / row["lru"] if row["lru"] else 1.0

    small = capacities[:2]
    ratio = min(share(n, c, args.policy) for n in names for c in capacities)
    vs_lru_small = min(share(n, c, args.policy) for n in names for c in small)
    weak = {
        f"{n}@{c}": round(share(n, c, args.policy), 4)
        for n in names
        for c in capacities
        if share(n, c, "belady") >= 1.5
    }
    print(
        f"{args.policy}: worst share of LRU {ratio:.3f} (at the {len(small)} smallest sizes {vs_lru_small:.3f}); "
        f"where Belady >= 1.5x LRU: {weak}; refs/s {per_second[args.policy] / per_second['lru']:.2f}x LRU's"
    )
    summary = {
        "ratio": round(ratio, 4),
        "vs_lru_small": round(vs_lru_small, 4),
        "policy": args.policy,
        "where_belady_1.5x_lru": weak,
        "refs_per_second": {p: round(v) for p, v in per_second.items()},
        "shares_refs_ratio": round(shares_refs_ratio, 4),
        "shares_tier_ratio": round(shares_tier_ratio, 4),
        "shares": shares,
        "hit_ratio": cells,
        "capacities": capacities,
        "trace": str(args.trace),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
