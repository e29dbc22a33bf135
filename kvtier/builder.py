"""Build a tier stack from a validated configuration: the one place that turns YAML into tiers (each
by its medium's registry entry, ``kvtier.core.media``), transfer backends and a ``TierStack``.

Why it lives in kvtier/, above everything it builds: it builds the tiers and the transfer backends
(``kvtier.transfers``) that move bytes between them. In core/ it made the block interface import what
is built on it; in tiers/ it would make the tiers import the transfers. Here it sits beside the public
API that exports it (``kvtier.build_stack``) and serves that API's callers: ``kvtier/api.py`` and
``kvtier replay``. It imports ``kvtier.tiers``, which registers the built-in media: every import of
kvtier goes through the package root and so through here, and a config naming them always validates.
"""

from __future__ import annotations

from collections.abc import Callable

import kvtier.tiers  # noqa: F401  (registers the built-in media)
from kvtier.core.config import StackConfig, capacity_in_blocks
from kvtier.core.errors import ConfigError, KvtierError
from kvtier.core.jobs import JobManager
from kvtier.core.layout import BlockLayout
from kvtier.core.media import TierRequest, medium
from kvtier.core.sizes import format_size
from kvtier.core.stack import TierStack
from kvtier.core.tier import Tier
from kvtier.core.transfer import TransferBackend
from kvtier.transfers import backends_for


def config_layout(config: StackConfig) -> BlockLayout:
    """The block layout a standalone stack uses: ``block_bytes`` cut into ``fragments`` equal parts."""
    if config.block_bytes is None:
        raise ConfigError("block_bytes: missing; a standalone stack needs the size of one block, e.g. 256KiB")
    return BlockLayout((config.block_bytes // config.fragments,) * config.fragments)


def build_stack(
    config: StackConfig,
    layout: BlockLayout | None = None,
    backends: list[TransferBackend] | None = None,
    first: Callable[[JobManager], Tier] | None = None,
) -> TierStack:
    """Tiers, policies, job manager and backend as the configuration says; nothing is left open on error.
    ``first(jobs)``: the first tier, built by the caller (a node daemon's slab, which its medium does not
    build), in place of the one the configuration describes."""
    layout = layout or config_layout(config)
    jobs = JobManager()
    tiers: list[Tier] = []
    made: list[TransferBackend] = []  # backends built here (a caller's own stay the caller's to close)
    try:
        for i in range(len(config.tiers)):
            tiers.append(first(jobs) if i == 0 and first is not None else _build_tier(config, i, layout, jobs))
        if backends is None:
            backends = made = backends_for(config.transfer, {t.storage.device for t in tiers}, config.tiers)
        return TierStack(tiers, backends, jobs, config.placement)
    except BaseException:
        for backend in made:
            backend.close()
        for tier in tiers:
            tier.close()
        raise


def _build_tier(config: StackConfig, i: int, layout: BlockLayout, jobs: JobManager) -> Tier:
    """Tier ``i`` as its medium's registry entry builds it. Memory or a file it cannot get (more than the
    machine has, a size the OS cannot map) is a ConfigError naming the tier and what it asked for, not a
    bare OSError from deep inside."""
    tier_cfg = config.tiers[i]
    build = medium(tier_cfg.medium).tier
    if tier_cfg.keyed:
        return build(TierRequest(i, config, layout, 0, jobs.is_fenced))
    where = f"tiers[{i}] ({config.tier_name(i)})"
    blocks = capacity_in_blocks(tier_cfg, layout.block_bytes, config.header_room)
    if blocks is None:
        raise ConfigError(
            f"{where}: give capacity or capacity_blocks for a standalone stack (under vLLM the engine owns GPU memory)"
        )
    footprint = tier_cfg.footprint(layout.block_bytes, config.header_room)
    if blocks < 1:
        raise ConfigError(
            f"{where}: capacity holds no block of {layout.block_bytes} bytes ({footprint} bytes with what each "
            f"block takes there)"
        )
    try:
        return build(TierRequest(i, config, layout, blocks, jobs.is_fenced))
    except KvtierError:
        raise  # names what failed already (a disk tier's path, say)
    except (MemoryError, OverflowError, OSError) as exc:
        raise ConfigError(
            f"{where}: {blocks} blocks of {format_size(layout.block_bytes)} ({format_size(blocks * footprint)} "
            f"in all) cannot be allocated: {str(exc) or type(exc).__name__}; lower its capacity or "
            f"block_bytes"
        ) from exc
