"""Connector statistics in vLLM's ``KVConnectorStats`` form: counters that add up across ranks and steps.

The scheduler side counts blocks (hits per medium: host, disk, remote; failed loads; stored blocks) and
requests whose lookup ended early, by reason and tier (``miss_counter``); the
workers count bytes and seconds per direction (into vLLM's KV blocks: load; out of them: store), and
what their storages count (``STORAGE_COUNTERS``), which the connector wraps here
(``WorkerSide.take_stats``). vLLM aggregates both through ``aggregate``, logs
``reduce()``, and feeds each step's figures to ``KVTierPromMetrics``, which exposes them as Prometheus
counters on vLLM's own /metrics endpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvtier.connectors.counters import (
    LABELS,
    PROMETHEUS_HELP,
    counter_names,
    counters,
    hit_media,
    tenant_counter,
    tenant_counters,
)
from kvtier.core.tier_config import NO_TENANT, OTHER_TENANTS

STORAGE_COUNTERS = ("skipped_existing",)
"""Counted by the workers' storages (``RankRequest.count``), summed over ranks: ``skipped_existing``,
records a store to the remote tier did not write because the store held them already (another engine
stored the block; each rank's record counts). vLLM logs them with the others (``reduce``); they are not
on /metrics, where no remote tier counter is."""


def _names() -> tuple[str, ...]:
    return (*counter_names(), *STORAGE_COUNTERS)


@dataclass
class KVTierConnectorStats(KVConnectorStats):
    def __post_init__(self) -> None:
        for name in _names():
            self.data.setdefault(name, 0)

    def record_load(self, hits: dict[str, int], failed: int) -> None:
        """A finished load: blocks that arrived per medium of the tier they came from, and those that did not."""
        for medium in hit_media():
            self.data[f"hit_blocks_{medium}"] += hits.get(medium, 0)
        self.data["failed_load_blocks"] += failed

    def record_store(self, blocks: int) -> None:
        self.data["stored_blocks"] += blocks

    def record_tenant(self, metric: str, label: str, blocks: int) -> None:
        """Blocks of one tenant label loaded or stored (``counters.TENANT_METRICS``), where the config's
        shares name tenants."""
        name = tenant_counter(metric, label)
        self.data[name] = self.data.get(name, 0) + blocks

    def record_misses(self, misses: dict[str, int]) -> None:
        """Lookups that ended early, by counter name (``counters.miss_counts``)."""
        for name, n in misses.items():
            self.data[name] = self.data.get(name, 0) + n

    def reset(self) -> None:
        self.data = dict.fromkeys(_names(), 0)

    def aggregate(self, other: KVConnectorStats) -> KVTierConnectorStats:
        if not isinstance(other, KVTierConnectorStats):
            raise TypeError(f"cannot aggregate kvtier stats with {type(other).__name__}")
        names = {*_names(), *self.data, *other.data}  # (the tenants' counts are the config's)
        return KVTierConnectorStats({k: self.data.get(k, 0) + other.data.get(k, 0) for k in names})

    def reduce(self) -> dict[str, int | float]:
        """What vLLM logs: every counter, less the miss counts that are 0 (most of them, most of the time)."""
        out: dict[str, int | float] = {k: v for k, v in self.data.items() if v or not k.startswith("miss_")}
        for direction in ("load", "store"):
            seconds = self.data[f"{direction}_seconds"]
            out[f"{direction}_GBps"] = round(self.data[f"{direction}_bytes"] / seconds / 1e9, 3) if seconds else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVTierPromMetrics(KVConnectorPromMetrics):
    """kvtier's counters as Prometheus counters with vLLM's engine labels, and their own ``LABELS``
    (hits by ``tier``, misses by ``reason`` and ``tier``; where the config's shares name tenants, blocks
    loaded and stored by ``tenant``): every series made at start, so each one is on /metrics, at 0,
    before anything is counted."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        metrics = {
            name: self._counter_cls(
                name=f"vllm:kvtier_{name}", documentation=text, labelnames=labelnames + list(LABELS.get(name, ()))
            )
            for name, text in PROMETHEUS_HELP.items()
        }
        from kvtier.connectors.vllm.connector import connector_config  # (it imports this module)

        named = connector_config(vllm_config).tenant_names()
        exported = (*counters(), *tenant_counters([*named, OTHER_TENANTS, NO_TENANT] if named else []))
        self._per_engine: dict[int, dict[str, Any]] = {
            engine: {c.name: metrics[c.metric].labels(*values, *c.labels) for c in exported}
            for engine, values in per_engine_labelvalues.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, counter in self._per_engine[engine_idx].items():
            value = transfer_stats_data.get(name, 0)
            if value > 0:
                counter.inc(value)
