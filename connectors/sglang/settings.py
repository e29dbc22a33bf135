"""What SGLang hands kvtier's storage backend at start: its extra config, and the kvtier configuration it names.

SGLang's ``dynamic`` storage backend passes the JSON of ``--hicache-storage-backend-extra-config``
(less the keys SGLang reads itself, such as ``prefetch_threshold``) to the backend. kvtier reads its
keys strictly: an unknown key, a YAML that does not validate or a tier SGLang cannot feed stops SGLang
at start with one ``ConfigError`` line naming the key, rather than a backend that silently stores
nothing.

What a stack under SGLang may hold: SGLang keeps the GPU (L1) and host (L2) caches itself and hands
kvtier pages of its host pool, so kvtier's tiers are those below it: a disk tier, a remote tier, or
both. A remote tier needs a small kvtier host tier above it, where records are checked before SGLang
sees them: a load from a store that outlives its deadline may still write into its destination, and
only a kvtier slot can be kept out of use until it no longer can (never one of SGLang's pages, which
SGLang hands to another request once a load has failed). Any other host tier would only duplicate
SGLang's own host cache, so it is refused.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from kvtier.connectors.extra_config import engine_settings
from kvtier.core.config import StackConfig, load_config
from kvtier.core.devices import HOST
from kvtier.core.errors import ConfigError
from kvtier.core.media import medium


class BackendSettings(BaseModel):
    """The extra config: SGLang's keys to load kvtier, and ``config``: a kvtier YAML path or the same as a mapping."""

    model_config = ConfigDict(extra="forbid")

    backend_name: str
    module_path: str
    class_name: str
    interface_v1: Literal[0, 1, False, True] = 0  # SGLang reads it as a flag; a string such as "0" would read as set
    config: str | dict[str, Any]


def backend_settings(extra_config: dict[str, Any] | None) -> BackendSettings:
    """The extra config, validated; a ConfigError names each key that is unknown, missing or wrong."""
    return engine_settings(
        BackendSettings, extra_config, "hicache-storage-backend-extra-config", "/etc/kvtier/sglang.yaml"
    )


def stack_config(settings: BackendSettings) -> StackConfig:
    """The kvtier configuration the settings name, checked for what a stack under SGLang may be."""
    config = load_config(settings.config)
    problems = []
    for key in ("block_bytes", "fragments"):
        if key in config.model_fields_set:
            problems.append(
                f"{key}: under SGLang a block is one page of SGLang's host pool, whose size SGLang "
                f"decides; remove {key}"
            )
    keyed = any(tier.keyed for tier in config.tiers)
    for i, tier in enumerate(config.tiers):
        if medium(tier.medium).rank_storage is None:  # the engine's own memory: the GPU
            problems.append(
                f"tiers[{i}].medium: {tier.medium}: SGLang keeps GPU KV itself and hands kvtier pages of its "
                f"host pool; remove the {tier.medium} tier"
            )
        elif tier.medium == HOST and not keyed:
            problems.append(
                f"tiers[{i}].medium: host: under SGLang a host tier only stages a remote tier's records "
                f"(SGLang's host cache is the memory tier); remove it, or add a remote tier below it"
            )
    if problems:
        raise ConfigError("; ".join(problems))
    return config


def check_page_tokens(config: StackConfig, page_tokens: int) -> None:
    """``block_tokens``, when given, must be SGLang's page size: a block is one page."""
    if "block_tokens" in config.model_fields_set and config.block_tokens != page_tokens:
        raise ConfigError(
            f"block_tokens: {config.block_tokens} differs from SGLang's page size {page_tokens}; leave "
            f"it out under SGLang or set it to {page_tokens}"
        )
