"""The node daemon's Prometheus endpoint (``kvtier node serve --metrics-port``): the daemon's counts, the
slab's use, per connected engine its own counts and, where the slab has shares, per tenant its blocks,
read from ``NodeDaemon.stats`` at every scrape."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvtier.node_daemon import DAEMON_COUNTS, SESSION_COUNTS, NodeDaemon

GAUGES = {
    "used_slots": "slots holding a block or being written",
    "slots": "slots in the slab",
    "slot_bytes": "bytes per slot",
    "connected": "engine connections open now",
    "held": "blocks pinned or reserved by engines now",
}
HELP = {
    "lookups": "keys engines asked about",
    "found": "keys asked about that the slab held",
    "hits": "blocks pinned for a load",
    "misses": "blocks a load asked for that the slab did not hold",
    "stores": "blocks committed",
    "skipped": "blocks a store skipped: the slab held them already",
    "busy": "blocks a store skipped: another engine was writing them",
    "full": "blocks a store could not place: no room, or the engine held its share",
    "declined": "blocks a store offered that the slab's policy did not admit (seen once: adaptive)",
    "aborted": "reservations given back unwritten",
    "dropped": "blocks a load found damaged, dropped",
    "connections": "engine connections accepted",
    "refused": "connections refused (user not allowed, too many)",
    "revoked": "connections closed for holding blocks past the lease",
    "protocol_errors": "connections closed for a malformed message",
    "evicted": "blocks evicted from the slab",
    "promoted": "blocks brought up into the slab from a tier below it (a disk cache, a store), for a load",
    "store_late": "lookups whose store below the slab answered after below_wait (those blocks were misses)",
    "copied_down": "blocks copied down from the slab into the tiers below it",
}


class NodeCollector:
    """Reads the daemon's numbers at each scrape (nothing is kept between scrapes)."""

    def __init__(self, daemon: NodeDaemon) -> None:
        self.daemon = daemon

    def collect(self) -> Iterator[Metric]:
        stats = self.daemon.stats()
        for name in (*SESSION_COUNTS, *DAEMON_COUNTS, "evicted", "copied_down"):
            yield CounterMetricFamily(f"kvtier_node_{name}", HELP[name], value=stats[name])
        for name, text in GAUGES.items():
            yield GaugeMetricFamily(f"kvtier_node_{name}", text, value=stats[name])
        held = GaugeMetricFamily(
            "kvtier_node_engine_held", "blocks an engine holds pinned or reserved now", labels=["engine"]
        )
        for engine, counts in stats["engines"].items():
            held.add_metric([engine], counts["held"])
        yield held
        for name in SESSION_COUNTS:
            family = CounterMetricFamily(f"kvtier_node_engine_{name}", f"{HELP[name]}, per engine", labels=["engine"])
            for engine, counts in stats["engines"].items():
                family.add_metric([engine], counts.get(name, 0))
            yield family
        yield from tenant_families(stats["tenants"])


TENANT_HELP = {
    "stored": "blocks of a tenant stored in the slab",
    "read": "blocks of a tenant read from the slab",
    "evicted": "blocks of a tenant evicted from the slab",
    "caused": "evictions from the slab a tenant's stores caused",
}


def tenant_families(tenants: dict[str, dict[str, int]]) -> Iterator[Metric]:
    """Per tenant of the slab's shares (the tenants they name, ``other``, ``none``), where it has shares."""
    if not tenants:
        return
    for name, text in TENANT_HELP.items():
        family = CounterMetricFamily(f"kvtier_node_tenant_{name}", text, labels=["tenant"])
        for tenant, counts in tenants.items():
            family.add_metric([tenant], counts[name])
        yield family
    held = GaugeMetricFamily("kvtier_node_tenant_held", "blocks of a tenant in the slab now", labels=["tenant"])
    for tenant, counts in tenants.items():
        held.add_metric([tenant], counts["held"])
    yield held


def serve_metrics(daemon: NodeDaemon, port: int, address: str = "127.0.0.1") -> None:
    """Serve /metrics on ``address``:``port`` from a thread of prometheus_client's."""
    registry = CollectorRegistry()
    registry.register(NodeCollector(daemon))
    start_http_server(port, address, registry)
