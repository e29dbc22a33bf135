"""The Grafana dashboard (examples/grafana/kvtier.json) with its ``engine`` variable on ``vllm``: every metric
it names is a series that kvtier's connector registers through vLLM's own ``KVConnectorProm``, which vLLM's
Prometheus logger builds for /metrics from the configured connector (tests/test_grafana.py reads the
dashboard and checks SGLang's side)."""

from __future__ import annotations

from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

from helpers.grafana import broken, exported_series, load_dashboard, unknown_metrics


def vllm_registry(vllm_config) -> CollectorRegistry:
    """A fresh registry with what vLLM registers for kvtier's connector (vLLM's global one would refuse the
    same names twice in one process), under the labels vLLM's Prometheus logger gives it."""
    registry = CollectorRegistry()

    class PromOnTestRegistry(KVConnectorProm):
        _gauge_cls = partial(Gauge, registry=registry)
        _counter_cls = partial(Counter, registry=registry)
        _histogram_cls = partial(Histogram, registry=registry)

    PromOnTestRegistry(vllm_config, ["model_name", "engine"], {0: ["tiny", "0"]})
    return registry


def test_every_metric_the_dashboard_names_is_one_vllm_serves(make_config):
    registry = vllm_registry(make_config({"tiers": [{"medium": "host", "capacity_blocks": 8}]}))
    assert "vllm:kvtier_hit_blocks_total" in exported_series(registry)  # the connector's counters are there
    assert unknown_metrics(load_dashboard(), "vllm", registry) == set()
    assert unknown_metrics(broken("unknown metric"), "vllm", registry) == {"vllm:kvtier_bogus_total"}
