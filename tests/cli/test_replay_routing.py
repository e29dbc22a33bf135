"""`kvtier replay --engines N --routing`: one replay per routing on the same requests and stacks, compared
in the JSON (``routing``) and a table; a router that hears every tier's events never does worse than
one that hears only the GPU's."""

from __future__ import annotations

import json

import pytest

from kvtier.cli import main
from kvtier.replay.routing import ROUTINGS


def config(tmp_path) -> str:
    path = tmp_path / "stack.yaml"
    tiers = [
        {"medium": "gpu", "capacity_blocks": 24, "eviction": "lru"},
        {"medium": "host", "capacity_blocks": 96, "eviction": "lru"},
    ]
    path.write_text(json.dumps({"block_tokens": 512, "block_bytes": 4096, "tiers": tiers}))
    return str(path)


def test_every_routing_is_replayed_and_tier_aware_routing_never_loses_to_gpu_only(tmp_path, capsys):
    argv = ["replay", "--conversations", "40", "--config", config(tmp_path), "--engines", "3", "--routing"]
    assert main([*argv, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    routing = summary["routing"]
    assert list(routing) == list(ROUTINGS)
    for figures in routing.values():
        assert len(figures["engines"]) == 3 and 0 <= figures["hit_ratio"] <= 1
        assert figures["hit_ratio"] == pytest.approx(sum(figures["tier_hit_ratio"].values()))
        assert figures["prefill_s_saved"] > 0
    assert routing["prefix_tiered"]["hit_ratio"] >= routing["prefix_gpu"]["hit_ratio"]
    assert routing["prefix_tiered"]["hit_ratio"] > routing["round_robin"]["hit_ratio"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "routing across 3 engines" in out and all(name in out for name in ROUTINGS)


def test_routing_needs_several_engines(tmp_path, capsys):
    assert main(["replay", "--conversations", "5", "--config", config(tmp_path), "--routing"]) == 2
    assert "--routing compares how requests go to several engines" in capsys.readouterr().err
