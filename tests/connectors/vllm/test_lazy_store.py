"""Lazy stores (``store: lazy``): a block is copied out only when it is among the next blocks vLLM's
free queue hands out again, so blocks vLLM's own prefix cache keeps serving cost no copy, and blocks
about to be overwritten are saved first, with the right bytes."""

from __future__ import annotations

from helpers.vllm_helpers import BLOCK

HOST = {"tiers": [{"medium": "host", "capacity_blocks": 32}]}


def prompt(blocks: int, tail: int, prefix: int) -> list[int]:
    return [100_000 * prefix + 7 + i for i in range(blocks * BLOCK)] + [50_000 + prefix * 100 + i for i in range(tail)]


def test_blocks_far_from_reuse_are_not_copied(make_engine):
    engine = make_lazy_engine(make_engine, ahead=0.1, num_gpu_blocks=64)
    engine.run([engine.add(prompt(4, 5, prefix=1), max_tokens=2)])
    for _ in range(3):
        engine.step()
    assert engine.kvtier.tier("host").usage().used == 0  # 64 free blocks, the request's 5 are far from the front
    engine.assert_no_leaks()


def test_blocks_about_to_be_reused_are_stored_first_and_load_back_exact(make_engine):
    engine = make_lazy_engine(make_engine, ahead=1.0, num_gpu_blocks=12)
    first = engine.add(prompt(4, 5, prefix=1), max_tokens=2)
    engine.run([first])
    engine.step()  # the first request's blocks are free now, and everything free is about to be reused
    engine.drain()
    assert engine.kvtier.tier("host").usage().used == 4
    # another prefix takes most GPU blocks: the first prefix's GPU copies are overwritten
    engine.run([engine.add(prompt(8, 5, prefix=2), max_tokens=2)])
    assert engine.scheduler.reset_prefix_cache()  # and vLLM forgets whatever of it survived
    for worker in engine.workers:
        worker.scribble()
    again = engine.add(prompt(4, 9, prefix=1), max_tokens=2)
    for _ in range(10):
        out, _ = engine.step()
        if again.request_id in out.num_scheduled_tokens:
            break
    assert out.num_scheduled_tokens[again.request_id] == 9  # 4 blocks came from kvtier's host tier
    assert engine.blocks_match(again, range(4))
    engine.run([again])
    engine.assert_no_leaks()


def test_the_same_prompt_computed_twice_in_one_step_is_stored_once(make_engine):
    """Identical prompts scheduled together each compute the block in a GPU block of their own (vLLM
    caches it once they are done): both copies reach the free queue, and kvtier stores the key once
    (it used to reserve it twice, and the StateError stopped the engine)."""
    engine = make_lazy_engine(make_engine, ahead=1.0, num_gpu_blocks=14)
    engine.run([engine.add(prompt(1, 0, prefix=3), max_tokens=1) for _ in range(3)])
    engine.step()
    engine.drain()
    assert engine.kvtier.tier("host").usage().used == 1
    engine.assert_no_leaks()


def test_blocks_the_host_tiers_policy_declines_are_not_offered_again_while_they_wait(make_engine):
    """A block declined once stays in the free queue's front for steps on end; asking about it at each
    of them would make it look seen again, and the policy would store it the second time."""
    declining = {"tiers": [{**HOST["tiers"][0], "eviction": "helpers.admission.AdmitOnSecondAsk"}]}
    engine = make_lazy_engine(make_engine, ahead=1.0, num_gpu_blocks=12, config=declining)
    engine.run([engine.add(prompt(4, 5, prefix=1), max_tokens=2)])
    for _ in range(3):
        engine.step()
    host = engine.kvtier.tier("host")
    assert host.usage().used == 0 and host.stats.declined == 4
    engine.assert_no_leaks()


def make_lazy_engine(make_engine, ahead: float, num_gpu_blocks: int, config: dict = HOST):
    """An engine whose connector stores lazily, looking ``ahead`` of vLLM's free queue."""
    return make_engine(config, num_gpu_blocks=num_gpu_blocks, extra={"store": "lazy", "lazy_ahead": ahead})
