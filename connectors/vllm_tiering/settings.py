"""What one ``secondary_tiers`` entry of vLLM's tiering config may say to a kvtier tier, checked at start.

vLLM hands a secondary tier the keys of its entry as keyword arguments (``type``, ``module_path`` and
``backpressure`` taken out). For a kvtier tier those keys are the kvtier tier's own settings, as in a
kvtier YAML (``path``, ``capacity``, ``compression``; ``backend``, ``redis``, ``auth_key_env``), a few
settings of the stack around it (``namespace``, ``key_secret_env``, ``transfer``) and the adapter's own
(``enable_kv_events``; a remote tier's ``staging_blocks``). They are validated by kvtier's config
models with the chunk size vLLM chose as the block size, so a key that is unknown or wrong stops vLLM
at start with one ConfigError line naming the entry and the key, never a tier that silently stores
nothing.

A node tier is the node daemon's slab alone: its copies are the engine's own memmoves, which end when
they end. A remote tier runs as kvtier runs one everywhere: below a small host tier of kvtier's own
(``staging_blocks`` chunks). Records arrive there and are checked (length, checksum, MAC) before they
are copied into vLLM's CPU tier, and a store call that outlives its deadline can only ever touch
kvtier's slots, which kvtier keeps out of use until that call has returned; a chunk of vLLM's CPU tier
is handed to another block as soon as a promotion fails, so it must never be a remote read's target.
Which media need that staging their registry entries say (``Medium.copies_outlive_jobs``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvtier.core.config import StackConfig, load_config, tier_configs
from kvtier.core.devices import HOST
from kvtier.core.errors import ConfigError
from kvtier.core.media import medium

STACK_KEYS = ("namespace", "key_secret_env", "transfer")
"""Settings of the stack around the tier, given in the entry beside the tier's own."""

DEFAULT_STAGING_BLOCKS = 64
"""Chunks a remote tier's host staging holds by default: enough for a few promotions and stores in
flight at once, 128 MiB with vLLM's usual 2 MiB chunks."""


class AdapterOptions(BaseModel):
    """The entry's keys that belong to the adapter, not to a kvtier tier."""

    model_config = ConfigDict(extra="forbid", strict=True)

    enable_kv_events: bool = False  # publish BlockStored events for chunks stored here (as vLLM's fs tier)
    staging_blocks: int = Field(DEFAULT_STAGING_BLOCKS, ge=1)  # a remote tier's host staging, in chunks


@dataclass(frozen=True)
class TierSettings:
    """An entry, validated: the kvtier stack to build and the adapter's own options."""

    config: StackConfig
    options: AdapterOptions


def tier_settings(medium_name: str, tier_type: str, entry: dict[str, Any], chunk_bytes: int) -> TierSettings:
    """The stack a ``secondary_tiers`` entry of type ``tier_type`` describes for chunks of ``chunk_bytes``:
    the tier of ``medium_name`` alone (disk, node), or a host staging tier above it where its copies can
    outlive their jobs (remote: ``Medium.copies_outlive_jobs``). Raises one ConfigError naming the entry
    and every key that is unknown, missing or wrong."""
    where = f"secondary_tiers entry {tier_type!r}"
    entry = dict(entry)
    staged = medium(medium_name).copies_outlive_jobs
    option_keys = [key for key in AdapterOptions.model_fields if staged or key != "staging_blocks"]
    tier_keys = [key for key in tier_configs()[medium_name].yaml_keys() if key != "medium"]
    if "medium" in entry:
        raise ConfigError(
            f"{where}: medium: {entry['medium']!r}: the type sets the medium ({tier_type} is kvtier's "
            f"{medium_name} tier; KVTierDisk, KVTierRemote and KVTierNode are the kvtier tiers vLLM can cascade "
            f"to, vLLM's CPU tier being the memory tier); remove medium"
        )
    unknown = sorted(set(entry) - set(option_keys) - set(tier_keys) - set(STACK_KEYS))
    if unknown:
        raise ConfigError(
            f"{where}: unknown key {unknown[0]!r} ({tier_type} is kvtier's {medium_name} tier); allowed: "
            f"{', '.join([*tier_keys, *STACK_KEYS, *option_keys])}"
        )
    options = _validated(
        lambda: AdapterOptions.model_validate({k: entry.pop(k) for k in option_keys if k in entry}), where
    )
    stack = {key: entry.pop(key) for key in STACK_KEYS if key in entry}
    tier = {"medium": medium_name, **entry}
    tiers = [{"medium": HOST, "name": "staging", "capacity_blocks": options.staging_blocks}, tier] if staged else [tier]
    config = _validated(lambda: load_config({**stack, "block_bytes": chunk_bytes, "tiers": tiers}), where)
    return TierSettings(config, options)


def _validated(build, where: str):
    """``build()``, its ConfigError (or pydantic's) reworded to name the entry's own keys: the entry is one
    tier, so kvtier's ``config: tiers[i].`` prefix would only confuse."""
    try:
        return build()
    except ConfigError as exc:
        message = "; ".join(str(exc).replace("config: ", "").splitlines())
        for i in range(2):
            message = message.replace(f"tiers[{i}].", "")
        message = message.replace("block_bytes", "vLLM's chunk size")
        raise ConfigError(f"{where}: {message}") from None
    except ValidationError as exc:  # the adapter's options
        problems = [
            f"{'.'.join(map(str, err['loc']))}: {err['msg']} (got {err.get('input')!r:.60})"
            for err in exc.errors(include_url=False)
        ]
        raise ConfigError(f"{where}: {'; '.join(problems)}") from None
