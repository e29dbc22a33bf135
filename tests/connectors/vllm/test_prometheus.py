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
