"""Why a prompt missed, under vLLM (issue 30): the scheduler side counts each request's lookup once, however
often vLLM asks, when it ends before the prompt's last full block (past vLLM's own prefix hit), by the
reason of its first missing block, in total (tier "all") and per tier; vLLM carries the counts in its
connector stats to ``vllm:kvtier_miss_reason_total{reason, tier}`` on /metrics."""

from __future__ import annotations

from helpers.vllm_helpers import forget_gpu, prompt
from kvtier.connectors.counters import counters

HOST_ONLY = {"tiers": [{"medium": "host", "capacity_blocks": 4, "eviction": "lru"}]}


def misses(engine) -> dict[tuple[str, str], int]:
    """The miss counts the engine's steps reported, summed, by (reason, tier); the zero ones left out."""
    rows = {c.name: c.labels for c in counters() if c.metric == "miss_reason"}
    totals = {rows[name]: sum(s.get(name, 0) for s in engine.stats) for name in rows}
    return {row: n for row, n in totals.items() if n}


def test_each_request_counts_its_miss_once_by_reason_and_tier(make_engine, prometheus):
    engine = make_engine(HOST_ONLY)
    for p in (1, 2):  # the host tier holds 4 blocks: prefix 2's evict prefix 1's
        engine.run([engine.add(prompt(4, 5, seed=p, prefix=p), max_tokens=2)])
    assert misses(engine) == {("never_stored", "all"): 2, ("never_stored", "host"): 2}

    forget_gpu(engine)  # all 4 full blocks of prefix 2 hit; vLLM computes the partial fifth itself
    engine.run([engine.add(prompt(4, 5, seed=3, prefix=2), max_tokens=2)])
    assert misses(engine)[("partial_block", "all")] == 1

    forget_gpu(engine)
    again = engine.add(prompt(4, 5, seed=4, prefix=1), max_tokens=2)
    for _ in range(3):  # vLLM may ask about a waiting request at every step: it still counts once
        assert engine.connector.get_num_new_matched_tokens(again, 0) == (0, False)
    engine.run([again])
    assert misses(engine) == {
        ("never_stored", "all"): 2,
        ("never_stored", "host"): 2,
        ("partial_block", "all"): 1,
        ("partial_block", "host"): 1,
        ("evicted", "all"): 1,
        ("evicted", "host"): 1,
    }

    registry, prom = prometheus(engine.vllm_config)
    for stats in engine.stats:
        prom.observe(stats, 0)

    def scraped(reason: str, tier: str) -> float | None:
        labels = {"model_name": "tiny", "engine": "0", "reason": reason, "tier": tier}
        return registry.get_sample_value("vllm:kvtier_miss_reason_total", labels)

    assert (scraped("evicted", "host"), scraped("evicted", "all"), scraped("never_stored", "host")) == (1, 1, 2)
    assert scraped("damaged", "disk") == 0  # every reason and tier is a series from the start


def test_a_prompt_of_whole_blocks_that_all_hit_is_no_miss(make_engine):
    """vLLM computes at least the prompt's last token, so the last of its whole blocks is never kvtier's to
    give: a hit of every block before it is a full hit."""
    engine = make_engine(HOST_ONLY)
    engine.run([engine.add(prompt(4, 0, seed=1, prefix=1), max_tokens=2)])
    forget_gpu(engine)
    engine.run([engine.add(prompt(4, 0, seed=2, prefix=1), max_tokens=2)])
    assert misses(engine) == {("never_stored", "all"): 1, ("never_stored", "host"): 1}
