#!/usr/bin/env bash
# Serve a model with SGLang 0.5.23's HiCache and kvtier as its storage backend (pip install kvtier next to SGLang).
# Usage: examples/sglang/serve.sh MODEL [more sglang.launch_server arguments]
# KVTIER_CONFIG picks the kvtier YAML (default: disk.yaml beside this script).
set -euo pipefail
config="${KVTIER_CONFIG:-$(cd "$(dirname "$0")" && pwd)/disk.yaml}"
exec python -m sglang.launch_server --model-path "${1:?usage: serve.sh MODEL [launch_server arguments]}" "${@:2}" \
  --enable-hierarchical-cache --hicache-storage-backend dynamic \
  --hicache-storage-backend-extra-config "{\"backend_name\": \"kvtier\",
    \"module_path\": \"kvtier.connectors.sglang.backend\", \"class_name\": \"KVTierStorage\",
    \"interface_v1\": 1, \"config\": \"$config\"}"
