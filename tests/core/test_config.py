"""The YAML schema: valid configs load, and every mistake raises one ConfigError naming key, value and fix.

Each error test asserts the three things a user needs to fix a config without reading the source:
where (the key path), what (the offending value) and what would be accepted.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest

from helpers.config_helpers import error_of
from kvtier.core.config import StackConfig, capacity_in_blocks, default_config_path, eviction_policy, load_config
from kvtier.core.errors import ConfigError
from kvtier.core.sizes import parse_size
from kvtier.tiers.gpu import GpuTierConfig
from kvtier.tiers.host import HostTierConfig

REPO = Path(__file__).resolve().parents[2]

VALID = {
    "block_tokens": 16,
    "block_bytes": "256KiB",
    "fragments": 4,
    "tiers": [
        {"medium": "gpu", "capacity_blocks": 8},
        {"medium": "host", "capacity": "64MiB", "eviction": "lru", "watermark": {"high": 0.9, "low": 0.5}},
    ],
    "placement": "write_through",
}


def with_changes(**top) -> dict:
    cfg = copy.deepcopy(VALID)
    cfg.update(top)
    return cfg


# --- valid configs ---------------------------------------------------------------------------


def test_loads_from_dict():
    cfg = load_config(VALID)
    assert isinstance(cfg, StackConfig)
    assert cfg.block_bytes == 256 * 1024
    assert isinstance(cfg.tiers[0], GpuTierConfig) and isinstance(cfg.tiers[1], HostTierConfig)
    assert cfg.tiers[1].capacity == 64 * 1024**2
    assert cfg.tiers[1].watermark.high == 0.9
    assert cfg.placement == "write_through"
    assert cfg.transfer.threads == 2
    assert [cfg.tier_name(i) for i in range(2)] == ["gpu", "host"]
    assert capacity_in_blocks(cfg.tiers[0], cfg.block_bytes) == 8
    assert capacity_in_blocks(cfg.tiers[1], cfg.block_bytes) == 256


def test_loads_from_file(tmp_path):
    path = tmp_path / "kvtier.yaml"
    path.write_text(
        "block_tokens: 32\n"
        "tiers:\n"
        "  - medium: gpu          # engine-owned\n"
        "  - medium: host\n"
        "    name: pinned\n"
        "    capacity: 1.5GiB\n"
        "    watermark: {high: 1, low: 0.5}\n"
        "transfer: {threads: 4}\n"
    )
    for source in (path, str(path)):
        cfg = load_config(source)
        assert cfg.block_tokens == 32
        assert cfg.tiers[0].capacity is None and cfg.tiers[0].capacity_blocks is None
        assert capacity_in_blocks(cfg.tiers[0], 1024) is None
        assert cfg.tiers[1].capacity == 3 * 1024**3 // 2
        assert cfg.tier_name(1) == "pinned"
        assert cfg.placement == "write_back"
        assert cfg.transfer.threads == 4


def test_defaults():
    cfg = load_config({"tiers": [{"medium": "host", "capacity_blocks": 4}]})
    assert (cfg.block_tokens, cfg.block_bytes, cfg.fragments, cfg.namespace) == (16, None, 1, "")
    assert cfg.tier_eviction(0) == "adaptive" and cfg.tiers[0].watermark is None
    assert cfg.tiers[0].eviction is None  # the default is the config's answer, not written into the model


def test_default_eviction_depends_on_the_tier_place():
    """Upper tiers only demote what they evict (LRU measured best); the last tier's evictions leave
    the stack (the prefix-ordered S3-FIFO measured best). A given policy is kept anywhere."""
    cfg = load_config(
        {
            "tiers": [
                {"medium": "gpu", "capacity_blocks": 4},
                {"medium": "host", "capacity_blocks": 8},
                {"medium": "disk", "capacity_blocks": 16, "path": "/tmp/x"},
            ]
        }
    )
    assert [cfg.tier_eviction(i) for i in range(3)] == ["lru", "lru", "adaptive"]
    cfg = load_config(
        {
            "tiers": [
                {"medium": "host", "capacity_blocks": 8, "eviction": "arc"},
                {"medium": "disk", "capacity_blocks": 16, "path": "/tmp/x", "eviction": "lru"},
            ]
        }
    )
    assert [cfg.tier_eviction(i) for i in range(2)] == ["arc", "lru"]


def test_default_config_loads():
    path = default_config_path()
    assert path.name == "default.yaml" and path.is_file()
    cfg = load_config(path)
    assert cfg.block_tokens == 16 and cfg.block_bytes == 256 * 1024 and cfg.fragments == 4
    assert [t.medium for t in cfg.tiers] == ["gpu", "host"]
    assert cfg.tiers[0].capacity_blocks == 64
    assert (cfg.tiers[0].watermark.high, cfg.tiers[0].watermark.low) == (0.9, 0.7)
    assert cfg.tiers[1].capacity == 64 * 1024**2
    assert cfg.placement == "write_back"


NOT_STACKS = {"node.yaml", "daemonset.yaml"}
"""The node daemon's YAML and a Kubernetes manifest (tests/tiers/node/test_node_examples.py loads them)."""


@pytest.mark.parametrize(
    "path",
    sorted(p for p in (REPO / "examples").rglob("*.yaml") if p.name not in NOT_STACKS),
    ids=lambda p: str(p.relative_to(REPO / "examples")),
)
def test_every_example_loads(path):
    load_config(path)


def test_examples_exist():
    assert (REPO / "examples" / "standalone.yaml").is_file()


# --- sizes -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("512B", 512),
        ("1KB", 10**3),
        ("2MB", 2 * 10**6),
        ("3GB", 3 * 10**9),
        ("4TB", 4 * 10**12),
        ("1KiB", 1024),
        ("2MiB", 2 * 1024**2),
        ("3GiB", 3 * 1024**3),
        ("4TiB", 4 * 1024**4),
        ("8gib", 8 * 1024**3),
        ("8 GiB", 8 * 1024**3),
        ("512 mb", 512 * 10**6),
        ("1.5GiB", 3 * 1024**3 // 2),
        ("0.5KiB", 512),
        (".5KiB", 512),
        ("4096", 4096),
        (4096, 4096),
    ],
)
def test_parse_size_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["8 GX", "GiB", "1.2.3GiB", "-1GiB", "8 G", "", [8], 1.5, None, True])
def test_parse_size_rejects_non_sizes(bad):
    with pytest.raises(ConfigError, match="is not a size: use a number with a unit.*KiB, MiB, GiB, TiB"):
        parse_size(bad)


@pytest.mark.parametrize(
    "bad, words",
    [
        (0, "positive"),
        (-5, "positive"),
        ("0GiB", "positive"),
        ("1.5B", "whole number of bytes"),
        ("0.0001KB", "whole number"),
    ],
)
def test_parse_size_rejects_zero_negative_and_fractions(bad, words):
    with pytest.raises(ConfigError, match=words):
        parse_size(bad)


# --- one test per kind of mistake -------------------------------------------------------------


def test_bad_size_names_path_value_and_units(tmp_path):
    path = tmp_path / "kvtier.yaml"
    path.write_text("tiers:\n  - medium: gpu\n  - medium: host\n    capacity: 8 GX\n")
    msg = error_of(path)
    assert msg == (
        f"{path}: tiers[1].capacity: '8 GX' is not a size: use a number with a unit, "
        f"e.g. 512MiB or 8GiB (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
    )


def test_unknown_key_lists_allowed_keys():
    cfg = with_changes(tiers=[{"medium": "host", "capcity": "1GiB"}])
    msg = error_of(cfg)
    assert (
        "tiers[0].capcity: unknown key 'capcity'; allowed: medium, name, capacity, capacity_blocks, eviction, watermark"
    ) in msg


def test_unknown_top_level_and_nested_keys():
    assert "bogus: unknown key 'bogus'; allowed: block_tokens, block_bytes, fragments" in error_of(
        with_changes(bogus=1)
    )
    cfg = with_changes(tiers=[{"medium": "host", "capacity": "1GiB", "watermark": {"hi": 0.9}}])
    assert "tiers[0].watermark.hi: unknown key 'hi'; allowed: high, low" in error_of(cfg)


def test_missing_host_capacity():
    msg = error_of({"tiers": [{"medium": "gpu"}, {"medium": "host"}]})
    assert "tiers[1]: missing key 'capacity' or 'capacity_blocks'" in msg


def test_both_capacities_refused():
    msg = error_of({"tiers": [{"medium": "host", "capacity": "1GiB", "capacity_blocks": 3}]})
    assert "tiers[0]:" in msg and "capacity or capacity_blocks, not both" in msg and "1GiB" in msg


def test_missing_tiers_and_empty_tiers():
    assert "missing key 'tiers'" in error_of({"block_tokens": 16})
    msg = error_of({"tiers": []})
    assert "tiers:" in msg and "at least 1" in msg


def test_unknown_medium_lists_allowed_media():
    msg = error_of({"tiers": [{"medium": "host", "capacity": "1GiB"}, {"medium": "tape", "path": "/tmp"}]})
    assert "tiers[1].medium: 'tape' is not a medium; allowed: gpu, host, node, disk" in msg


def test_missing_medium():
    msg = error_of({"tiers": [{"capacity": "1GiB"}]})
    assert "tiers[0]: missing key 'medium'" in msg and "gpu, host" in msg


def test_tier_entry_not_a_mapping():
    msg = error_of({"tiers": ["host"]})
    assert "tiers[0]:" in msg and "'host'" in msg and "mapping" in msg


def test_unknown_eviction_policy():
    msg = error_of({"tiers": [{"medium": "host", "capacity": "1GiB", "eviction": "lfu"}]})
    assert "tiers[0].eviction:" in msg and "'lfu'" in msg and "lru" in msg


def test_eviction_dotted_path_that_cannot_load():
    msg = error_of({"tiers": [{"medium": "host", "capacity": "1GiB", "eviction": "no_such_pkg.mod.Policy"}]})
    assert "tiers[0].eviction:" in msg and "no_such_pkg.mod.Policy" in msg


def test_a_policy_a_config_names_that_cannot_be_used_is_a_config_error_with_the_policy_message():
    """What builds tiers from a config (the builder, the vLLM scheduler side) gets a ConfigError, whose
    message is the policy lookup's own."""
    with pytest.raises(ConfigError, match="^unknown eviction policy 'fifo'; use one of .*lru"):
        eviction_policy("fifo")
    with pytest.raises(ConfigError, match="^eviction policy 'no_such_pkg.mod.Policy' cannot be loaded"):
        eviction_policy("no_such_pkg.mod.Policy")


def test_watermark_order():
    msg = error_of({"tiers": [{"medium": "host", "capacity": "1GiB", "watermark": {"high": 0.5, "low": 0.9}}]})
    assert "tiers[0].watermark:" in msg and "0 < low < high <= 1" in msg and "high=0.5" in msg and "low=0.9" in msg


@pytest.mark.parametrize(
    "key, value, words",
    [
        ("placement", "write_bak", "'write_bak' is not allowed; allowed: write_through, write_back"),
        ("block_tokens", 0, "block_tokens: 0 is too small; must be greater than 0"),
        ("block_tokens", "16", "block_tokens: expected an integer, got '16'"),
        ("fragments", 0, "fragments: 0 is too small; must be at least 1"),
        ("transfer", {"threads": 0}, "transfer.threads: 0 is too small; must be at least 1"),
        ("namespace", 5, "namespace: expected a string, got 5"),
        ("block_bytes", "lots", "block_bytes: 'lots' is not a size"),
    ],
)
def test_bad_scalar_values(key, value, words):
    assert words in error_of(with_changes(**{key: value}))


def test_fragments_must_divide_block_bytes():
    msg = error_of(with_changes(fragments=3))
    assert "fragments:" in msg and "3 equal fragments" in msg and "256KiB" in msg


def test_duplicate_tier_names():
    msg = error_of(
        {"tiers": [{"medium": "gpu", "name": "fast"}, {"medium": "host", "capacity": "1GiB", "name": "fast"}]}
    )
    assert "tiers[1].name: 'fast' is already the name of tiers[0]" in msg and "unique" in msg


def test_one_tier_per_medium():
    msg = error_of(
        {"tiers": [{"medium": "host", "capacity": "1GiB"}, {"medium": "host", "capacity": "2GiB", "name": "other"}]}
    )
    assert "tiers[1].medium: a second 'host' tier" in msg and "at most one tier per medium" in msg


def test_gpu_only_first():
    msg = error_of({"tiers": [{"medium": "host", "capacity": "1GiB"}, {"medium": "gpu"}]})
    assert "tiers[1].medium: a gpu tier may only be the first tier" in msg


def test_capacity_must_hold_one_block():
    msg = error_of(with_changes(tiers=[{"medium": "host", "capacity": "100KiB"}]))
    assert "tiers[0].capacity: 100KiB" in msg and "holds no block" in msg and "at least 256KiB" in msg


def test_several_mistakes_in_one_message():
    msg = error_of(with_changes(block_tokens=0, placement="nope", bogus=1))
    lines = msg.splitlines()
    assert len(lines) == 3 and all(line.startswith("config: ") for line in lines)


# --- files ----------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    msg = error_of(tmp_path / "nope.yaml")
    assert "nope.yaml" in msg and "no such file" in msg


def test_directory_is_not_a_file(tmp_path):
    assert "is a directory" in error_of(tmp_path)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file(tmp_path):
    path = tmp_path / "secret.yaml"
    path.write_text("tiers: []\n")
    path.chmod(0)
    assert "cannot be read" in error_of(path)


def test_not_utf8(tmp_path):
    path = tmp_path / "bin.yaml"
    path.write_bytes(b"\xff\xfe\x00")
    assert "not UTF-8" in error_of(path)


def test_yaml_syntax_error_gives_line(tmp_path):
    path = tmp_path / "kvtier.yaml"
    path.write_text("tiers:\n  - medium: host\n    capacity: 1GiB\n   eviction: lru\n")
    msg = error_of(path)
    assert str(path) in msg and "line 4" in msg and "YAML syntax error" in msg


def test_duplicate_yaml_key_refused(tmp_path):
    path = tmp_path / "kvtier.yaml"
    path.write_text("block_tokens: 16\ntiers: [{medium: host, capacity: 1GiB}]\nblock_tokens: 32\n")
    msg = error_of(path)
    assert "line 3" in msg and "duplicate key 'block_tokens'" in msg and "line 1" in msg


@pytest.mark.parametrize(
    "text, words",
    [
        ("", "empty"),
        ("- medium: host\n", "top level must be a mapping"),
        ("just a string\n", "top level must be a mapping"),
    ],
)
def test_top_level_not_a_mapping(tmp_path, text, words):
    path = tmp_path / "kvtier.yaml"
    path.write_text(text)
    assert words in error_of(path)


def test_yaml_text_is_not_a_path():
    assert "not YAML text" in error_of("tiers:\n  - medium: host\n")


def test_other_source_types_refused():
    assert "got int" in error_of(5)


@pytest.mark.parametrize("name", ["misses", "all"])
def test_a_tier_name_the_miss_counts_use_is_refused(name):
    message = error_of({"tiers": [{"medium": "host", "name": name, "capacity": "1MiB"}]})
    assert f"'{name}' is the " in message and "pick another tier name" in message
