"""A standalone stack's KV events on its own ZMQ endpoint (``kvtier/event_publisher.py``), read by a real
subscriber: batches numbered without gaps whose events, applied in order, say exactly what each tier
holds; a replay gives a late subscriber what it missed; malformed replay requests, a subscriber that
never reads, an endpoint taken and a backlog nobody sends are each met without harm."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings, strategies as st

from helpers.kv_events import Subscriber, apply, decode
from helpers.ports import free_port
from kvtier import KVTier
from kvtier.core.errors import ConfigError

BLOCK = 4096


def config(tmp_path, **events) -> dict:
    return {
        "block_tokens": 4,
        "block_bytes": BLOCK,
        "tiers": [
            {"medium": "host", "capacity_blocks": 4, "eviction": "lru"},
            {"medium": "disk", "path": str(tmp_path / "disk"), "capacity_blocks": 8, "eviction": "lru"},
        ],
        "events": {
            "endpoint": f"ipc://{tmp_path}/events",
            "replay_endpoint": f"ipc://{tmp_path}/replay",
            "interval": 0.01,
            **events,
        },
    }


def keys(*ids: int) -> list[bytes]:
    return [i.to_bytes(2, "big") * 8 for i in ids]


def store(kv: KVTier, ids) -> None:
    blocks = np.stack([np.full(BLOCK, i % 251, np.uint8) for i in ids])
    result = kv.store(keys(*ids), blocks).result(10)
    assert result.stored + result.present == len(ids)
    kv.wait_idle()
    assert kv.publisher is not None and kv.publisher.flush()


def held(kv: KVTier) -> dict[tuple[str, None], set[bytes]]:
    media = {"host": "CPU", "disk": "STORAGE"}
    return {(media[tier.name], None): set(tier.ready_keys()) for tier in kv.stack.tiers}


def test_a_subscriber_sees_numbered_batches_that_say_what_each_tier_holds(tmp_path, rng):
    with KVTier.open(config(tmp_path)) as kv, Subscriber(f"ipc://{tmp_path}/events") as sub:
        sub.connected(lambda: store(kv, [1000]))
        sub.drain()
        view = held(kv)  # (what the subscriber missed before it was connected)
        numbers = []
        for _ in range(30):
            store(kv, [int(i) for i in rng.choice(30, size=int(rng.integers(1, 4)), replace=False)])
            for _, seq, payload in sub.drain(0.1):
                numbers.append(seq)
                apply(view, decode(payload))
            assert {where: view.get(where, set()) for where in held(kv)} == held(kv)
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), "no gaps"
        stats = kv.stats()["events"]
        assert stats["batches"] >= len(numbers) and stats["stored"] > 0 and stats["removed"] > 0
        assert stats["lost"] == 0


def test_blocks_stored_by_token_ids_are_announced_with_their_tokens_chained_to_their_parents(tmp_path, rng):
    """On every tier: the host tier that took them, the disk tier they were pushed down to (the tokens
    kept while a tier holds the block, let go once none does); blocks stored by key carry none."""
    prompts = [[int(t) for t in rng.integers(0, 50_000, 12)] for _ in range(4)]  # 3 blocks each
    with KVTier.open(config(tmp_path)) as kv, Subscriber(f"ipc://{tmp_path}/events") as sub:
        sub.connected(lambda: store(kv, [1000]))
        sub.drain()
        expected = {}
        for prompt in prompts:  # 12 blocks over a host tier of 4 and a disk tier of 8
            chain = kv.keys(prompt)
            expected.update(
                {key: (prompt[i * 4 : (i + 1) * 4], chain[i - 1] if i else None) for i, key in enumerate(chain)}
            )
            kv.store(prompt, np.zeros((3, BLOCK), np.uint8)).result(10)
            kv.wait_idle()
        store(kv, [7])  # by key
        stored = [e for _, _, payload in sub.drain() for e in decode(payload) if e["type"] == "BlockStored"]
        announced = {m: set() for m in ("CPU", "STORAGE")}
        by_key = set(keys(1000, 7))
        for event in stored:
            block_keys = event["block_hashes"]
            if block_keys[0] in by_key:
                assert set(block_keys) <= by_key and (event["token_ids"], event["parent_block_hash"]) == ([], None)
                continue
            tokens = [t for key in block_keys for t in expected[key][0]]
            assert (event["token_ids"], event["parent_block_hash"]) == (tokens, expected[block_keys[0]][1])
            assert all(expected[key][1] == before for before, key in zip(block_keys, block_keys[1:], strict=False))
            announced[event["medium"]].update(block_keys)
        assert announced["CPU"] == set(expected) and len(announced["STORAGE"]) >= 8  # (demoted, with their tokens)
        kept = {key for tier in kv.stack.tiers for key in tier.ready_keys()} - by_key
        assert len(kv.publisher.tokens) == len(kept)  # (those of blocks no tier holds let go)


def test_a_late_subscriber_gets_what_it_missed_from_the_replay_endpoint(tmp_path):
    with KVTier.open(config(tmp_path)) as kv:
        for i in range(5):
            store(kv, [i])
        with Subscriber(f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay") as sub:
            missed = sub.replay(0)
            assert [seq for _, seq, _ in missed] == list(range(len(missed))) and len(missed) >= 1
            view: dict = {}
            for _, _, payload in missed:
                apply(view, decode(payload))
            assert view == held(kv)
            assert [seq for _, seq, _ in sub.replay(len(missed) - 1)] == [len(missed) - 1]
            assert sub.replay(len(missed) + 100) == []


def test_the_replay_buffer_keeps_the_latest_batches(tmp_path):
    with KVTier.open(config(tmp_path, replay_batches=3)) as kv:
        for i in range(6):
            store(kv, [i])  # (a batch each)
        with Subscriber(f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay") as sub:
            sent = kv.stats()["events"]["batches"]
            assert [seq for _, seq, _ in sub.replay(0)] == [sent - 3, sent - 2, sent - 1]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.lists(st.binary(max_size=12), min_size=1, max_size=4))
def test_a_malformed_replay_request_gets_the_end_marker_and_publishing_goes_on(tmp_path_factory, frames):
    tmp_path = tmp_path_factory.mktemp("malformed")
    with KVTier.open(config(tmp_path)) as kv:
        store(kv, [1])
        with Subscriber(f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay") as sub:
            well_formed = len(frames) == 2 and frames[0] == b"" and len(frames[1]) == 8
            got = sub.replay(0, frames)
            assert well_formed or got == []
            sub.connected(lambda: store(kv, [2, 3]))  # (still publishing)
            assert len(sub.replay(0)) >= 1


def test_an_oversized_replay_request_drops_only_its_sender(tmp_path):
    with KVTier.open(config(tmp_path)) as kv:
        store(kv, [1])
        with Subscriber(f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay") as sub:
            hostile = sub.context.socket(zmq.DEALER)
            hostile.connect(f"ipc://{tmp_path}/replay")
            hostile.send_multipart([b"", b"x" * (8 << 20)])  # 8 MiB where 8 bytes are asked for
            assert not hostile.poll(500), "no answer to an oversized request"
            hostile.close(linger=0)
            assert len(sub.replay(0)) >= 1  # (others are still answered)
            sub.connected(lambda: store(kv, [2, 3]))  # (and publishing goes on)


def test_a_subscriber_that_never_reads_does_not_hold_up_stores_or_close(tmp_path):
    with Subscriber(f"ipc://{tmp_path}/events"):  # (connected, never reading)
        kv = KVTier.open(config(tmp_path, max_pending_blocks=1 << 20))
        for i in range(300):
            store(kv, [i % 40, 40 + i % 7])  # (each waits for its batch to go out)
        started = time.monotonic()
        kv.close()
        assert time.monotonic() - started < 5.0
        assert kv.stats()["events"]["batches"] > 0 and kv.stats()["events"]["lost"] == 0


def test_a_backlog_past_its_bound_is_forgotten_and_counted(tmp_path):
    kv = KVTier.open(config(tmp_path, interval=5.0, max_pending_blocks=3))
    kv.store(keys(1, 2, 3, 4), np.zeros((4, BLOCK), np.uint8)).result(10)  # (4 keys wait: more than 3)
    kv.close()  # (sends what waits)
    assert kv.stats()["events"]["lost"] >= 4


def test_the_backlog_batch_begins_with_all_blocks_cleared(tmp_path):
    with KVTier.open(config(tmp_path, max_pending_blocks=3, interval=0.5)) as kv:
        with Subscriber(f"ipc://{tmp_path}/events") as sub:
            sub.connected(lambda: store(kv, [100]))
            sub.drain()
            kv.store(keys(1, 2, 3, 4), np.zeros((4, BLOCK), np.uint8)).result(10)
            kv.wait_idle()
            batches = sub.drain(1.0)
            events = [event for _, _, payload in batches for event in decode(payload)]
            assert events[0] == {"type": "AllBlocksCleared"}


def test_an_endpoint_taken_is_a_config_error_and_nothing_stays_open(tmp_path, monkeypatch):
    """The publisher's wake-up pipe is closed whether its open failed or it was closed after use, and a
    second close closes nothing (the numbers may be another file's by then). Its own descriptors are
    followed, closed on this thread: other threads of a test process open and close theirs meanwhile."""
    opened: list[int] = []
    closed: list[int] = []  # on this thread
    pipe, close, me = os.pipe, os.close, threading.get_ident()
    monkeypatch.setattr(os, "pipe", lambda: (ends := pipe(), opened.extend(ends))[0])
    monkeypatch.setattr(os, "close", lambda fd: (threading.get_ident() == me and closed.append(fd), close(fd))[1])
    port = free_port()
    taken = zmq.Context().socket(zmq.PUB)
    taken.bind(f"tcp://127.0.0.1:{port}")
    try:
        with pytest.raises(ConfigError, match="events: cannot publish"):
            KVTier.open(config(tmp_path, endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=None))
        assert len(opened) == 2 and set(opened) <= set(closed)
        since = len(closed)
        with KVTier.open(config(tmp_path)) as kv:  # (the disk tier's directory was let go)
            store(kv, [1])
        assert len(opened) == 4 and set(opened[2:]) <= set(closed[since:])  # (nor a publisher closed after use)
        since = len(closed)
        kv.close()
        assert not set(opened) & set(closed[since:])
    finally:
        taken.close(linger=0)


def test_events_are_off_unless_configured(tmp_path):
    cfg = config(tmp_path)
    del cfg["events"]
    with KVTier.open(cfg) as kv:
        assert kv.publisher is None and "events" not in kv.stats()
        assert all(tier.watcher is None for tier in kv.stack.tiers)


@pytest.mark.parametrize(
    "events, message",
    [
        ({"endpoint": "http://x"}, "endpoint"),
        ({"endpoint": "tcp://127.0.0.1:1", "interval": 0}, "interval"),
        ({"endpoint": "tcp://127.0.0.1:1", "max_pending_blocks": 0}, "max_pending_blocks"),
        ({"endpoint": "tcp://127.0.0.1:1", "hwm": 5}, "hwm"),
    ],
)
def test_a_bad_events_config_is_refused_naming_its_key(tmp_path, events, message):
    cfg = config(tmp_path)
    cfg["events"] = events
    with pytest.raises(ConfigError, match=message):
        KVTier.open(cfg)
