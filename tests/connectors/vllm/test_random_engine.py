"""Random engine runs: vLLM's scheduler and kvtier's connector driven through generated sequences of
requests sharing prefixes, aborts, reports held back on some ranks, damaged disk bytes and emptied
GPU caches, on small tiers and few GPU blocks (so vLLM preempts and kvtier evicts and demotes),
with and without tensor parallelism, lazy stores and a compressing disk that refuses blocks.

After every step, each running request's prompt blocks on every rank must hold exactly the KV its
tokens give, whether vLLM computed them or kvtier loaded them; at the end every request finishes
and no pin, slot, job or GPU reader is left. Hypothesis shrinks a failing run to a short one.
"""

from __future__ import annotations

import tempfile

from hypothesis import HealthCheck, event, given, settings, strategies as st
from vllm.v1.request import RequestStatus

from helpers.vllm_helpers import BLOCK, forget_gpu, prompt
from kvtier.tiers.disk.slots import PAGE

stacks = st.fixed_dictionaries(
    {
        "placement": st.sampled_from(["write_back", "write_through"]),
        "host": st.integers(2, 8),
        "disk": st.none() | st.integers(4, 16),
        "gpu_blocks": st.integers(14, 24),
        "tp": st.integers(1, 2),
        "compression": st.sampled_from(["none", "zstd"]),  # zstd refuses 16 KiB blocks of random KV, not 2 KiB ones
        "head_size": st.sampled_from([8, 64]),  # 2 KiB or 16 KiB blocks
        "lazy": st.sampled_from([False, False, True]),  # lazy stores copy only blocks vLLM is about to reuse
    }
)
requests = st.tuples(st.integers(0, 3), st.integers(1, 4), st.integers(0, 2 * BLOCK), st.integers(1, 6))
"""(prefix, prefix blocks, tail tokens, tokens to generate): four prefixes, so prompts share blocks."""
rounds = st.lists(
    st.fixed_dictionaries(
        {
            "add": st.lists(requests, max_size=3),
            "steps": st.integers(1, 5),
            "report": st.sampled_from(
                [None, None, (), (0,)]
            ),  # the ranks that report in those steps: all, none, rank 0
            "then": st.sampled_from([None, "forget", "forget", "abort", "damage"]),
            "which": st.integers(0, 15),  # the request aborted, or the disk slot damaged
        }
    ),
    min_size=2,
    max_size=10,
)


def kvtier_config(stack: dict, disk_dir: str) -> dict:
    tiers = [{"medium": "host", "capacity_blocks": stack["host"]}]
    if stack["disk"]:
        tiers.append(
            {
                "medium": "disk",
                "capacity_blocks": stack["disk"],
                "path": disk_dir,
                "o_direct": "off",
                "compression": stack["compression"],
            }
        )
    return {"placement": stack["placement"], "tiers": tiers}


def assert_prompt_kv_exact(engine) -> None:
    """Every running request's computed prompt blocks hold the KV of its tokens on every rank."""
    for request in engine.scheduler.running:
        done = min(request.num_computed_tokens, request.num_prompt_tokens) // BLOCK
        assert engine.blocks_match(request, range(done)), f"{request.request_id}: wrong KV in its first {done} blocks"


def damage(engine, slot: int) -> None:
    """Overwrite bytes inside one disk slot's data on rank 0 (a checksum catches it at load)."""
    slab = engine.workers[0].connector.worker_side.storages["disk"].slab
    with open(slab.path, "r+b") as f:
        f.seek(slab.slot_offset(slot % slab.num_slots) + PAGE + 64)
        f.write(b"\x5a\xa5" * 16)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stack=stacks, ops=rounds)
def test_random_runs_keep_kv_exact_and_leave_nothing_behind(make_engine, stack, ops):
    with tempfile.TemporaryDirectory() as disk_dir:
        extra = {"store": "lazy", "lazy_ahead": 0.5} if stack["lazy"] else None
        engine = make_engine(
            kvtier_config(stack, disk_dir),
            num_gpu_blocks=stack["gpu_blocks"],
            tp=stack["tp"],
            max_num_seqs=4,
            extra=extra,
            head_size=stack["head_size"],
        )
        try:
            added = []
            for round_ in ops:
                added += [
                    engine.add(prompt(blocks, tail, seed=tail % 3, prefix=prefix), max_tokens=max_tokens)
                    for prefix, blocks, tail, max_tokens in round_["add"]
                ]
                for _ in range(round_["steps"]):
                    engine.step(report_ranks=None if round_["report"] is None else set(round_["report"]))
                    assert_prompt_kv_exact(engine)
                then, which = round_["then"], round_["which"]
                if then == "abort" and engine.scheduler.requests:
                    victim = sorted(engine.scheduler.requests)[which % len(engine.scheduler.requests)]
                    engine.scheduler.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
                elif then == "damage" and stack["disk"]:
                    damage(engine, which)
                elif then == "forget":  # let the running requests end, then empty vLLM's prefix cache
                    for _ in range(100):
                        if not engine.scheduler.requests:
                            break
                        engine.step()
                        assert_prompt_kv_exact(engine)
                    engine.drain()
                    forget_gpu(engine)
            for _ in range(300):  # every request runs to its end, every rank reporting
                if not engine.scheduler.requests:
                    break
                engine.step()
                assert_prompt_kv_exact(engine)
            assert not engine.scheduler.requests, "requests did not finish"
            engine.drain()
            engine.assert_no_leaks()
            # What the run exercised (pytest --hypothesis-show-statistics lists how often).
            totals = {key: sum(s.get(key, 0) for s in engine.stats) for key in ("hit_blocks_host", "hit_blocks_disk")}
            for key, n in totals.items():
                event(f"{key} > 0" if n else f"{key} = 0")
            event("load errors" if engine.load_errors else "no load errors")
            event(f"host evictions > 0: {engine.kvtier.tier('host').stats.evicted > 0}")
            event(f"demotions refused > 0: {engine.kvtier.tier('host').stats.demotion_refused > 0}")
            assert all(
                r.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_ABORTED) for r in added
            )
        finally:
            engine.shutdown()
