"""How vLLM finds and configures the connector: by module path through its own KVConnectorFactory,
with the kvtier configuration from ``kv_connector_extra_config["config"]``; mistakes are clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvtier.connectors.vllm import KVTierConnector
from kvtier.connectors.vllm.connector import connector_config
from kvtier.connectors.vllm.geometry import tier_slots
from kvtier.core.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "vllm" / "kvtier.yaml"


def scheduler_connector(make_config, kv_config, kvtier):
    return KVConnectorFactory.create_connector(make_config(kvtier), KVConnectorRole.SCHEDULER, kv_config(32))


def test_loaded_by_module_path_from_a_yaml_file(make_config, kv_config, tmp_path):
    path = tmp_path / "kvtier.yaml"
    path.write_text("tiers:\n  - medium: host\n    capacity: 64KiB\n")
    connector = scheduler_connector(make_config, kv_config, str(path))
    assert isinstance(connector, KVTierConnector) and connector.worker_side is None
    assert connector.scheduler_side.tier("host").capacity == 32  # 64 KiB of 2 KiB blocks (2 layers x 1 KiB pages)


def test_example_config_is_valid_and_sized_per_rank(make_config):
    config = connector_config(make_config(str(EXAMPLE)))
    block = 32 * 2 * 16 * 8 * 128 * 2  # one rank's block of Llama-3.1-8B, bf16, 16 tokens: 32 layers, K and V
    assert [(name, n) for name, _, n in tier_slots(config, block)] == [
        ("host", 48 * 1024 // 2),
        ("disk", 400 * 2**30 // (block + 4096)),
    ]


@pytest.mark.parametrize(
    "extra, message",
    [
        ({}, 'needs "config"'),
        ({"config": {"block_tokens": 32, "tiers": [{"medium": "host", "capacity_blocks": 4}]}}, "block size 16"),
        ({"config": {"tiers": [{"medium": "disk", "path": "/tmp/x", "capacity_blocks": 4}]}}, "must be a host tier"),
        ({"config": {"tiers": [{"medium": "host", "capacity": "1KiB"}]}}, "holds no block"),
    ],
)
def test_bad_configuration_is_a_clear_error(make_config, kv_config, extra, message):
    vllm_config = make_config({})
    vllm_config.kv_transfer_config.kv_connector_extra_config = extra
    with pytest.raises(ConfigError, match=message):
        KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.SCHEDULER, kv_config(32))


@pytest.mark.parametrize("name", ["decode_context_parallel_size", "prefill_context_parallel_size"])
def test_context_parallelism_is_refused_at_start(make_config, kv_config, name):
    """Context-parallel ranks each hold every other token of a block: kvtier's keys cannot name that."""
    vllm_config = make_config({"tiers": [{"medium": "host", "capacity_blocks": 4}]})
    setattr(vllm_config.parallel_config, name, 2)
    with pytest.raises(ConfigError, match=f"context parallelism \\({name}=2\\)"):
        KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.SCHEDULER, kv_config(32))
