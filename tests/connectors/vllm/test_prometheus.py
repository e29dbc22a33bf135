"""kvtier's statistics reach Prometheus through vLLM's own machinery: vLLM's ``KVConnectorProm``
finds ``KVTierConnector.build_prom_metrics`` and feeds it each step's stats, as its Prometheus
logger does for /metrics. The counters must equal what the engine's steps reported."""

from __future__ import annotations

from helpers.vllm_helpers import forget_gpu, prompt
from kvtier.connectors.counters import counter_names


def test_counters_on_metrics_equal_the_reported_stats(make_engine, prometheus, tmp_path):
    engine = make_engine(
        {
            "tiers": [
                {"medium": "host", "capacity_blocks": 4},
                {"medium": "disk", "capacity_blocks": 64, "path": str(tmp_path / "disk")},
            ]
        }
    )
    for p in (1, 2, 3):  # the first prefix ends up on disk only
        engine.run([engine.add(prompt(4, 5, seed=p, prefix=p), max_tokens=2)])
    forget_gpu(engine)
    engine.run(
        [
            engine.add(prompt(4, 9, seed=4, prefix=1), max_tokens=2),  # from disk
            engine.add(prompt(4, 9, seed=5, prefix=3), max_tokens=2),
        ]
    )  # from host
    registry, prom = prometheus(engine.vllm_config)
    for stats in engine.stats:  # the payloads vLLM put into its scheduler stats, step by step
        prom.observe(stats, 0)

    totals = {name: sum(s.get(name, 0) for s in engine.stats) for name in counter_names()}
    assert totals["hit_blocks_disk"] >= 4 and totals["hit_blocks_host"] + totals["hit_blocks_disk"] == 8
    assert totals["stored_blocks"] > 0
    labels = {"model_name": "tiny", "engine": "0"}
    for tier in ("host", "disk"):
        scraped = registry.get_sample_value("vllm:kvtier_hit_blocks_total", {**labels, "tier": tier})
        assert scraped == totals[f"hit_blocks_{tier}"], tier
    for name in ("failed_load_blocks", "stored_blocks", "load_bytes", "load_seconds", "store_bytes", "store_seconds"):
        assert registry.get_sample_value(f"vllm:kvtier_{name}_total", labels) == totals[name], name
    assert totals["load_bytes"] == 8 * engine.kvtier.tier("host").block_bytes


def test_blocks_loaded_and_stored_per_tenant_reach_metrics_under_bounded_labels(make_engine, prometheus):
    """Where the shares name tenants, /metrics counts blocks loaded and stored per tenant: a named one by
    its name, every other salt as ``other``, requests without a salt as ``none``; nothing else."""
    host = {"medium": "host", "capacity_blocks": 64, "tenants": {"shares": {"alice": 0.5}}}
    engine = make_engine({"tiers": [host]})
    tokens = {salt: prompt(4, 5, seed=i, prefix=i) for i, salt in enumerate(["alice", "bob", "carol", None])}
    for salt, t in tokens.items():
        engine.run([engine.add(t, max_tokens=2, cache_salt=salt)])
    forget_gpu(engine)
    for salt, t in tokens.items():  # each one's prefix again: loaded from host
        engine.run([engine.add(t, max_tokens=2, cache_salt=salt)])
    registry, prom = prometheus(engine.vllm_config)
    for stats in engine.stats:
        prom.observe(stats, 0)
    labels = {"model_name": "tiny", "engine": "0"}
    hits = {
        tenant: registry.get_sample_value("vllm:kvtier_tenant_hit_blocks_total", {**labels, "tenant": tenant})
        for tenant in ("alice", "other", "none", "bob")
    }
    assert hits == {"alice": 4, "other": 8, "none": 4, "bob": None}  # bob and carol are "other"
    stored = sum(
        registry.get_sample_value("vllm:kvtier_tenant_stored_blocks_total", {**labels, "tenant": t})
        for t in ("alice", "other", "none")
    )
    assert stored == registry.get_sample_value("vllm:kvtier_stored_blocks_total", labels) > 0
    held = engine.kvtier.tier("host").tenant_counts()
    assert set(held) == {"alice", "other", "none"} and held["other"]["held"] == 2 * held["alice"]["held"]
