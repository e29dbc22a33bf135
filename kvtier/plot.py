"""One PNG for a replay: hit ratio against capacity per policy, and tier occupancy over time.

Why: the question "how much cache do I need and which policy" is read off a curve, not a table, and
"do the tiers fill, and when" off the occupancy lines. matplotlib's Agg backend draws without a
display, so this works on any machine.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)


def plot_replay(path: str | Path, summary: dict, occupancy: list[tuple[int, dict[str, int]]]) -> None:
    """Write the figure: left, the sweep (when there is one); right, used blocks per tier per request."""
    panels = 2 if "sweep" in summary else 1
    fig, axes = plt.subplots(1, panels, figsize=(7 * panels, 4.8), squeeze=False)
    axes = axes[0]
    if panels == 2:
        _sweep_panel(axes[0], summary)
    _occupancy_panel(axes[-1], summary, occupancy)
    fig.suptitle(f"kvtier replay - {summary['workload']}", fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _sweep_panel(ax, summary: dict) -> None:
    belady = summary.get("belady_sweep")
    capacities = [int(c) for c in next(iter(summary["sweep"].values()))]
    if belady:
        label = "Belady (optimum)" if summary["mode"] == "metadata" else "Belady (optimum, as many blocks as all tiers)"
        ax.plot(capacities, [belady[str(c)] for c in capacities], "k--", marker="s", label=label)
    for policy, by_capacity in summary["sweep"].items():
        ax.plot(capacities, [by_capacity[str(c)] for c in capacities], marker="o", label=policy)
    ax.set_xscale("log")
    ax.set_xticks(capacities)
    ax.set_xticklabels([f"{c:,}" for c in capacities])
    ax.minorticks_off()
    ax.set_ylim(0, 1)
    ax.set_xlabel(f"capacity of {summary['governed_tier']} (blocks)")
    ax.set_ylabel("prefix hit ratio")
    ax.set_title("hit ratio vs capacity")
    ax.grid(True, alpha=0.3)
    ax.legend()


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
