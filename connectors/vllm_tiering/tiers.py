"""kvtier's disk, remote and node tiers as secondary tiers of vLLM's tiered offloading (``SecondaryTierManager``).

vLLM keeps its CPU tier (the primary) and its own GPU <-> CPU copies; after a chunk lands there it
hands it to every secondary tier to store (``submit_store``: chunk ids of the CPU tier, pinned until
the job reports), and on a miss of the CPU tier asks each secondary tier in turn (``lookup``) and
promotes a hit into a CPU chunk it allocated (``submit_load``). Here each such tier is a kvtier
``TierStack`` (the one planner, kvtier's tiers and transfer backends) whose caller storage is vLLM's
CPU tier itself: one ``StridedStorage`` over its rows, slot = chunk id. A disk tier's reads and writes
go straight between its slab and the CPU tier's chunks, as a node tier's between the node daemon's
slab and them; a remote tier stages through a small host tier of its own (settings.py says why).
Keys: each OffloadKey folded under the namespace of the engine's chunks (namespace.py) and the key
secret (core/keys.py ``KeyFolder``).

vLLM's contract, kept here: every method runs on the scheduler thread (under the tiering manager's
lock) and must not block. ``submit_store`` and ``submit_load`` only queue the job; one thread per
direction runs it through the stack (which may wait for room or for a copy) and posts its
``JobResult``, collected by ``get_finished_jobs``. A disk tier answers ``lookup`` from its index at
once; a remote or node tier answers RETRY until vLLM's own ``AsyncLookupManager`` has asked the store or
the daemon (one batched query per request and step, off the scheduler thread). A promotion that fails names the
chunks that did arrive (``successful_keys``); a chunk that arrived damaged is never among them.
``drain_jobs`` waits until no job touches the CPU tier; ``shutdown`` also closes the stack (a disk
slab then holds what it held, found again at the next start).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    ConfigInfo,
    ConfigInfoMapping,
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.builder import build_stack
from kvtier.connectors.vllm_tiering.events import ChunkEvents
from kvtier.connectors.vllm_tiering.namespace import chunk_namespace
from kvtier.connectors.vllm_tiering.settings import tier_settings
from kvtier.core.devices import HOST_DEVICE
from kvtier.core.keys import KeyFolder, key_secret
from kvtier.core.layout import BlockLayout
from kvtier.core.storage import StridedStorage
from kvtier.core.tier import BlockState

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

log = logging.getLogger(__name__)

TIER_LABEL = "kvtier_tier"
"""The label of kvtier's own metrics: the entry's type (vLLM's ``tier`` label names the manager's tiers)."""

METRICS = {
    "vllm:kvtier_tier_stored_chunks": "Chunks a kvtier secondary tier stored (new ones; already held ones skipped).",
    "vllm:kvtier_tier_dropped_chunks": "Chunks a kvtier secondary tier did not store: no room, declined by its "
    "policy, or a copy that failed.",
    "vllm:kvtier_tier_failed_load_chunks": "Chunks a kvtier secondary tier could not promote intact (gone, "
    "damaged, foreign or unsigned): vLLM recomputes them.",
}


@dataclass(frozen=True)
class KVTierTierInfo(ConfigInfo):
    """The facts of one kvtier tier on ``vllm:kv_offload_config_info``: its namespace digest (what two
    engines must share to share chunks) and its tiers."""

    kvtier_namespace: str
    kvtier_tiers: str


class KVTierTier(SecondaryTierManager):
    """A kvtier tier stack behind vLLM's CPU tier; the subclasses name its medium."""

    kvtier_medium: ClassVar[str]  # the registered medium of its tier (settings.py reads the rest from its entry)
    kvtier_locality: ClassVar[Locality]  # what the tier's events and vLLM's per-request tier filters see
    medium: ClassVar[Medium] = Medium.STORAGE  # vLLM knows CPU and STORAGE; both of kvtier's are storage

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **entry: Any,
    ) -> None:
        """Validate the entry (a ConfigError names a wrong key and stops vLLM's start), then open the stack
        over the CPU tier's chunks; a disk tier finds what an earlier run of the same engine stored."""
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = self.kvtier_locality
        settings = tier_settings(self.kvtier_medium, tier_type, entry, self.block_size_bytes)
        namespace = chunk_namespace(offloading_spec.config, self.block_size_bytes, settings.config.namespace)
        self.config = settings.config.model_copy(update={"namespace": namespace})
        self._fold = KeyFolder(namespace, key_secret(self.config.key_secret_env))
        self.stack = build_stack(self.config, BlockLayout((self.block_size_bytes,)))
        self._events: ChunkEvents | None = None
        if settings.options.enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self._events = ChunkEvents(self.stack, self.medium, self.locality)
            else:
                log.warning(
                    "%s: enable_kv_events is set but vLLM publishes no KV cache events (kv_events_config); "
                    "this tier announces nothing",
                    tier_type,
                )
        self._chunks = _chunk_storage(primary_kv_view)
        self._info = KVTierTierInfo(
            hashlib.blake2b(namespace.encode(), digest_size=8).hexdigest(),
            ", ".join(f"{t.name}:{t.medium}:{t.capacity}" for t in self.stack.tiers),
        )
        self._jobs = _JobRunner(tier_type, self.config.transfer.io_threads)
        self._counts = dict.fromkeys(METRICS, 0)
        self._counts_lock = threading.Lock()
        log.info(
            "kvtier secondary tier %s for vLLM's CPU tier (%d chunks of %d bytes):\n%s",
            tier_type,
            self._chunks.num_slots,
            self.block_size_bytes,
            self.stack.describe(),
        )

    # --- vLLM's questions ------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT when a tier of the stack holds the chunk readable, RETRY while it is being stored here."""
        state = self._state(self._keys([key])[0])
        if state is BlockState.READY:
            return LookupResult.HIT
        return LookupResult.RETRY if state is BlockState.WRITING else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys, chunks = list(job_metadata.keys), [int(c) for c in job_metadata.chunk_ids]
        self._jobs.submit("store", job_metadata.job_id, lambda: self._store(job_metadata.job_id, keys, chunks), keys)

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys, chunks = list(job_metadata.keys), [int(c) for c in job_metadata.chunk_ids]
        self._jobs.submit("load", job_metadata.job_id, lambda: self._load(job_metadata.job_id, keys, chunks), keys)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """The jobs that ended since the last call; a promotion's chunks that did not arrive are a miss
        (``_load_failed``)."""
        results = []
        for kind, result, keys in self._jobs.finished():
            if kind == "load" and keys:
                self._load_failed(keys)
            results.append(result)
        return results

    def has_pending_work(self) -> bool:
        return self._jobs.pending() > 0

    def drain_jobs(self) -> None:
        self._jobs.drain()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """A use of chunks (vLLM's manager forwards its touches to every tier): each kvtier tier holding one
        tells its eviction policy, as a read would (a pin taken and released at once)."""
        kv_keys = self._keys(list(keys))
        for tier in self.stack.tiers:
            if not tier.by_key:
                tier.unpin([key for key in kv_keys if tier.try_pin(key)])

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Chunks that entered the stack and left it since the last call (``events.py``), when asked for."""
        return [] if self._events is None else self._events.take()

    def shutdown(self) -> None:
        """Wait for the jobs in flight, close the stack (a disk tier's slab keeps its chunks for the next
        start), and let go of the CPU tier's memory before vLLM releases it."""
        self._jobs.shutdown()
        try:
            self.stack.close()
        finally:
            self._chunks.close()

    # --- metrics ---------------------------------------------------------------------------------

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return {
            name: OffloadingCounterMetadata(documentation=doc, labelnames=(TIER_LABEL,))
            for name, doc in METRICS.items()
        }

    def get_stats(self) -> OffloadingConnectorStats | None:
        with self._counts_lock:
            counts, self._counts = self._counts, dict.fromkeys(METRICS, 0)
        stats = OffloadingConnectorStats()
        for name, value in counts.items():
            if value:
                stats.increase_counter(name, value, (self.tier_type,))
        return None if stats.is_empty() else stats

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return KVTierTierInfo.config_info_keys()

    def config_info(self) -> ConfigInfoMapping:
        return self._info.as_config_info()

    # --- the jobs, on the runner's threads -------------------------------------------------------

    def _store(self, job_id: int, keys: list[OffloadKey], chunks: list[int]) -> tuple[JobResult, list[OffloadKey]]:
        """Store the chunks, in batches the stack's first tier can hold; success unless a copy failed
        (a chunk with no room is a drop, counted: a full tier stores less). Also returns the chunks
        the stack does not hold afterwards."""
        started = time.perf_counter()
        stored = dropped = failed = 0
        kv_keys = self._keys(keys)
        if self._events is not None:
            self._events.storing(kv_keys, keys)
        step = self._batch(len(kv_keys))
        for i in range(0, len(kv_keys), step):
            result = self.stack.store(kv_keys[i : i + step], self._chunks, chunks[i : i + step]).result()
            stored += result.stored
            dropped += result.dropped
            failed += len(result.failed)
        self._count(**{"vllm:kvtier_tier_stored_chunks": stored, "vllm:kvtier_tier_dropped_chunks": dropped + failed})
        absent = [i for i, kv_key in enumerate(kv_keys) if self.stack.planner.is_new(kv_key)]
        if self._events is not None:
            self._events.not_stored([kv_keys[i] for i in absent])
        return JobResult(
            job_id,
            success=not failed,
            transfer_time=time.perf_counter() - started,
            transfer_bytes=stored * self.block_size_bytes,
        ), [keys[i] for i in absent]

    def _load(self, job_id: int, keys: list[OffloadKey], chunks: list[int]) -> tuple[JobResult, list[OffloadKey]]:
        """Promote the chunks, in batches the stack can stage; the result names those that arrived intact
        (a batch loads the prefix its tiers hold, and a chunk whose copy failed its checks never counts).
        Also returns those that did not arrive."""
        started = time.perf_counter()
        kv_keys = self._keys(keys)
        step = self._batch(len(kv_keys))
        arrived: list[OffloadKey] = []
        missed: list[OffloadKey] = []
        for i in range(0, len(kv_keys), step):
            result = self.stack.load(kv_keys[i : i + step], self._chunks, chunks[i : i + step], "host").result()
            failed = set(result.failed)
            for j, key in enumerate(keys[i : i + step]):
                (arrived if j < result.hits and j not in failed else missed).append(key)
        if missed:
            self._count(**{"vllm:kvtier_tier_failed_load_chunks": len(missed)})
        return JobResult(
            job_id,
            success=not missed,
            successful_keys=arrived or None,
            transfer_time=time.perf_counter() - started,
            transfer_bytes=len(arrived) * self.block_size_bytes,
        ), missed

    def _batch(self, n: int) -> int:
        """Chunks per batch of a job of ``n``: what the stack's first tier holds (all of them where that
        tier is addressed by key: its owner makes room)."""
        top = self.stack.tiers[0]
        return max(n, 1) if top.by_key else top.capacity

    def _load_failed(self, keys: list[OffloadKey]) -> None:
        """Chunks a promotion did not bring: the stack already treats them as a miss (a damaged slot is
        dropped, a store's record is a miss for a while); a tier with a lookup cache of its own forgets them."""

    def _keys(self, keys: Sequence[OffloadKey]) -> list[bytes]:
        return self._fold(keys)

    def _state(self, key: bytes) -> BlockState:
        """READY if some tier holds the chunk readable, WRITING if one is being written, else FREE."""
        writing = False
        for tier in self.stack.tiers:
            state = tier.state(key)
            if state is BlockState.READY:
                return state
            writing = writing or state is BlockState.WRITING
        return BlockState.WRITING if writing else BlockState.FREE

    def _count(self, **counts: int) -> None:
        with self._counts_lock:
            for name, value in counts.items():
                self._counts[name] += value


class KVTierDisk(KVTierTier):
    """kvtier's disk tier: a preallocated slab of checksummed slots in ``path``, found again after a
    restart, optionally compressed; its own eviction policy (``eviction``, adaptive by default)."""

    kvtier_medium = "disk"
    kvtier_locality = Locality.LOCAL


class _AskedTier(KVTierTier):
    """A kvtier tier addressed by key, whose owner (a store, a node daemon) is asked whether it holds a
    chunk off the scheduler thread (vLLM's ``AsyncLookupManager``): RETRY until it answered."""

    cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **entry: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector, **entry)
        self._asked = _StoreLookup(self)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """What the stack knows already (staged here, being stored, or recently found in the store), else
        the store's answer once vLLM's lookup thread has it (RETRY until then)."""
        known = super().lookup(key, req_context)
        if known is not LookupResult.MISS:
            return known
        found = self._asked.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def _load_failed(self, keys: list[OffloadKey]) -> None:
        """vLLM's lookup cache would still say HIT for them, and vLLM would ask to promote them again and again."""
        self._asked.mark_miss(keys)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._asked.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._asked.flush()

    def shutdown(self) -> None:
        self._asked.shutdown()
        super().shutdown()

    def query_store(self, keys: list[OffloadKey]) -> list[bool]:
        """Ask the owner which of the chunks it holds (one batched query, bounded by the tier's timeout:
        an unreachable owner answers "none")."""
        kv_keys = self._keys(keys)
        self.stack.tiers[-1].query(kv_keys)
        return [self._state(key) is BlockState.READY for key in kv_keys]


class KVTierRemote(_AskedTier):
    """kvtier's remote tier: a Mooncake Store or Redis/Valkey shared with other engines, records checked
    (and with ``auth_key_env`` authenticated) in a host staging tier of kvtier's before they are promoted."""

    kvtier_medium = "remote"
    kvtier_locality = Locality.REMOTE


class KVTierNode(_AskedTier):
    """kvtier's node tier: the machine's node daemon's slab, shared by every engine on the machine (``socket``
    of a ``kvtier node serve``); chunks are copied straight between it and vLLM's CPU tier, each checked
    against its slot header before it is promoted (a copy ends when it ends: no staging)."""

    kvtier_medium = "node"
    kvtier_locality = Locality.LOCAL


class _StoreLookup(AsyncLookupManager):
    """vLLM's asynchronous lookup, asking a keyed tier's owner on vLLM's lookup thread."""

    def __init__(self, tier: _AskedTier) -> None:
        super().__init__(tier_type=tier.tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier.query_store(keys)


Kind = Literal["store", "load"]
Run = Callable[[], tuple[JobResult, list[OffloadKey]]]


class _JobRunner:
    """Runs a tier's jobs off the scheduler thread and hands back what each returned: its ``JobResult``
    and the chunks it did not store or promote. A job that raises is reported failed (with all its
    chunks), never lost. ``threads`` jobs per direction run at once (the tier's ``transfer.io_threads``): vLLM submits
    a job per request and step, often of a few chunks, and one at a time would leave the disk one read
    deep; a pool per direction keeps a burst of stores from delaying promotions."""

    def __init__(self, tier_type: str, threads: int) -> None:
        self._pools = {
            kind: ThreadPoolExecutor(threads, thread_name_prefix=f"kvtier-{tier_type}-{kind}")
            for kind in ("store", "load")
        }
        self._done: list[tuple[Kind, JobResult, list[OffloadKey]]] = []
        self._in_flight = 0
        self._cond = threading.Condition()

    def submit(self, kind: Kind, job_id: int, run: Run, keys: list[OffloadKey]) -> None:
        with self._cond:
            self._in_flight += 1
        self._pools[kind].submit(self._run, kind, job_id, run, keys)

    def finished(self) -> list[tuple[Kind, JobResult, list[OffloadKey]]]:
        with self._cond:
            done, self._done = self._done, []
        return done

    def pending(self) -> int:
        with self._cond:
            return self._in_flight + len(self._done)

    def drain(self) -> None:
        """Wait until every submitted job has run (its result waits in ``finished``)."""
        with self._cond:
            self._cond.wait_for(lambda: self._in_flight == 0)

    def shutdown(self) -> None:
        self.drain()
        for pool in self._pools.values():
            pool.shutdown()

    def _run(self, kind: Kind, job_id: int, run: Run, keys: list[OffloadKey]) -> None:
        try:
            done = (kind, *run())
        except Exception:
            log.exception("kvtier secondary tier: %s job %d failed", kind, job_id)
            done = (kind, JobResult(job_id, success=False), keys)
        with self._cond:
            self._done.append(done)
            self._in_flight -= 1
            self._cond.notify_all()


def _chunk_storage(view: memoryview) -> StridedStorage:
    """One fragment per chunk: the whole row (every worker's shard and the padding), at its address in
    the CPU tier's shared region. The array is the only export of the view kvtier holds; ``close``
    drops it, so vLLM can release the view after shutdown."""
    rows = np.asarray(view)
    if rows.ndim != 2 or not rows.flags.c_contiguous:
        raise ValueError(f"vLLM's CPU tier view must be (chunks, row bytes) and contiguous, got {rows.shape}")
    row = rows.shape[1] * rows.itemsize
    return StridedStorage(BlockLayout((row,)), rows.shape[0], [rows.ctypes.data], [row], HOST_DEVICE, keepalive=rows)
