"""The remote tier's YAML schema: the tier's own keys and each store backend's settings (Mooncake Store,
Redis/Valkey), beside the clients that use them, so that kvtier's core knows no store.
"""

from __future__ import annotations

from typing import ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from kvtier.core.config import (
    ConfigModel,
    EnvName,
    ProblemList,
    SizeOrZero,
    StackConfig,
    TierConfigBase,
    env_name_hint,
)
from kvtier.core.config_messages import Problems
from kvtier.core.media import HOST


class MooncakeConfig(ConfigModel):
    """How to reach a Mooncake Store: its master and metadata server, and what this process contributes."""

    master: str = Field(
        pattern=r"^[^\s:/]+:\d{1,5}$", description="host:port (the Mooncake master's RPC address, e.g. 127.0.0.1:50051)"
    )
    metadata_server: str = Field(
        pattern=r"^[a-z][a-z0-9+.-]*://\S+$", description="a URL, e.g. http://127.0.0.1:8080/metadata"
    )
    # Memory this process lends the store (0: none; blocks then live in other clients' segments, e.g. a
    # standalone mooncake_client: a process that exits takes the blocks in its segment with it).
    segment_size: SizeOrZero = 0
    protocol: Literal["tcp", "rdma"] = "tcp"
    local_hostname: str = Field("127.0.0.1", min_length=1)  # the address peers reach this process at


class RedisConfig(ConfigModel):
    """How to reach a Redis or Valkey server. The password comes from the environment (``password_env``)."""

    url: str = Field(
        pattern=r"^rediss?://\S+$",  # redis://host:port/db, or rediss:// for TLS
        description="a redis:// or rediss:// URL, e.g. redis://127.0.0.1:6379/0",
    )
    password_env: EnvName | None = Field(None, description=env_name_hint("KVTIER_REDIS_PASSWORD"))
    pool_size: int = Field(4, ge=1)  # connections open at once for loads and stores (calls in parallel)
    ca_file: str | None = Field(None, min_length=1)  # the CA that signs a rediss:// server's certificate

    @field_validator("url")
    @classmethod
    def _no_password(cls, value: str) -> str:
        if urlsplit(value).password is not None:
            raise ValueError(
                "the URL carries a password; remove it and name an environment variable holding "
                "it in password_env (a secret never belongs in a config file)"
            )
        return value

    @model_validator(mode="after")
    def _ca_for_tls(self) -> RedisConfig:
        if self.ca_file is not None and not self.url.startswith("rediss://"):
            raise ValueError("ca_file applies to TLS connections only; use a rediss:// URL or remove ca_file")
        return self


REMOTE_BACKENDS = ("mooncake", "redis")
HEADER_ROOM = 4096
"""Bytes before each host slot of a stack with a remote tier, for a record's header, so header and block
move to and from the store as one piece (a separate header piece cost Mooncake's transfers 4-9 ms per
64 x 2 MiB batch); a page, so slots stay page-aligned."""


class RemoteTierConfig(TierConfigBase):
    """A store shared with other engines (Mooncake Store, Redis/Valkey): always the last tier.

    It has no capacity, eviction policy or watermark: the store manages its own memory and evicts by
    itself. ``placement`` is its own, whatever the stack's: ``write_through`` (default) copies every
    block to the store as soon as it is in host memory; ``write_back`` sends only the host tier's
    victims. Secrets come from environment variables named here (``auth_key_env``, the backend's
    ``password_env``), never from the file.
    """

    keyed: ClassVar[bool] = True
    header_room_above: ClassVar[int] = HEADER_ROOM

    medium: Literal["remote"]
    backend: Literal["mooncake", "redis"]
    timeout: float = Field(2.0, gt=0)  # seconds any call to the store may take; then it is a miss or a drop
    prefix: str = Field(
        "kvtier",
        pattern=r"^\S+$",  # record names start with it
        description="a name without spaces, e.g. kvtier",
    )
    # a MAC secret: records without a valid MAC are misses
    auth_key_env: EnvName | None = Field(None, description=env_name_hint("KVTIER_REMOTE_MAC_KEY"))
    placement: Literal["write_through", "write_back"] = "write_through"
    mooncake: MooncakeConfig | None = None
    redis: RedisConfig | None = None

    @model_validator(mode="after")
    def _store_owns_its_memory(self) -> RemoteTierConfig:
        problems: ProblemList = []
        for key, what in (
            ("capacity", "capacity"),
            ("capacity_blocks", "capacity"),
            ("eviction", "eviction policy"),
            ("watermark", "watermark"),
        ):
            if getattr(self, key) is not None:
                problems.append(
                    (
                        (key,),
                        f"a remote tier has no {what}: the store manages its own memory and "
                        f"evicts by itself (size it on the server); remove {key}",
                    )
                )
        for backend in REMOTE_BACKENDS:
            given = getattr(self, backend) is not None
            if backend == self.backend and not given:
                problems.append(
                    (
                        (),
                        f"missing key {backend!r}: the {backend} backend's settings "
                        f"({', '.join(_BACKEND_CONFIGS[backend].model_fields)})",
                    )
                )
            if backend != self.backend and given:
                problems.append(
                    (
                        (backend,),
                        f"settings for {backend} but the backend is {self.backend}; remove "
                        f"them or set backend: {backend}",
                    )
                )
        if problems:
            raise Problems(problems)
        return self

    def stack_problems(self, stack: StackConfig, i: int) -> ProblemList:
        """Where a remote tier may sit: last (nothing of ours lies below a store others evict from), with
        a host tier above it (blocks reach the store from host memory and come back through it), and
        with ``write_back`` directly below the host tier (a disk tier's victims would need a copy
        through host memory to reach the store)."""
        problems: ProblemList = []
        if i != len(stack.tiers) - 1:
            problems.append(
                (
                    ("medium",),
                    "a remote tier may only be the last tier: the store evicts and loses blocks by itself, so no "
                    "tier of kvtier's can sit below it",
                )
            )
        if not any(t.medium == HOST for t in stack.tiers):
            problems.append(
                (
                    ("medium",),
                    "a remote tier needs a host tier above it: blocks reach the store from host memory and come "
                    "back through it",
                )
            )
        elif self.placement == "write_back" and i > 0 and stack.tiers[i - 1].medium != HOST:
            problems.append(
                (
                    ("placement",),
                    f"write_back needs the host tier directly above the remote tier (tiers[{i - 1}] is "
                    f"{stack.tiers[i - 1].medium}): its victims would need a copy through host memory to reach "
                    f"the store; use write_through",
                )
            )
        return problems


_BACKEND_CONFIGS: dict[str, type[ConfigModel]] = {"mooncake": MooncakeConfig, "redis": RedisConfig}


def remote_config(stack: StackConfig) -> RemoteTierConfig | None:
    """The remote tier's settings, if the stack has one (it is the last tier)."""
    last = stack.tiers[-1]
    return last if isinstance(last, RemoteTierConfig) else None
