"""kvtier as a vLLM KV connector: ``kv_connector_module_path="kvtier.connectors.vllm"``,
``kv_connector="KVTierConnector"``.

Only the connector class needs vLLM, and it is imported when first asked for: the worker side
(``worker.py``) and what it consumes (``metadata.py``, ``geometry.py``) import without vLLM, so the
real worker code runs where vLLM cannot be installed. The rest of kvtier never needs vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.connectors.vllm.connector import KVTierConnector

__all__ = ["KVTierConnector"]


def __getattr__(name: str):
    """``KVTierConnector`` on first use (vLLM's factory takes it with getattr from this package)."""
    if name == "KVTierConnector":
        from kvtier.connectors.vllm.connector import KVTierConnector

        return KVTierConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
