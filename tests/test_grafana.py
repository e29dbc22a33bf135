"""The Grafana dashboard (examples/grafana/kvtier.json) queries only what kvtier exports (issue 30).

A dashboard rots silently: a counter is renamed and its panel goes blank without an error anywhere. So
every PromQL expression in it (the panels' targets, through rows, and the variables' queries) is read for
the metric names it selects, once for each engine its ``engine`` variable offers, and each name must be a
series of a live registry holding kvtier's counters as that engine exports them. Here: SGLang's, made by
``kvtier.connectors.sglang.metrics`` in a process of its own in prometheus_client's multiprocess mode (as
in SGLang's scheduler) and collected as SGLang's /metrics collects them; the node daemon's row against a
real daemon's registry (``kvtier.node_metrics``) with an engine connected. vLLM's are checked in
tests/connectors/vllm/test_grafana_vllm.py, through vLLM's own ``KVConnectorProm``, with the same
checker (tests/helpers/grafana.py).
The panels must also say what they show (a title), query the dashboard's data source variable, and use
only variables the dashboard defines. Broken copies of the dashboard show that each check catches its fault.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest

from helpers.grafana import (
    broken,
    dashboard_metrics,
    engines,
    exported_series,
    layout_problems,
    load_dashboard,
    metric_names,
    node_metrics,
    panels,
    unknown_metrics,
    variables,
)


@pytest.fixture(scope="module")
def sglang_registry(tmp_path_factory):
    """kvtier's counters as SGLang serves them: made in another process by the metrics module SGLang's
    scheduler runs (multiprocess mode is fixed when prometheus_client is imported), read back through
    prometheus_client's MultiProcessCollector into a fresh registry, as SGLang's /metrics reads them."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    directory = tmp_path_factory.mktemp("prometheus-multiproc")
    make = "from kvtier.connectors.sglang.metrics import StorageCounters\nStorageCounters(tp_rank=0, block_bytes=4096)"
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory)}
    subprocess.run([sys.executable, "-c", make], env=env, check=True, timeout=120)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    return registry


@pytest.fixture(scope="module")
def node_registry(tmp_path_factory):
    """The node daemon's series as ``kvtier node serve --metrics-port`` serves them: a daemon of this test's,
    one engine connected (per-engine series exist only for connected engines)."""
    import threading
    import uuid

    from prometheus_client import CollectorRegistry

    from kvtier.node_config import load_node_config
    from kvtier.node_daemon import NodeDaemon
    from kvtier.node_metrics import NodeCollector
    from kvtier.tiers.node.client import NodeClient

    directory = tmp_path_factory.mktemp("node")
    slab = f"/dev/shm/kvtier-test-{uuid.uuid4().hex[:12]}"
    config = {
        "node": {"socket": str(directory / "n.sock"), "slab": slab},
        "block_bytes": 4096,
        "tiers": [{"medium": "host", "capacity_blocks": 8}],
    }
    daemon = NodeDaemon(load_node_config(config))
    serving = threading.Thread(target=daemon.serve, daemon=True)
    serving.start()
    client = NodeClient(config["node"]["socket"], 5.0)
    client.open()
    registry = CollectorRegistry()
    registry.register(NodeCollector(daemon))
    try:
        yield registry
    finally:
        client.close()
        daemon.request_stop()
        serving.join()
        daemon.stop()
        os.unlink(slab)


def test_the_engine_variable_offers_vllm_and_sglang():
    dashboard = load_dashboard()
    assert engines(dashboard) == ["vllm", "sglang"]
    assert [option["value"] for option in variables(dashboard)["engine"]["options"]] == ["vllm", "sglang"]


def test_every_panel_has_a_title_the_datasource_and_defined_variables():
    assert layout_problems(load_dashboard()) == []


def test_the_dashboard_shows_hits_traffic_failures_and_miss_reasons():
    dashboard = load_dashboard()
    titles = {panel["title"]: panel for panel in panels(dashboard)}
    rows = [panel["title"] for panel in panels(dashboard) if panel["type"] == "row"]
    assert rows == ["Hits", "Traffic", "Failures", "Miss reasons", "Node daemon"]
    explained = titles["Miss reasons"]["options"]["content"]  # (the row's text panel)
    assert all(f"`{reason}`" in explained for reason in ("never_stored", "evicted", "partial_block"))
    by_tier = titles["Misses per second by reason and tier"]["targets"][0]["expr"]
    assert by_tier.startswith("sum by (reason, tier) (rate(${engine}:kvtier_miss_reason_total{")
    shown = ["hit_blocks", "failed_load_blocks", "stored_blocks", "miss_reason"]
    shown += [f"{direction}_{unit}" for direction in ("load", "store") for unit in ("bytes", "seconds")]
    assert dashboard_metrics(dashboard, "sglang") == {f"sglang:kvtier_{name}_total" for name in shown}


def test_every_metric_the_dashboard_names_is_one_sglang_serves(sglang_registry):
    dashboard = load_dashboard()
    assert "sglang:kvtier_hit_blocks_total" in exported_series(sglang_registry)  # the registry is not empty
    assert unknown_metrics(dashboard, "sglang", sglang_registry) == set()


def test_the_node_daemon_row_queries_what_the_daemon_serves(node_registry):
    dashboard = load_dashboard()
    assert {"kvtier_node_slots", "kvtier_node_hits_total", "kvtier_node_engine_hits_total"} <= node_metrics(dashboard)
    assert unknown_metrics(dashboard, "node", node_registry) == set()
    broken_copy = load_dashboard()
    row = next(panel for panel in panels(broken_copy) if panel.get("title") == "Node engines")
    row["targets"][0]["expr"] = row["targets"][0]["expr"].replace("connected", "connections_open")
    assert unknown_metrics(broken_copy, "node", node_registry) == {"kvtier_node_connections_open"}


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('sum by (tier) (rate(a:b_total{tier="x(y)", job=~"$job"}[$__rate_interval]))', {"a:b_total"}),
        (
            "sum(rate(a_total[5m] offset 1h)) / on() group_left sum without (le) (b_total @ end())",
            {"a_total", "b_total"},
        ),
        ("histogram_quantile(0.99, sum by (le) (rate(x_bucket[5m]))) > bool 1e3", {"x_bucket"}),
        ("a_total and ignoring (instance) b_total or c unless d", {"a_total", "b_total", "c", "d"}),
        ("a_total / on() group_left (tier) b_total", {"a_total", "b_total"}),
    ],
)
def test_metric_names_are_read_from_promql(expr, names):
    assert metric_names(expr) == names


@pytest.mark.parametrize("expr", ["rate(${metric}_total[5m])", '{__name__=~"kvtier_.*"}'])
def test_a_metric_name_that_cannot_be_read_is_refused(expr):
    with pytest.raises(ValueError, match="cannot be checked"):
        metric_names(expr)


@pytest.mark.parametrize(
    ("change", "name"),
    [
        ("unknown metric", "sglang:kvtier_bogus_total"),
        ("misspelled in a collapsed row", "sglang:kvtier_hit_block_total"),
        ("counter without _total", "sglang:kvtier_load_bytes"),
        ("unknown metric in a variable", "sglang:kvtier_bogus_total"),
    ],
)
def test_a_metric_kvtier_does_not_export_is_caught(sglang_registry, change, name):
    assert unknown_metrics(broken(change), "sglang", sglang_registry) == {name}


def test_layout_faults_are_caught():
    dashboard = copy.deepcopy(load_dashboard())
    graphs = [panel for panel in panels(dashboard) if panel.get("targets")]
    del graphs[0]["datasource"]
    graphs[1]["title"] = " "
    graphs[2]["targets"][0]["expr"] += ' * on() group_left max(up{cluster="$cluster"})'
    graphs[3]["targets"][0]["datasource"] = {"type": "prometheus", "uid": "my-prometheus"}
    graphs[4]["id"] = graphs[5]["id"]
    dashboard["schemaVersion"] = 36
    problems = "\n".join(layout_problems(dashboard))
    assert f"panel {graphs[0]['id']} ({graphs[0]['title']!r}) does not query the datasource variable" in problems
    assert f"panel {graphs[1]['id']} (' ') has no title" in problems
    assert "variable $cluster is used but not defined" in problems
    assert f"({graphs[3]['title']!r}) target A has no query on the datasource variable" in problems
    assert f"panel ids repeat: [{graphs[5]['id']}]" in problems
    assert "schemaVersion 36 is below 38" in problems
    assert len(layout_problems(dashboard)) == 6
