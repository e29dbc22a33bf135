"""The ``kvtier`` command: ``replay`` (the main job; ``demo`` is its alias), ``inspect`` (what a disk
tier directory holds), ``doctor`` (what would fail at an engine's start, or silently not share, on a
config: ``kvtier.doctor``) and ``node serve`` (the machine's node daemon: ``kvtier.node_cli``).

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
    from rich.text import Text

    from kvtier.replay_cli import add_replay_parser, run_replay
    from kvtier.report import command_console
except ImportError as exc:  # the command's own dependencies are an extra: engines never need them
    raise SystemExit(f"the kvtier command needs its extra: pip install 'kvtier[cli]' ({exc})") from None
from kvtier.core.errors import ArgumentError, ConfigError
from kvtier.doctor import diagnose
from kvtier.doctor_sharing import VllmEngine, differences, other_sharing, recorded_report, verdict, vllm_dtype
from kvtier.node_cli import add_node_parser, run_node
from kvtier.tiers.disk.files import DiskTierError
from kvtier.tiers.disk.inspect import inspect_slab


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


def build_parser() -> argparse.ArgumentParser:
    """The command line without running it, so tests/test_docs.py can check every `kvtier ...` line the docs show."""
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
    add_doctor_parser(commands)
    add_node_parser(commands)
    return parser


def add_doctor_parser(commands) -> None:
    doctor = commands.add_parser(
        "doctor",
        help="check a config before an engine starts on it: what would fail, and what decides sharing",
        description="Exit status 0 when every check passes (and, with --compare, the two share), 1 otherwise.",
    )
    doctor.add_argument("config", help="the kvtier YAML config, or a `kvtier doctor --json` output to compare")
    doctor.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    doctor.add_argument(
        "--compare",
        metavar="OTHER",
        help="another config (under the same engine flags), or a `kvtier doctor --json` output: do the two share?",
    )
    engine = doctor.add_argument_group("engine", "the engine's settings that enter the key namespace (vLLM)")
    engine.add_argument("--engine", choices=["vllm"], help="the config is a vLLM connector's (default: standalone)")
    engine.add_argument("--model", help="the model as vLLM is given it (a Hub id or a local folder)")
    engine.add_argument("--dtype", type=_dtype, help="the dtype the engine runs with: bfloat16, float16, float32")
    engine.add_argument("--layout", help="the KV cache layout vLLM resolves, e.g. LBHNC")
    engine.add_argument("--block-size", type=int, default=16, help="tokens per vLLM block (default 16)")
    engine.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    engine.add_argument("--cache-dtype", default="auto", help="vLLM's kv cache dtype (default auto)")
    engine.add_argument("--revision", help="the commit a Hub model's revision resolved to")
    engine.add_argument("--quantization", help="vLLM's quantization method, if any")


def _dtype(name: str) -> str:
    try:
        return vllm_dtype(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _engine(args: argparse.Namespace) -> VllmEngine | None:
    """The engine the command line names; its flags without ``--engine``, or ``--engine`` without the
    settings it needs, are usage errors."""
    if args.engine is None:
        if args.model or args.dtype or args.layout:
            raise ArgumentError("--model, --dtype and --layout describe an engine: add --engine vllm")
        return None
    needed = (("--model", args.model), ("--dtype", args.dtype), ("--layout", args.layout))
    missing = [flag for flag, value in needed if not value]
    if missing:
        raise ArgumentError(f"--engine vllm needs {', '.join(missing)}")
    if args.block_size < 1 or args.tp < 1:
        raise ArgumentError("--block-size and --tp must be at least 1")
    return VllmEngine(
        args.model,
        args.dtype,
        args.layout,
        args.block_size,
        args.tp,
        args.cache_dtype,
        args.revision,
        args.quantization,
    )


def run_doctor(args: argparse.Namespace, console: Console) -> int:
    """Exit status 0 when every check passes (and, with ``--compare``, the two share), 1 otherwise, 2 for
    a command line that names no valid engine."""
    try:
        engine = _engine(args)
    except ArgumentError as exc:
        console.print(Text(f"kvtier doctor: {exc}"))
        return 2
    report = recorded_report(args.config) or diagnose(args.config, engine)
    ok = report["ok"]
    if args.compare is not None:
        try:
            other = other_sharing(args.compare, engine)
        except ConfigError as exc:
            report["compare"] = {"other": args.compare, "error": str(exc)}
        else:
            if report["sharing"] is None:
                report["compare"] = {"other": args.compare, "error": f"{args.config} does not load"}
            else:
                differ = differences(report["sharing"], other)
                report["compare"] = {"other": args.compare, "share": not differ, "differences": differ}
        ok = ok and bool(report["compare"].get("share"))
    if args.json:
        print(json.dumps(report))
    else:
        print_doctor(report, console)
    return 0 if ok else 1


def print_doctor(report: dict, console: Console) -> None:
    table = Table(title=Text(f"kvtier doctor {report['config']}"))
    for column in ("check", "", "what"):
        table.add_column(column)
    for check in report["checks"]:
        table.add_row(
            Text(check["name"]),
            Text("ok", "green") if check["ok"] else Text("FAIL", "bold red"),
            Text(check["message"]),
        )
    console.print(table)
    if report["sharing"] is not None:
        shared = Table(title="what decides sharing (equal digests: equal keys)", show_header=False)
        shared.add_column("field")
        shared.add_column("value")
        shared.add_row("digest", Text(str(report["sharing"]["digest"])))
        for name, value in report["sharing"]["fields"].items():
            shared.add_row(Text(name), Text(json.dumps(value)))
        console.print(shared)
    compare = report.get("compare")
    if compare is not None:
        said = compare["error"] if "error" in compare else verdict(compare["differences"])
        console.print(Text(f"compared with {compare['other']}: {said}"))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "node":
        return run_node(args)
    console = command_console()
    if args.command == "doctor":
        return run_doctor(args, console)
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
