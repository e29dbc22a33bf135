"""The engine tests' shared fixtures: one random-weight model and one reference run (no connector) for
the whole session, whichever of this folder's modules asks first (each engine run costs ~10 s)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    """A random-weight Llama small enough for CPU (head_dim 64: the CPU attention backend needs it)."""
    from vllm_engine.test_engine import make_model

    path = tmp_path_factory.mktemp("tiny-llama")
    make_model(path, seed=0)
    return str(path)


@pytest.fixture(scope="session")
def reference(model_dir) -> list[list[int]]:
    """The tokens the model generates for ``engine_run.prompts()`` without any connector."""
    from vllm_engine.test_engine import run

    return run(model_dir, "none")["tokens"]
