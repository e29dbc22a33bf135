"""The whole stack on a GPU: a CUDA GPU tier over pinned host memory over disk, driven through the
public API with CUDA tensors; every block still present comes back bit-exact after evictions and
demotions, and the CUDA backend is what moved the GPU <-> host bytes."""

from __future__ import annotations

import pytest

from kvtier import KVTier
from kvtier.transfers.cuda import cuda_available

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(
    not (cuda_available() and torch.cuda.is_available()), reason="needs CuPy, torch with CUDA and a GPU"
)

BLOCK = 256 * 1024


def config(tmp_path, copy_mode):
    return {
        "block_tokens": 16,
        "block_bytes": "256KiB",
        "fragments": 8,
        "namespace": "gpu-test",
        "transfer": {"cuda_copy": copy_mode},
        "tiers": [
            {"medium": "gpu", "capacity_blocks": 32, "watermark": {"high": 0.9, "low": 0.6}},
            {"medium": "host", "capacity_blocks": 64},
            {"medium": "disk", "path": str(tmp_path / "disk"), "capacity": "128MiB"},
        ],
    }


@pytest.mark.parametrize("copy_mode", ["auto", "batch", "kernel"])
def test_blocks_round_trip_through_gpu_host_and_disk(tmp_path, copy_mode):
    generator = torch.Generator(device="cuda").manual_seed(3)
    prompts = [list(range(p * 10_000, p * 10_000 + 16 * 8)) for p in range(24)]  # 24 prompts of 8 blocks
    data = [torch.randint(0, 256, (8, BLOCK), dtype=torch.uint8, device="cuda", generator=generator) for _ in prompts]
    with KVTier.open(config(tmp_path, copy_mode)) as kv:
        assert kv.stack.transfers.backends[0].name == "cuda"
        assert "CUDA device" in kv.describe()
        for tokens, blocks in zip(prompts, data, strict=True):
            assert kv.store(tokens, blocks).result(60).stored == 8
        kv.wait_idle()
        present = 0
        for tokens, blocks in zip(prompts, data, strict=True):
            hits = kv.lookup(tokens)
            out = torch.zeros_like(blocks)
            result = kv.load(tokens, out).result(60)
            assert result.failed == [] and result.loaded == hits
            assert torch.equal(out[:hits], blocks[:hits])
            present += hits
        assert present == 24 * 8, "gpu + host + disk hold every block"
        stats = kv.stats()
        assert stats["disk"]["committed"] > 0 and stats["host"]["demoted"] > 0
        cuda = kv.stack.transfers.backends[0]
        assert sum(cuda.jobs_by_method.values()) > 0 and not cuda.jobs_by_method["batch_refused"]
