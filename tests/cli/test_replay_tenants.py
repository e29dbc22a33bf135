"""Tenants in `kvtier replay`: a flooding tenant (``--flood``: prefixes nobody sends again) against a
steady one, through the index alone and through a real host tier, with and without the tier's
``tenants:`` shares.

What it shows: with shares the steady tenant's hit ratio stays within 0.02 of what it gets alone with its
share of the capacity; without them it collapses. Trace lines carry ``tenant``; two tenants sending the
same block ids never hit each other's blocks; the report names the top tenants and sums the rest; a bad
``tenant`` field is one clear error.
"""

from __future__ import annotations

import json

import pytest
import yaml

from helpers.replay_helpers import write
from kvtier.cli import main
from kvtier.replay.tenants import OTHERS, tenant_summary

CAPACITY = 2000


def run_json(capsys, *argv) -> dict:
    assert main(["replay", *map(str, argv), "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def config(tmp_path, shares: dict | None, capacity: int = CAPACITY) -> str:
    host = {"medium": "host", "capacity_blocks": capacity, "eviction": "lru"}
    if shares is not None:
        host["tenants"] = {"shares": shares}
    path = tmp_path / f"stack-{capacity}-{bool(shares)}.yaml"
    path.write_text(yaml.safe_dump({"block_tokens": 512, "block_bytes": "4KiB", "tiers": [host]}))
    return str(path)


@pytest.mark.parametrize("mode", [["--metadata-only"], []], ids=["index", "host tier"])
def test_a_steady_tenant_keeps_its_hits_against_a_flood_with_shares_and_loses_them_without(tmp_path, capsys, mode):
    workload = ["--conversations", "100", *mode]
    alone = run_json(capsys, *workload, "--config", config(tmp_path, None, CAPACITY // 2))["hit_ratio"]
    flooded = [*workload, "--flood", "128"]
    unshared = run_json(capsys, *flooded, "--config", config(tmp_path, None))
    shared = run_json(capsys, *flooded, "--config", config(tmp_path, {"steady": 0.5, "flood": 0.5}))
    assert shared["tenants"]["steady"]["hit_ratio"] >= alone - 0.02
    assert unshared["tenants"]["steady"]["hit_ratio"] < alone - 0.15
    assert shared["tenants"]["flood"]["hits"] == unshared["tenants"]["flood"]["hits"] == 0
    if not mode:
        assert shared["corrupt_blocks"] == unshared["corrupt_blocks"] == 0
        held = shared["tiers"]["host"]["tenants"]  # the tier's own counts, per tenant of its shares
        assert set(held) == {"steady", "flood"} and held["flood"]["evicted"] > 10 * held["steady"]["evicted"]
        assert held["steady"]["held"] + held["flood"]["held"] == shared["tiers"]["host"]["used"]
        assert "tenants" not in unshared["tiers"]["host"]


def test_engines_on_a_node_daemon_keep_a_steady_tenants_hits_with_the_slabs_shares(tmp_path, capsys):
    """``--node --engines 2``: the config's last tier becomes a node daemon's slab, shares and all; the
    engines tell it each block's tenant, and its shares hold the steady tenant's blocks."""
    flooded = ["--conversations", "100", "--flood", "128", "--node", "--engines", "2"]
    unshared = run_json(capsys, *flooded, "--config", config(tmp_path, None))
    shared = run_json(capsys, *flooded, "--config", config(tmp_path, {"steady": 0.5, "flood": 0.5}))
    assert shared["tenants"]["steady"]["hit_ratio"] > unshared["tenants"]["steady"]["hit_ratio"] + 0.15
    slab = shared["tiers"]["host"]["tenants"]  # the daemon's own counts: steady holds its share at the end
    assert slab["steady"]["held"] >= CAPACITY // 2 and slab["flood"]["evicted"] > 10 * slab["steady"]["evicted"]
    assert shared["corrupt_blocks"] == unshared["corrupt_blocks"] == 0


def test_two_tenants_sending_the_same_block_ids_never_hit_each_others(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    lines = [{"hash_ids": [1, 2, 3], "tenant": "a"}, {"hash_ids": [1, 2, 3], "tenant": "b"}, {"hash_ids": [1, 2, 3]}]
    lines.append({"hash_ids": [1, 2, 3], "tenant": "a"})
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    for mode in (["--metadata-only", "--capacity", "100"], ["--config", config(tmp_path, None, 100)]):
        s = run_json(capsys, trace, *mode)
        assert s["hits"] == 3
        assert {name: c["hits"] for name, c in s["tenants"].items()} == {"a": 3, "b": 0, "(none)": 0}


def test_the_report_names_the_top_tenants_and_sums_the_others():
    counts = {f"t{i}": {"hits": i, "references": 10 + i} for i in range(12)}
    summary = tenant_summary(counts, top=3)
    assert list(summary) == ["t11", "t10", "t9", OTHERS]
    assert summary[OTHERS] == {
        "hits": sum(range(9)),
        "references": sum(range(10, 19)),
        "tenants": 9,
        "hit_ratio": 36 / 126,
    }
    assert tenant_summary({"(none)": {"hits": 1, "references": 2}}) == {}


@pytest.mark.parametrize("tenant", ["", 7, "x" * 256, "\ud800"])
def test_a_bad_tenant_field_is_one_clear_error(tmp_path, capsys, tenant):
    trace = tmp_path / "bad.jsonl"
    trace.write_text(json.dumps({"hash_ids": [1], "tenant": tenant}) + "\n")
    assert main(["replay", str(trace), "--metadata-only"]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:1" in err and "tenant: expected a string of 1 to 255 bytes" in err and "Traceback" not in err
    write(tmp_path / "ok.jsonl", [[1]])
    assert main(["replay", str(tmp_path / "ok.jsonl"), "--metadata-only", "--flood", "0"]) == 2
    assert "--flood must be at least 1 block" in capsys.readouterr().err


def test_the_printed_report_gives_the_traces_tenants_and_each_tiers_own_labels_apart(tmp_path, capsys):
    """The trace's tenants (hit ratios) and a tier's counts (by the labels of its shares) are two tables:
    a tenant the shares do not name is the tier's ``other``, never a row of zeros under its own name."""
    shares = config(tmp_path, {"steady": 0.5})
    assert main(["replay", "--conversations", "20", "--flood", "64", "--config", shares]) == 0
    out = capsys.readouterr().out
    trace_table, tier_table = out.split("tenants in host (by its shares)")
    assert "flood" in trace_table and "steady" in trace_table
    rows = {line.split()[0] for line in tier_table.splitlines() if line.strip()[:1].isalpha()}
    assert {"steady", "other"} <= rows and "flood" not in rows
