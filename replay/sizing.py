"""Sizing: what a replay's hits are worth per second of traffic, and what loading them costs.

Why this exists
    An operator asks "how much memory or disk should I buy?". A hit ratio does not answer it; a rate
    does. Each prefix-hit block spares the engine recomputing ``block_tokens`` prompt tokens, which
    takes ``block_tokens / prefill_tokens_per_s`` seconds of prefill, and costs loading its
    ``block_bytes`` from the tier that served it, which takes ``block_bytes / bandwidth`` seconds.
    Summed over a run's hits and divided by the trace's span, that gives, per tier and in all:

    - ``tokens_saved_per_s``: prompt tokens not recomputed per second of trace (hits x block tokens);
    - ``recompute_s_per_s``: the prefill seconds those tokens would have cost, per second of trace;
    - ``load_s_per_s``: the seconds spent loading those blocks instead, per second of trace;
    - ``net_s_saved_per_s``: the difference, prefill seconds saved per second of trace.

    A tier whose load of one block takes longer than recomputing it does not pay at that prefill rate
    (``pays`` is false): its hits cost more time than they save.

Where the inputs come from
    The hits per tier from the replay; the bandwidth of each tier measured by the real-stack replay
    (``LoadTimes``: every run of one command pooled, so the runs of a sweep are weighed at the same
    bandwidth and differ only in their hits) or given by the user (``Assumptions.load_gbps``, which
    wins); the prefill rate is always an assumption about the engine and the model. A figure that
    needs a bandwidth nobody measured or gave is None, never a guess; so is every per-second figure
    when the trace's timestamps span no time.

Tokens are counted in whole blocks: a request's last, partial block counts ``block_tokens`` here,
where the replay's ``prefill_tokens_saved`` caps it at the prompt's length.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.replay.trace import Request

GB = 1e9
"""Bandwidths are in GB/s, decimal (10**9 bytes), as storage and link speeds are quoted."""

DEFAULT_PREFILL_TOKENS_PER_S = 10_000.0
"""The prefill rate assumed when none is given: roughly what a 7-8B-parameter model prefills per second
on one recent data-centre GPU (bf16, long prompts). An assumption, not a measurement: give your own."""


def trace_seconds(requests: Sequence[Request]) -> float:
    """The time the trace spans: its last timestamp minus its first, in seconds (Mooncake traces and the
    generated workload stamp requests in milliseconds). 0.0 for a trace without timestamps."""
    if not requests:
        return 0.0
    stamps = [r.timestamp for r in requests]
    return (max(stamps) - min(stamps)) / 1000.0


@dataclass
class LoadTimes:
    """Bytes loaded and seconds spent loading them, per tier, over the loads that were timed."""

    bytes_loaded: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, tier: str, nbytes: int, seconds: float) -> None:
        self.bytes_loaded[tier] = self.bytes_loaded.get(tier, 0) + nbytes
        self.seconds[tier] = self.seconds.get(tier, 0.0) + seconds

    def merge(self, other: LoadTimes) -> None:
        for tier, seconds in other.seconds.items():
            self.add(tier, other.bytes_loaded[tier], seconds)

    def gbps(self) -> dict[str, float]:
        """Load bandwidth per tier in GB/s, for the tiers some timed load read."""
        return {tier: self.bytes_loaded[tier] / seconds / GB for tier, seconds in self.seconds.items() if seconds > 0}


@dataclass(frozen=True)
class Assumptions:
    """What the sizing figures take as given, the same for every run of one command."""

    prefill_tokens_per_s: float
    trace_seconds: float
    load_gbps: Mapping[str, float] = field(default_factory=dict)  # per tier; replaces a measured bandwidth


def sizing(
    hits: Mapping[str, int],
    block_tokens: int,
    block_bytes: int | None,
    measured_gbps: Mapping[str, float],
    assumed: Assumptions,
) -> dict[str, Any]:
    """The sizing figures of one run (JSON-ready): ``tiers`` (one entry per tier of ``hits``), ``total``
    (their sums), and what they rest on. See the module docstring for each figure. Without ``block_bytes``
    (a metadata replay of a config that leaves it out) nothing can be loaded, so the load side is None."""
    recompute_s_per_block = block_tokens / assumed.prefill_tokens_per_s
    tiers = {}
    for name, n in hits.items():
        given = assumed.load_gbps.get(name)
        gbps = given if given is not None else measured_gbps.get(name)
        load_s_per_block = block_bytes / (gbps * GB) if gbps and block_bytes else None
        tiers[name] = {
            **_rates(n, block_tokens, recompute_s_per_block, load_s_per_block, assumed.trace_seconds),
            "load_gbps": gbps,
            "load_gbps_from": None if gbps is None else "given" if given is not None else "measured",
            "load_s_per_block": load_s_per_block,
            "pays": None if load_s_per_block is None else load_s_per_block < recompute_s_per_block,
        }
    total = {"hits": sum(hits.values()), **{key: _sum(t[key] for t in tiers.values()) for key in _RATE_KEYS[1:]}}
    return {
        "trace_seconds": assumed.trace_seconds,
        "prefill_tokens_per_s": assumed.prefill_tokens_per_s,
        "block_tokens": block_tokens,
        "block_bytes": block_bytes,
        "recompute_s_per_block": recompute_s_per_block,
        "tiers": tiers,
        "total": total,
    }


_RATE_KEYS = ("hits", "tokens_saved_per_s", "recompute_s_per_s", "load_s_per_s", "net_s_saved_per_s")


def _rates(
    hits: int, block_tokens: int, recompute_s_per_block: float, load_s_per_block: float | None, span: float
) -> dict[str, Any]:
    """One tier's per-second figures. A tier without hits loads nothing, whatever its bandwidth."""
    if span <= 0:
        return {"hits": hits, **dict.fromkeys(_RATE_KEYS[1:])}
    recompute = hits * recompute_s_per_block / span
    load = 0.0 if hits == 0 else None if load_s_per_block is None else hits * load_s_per_block / span
    return {
        "hits": hits,
        "tokens_saved_per_s": hits * block_tokens / span,
        "recompute_s_per_s": recompute,
        "load_s_per_s": load,
        "net_s_saved_per_s": None if load is None else recompute - load,
    }


def _sum(values: Iterable[float | None]) -> float | None:
    """The sum, or None when any part is unknown (a total that leaves a tier out would mislead)."""
    total = 0.0
    for v in values:
        if v is None:
            return None
        total += v
    return total
