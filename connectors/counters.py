"""The counters every engine adapter exports, with one name and one meaning under vLLM and under SGLang.

Blocks are counted per load and store (hits by the medium of the tier they came from, loads that did
not arrive intact, blocks stored), bytes and seconds per direction (load: into the engine's KV
memory; store: out of it), and lookups that ended early by why (``core/misses.py``). Each engine
exports them where it exports its own metrics, as Prometheus counters named ``<engine>:kvtier_<name>``
(``_total`` when scraped): hits with a ``tier`` label, misses with ``reason`` and ``tier`` labels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

from kvtier.core.media import media, watch_media
from kvtier.core.misses import TOTAL, MissReason

TOTALS = ("failed_load_blocks", "stored_blocks", "load_bytes", "load_seconds", "store_bytes", "store_seconds")

LABELS = {
    "hit_blocks": ("tier",),
    "miss_reason": ("reason", "tier"),
    "tenant_hit_blocks": ("tenant",),
    "tenant_stored_blocks": ("tenant",),
}
"""The labels of each Prometheus metric beyond the engine's own; the others have none."""


class Exported(NamedTuple):
    """One counter: its ``name`` in the engines' statistics, the Prometheus ``metric`` it feeds (a key of
    ``PROMETHEUS_HELP``) and its values of that metric's ``LABELS``."""

    name: str
    metric: str
    labels: tuple[str, ...] = ()


def miss_counter(reason: str, tier: str) -> str:
    """The name of the count of lookups that ended early for ``reason`` (a ``MissReason`` value) in
    ``tier`` (a medium of ``hit_media``, or ``TOTAL``)."""
    return f"miss_{reason}_{tier}"


def miss_counts(taken: Mapping[tuple[MissReason, str], int], medium_of: Callable[[str], str]) -> dict[str, int]:
    """A stack's ``Misses.take()`` (counts by reason and tier name) as counts by ``miss_counter`` name, each
    tier named by its medium, ``medium_of(tier name)`` (a stack holds at most one tier per medium)."""
    return {
        miss_counter(reason.value, tier if tier == TOTAL else medium_of(tier)): n for (reason, tier), n in taken.items()
    }


class _Names:
    """The counters for the media registered now: asked at every engine step, so worked out only when
    the registry changes."""

    hits: tuple[str, ...] = ()
    counters: tuple[Exported, ...] = ()
    names: tuple[str, ...] = ()


def _recount() -> None:
    _Names.hits = tuple(m.name for m in media() if m.counts_hits)
    _Names.counters = (
        *(Exported(f"hit_blocks_{name}", "hit_blocks", (name,)) for name in _Names.hits),
        *(Exported(name, name) for name in TOTALS),
        *(
            Exported(miss_counter(reason.value, tier), "miss_reason", (reason.value, tier))
            for reason in MissReason
            for tier in (TOTAL, *_Names.hits)
        ),
    )
    _Names.names = tuple(counter.name for counter in _Names.counters)


watch_media(_recount)


TENANT_METRICS = ("tenant_hit_blocks", "tenant_stored_blocks")


def tenant_counter(metric: str, label: str) -> str:
    """The name of a ``TENANT_METRICS`` count of one tenant label (``core.tier_config.tenant_labels``)."""
    return f"{metric}:{label}"


def tenant_counters(labels: Iterable[str]) -> tuple[Exported, ...]:
    """The per-tenant counters of a config whose shares name tenants: each ``TENANT_METRICS`` metric per
    label (the named tenants, ``other`` and ``none``); none where no tier names a tenant."""
    return tuple(
        Exported(tenant_counter(metric, label), metric, (label,)) for metric in TENANT_METRICS for label in labels
    )


def hit_media() -> tuple[str, ...]:
    """The media whose hits are counted: every registered medium but the engine's own (gpu)."""
    return _Names.hits


def counters() -> tuple[Exported, ...]:
    """Every counter: ``hit_blocks_<medium>`` per medium of ``hit_media``, the ``TOTALS``, then
    ``miss_counter(reason, tier)`` per ``MissReason`` for ``TOTAL`` and each medium of ``hit_media``."""
    return _Names.counters


def counter_names() -> tuple[str, ...]:
    """The names of ``counters``, in order."""
    return _Names.names


PROMETHEUS_HELP = {
    "hit_blocks": "Prompt blocks kvtier loaded into the engine's KV cache instead of the engine computing them, "
    "by tier.",
    "failed_load_blocks": "Blocks kvtier planned to load that did not arrive intact (the engine recomputed them).",
    "stored_blocks": "Blocks kvtier copied out of the engine's KV cache into its tiers.",
    "load_bytes": "Bytes kvtier copied into the engine's KV cache, summed over workers.",
    "load_seconds": "Seconds kvtier's loads took, summed over jobs and workers.",
    "store_bytes": "Bytes kvtier copied out of the engine's KV cache, summed over workers.",
    "store_seconds": "Seconds kvtier's stores took, summed over jobs and workers.",
    "tenant_hit_blocks": "Prompt blocks kvtier loaded for a tenant's requests (vLLM's cache_salt), by tenant: the "
    "tenants the config's shares name, the rest as other, requests of no tenant as none.",
    "tenant_stored_blocks": "Blocks of a tenant kvtier stored, by tenant (as tenant_hit_blocks).",
    "miss_reason": "Prompt lookups in kvtier that ended before the prompt's last full block, once per request, by "
    "why its first missing block is not there: in total (tier all) and per tier.",
}
"""Prometheus metric ``<engine>:kvtier_<name>`` for each entry, with the engine's labels and ``LABELS``."""
