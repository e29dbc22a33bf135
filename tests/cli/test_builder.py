"""Building stacks from configuration: tiers, policies and watermarks as the YAML says; a GPU tier
without torch falls back to numpy stand-ins and says so; a bad config leaves nothing half-built."""

import sys

import numpy as np
import pytest

from kvtier.builder import build_stack, config_layout
from kvtier.core.config import load_config
from kvtier.core.errors import ConfigError
from kvtier.core.layout import BlockLayout
from kvtier.policies import LRUPolicy
from kvtier.tiers.gpu import gpu_tier

CONFIG = {
    "block_bytes": "8KiB",
    "fragments": 4,
    "placement": "write_through",
    "transfer": {"threads": 3},
    "tiers": [
        {"medium": "gpu", "name": "hbm", "capacity_blocks": 3},
        {"medium": "host", "capacity": "80KiB", "watermark": {"high": 0.8, "low": 0.4}},
    ],
}


def test_stack_matches_the_config():
    stack = build_stack(load_config(CONFIG))
    try:
        gpu, host = stack.tiers
        assert (gpu.name, gpu.medium, gpu.capacity) == ("hbm", "gpu", 3)
        assert (host.name, host.medium, host.capacity) == ("host", "host", 10)
        assert host.watermark.high == 0.8 and host.watermark.low == 0.4 and gpu.watermark is None
        assert isinstance(gpu.policy, LRUPolicy)
        assert gpu.storage.layout == BlockLayout((2048,) * 4)
        assert stack.placement == "write_through" and stack.transfers.backends[0].threads == 3
    finally:
        stack.close()


def test_layout_needs_block_bytes():
    with pytest.raises(ConfigError, match="block_bytes: missing"):
        config_layout(load_config({"tiers": [{"medium": "host", "capacity_blocks": 4}]}))


def test_gpu_tier_without_torch_uses_numpy_stand_ins(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` raise ImportError
    layout = BlockLayout.per_layer(2, 512)
    tier = gpu_tier("gpu", 4, layout, LRUPolicy())
    assert "numpy arrays standing in for a GPU (no torch)" in repr(tier)
    addresses = tier.storage.fragment_addresses([0, 3])
    assert addresses.shape == (2, 2)
    assert addresses[1, 0] - addresses[0, 0] == 3 * 512
    tier.close()


def test_bad_policy_path_fails_before_anything_is_built():
    bad = dict(CONFIG, tiers=[CONFIG["tiers"][0], dict(CONFIG["tiers"][1], eviction="nowhere.Policy")])
    with pytest.raises(ConfigError, match="nowhere.Policy"):
        build_stack(load_config(bad))


def test_numpy_is_enough_for_a_host_only_stack():
    stack = build_stack(load_config({"block_bytes": 1024, "tiers": [{"medium": "host", "capacity_blocks": 2}]}))
    assert stack.tiers[0].storage.device == "cpu"
    assert np.asarray(stack.tiers[0].storage.fragment_addresses([1])).item() > 0
    stack.close()
