"""kvtier as a vLLM KV connector: ``kv_connector_module_path="kvtier.connectors.vllm"``,
``kv_connector="KVTierConnector"``. Importing this package needs vLLM; the rest of kvtier does not."""

from kvtier.connectors.vllm.connector import KVTierConnector

__all__ = ["KVTierConnector"]
