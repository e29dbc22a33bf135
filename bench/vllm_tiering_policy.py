"""The hit ratio of vLLM's CPU offloading tier with kvtier's adaptive policy, against vLLM's own LRU and ARC.

What is measured
    Each policy drives vLLM 0.33's real ``CPUOffloadingManager`` (``cache_policy="lru"``, ``"arc"``,
    or ``"KVTierAdaptive"`` loaded out of tree from ``kvtier.connectors.vllm_tiering``), metadata
    only: no bytes move. Each request is replayed as vLLM's offloading connector drives the
    manager: ``on_new_request``; ``lookup`` of its keys in order until the first that is not a
    HIT (those are its prefix hits); ``prepare_load`` and ``complete_load`` of the hits;
    ``prepare_store`` of the rest (when it returns None the store is dropped, as vLLM does) and
    ``complete_store``; ``on_request_finished``. Every key's end token is set in the request's
    ``ReqContext`` as vLLM's scheduler does. A block id becomes a key as vLLM makes one: a
    SHA-256 digest (vLLM's block hashes are digests) through ``make_offload_key(digest, 0)``.
    The hit ratio is prefix-hit blocks / all blocks of all requests.

    Workloads: the shared Mooncake synthetic trace and the generated ``chat`` workload
    (``kvtier.replay.workload.WORKLOADS``), each at three capacities given as fractions of the
    workload's distinct blocks (small, medium, large).

Reference, measured in the same run
    vLLM's ``lru`` (its default) and ``arc`` through the same manager and the same calls. Each
    cell shows the adaptive policy's hit ratio as a share of the better of the two.

Why
    The policy is only worth configuring in vLLM if it is at least as good as what vLLM ships on
    every workload and size: vLLM's manager calls a policy differently from kvtier's tiers (it
    stores every block it is offered, inserts before writing, tells reads at first access), so
    kvtier's own figures (bench/policies.py) do not carry over by themselves.

The last line printed is one JSON object: ``ratio`` is the minimum over every (workload, capacity)
cell of adaptive / max(lru, arc); then every cell's figures.

Run: ``VLLM_TARGET_DEVICE=cpu .venv/bin/python bench/vllm_tiering_policy.py [--trace PATH]
[--workloads mooncake,chat] [--fractions 0.025,0.1,0.4]`` (about 15 seconds on two cores).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

# vLLM reads these when it is imported: its CPU install, no GPU, no model hub.
for _name, _value in (("VLLM_TARGET_DEVICE", "cpu"), ("CUDA_VISIBLE_DEVICES", ""), ("HF_HUB_OFFLINE", "1")):
    os.environ.setdefault(_name, _value)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the tests' driver of vLLM's managers

from vllm.v1.kv_offload.base import OffloadKey, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402

from helpers.vllm_tiering import serve  # noqa: E402
from kvtier.replay.trace import Request, load_trace  # noqa: E402
from kvtier.replay.workload import WORKLOADS, generate  # noqa: E402

DEFAULT_TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"
MODULE_PATH = "kvtier.connectors.vllm_tiering"
# column -> (vLLM's cache_policy, cache_policy_module_path)
POLICIES = {"lru": ("lru", None), "arc": ("arc", None), "adaptive": ("KVTierAdaptive", MODULE_PATH)}


def workload(name: str, trace: Path) -> list[Request]:
    """The requests of a named workload: ``mooncake`` reads ``trace``, the others are generated."""
    return load_trace(trace) if name == "mooncake" else generate(WORKLOADS[name])


def keyed(requests: Sequence[Request]) -> list[list[OffloadKey]]:
    """Every request's blocks as vLLM offload keys (group 0), one digest per distinct block id."""
    keys: dict[int, OffloadKey] = {}
    out = []
    for request in requests:
        row = []
        for block in request.hash_ids:
            key = keys.get(block)
            if key is None:
                key = keys[block] = make_offload_key(hashlib.sha256(block.to_bytes(8, "little")).digest(), 0)
            row.append(key)
        out.append(row)
    return out


def replay(requests: list[list[OffloadKey]], capacity: int, policy: str) -> float:
    """The prefix hit ratio of ``requests`` through one CPU tier of ``capacity`` chunks."""
    name, module_path = POLICIES[policy]
    manager = CPUOffloadingManager(capacity, cache_policy=name, cache_policy_module_path=module_path)
    hits = sum(serve(manager, str(i), keys) for i, keys in enumerate(requests))
    blocks = sum(len(keys) for keys in requests)
    return hits / blocks if blocks else 0.0


def measure(names: list[str], fractions: list[float], trace: Path) -> tuple[dict, dict[str, float]]:
    """Every cell's hit ratios (workload -> capacity -> policy -> ratio), printed as they come, and each
    policy's seconds."""
    cells: dict[str, dict[str, dict[str, float]]] = {}
    seconds = dict.fromkeys(POLICIES, 0.0)
    for name in names:
        requests = keyed(workload(name, trace))
        distinct = len({key for keys in requests for key in keys})
        capacities = [max(1, round(distinct * f)) for f in fractions]
        print(f"\n{name}: {len(requests)} requests, {sum(map(len, requests))} blocks, {distinct} distinct")
        cells[name] = {}
        for capacity in capacities:
            row = cells[name][str(capacity)] = {}
            for policy in POLICIES:
                start = time.perf_counter()
                row[policy] = replay(requests, capacity, policy)
                seconds[policy] += time.perf_counter() - start
        print_table(cells[name])
    return cells, seconds


def share(row: dict[str, float]) -> float:
    """The adaptive policy's hit ratio as a share of the better of vLLM's two (1 where both are 0)."""
    best = max(row["lru"], row["arc"])
    return row["adaptive"] / best if best else 1.0


def print_table(cells: dict[str, dict[str, float]]) -> None:
    header = f"{'capacity':>10}" + "".join(f"{p:>10}" for p in POLICIES) + f"{'share':>10}"
    print(header)
    print("-" * len(header))
    for capacity, row in cells.items():
        print(f"{capacity:>10}" + "".join(f"{row[p]:>10.4f}" for p in POLICIES) + f"{share(row):>10.3f}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE), help="the Mooncake JSONL trace of workload 'mooncake'")
    parser.add_argument(
        "--workloads",
        default="mooncake,chat",
        help="comma separated: mooncake and the names of kvtier.replay.workload.WORKLOADS",
    )
    parser.add_argument(
        "--fractions",
        default="0.025,0.1,0.4",
        help="capacities as fractions of each workload's distinct blocks, comma separated",
    )
    args = parser.parse_args(argv)
    names = args.workloads.split(",")
    unknown = [n for n in names if n != "mooncake" and n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads: {unknown}")
    if "mooncake" in names and not Path(args.trace).is_file():
        parser.error(f"trace not found: {args.trace} (pass --trace, or leave mooncake out of --workloads)")
    fractions = sorted(float(f) for f in args.fractions.split(","))

    start = time.perf_counter()
    cells, seconds = measure(names, fractions, Path(args.trace))
    wall = time.perf_counter() - start
    ratio = min(share(row) for rows in cells.values() for row in rows.values())
    print(
        f"\n(hit ratio; share = adaptive / max(lru, arc)); worst share {ratio:.4f}; "
        f"seconds per policy: " + ", ".join(f"{p} {s:.1f}" for p, s in seconds.items()) + f"; wall {wall:.1f} s"
    )
    result = {
        "ratio": round(ratio, 4),
        "hit_ratio": {
            name: {c: {p: round(v, 5) for p, v in row.items()} for c, row in rows.items()}
            for name, rows in cells.items()
        },
        "share": {name: {c: round(share(row), 4) for c, row in rows.items()} for name, rows in cells.items()},
        "fractions": fractions,
        "seconds": {p: round(s, 2) for p, s in seconds.items()},
        "trace": str(args.trace),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
