#!/usr/bin/env bash
# Install vLLM 0.33.0 for kvtier's connector tests on a machine without a GPU, into the venv given as $1.
#
# A plain `pip install vllm==0.33.0` cannot resolve (it wants a certifi newer than the registry serves and
# torch 2.14 with ~30 CUDA packages), so this is the measured recipe instead: the CPU build of torch,
# vLLM and xgrammar without their dependencies, then the pure-Python packages vLLM's scheduler and
# connector paths import (requirements/vllm-cpu.txt). vLLM's CUDA extensions do not load, so no model
# runs with this install; vLLM's Scheduler, BlockPool and KVConnectorFactory do. `pip check` complains
# by design. Users do not need this: they install kvtier next to their own vLLM.
set -euo pipefail
venv="${1:?usage: scripts/install-vllm-cpu.sh VENV_DIR}"
here="$(cd "$(dirname "$0")/.." && pwd)"
pip=("$venv/bin/python" -m pip install -q)
# torch==2.13.0 is the CPU build only where pip's settings point at one (as on kvtier's CI machines);
# elsewhere set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu to get it from PyTorch's CPU index.
"${pip[@]}" torch==2.13.0 ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"}
"${pip[@]}" --no-deps vllm==0.33.0 xgrammar==0.2.8
"${pip[@]}" -r "$here/requirements/vllm-cpu.txt"
VLLM_TARGET_DEVICE=cpu CUDA_VISIBLE_DEVICES="" "$venv/bin/python" -c \
  "import vllm; from vllm.v1.core.sched.scheduler import Scheduler; print('vllm', vllm.__version__, 'ready')"
