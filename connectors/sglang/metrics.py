"""kvtier's counters inside an SGLang scheduler process, exported where SGLang exports its own.

SGLang serves Prometheus metrics from every process through prometheus_client's multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR``, set before its scheduler starts): counters made in the scheduler, where
the storage backend lives, appear on SGLang's /metrics. kvtier's are the counters it exports under vLLM
(``connectors/counters.py``), named ``sglang:kvtier_<name>`` and labelled with the TP rank (and their
own labels: hits by tier, misses by reason and tier). SGLang's
own storage metrics (pages and bandwidth per prefetch and backup call) come from ``take()``, which
``get_stats`` hands SGLang when it runs with ``--enable-cache-report``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from kvtier.connectors.counters import LABELS, PROMETHEUS_HELP, counters

_METRICS: dict[str, Any] = {}
_METRICS_LOCK = threading.Lock()


def _prometheus_metrics() -> dict[str, Any]:
    """The process's kvtier counters, made once (prometheus_client refuses a second metric of a name)."""
    with _METRICS_LOCK:
        if not _METRICS:
            from prometheus_client import Counter

            for name, text in PROMETHEUS_HELP.items():
                _METRICS[name] = Counter(f"sglang:kvtier_{name}", text, ["tp_rank", *LABELS.get(name, ())])
        return _METRICS


@dataclass
class CallFigures:
    """Pages and GB/s of each storage call since the last ``take``, in the form of SGLang's StorageMetrics."""

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)


class StorageCounters:
    """One backend's counters: Prometheus counters for the process (every series made here, so each one
    is on /metrics, at 0, before anything is counted), per-call figures for SGLang."""

    def __init__(self, tp_rank: int, block_bytes: int) -> None:
        metrics = _prometheus_metrics()
        rank = str(tp_rank)
        self._counters = {c.name: metrics[c.metric].labels(rank, *c.labels) for c in counters()}
        self._block_bytes = block_bytes
        self._calls = CallFigures()
        self._lock = threading.Lock()

    def loaded(self, hits: dict[str, int], failed: int, seconds: float) -> None:
        """A load call: blocks that arrived per medium of the tier they came from, those that did not."""
        for medium, blocks in hits.items():
            self._counters[f"hit_blocks_{medium}"].inc(blocks)
        self._counters["failed_load_blocks"].inc(failed)
        self._call("load", sum(hits.values()), seconds)

    def stored(self, blocks: int, seconds: float) -> None:
        """A store call: the blocks it copied out of SGLang's host pool into kvtier's first tier."""
        self._counters["stored_blocks"].inc(blocks)
        self._call("store", blocks, seconds)

    def missed(self, misses: dict[str, int]) -> None:
        """Lookups that ended early, by counter name (``counters.miss_counts``); a tier of a medium whose
        hits are not counted has no series of its own (its lookups are in the totals)."""
        for name, n in misses.items():
            counter = self._counters.get(name)
            if counter is not None:
                counter.inc(n)

    def take(self) -> CallFigures:
        """The per-call figures since the last call, for SGLang's storage metrics."""
        with self._lock:
            calls, self._calls = self._calls, CallFigures()
        return calls

    def _call(self, direction: str, blocks: int, seconds: float) -> None:
        nbytes = blocks * self._block_bytes
        self._counters[f"{direction}_bytes"].inc(nbytes)
        self._counters[f"{direction}_seconds"].inc(seconds)
        if not blocks:
            return
        with self._lock:
            pages, bandwidth = (
                (self._calls.prefetch_pgs, self._calls.prefetch_bandwidth)
                if direction == "load"
                else (self._calls.backup_pgs, self._calls.backup_bandwidth)
            )
            pages.append(blocks)
            bandwidth.append(nbytes / seconds / 1e9 if seconds > 0 else 0.0)
