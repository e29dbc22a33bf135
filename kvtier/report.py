"""Rich tables for a replay's summary: per tier, the sizing, the totals, and a policy sweep.

Why separate: the replay command builds one summary dict (also printed as JSON), and these functions
only render it, so the table and the JSON line can never disagree.
"""

from __future__ import annotations

import sys

from rich import box
from rich.console import Console, ConsoleRenderable, RenderHook
from rich.table import Table

MiB = 2**20
LOG_WIDTH = 4096
"""Columns of the kvtier command's output where it is not a terminal (a log, a pipe): wide enough for
any table, which then takes only the width it needs; rich would otherwise assume 80."""


class _FoldTables(RenderHook):
    """Cells too wide for their column fold onto more lines, never end in "…": a cut path or figure
    reads as a whole one."""

    def process_renderables(self, renderables: list[ConsoleRenderable]) -> list[ConsoleRenderable]:
        for renderable in renderables:
            if isinstance(renderable, Table):
                for column in renderable.columns:
                    column.overflow = "fold"
        return renderables


def command_console() -> Console:
    """The kvtier command's console: a terminal's width on a terminal, ``LOG_WIDTH`` elsewhere, and
    tables that fold what does not fit rather than cut it."""
    console = Console() if sys.stdout.isatty() else Console(width=LOG_WIDTH)
    console.push_render_hook(_FoldTables())
    return console


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


def misses_table(summary: dict) -> Table:
    """Requests whose prefix missed, one row per reason: in total (the first missing block's reason)
    and per tier (why that block was not in the tier)."""
    misses = summary["misses"]
    table = Table(title="misses (requests whose prefix ended early)", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("reason")
    for column in ["total", *misses["by_tier"]]:
        table.add_column(column, justify="right")
    for reason, total in misses["total"].items():
        table.add_row(reason, f"{total:,}", *(f"{tier[reason]:,}" for tier in misses["by_tier"].values()))
    return table


def tenants_table(summary: dict) -> Table:
    """Per tenant of the trace (the top ones by name, the rest summed): its references and hit ratio."""
    table = Table(title="tenants", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("tenant")
    for column in ("references", "hits", "hit ratio"):
        table.add_column(column, justify="right")
    for tenant, c in summary["tenants"].items():
        table.add_row(tenant, f"{c['references']:,}", f"{c['hits']:,}", f"{c['hit_ratio']:.3f}")
    return table


def tier_tenants_table(name: str, counts: dict) -> Table:
    """A tier's own counts per tenant label (the tenants its shares name, ``other``, ``none``: not the
    trace's tenants, whom a tier knows only by their shares)."""
    table = Table(title=f"tenants in {name} (by its shares)", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("tenant")
    columns = ("stored", "read", "evicted", "caused", "held")
    for column in columns:
        table.add_column(column, justify="right")
    for label, c in counts.items():
        table.add_row(label, *(f"{c[what]:,}" for what in columns))
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
    if "engines" in s:
        where = "one node daemon's slab" if s["node"] else "private tiers of 1/N of the stack each"
        ratios = ", ".join(f"{e['hit_ratio']:.3f}" for e in s["engines"])
        lines.append(f"{len(s['engines'])} engine(s), split {s['split']}, on {where}: hit ratios {ratios}")
    if "private" in s:
        lines.append(
            f"the same split on private tiers of 1/{len(s['engines'])} of the memory each: hit ratio "
            f"{s['private']['hit_ratio']:.3f}; the node tier's is {s['hit_gain']:.2f}x that"
        )
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


def routing_table(summary: dict) -> Table:
    """One row per routing (``--routing``): hit ratio in all and per tier, prefill seconds saved, the engines'
    hit ratios (lowest to highest), and the busiest engine's requests over the mean (1.00: evenly spread)."""
    routing = summary["routing"]
    tiers = list(next(iter(routing.values()))["tier_hit_ratio"])
    table = Table(title=f"routing across {len(summary['engines'])} engines", box=box.SIMPLE_HEAD, pad_edge=False)
    columns = ["routing", "hit ratio", *(f"{t} hits" for t in tiers), "prefill s saved", "net s", "engines", "busiest"]
    for column in columns:
        table.add_column(column, justify="left" if column == "routing" else "right")
    for name, r in routing.items():
        spread = f"{min(r['engines']):.2f}-{max(r['engines']):.2f}"
        net = "?" if r["net_prefill_s_saved"] is None else f"{r['net_prefill_s_saved']:.1f}"
        per_tier = (f"{r['tier_hit_ratio'][t]:.3f}" for t in tiers)
        busiest = f"{max(r['requests']) * len(r['requests']) / max(1, sum(r['requests'])):.2f}"
        table.add_row(name, f"{r['hit_ratio']:.3f}", *per_tier, f"{r['prefill_s_saved']:.1f}", net, spread, busiest)
    return table


SIZING_COLUMNS = ["tier", "hits", "tokens/s", "GB/s", "ms/block", "net s/s", "pays?"]


def sizing_table(summary: dict) -> Table:
    """The single run's sizing (``kvtier.replay.sizing``): one row per tier and one for all of them."""
    table = _sizing_frame(summary["sizing"], "sizing: what this capacity buys per second of trace", SIZING_COLUMNS)
    for row in _sizing_rows(summary["sizing"]):
        table.add_row(*row.values())
    return table


def sizing_sweep_table(summary: dict) -> Table:
    """The sizing of every capacity of the sweep, for the run's policy (the JSON has every policy's). No
    GB/s column: a tier's bandwidth is one for all the runs, shown in the single run's table."""
    by_capacity = summary["sizing_sweep"][summary["policy"]]
    title = f"sizing by capacity of {summary['governed_tier']} (blocks), {summary['policy']}, per second of trace"
    columns = [c for c in SIZING_COLUMNS if c != "GB/s"]
    table = _sizing_frame(next(iter(by_capacity.values())), title, ["capacity", *columns])
    for capacity, figures in by_capacity.items():
        rows = _sizing_rows(figures)
        for i, row in enumerate(rows):
            cells = [row[c] for c in columns]
            table.add_row(f"{int(capacity):,}" if i == 0 else "", *cells, end_section=i == len(rows) - 1)
    return table


def _sizing_frame(sizing: dict, title: str, columns: list[str]) -> Table:
    """An empty sizing table whose caption says what the figures assume and how to read them."""
    span = sizing["trace_seconds"]
    rates = (
        f"Per second of trace ({span:,.1f} s): tokens/s = prompt tokens not recomputed; net s/s = prefill "
        "seconds saved minus seconds spent loading."
        if span > 0
        else "The trace's timestamps span no time: per-second figures need a trace with timestamps."
    )
    caption = (
        f"{rates} Recomputing a {sizing['block_tokens']}-token block takes "
        f"{sizing['recompute_s_per_block'] * 1e3:.3g} ms at {sizing['prefill_tokens_per_s']:,.0f} tokens/s "
        f"(assumed: --prefill-tokens-per-s); loading its {_number(sizing['block_bytes'], ',')} bytes takes "
        "ms/block at the tier's GB/s (measured over this command's runs, or --load-gbps). pays? NO: loading a "
        "block from that tier is slower than recomputing it at this rate, so its hits do not pay; unmeasured: "
        "no load read that tier alone, or --metadata-only (give --load-gbps)."
    )
    table = Table(title=title, caption=caption, caption_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for column in columns:
        table.add_column(column, justify="left" if column in ("tier", "pays?") else "right", no_wrap=True)
    return table


def _sizing_rows(sizing: dict) -> list[dict[str, str]]:
    """Each tier's cells and the total's, by column of ``SIZING_COLUMNS``; "-" where a figure is unknown."""
    rows = []
    for name, t in sizing["tiers"].items():
        load_ms = None if t["load_s_per_block"] is None else t["load_s_per_block"] * 1e3
        rows.append(_row(name, t, _number(t["load_gbps"]), _number(load_ms), _verdict(t)))
    total = sizing["total"]
    rows.append(_row("all", total, "", "", _total_verdict(total)))
    return rows


def _row(label: str, figures: dict, gbps: str, load_ms: str, verdict: str) -> dict[str, str]:
    cells = [label, f"{figures['hits']:,}", _number(figures["tokens_saved_per_s"], ",.0f"), gbps, load_ms]
    cells += [_number(figures["net_s_saved_per_s"]), verdict]
    return dict(zip(SIZING_COLUMNS, cells, strict=True))


def _number(value: float | None, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def _verdict(tier: dict) -> str:
    """Plainly: whether loading one block from this tier beats recomputing it at the assumed rate."""
    if tier["pays"] is None:
        return "no hits" if tier["hits"] == 0 else "unmeasured"
    return "yes" if tier["pays"] else "[bold red]NO: recompute[/]"


def _total_verdict(total: dict) -> str:
    net = total["net_s_saved_per_s"]
    if net is None:
        return ""
    return "saves" if net > 0 else "[bold red]LOSES[/]" if net < 0 else "-"


def print_summary(summary: dict, console: Console) -> None:
    if summary.get("stack_description"):
        console.print(summary["stack_description"], highlight=False, soft_wrap=True)
    console.print(tier_table(summary))
    console.print(sizing_table(summary))
    if "misses" in summary:
        console.print(misses_table(summary))
    if summary.get("tenants"):
        console.print(tenants_table(summary))
    for name, tier in summary["tiers"].items():
        if "tenants" in tier:
            console.print(tier_tenants_table(name, tier["tenants"]))
    if "sweep" in summary:
        console.print(sweep_table(summary))
        console.print(sizing_sweep_table(summary))
    if "routing" in summary:
        console.print(routing_table(summary))
    for line in totals_lines(summary):
        console.print(line, highlight=False, soft_wrap=True)
