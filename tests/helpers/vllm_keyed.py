"""The vLLM connector over a tier by key (a remote store, a node daemon), for the tests of both: a first
engine publishes a prefix, a second one asks for it and loads it."""

from __future__ import annotations

import time

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from helpers.vllm_helpers import BLOCK, prompt, step_until_scheduled

WAIT = 10.0


def answer(engine, request, computed: int = 0) -> tuple[int | None, bool]:
    """The lookup once the shared tier has answered (None, "ask again", while the query is in flight)."""
    lookup = engine.connector.get_num_new_matched_tokens
    deadline = time.monotonic() + WAIT
    while (found := lookup(request, computed))[0] is None:
        assert time.monotonic() < deadline, "the shared tier's answer never came"
        time.sleep(0.01)
    return found


def publish(make_engine, config: dict, tokens: list[int], **kwargs):
    """A first engine computes ``tokens``; its blocks reach the shared tier (host tier, then a copy on,
    a job of its own: stepped until every block is committed)."""
    writer = make_engine(config, **kwargs)
    request = writer.add(tokens, max_tokens=2)
    assert answer(writer, request) == (0, False)  # the tier holds none yet (a first client may take a while)
    writer.run([request])
    stored = len(tokens) // BLOCK * len(writer.kvtier.groups)
    deadline = time.monotonic() + WAIT
    while writer.kvtier.keyed.stats.committed < stored:
        assert time.monotonic() < deadline, "the blocks never reached the shared tier"
        writer.step()
    writer.assert_no_leaks()
    return writer


def assert_second_engine_hit(make_engine, config: dict, tier: str, staged: bool) -> None:
    """A second engine finds the first one's 4-block prefix in the tier named ``tier`` and loads it
    into vLLM's blocks bit-exact, computing only the tail: ``staged`` through its host tier (where they
    stay), or straight from the tier (a node slab, vLLM's blocks in host memory: the harness's CPU)."""
    publish(make_engine, config, prompt(4, 5, seed=1))
    reader = make_engine(config)
    again = reader.add(prompt(4, 9, seed=2), max_tokens=2)
    assert answer(reader, again) == (4 * BLOCK, True)
    assert reader.connector.get_external_cache_hit_sources(again, 4 * BLOCK) == {
        CacheHitSource.EXTERNAL_UNSPECIFIED: 4 * BLOCK
    }
    out = step_until_scheduled(reader, again)
    assert out.num_scheduled_tokens[again.request_id] == 9  # the tail only: 4 blocks came from the tier
    assert reader.blocks_match(again, range(4)) and not reader.load_errors
    reader.run([again])
    totals = {k: sum(s.get(k, 0) for s in reader.stats) for k in (f"hit_blocks_{tier}", "hit_blocks_host")}
    assert totals == {f"hit_blocks_{tier}": 4, "hit_blocks_host": 0}
    assert reader.kvtier.tier("host").usage().used == (4 if staged else 0)
    reader.assert_no_leaks()
