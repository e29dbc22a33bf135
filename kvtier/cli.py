"""The ``kvtier`` command: ``demo`` (the main job) and ``inspect`` (what a disk tier directory holds).

``kvtier demo`` runs a small chat workload (shared system prompts, multi-turn conversations) through a
real tier stack: every prompt's cached prefix is loaded back and checked bit-exact, the rest is
"computed" and stored, and the tiers evict, demote and reload as they fill. It prints what happened
per tier. It needs no file: without ``--config`` it uses the embedded default stack.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from kvtier.connectors.api import KVTier
from kvtier.tiers.disk import DiskTierError, inspect_slab


def block_content(key: bytes, nbytes: int) -> np.ndarray:
    """The bytes a model would have computed for this block: a pure function of the key, so loads can be checked."""
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(0, 256, nbytes, dtype=np.uint8)


def chat_workload(seed: int, conversations: int, turns: int, block_tokens: int):
    """Prompts of multi-turn chats: each conversation starts with one of a few shared system prompts and
    grows by a user turn and an answer per turn; every turn's prompt repeats the whole history."""
    rng = np.random.default_rng(seed)
    system_prompts = [rng.integers(0, 32000, block_tokens * int(rng.integers(4, 12))).tolist() for _ in range(3)]
    histories = [list(system_prompts[i % 3]) for i in range(conversations)]
    for _ in range(turns):
        for history in histories:
            history += rng.integers(0, 32000, int(rng.integers(1, 4) * block_tokens)).tolist()
            yield list(history)


def run_demo(kv: KVTier, conversations: int, turns: int, seed: int) -> dict:
    """Drive the workload through ``kv``; returns totals. Raises AssertionError on any wrong byte."""
    bb = kv.layout.block_bytes
    totals = {"requests": 0, "blocks": 0, "hit_blocks": 0, "verified_blocks": 0, "stored_blocks": 0}
    hits_per_tier: dict[str, int] = {}
    for tokens in chat_workload(seed, conversations, turns, kv.config.block_tokens):
        keys = kv.keys(tokens)
        out = np.empty((len(keys), bb), dtype=np.uint8)
        loaded = kv.load(keys, out).result(timeout=60)
        good = loaded.hits if not loaded.failed else loaded.failed[0]
        for i in range(good):
            assert np.array_equal(out[i], block_content(keys[i], bb)), f"block {i} came back wrong"
        for tier, n in loaded.per_tier.items():
            hits_per_tier[tier] = hits_per_tier.get(tier, 0) + n
        missing = keys[good:]
        computed = np.stack([block_content(k, bb) for k in missing]) if missing else out[:0]
        stored = kv.store(missing, computed).result(timeout=60)
        totals["requests"] += 1
        totals["blocks"] += len(keys)
        totals["hit_blocks"] += good
        totals["verified_blocks"] += good
        totals["stored_blocks"] += stored.stored
    kv.wait_idle()
    totals["hit_ratio"] = totals["hit_blocks"] / max(totals["blocks"], 1)
    totals["hits_per_tier"] = hits_per_tier
    return totals


def print_report(kv: KVTier, totals: dict, seconds: float, console: Console) -> None:
    console.print(kv.describe())
    table = Table(title="per tier")
    for column in ("tier", "used / capacity", "stored", "demoted", "evicted", "hits", "MiB in", "MiB out"):
        table.add_column(column, justify="right" if column != "tier" else "left")
    for name, s in kv.stats().items():
        table.add_row(name, f"{s['used']} / {s['capacity']}", str(s["committed"]), str(s["demoted"]),
                      str(s["evicted"]), str(s["hits"]), f"{s['bytes_in'] / 2**20:.1f}", f"{s['bytes_out'] / 2**20:.1f}")
    console.print(table)
    console.print(f"{totals['requests']} requests, {totals['blocks']} block references, "
                  f"{totals['hit_blocks']} hits ({totals['hit_ratio']:.1%}), every hit verified bit-exact; "
                  f"{totals['stored_blocks']} blocks stored; {seconds:.1f} s")


def print_inspection(info: dict, console: Console) -> None:
    table = Table(title=f"disk tier {info['path']}", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    rows = [
        ("blocks", f"{info['blocks']} of {info['slots']} slots ({info['free_slots']} free)"),
        ("block size", f"{info['block_bytes']} B (slot stride {info['slot_stride']} B)"),
        ("compression", f"{info['compression']}, {info['slot_bytes']} B of room per block"),
        ("bytes held", f"{info['block_bytes_used'] / 2**20:.1f} MiB ({info['stored_bytes'] / 2**20:.1f} MiB on disk)"),
        ("damaged slot headers", str(info["damaged_headers"])),
        ("file size", f"{info['file_bytes'] / 2**20:.1f} MiB"),
        ("filesystem free", f"{info['filesystem_free_bytes'] / 2**30:.1f} GiB"),
        ("in use by", info["lock_holder"] or "nobody"),
    ]
    rows += [(f"namespace {digest[:16]}", f"{count} blocks") for digest, count in info["namespaces"].items()]
    for row in rows:
        table.add_row(*row)
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvtier", description="A tiered KV-cache block store for LLM inference.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="store, evict, demote and reload a chat workload through a tier stack")
    demo.add_argument("--config", help="stack YAML (default: the embedded default stack)")
    demo.add_argument("--conversations", type=int, default=24)
    demo.add_argument("--turns", type=int, default=6)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", action="store_true", help="print the totals as one JSON object on the last line")
    inspect = commands.add_parser("inspect", help="show what a disk tier directory holds")
    inspect.add_argument("path", help="the disk tier's directory (its `path` in the YAML)")
    inspect.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)

    console = Console()
    if args.command == "inspect":
        try:
            info = inspect_slab(args.path)
        except DiskTierError as exc:
            console.print(f"kvtier inspect: {exc}")
            return 1
        if args.json:
            print(json.dumps(info))
        else:
            print_inspection(info, console)
        return 0
    started = time.perf_counter()
    with KVTier.open(args.config) as kv:
        totals = run_demo(kv, args.conversations, args.turns, args.seed)
        print_report(kv, totals, time.perf_counter() - started, console)
        totals["tiers"] = kv.stats()
    if args.json:
        print(json.dumps(totals))
    return 0


if __name__ == "__main__":
    sys.exit(main())
