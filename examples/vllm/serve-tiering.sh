#!/usr/bin/env bash
# Serve a model with vLLM's own tiered offloading (its CPU tier and GPU <-> CPU copies), kvtier's disk tier
# below it and kvtier's adaptive policy for the CPU tier (pip install kvtier next to vLLM 0.33).
# Usage: examples/vllm/serve-tiering.sh MODEL [more vllm serve arguments]; KVTIER_TIERING names another JSON.
set -euo pipefail
config="${KVTIER_TIERING:-$(cd "$(dirname "$0")" && pwd)/tiering.json}"
exec vllm serve "${1:?usage: serve-tiering.sh MODEL [vllm serve arguments]}" "${@:2}" \
  --kv-transfer-config "$(cat "$config")"
