"""One PNG for a replay: hit ratio and what it buys against capacity per policy, and tier occupancy over time.

Why: the question "how much cache do I need and which policy" is read off a curve, not a table, and
"do the tiers fill, and when" off the occupancy lines. The sizing panel turns the hit ratio into what
an operator buys: prompt tokens not recomputed per second of trace and, on the right axis, the prefill
seconds that saves net of loading the hits (``kvtier.replay.sizing``). matplotlib's Agg backend draws
without a display, so this works on any machine.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402


def plot_replay(path: str | Path, summary: dict, occupancy: list[tuple[int, dict[str, int]]]) -> None:
    """Write ``replay_figure`` as a PNG."""
    fig = replay_figure(summary, occupancy)
    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def replay_figure(summary: dict, occupancy: list[tuple[int, dict[str, int]]]) -> Figure:
    """The figure, left to right: the sweep's hit ratios and its sizing (when there is a sweep; the
    sizing only when the trace spans some time), then used blocks per tier per request."""
    sweeps = [_sweep_panel] if "sweep" in summary else []
    if "sizing_sweep" in summary and summary["sizing"]["trace_seconds"] > 0:
        sweeps.append(_sizing_panel)
    panels = len(sweeps) + 1
    fig, axes = plt.subplots(1, panels, figsize=(7 * panels, 4.8), squeeze=False)
    for draw, ax in zip(sweeps, axes[0], strict=False):
        draw(ax, summary)
    _occupancy_panel(axes[0][-1], summary, occupancy)
    fig.suptitle(f"kvtier replay - {summary['workload']}", fontsize=12)
    fig.tight_layout()
    return fig


def _sweep_panel(ax, summary: dict) -> None:
    belady = summary.get("belady_sweep")
    capacities = [int(c) for c in next(iter(summary["sweep"].values()))]
    if belady:
        label = "Belady (optimum)" if summary["mode"] == "metadata" else "Belady (optimum, as many blocks as all tiers)"
        ax.plot(capacities, [belady[str(c)] for c in capacities], "k--", marker="s", label=label)
    for policy, by_capacity in summary["sweep"].items():
        ax.plot(capacities, [by_capacity[str(c)] for c in capacities], marker="o", label=policy)
    _capacity_axis(ax, summary, capacities)
    ax.set_ylim(0, 1)
    ax.set_ylabel("prefix hit ratio")
    ax.set_title("hit ratio vs capacity")
    ax.grid(True, alpha=0.3)
    ax.legend()


def _sizing_panel(ax, summary: dict) -> None:
    """Per policy: tokens not recomputed per second of trace (solid, left axis) and the net prefill
    seconds saved per second (dashed, right axis, where every hit tier's load bandwidth is known).
    The right axis is the left one divided by the prefill rate, so a dashed line sits below its solid
    one by exactly the time spent loading, and under zero where loading costs more than it saves."""
    rate = summary["sizing"]["prefill_tokens_per_s"]
    capacities = list(next(iter(summary["sizing_sweep"].values())))
    xs = [int(c) for c in capacities]
    right = ax.twinx()
    heights = [0.0]  # in tokens/s (a net in seconds/s times the rate): what the left axis must show
    nets_drawn = False
    for policy, by_capacity in summary["sizing_sweep"].items():
        totals = [by_capacity[c]["total"] for c in capacities]
        tokens = [t["tokens_saved_per_s"] for t in totals]
        (line,) = ax.plot(xs, tokens, marker="o", label=policy)
        heights += tokens
        net = [t["net_s_saved_per_s"] for t in totals]
        if any(n is not None for n in net):
            right.plot(xs, [math.nan if n is None else n for n in net], "--", marker="x", color=line.get_color())
            heights += [n * rate for n in net if n is not None]
            nets_drawn = True
    bottom, top = min(heights) * 1.08, max(heights) * 1.08 or 1.0
    ax.set_ylim(bottom, top)
    right.set_ylim(bottom / rate, top / rate)
    right.axhline(0, color="grey", linewidth=0.8)
    _capacity_axis(ax, summary, xs)
    ax.set_ylabel("prompt tokens not recomputed per second of trace")
    right.set_ylabel(f"net prefill s saved per s (at {rate:,.0f} tokens/s assumed)")
    ax.set_title("what each capacity buys")
    ax.grid(True, alpha=0.3)
    styles = [Line2D([], [], color="black", label="tokens/s (left)")]
    if nets_drawn:
        styles.append(Line2D([], [], color="black", linestyle="--", marker="x", label="net s/s (right)"))
    ax.legend(handles=ax.get_legend_handles_labels()[0] + styles, fontsize="small")


def _capacity_axis(ax, summary: dict, capacities: list[int]) -> None:
    """Capacities on a log axis, each one labelled."""
    ax.set_xscale("log")
    ax.set_xticks(capacities)
    ax.set_xticklabels([f"{c:,}" for c in capacities])
    ax.minorticks_off()
    ax.set_xlabel(f"capacity of {summary['governed_tier']} (blocks)")


def _occupancy_panel(ax, summary: dict, occupancy: list[tuple[int, dict[str, int]]]) -> None:
    xs = [i + 1 for i, _ in occupancy]
    for name, tier in summary["tiers"].items():
        label = name if name == tier["medium"] else f"{name} ({tier['medium']})"
        (line,) = ax.plot(xs, [used[name] for _, used in occupancy], label=label)
        ax.axhline(tier["capacity"], color=line.get_color(), linestyle=":", linewidth=1)
    ax.set_xlabel("request")
    ax.set_ylabel("blocks held (dotted: capacity)")
    ax.set_title(f"tier occupancy over time ({summary['policy']}, hit ratio {summary['hit_ratio']:.3f})")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
