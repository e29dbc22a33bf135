"""The YAML schema of a tier stack, validated when loaded so that every mistake names its key and the fix.

    cfg = load_config("kvtier.yaml")        # or a dict; raises ConfigError with one message
    cfg.tiers[0].medium, cfg.tier_name(0), capacity_in_blocks(cfg.tiers[1], cfg.block_bytes)

The schema is strict: unknown keys, wrong types and out-of-range values are errors rather than being
ignored or coerced, because a silently ignored typo in a cache config shows up later as a cache that
does not do what its author thinks.

Each tier is validated by its medium's model, picked by ``medium`` among the media registered
(``kvtier.core.media``): each medium's model lives beside its tier (``kvtier.tiers.host``,
``kvtier.tiers.disk.config``, ...; a program's own wherever it registers it), and builds on the keys
every tier has (``kvtier.core.tier_config``). So this module knows no medium's keys.
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, GetCoreSchemaHandler, ValidationError, model_validator
from pydantic_core import CoreSchema, core_schema

from kvtier.core.config_messages import Problems, explain
from kvtier.core.errors import ConfigError, shown
from kvtier.core.events_config import EventsConfig
from kvtier.core.keys import key_secret, tenant_of
from kvtier.core.sizes import Size, format_size
from kvtier.core.strict_yaml import read_yaml
from kvtier.core.tier_config import ConfigModel, EnvName, ProblemList, TierConfigBase, env_name_hint
from kvtier.policies import EvictionPolicy, PolicyError, Watermark, eviction_policy_class

RESERVED_TIER_NAMES = {
    "misses": "is the key of the miss counts in KVTier.stats(), beside the tiers'",
    "events": "is the key of the KV events' counts in KVTier.stats(), beside the tiers'",
    "all": "is the tier label of the miss counts' totals",
}


class TransferConfig(ConfigModel):
    """The transfer backend's knobs; ``threads`` is the CPU backend's copy pool size."""

    threads: int = Field(2, ge=1)
    io_threads: int = Field(8, ge=1)  # positioned reads and writes in flight at once, for disk tiers
    cuda_copy: Literal["auto", "batch", "kernel", "loop"] = "auto"  # how GPU <-> host jobs move (transfers/cuda.py)


_TIER_CONFIGS: dict[str, type[TierConfigBase]] = {}


def use_tier_configs(schemas: dict[str, type[TierConfigBase]]) -> None:
    """The registered media's schemas, by medium, as the registry (``kvtier.core.media``) has them now:
    the tier union is rebuilt with them. The registry calls this, so that the schema needs no import of
    the registry, whose entries name the schema's types."""
    _TIER_CONFIGS.clear()
    _TIER_CONFIGS.update(schemas)
    if schemas:
        StackConfig.model_rebuild(force=True)


def tier_configs() -> dict[str, type[TierConfigBase]]:
    """Every registered medium's schema, by medium (``kvtier.core.media``)."""
    return dict(_TIER_CONFIGS)


class _RegisteredMedia:
    """The schema of one tier: the model of the medium its ``medium`` key names, among those registered
    when the schema was built (``StackConfig`` is rebuilt whenever the registry changes)."""

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        choices = {name: handler.generate_schema(model) for name, model in tier_configs().items()}
        return core_schema.tagged_union_schema(choices, discriminator="medium")


TierConfig = Annotated[TierConfigBase, _RegisteredMedia()]
"""A tier of any registered medium, validated by that medium's model."""


UPPER_TIER_EVICTION = "lru"
LAST_TIER_EVICTION = "adaptive"
"""Default policies, from ``kvtier replay`` and bench/policies.py (docs/replay.md): a tier above
another only demotes what it evicts, and recency order did best there; the last tier's evictions
leave the stack, and there LRU with a second-sight admission filter that turns itself on only where
it pays (``adaptive``) was never below LRU on any workload and size measured, where S3-FIFO fed
chains deepest first (the previous default) lost up to 15% to LRU on chat workloads."""


class StackConfig(ConfigModel):
    """One tier stack: block geometry, the ordered tiers (fastest first), placement and transfers.
    A tier without ``eviction`` gets UPPER_TIER_EVICTION, or LAST_TIER_EVICTION when it is last."""

    model_config = ConfigDict(extra="forbid", strict=True, defer_build=True)  # built once media register

    block_tokens: int = Field(16, gt=0)
    block_bytes: Size | None = None
    fragments: int = Field(1, ge=1)
    namespace: str = ""
    # The name of an environment variable holding a per-deployment secret that keys the block hash
    # (kvtier.core.keys): keys then cannot be computed from a guessed prompt by anyone without it.
    key_secret_env: EnvName | None = Field(None, description=env_name_hint("KVTIER_KEY_SECRET"))
    tiers: list[TierConfig] = Field(min_length=1)
    placement: Literal["write_through", "write_back"] = "write_back"
    transfer: TransferConfig = Field(default_factory=TransferConfig)
    events: EventsConfig | None = None  # off unless given

    def tier_name(self, i: int) -> str:
        """Tier ``i``'s name: its ``name`` key, or its medium where none is given."""
        tier = self.tiers[i]
        return tier.name or tier.medium

    def tier_eviction(self, i: int) -> str:
        """Tier ``i``'s eviction policy name: its ``eviction`` key, or the default for its place (the last
        tier kvtier evicts from is the last one above a remote tier, whose store evicts by itself).
        Raises ConfigError for a keyed store's tier (a remote one)."""
        if self.tiers[i].keyed:
            raise ConfigError(f"tiers[{i}] is a remote tier: its store evicts by itself, kvtier has no policy for it")
        eviction = self.tiers[i].eviction
        if eviction is not None:
            return eviction
        return LAST_TIER_EVICTION if i == self.last_local_tier else UPPER_TIER_EVICTION

    def tenant_names(self) -> list[str]:
        """The tenants some tier's ``tenants:`` shares name, sorted: counted by name (``tenant_labels``)."""
        return sorted({name for tier in self.tiers if tier.tenants is not None for name in tier.tenants.shares})

    def tier_policy(
        self, i: int, tag_of: Callable[[bytes], bytes] = tenant_of
    ) -> tuple[EvictionPolicy, Watermark | None]:
        """A new eviction policy for tier ``i`` (``tier_eviction``) and its watermark, if it has one: what
        every place that builds the tier's index (a stack, vLLM's scheduler side, a node daemon) gives
        it. With ``tenants:`` shares a block's tenant is ``tag_of(key)`` (a node daemon's keys do not
        begin with it: the daemon keeps what the engines said)."""
        tier = self.tiers[i]
        make = eviction_policy(self.tier_eviction(i))
        if tier.tenants is None:
            policy = make()
        else:
            policy = tier.tenants.policy(make, key_secret(self.key_secret_env), tag_of)
        return policy, Watermark(tier.watermark.high, tier.watermark.low) if tier.watermark is not None else None

    @property
    def last_local_tier(self) -> int:
        """The index of the last tier that is not a keyed store (-1: none is)."""
        return max((i for i, tier in enumerate(self.tiers) if not tier.keyed), default=-1)

    @property
    def header_room(self) -> int:
        """Bytes a host tier keeps before each slot: what the stack's tiers ask for (a remote tier: room
        for a record's header, so header and block move to and from the store as one piece)."""
        return max(type(tier).header_room_above for tier in self.tiers)

    @model_validator(mode="after")
    def _cross_field(self) -> StackConfig:
        problems: ProblemList = []
        if self.block_bytes is not None and self.block_bytes % self.fragments:
            problems.append(
                (
                    ("fragments",),
                    f"block_bytes {format_size(self.block_bytes)} ({self.block_bytes} "
                    f"bytes) cannot be cut into {self.fragments} equal fragments; "
                    f"block_bytes must be divisible by fragments",
                )
            )
        first_of_medium: dict[str, int] = {}
        first_of_name: dict[str, int] = {}
        for i, tier in enumerate(self.tiers):
            own = [(("tiers", i, *loc), msg) for loc, msg in tier.stack_problems(self, i)]
            problems.extend(own)
            if tier.medium in first_of_medium:
                problems.append(
                    (
                        ("tiers", i, "medium"),
                        f"a second {tier.medium!r} tier (tiers["
                        f"{first_of_medium[tier.medium]}] is one); "
                        f"at most one tier per medium",
                    )
                )
            else:
                first_of_medium[tier.medium] = i
                name = self.tier_name(i)  # same-medium duplicates are reported once, above
                if name in RESERVED_TIER_NAMES:
                    problems.append(
                        (("tiers", i, "name"), f"{name!r} {RESERVED_TIER_NAMES[name]}: pick another tier name")
                    )
                elif name in first_of_name:
                    problems.append(
                        (
                            ("tiers", i, "name"),
                            f"{name!r} is already the name of tiers[{first_of_name[name]}]; tier names must be unique",
                        )
                    )
                else:
                    first_of_name[name] = i
            if own:
                continue  # (a slot size that is wrong has no footprint to check the capacity against)
            if self.block_bytes is not None and tier.capacity is not None:
                need = tier.footprint(self.block_bytes)
                if tier.capacity < need:
                    problems.append(
                        (
                            ("tiers", i, "capacity"),
                            f"{format_size(tier.capacity)} ({tier.capacity} bytes) holds no block of "
                            f"block_bytes {format_size(self.block_bytes)}; give at least "
                            f"{format_size(need)}",
                        )
                    )
        if problems:
            raise Problems(problems)
        return self


def capacity_in_blocks(tier_cfg: TierConfigBase, block_bytes: int | None, header_room: int = 0) -> int | None:
    """How many blocks a tier holds: ``capacity_blocks``, else ``capacity`` divided by what one block
    takes there (``TierConfigBase.footprint``); None if unsized."""
    if tier_cfg.capacity_blocks is not None:
        return tier_cfg.capacity_blocks
    if tier_cfg.capacity is None:
        return None
    if not block_bytes or block_bytes <= 0:
        raise ConfigError(
            f"tier {tier_cfg.name or tier_cfg.medium!r}: capacity is given in bytes, so block_bytes "
            f"is needed to count its blocks; got block_bytes={block_bytes!r}"
        )
    return tier_cfg.capacity // tier_cfg.footprint(block_bytes, header_room)


# --- loading ----------------------------------------------------------------------------------


def default_config_path() -> Path:
    """The embedded demo configuration (``kvtier/default.yaml``, shipped as package data)."""
    return Path(str(importlib.resources.files("kvtier").joinpath("default.yaml")))


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
            raise ConfigError(
                "load_config takes a path to a YAML file or a dict, not YAML text; "
                "parse it first with yaml.safe_load(text)"
            )
        data = read_yaml(Path(source).expanduser(), name)
        if data is None:
            raise ConfigError(f"{name}: the file is empty; it needs at least a 'tiers' list")
    else:
        raise ConfigError(f"load_config takes a path to a YAML file or a dict, got {type(source).__name__}")
    if not isinstance(data, dict):
        raise ConfigError(
            f"{name}: the top level must be a mapping of keys ({', '.join(StackConfig.model_fields)}), "
            f"got {type(data).__name__} {shown(data)}"
        )
    try:
        config = StackConfig.model_validate(data)
    except ValidationError as exc:
        problems = explain(exc, StackConfig, tier_configs())
        lines = [f"{name}: {path}: {msg}" if path else f"{name}: {msg}" for path, msg in problems]
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
