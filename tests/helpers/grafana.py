"""Reading a Grafana dashboard's queries for the metric names they select, and checking them against a
live Prometheus registry: shared by the dashboard's tests (tests/test_grafana.py for SGLang's registry and
the node daemon's, tests/connectors/vllm/test_grafana_vllm.py for vLLM's)."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "kvtier.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
"""What every panel and target queries: the data source the reader picks in the ``datasource`` variable."""

GRAFANA_GLOBALS = frozenset(
    {"__rate_interval", "__interval", "__interval_ms", "__range", "__range_s", "__range_ms", "__from", "__to"}
)
"""Variables Grafana itself defines for every dashboard."""

PROMQL_WORDS = frozenset(
    {"and", "or", "unless", "atan2", "bool", "offset", "by", "without", "on", "ignoring", "group_left", "group_right"}
    | {"inf", "nan"}
)
"""PromQL's keywords and binary operators spelled as words: never metric names."""

VARIABLE = re.compile(r"\$\{(\w+)(?:[:.][^}]*)?\}|\$(\w+)|\[\[(\w+)(?::\w+)?\]\]")
QUOTED = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
MATCHERS = re.compile(r"\{[^}]*\}")
RANGES = re.compile(r"\[[^\]]*\]")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
IDENTIFIER = re.compile(r"(?<![\w:.$])[A-Za-z_:][\w:]*(?![\w:]|\s*\()")
LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(.+),\s*\w+\s*\)\s*$", re.DOTALL)
QUERY_RESULT = re.compile(r"^\s*query_result\(\s*(.+)\)\s*$", re.DOTALL)


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def panels(container: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows included, and the panels a collapsed row keeps inside it."""
    for panel in container.get("panels", []):
        yield panel
        yield from panels(panel)


def variables(dashboard: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {variable["name"]: variable for variable in dashboard.get("templating", {}).get("list", [])}


def engines(dashboard: dict[str, Any]) -> list[str]:
    """The prefixes the ``engine`` variable offers (``vllm``, ``sglang``)."""
    return [value.strip() for value in variables(dashboard)["engine"]["query"].split(",")]


def expressions(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression: the panels' targets and the series selectors of the query variables."""
    found = [target["expr"] for panel in panels(dashboard) for target in panel.get("targets", [])]
    for variable in variables(dashboard).values():
        if variable.get("type") == "query":
            query = variable["query"]
            query = query["query"] if isinstance(query, dict) else query
            match = LABEL_VALUES.match(query) or QUERY_RESULT.match(query)
            if match:
                found.append(match.group(1))
            elif query.strip().startswith("label_values("):  # label_values(label): no series selector
                continue
            else:
                raise ValueError(f"variable {variable['name']}: cannot read the metrics of query {query!r}")
    return found


def substitute(text: str, name: str, value: str) -> str:
    """``text`` with the variable ``name`` replaced in each form Grafana reads: $name, ${name}, [[name]]."""
    return VARIABLE.sub(lambda m: value if name in m.groups() else m.group(0), text)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: what is left once strings, label matchers, ranges and
    grouping labels are cut out, less function calls, keywords and numbers."""
    bare = GROUPING.sub(" ", RANGES.sub(" ", MATCHERS.sub(" ", QUOTED.sub('""', expr))))
    if "$" in bare or "__name__" in expr:
        raise ValueError(f"a metric named by a variable or a __name__ matcher cannot be checked: {expr!r}")
    return {name for name in IDENTIFIER.findall(bare) if name not in PROMQL_WORDS}


NODE_METRICS = "kvtier_node_"
"""The prefix of the node daemon's own series (``kvtier node serve --metrics-port``): no engine serves them."""


def dashboard_metrics(dashboard: dict[str, Any], engine: str) -> set[str]:
    """The metric names an engine serves of every expression, with the ``engine`` variable set to ``engine``."""
    names = {name for expr in expressions(dashboard) for name in metric_names(substitute(expr, "engine", engine))}
    return {name for name in names if not name.startswith(NODE_METRICS)}


def node_metrics(dashboard: dict[str, Any]) -> set[str]:
    """The node daemon's metric names the dashboard queries."""
    names = {name for expr in expressions(dashboard) for name in metric_names(substitute(expr, "engine", "any"))}
    return {name for name in names if name.startswith(NODE_METRICS)}


def exported_series(registry: Any) -> set[str]:
    """The series names a prometheus_client registry serves (counters as ``<name>_total``)."""
    return {sample.name for metric in registry.collect() for sample in metric.samples}


def unknown_metrics(dashboard: dict[str, Any], engine: str, registry: Any) -> set[str]:
    """The dashboard's metric names for ``engine`` that the registry does not serve (empty: all is well);
    ``engine`` "node": the node daemon's, against its registry."""
    wanted = node_metrics(dashboard) if engine == "node" else dashboard_metrics(dashboard, engine)
    return wanted - exported_series(registry)


def layout_problems(dashboard: dict[str, Any]) -> list[str]:
    """What is wrong with the dashboard apart from its metric names (empty: nothing)."""
    problems = []
    if dashboard.get("schemaVersion", 0) < 38:
        problems.append(f"schemaVersion {dashboard.get('schemaVersion')} is below 38")
    defined = variables(dashboard)
    source = defined.get("datasource", {})
    if (source.get("type"), source.get("query")) != ("datasource", "prometheus"):
        problems.append("no variable 'datasource' choosing a Prometheus data source")
    ids = [panel.get("id") for panel in panels(dashboard)]
    if len(ids) != len(set(ids)):
        problems.append(f"panel ids repeat: {sorted(i for i in set(ids) if ids.count(i) > 1)}")
    for panel in panels(dashboard):
        name = f"panel {panel.get('id')} ({panel.get('title')!r})"
        if not str(panel.get("title", "")).strip():
            problems.append(f"{name} has no title")
        if panel.get("type") in ("row", "text"):
            continue
        if panel.get("datasource") != DATASOURCE:
            problems.append(f"{name} does not query the datasource variable: {panel.get('datasource')}")
        if not panel.get("targets"):
            problems.append(f"{name} has no query")
        for target in panel.get("targets", []):
            if target.get("datasource", DATASOURCE) != DATASOURCE or not target.get("expr", "").strip():
                problems.append(f"{name} target {target.get('refId')} has no query on the datasource variable")
    used = {name for text in strings(dashboard) for m in VARIABLE.finditer(text) for name in m.groups() if name}
    problems += [f"variable ${name} is used but not defined" for name in sorted(used - set(defined) - GRAFANA_GLOBALS)]
    return problems


def strings(value: Any) -> Iterator[str]:
    """Every string in a JSON value, keys and values, at any depth."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings(item)


def broken(change: str) -> dict[str, Any]:
    """A copy of the dashboard with one fault put in."""
    dashboard = copy.deepcopy(load_dashboard())
    first = next(panel for panel in panels(dashboard) if panel.get("targets"))
    if change == "unknown metric":
        first["targets"].append({**first["targets"][0], "refId": "Z", "expr": "rate(${engine}:kvtier_bogus_total[5m])"})
    elif change == "misspelled in a collapsed row":
        row = next(panel for panel in panels(dashboard) if panel["type"] == "row")
        row["collapsed"], row["panels"] = True, [copy.deepcopy(first)]
        target = row["panels"][0]["targets"][0]
        target["expr"] = target["expr"].replace("hit_blocks_total", "hit_block_total")
    elif change == "counter without _total":
        first["targets"][0]["expr"] = "rate(${engine}:kvtier_load_bytes[5m])"
    elif change == "unknown metric in a variable":
        variables(dashboard)["instance"]["query"] = "label_values(${engine}:kvtier_bogus_total, instance)"
    else:
        raise ValueError(f"no such fault: {change}")
    return dashboard
