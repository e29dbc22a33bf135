"""The node daemon's YAML: kvtier's usual stack (the machine's tiers, the slab first) plus a ``node``
section saying where the daemon listens, where its slab lives and who may connect.

    node:
      socket: /run/kvtier/node.sock      # the Unix socket engines connect to (its directory must exist)
      slab: /dev/shm/kvtier-node         # the shared memory file (default: /dev/shm/kvtier-node-<uid>)
      hugepages: false                   # ask for transparent huge pages on the slab
      allow_users: [vllm]                # users (names or uids) who may connect, besides the daemon's own
      allow_groups: []                   # groups whose members may connect
      lease: 30                          # seconds a connection may hold a pin or a reservation
      max_held: 0.25                     # the share of the slab's slots one connection may hold at once
      max_connections: 256
      below_wait: 0.2                    # seconds a lookup waits for a store below the slab to answer
    block_bytes: 2MiB                    # the largest block an engine stores (the slab's slot size)
    tiers:
      - medium: host                     # the slab
        capacity: 64GiB
        eviction: adaptive               # the default where the slab is the last tier (lru above a disk tier)
        watermark: {high: 0.95, low: 0.85}
      - medium: disk                     # optional: one disk cache for the machine, below the slab
        path: /var/cache/kvtier-node
        capacity: 1TiB
      - medium: remote                   # optional, last: a store the machines' daemons share
        backend: redis
        redis: {url: "redis://store:6379/0"}

Tiers below the slab take what the slab holds, as it is committed (``write_through``, the only placement
here): a disk tier is one disk cache per machine, its blocks brought back up into the slab when an engine
asks for them (``kvtier.node_daemon``); a remote tier is one store client per machine, shared by machines
whose daemons name the same store, a block many engines want read from it once. A remote tier whose
store's reads land straight in their destination (Mooncake without a ``fetch_buffer``) is refused: a read
past its deadline could land in a slot given out again since.
"""

from __future__ import annotations

import grp
import os
import pwd
from pathlib import Path

from pydantic import Field, ValidationError, field_validator

from kvtier.core.config import StackConfig, load_config
from kvtier.core.config_messages import explain
from kvtier.core.devices import HOST
from kvtier.core.errors import ConfigError, shown
from kvtier.core.strict_yaml import read_yaml
from kvtier.core.tier_config import ConfigModel

ENGINE_KEYS = ("namespace", "fragments", "block_tokens")
"""Stack keys that describe an engine's blocks, not a daemon's: the daemon stores every engine's blocks
under that engine's own keys, so they mean nothing here. (``key_secret_env`` does: the engines' secret,
which the daemon needs only to know the tenants its slab's shares name.)"""


def default_slab() -> str:
    return f"/dev/shm/kvtier-node-{os.geteuid()}"


class NodeSettings(ConfigModel):
    """The ``node`` section (see the module doc)."""

    socket: str = Field(min_length=1)
    slab: str = Field(default_factory=default_slab, min_length=1)
    hugepages: bool = False
    allow_users: list[str | int] = Field(default_factory=list)
    allow_groups: list[str | int] = Field(default_factory=list)
    lease: float = Field(30.0, gt=0)
    max_held: float = Field(0.25, gt=0, le=1)
    max_connections: int = Field(256, ge=1)
    below_wait: float = Field(0.2, gt=0)

    @field_validator("allow_users")
    @classmethod
    def _users(cls, value: list[str | int]) -> list[str | int]:
        for user in value:
            if isinstance(user, str):
                try:
                    pwd.getpwnam(user)
                except KeyError:
                    raise ValueError(f"no user named {user!r} on this machine") from None
        return value

    @field_validator("allow_groups")
    @classmethod
    def _groups(cls, value: list[str | int]) -> list[str | int]:
        for group in value:
            if isinstance(group, str):
                try:
                    grp.getgrnam(group)
                except KeyError:
                    raise ValueError(f"no group named {group!r} on this machine") from None
        return value

    @property
    def allowed_uids(self) -> frozenset[int]:
        """The daemon's own user and ``allow_users``."""
        return frozenset(
            {os.geteuid(), *(u if isinstance(u, int) else pwd.getpwnam(u).pw_uid for u in self.allow_users)}
        )

    @property
    def allowed_gids(self) -> frozenset[int]:
        return frozenset(g if isinstance(g, int) else grp.getgrnam(g).gr_gid for g in self.allow_groups)

    @property
    def others_allowed(self) -> bool:
        """Whether anyone but the daemon's own user may connect (the socket is then open to all; peer
        credentials decide)."""
        return bool(self.allow_groups) or self.allowed_uids != {os.geteuid()}


class NodeConfig:
    """A validated daemon config: ``node`` (its ``NodeSettings``) and ``stack`` (its tiers)."""

    def __init__(self, node: NodeSettings, stack: StackConfig) -> None:
        self.node = node
        self.stack = stack

    @property
    def block_bytes(self) -> int:
        assert self.stack.block_bytes is not None  # (checked by load_node_config)
        return self.stack.block_bytes


def load_node_config(source: str | Path | dict) -> NodeConfig:
    """A daemon config from a YAML file's path or a dict; every mistake is one ConfigError naming its key."""
    name, data = ("config", source) if isinstance(source, dict) else (str(source), read_yaml(Path(source), str(source)))
    if not isinstance(data, dict):
        raise ConfigError(f"{name}: the top level must be a mapping with a 'node' section and the slab's tiers")
    data = dict(data)
    section = data.pop("node", None)
    if section is None:
        raise ConfigError(f"{name}: missing key 'node': where the daemon listens (node: {{socket: PATH}})")
    lines = [
        f"{name}: {key}: describes an engine's blocks, not the daemon's (each engine keeps its own); remove it"
        for key in ENGINE_KEYS
        if key in data
    ]
    try:
        node = NodeSettings.model_validate(section)
    except ValidationError as exc:
        lines += [
            f"{name}: node.{path}: {msg}" if path else f"{name}: node: {msg}"
            for path, msg in explain(exc, NodeSettings, {})
        ]
    if lines:
        raise ConfigError("\n".join(lines))
    if data.get("placement", "write_through") != "write_through":
        raise ConfigError(
            f"{name}: placement: the slab copies every block down as soon as it is committed (write_through): "
            f"write_back would make engines' reservations wait for the tier below; remove placement"
        )
    stack = load_config(data | {"placement": "write_through"}) if "tiers" in data else None
    if stack is None:
        raise ConfigError(f"{name}: missing key 'tiers': the slab, as a host tier with its capacity")
    if stack.block_bytes is None:
        raise ConfigError(f"{name}: missing key 'block_bytes': the largest block an engine stores, e.g. 2MiB")
    if stack.tiers[0].medium != HOST:
        raise ConfigError(
            f"{name}: tiers[0]: the slab is a host tier (medium: host), got {shown(stack.tiers[0].medium)}"
        )
    for i, tier in enumerate(stack.tiers[1:], 1):
        if tier.tenants is not None:
            raise ConfigError(
                f"{name}: tiers[{i}]: tenants: only the slab (tiers[0]) has tenant shares: the tiers below it "
                f"keep what the slab copies down"
            )
    for i, tier in enumerate(stack.tiers[1:], 1):
        if tier.medium == "node":
            raise ConfigError(f"{name}: tiers[{i}]: the daemon serves the node tier; one cannot be below its slab")
        if tier.keyed and not tier.fetches:
            raise ConfigError(
                f"{name}: tiers[{i}]: a store whose reads land straight in their destination (backend "
                f"{shown(getattr(tier, 'backend', tier.medium))}) cannot be below the slab: a read past its "
                f"deadline could write into a slot given to another block since; give Mooncake a fetch_buffer "
                f"(mooncake: {{fetch_buffer: 64MiB}}: reads land in its client's own memory first), or give the "
                f"store to the engines' stacks"
            )
    return NodeConfig(node, stack)
