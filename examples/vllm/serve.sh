#!/usr/bin/env bash
# Serve a model with kvtier as vLLM's KV connector (pip install kvtier next to vLLM 0.33).
# Usage: examples/vllm/serve.sh MODEL [more vllm serve arguments]
set -euo pipefail
config="${KVTIER_CONFIG:-$(cd "$(dirname "$0")" && pwd)/kvtier.yaml}"
exec vllm serve "${1:?usage: serve.sh MODEL [vllm serve arguments]}" "${@:2}" \
  --kv-transfer-config "{\"kv_connector\": \"KVTierConnector\", \"kv_connector_module_path\": \"kvtier.connectors.vllm\",
                         \"kv_role\": \"kv_both\", \"kv_connector_extra_config\": {\"config\": \"$config\"}}"
