"""A stack's KV events on a ZMQ endpoint of its own, in vLLM's wire format: for the doors that have no
publisher (a standalone ``KVTier``, SGLang's backend), so that a prefix-aware router (llm-d's indexer,
Dynamo's KV router) subscribes to kvtier as it does to vLLM.

The wire, as vLLM 0.33's ``ZmqEventPublisher`` sends it and subscribers read it: a PUB socket sends each
batch as three frames, the topic, a sequence number (8 bytes, big-endian: 0, 1, 2, ... one per batch, no
gaps) and the batch in msgpack, ``[ts, [event, ...], data_parallel_rank]``, each event a map tagged by
``"type"`` (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``) with vLLM's field names. A ROUTER
socket (``replay_endpoint``) answers a request holding a start sequence number (8 bytes, big-endian)
with every batch it still keeps from there on (frames: empty, topic, sequence number, batch), then an
end marker (sequence number -1, empty batch).

It never slows a store or a load: the tiers note keys (``core/events.py``, bounded), and this
publisher's thread takes them every ``interval`` seconds, as one batch. A subscriber that does not keep
up loses batches at the socket's high-water mark (ZMQ drops, nothing waits) and asks for them again by
sequence number. Keys noted beyond the bound are forgotten: the next batch begins with
``AllBlocksCleared``, after which the subscriber knows only what this engine stores or drops from then on.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Any

import msgpack

from kvtier.core.errors import ConfigError
from kvtier.core.events import Batch, BlockEvents, BlockTokens, HeldTokens, Run
from kvtier.core.events_config import EventsConfig
from kvtier.core.tier import Tier

log = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
REQUEST_BYTES = 64
"""The most a replay request's frame may hold (8 bytes are asked for): ZMQ drops a peer that sends more,
before anything of it is kept."""
HIGH_WATER_MARK = 100_000
"""Batches a PUB socket queues for a subscriber before it drops (ZMQ's high-water mark)."""


def for_rank(config: EventsConfig, offset: int) -> EventsConfig:
    """``config`` for the ``offset``-th of several processes that publish from one config (SGLang's
    ranks): a TCP endpoint's port plus ``offset``, an IPC path with ``-offset`` appended; unchanged for 0."""
    if offset == 0:
        return config

    def moved(endpoint: str | None) -> str | None:
        if endpoint is None:
            return None
        if endpoint.startswith("ipc://"):
            return f"{endpoint}-{offset}"
        address, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ConfigError(f"events: {endpoint!r}: several ranks publish, so give a port (they use port + rank)")
        return f"{address}:{int(port) + offset}"

    return config.model_copy(
        update={"endpoint": moved(config.endpoint), "replay_endpoint": moved(config.replay_endpoint)}
    )


def import_zmq() -> Any:
    """pyzmq, which only a stack with ``events`` needs."""
    try:
        import zmq
    except ImportError as exc:
        raise ConfigError("events: needs pyzmq; pip install 'kvtier[events]'") from exc
    return zmq


class EventPublisher:
    """Publishes the KV events of ``tiers`` as ``config`` says, from a thread of its own, until ``close``.
    ``block_tokens``: the tokens a block holds (each BlockStored says it). Raises ConfigError when an
    endpoint cannot be bound."""

    def __init__(self, config: EventsConfig, tiers: list[Tier], block_tokens: int) -> None:
        self.config = config
        self.block_tokens = block_tokens
        self.events = BlockEvents(config.max_pending_blocks)
        self.tokens = HeldTokens(config.max_pending_blocks)  # what a store by token ids said (``note``)
        self.counts = {"batches": 0, "stored": 0, "removed": 0, "lost": 0}
        self._replay: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=config.replay_batches)
        self._stop = threading.Event()
        self._closing = threading.Lock()
        self._hurry = threading.Event()
        self._rounds = threading.Condition()
        self._started = self._taken = 0  # takes from ``events`` begun, and ended (sent, or nothing to send)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._wake_read, self._wake_write = os.pipe()  # a byte written wakes the thread (flush, close)
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        zmq = import_zmq()
        self._thread = threading.Thread(target=self._run, args=(zmq,), name="kvtier-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._close_wake()
            raise ConfigError(f"events: cannot publish: {self._error}") from self._error
        self.events.watch(tiers)

    def note(self, keys: list[bytes], tokens: list[int]) -> None:
        """The blocks of ``keys`` hold ``tokens`` (``block_tokens`` each, in order) and are about to be
        stored: their BlockStored events carry them, chained each to the one before."""
        n, whole = self.block_tokens, tuple(tokens)
        parents = [None, *keys[:-1]]
        self.tokens.note(keys, [BlockTokens(whole[i * n : i * n + n], parents[i]) for i in range(len(keys))])

    def stats(self) -> dict[str, int]:
        """Batches sent, blocks announced stored and removed, and changes forgotten (never sent)."""
        return dict(self.counts)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every change noted before the call has gone out (at once, not at the next
        interval); False when the publisher's thread did not get to it within ``timeout``."""
        with self._rounds:
            target = self._started + 1  # (one under way may have begun before the call)
            self._hurry.set()
            self._wake()
            return self._rounds.wait_for(lambda: self._taken >= target or not self._thread.is_alive(), timeout)

    def close(self) -> None:
        """Send what is noted still, then stop (and unbind); a second call does nothing (its descriptors,
        closed once, may be another file's by then)."""
        with self._closing:
            if self._stop.is_set():
                return
            self._stop.set()
            self._wake()
            self._thread.join()
            self._close_wake()

    def _close_wake(self) -> None:
        for fd in (self._wake_read, self._wake_write):
            os.close(fd)

    def _wake(self) -> None:
        try:
            os.write(self._wake_write, b"!")
        except BlockingIOError:  # (the pipe is full of wake-ups: the thread wakes anyway)
            pass

    # --- the publisher's thread -------------------------------------------------------------------

    def _run(self, zmq: Any) -> None:
        context = zmq.Context()
        sockets = []
        try:
            pub = context.socket(zmq.PUB)
            sockets.append(pub)
            pub.set_hwm(HIGH_WATER_MARK)
            pub.bind(self.config.endpoint)
            router = None
            if self.config.replay_endpoint is not None:
                router = context.socket(zmq.ROUTER)
                sockets.append(router)
                router.setsockopt(zmq.SNDHWM, 2 * (self.config.replay_batches + 1))  # a whole replay fits
                router.setsockopt(zmq.MAXMSGSIZE, REQUEST_BYTES)  # (a peer sending more is disconnected)
                router.bind(self.config.replay_endpoint)
        except Exception as exc:
            self._error = exc
            self._ready.set()
            for sock in sockets:
                sock.close(linger=0)
            context.term()
            return
        self._ready.set()
        try:
            self._serve(zmq, pub, router)
        except Exception:  # (the stack goes on without events; flush() returns)
            log.exception("kvtier events: the publisher stopped; no more events are sent")
        finally:
            for sock in sockets:
                sock.close(linger=0)
            context.term()

    def _serve(self, zmq: Any, pub: Any, router: Any) -> None:
        """Sleeps until a replay request, a wake-up (flush, close) or the next interval, whichever comes
        first."""
        topic = self.config.topic.encode()
        poller = zmq.Poller()
        poller.register(self._wake_read, zmq.POLLIN)
        if router is not None:
            poller.register(router, zmq.POLLIN)
        seq = 0
        next_at = time.monotonic()
        while True:
            ready = dict(poller.poll(max(0.0, next_at - time.monotonic()) * 1000))
            if self._wake_read in ready:
                os.read(self._wake_read, 4096)
            stopping = self._stop.is_set()
            if router in ready:
                self._answer_replay(router, topic)
            if time.monotonic() >= next_at or stopping or self._hurry.is_set():
                with self._rounds:
                    self._hurry.clear()
                    self._started += 1
                next_at = time.monotonic() + self.config.interval
                payload = self._encode(self.events.take())
                if payload is not None:
                    pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                    self._replay.append((seq, payload))
                    seq += 1
                with self._rounds:
                    self._taken += 1
                    self._rounds.notify_all()
            if stopping:
                return

    def _answer_replay(self, router: Any, topic: bytes) -> None:
        """Every batch kept from the requested sequence number on, then the end marker; a malformed
        request (not three frames, or a number not of 8 bytes) gets nothing but the end marker."""
        frames = router.recv_multipart()
        start = int.from_bytes(frames[2], "big") if len(frames) == 3 and len(frames[2]) == 8 else None
        if start is not None:
            for seq, payload in list(self._replay):
                if seq >= start:
                    router.send_multipart((frames[0], b"", topic, seq.to_bytes(8, "big"), payload))
        router.send_multipart((frames[0], b"", b"", END_OF_REPLAY, b""))

    def _encode(self, batch: Batch) -> bytes | None:
        """The batch in vLLM's msgpack layout; None when nothing happened."""
        events: list[dict[str, Any]] = []
        if batch.lost:
            events.append({"type": "AllBlocksCleared"})
            self.counts["lost"] += batch.lost
        for run in batch.runs:
            events.extend(self._stored(run) if run.stored else [self._removed(run)])
        if not events:
            return None
        self.counts["batches"] += 1
        return msgpack.packb([time.time(), events, None], use_bin_type=True)

    def _removed(self, run: Run) -> dict[str, Any]:
        self.tokens.removed(run.tier, run.keys)
        self.counts["removed"] += len(run.keys)
        return {"type": "BlockRemoved", "block_hashes": run.keys, **_placed(run)}

    def _stored(self, run: Run) -> list[dict[str, Any]]:
        """BlockStored events for a run: one per chain of blocks whose tokens are known (each block's
        parent the one before it; the tokens of all, in order), one for each stretch of blocks whose
        tokens are not (stored by key)."""
        self.counts["stored"] += len(run.keys)
        events: list[dict[str, Any]] = []
        keys: list[bytes] = []  # the last event's, and its tokens (empty: not known)
        tokens: list[int] = []
        last: bytes | None = None
        for key, block in zip(run.keys, self.tokens.stored(run.tier, run.where, run.keys), strict=True):
            if block is None and keys and not tokens:  # (a stretch of blocks whose tokens are not known goes on)
                keys.append(key)
            elif block is not None and tokens and block.parent == last:  # (a chain goes on)
                keys.append(key)
                tokens.extend(block.tokens)
            else:
                keys, tokens = [key], list(block.tokens) if block is not None else []
                events.append(self._stored_event(keys, tokens, block.parent if block is not None else None, run))
            last = key
        return events

    def _stored_event(self, keys: list[bytes], tokens: list[int], parent: bytes | None, run: Run) -> dict[str, Any]:
        return {
            "type": "BlockStored",
            "block_hashes": keys,
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": self.block_tokens,
            "lora_id": None,
            "lora_name": None,
            **_placed(run),
        }


def _placed(run: Run) -> dict[str, Any]:
    """Where the run's blocks live, as vLLM's events say it (no ``ownership`` for this engine's own)."""
    placed = {"medium": run.where.medium, "locality": run.where.locality}
    if run.where.owner is not None:
        placed["ownership"] = run.where.owner
    return placed
