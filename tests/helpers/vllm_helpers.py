"""Steps and prompts shared by the vLLM connector tests under ``tests/connectors/vllm`` (the engine
itself is ``helpers.vllm_harness``): prompts sharing prefixes, and stepping until a load is planned or
a request is scheduled. Plain Python, importable without vLLM."""

from __future__ import annotations

BLOCK = 16  # the test engine's block size (vLLM's --block-size there)


def prompt(prefix_blocks: int, tail: int, seed: int, prefix: int = 0) -> list[int]:
    """``prefix_blocks`` blocks shared by every prompt of the same ``prefix``, then ``tail`` tokens of this seed."""
    return [100_000 * prefix + 7 + i for i in range(prefix_blocks * BLOCK)] + [10_000 * seed + i for i in range(tail)]


def held_by(engine, keys: list[bytes]) -> list[str | None]:
    """The name of the fastest tier holding each key readable on the scheduler side (None: no tier)."""
    names = []
    for key in keys:
        found = engine.kvtier.planner.lookup([key])
        names.append(engine.kvtier.tiers[found.sources[0]].name if found.hits else None)
    return names


def forget_gpu(engine) -> None:
    """Empty vLLM's own prefix cache and scribble over the KV memory, so only kvtier can supply a hit."""
    assert engine.scheduler.reset_prefix_cache()
    for worker in engine.workers:
        worker.scribble()


def assert_loads_back(engine, tokens: list[int], computed: int, blocks: int) -> None:
    """Empty vLLM's prefix cache and send ``tokens`` again: vLLM computes only ``computed`` of them
    (kvtier supplies the rest), no load fails, the first ``blocks`` blocks hold the right KV on every
    rank (and in every KV cache group that keeps them), and the run leaves nothing behind."""
    forget_gpu(engine)
    errors = set(engine.load_errors)
    again = engine.add(tokens, max_tokens=2)
    out = step_until_scheduled(engine, again)
    assert out.num_scheduled_tokens[again.request_id] == computed
    assert engine.load_errors == errors and again.request_id not in engine.failed_loads
    assert engine.blocks_match(again, range(blocks))
    engine.run([again])
    engine.assert_no_leaks()


def assert_recomputed_from(engine, tokens: list[int], damaged: int, blocks: int, computed: int):
    """Empty vLLM's prefix cache and send ``tokens`` again, whose block ``damaged`` kvtier holds with
    bad bytes: the load plans all ``blocks``, that block's GPU block is reported as a load error,
    vLLM computes ``computed`` tokens (from that block on) and every block ends up with the right
    KV. Returns the request, still running."""
    forget_gpu(engine)
    again = engine.add(tokens, max_tokens=2)
    assert scheduled_load(engine, again.request_id).num_blocks == blocks
    out = step_until_scheduled(engine, again)
    (block_ids,) = engine.scheduler.kv_cache_manager.get_block_ids(again.request_id)
    assert block_ids[damaged] in engine.load_errors
    assert out.num_scheduled_tokens[again.request_id] == computed
    assert engine.blocks_match(again, range(blocks))
    return again


def scheduled_load(engine, request_id):
    """Steps until the request's load is planned; returns the planned job as the workers received it."""
    for _ in range(5):
        out, _ = engine.step()
        for job in out.kv_connector_metadata.loads:
            if job.req_id == request_id:
                return job
    raise AssertionError("no load was planned")


def step_until_scheduled(engine, request, max_steps: int = 10):
    """Steps until vLLM schedules the request (after its load arrived); returns that step's output."""
    for _ in range(max_steps):
        out, _ = engine.step()
        if request.request_id in out.num_scheduled_tokens:
            return out
    raise AssertionError(f"{request.request_id} was never scheduled")
