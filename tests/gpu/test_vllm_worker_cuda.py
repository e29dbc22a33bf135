"""kvtier's vLLM worker side on CUDA without vLLM: the worker objects the connector builds, on a KV cache
of CUDA tensors laid out as vLLM 0.33 lays it out (bf16 views of one flat buffer), fed the jobs the
scheduler side plans. The KV is computed and poisoned on each rank's compute stream with nothing
synchronized before the copies start; every byte of every loaded block comes back bit-exact, and every
job reports as the scheduler expects. The bodies live in ``helpers.worker_rig``;
tests/connectors/vllm/test_worker_layouts.py runs them on CPU tensors.

Skipped where CuPy, torch with CUDA or a GPU is missing.
"""

from __future__ import annotations

import pytest

from kvtier.transfers.cuda import cuda_available

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(
    not (cuda_available() and torch.cuda.is_available()), reason="needs CuPy, torch with CUDA and a GPU"
)

from helpers.worker_rig import LAYOUTS, check_mla_shared_slab, check_round_trip, check_two_ranks  # noqa: E402


@pytest.mark.parametrize("copy_mode", ["auto", "batch", "kernel"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kv_round_trips_through_host_and_disk(tmp_path, layout, copy_mode):
    check_round_trip("cuda", layout, str(tmp_path / "disk"), copy_mode)


def test_two_ranks_with_their_own_streams_at_once(tmp_path):
    check_two_ranks("cuda", str(tmp_path / "disk"))


def test_mla_ranks_share_the_host_slab(tmp_path):
    check_mla_shared_slab("cuda", str(tmp_path / "disk"))
