"""Rich tables for a replay's summary: per tier, the totals, and a policy sweep.

Why separate: the replay command builds one summary dict (also printed as JSON), and these functions
only render it, so the table and the JSON line can never disagree.
"""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

MiB = 2**20


def tier_table(summary: dict) -> Table:
    """One row per tier: capacity and use, hits and hit ratio, bytes in/out, demotions, evictions, bandwidth."""
    stack = summary["mode"] == "stack"
    table = Table(
        title=f"per tier ({'real stack' if stack else 'metadata only: one cache, no bytes'})",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    columns = ["tier", "used/cap", "hits", "hit ratio"]
    if stack:
        columns += ["MiB in", "MiB out", "demoted", "evicted", "MiB/s"]
    else:
        columns += ["evicted"]
    widest = max(len(f"{t['used']}/{t['capacity']}") for t in summary["tiers"].values())
    min_widths = {"used/cap": widest, "hit ratio": 5}  # "hit ratio" may wrap its header, never its 0.123
    for column in columns:
        table.add_column(
            column,
            justify="left" if column == "tier" else "right",
            no_wrap=column != "hit ratio",
            min_width=min_widths.get(column),
        )
    for name, t in summary["tiers"].items():
        label = name if name == t["medium"] else f"{name} ({t['medium']})"
        row = [label, f"{t['used']}/{t['capacity']}", f"{t['hits']:,}", f"{t['hit_ratio']:.3f}"]
        if stack:
            row += [
                f"{t['bytes_in'] / MiB:.0f}",
                f"{t['bytes_out'] / MiB:.0f}",
                f"{t['demoted']:,}",
                f"{t['evicted']:,}",
                f"{t['mib_per_s']:,.0f}",
            ]
        else:
            row += [f"{t['evicted']:,}"]
        table.add_row(*row)
    return table


def totals_lines(summary: dict) -> list[str]:
    """The headline figures in a few sentences."""
    s = summary
    lines = [
        f"{s['workload']}: {s['requests']:,} requests, {s['references']:,} block references; "
        f"policy {s['policy']} on {s['governed_tier']} ({s['capacity']:,} blocks)",
        f"hit ratio {s['hit_ratio']:.3f} ({s['hits']:,} prefix-hit blocks); prefill tokens saved "
        f"{s['prefill_tokens_saved']:,} of {s['prefill_tokens']:,} ({s['prefill_saved_ratio']:.1%})",
    ]
    if "belady_hit_ratio" in s:
        share = s["hit_ratio"] / s["belady_hit_ratio"] if s["belady_hit_ratio"] else 1.0
        lines.append(
            f"Belady (offline optimum, {s['belady_capacity']:,} blocks): {s['belady_hit_ratio']:.3f}; "
            f"this run reaches {share:.3f} of it"
        )
    if s["mode"] == "stack":
        check = "all bit-exact" if not s["corrupt_blocks"] else f"[bold red]{s['corrupt_blocks']} CORRUPT[/]"
        lines.append(
            f"{s['verified_blocks']:,} hit blocks loaded back and compared with what was stored: {check}; "
            f"{s['failed_blocks']} failed loads; {s['stored_blocks']:,} blocks stored; "
            f"{s['block_bytes']:,} bytes per block; {s['seconds']:.1f} s"
        )
    else:
        lines.append(f"{s['seconds']:.1f} s")
    return lines


def sweep_table(summary: dict) -> Table:
    """Hit ratio per policy (rows) and capacity (columns), with the ratio to Belady in brackets when known."""
    sweep, belady = summary["sweep"], summary.get("belady_sweep", {})
    capacities = list(next(iter(sweep.values())))
    table = Table(
        title=f"hit ratio by capacity of {summary['governed_tier']} (blocks)"
        + (" - in brackets: share of Belady's" if belady else ""),
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    table.add_column("policy")
    for c in capacities:
        table.add_column(f"{int(c):,}", justify="right")
    if belady:
        table.add_row("belady (optimum)", *(f"{belady[c]:.3f}" for c in capacities))
    for policy, by_capacity in sweep.items():
        cells = [
            f"{by_capacity[c]:.3f}" + (f" ({by_capacity[c] / belady[c]:.2f})" if belady.get(c) else "")
            for c in capacities
        ]
        table.add_row(policy, *cells)
    return table


def print_summary(summary: dict, console: Console) -> None:
    if summary.get("stack_description"):
        console.print(summary["stack_description"], highlight=False, soft_wrap=True)
    console.print(tier_table(summary))
    if "sweep" in summary:
        console.print(sweep_table(summary))
    for line in totals_lines(summary):
        console.print(line, highlight=False, soft_wrap=True)
