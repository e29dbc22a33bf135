"""The worker side runs where vLLM cannot be imported: a fresh interpreter whose import system refuses
every ``vllm`` module loads ``kvtier.connectors.vllm.worker`` (and the plan and metadata types it
consumes), stores two blocks of a KV cache laid out the way vLLM 0.33 lays it out (one flat CPU
buffer, one view per layer) through host memory onto disk, loads them back from disk through other
host slots into other block ids, and finds them bit-exact, with the reports vLLM's scheduler side
would get. This file runs with or without vLLM installed (see conftest.py)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r'''
import sys

class NoVLLM:
    """A meta path finder that makes every vllm module unimportable."""

    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError(f"vLLM is not importable here ({name})")
        return None

sys.meta_path.insert(0, NoVLLM())

import time
from types import SimpleNamespace

import numpy as np
import torch

from kvtier.connectors.vllm.metadata import GPU, StepJobs, TransferJob
from kvtier.connectors.vllm.worker import WorkerSide
from kvtier.core.config import load_config
from kvtier.core.planner import copy_of

try:
    import kvtier.connectors.vllm.connector
except ImportError:
    pass
else:
    raise AssertionError("the connector imported without vLLM: the finder does not work")

PAGE, BLOCKS, LAYERS = 1024, 8, ("model.layers.0.attn", "model.layers.1.attn")
# What vLLM's KVCacheConfig says about the buffer, read by field: one tensor, layer-outer.
kv_cache_config = SimpleNamespace(
    num_blocks=BLOCKS, kv_cache_layout="LBHNC",
    kv_cache_groups=[SimpleNamespace(layer_names=list(LAYERS), kv_cache_spec=SimpleNamespace(page_size_bytes=PAGE))],
    kv_cache_tensors=[SimpleNamespace(offset=0, layers=list(LAYERS), layer_stride=PAGE * BLOCKS, block_stride=PAGE,
                                      size=PAGE * BLOCKS * len(LAYERS))])
buffer = torch.zeros(PAGE * BLOCKS * len(LAYERS), dtype=torch.uint8)
kv_caches = {name: buffer[i * PAGE * BLOCKS:(i + 1) * PAGE * BLOCKS].view(BLOCKS, PAGE)
             for i, name in enumerate(LAYERS)}
config = load_config({"tiers": [{"medium": "host", "capacity_blocks": 8},
                                {"medium": "disk", "capacity_blocks": 8, "path": sys.argv[1], "o_direct": "off"}]})
side = WorkerSide(config, kv_cache_config, rank=0, namespace="no-vllm")
side.register_kv_caches(kv_caches)

def block(b):
    return torch.cat([kv_caches[name][b] for name in LAYERS]).numpy().copy()

def run(*jobs):
    side.start(list(jobs))
    deadline = time.monotonic() + 10
    while side.in_flight():
        assert time.monotonic() < deadline, "copies did not finish"
        time.sleep(0.002)

rng = np.random.default_rng(7)
for b in (2, 5):
    for name in LAYERS:
        kv_caches[name][b] = torch.from_numpy(rng.integers(0, 256, PAGE, dtype=np.uint8))
original = [block(2), block(5)]
keys = (b"k" * 16, b"j" * 16)

def rows(src, dst):
    return [(i, keys[i], s, d) for i, (s, d) in enumerate(zip(src, dst))]

side.flush(StepJobs(flush={99}))  # a job this rank does not run: nothing to wait for
run(TransferJob(1, "store", 2, ((copy_of(GPU, "host", rows([2, 5], [0, 1])),),
                                (copy_of("host", "disk", rows([0, 1], [6, 3])),))))
buffer.zero_()
run(TransferJob(2, "load", 2, ((copy_of("disk", "host", rows([6, 3], [4, 5])),),
                               (copy_of("host", GPU, rows([4, 5], [7, 1])),)), "r", (7, 1)))
assert all(np.array_equal(a, b) for a, b in zip((block(7), block(1)), original)), "blocks came back wrong"
report = side.take_report()
assert report.finished == {1: 1, 2: 1} and not report.failed, report
assert side.take_finished_loads() == ({"r"}, set()) and side.take_load_errors() == set()
assert side.take_stats()["load_bytes"] == 2 * 2 * PAGE
side.shutdown()
assert not any(m == "vllm" or m.startswith("vllm.") for m in sys.modules)
print("round trip bit-exact without vLLM")
'''


def test_the_worker_side_round_trips_blocks_without_vllm(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "disk")], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "round trip bit-exact without vLLM" in result.stdout
