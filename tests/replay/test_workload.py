"""The generated chat workload (kvtier.replay.workload).

Invariants checked:
- the same seed and parameters give the same requests; another seed gives others;
- Mooncake shape: one id per 512-token block (the partial last one included), timestamps in order,
  lengths inside the configured ranges; write_trace/load_trace give the requests back unchanged;
- ids are chained: an id always stands for the same prefix (the same ids before it);
- system prompts are shared across conversations, a later turn repeats the earlier turn's full
  blocks, and a partial last block is never reused (it grows in the next turn);
- bad parameters raise ValueError naming the field.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest

from kvtier.replay.trace import load_trace, write_trace
from kvtier.replay.workload import ChatWorkload, generate

SPEC = ChatWorkload(conversations=60, seed=3)


def test_seeded_and_deterministic():
    assert generate(SPEC) == generate(ChatWorkload(conversations=60, seed=3))
    assert generate(SPEC) != generate(ChatWorkload(conversations=60, seed=4))


def test_mooncake_shape_and_round_trip(tmp_path):
    requests = generate(SPEC)
    assert len(requests) >= SPEC.conversations
    assert [r.timestamp for r in requests] == sorted(r.timestamp for r in requests)
    for r in requests:
        assert len(r.hash_ids) == math.ceil(r.input_length / SPEC.block_tokens)
        assert SPEC.output_tokens[0] <= r.output_length <= SPEC.output_tokens[1]
        assert r.input_length >= SPEC.system_prompt_tokens[0] + SPEC.user_tokens[0]
        assert len(set(r.hash_ids)) == len(r.hash_ids)
    path = tmp_path / "generated.jsonl"
    write_trace(requests, path)
    assert load_trace(path) == requests


def test_ids_are_chained_and_reused_the_way_chats_reuse_them():
    requests = generate(SPEC)
    prefix_of: dict[int, tuple[int, ...]] = {}
    for r in requests:
        for depth, h in enumerate(r.hash_ids):
            assert prefix_of.setdefault(h, r.hash_ids[:depth]) == r.hash_ids[:depth], "an id names one prefix"
    uses = Counter(h for r in requests for h in r.hash_ids)
    first_blocks = Counter(r.hash_ids[0] for r in requests)
    assert len(first_blocks) <= SPEC.system_prompts, "every prompt opens with a shared system prompt block"
    # Multi-turn: the last full block of a prompt, past any system prompt, comes back in a later turn.
    system_blocks = SPEC.system_prompt_tokens[1] // SPEC.block_tokens
    last_full = [
        r.hash_ids[r.input_length // SPEC.block_tokens - 1]
        for r in requests
        if r.input_length // SPEC.block_tokens > system_blocks
    ]
    assert sum(uses[h] > 1 for h in last_full) > 0.3 * len(last_full)
    tails = [r.hash_ids[-1] for r in requests if r.input_length % SPEC.block_tokens]
    assert tails and all(uses[h] == 1 for h in tails), "a partial last block grows in the next turn: a new id"
    assert sum(1 for c in uses.values() if c == 1) > 0.2 * len(uses), "many blocks are never reused"


@pytest.mark.parametrize(
    "field, value",
    [
        ("mean_turns", 0.5),
        ("conversations", -1),
        ("system_prompts", 0),
        ("user_tokens", (10, 5)),
        ("document_chance", 1.5),
    ],
)
def test_bad_parameters(field, value):
    with pytest.raises(ValueError, match=field):
        ChatWorkload(**{field: value})
