"""A medium registered from outside kvtier (tests/helpers/ram_medium.py) is a medium like the built-in
ones: its YAML validates with its own schema and messages, a standalone stack builds its tier, routes
reach it through host memory and blocks round-trip through it bit-exact; ``kvtier doctor`` runs its own
check in its tier's place, and ``kvtier replay`` runs a trace through it with the figures a disk tier
in its place gives (tests/cli/test_replay_cli.py); unregistered, it is gone again. Registering a
second, different entry under a taken name is refused."""

from __future__ import annotations

import dataclasses
import json

import pytest

from helpers.config_helpers import error_of
from helpers.ram_medium import RAM, RamTierConfig, registered
from helpers.replay_helpers import BB, TRACE, write
from helpers.stack_helpers import LAYOUT, assert_no_leaks, blocks_for, key, load, store
from kvtier import build_stack
from kvtier.cli import main
from kvtier.core.config import load_config
from kvtier.core.media import media, medium, register_medium
from kvtier.core.routes import plan_route
from kvtier.doctor import diagnose

RAM_STACK = {
    "block_bytes": LAYOUT.block_bytes,
    "fragments": LAYOUT.num_fragments,
    "tiers": [{"medium": "host", "capacity_blocks": 2}, {"medium": "ram", "capacity_blocks": 8}],
}


@pytest.fixture
def ram():
    with registered() as entry:
        yield entry


def test_an_unregistered_medium_is_refused_with_the_known_ones():
    assert (
        error_of(RAM_STACK) == "config: tiers[1].medium: 'ram' is not a medium; allowed: gpu, host, node, disk, remote"
    )
    with registered():
        assert [m.name for m in media()] == ["gpu", "host", "node", "disk", "remote", "ram"]
    assert "ram" not in [m.name for m in media()]
    assert error_of(RAM_STACK).endswith("allowed: gpu, host, node, disk, remote")


def test_its_schema_is_its_own(ram):
    config = load_config(RAM_STACK)
    assert isinstance(config.tiers[1], RamTierConfig) and config.tier_name(1) == "ram"
    assert config.tier_eviction(1) == "adaptive"  # the last tier's default, as for any medium
    bad = {**RAM_STACK, "tiers": [RAM_STACK["tiers"][0], {"medium": "ram", "capacity_blocks": 8, "path": "/x"}]}
    assert error_of(bad).startswith("config: tiers[1].path: unknown key 'path'; allowed: medium, name, capacity")
    unsized = {**RAM_STACK, "tiers": [RAM_STACK["tiers"][0], {"medium": "ram"}]}
    assert error_of(unsized) == "config: tiers[1]: missing key 'capacity' or 'capacity_blocks'"


def test_routes_reach_it_through_host_memory(ram):
    assert plan_route("ram", "gpu") == ("ram", "host", "gpu")
    assert plan_route("disk", "ram") == ("disk", "host", "ram")
    assert plan_route("host", "ram") == ("host", "ram")


def test_blocks_round_trip_through_it_bit_exact(ram):
    stack = build_stack(load_config(RAM_STACK))
    try:
        assert [(t.name, t.medium) for t in stack.tiers] == [("host", "host"), ("ram", "ram")]
        keys = [key(i) for i in range(6)]
        assert [store(stack, keys[i : i + 2]).stored for i in (0, 2, 4)] == [2, 2, 2]
        stack.wait_idle()
        assert stack.lookup(keys).tiers == ("ram",) * 4 + ("host",) * 2  # the host tier demoted the oldest
        result, out = load(stack, keys)
        assert result.loaded == 6 and result.sources[:4] == ("ram",) * 4
        assert (out == blocks_for(keys)).all()
        assert_no_leaks(stack)
    finally:
        stack.close()


def test_the_doctor_runs_its_own_check_in_its_tiers_place(ram, tmp_path):
    path = tmp_path / "ram.yaml"
    path.write_text(json.dumps(RAM_STACK))  # (JSON is YAML)
    report = diagnose(str(path))
    assert report["ok"] and report["failed"] == []
    assert [c["name"] for c in report["checks"]] == ["config", "key secret", "tiers[1] (ram) arrays", "host memory"]
    assert report["checks"][2]["details"] == {"need_bytes": 8 * LAYOUT.block_bytes}


def test_a_replay_runs_through_it(ram, tmp_path, capsys):
    config = tmp_path / "stack.yaml"
    config.write_text(
        f"block_bytes: {BB}\ntiers:\n  - medium: host\n    capacity_blocks: 2\n"
        "  - medium: ram\n    capacity_blocks: 100\n    eviction: arc\n"
    )
    trace = write(tmp_path / "t.jsonl", TRACE, tail=0)
    argv = ["replay", str(trace), "--config", str(config), "--capacity", "4", "--policy", "lru", "--tier", "ram"]
    assert main([*argv, "--json"]) == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # the figures of tests/cli/test_replay_cli.py's disk tier in the same place
    assert (s["mode"], s["hits"], s["references"], s["stored_blocks"]) == ("stack", 7, 16, 8)
    assert s["verified_blocks"] == 7 and s["corrupt_blocks"] == 0
    ram_tier = s["tiers"]["ram"]
    assert (ram_tier["medium"], ram_tier["hits"], ram_tier["stored"], ram_tier["evicted"]) == ("ram", 4, 6, 2)


def test_a_taken_name_is_refused(ram):
    register_medium(RAM)  # the same entry again: a module imported twice
    with pytest.raises(ValueError, match="a medium named 'ram' is registered already"):
        register_medium(dataclasses.replace(RAM, event_medium=None))
    with pytest.raises(ValueError, match="a medium named 'host' is registered already"):
        register_medium(dataclasses.replace(medium("host"), event_medium=None))
    assert medium("ram") is RAM
