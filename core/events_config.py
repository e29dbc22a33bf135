"""The ``events:`` section of a stack's YAML: where its tiers' KV events are published
(``kvtier/event_publisher.py``); a model of its own, beside the stack's schema (``core/config.py``)."""

from __future__ import annotations

from pydantic import Field

from kvtier.core.tier_config import ConfigModel


class EventsConfig(ConfigModel):
    """KV events of the stack's tiers on a ZMQ endpoint of its own (``kvtier/event_publisher.py``), in
    vLLM's format: where a router subscribes (``endpoint``, bound: ``tcp://host:port`` or ``ipc://path``)
    and asks for what it missed (``replay_endpoint``, optional), ``topic`` (the first frame), how often
    the tiers' changes go out (``interval`` seconds: one batch each), how many batches are kept for replay,
    and how many blocks' changes may wait before they are forgotten (a subscriber is then told to
    forget this engine's blocks)."""

    endpoint: str = Field(pattern=r"^(tcp|ipc)://.+")
    replay_endpoint: str | None = Field(None, pattern=r"^(tcp|ipc)://.+")
    topic: str = ""
    interval: float = Field(0.05, gt=0, le=10)
    replay_batches: int = Field(10_000, ge=0)
    max_pending_blocks: int = Field(1 << 20, ge=1)
