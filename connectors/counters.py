"""The counters every engine adapter exports, with one name and one meaning under vLLM and under SGLang.

Blocks are counted per load and store (hits by the medium of the tier they came from, loads that did
not arrive intact, blocks stored), bytes and seconds per direction (load: into the engine's KV
memory; store: out of it). Each engine exports them where it exports its own metrics, as Prometheus
counters named ``<engine>:kvtier_<name>`` (``_total`` when scraped), hits with a ``tier`` label.
"""

from __future__ import annotations

from kvtier.core.media import media, watch_media

TOTALS = ("failed_load_blocks", "stored_blocks", "load_bytes", "load_seconds", "store_bytes", "store_seconds")


class _Names:
    """The counter names for the media registered now: asked at every engine step, so worked out only
    when the registry changes."""

    hits: tuple[str, ...] = ()
    counters: tuple[str, ...] = TOTALS


def _recount() -> None:
    _Names.hits = tuple(m.name for m in media() if m.counts_hits)
    _Names.counters = (*(f"hit_blocks_{name}" for name in _Names.hits), *TOTALS)


watch_media(_recount)


def hit_media() -> tuple[str, ...]:
    """The media whose hits are counted: every registered medium but the engine's own (gpu)."""
    return _Names.hits


def counter_names() -> tuple[str, ...]:
    """Every counter: ``hit_blocks_<medium>`` per medium of ``hit_media``, then the ``TOTALS``."""
    return _Names.counters


PROMETHEUS_HELP = {
    "hit_blocks": "Prompt blocks kvtier loaded into the engine's KV cache instead of the engine computing them, "
    "by tier.",
    "failed_load_blocks": "Blocks kvtier planned to load that did not arrive intact (the engine recomputed them).",
    "stored_blocks": "Blocks kvtier copied out of the engine's KV cache into its tiers.",
    "load_bytes": "Bytes kvtier copied into the engine's KV cache, summed over workers.",
    "load_seconds": "Seconds kvtier's loads took, summed over jobs and workers.",
    "store_bytes": "Bytes kvtier copied out of the engine's KV cache, summed over workers.",
    "store_seconds": "Seconds kvtier's stores took, summed over jobs and workers.",
}
"""Prometheus metric ``<engine>:kvtier_<name>`` for each entry; ``hit_blocks`` is one metric with a
``tier`` label, the others have the engine's labels only."""
