"""A medium registered from the tests (tests/helpers/ram_medium.py), under vLLM's real scheduler: once the
host tier is full a prefix lives in the ``ram`` tier; a later request loads it from there, staged
through host memory, bit-exact, counted as ``hit_blocks_ram`` and announced with the medium's own
KV-event label, with nothing left pinned."""

from __future__ import annotations

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from helpers.ram_medium import registered
from helpers.vllm_helpers import BLOCK, forget_gpu, held_by, prompt, scheduled_load, step_until_scheduled
from kvtier.core.keys import chain_hashes

RAM_STACK = {"tiers": [{"medium": "host", "capacity_blocks": 4}, {"medium": "ram", "capacity_blocks": 64}]}


def test_a_registered_medium_serves_a_prefix_under_vllm(make_engine):
    with registered():
        engine = make_engine(RAM_STACK)
        first = engine.add(prompt(4, 5, seed=1, prefix=1), max_tokens=2)
        engine.run([first])
        for p in (2, 3):  # two more prefixes push the first out of the 4-block host tier
            engine.run([engine.add(prompt(4, 5, seed=p, prefix=p), max_tokens=2)])
        keys = chain_hashes(prompt(4, 0, seed=0, prefix=1), BLOCK, engine.kvtier.request_namespace())
        assert held_by(engine, keys) == ["ram"] * 4
        stored = [e for e in engine.events if type(e).__name__ == "BlockStored" and e.medium == "RAM"]
        assert set(keys) <= {h for e in stored for h in e.block_hashes}
        forget_gpu(engine)

        again = engine.add(prompt(4, 11, seed=4, prefix=1), max_tokens=2)
        job = scheduled_load(engine, again.request_id)
        assert job.num_blocks == 4 and [c.src.tier for stage in job.stages for c in stage] == ["ram", "host"]
        sources = engine.connector.get_external_cache_hit_sources(again, 4 * BLOCK)
        assert sources == {CacheHitSource.EXTERNAL_UNSPECIFIED: 4 * BLOCK}  # no vLLM label of its own
        out = step_until_scheduled(engine, again)
        assert out.num_scheduled_tokens[again.request_id] == 11
        assert engine.blocks_match(again, range(4))
        engine.run([again])
        assert sum(s["hit_blocks_ram"] for s in engine.stats) == 4
        assert sum(s["hit_blocks_host"] + s["hit_blocks_disk"] for s in engine.stats) == 0
        engine.assert_no_leaks()
