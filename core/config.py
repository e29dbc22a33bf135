"""The YAML schema of a tier stack, validated when loaded so that every mistake names its key and the fix.

    cfg = load_config("kvtier.yaml")        # or a dict; raises ConfigError with one message
    cfg.tiers[0].medium, cfg.tier_name(0), capacity_in_blocks(cfg.tiers[1], cfg.block_bytes)

The schema is strict: unknown keys, wrong types and out-of-range values are errors rather than being
ignored or coerced, because a silently ignored typo in a cache config shows up later as a cache that
does not do what its author thinks.
"""

from __future__ import annotations

import importlib.resources
import re
import typing
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvtier.core.errors import ConfigError
from kvtier.core.slots import slot_problem, slot_stride
from kvtier.policies import EvictionPolicy, PolicyError, Watermark, check_policy_name, eviction_policy_class

# --- sizes ------------------------------------------------------------------------------------

_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3, "tb": 1000 ** 4,
    "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3, "tib": 1024 ** 4,
}
_UNIT_NAMES = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


def _not_a_size(value: Any) -> ConfigError:
    return ConfigError(f"{_show(value)} is not a size: use a number with a unit, e.g. 512MiB or 8GiB "
                       f"(units: {_UNIT_NAMES})")


def parse_size(value: Any) -> int:
    """Bytes from an int or a string with a unit ("512MiB", "1.5 GiB", "8gb"); units are case-insensitive.

    KB/MB/GB/TB are powers of 1000 and KiB/MiB/GiB/TiB powers of 1024, as on disk labels and in
    ``free -h`` respectively; a bare number string means bytes. The result must be a positive
    whole number of bytes, since a tier cannot hold a fraction of a byte.
    """
    if isinstance(value, bool):
        raise _not_a_size(value)
    if isinstance(value, int):
        if value <= 0:
            raise ConfigError(f"{value!r} is not a positive size in bytes; use e.g. 512MiB or 8GiB")
        return value
    if not isinstance(value, str):
        raise _not_a_size(value)
    match = _SIZE_RE.match(value)
    if match is None or match.group(2).lower() not in _UNITS | {"": 1}:
        raise _not_a_size(value)
    number, unit = match.groups()
    try:
        exact = Decimal(number) * _UNITS.get(unit.lower(), 1)
    except InvalidOperation:  # pragma: no cover - the regex admits only decimal numbers
        raise _not_a_size(value) from None
    if exact <= 0:
        raise ConfigError(f"{_show(value)} is not a positive size; use e.g. 512MiB or 8GiB")
    if exact != exact.to_integral_value():
        raise ConfigError(f"{_show(value)} is not a whole number of bytes ({exact} bytes)")
    return int(exact)


def format_size(n: int) -> str:
    """The shortest exact binary-unit spelling of a byte count, for messages (262144 -> '256KiB')."""
    for unit, factor in (("TiB", 1024 ** 4), ("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if n >= factor and n % factor == 0:
            return f"{n // factor}{unit}"
    return f"{n}B"


Size = Annotated[int, BeforeValidator(parse_size)]


def _size_or_zero(value: Any) -> int:
    """A size, or 0 (``0`` or ``"0"``) for "none at all"."""
    return 0 if value is not False and value in (0, "0") else parse_size(value)


SizeOrZero = Annotated[int, BeforeValidator(_size_or_zero)]
EnvName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
"""The name of an environment variable: secrets enter kvtier only that way, never as values in a config."""


def _show(value: Any, limit: int = 80) -> str:
    """A value as the user would recognise it in a message: its repr, shortened if long."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Problems(ValueError):
    """Errors found by a cross-field check, each at its own key path below the validated model."""

    def __init__(self, problems: list[tuple[tuple[str | int, ...], str]]) -> None:
        super().__init__("; ".join(msg for _, msg in problems))
        self.problems = problems


# --- models -----------------------------------------------------------------------------------


class _Model(BaseModel):
    """Strict and closed: unknown keys and type coercions are errors, so typos never pass silently."""

    model_config = ConfigDict(extra="forbid", strict=True)


class WatermarkConfig(_Model):
    """High and low marks as fractions of a tier's capacity (see kvtier.policies.watermark)."""

    high: float = 0.95
    low: float = 0.85

    @model_validator(mode="after")
    def _ordered(self) -> WatermarkConfig:
        if not 0.0 < self.low < self.high <= 1.0:
            raise ValueError(f"needs 0 < low < high <= 1, got high={self.high!r} low={self.low!r}")
        return self


class TransferConfig(_Model):
    """The transfer backend's knobs; ``threads`` is the CPU backend's copy pool size."""

    threads: int = Field(2, ge=1)
    io_threads: int = Field(8, ge=1)  # positioned reads and writes in flight at once, for disk tiers
    cuda_copy: Literal["auto", "batch", "kernel", "loop"] = "auto"  # how GPU <-> host jobs move (transfers/cuda.py)


class _TierConfig(_Model):
    """Fields every tier shares; the subclasses fix ``medium`` and the capacity rule."""

    medium: str
    name: str | None = Field(None, min_length=1)
    capacity: Size | None = None
    capacity_blocks: int | None = Field(None, gt=0)
    eviction: str | None = None  # None: the measured default for the tier's place (StackConfig)
    watermark: WatermarkConfig | None = None

    @field_validator("eviction")
    @classmethod
    def _known_policy(cls, value: str | None) -> str | None:
        """A registered name or the shape of a dotted path; nothing is imported until the whole config
        validated (``load_config``), so a config that is refused never runs the code it names."""
        if value is None:
            return value
        check_policy_name(value)  # its PolicyError is a ValueError: pydantic names the key
        return value

    def _both_capacities(self) -> None:
        if self.capacity is not None and self.capacity_blocks is not None:
            raise ValueError(f"give capacity or capacity_blocks, not both (capacity={format_size(self.capacity)}, "
                             f"capacity_blocks={self.capacity_blocks})")


class GpuTierConfig(_TierConfig):
    """GPU memory. Capacity may be left out where the engine owns GPU memory (under vLLM)."""

    medium: Literal["gpu"]

    @model_validator(mode="after")
    def _capacity(self) -> GpuTierConfig:
        self._both_capacities()
        return self


class _SizedTierConfig(_TierConfig):
    """A tier kvtier allocates itself, so its size must be given (bytes or blocks)."""

    @model_validator(mode="after")
    def _capacity(self) -> _SizedTierConfig:
        self._both_capacities()
        if self.capacity is None and self.capacity_blocks is None:
            raise ValueError("missing key 'capacity' or 'capacity_blocks'")
        return self


class HostTierConfig(_SizedTierConfig):
    """Pinned host memory."""

    medium: Literal["host"]


class DiskTierConfig(_SizedTierConfig):
    """A local directory holding a preallocated slab file that survives restarts.

    ``compression`` trades CPU for capacity: each block gets ``slot_bytes`` of room on disk instead of
    ``block_bytes`` (see kvtier.tiers.disk.slot_room for the default), so a byte ``capacity`` holds
    more blocks; blocks that do not compress into that room are not stored.
    """

    medium: Literal["disk"]
    path: str = Field(min_length=1)
    o_direct: Literal["auto", "on", "off"] = "auto"
    compression: Literal["none", "lz4", "zstd"] = "none"
    slot_bytes: Size | None = None
    # Trust: by default the directory and slab must be the running user's and writable by nobody else.
    # True accepts a directory a group of services shares on purpose (README, Security): every user who
    # can write it can then plant blocks that this tier loads.
    shared_directory: bool = False
    # True lets the tier overwrite a file named like its slab that is not a kvtier slab; by default that
    # is an error, so a mistyped path never destroys someone's data.
    reinitialise: bool = False

    @field_validator("slot_bytes")
    @classmethod
    def _at_least_a_page(cls, value: int | None) -> int | None:
        if value is not None and value < 4096:
            raise ValueError(f"{format_size(value)} ({value} bytes) is less than 4KiB, the smallest slot")
        return value


class MooncakeConfig(_Model):
    """How to reach a Mooncake Store: its master and metadata server, and what this process contributes."""

    master: str = Field(pattern=r"^[^\s:/]+:\d{1,5}$")  # host:port of mooncake_master's RPC service
    metadata_server: str = Field(pattern=r"^[a-z][a-z0-9+.-]*://\S+$")  # e.g. http://host:8080/metadata
    # Memory this process lends the store (0: none; blocks then live in other clients' segments, e.g. a
    # standalone mooncake_client: a process that exits takes the blocks in its segment with it).
    segment_size: SizeOrZero = 0
    protocol: Literal["tcp", "rdma"] = "tcp"
    local_hostname: str = Field("127.0.0.1", min_length=1)  # the address peers reach this process at


class RedisConfig(_Model):
    """How to reach a Redis or Valkey server. The password comes from the environment (``password_env``)."""

    url: str = Field(pattern=r"^rediss?://\S+$")  # redis://host:port/db, or rediss:// for TLS
    password_env: EnvName | None = None
    pool_size: int = Field(4, ge=1)  # connections open at once for loads and stores (calls in parallel)
    ca_file: str | None = Field(None, min_length=1)  # the CA that signs a rediss:// server's certificate

    @field_validator("url")
    @classmethod
    def _no_password(cls, value: str) -> str:
        if urlsplit(value).password is not None:
            raise ValueError("the URL carries a password; remove it and name an environment variable holding "
                             "it in password_env (a secret never belongs in a config file)")
        return value

    @model_validator(mode="after")
    def _ca_for_tls(self) -> RedisConfig:
        if self.ca_file is not None and not self.url.startswith("rediss://"):
            raise ValueError("ca_file applies to TLS connections only; use a rediss:// URL or remove ca_file")
        return self


REMOTE_BACKENDS = ("mooncake", "redis")
HEADER_ROOM = 4096
"""Bytes before each host slot of a stack with a remote tier, for a record's header (``StackConfig.header_room``)."""


class RemoteTierConfig(_TierConfig):
    """A store shared with other engines (Mooncake Store, Redis/Valkey): always the last tier.

    It has no capacity, eviction policy or watermark: the store manages its own memory and evicts by
    itself. ``placement`` is its own, whatever the stack's: ``write_through`` (default) copies every
    block to the store as soon as it is in host memory; ``write_back`` sends only the host tier's
    victims. Secrets come from environment variables named here (``auth_key_env``, the backend's
    ``password_env``), never from the file.
    """

    medium: Literal["remote"]
    backend: Literal["mooncake", "redis"]
    timeout: float = Field(2.0, gt=0)  # seconds any call to the store may take; then it is a miss or a drop
    prefix: str = Field("kvtier", pattern=r"^\S+$")  # record names start with it
    auth_key_env: EnvName | None = None  # a MAC secret: records without a valid MAC are misses
    placement: Literal["write_through", "write_back"] = "write_through"
    mooncake: MooncakeConfig | None = None
    redis: RedisConfig | None = None

    @model_validator(mode="after")
    def _store_owns_its_memory(self) -> RemoteTierConfig:
        problems: list[tuple[tuple[str | int, ...], str]] = []
        for key, what in (("capacity", "capacity"), ("capacity_blocks", "capacity"), ("eviction", "eviction policy"),
                          ("watermark", "watermark")):
            if getattr(self, key) is not None:
                problems.append(((key,), f"a remote tier has no {what}: the store manages its own memory and "
                                         f"evicts by itself (size it on the server); remove {key}"))
        for backend in REMOTE_BACKENDS:
            given = getattr(self, backend) is not None
            if backend == self.backend and not given:
                problems.append(((), f"missing key {backend!r}: the {backend} backend's settings "
                                     f"({', '.join(_BACKEND_CONFIGS[backend].model_fields)})"))
            if backend != self.backend and given:
                problems.append(((backend,), f"settings for {backend} but the backend is {self.backend}; remove "
                                             f"them or set backend: {backend}"))
        if problems:
            raise _Problems(problems)
        return self


_BACKEND_CONFIGS: dict[str, type[_Model]] = {"mooncake": MooncakeConfig, "redis": RedisConfig}

TIER_CONFIGS: dict[str, type[_TierConfig]] = {"gpu": GpuTierConfig, "host": HostTierConfig, "disk": DiskTierConfig,
                                              "remote": RemoteTierConfig}
TierConfig = Annotated[GpuTierConfig | HostTierConfig | DiskTierConfig | RemoteTierConfig,
                       Field(discriminator="medium")]


UPPER_TIER_EVICTION = "lru"
LAST_TIER_EVICTION = "adaptive"
"""Default policies, from ``kvtier replay`` and bench/policies.py (README, main job): a tier above
another only demotes what it evicts, and recency order did best there; the last tier's evictions
leave the stack, and there LRU with a second-sight admission filter that turns itself on only where
it pays (``adaptive``) was never below LRU on any workload and size measured, where S3-FIFO fed
chains deepest first (the previous default) lost up to 15% to LRU on chat workloads."""


class StackConfig(_Model):
    """One tier stack: block geometry, the ordered tiers (fastest first), placement and transfers.
    A tier without ``eviction`` gets UPPER_TIER_EVICTION, or LAST_TIER_EVICTION when it is last."""

    block_tokens: int = Field(16, gt=0)
    block_bytes: Size | None = None
    fragments: int = Field(1, ge=1)
    namespace: str = ""
    # The name of an environment variable holding a per-deployment secret that keys the block hash
    # (kvtier.core.keys): keys then cannot be computed from a guessed prompt by anyone without it.
    key_secret_env: EnvName | None = None
    tiers: list[TierConfig] = Field(min_length=1)
    placement: Literal["write_through", "write_back"] = "write_back"
    transfer: TransferConfig = Field(default_factory=TransferConfig)

    def tier_name(self, i: int) -> str:
        """Tier ``i``'s name: its ``name`` key, or its medium where none is given."""
        tier = self.tiers[i]
        return tier.name or tier.medium

    def tier_eviction(self, i: int) -> str:
        """Tier ``i``'s eviction policy name: its ``eviction`` key, or the default for its place (the last
        tier kvtier evicts from is the last one above a remote tier, whose store evicts by itself).
        Raises ConfigError for a remote tier."""
        if isinstance(self.tiers[i], RemoteTierConfig):
            raise ConfigError(f"tiers[{i}] is a remote tier: its store evicts by itself, kvtier has no policy for it")
        eviction = self.tiers[i].eviction
        if eviction is not None:
            return eviction
        return LAST_TIER_EVICTION if i == self.last_local_tier else UPPER_TIER_EVICTION

    def tier_policy(self, i: int) -> tuple[EvictionPolicy, Watermark | None]:
        """A new eviction policy for tier ``i`` (``tier_eviction``) and its watermark, if it has one: what
        every place that builds the tier's index (a stack, vLLM's scheduler side) gives it."""
        wm = self.tiers[i].watermark
        return eviction_policy(self.tier_eviction(i))(), Watermark(wm.high, wm.low) if wm is not None else None

    @property
    def last_local_tier(self) -> int:
        """The index of the last tier that is not a remote store (-1: none is)."""
        return max((i for i, tier in enumerate(self.tiers) if not isinstance(tier, RemoteTierConfig)), default=-1)

    @property
    def remote(self) -> RemoteTierConfig | None:
        """The remote tier's settings, if the stack has one (it is the last tier)."""
        last = self.tiers[-1]
        return last if isinstance(last, RemoteTierConfig) else None

    @property
    def header_room(self) -> int:
        """Bytes a host tier keeps before each slot: with a remote tier, room for a record's header, so
        header and block move to and from the store as one piece (a separate header piece cost
        Mooncake's transfers 4-9 ms per 64 x 2 MiB batch); a page, so slots stay page-aligned."""
        return HEADER_ROOM if self.remote is not None else 0

    @model_validator(mode="after")
    def _cross_field(self) -> StackConfig:
        problems: list[tuple[tuple[str | int, ...], str]] = []
        for i, tier in enumerate(self.tiers):
            if not isinstance(tier, RemoteTierConfig):
                tier.eviction = self.tier_eviction(i)
        if self.block_bytes is not None and self.block_bytes % self.fragments:
            problems.append((("fragments",), f"block_bytes {format_size(self.block_bytes)} ({self.block_bytes} "
                                              f"bytes) cannot be cut into {self.fragments} equal fragments; "
                                              f"block_bytes must be divisible by fragments"))
        first_of_medium: dict[str, int] = {}
        first_of_name: dict[str, int] = {}
        for i, tier in enumerate(self.tiers):
            if tier.medium == "gpu" and i != 0:
                problems.append((("tiers", i, "medium"), "a gpu tier may only be the first tier (tiers[0]), "
                                                         "since the engine reads KV from GPU memory"))
            if isinstance(tier, RemoteTierConfig):
                problems.extend(self._remote_problems(i, tier))
            if tier.medium in first_of_medium:
                problems.append((("tiers", i, "medium"), f"a second {tier.medium!r} tier (tiers["
                                                         f"{first_of_medium[tier.medium]}] is one); "
                                                         f"at most one tier per medium"))
            else:
                first_of_medium[tier.medium] = i
                name = self.tier_name(i)  # same-medium duplicates are reported once, above
                if name in first_of_name:
                    problems.append((("tiers", i, "name"), f"{name!r} is already the name of tiers["
                                                           f"{first_of_name[name]}]; tier names must be unique"))
                else:
                    first_of_name[name] = i
            if self.block_bytes is not None and isinstance(tier, DiskTierConfig):
                problem = slot_problem(self.block_bytes, tier.compression, tier.slot_bytes)
                if problem is not None:
                    problems.append((("tiers", i, "slot_bytes"), problem))
                    continue
            if self.block_bytes is not None and tier.capacity is not None:
                need = block_footprint(tier, self.block_bytes)
                if tier.capacity < need:
                    problems.append((("tiers", i, "capacity"),
                                     f"{format_size(tier.capacity)} ({tier.capacity} bytes) holds no block of "
                                     f"block_bytes {format_size(self.block_bytes)}; give at least "
                                     f"{format_size(need)}"))
        if problems:
            raise _Problems(problems)
        return self

    def _remote_problems(self, i: int, tier: RemoteTierConfig) -> list[tuple[tuple[str | int, ...], str]]:
        """Where a remote tier may sit: last (nothing of ours lies below a store others evict from), with
        a host tier above it (blocks reach the store from host memory and come back through it), and
        with ``write_back`` directly below the host tier (a disk tier's victims would need a copy
        through host memory to reach the store)."""
        problems: list[tuple[tuple[str | int, ...], str]] = []
        if i != len(self.tiers) - 1:
            problems.append((("tiers", i, "medium"), "a remote tier may only be the last tier: the store evicts "
                                                     "and loses blocks by itself, so no tier of kvtier's can sit "
                                                     "below it"))
        if not any(t.medium == "host" for t in self.tiers):
            problems.append((("tiers", i, "medium"), "a remote tier needs a host tier above it: blocks reach the "
                                                     "store from host memory and come back through it"))
        elif tier.placement == "write_back" and i > 0 and self.tiers[i - 1].medium != "host":
            problems.append((("tiers", i, "placement"), f"write_back needs the host tier directly above the remote "
                                                        f"tier (tiers[{i - 1}] is {self.tiers[i - 1].medium}): its "
                                                        f"victims would need a copy through host memory to reach "
                                                        f"the store; use write_through"))
        return problems


def block_footprint(tier_cfg: _TierConfig, block_bytes: int, header_room: int = 0) -> int:
    """Bytes of a tier's ``capacity`` one block takes: ``block_bytes`` in memory (and the stack's
    ``header_room`` before each host slot); on disk its slot (a 4 KiB header and ``slot_bytes`` of
    room, which compression makes smaller than the block)."""
    if isinstance(tier_cfg, DiskTierConfig):
        return slot_stride(block_bytes, tier_cfg.compression, tier_cfg.slot_bytes)
    return block_bytes + (header_room if tier_cfg.medium == "host" else 0)


def capacity_in_blocks(tier_cfg: _TierConfig, block_bytes: int | None, header_room: int = 0) -> int | None:
    """How many blocks a tier holds: ``capacity_blocks``, else ``capacity`` divided by what one block
    takes there (``block_footprint``); None if unsized."""
    if tier_cfg.capacity_blocks is not None:
        return tier_cfg.capacity_blocks
    if tier_cfg.capacity is None:
        return None
    if not block_bytes or block_bytes <= 0:
        raise ConfigError(f"tier {tier_cfg.name or tier_cfg.medium!r}: capacity is given in bytes, so block_bytes "
                          f"is needed to count its blocks; got block_bytes={block_bytes!r}")
    return tier_cfg.capacity // block_footprint(tier_cfg, block_bytes, header_room)


# --- loading ----------------------------------------------------------------------------------


def default_config_path() -> Path:
    """The embedded demo configuration (``kvtier/default.yaml``, shipped as package data)."""
    return Path(str(importlib.resources.files("kvtier").joinpath("default.yaml")))


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys, which plain YAML loading would silently let the last one win,
    and aliases (``*name``, also in merge keys ``<<: *name``): a few hundred bytes of nested aliases expand
    to billions of values, and a cache config has nothing worth sharing that way."""

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, f"aliases (*{event.anchor}) are not allowed in a kvtier config; write the value out",
                event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key; the base class reports it
                continue
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first given on line {first + 1})", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path, source: str) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{source}: is a directory, not a YAML file") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"{source}: cannot be read: {exc.strerror or exc}") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        detail = exc.problem or exc.context or "invalid YAML"
        context = f" ({exc.context})" if exc.context and exc.problem else ""
        refused = isinstance(exc, (yaml.composer.ComposerError, yaml.constructor.ConstructorError))
        kind = "YAML error" if refused else "YAML syntax error"
        raise ConfigError(f"{source}: {where}{kind}: {detail}{context}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: YAML error: {exc}") from None


def load_config(source: str | Path | dict | StackConfig) -> StackConfig:
    """A validated StackConfig from a YAML file's path or a dict; any mistake raises one ConfigError.

    The message names the source, the key path (``tiers[1].capacity``), the offending value and what
    is allowed, one line per mistake. YAML text is not accepted, so that a mistyped path is never
    parsed as a (valid, one-word) YAML document.
    """
    if isinstance(source, StackConfig):
        return source
    if isinstance(source, dict):
        name, data = "config", source
    elif isinstance(source, (str, Path)):
        name = str(source)
        if isinstance(source, str) and "\n" in source:
            raise ConfigError("load_config takes a path to a YAML file or a dict, not YAML text; "
                              "parse it first with yaml.safe_load(text)")
        data = _read_yaml(Path(source).expanduser(), name)
        if data is None:
            raise ConfigError(f"{name}: the file is empty; it needs at least a 'tiers' list")
    else:
        raise ConfigError(f"load_config takes a path to a YAML file or a dict, got {type(source).__name__}")
    if not isinstance(data, dict):
        raise ConfigError(f"{name}: the top level must be a mapping of keys ({', '.join(StackConfig.model_fields)}), "
                          f"got {type(data).__name__} {_show(data)}")
    try:
        config = StackConfig.model_validate(data)
    except ValidationError as exc:
        lines = [f"{name}: {path}: {msg}" if path else f"{name}: {msg}" for path, msg in _explain(exc)]
        raise ConfigError("\n".join(dict.fromkeys(lines))) from None
    _import_policies(config, name)
    return config


def eviction_policy(name: str) -> type[EvictionPolicy]:
    """The eviction policy class a config names (``kvtier.policies.eviction_policy_class``); a name that
    names no usable policy is a ConfigError with the policy lookup's own message."""
    try:
        return eviction_policy_class(name)
    except PolicyError as exc:
        raise ConfigError(str(exc)) from exc


def _import_policies(config: StackConfig, name: str) -> None:
    """Import the tiers' dotted-path eviction policies, once the whole config validated: a config can name
    code to run, and none of it runs for a config that is refused. Raises ConfigError naming each key."""
    lines = []
    for i in range(config.last_local_tier + 1):
        try:
            eviction_policy(config.tier_eviction(i))
        except ConfigError as exc:
            lines.append(f"{name}: tiers[{i}].eviction: {exc}")
    if lines:
        raise ConfigError("\n".join(lines))


# --- error messages ---------------------------------------------------------------------------


def _key_path(loc: tuple[str | int, ...]) -> str:
    """``('tiers', 1, 'host', 'capacity')`` -> ``tiers[1].capacity``: indices in brackets, union tags dropped."""
    out = ""
    prev: str | int | None = None
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(prev, int) and part in TIER_CONFIGS:
            pass  # pydantic's discriminator tag, not a key the user wrote
        else:
            out += f".{part}" if out else str(part)
        prev = part
    return out


def _only_model(annotation: Any) -> type[BaseModel] | None:
    """The one model class inside a field's type (``X | None``, ``list[X]``), or None if zero or several."""
    found: list[type[BaseModel]] = []

    def walk(tp: Any) -> None:
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            found.append(tp)
        for arg in typing.get_args(tp):
            walk(arg)

    walk(annotation)
    return found[0] if len(found) == 1 else None


def _model_at(loc: tuple[str | int, ...]) -> type[BaseModel] | None:
    """The model that validated the mapping at ``loc`` (with pydantic's tags), for listing its keys."""
    model: type[BaseModel] | None = StackConfig
    for part in loc:
        if isinstance(part, int):
            continue
        if model is None and part in TIER_CONFIGS:
            model = TIER_CONFIGS[part]
        elif model is not None and part in model.model_fields:
            model = _only_model(model.model_fields[part].annotation)
        else:
            return None
    return model


def _literal_values(loc: tuple[str | int, ...]) -> list[Any] | None:
    model = _model_at(loc[:-1])
    field = model.model_fields.get(loc[-1]) if model is not None and isinstance(loc[-1], str) else None
    if field is None:
        return None
    for tp in [field.annotation, *typing.get_args(field.annotation)]:
        if typing.get_origin(tp) is Literal:
            return list(typing.get_args(tp))
    return None


_TYPE_NAMES = {"int_type": "an integer", "float_type": "a number", "string_type": "a string",
               "bool_type": "true or false", "list_type": "a list", "int_from_float": "an integer"}
_ENV_NAME = "the name of an environment variable, e.g. {}"
_PATTERN_MEANINGS = {"key_secret_env": _ENV_NAME.format("KVTIER_KEY_SECRET"),
                     "auth_key_env": _ENV_NAME.format("KVTIER_REMOTE_MAC_KEY"),
                     "password_env": _ENV_NAME.format("KVTIER_REDIS_PASSWORD"),
                     "url": "a redis:// or rediss:// URL, e.g. redis://127.0.0.1:6379/0",
                     "master": "host:port (the Mooncake master's RPC address, e.g. 127.0.0.1:50051)",
                     "metadata_server": "a URL, e.g. http://127.0.0.1:8080/metadata",
                     "prefix": "a name without spaces, e.g. kvtier"}
_BOUNDS = {"greater_than": ("gt", "greater than"), "greater_than_equal": ("ge", "at least"),
           "less_than": ("lt", "less than"), "less_than_equal": ("le", "at most")}


def _explain(exc: ValidationError) -> list[tuple[str, str]]:
    """Each pydantic error as (key path, message naming the value and what is allowed)."""
    out: list[tuple[str, str]] = []
    media = ", ".join(TIER_CONFIGS)
    for err in exc.errors(include_url=False):
        kind, loc, value, ctx = err["type"], tuple(err["loc"]), err.get("input"), err.get("ctx") or {}
        path = _key_path(loc)
        if kind == "extra_forbidden":
            model = _model_at(loc[:-1])
            allowed = f"; allowed: {', '.join(model.model_fields)}" if model is not None else ""
            out.append((path, f"unknown key {str(loc[-1])!r}{allowed}"))
        elif kind == "missing":
            out.append((_key_path(loc[:-1]), f"missing key {str(loc[-1])!r}"))
        elif kind == "union_tag_invalid":
            shown = _show(value["medium"]) if isinstance(value, dict) and "medium" in value else _show(ctx.get("tag"))
            out.append((_key_path(loc + ("medium",)), f"{shown} is not a medium; allowed: {media}"))
        elif kind == "union_tag_not_found":
            out.append((path, f"missing key 'medium'; allowed media: {media}"))
        elif kind in ("model_type", "model_attributes_type", "dict_type"):
            model = _model_at(loc)
            keys = f" with keys {', '.join(model.model_fields)}" if model is not None else \
                f" such as {{medium: host, capacity: 8GiB}} (media: {media})"
            out.append((path, f"expected a mapping{keys}, got {_show(value)}"))
        elif kind == "literal_error":
            values = _literal_values(loc)
            shown = ", ".join(map(str, values)) if values else ctx.get("expected", "?")
            out.append((path, f"{_show(value)} is not allowed; allowed: {shown}"))
        elif kind in ("value_error", "assertion_error"):
            error = ctx.get("error")
            if isinstance(error, _Problems):
                out.extend((_key_path(loc + sub), msg) for sub, msg in error.problems)
            else:
                out.append((path, str(error) if error is not None else err["msg"]))
        elif kind in _TYPE_NAMES:
            out.append((path, f"expected {_TYPE_NAMES[kind]}, got {_show(value)}"))
        elif kind in _BOUNDS:
            key, words = _BOUNDS[kind]
            out.append((path, f"{_show(value)} is too {'small' if key[0] == 'g' else 'large'}; "
                              f"must be {words} {ctx.get(key)}"))
        elif kind == "too_short" and isinstance(value, list) and not value:
            out.append((path, f"needs at least {ctx.get('min_length', 1)} entry, got an empty list"))
        elif kind == "string_too_short":
            out.append((path, f"{_show(value)} is empty; give a non-empty string"))
        elif kind == "string_pattern_mismatch":
            wanted = _PATTERN_MEANINGS.get(str(loc[-1]), f"a string matching {ctx.get('pattern')}")
            out.append((path, f"{_show(value)} is not {wanted}"))
        else:
            out.append((path, f"{err['msg']} (got {_show(value)})"))
    return out


__all__ = [
    "DiskTierConfig", "GpuTierConfig", "HostTierConfig", "MooncakeConfig", "RedisConfig", "RemoteTierConfig", "Size",
    "StackConfig", "TIER_CONFIGS", "TierConfig",
    "TransferConfig", "WatermarkConfig", "block_footprint", "capacity_in_blocks", "default_config_path",
    "format_size", "load_config", "parse_size",
]
