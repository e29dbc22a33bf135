"""`kvtier replay --engines N --split ... [--node]`: a trace across engines with private tiers, or through a
real node daemon (its own socket and slab, serving in the command's process), figures worked out by hand.

- routing: round robin; by session (the generator's conversations; a trace's first block otherwise);
- private tiers get 1/N of each tier's capacity; the engines' counts add up to the summary's;
- through a node daemon, one engine's blocks are another's hits: a prefix stored by engine 0 is a hit
  for engine 1 (round robin), which private tiers can never give; every hit checked bit-exact;
- with --node and N > 1 the private split is reported too (``private``, ``hit_gain`` >= 1 here);
- --node on a stack whose last tier is not a host tier, and --node with --metadata-only, exit 2 with
  one line.
"""

from __future__ import annotations

import json
import os

import pytest

from helpers.replay_helpers import write
from kvtier.cli import main
from kvtier.replay.routing import route
from kvtier.replay.trace import Request
from kvtier.replay.workload import ChatWorkload, generate


def config(tmp_path, capacity: int = 8, **extra) -> str:
    path = tmp_path / "stack.yaml"
    tiers = [{"medium": "host", "capacity_blocks": capacity, "eviction": "lru"}]
    path.write_text(json.dumps({"block_tokens": 512, "block_bytes": 4096, "tiers": tiers, **extra}))
    return str(path)


def run_json(capsys, *argv) -> dict:
    assert main(["replay", *map(str, argv), "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_round_robin_and_sessions_route_as_said():
    requests = [Request(0, 0, 0, (i,), session) for i, session in enumerate([7, 8, 7, 9, 8, 7])]
    assert route(requests, 2, "round_robin") == [0, 1, 0, 1, 0, 1]
    assert route(requests, 2, "session") == [0, 1, 0, 0, 1, 0]  # sessions 7, 8, 9 given out in turn
    by_first_block = [Request(0, 0, 0, ids) for ids in [(1, 2), (3,), (1, 5), (4,), (3, 9)]]
    assert route(by_first_block, 3, "session") == [0, 1, 0, 2, 1]
    chat = generate(ChatWorkload(conversations=30, seed=3))
    engine_of = route(chat, 4, "session")
    for conversation in {r.session for r in chat}:
        assert len({e for r, e in zip(chat, engine_of, strict=True) if r.session == conversation}) == 1
    drawn = route(chat, 3, "random", seed=5)
    assert drawn == route(chat, 3, "random", seed=5) != route(chat, 3, "random", seed=6)
    assert set(drawn) == {0, 1, 2}
    with pytest.raises(ValueError, match="unknown routing"):
        route(chat, 2, "prefix_gpu")  # (it needs the engines' events)


def test_private_engines_split_the_capacity_and_add_up(tmp_path, capsys):
    # Two engines, round robin, 4 blocks each: [1,2] to 0, [1,2] to 1 (a miss: engine 1 never saw it),
    # [1,2] to 0 (a hit of 2), [1,2] to 1 (a hit of 2).
    trace = write(tmp_path / "t.jsonl", [[1, 2]] * 4)
    s = run_json(capsys, trace, "--config", config(tmp_path), "--engines", 2)
    assert [e["hits"] for e in s["engines"]] == [2, 2]
    assert (s["hits"], s["references"], s["corrupt_blocks"]) == (4, 8, 0)
    assert s["tiers"]["host"]["capacity"] == 8  # 4 + 4: the same memory as one engine's
    assert s["split"] == "round_robin" and s["node"] is False


def test_through_a_node_daemon_one_engines_blocks_are_anothers_hits(tmp_path, capsys):
    trace = write(tmp_path / "t.jsonl", [[1, 2]] * 4)
    s = run_json(capsys, trace, "--config", config(tmp_path), "--engines", 2, "--node")
    assert [e["hits"] for e in s["engines"]] == [2, 4]  # engine 1's first request hits engine 0's blocks
    assert (s["hits"], s["verified_blocks"], s["corrupt_blocks"], s["failed_blocks"]) == (6, 6, 0, 0)
    assert s["tiers"]["host"]["medium"] == "node" and s["tiers"]["host"]["capacity"] == 8
    assert s["private"]["hits"] == 4 and s["hit_gain"] == pytest.approx(6 / 4)
    ours = f"kvtier-replay-{os.getpid()}-"  # (other tests, running at once, may hold slabs of their own)
    assert not [name for name in os.listdir("/dev/shm") if name.startswith(ours)]  # the daemon's slab is gone with it


@pytest.mark.parametrize("split", ["round_robin", "session"])
def test_the_node_tier_is_never_below_private_tiers_of_the_same_memory(tmp_path, capsys, split):
    s = run_json(
        capsys, "--conversations", 60, "--config", config(tmp_path, 400), "--engines", 4, "--split", split, "--node"
    )
    assert s["corrupt_blocks"] == 0 and s["failed_blocks"] == 0
    assert s["hit_gain"] >= 1.0
    assert len(s["engines"]) == 4 and sum(e["hits"] for e in s["engines"]) == s["hits"]


def test_node_needs_a_host_tier_last_and_a_real_stack(tmp_path, capsys):
    path = tmp_path / "disk.yaml"
    path.write_text(
        json.dumps(
            {
                "block_bytes": 4096,
                "tiers": [
                    {"medium": "host", "capacity_blocks": 4},
                    {"medium": "disk", "path": str(tmp_path / "d"), "capacity_blocks": 8},
                ],
            }
        )
    )
    assert main(["replay", "--conversations", "5", "--config", str(path), "--node"]) == 2
    assert "--node: the config's last tier is disk; it must be a host tier" in capsys.readouterr().err
    assert main(["replay", "--conversations", "5", "--metadata-only", "--node"]) == 2
    assert "leave out --metadata-only" in capsys.readouterr().err
    assert main(["replay", "--conversations", "5", "--engines", "0"]) == 2
    assert "--engines must be at least 1" in capsys.readouterr().err
