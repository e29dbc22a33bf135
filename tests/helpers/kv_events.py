"""A router's end of kvtier's KV events (``kvtier/event_publisher.py``): a real ZMQ subscriber and replay
client, as llm-d's indexer or any subscriber of vLLM's events connects, and the view it keeps."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

END_OF_REPLAY = -1
WAIT_S = 10.0


class Subscriber:
    """SUB on ``endpoint`` (every topic); ``replay`` asks ``replay_endpoint`` for what it missed. Each
    batch comes back as (topic, seq, payload bytes); ``decode`` reads a payload (plain msgpack here; the
    vLLM tests pass vLLM's own decoder)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None) -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sub.close(linger=0)
        self.context.term()

    def connected(self, publish: Callable[[], None]) -> None:
        """Wait until the SUB socket gets what the publisher sends (a SUB misses whatever was sent before
        its subscription reached the publisher): ``publish()`` makes something to send, again and again."""
        deadline = time.monotonic() + WAIT_S
        while not self.sub.poll(100):
            assert time.monotonic() < deadline, "the subscriber never received a batch"
            publish()

    def receive(self, timeout: float = WAIT_S) -> tuple[bytes, int, bytes] | None:
        """The next batch, or None when none came within ``timeout``."""
        if not self.sub.poll(int(timeout * 1000)):
            return None
        topic, seq, payload = self.sub.recv_multipart()
        return topic, int.from_bytes(seq, "big"), payload

    def drain(self, quiet: float = 0.5) -> list[tuple[bytes, int, bytes]]:
        """Every batch until none came for ``quiet`` seconds."""
        out = []
        while (got := self.receive(quiet)) is not None:
            out.append(got)
        return out

    def replay(self, start: int, frames: list[bytes] | None = None) -> list[tuple[bytes, int, bytes]]:
        """Ask for every batch from ``start`` on (or send ``frames`` as the request: a malformed one);
        the batches up to the end marker."""
        assert self.replay_endpoint is not None
        dealer = self.context.socket(zmq.DEALER)
        try:
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart(frames if frames is not None else [b"", start.to_bytes(8, "big")])
            out = []
            while True:
                assert dealer.poll(int(WAIT_S * 1000)), "no end marker from the replay endpoint"
                _, topic, seq, payload = dealer.recv_multipart()
                number = int.from_bytes(seq, "big", signed=True)
                if number == END_OF_REPLAY:
                    return out
                out.append((topic, number, payload))
        finally:
            dealer.close(linger=0)


def decode(payload: bytes) -> list[Any]:
    """A batch as msgpack: ``[ts, events, data_parallel_rank]``; its events."""
    ts, events, _ = msgpack.unpackb(payload)
    assert isinstance(ts, float)
    return events


def apply(view: dict[tuple[str, str | None], set[bytes]], events: list[dict]) -> None:
    """Update a router's view, per (medium, ownership), with decoded events (AllBlocksCleared: forget all)."""
    for event in events:
        if event["type"] == "AllBlocksCleared":
            view.clear()
            continue
        held = view.setdefault((event["medium"], event.get("ownership")), set())
        if event["type"] == "BlockStored":
            held.update(event["block_hashes"])
        else:
            held.difference_update(event["block_hashes"])
