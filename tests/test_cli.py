"""The main job: `kvtier demo` drives a chat workload through a real stack, checks every reloaded
block bit-exact (it raises otherwise), and reports per-tier figures that add up."""

import json

from kvtier.cli import chat_workload, main


def test_demo_reports_hits_demotions_and_consistent_counts(capsys):
    assert main(["demo", "--conversations", "8", "--turns", "4", "--json"]) == 0
    totals = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert totals["requests"] == 32
    assert 0 < totals["hit_blocks"] < totals["blocks"]
    assert totals["hit_ratio"] == totals["hit_blocks"] / totals["blocks"]
    assert sum(totals["hits_per_tier"].values()) == totals["hit_blocks"]
    gpu, host = totals["tiers"]["gpu"], totals["tiers"]["host"]
    assert gpu["committed"] == totals["stored_blocks"]
    assert gpu["demoted"] == host["committed"] > 0, "the GPU tier's watermark demotes into host memory"
    assert gpu["hits"] == totals["hits_per_tier"]["gpu"]


def test_demo_runs_on_a_given_config(tmp_path, capsys):
    config = tmp_path / "stack.yaml"
    config.write_text("block_bytes: 8KiB\ntiers:\n  - medium: host\n    capacity_blocks: 16\n")
    assert main(["demo", "--config", str(config), "--conversations", "4", "--turns", "3", "--json"]) == 0
    totals = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert totals["tiers"]["host"]["evicted"] > 0 and totals["tiers"]["host"]["used"] <= 16


def test_workload_prompts_grow_by_whole_blocks_and_share_system_prompts():
    prompts = list(chat_workload(seed=1, conversations=3, turns=2, block_tokens=16))
    assert len(prompts) == 6
    assert all(len(p) % 16 == 0 for p in prompts)
    first_turn, second_turn = prompts[:3], prompts[3:]
    for before, after in zip(first_turn, second_turn):
        assert after[:len(before)] == before, "each turn repeats the whole history"
