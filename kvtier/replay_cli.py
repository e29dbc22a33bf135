"""``kvtier replay [TRACE.jsonl]``: the main job. Replays requests through a tier stack and reports the savings.

Why: a user deciding whether kvtier pays off asks how many prefill tokens it saves on their traffic,
in which tier the hits land, how many bytes move, and which eviction policy is best. This command
answers that from a Mooncake trace, or from the seeded chat workload (``kvtier.replay.workload``) when
no trace is given, on any machine.

* Default: a real stack (``--config FILE.yaml``, or the embedded ``kvtier/replay.yaml``) built by
  ``kvtier.builder.build_stack``; blocks move through the real tiers and transfer backends, and
  every hit is checked bit-exact (``kvtier.replay.stack``). A corrupt block makes it exit 1.
  Each run puts a disk tier in a fresh directory inside its ``path`` and removes it afterwards, so
  every run starts empty and blocks already stored there are left alone.
* ``--metadata-only``: the same policies on an index alone (``kvtier.replay.cache``), one cache.
* ``--engines N`` with ``--split`` and ``--node``: several engines on one machine, with private tiers
  or a node daemon's shared slab (``kvtier.replay_engines``), requests sent to them by a routing
  (``kvtier.replay.routing``: by the requests alone, or by the engines' KV events); ``--routing``
  replays once per routing and compares them.
* ``--policy`` and ``--capacity`` set the eviction policy and size (in blocks) of one tier, the last
  one unless ``--tier`` names another; with ``--metadata-only`` they set the one cache.
* ``--belady`` adds the offline optimum for the same number of blocks (with a stack: all its tiers'
  blocks together); ``--sweep`` repeats the run at several capacities for every policy given (all
  registered policies by default); ``--plot`` draws the sweep, what each capacity buys and the tier
  occupancy over time.
* Sizing (``kvtier.replay.sizing``): per tier, prompt tokens not recomputed per second of trace, and
  the prefill seconds that saves net of loading the hits, at each tier's load bandwidth measured over
  all the command's runs (or ``--load-gbps``) against recomputing at ``--prefill-tokens-per-s`` (an
  assumption).

Output: a rich progress bar, the stack, a table per tier, the sizing, the totals, with ``--routing`` a
row per routing; with ``--json`` the last line is one JSON object with the same figures. Hit rule (see
``kvtier.replay.cache``): the longest present prefix of a request's blocks is its hit, then every block
of the request is referenced.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from kvtier.builder import build_stack
from kvtier.core.config import StackConfig, capacity_in_blocks, load_config
from kvtier.core.errors import ConfigError, TransferError
from kvtier.core.keys import key_secret
from kvtier.core.media import medium
from kvtier.core.sizes import parse_size
from kvtier.core.tier_config import TenantSharesConfig
from kvtier.policies import EVICTION_POLICIES, EvictionPolicy, eviction_policy_class
from kvtier.policies.shares import TenantShares
from kvtier.replay.cache import belady, replay
from kvtier.replay.routing import PREFIX_ROUTINGS, ROUTINGS, FixedRouter, PrefixRouter, Router, route
from kvtier.replay.sizing import DEFAULT_PREFILL_TOKENS_PER_S, Assumptions, LoadTimes, sizing, trace_seconds
from kvtier.replay.stack import prefill_tokens_saved, replay_through_engines
from kvtier.replay.tenants import count, keep_tenants_apart, tenant_summary, with_flood
from kvtier.replay.trace import Request, load_trace, write_trace
from kvtier.replay.workload import ChatWorkload, generate
from kvtier.replay_engines import daemon_counts, divided, merged, node_daemon_for
from kvtier.report import print_summary

EMBEDDED_CONFIG = Path(__file__).resolve().parent / "replay.yaml"
MiB = 2**20


def add_replay_parser(commands) -> None:
    """Register ``replay`` (alias ``demo``) on the ``kvtier`` subcommand parser."""
    p = commands.add_parser(
        "replay",
        aliases=["demo"],
        help="replay a request trace (or a generated chat "
        "workload) through a tier stack: hits per tier, bytes moved, prefill tokens saved",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("trace", nargs="?", type=Path, help="Mooncake JSONL trace (default: a generated chat workload)")
    p.add_argument("--config", type=Path, help="stack YAML (default: the embedded kvtier/replay.yaml)")
    p.add_argument(
        "--policy",
        help="eviction policy (a short name or dotted path) of the governed tier; "
        "with --sweep a comma-separated list (default there: every registered policy)",
    )
    p.add_argument("--capacity", type=int, help="capacity in blocks of the governed tier (or the one cache)")
    p.add_argument("--tier", help="the tier --policy and --capacity govern (default: the last tier)")
    p.add_argument("--metadata-only", action="store_true", help="replay the index alone (one cache, no bytes): fast")
    p.add_argument("--belady", action="store_true", help="also compute the offline optimum (Belady)")
    p.add_argument("--sweep", help="comma-separated capacities in blocks, e.g. 1000,4000,16000")
    p.add_argument("--block-bytes", help="bytes stored per block in a real replay, e.g. 16KiB (default: the config's)")
    p.add_argument("--block-tokens", type=int, default=512, help="tokens per hash id, for saved tokens (default 512)")
    p.add_argument(
        "--plot",
        type=Path,
        help="write a PNG: hit ratio and what it buys vs capacity (with --sweep), occupancy over time",
    )
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object on the last line")
    p.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=DEFAULT_PREFILL_TOKENS_PER_S,
        help="sizing: the engine's prefill rate a hit is weighed against (an assumption; default "
        f"{DEFAULT_PREFILL_TOKENS_PER_S:,.0f}, roughly a 7-8B model on one data-centre GPU)",
    )
    p.add_argument(
        "--load-gbps",
        help="sizing: load bandwidth per tier in GB/s, e.g. host=20,disk=2.5, instead of the one measured "
        "(with --metadata-only, where nothing is measured, the one cache is named cache)",
    )
    p.add_argument(
        "--conversations",
        type=int,
        default=ChatWorkload.conversations,
        help="generated workload: number of conversations",
    )
    p.add_argument("--seed", type=int, default=0, help="generated workload: random seed")
    p.add_argument(
        "--flood",
        type=int,
        metavar="BLOCKS",
        help="after each request, one of tenant 'flood' with BLOCKS blocks never seen again (the other "
        "requests become tenant 'steady's): what a tier's tenants: shares are for",
    )
    p.add_argument(
        "--engines",
        type=int,
        default=1,
        help="split the requests across this many engines on one machine, each with the config's stack "
        "cut to 1/N of its capacity (default 1)",
    )
    p.add_argument(
        "--split",
        choices=ROUTINGS,
        default="round_robin",
        help="how requests go to engines (default round_robin; prefix_gpu and prefix_tiered route by the "
        "engines' KV events: kvtier.replay.routing)",
    )
    p.add_argument(
        "--routing",
        action="store_true",
        help="with --engines > 1: replay once per routing (round_robin, random, session, prefix_gpu, "
        "prefix_tiered) and compare their hits and prefill time saved",
    )
    p.add_argument(
        "--node",
        action="store_true",
        help="the config's last tier (a host tier) becomes one node daemon's slab that every engine shares; "
        "with --engines > 1 the private split is replayed too, and both are reported",
    )
    p.add_argument("--save-trace", type=Path, help="also write the replayed requests as a Mooncake JSONL trace")


class ReplayError(Exception):
    """A problem with the command's input, reported as one line and exit status 2."""


def run_replay(args: argparse.Namespace, console: Console) -> int:
    try:
        summary, occupancy = _run(args, console)
    except (ReplayError, ConfigError, TransferError, ValueError, OSError) as exc:
        print(f"kvtier replay: {exc}", file=sys.stderr)
        return 2
    except MemoryError as exc:  # the replay's own buffers: block_bytes times the longest request
        print(f"kvtier replay: out of memory ({str(exc) or 'MemoryError'}); lower --block-bytes", file=sys.stderr)
        return 2
    if not args.json:
        print_summary(summary, console)
    if args.plot:
        from kvtier.plot import plot_replay  # here: matplotlib takes a while to import, and only --plot needs it

        plot_replay(args.plot, summary, occupancy)
        if not args.json:
            console.print(f"plot written to {args.plot}", highlight=False, soft_wrap=True)
    if args.json:
        summary.pop("stack_description", None)
        print(json.dumps(summary))
    return 1 if summary.get("corrupt_blocks") else 0


# --- the runs ------------------------------------------------------------------------------------


def _run(args: argparse.Namespace, console: Console) -> tuple[dict, list]:
    requests, workload = _requests(args)
    if args.flood is not None:
        if args.flood < 1:
            raise ReplayError(f"--flood must be at least 1 block, not {args.flood}")
        requests, workload = with_flood(requests, args.flood), f"{workload}, flooded ({args.flood} blocks a request)"
    if args.save_trace:
        write_trace(requests, args.save_trace)
    requests = keep_tenants_apart(requests)
    config = _config(args)
    governed = args.tier or config.tier_name(len(config.tiers) - 1)
    names = [config.tier_name(i) for i in range(len(config.tiers))]
    if governed not in names:
        raise ReplayError(f"--tier {governed!r}: the stack has tiers {', '.join(names)}")
    policies = _policies(args, config, names.index(governed))
    capacities = _capacities(args.sweep) if args.sweep else []
    if args.capacity is not None and args.capacity < (0 if args.metadata_only else 1):
        raise ReplayError(f"--capacity must be at least {0 if args.metadata_only else 1} block(s), not {args.capacity}")
    if args.block_tokens < 1:
        raise ReplayError(f"--block-tokens must be at least 1, not {args.block_tokens}")
    if args.engines < 1:
        raise ReplayError(f"--engines must be at least 1, not {args.engines}")
    if args.metadata_only and (args.node or args.engines > 1):
        raise ReplayError("--engines and --node replay real stacks: leave out --metadata-only")
    if args.routing and (args.engines < 2 or args.sweep):
        raise ReplayError("--routing compares how requests go to several engines: give --engines N > 1, no --sweep")
    if not (math.isfinite(args.prefill_tokens_per_s) and args.prefill_tokens_per_s > 0):
        raise ReplayError(f"--prefill-tokens-per-s must be a positive number, not {args.prefill_tokens_per_s}")
    block_bytes = parse_size(args.block_bytes) if args.block_bytes else None
    assumed = Assumptions(
        args.prefill_tokens_per_s,
        trace_seconds(requests),
        _load_gbps(args.load_gbps, ["cache"] if args.metadata_only else names) if args.load_gbps else {},
    )
    if args.load_gbps and not (block_bytes or config.block_bytes):
        raise ReplayError("--load-gbps needs the size of a block: give --block-bytes (the config has no block_bytes)")
    timed = LoadTimes()  # every stack run's timed loads: one bandwidth per tier for all the runs

    def size(run: dict) -> dict:
        hits = {name: tier["hits"] for name, tier in run["tiers"].items()}
        return sizing(hits, args.block_tokens, block_bytes or config.block_bytes, timed.gbps(), assumed)

    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("requests"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=args.json,
    )

    def one_run(policy: str, capacity: int | None, label: str, routing: str = args.split) -> tuple[dict, list]:
        task = progress.add_task(label, total=len(requests))
        advance = lambda: progress.advance(task)  # noqa: E731
        try:
            if args.metadata_only:
                total = capacity if capacity is not None else sum(_blocks(config, i) for i in range(len(names)))
                shares = config.tiers[names.index(governed)].tenants
                return _metadata_run(requests, total, policy, shares, args.block_tokens, advance)
            with ExitStack() as directories:
                cfg = _fresh_directories(
                    _override(config, names.index(governed), policy, capacity, block_bytes), directories
                )
                run, occupancy = _stack_run(requests, cfg, args, timed, advance, routing=routing)
                if args.node and args.engines > 1 and not args.routing:
                    private, _ = _stack_run(requests, cfg, args, timed, advance, node=False, routing=routing)
                    run["private"] = {k: private[k] for k in ("hit_ratio", "hits", "prefill_saved_ratio", "engines")}
                    run["hit_gain"] = run["hit_ratio"] / private["hit_ratio"] if private["hit_ratio"] else None
                return run, occupancy
        finally:
            progress.remove_task(task)

    with progress:
        summary, occupancy = one_run(policies[0], args.capacity, f"replay ({policies[0]})")
        summary.update(
            workload=workload, policy=policies[0], governed_tier="one cache" if args.metadata_only else governed
        )
        if not args.metadata_only:
            summary["capacity"] = summary["tiers"][governed]["capacity"]
        if args.belady:
            summary["belady_capacity"] = _belady_capacity(summary)
            summary["belady_hit_ratio"] = belady(requests, summary["belady_capacity"]).hit_ratio
        if capacities:
            sweep: dict[str, dict[str, float]] = {}
            runs: dict[str, dict[str, dict]] = {}
            belady_sweep: dict[str, float] = {}
            for policy in policies:
                sweep[policy], runs[policy] = {}, {}
                for c in capacities:
                    run, _ = one_run(policy, c, f"sweep {policy} @ {c:,}")
                    sweep[policy][str(c)] = run["hit_ratio"]
                    runs[policy][str(c)] = run
                    if args.belady and str(c) not in belady_sweep:
                        belady_sweep[str(c)] = belady(requests, _belady_capacity(run)).hit_ratio
            summary["sweep"] = sweep
            summary["sizing_sweep"] = {p: {c: size(run) for c, run in by_c.items()} for p, by_c in runs.items()}
            if belady_sweep:
                summary["belady_sweep"] = belady_sweep
        if args.routing:
            routed = {r: one_run(policies[0], args.capacity, f"routing {r}", r)[0] for r in ROUTINGS}
    summary["sizing"] = size(summary)  # after every run: each one's loads are timed
    if args.routing:
        summary["routing"] = {
            r: _routing_figures(run, size(run), args.prefill_tokens_per_s) for r, run in routed.items()
        }
    return summary, occupancy


def _requests(args: argparse.Namespace) -> tuple[list[Request], str]:
    if args.trace is not None:
        if not args.trace.is_file():
            raise ReplayError(f"{args.trace}: no such trace file")
        requests = load_trace(args.trace)
        return requests, f"trace {args.trace.name}"
    if args.conversations < 1:
        raise ReplayError(f"--conversations must be at least 1, not {args.conversations}")
    spec = ChatWorkload(conversations=args.conversations, seed=args.seed)
    return generate(spec), f"generated chat workload ({spec.conversations} conversations, seed {spec.seed})"


def _config(args: argparse.Namespace) -> StackConfig:
    return load_config(args.config if args.config is not None else EMBEDDED_CONFIG)


def _fresh_directories(config: StackConfig, cleanup: ExitStack) -> StackConfig:
    """The configuration with each tier that lives in a directory (a disk tier: ``Medium.directory_key``)
    in a new directory inside its own, removed by ``cleanup``: every run starts empty on the same
    filesystem, and blocks already stored there are never touched."""
    data = config.model_dump(exclude_none=True)
    for tier in data["tiers"]:
        key = medium(tier["medium"]).directory_key
        if key is not None:
            base = Path(tier[key]).expanduser()
            base.mkdir(parents=True, exist_ok=True)
            tier[key] = cleanup.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-replay-", dir=base))
    return load_config(data)


def _policies(args: argparse.Namespace, config: StackConfig, governed_index: int) -> list[str]:
    if args.policy is None:
        default = config.tier_eviction(governed_index)
        return [default, *(p for p in EVICTION_POLICIES if p != default)] if args.sweep else [default]
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    if not policies:
        raise ReplayError(f"--policy {args.policy!r}: give a policy name, e.g. {', '.join(EVICTION_POLICIES)}")
    if len(policies) > 1 and not args.sweep:
        raise ReplayError("--policy takes one name without --sweep")
    for p in policies:
        eviction_policy_class(p)  # PolicyError naming the known policies
    return policies


def _capacities(text: str) -> list[int]:
    try:
        capacities = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise ReplayError(f"--sweep {text!r}: give capacities in blocks separated by commas, e.g. 1000,4000") from None
    if not capacities or min(capacities) < 1:
        raise ReplayError(f"--sweep {text!r}: give at least one capacity, each at least 1 block")
    return capacities


def _load_gbps(text: str, tiers: Sequence[str]) -> dict[str, float]:
    """``--load-gbps host=20,disk=2.5`` as {tier: GB/s}: each tier one of the run's, each rate positive."""
    rates: dict[str, float] = {}
    for item in filter(str.strip, text.split(",")):
        name, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not name:
            raise ReplayError(f"--load-gbps {text!r}: give TIER=GBPS pairs separated by commas, e.g. disk=2.5")
        if name not in tiers:
            raise ReplayError(f"--load-gbps: no tier {name!r} in this run; its tiers: {', '.join(tiers)}")
        if name in rates:
            raise ReplayError(f"--load-gbps: tier {name!r} is given twice")
        try:
            rate = float(value)
        except ValueError:
            rate = math.nan  # refused below, like a negative rate
        if not (math.isfinite(rate) and rate > 0):
            raise ReplayError(f"--load-gbps {name}={value}: the bandwidth must be a positive number of GB/s")
        rates[name] = rate
    if not rates:
        raise ReplayError(f"--load-gbps {text!r}: give TIER=GBPS pairs separated by commas, e.g. disk=2.5")
    return rates


def _blocks(config: StackConfig, index: int) -> int:
    blocks = capacity_in_blocks(config.tiers[index], config.block_bytes)
    if blocks is None:
        raise ReplayError(f"tier {config.tier_name(index)!r} has no capacity; a replay needs every tier sized")
    return blocks


def _override(
    config: StackConfig, index: int, policy: str, capacity: int | None, block_bytes: int | None
) -> StackConfig:
    """The configuration with the governed tier's policy and size, and the block size, replaced."""
    data = config.model_dump(exclude_none=True)
    tier = data["tiers"][index]
    tier["eviction"] = policy
    if capacity is not None:
        tier.pop("capacity", None)
        tier["capacity_blocks"] = capacity
    if block_bytes is not None:
        data["block_bytes"] = block_bytes
    return load_config(data)


def _belady_capacity(run: dict) -> int:
    """Blocks the run could hold at once: the one cache, or every tier of the stack together."""
    return sum(t["capacity"] for t in run["tiers"].values())


def _metadata_run(
    requests: Sequence[Request],
    capacity: int,
    policy: str,
    shares: TenantSharesConfig | None,
    block_tokens: int,
    advance: Callable[[], None],
) -> tuple[dict, list]:
    """One replay of the index alone: one cache of ``capacity`` blocks ordered by ``policy``, shared out
    among the trace's tenants by ``shares`` (the governed tier's ``tenants:``) where given."""
    saved = [0]
    by_tenant: dict[str, dict[str, int]] = {}
    occupancy: list[tuple[int, dict[str, int]]] = []
    every = max(1, -(-len(requests) // 400))
    index = [0]

    def observe(request: Request, hits: int, resident: int) -> None:
        saved[0] += prefill_tokens_saved(request, hits, block_tokens)
        count(by_tenant, request, hits)
        if index[0] % every == 0 or index[0] == len(requests) - 1:
            occupancy.append((index[0], {"cache": resident}))
        index[0] += 1
        advance()

    started = time.perf_counter()
    make = eviction_policy_class(policy)
    if shares is None:
        ordering: EvictionPolicy[int] = make()
    else:
        owner = {h: r.tenant or "" for r in requests for h in r.hash_ids}
        ordering = TenantShares(make, owner.__getitem__, shares.shares, shares.default_share, capacity)
    result = replay(requests, capacity, ordering, observe)
    seconds = time.perf_counter() - started
    prefill = sum(r.input_length or len(r.hash_ids) * block_tokens for r in requests)
    used = occupancy[-1][1]["cache"] if occupancy else 0
    summary = {
        "mode": "metadata",
        "requests": len(requests),
        "references": result.references,
        "hits": result.hits,
        "hit_ratio": result.hit_ratio,
        "capacity": capacity,
        "prefill_tokens": prefill,
        "prefill_tokens_saved": saved[0],
        "prefill_saved_ratio": saved[0] / prefill if prefill else 0.0,
        "seconds": seconds,
        "tenants": tenant_summary(by_tenant),
        "tiers": {
            "cache": {
                "medium": "index",
                "capacity": capacity,
                "used": used,
                "hits": result.hits,
                "hit_ratio": result.hit_ratio,
                "evicted": result.evictions,
            }
        },
    }
    return summary, occupancy


def _stack_run(
    requests: Sequence[Request],
    config: StackConfig,
    args: argparse.Namespace,
    timed: LoadTimes,
    advance: Callable[[], None],
    node: bool | None = None,
    routing: str | None = None,
) -> tuple[dict, list]:
    """One replay through real stacks built from ``config``: ``args.engines`` of them, through a node
    daemon with ``node`` (``args.node`` by default), requests sent to them by ``routing`` (``args.split``
    by default); its timed loads are added to ``timed``."""
    node = args.node if node is None else node
    routing = args.split if routing is None else routing
    with ExitStack() as cleanup:
        daemon = None
        if node:
            config, daemon = cleanup.enter_context(node_daemon_for(config))
        config = divided(config, args.engines, keep_last=node) if args.engines > 1 else config
        stacks = []
        try:
            for _ in range(args.engines):  # (each in directories of its own: a disk tier's slab is one process's)
                stacks.append(build_stack(_fresh_directories(config, cleanup) if args.engines > 1 else config))
            description = stacks[0].describe()
            media = {t.name: t.medium for t in stacks[0].tiers}
            results = replay_through_engines(
                requests,
                stacks,
                _router(routing, requests, stacks, args),
                args.block_tokens,
                on_request=lambda _: advance(),
                key_secret=key_secret(config.key_secret_env),
            )
        finally:
            for stack in stacks:
                stack.close()
        result = merged(results)
        if daemon is not None:
            result.tiers[config.tier_name(len(config.tiers) - 1)].update(daemon_counts(daemon))
    seconds = max(result.seconds, 1e-9)
    timed.merge(result.loads)
    tiers = {}
    for name, s in result.tiers.items():
        tiers[name] = {
            "medium": media[name],
            "capacity": s["capacity"],
            "used": s["used"],
            "hits": s["hits"],
            "hit_ratio": s["hits"] / result.references if result.references else 0.0,
            "bytes_in": s["bytes_in"],
            "bytes_out": s["bytes_out"],
            "stored": s["committed"],
            "demoted": s["demoted"],
            "evicted": s["evicted"],
            "read_errors": s["read_errors"],
            "mib_per_s": (s["bytes_in"] + s["bytes_out"]) / MiB / seconds,
        }
        if "tenants" in s:  # a tier with tenants: shares, per tenant label (``Tier.tenant_counts``)
            tiers[name]["tenants"] = s["tenants"]
    summary = {
        "mode": "stack",
        "requests": result.requests,
        "references": result.references,
        "hits": result.hits,
        "hit_ratio": result.hit_ratio,
        "prefill_tokens": result.prefill_tokens,
        "prefill_tokens_saved": result.prefill_tokens_saved,
        "prefill_saved_ratio": result.prefill_tokens_saved / result.prefill_tokens if result.prefill_tokens else 0.0,
        "verified_blocks": result.verified_blocks,
        "corrupt_blocks": result.corrupt_blocks,
        "failed_blocks": result.failed_blocks,
        "stored_blocks": result.stored_blocks,
        "misses": result.misses,
        "tenants": tenant_summary(result.tenants),
        "block_bytes": config.block_bytes,
        "placement": config.placement,
        "seconds": result.seconds,
        "tiers": tiers,
        "stack_description": description,
    }
    if args.engines > 1 or node:
        summary["engines"] = [
            {"hit_ratio": r.hit_ratio, "hits": r.hits, "references": r.references, "requests": r.requests}
            for r in results
        ]
        summary.update(split=routing, node=node)
    return summary, result.occupancy


def _router(routing: str, requests: Sequence[Request], stacks: list, args: argparse.Namespace) -> Router:
    if routing in PREFIX_ROUTINGS:
        sees = "gpu" if routing == "prefix_gpu" else "every tier"
        return PrefixRouter(stacks, sees, args.block_tokens / args.prefill_tokens_per_s)
    return FixedRouter(route(requests, args.engines, routing, args.seed))


def _routing_figures(run: dict, sizing: dict, prefill_tokens_per_s: float) -> dict:
    """What one routing gave (``--routing``): hits, per tier too, prefill saved (tokens, and seconds at the
    assumed rate: gross, and net of the loads' time where every tier's load time is known), each engine's hit ratio
    and requests (a prefix router may give some engines more requests than others)."""
    net = sizing["total"]["net_s_saved_per_s"]
    return {
        "hit_ratio": run["hit_ratio"],
        "tier_hit_ratio": {name: tier["hit_ratio"] for name, tier in run["tiers"].items()},
        "prefill_saved_ratio": run["prefill_saved_ratio"],
        "prefill_s_saved": run["prefill_tokens_saved"] / prefill_tokens_per_s,
        "net_prefill_s_saved": None if net is None else net * sizing["trace_seconds"],
        "engines": [engine["hit_ratio"] for engine in run["engines"]],
        "requests": [engine["requests"] for engine in run["engines"]],
    }
