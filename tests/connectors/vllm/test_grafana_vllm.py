"""The Grafana dashboard (examples/grafana/kvtier.json) with its ``engine`` variable on ``vllm``: every metric
it names is a series that kvtier's connector registers through vLLM's own ``KVConnectorProm``, which vLLM's
Prometheus logger builds for /metrics from the configured connector (tests/test_grafana.py reads the
dashboard and checks SGLang's side)."""

from __future__ import annotations

from helpers.grafana import broken, exported_series, load_dashboard, unknown_metrics


def test_every_metric_the_dashboard_names_is_one_vllm_serves(make_config, prometheus):
    registry, _ = prometheus(make_config({"tiers": [{"medium": "host", "capacity_blocks": 8}]}))
    assert "vllm:kvtier_hit_blocks_total" in exported_series(registry)  # the connector's counters are there
    assert unknown_metrics(load_dashboard(), "vllm", registry) == set()
    assert unknown_metrics(broken("unknown metric"), "vllm", registry) == {"vllm:kvtier_bogus_total"}
