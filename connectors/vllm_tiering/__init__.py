"""kvtier inside vLLM's own tiered offloading (``TieringOffloadingSpec``, vLLM 0.33): kvtier's disk, remote
and node tiers as vLLM secondary tiers, and kvtier's adaptive policy as the CPU tier's eviction.

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8589934592,
        "eviction_policy": "KVTierAdaptive", "cache_policy_module_path": "kvtier.connectors.vllm_tiering",
        "secondary_tiers": [{"type": "KVTierDisk", "module_path": "kvtier.connectors.vllm_tiering",
                             "path": "/var/cache/kvtier", "capacity": "500GiB"}]}}'

vLLM's factories take each class by name from this package (``getattr``), so the names are imported
on first use: importing the package needs no vLLM.
"""

from __future__ import annotations

import importlib
from typing import Any

_CLASSES = {
    "KVTierDisk": "kvtier.connectors.vllm_tiering.tiers",
    "KVTierRemote": "kvtier.connectors.vllm_tiering.tiers",
    "KVTierNode": "kvtier.connectors.vllm_tiering.tiers",
    "KVTierAdaptive": "kvtier.connectors.vllm_tiering.policy",
}

__all__ = sorted(_CLASSES)


def __getattr__(name: str) -> Any:
    """The class vLLM's factory asks for, from its module, on first use."""
    module = _CLASSES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
