"""The ``kvtier`` command: ``replay`` (the main job; ``demo`` is its alias) and ``inspect`` (what a disk
tier directory holds).

``kvtier replay`` runs a Mooncake trace, or without one a generated chat workload (shared system
prompts, multi-turn conversations), through a real tier stack: every hit is loaded back and checked
bit-exact, the rest is "computed" and stored, and the tiers evict, demote and reload as they fill. It
prints what happened per tier (see ``kvtier.replay_cli``).
"""

from __future__ import annotations

import argparse
import json
import sys

try:
    from rich.console import Console
    from rich.table import Table

    from kvtier.replay_cli import add_replay_parser, run_replay
except ImportError as exc:  # the command's own dependencies are an extra: engines never need them
    raise SystemExit(f"the kvtier command needs its extra: pip install 'kvtier[cli]' ({exc})") from None
from kvtier.tiers.disk import DiskTierError, inspect_slab


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
    add_replay_parser(commands)
    inspect = commands.add_parser("inspect", help="show what a disk tier directory holds")
    inspect.add_argument("path", help="the disk tier's directory (its `path` in the YAML)")
    inspect.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    inspect.add_argument(
        "--shared-directory",
        action="store_true",
        help="accept a directory or slab of another owner, or group-writable (the tier's shared_directory: true)",
    )
    args = parser.parse_args(argv)

    console = Console()
    if args.command == "inspect":
        try:
            info = inspect_slab(args.path, shared_directory=args.shared_directory)
        except DiskTierError as exc:
            console.print(f"kvtier inspect: {exc}")
            return 1
        if args.json:
            print(json.dumps(info))
        else:
            print_inspection(info, console)
        return 0
    return run_replay(args, console)


if __name__ == "__main__":
    sys.exit(main())
