"""Groups whose blocks hold different numbers of tokens (vLLM picks block sizes that give every group
one page size when their layers differ): here full attention in blocks of 16 tokens and a
sliding window in blocks of 32 (half the heads). kvtier keys every 16 tokens, keys a window block
where it ends, and ends every hit on a boundary of both groups' blocks, as vLLM's scheduler block
(32 tokens, their least common multiple) does."""

from __future__ import annotations

import pytest

from helpers.vllm_helpers import BLOCK, forget_gpu, held_by, prompt, scheduled_load, step_until_scheduled
from kvtier.connectors.vllm.geometry import ServedGroup, block_tokens, served_groups
from kvtier.core.keys import chain_hashes

HOST_ONLY = {"tiers": [{"medium": "host", "capacity_blocks": 64}]}
WINDOW_BLOCK = 2 * BLOCK
WINDOW = 2 * WINDOW_BLOCK + 1
"""A hit's last 2 window blocks (64 tokens) are all the windowed layers keep."""


@pytest.fixture
def engine(make_engine):
    return make_engine(HOST_ONLY, window=WINDOW, window_block=WINDOW_BLOCK)


def group_keys(engine, tokens: list[int], group: int) -> list[bytes]:
    """The keys of a group's blocks: one per 16 tokens for the full group, at every second one for the window's."""
    keys = chain_hashes(tokens[: len(tokens) // BLOCK * BLOCK], BLOCK, engine.kvtier.request_namespace())
    return [key + group.to_bytes(2, "big") for key in (keys if group == 0 else keys[1::2])]


def load_back(engine, tokens: list[int], hit_blocks: int, loaded: int):
    """Send ``tokens`` again after vLLM forgot everything: kvtier offers ``hit_blocks`` 16-token blocks,
    loads ``loaded`` group blocks, and every group's blocks of the hit hold the right KV on arrival."""
    forget_gpu(engine)
    again = engine.add(tokens, max_tokens=2)
    assert engine.connector.get_num_new_matched_tokens(again, 0) == (hit_blocks * BLOCK, True)
    job = scheduled_load(engine, again.request_id)
    assert job.num_blocks == loaded and job.missing == ()
    out = step_until_scheduled(engine, again)
    assert out.num_scheduled_tokens[again.request_id] == len(tokens) - hit_blocks * BLOCK
    assert engine.blocks_match(again, range(hit_blocks)) and not engine.failed_loads
    engine.run([again])
    engine.assert_no_leaks()


def test_keys_are_as_fine_as_every_groups_blocks_and_hits_as_coarse(engine):
    assert served_groups(engine.kv_config) == [ServedGroup(0), ServedGroup(1, window_blocks=2, keys_per_block=2)]
    assert block_tokens(engine.kv_config) == BLOCK
    assert engine.kvtier.geometry.hit_keys * BLOCK == WINDOW_BLOCK  # a hit ends where both groups' blocks end


def test_each_group_stores_its_own_blocks_under_the_key_where_they_end(engine):
    engine.run([engine.add(prompt(6, 5, seed=1), max_tokens=2)])
    full, window = group_keys(engine, prompt(6, 0, seed=0), 0), group_keys(engine, prompt(6, 0, seed=0), 1)
    assert (len(full), len(window)) == (6, 3)
    assert held_by(engine, full + window) == ["host"] * 9 and engine.kvtier.tier("host").usage().used == 9
    sizes = {
        bytes(e.block_hashes[0]): (e.block_size, len(e.token_ids))
        for e in engine.events
        if type(e).__name__ == "BlockStored"
    }
    assert {sizes[k] for k in full} == {(BLOCK, BLOCK)} and {sizes[k] for k in window} == {(WINDOW_BLOCK,) * 2}


def test_a_prefix_longer_than_the_window_loads_into_both_groups_bit_exact(engine):
    engine.run([engine.add(prompt(6, 5, seed=1), max_tokens=2)])
    load_back(engine, prompt(6, 9, seed=2), hit_blocks=6, loaded=6 + 2)  # the window: its last 2 blocks


def test_a_hit_ends_on_a_boundary_of_both_groups_blocks(engine):
    """5 full 16-token blocks are stored, but 80 tokens end inside a window block: the hit is 64."""
    engine.run([engine.add(prompt(5, 5, seed=1), max_tokens=2)])
    load_back(engine, prompt(5, 9, seed=2), hit_blocks=4, loaded=4 + 2)


def test_a_window_block_missing_ends_the_hit_where_that_block_starts(engine):
    """Without the window's third block (tokens 64-95) a hit to 96 is not whole; one to 64 needs the
    window's first two blocks, which are there."""
    engine.run([engine.add(prompt(6, 5, seed=1), max_tokens=2)])
    engine.kvtier.tier("host").discard([group_keys(engine, prompt(6, 0, seed=0), 1)[2]])
    load_back(engine, prompt(6, 9, seed=2), hit_blocks=4, loaded=4 + 2)
