"""kvtier as SGLang's HiCache storage backend (L3), loaded by SGLang's ``dynamic`` storage backend:

    --enable-hierarchical-cache --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
      '{"backend_name": "kvtier", "module_path": "kvtier.connectors.sglang.backend",
        "class_name": "KVTierStorage", "interface_v1": 1, "config": "/etc/kvtier/sglang.yaml"}'

SGLang keeps the GPU (L1) and host (L2) caches; it hands this backend pages of its host pool to store
(its backup thread) and asks which pages exist and to load them back (its prefetch threads), batch by
batch, from several threads at once. Each call becomes one plan of kvtier's one planner over the tiers
the YAML configures (disk, remote, or both; ``settings.py``), executed by a ``TierStack`` whose
caller's storage is SGLang's host pool itself (``pages.py``): blocks move between the pool's pages and
the tiers with no copy of their own. SGLang's page keys are folded under the namespace of this rank's
pages (``namespace.py``) into kvtier's keyed block keys.

The contract SGLang relies on, kept here: a batch call returns per page whether it was stored or
loaded, never raises, and never returns before kvtier is done with the pages it was given (SGLang reuses
a page once the call returns): a page that could not be stored or loaded intact is ``False``, and SGLang
recomputes what it does not get. Every tier bounds its waits (a remote store's calls have a deadline; a
late reply never writes into SGLang's pages: Mooncake's loads stage through a kvtier host slot, and
Redis's replies are checked and copied in as they arrive, never after the call's deadline).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sglang.srt.mem_cache.hicache_storage import (
    STORAGE_BATCH_SIZE,
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.observability.metrics_collector import StorageMetrics

from kvtier.builder import build_stack
from kvtier.connectors.counters import miss_counts
from kvtier.connectors.sglang.metrics import StorageCounters
from kvtier.connectors.sglang.namespace import check_parallelism, server_model_path, storage_namespace
from kvtier.connectors.sglang.pages import PageGeometry, page_geometry, page_slots
from kvtier.connectors.sglang.settings import backend_settings, check_page_tokens, stack_config
from kvtier.core.config import StackConfig, capacity_in_blocks
from kvtier.core.errors import ConfigError, StateError
from kvtier.core.keys import KeyFolder, key_secret
from kvtier.core.media import medium
from kvtier.core.sizes import format_size
from kvtier.core.stack import TierStack
from kvtier.core.storage import BlockStorage, buffer_storage
from kvtier.event_publisher import EventPublisher, for_rank

log = logging.getLogger(__name__)

KV_POOL = "kv"
"""The name SGLang's hybrid controller gives the KV pool itself among the pools it registers (v2)."""


class KVTierStorage(HiCacheStorage):
    """A kvtier tier stack below SGLang's host cache, one per scheduler process (TP rank)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        """Check the extra config, the kvtier YAML it names and the parallel layout, and read the key
        secret: anything wrong stops SGLang here, at start. The stack itself is built once SGLang
        registers its host pool (``register_mem_pool_host``): the pool decides the block geometry."""
        check_parallelism(storage_config)
        self.storage_config = storage_config
        self.config = _rank_config(stack_config(backend_settings(storage_config.extra_config)), storage_config)
        self.key_secret = key_secret(self.config.key_secret_env)
        self.stack: TierStack | None = None
        self.pages: PageGeometry | None = None
        self.namespace = b""
        self._fold = KeyFolder(self.namespace, self.key_secret)  # the rank's own once the pool is registered
        self.counters: StorageCounters | None = None
        self.publisher: EventPublisher | None = None

    # --- start ---------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Open the stack over SGLang's host pool: its pages are the blocks (``pages.py``), this rank's
        namespace keys them, and a disk tier takes back what an earlier run of the same model stored."""
        super().register_mem_pool_host(mem_pool_host)
        if self.stack is not None:
            raise StateError("kvtier's storage backend already has a host pool")
        pages = page_geometry(mem_pool_host)
        check_page_tokens(self.config, pages.page_tokens)
        _check_room_for_a_batch(self.config, pages.layout.block_bytes)
        model_path, revision = server_model_path()
        self.namespace = storage_namespace(self.storage_config, mem_pool_host, pages, self.config, model_path, revision)
        self._fold = KeyFolder(self.namespace, self.key_secret)
        config = self.config.model_copy(update={"namespace": self.namespace.decode("ascii")})
        self.stack = build_stack(config, pages.layout)
        if config.events is not None:
            try:
                events = for_rank(config.events, _rank_offset(self.storage_config))
                self.publisher = EventPublisher(events, self.stack.tiers, pages.page_tokens)
            except BaseException:
                self.stack.close()
                raise
        self.pages = pages
        self.counters = StorageCounters(self.storage_config.tp_rank, pages.layout.block_bytes)
        log.info(
            "kvtier storage backend for SGLang (TP rank %d of %d):\n%s",
            self.storage_config.tp_rank,
            self.storage_config.tp_size,
            self.stack.describe(),
        )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """SGLang's hybrid controller registers each pool of the model here; kvtier serves the KV pool
        (already registered) and refuses every other (Mamba states, sliding-window or indexer pools) at
        start, rather than storing a model's KV without the state that goes with it."""
        if str(host_pool_name) == KV_POOL and host_pool is getattr(self, "mem_pool_host", None):
            return
        raise ConfigError(
            f"kvtier's SGLang storage backend serves the KV pool only; this model also has the host "
            f"pool {str(host_pool_name)!r} ({type(host_pool).__name__}), which it cannot store: run "
            f"it without kvtier (hybrid models are not supported yet)"
        )

    # --- the zero-copy interface (interface_v1: 1) ---------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages some tier holds (a remote store is asked only past the local hit). A
        lookup that ends before the last page is counted with its reason (``TierStack.lookup``; SGLang
        asks for full pages only) and exported with the process's counters."""
        try:
            stack, _, counters = self._opened()
            hits = stack.lookup(self._keys(keys)).hits
            counters.missed(miss_counts(stack.misses.take(), lambda name: stack.planner.tier(name).medium))
            return hits
        except Exception:
            log.exception("kvtier: lookup of %d pages failed; answering a miss", len(keys))
            return 0

    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Load the leading pages some tier holds into the host pool's pages ``host_indices``."""
        try:
            return self._load(keys, self._opened()[1].storage, self._page_slots(host_indices))
        except Exception:
            log.exception("kvtier: load of %d pages failed; SGLang recomputes them", len(keys))
            return [False] * len(keys)

    def batch_set_v1(
        self, keys: list[str], host_indices: Any, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Store the host pool's pages ``host_indices`` under ``keys``."""
        try:
            return self._store(keys, self._opened()[1].storage, self._page_slots(host_indices))
        except Exception:
            log.exception("kvtier: store of %d pages failed", len(keys))
            return [False] * len(keys)

    # --- the generic interface (interface_v1: 0): flat page tensors ----------------------------

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        """Fill the flat page tensors ``target_locations`` (one per key); each is returned, or None where
        its page was not loaded."""
        try:
            targets = list(target_locations)
            dst = buffer_storage(targets, self._opened()[1].layout, writable=True)
            loaded = self._load(keys, dst, range(len(keys)))
            return [target if ok else None for target, ok in zip(targets, loaded, strict=True)]
        except Exception:
            log.exception("kvtier: load of %d pages failed; SGLang recomputes them", len(keys))
            return [None] * len(keys)

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Store the flat page tensors ``values`` (one per key); True when every page is stored."""
        try:
            pages = [value.contiguous() for value in values]
            return all(self._store(keys, buffer_storage(pages, self._opened()[1].layout), range(len(keys))))
        except Exception:
            log.exception("kvtier: store of %d pages failed", len(keys))
            return False

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.batch_get([key], [target_location])[0]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # --- housekeeping --------------------------------------------------------------------------

    def get_stats(self) -> StorageMetrics | None:
        """Pages and GB/s per load and store call since the last call, for SGLang's storage metrics."""
        if self.counters is None:
            return None
        return StorageMetrics(**dataclasses.asdict(self.counters.take()))

    def clear(self) -> None:
        """SGLang's "clear the storage backend" request. kvtier keeps its tiers: a disk tier evicts by its
        policy and a remote store is shared with other engines, so nothing is deleted on request."""
        log.warning("kvtier keeps its tiers on SGLang's clear request (blocks leave them by eviction)")

    def close(self) -> None:
        """Wait for copies in flight, copy what only a memory tier holds to a disk tier, release everything."""
        try:
            if self.stack is not None:
                self.stack.close()
        finally:
            if self.publisher is not None:
                self.publisher.close()  # (after the stack: what its close moved goes out too)

    # --- the calls, once checked ---------------------------------------------------------------

    def _load(self, keys: Sequence[str], dst: BlockStorage, slots: Sequence[int]) -> list[bool]:
        """Load the leading pages some tier holds into ``slots`` of ``dst``; per key, whether it arrived intact."""
        stack, _, counters = self._opened()
        started = time.perf_counter()
        result = stack.load_now(self._keys(keys), dst, slots, "host")
        failed = set(result.failed)
        ok = [i < result.hits and i not in failed for i in range(len(keys))]
        hits: dict[str, int] = {}
        for i, tier_name in enumerate(result.sources):
            if ok[i]:
                medium = stack.planner.tier(tier_name).medium
                hits[medium] = hits.get(medium, 0) + 1
        counters.loaded(hits, len(failed), time.perf_counter() - started)
        return ok

    def _store(self, keys: Sequence[str], src: BlockStorage, slots: Sequence[int]) -> list[bool]:
        """Store ``slots`` of ``src`` under ``keys``; per key, whether a tier holds it now (already held, or
        landed; not: no room, declined by the policy, or a failed copy)."""
        stack, _, counters = self._opened()
        started = time.perf_counter()
        kv_keys = self._keys(keys)
        result = stack.store_now(kv_keys, src, slots)
        failed = set(result.failed)
        ok = [key not in failed and not stack.planner.is_new(key) for key in kv_keys]
        counters.stored(result.stored, time.perf_counter() - started)
        return ok

    def _keys(self, keys: Sequence[str]) -> list[bytes]:
        return self._fold(keys)

    def _page_slots(self, host_indices: Any) -> list[int]:
        """The pool's pages that SGLang's token indices name (ValueError for anything but whole pages of it)."""
        pages = self._opened()[1]
        return page_slots(host_indices, pages.page_tokens, pages.storage.num_slots)

    def _opened(self) -> tuple[TierStack, PageGeometry, StorageCounters]:
        """The stack, the pool's pages and the counters, once SGLang registered its host pool."""
        if self.stack is None or self.pages is None or self.counters is None:
            raise StateError("SGLang has not registered its host pool with kvtier's storage backend yet")
        return self.stack, self.pages, self.counters


def _check_room_for_a_batch(config: StackConfig, page_bytes: int) -> None:
    """The first tier takes a whole batch SGLang stores in one call (up to STORAGE_BATCH_SIZE pages): a
    smaller one would refuse every full batch, and SGLang would store nothing while it seemed to work.
    A tier addressed by key (a node daemon's slab) has no capacity here: its owner makes room."""
    if config.tiers[0].keyed:
        return
    pages = capacity_in_blocks(config.tiers[0], page_bytes, config.header_room) or 0
    if pages < STORAGE_BATCH_SIZE:
        need = STORAGE_BATCH_SIZE * config.tiers[0].footprint(page_bytes, config.header_room)
        key = "capacity_blocks" if config.tiers[0].capacity_blocks is not None else "capacity"
        raise ConfigError(
            f"tiers[0].{key}: holds {pages} of SGLang's pages ({format_size(page_bytes)} each), "
            f"fewer than the {STORAGE_BATCH_SIZE} SGLang stores in one call; give at least "
            f"{format_size(need)}"
        )


def _rank_config(config: StackConfig, storage_config: HiCacheStorageConfig) -> StackConfig:
    """The configuration this rank opens: a tier whose storage lives in a directory (a disk tier's slab:
    ``Medium.directory_key``) in a directory of the rank's own (every rank holds its own shard of every
    page). MLA keeps one copy for the TP group, which only a store shared by the ranks can hold (SGLang
    lets one rank write it): such a tier under MLA with TP > 1 is refused."""
    tiers = list(config.tiers)
    for i, tier in enumerate(tiers):
        key = medium(tier.medium).directory_key
        if key is None:
            continue
        if storage_config.is_mla_model and storage_config.tp_size > 1:
            raise ConfigError(
                f"tiers[{i}].medium: {tier.medium}: an MLA model keeps one copy of its KV for all "
                f"{storage_config.tp_size} TP ranks, which SGLang lets one rank write; a {tier.medium} tier of "
                f"each rank would stay empty on the others: use a remote tier"
            )
        tiers[i] = tier.model_copy(update={key: str(Path(getattr(tier, key)) / _rank_directory(storage_config))})
    return config.model_copy(update={"tiers": tiers})


def _rank_offset(storage_config: HiCacheStorageConfig) -> int:
    """This scheduler's number among all of them (TP rank first, then pipeline stage, then data-parallel
    rank): where it publishes KV events (``event_publisher.for_rank``)."""
    tp, pp = storage_config.tp_size, storage_config.pp_size
    return storage_config.tp_rank + tp * (storage_config.pp_rank + pp * (storage_config.dp_rank or 0))


def _rank_directory(storage_config: HiCacheStorageConfig) -> str:
    """The directory of one scheduler's storage (a disk slab): its TP rank, pipeline stage and data-parallel rank."""
    name = f"rank{storage_config.tp_rank}"
    if storage_config.pp_size > 1:
        name += f"-pp{storage_config.pp_rank}"
    if storage_config.dp_rank:
        name += f"-dp{storage_config.dp_rank}"
    return name
