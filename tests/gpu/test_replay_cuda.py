"""`kvtier replay` on a GPU: the embedded stack's GPU tier in CUDA memory, the engine's buffers on the
GPU, the CUDA backend moving GPU <-> host bytes; hits come from every tier and every loaded block is
checked against what was stored (none corrupt, none failed). Skipped without CuPy, torch with CUDA
and a GPU."""

from __future__ import annotations

import json

import pytest

from kvtier.cli import main
from kvtier.transfers.cuda import cuda_available

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(
    not (cuda_available() and torch.cuda.is_available()), reason="needs CuPy, torch with CUDA and a GPU"
)


def test_replay_on_a_cuda_gpu_tier_checks_every_hit(capsys):
    assert main(["replay", "--conversations", "150", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["mode"] == "stack" and summary["hits"] > 0
    assert summary["verified_blocks"] == summary["hits"]
    assert summary["corrupt_blocks"] == 0 and summary["failed_blocks"] == 0
    tiers = summary["tiers"]
    assert all(tiers[name]["hits"] > 0 for name in ("gpu", "host", "disk")), tiers
    assert tiers["host"]["demoted"] > 0 and tiers["disk"]["stored"] > 0
