"""`kvtier replay` flags on hand-made traces, figures computed by hand.

Invariants checked:
- --metadata-only --json: hits, hit ratio, prefill tokens saved, Belady (--belady) as worked out by hand;
- --sweep with --policy list and --belady: one hit ratio per policy and capacity, Belady per capacity;
- a real stack from --config, with --capacity and --tier overriding the governed tier: per-tier hits,
  bytes in/out, demotions and evictions as worked out by hand (tests/replay/test_replay_stack.py); each
  run's disk tier starts empty in a fresh directory inside the configured path, removed afterwards;
- --plot writes a PNG; --save-trace writes the replayed requests, and replaying that file gives
  the same figures;
- bad input (missing trace, bad trace line, unknown policy or tier, several policies without
  --sweep, a bad --sweep, a bad config) exits 2 with one clear line on stderr, never a traceback.
"""

from __future__ import annotations

import json

import pytest

from helpers.replay_helpers import BB, TRACE, write
from kvtier.cli import main

BY_HAND = [[1, 2], [1, 3], [4], [1, 2], [1, 3]]


def run_json(capsys, *argv) -> dict:
    assert main(["replay", *map(str, argv), "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_metadata_only_with_belady(tmp_path, capsys):
    # LRU, 3 blocks (see tests/replay/test_replay.py::test_lru_and_belady_by_hand): 3 hits of 9, one
    # block each in requests 2, 4 and 5, each saving 512 of its 1012 tokens. Belady: 5 hits.
    trace = write(tmp_path / "t.jsonl", BY_HAND)
    s = run_json(capsys, trace, "--metadata-only", "--policy", "lru", "--capacity", 3, "--belady")
    assert (s["mode"], s["requests"], s["references"], s["hits"]) == ("metadata", 5, 9, 3)
    assert s["hit_ratio"] == pytest.approx(3 / 9)
    assert s["prefill_tokens"] == 4 * 1012 + 500 and s["prefill_tokens_saved"] == 3 * 512
    assert s["belady_hit_ratio"] == pytest.approx(5 / 9) and s["belady_capacity"] == 3
    assert s["tiers"]["cache"] == {
        "medium": "index",
        "capacity": 3,
        "used": 3,
        "hits": 3,
        "hit_ratio": pytest.approx(3 / 9),
        "evicted": 3,
    }


def test_sweep(tmp_path, capsys):
    # 1 block, LRU: [1,2] keeps 1 (the request protects its blocks, only what fits is cached);
    # [1,3] hits 1 and cannot cache 3; [4] replaces 1; [1,2] keeps 1; [1,3] hits 1: 2 hits.
    # Belady, 1 block: 1 stays throughout, everything else is bypassed: hits in requests 2, 4, 5.
    trace = write(tmp_path / "t.jsonl", BY_HAND)
    s = run_json(capsys, trace, "--metadata-only", "--policy", "lru,s3fifo", "--sweep", "1,3", "--belady")
    assert s["sweep"]["lru"] == {"1": pytest.approx(2 / 9), "3": pytest.approx(3 / 9)}
    assert set(s["sweep"]) == {"lru", "s3fifo"}
    assert s["belady_sweep"] == {"1": pytest.approx(3 / 9), "3": pytest.approx(5 / 9)}


def test_real_stack_from_a_config_with_overrides(tmp_path, capsys):
    config = tmp_path / "stack.yaml"
    config.write_text(
        f"block_bytes: {BB}\ntiers:\n  - medium: host\n    capacity_blocks: 2\n"
        f"  - medium: disk\n    path: {tmp_path / 'disk'}\n    capacity_blocks: 100\n    eviction: arc\n"
    )
    trace = write(tmp_path / "t.jsonl", TRACE, tail=0)
    s = run_json(capsys, trace, "--config", config, "--capacity", 4, "--policy", "lru", "--tier", "disk", "--belady")
    assert (s["mode"], s["hits"], s["references"], s["stored_blocks"]) == ("stack", 7, 16, 8)
    assert s["verified_blocks"] == 7 and s["corrupt_blocks"] == 0 and s["policy"] == "lru"
    host, disk = s["tiers"]["host"], s["tiers"]["disk"]
    assert (host["hits"], host["stored"], host["demoted"]) == (3, 8, 6)
    assert (host["bytes_in"], host["bytes_out"]) == (8 * BB, 9 * BB)
    assert (disk["hits"], disk["stored"], disk["evicted"]) == (4, 6, 2)
    assert (disk["bytes_in"], disk["bytes_out"]) == (6 * BB, 4 * BB)
    assert disk["capacity"] == 4 and s["capacity"] == 4 and disk["hit_ratio"] == pytest.approx(4 / 16)
    assert s["prefill_tokens_saved"] == 7 * 512
    assert s["belady_capacity"] == 6 and 7 / 16 <= s["belady_hit_ratio"] <= 1
    # Each run's disk tier lived in a fresh directory inside the configured path, now removed: a
    # second run starts empty again and counts the same blocks; --block-bytes doubles every byte count.
    assert list((tmp_path / "disk").iterdir()) == []
    again = run_json(capsys, trace, "--config", config, "--capacity", 4, "--policy", "lru", "--block-bytes", "8KiB")
    assert again["block_bytes"] == 2 * BB and again["verified_blocks"] == 7
    for name, tier in s["tiers"].items():
        for k, v in tier.items():
            if k.startswith("bytes_"):
                assert again["tiers"][name][k] == 2 * v
            elif k != "mib_per_s":
                assert again["tiers"][name][k] == v


def test_plot_and_save_trace(tmp_path, capsys):
    png, saved = tmp_path / "replay.png", tmp_path / "generated.jsonl"
    s = run_json(
        capsys,
        "--conversations",
        8,
        "--metadata-only",
        "--capacity",
        50,
        "--sweep",
        "20,50",
        "--plot",
        png,
        "--save-trace",
        saved,
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    again = run_json(capsys, saved, "--metadata-only", "--capacity", 50, "--sweep", "20,50")
    assert (again["hits"], again["references"], again["sweep"]) == (s["hits"], s["references"], s["sweep"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["missing.jsonl"], "no such trace file"),
        (["BAD", "--metadata-only"], "not a Mooncake trace line"),
        (["--policy", "nope"], "unknown eviction policy 'nope'"),
        (["--policy", "lru,arc"], "--policy takes one name without --sweep"),
        (["--policy", ","], "give a policy name"),
        (["--tier", "ssd"], "--tier 'ssd': the stack has tiers gpu, host, disk"),
        (["--sweep", "10,x"], "give capacities in blocks"),
        (["--capacity", "0"], "--capacity must be at least 1"),
        (["--config", "nowhere.yaml"], "nowhere.yaml: no such file"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, argv, message):
    (tmp_path / "BAD").write_text('{"hash_ids": [1, 1]}\n')
    argv = [str(tmp_path / "BAD") if a == "BAD" else a for a in argv]
    assert main(["replay", "--conversations", "2", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier replay: ") and message in err and "Traceback" not in err
