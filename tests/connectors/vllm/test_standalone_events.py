"""A standalone stack's KV events (``kvtier/event_publisher.py``) as a subscriber of vLLM's events reads
them: every batch decodes with vLLM's own ``KVEventBatch`` decoder into vLLM's event classes, with the
medium, locality and block size the stack's tiers have."""

from __future__ import annotations

import msgspec
import numpy as np
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from helpers.kv_events import Subscriber
from kvtier import KVTier

BLOCK = 4096


def test_every_batch_decodes_into_vllms_event_classes(tmp_path):
    config = {
        "block_tokens": 16,
        "block_bytes": BLOCK,
        "tiers": [
            {"medium": "host", "capacity_blocks": 2, "eviction": "lru"},
            {"medium": "disk", "path": str(tmp_path / "disk"), "capacity_blocks": 4, "eviction": "lru"},
        ],
        "events": {"endpoint": f"ipc://{tmp_path}/ev", "replay_endpoint": f"ipc://{tmp_path}/re", "topic": "kv"},
    }
    keys = [bytes([i]) * 16 for i in range(6)]
    with KVTier.open(config) as kv:
        for i in range(0, 6, 2):
            kv.store(keys[i : i + 2], np.full((2, BLOCK), i, np.uint8)).result(10)
            kv.wait_idle()
        assert kv.publisher is not None and kv.publisher.flush()
        with Subscriber(f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/re") as sub:
            batches = sub.replay(0)
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    events = [event for topic, _, payload in batches for event in decoder.decode(payload).events]
    assert {topic for topic, _, _ in batches} == {b"kv"}
    assert all(isinstance(event, (BlockStored, BlockRemoved)) for event in events)
    assert not any(isinstance(event, AllBlocksCleared) for event in events)
    stored = [event for event in events if isinstance(event, BlockStored)]
    assert {(e.medium, e.locality, e.ownership, e.block_size) for e in stored} == {
        ("CPU", "LOCAL", None, 16),
        ("STORAGE", "LOCAL", None, 16),
    }
    on_host = {key for e in stored if e.medium == "CPU" for key in e.block_hashes}
    assert on_host == set(keys)
    removed = {key for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU" for key in e.block_hashes}
    assert removed == set(keys[:4]), "the host tier of 2 blocks let go of the first four"
