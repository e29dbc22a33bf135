"""The main job from the command line: `kvtier replay` (alias `kvtier demo`) drives the generated chat
workload through the embedded real stack, checks every reloaded block bit-exact (exit 1 otherwise),
and reports per-tier figures that add up; `inspect` is covered in the disk tests."""

import json

from kvtier.cli import main


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_demo_is_the_replay_on_the_embedded_stack(capsys):
    assert main(["demo", "--conversations", "20", "--json"]) == 0
    s = last_json(capsys)
    assert s["mode"] == "stack" and s["workload"].startswith("generated chat workload (20 conversations")
    assert 0 < s["hits"] < s["references"]
    assert s["hit_ratio"] == s["hits"] / s["references"]
    assert s["verified_blocks"] == s["hits"] and s["corrupt_blocks"] == 0
    tiers = s["tiers"]
    assert list(tiers) == ["gpu", "host", "disk"]
    assert sum(t["hits"] for t in tiers.values()) == s["hits"]
    assert tiers["gpu"]["stored"] == s["stored_blocks"]
    assert tiers["gpu"]["demoted"] > 0, "the GPU tier's watermark demotes into host memory"
    assert tiers["gpu"]["bytes_in"] >= s["stored_blocks"] * s["block_bytes"]


def test_the_table_is_printed_without_json(capsys):
    assert main(["replay", "--conversations", "5"]) == 0
    out = capsys.readouterr().out
    assert "per tier (real stack)" in out and "all bit-exact" in out and "prefill tokens saved" in out
