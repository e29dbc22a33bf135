"""``KVTierConnector``: kvtier as a vLLM 0.33 KV connector, loaded by module path.

vLLM builds one instance with the scheduler role (engine-core process) and one with the worker role
per GPU worker. The scheduler-side instance delegates to ``SchedulerSide`` (index, policies, jobs),
the worker-side one to ``WorkerSide`` (tier memory and copies). Enable it with::

    --kv-transfer-config '{"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connectors.vllm",
                           "kv_role": "kv_both", "kv_connector_extra_config": {"config": "/path/kvtier.yaml"}}'

Loads are asynchronous: a request with a hit waits (vLLM's WAITING_FOR_REMOTE_KVS) until every
rank has copied its blocks, so the forward pass never reads a block still being loaded. Stores start
after the forward pass that computed their blocks. A load that fails reports exactly the GPU blocks
that did not arrive, and vLLM recomputes them. kvtier is a best-effort cache: ``request_finished``
hands the blocks back at once, and a store still reading them is flushed before they are reused.

It supports vLLM's hybrid KV cache manager (``SupportsHMA``): models with several KV cache groups
keep it on. With several groups a failed load is reported per request (vLLM recomputes the request),
since block ids alone no longer say which group's block failed; with one group, per block.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.connectors.extra_config import engine_settings
from kvtier.connectors.vllm.geometry import block_layout, block_tokens, replicated, served_groups, state_groups
from kvtier.connectors.vllm.metadata import StepJobs
from kvtier.connectors.vllm.namespace import engine_namespace
from kvtier.connectors.vllm.scheduler import SchedulerSide
from kvtier.connectors.vllm.stats import KVTierConnectorStats, KVTierPromMetrics
from kvtier.connectors.vllm.worker import WorkerSide
from kvtier.core.config import StackConfig, load_config
from kvtier.core.devices import Capabilities
from kvtier.core.errors import ConfigError
from kvtier.core.jobs import WorkerReport
from kvtier.core.keys import key_secret
from kvtier.core.media import medium

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class ConnectorSettings(BaseModel):
    """``kv_connector_extra_config``: the kvtier configuration, and when blocks are stored.

    ``store: eager`` copies every block once it is full; ``store: lazy`` copies a block only when it
    is among the next ``lazy_ahead`` (a fraction of vLLM's GPU blocks) that vLLM's free queue will
    hand out again, so blocks vLLM's own prefix cache keeps serving cost no copy.

    ``host_hits: async`` (the default) parks a request whose hit host memory holds until a later step
    reports the load done, as every other hit (disk, remote, several KV cache groups) is loaded;
    ``in_step`` loads it in the step that computes the rest of its prompt (the workers copy before
    the forward pass). Async is the default because it measured faster (``bench/ttft.py``, 2-core
    AMD EPYC, vLLM's cache / kvtier: 0.94 async against 0.89 in step with a 2,048-token prefix, 0.99
    against 0.90 with 8,192 tokens): once idle steps wait for loads (``WorkerSide.idle``) the extra
    step costs less than copying on vLLM's thread, and a failed load never goes through vLLM's
    synchronous-load recovery.
    """

    model_config = ConfigDict(extra="forbid")

    config: str | dict
    store: Literal["eager", "lazy"] = "eager"
    lazy_ahead: float = Field(0.1, gt=0, le=1)
    host_hits: Literal["in_step", "async"] = "async"


def connector_settings(vllm_config: VllmConfig) -> ConnectorSettings:
    transfer = vllm_config.kv_transfer_config
    extra = transfer.kv_connector_extra_config if transfer is not None else None
    return engine_settings(ConnectorSettings, extra, "kv_connector_extra_config", "/etc/kvtier.yaml")


def connector_config(vllm_config: VllmConfig) -> StackConfig:
    """The kvtier configuration named by ``kv_connector_extra_config["config"]`` (a YAML path or a dict).
    Refuses context parallelism: its ranks hold interleaved parts of a block's tokens, which kvtier's
    keys (one per block of consecutive tokens) do not name."""
    parallel = vllm_config.parallel_config
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(parallel, name, 1) > 1:
            raise ConfigError(f"kvtier does not serve context parallelism ({name}={getattr(parallel, name)})")
    config = load_config(connector_settings(vllm_config).config)
    block_size = vllm_config.cache_config.block_size
    if "block_tokens" in config.model_fields_set and config.block_tokens != block_size:
        raise ConfigError(
            f"block_tokens: {config.block_tokens} differs from vLLM's block size {block_size}; "
            f"leave it out under vLLM or set it to {block_size}"
        )
    return config


@dataclass
class KVTierMetadata(StepJobs, KVConnectorMetadata):
    """One step's jobs (``StepJobs``) as vLLM carries them from the scheduler to every worker."""


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """Job completions from workers. vLLM merges the ranks' objects of one step with ``aggregate``;
    the scheduler's JobManager adds up steps, so a job ends once every rank has reported it."""

    report: WorkerReport = field(default_factory=WorkerReport)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVTierWorkerMetadata:
        if not isinstance(other, KVTierWorkerMetadata):
            raise TypeError(f"cannot aggregate kvtier worker metadata with {type(other).__name__}")
        return KVTierWorkerMetadata(self.report.aggregate(other.report))


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """Tiered KV cache (host memory, local disk, a shared remote store) below vLLM's GPU prefix cache."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        config = connector_config(vllm_config)
        settings = connector_settings(vllm_config)
        # Both roles: a missing secret fails every process at start, not the first request.
        secret = key_secret(config.key_secret_env)
        ns = engine_namespace(vllm_config, kv_cache_config, config)  # reads the model folder: once here
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            lazy_ahead = (
                max(1, round(settings.lazy_ahead * kv_cache_config.num_blocks)) if settings.store == "lazy" else None
            )
            states = state_groups(kv_cache_config)
            if states:
                log.warning(
                    "kvtier serves no prefix hits for this model: KV cache group(s) %s hold a recurrent "
                    "(Mamba) state, which kvtier does not store",
                    states,
                )
            self.scheduler_side = SchedulerSide(
                config,
                block_layout(kv_cache_config),
                block_tokens(kv_cache_config) or vllm_config.cache_config.block_size,
                vllm_config.parallel_config.world_size,
                ns,
                lazy_ahead,
                secret,
                served_groups(kv_cache_config),
                kv_cache_config.num_blocks,
                serves_hits=not states,
                replicated=replicated(kv_cache_config),
                in_step_host_hits=settings.host_hits == "in_step",
                capabilities=Capabilities(gpu_in_host_memory=vllm_config.device_config.device_type == "cpu"),
                kv_events=vllm_config.kv_events_config is not None
                and vllm_config.kv_events_config.enable_kv_cache_events,
            )
        else:
            transfer = vllm_config.kv_transfer_config
            self.worker_side = WorkerSide(
                config,
                kv_cache_config,
                vllm_config.parallel_config.rank,
                ns.hex(),
                vllm_config.parallel_config.world_size,
                (transfer.engine_id if transfer is not None else None) or "",
            )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped store is a later cache miss, never lost output

    @property
    def _sched(self) -> SchedulerSide:
        if self.scheduler_side is None:
            raise RuntimeError("a scheduler-side hook was called on kvtier's worker-side connector")
        return self.scheduler_side

    @property
    def _work(self) -> WorkerSide:
        if self.worker_side is None:
            raise RuntimeError("a worker-side hook was called on kvtier's scheduler-side connector")
        return self.worker_side

    # --- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._work.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._work.flush(_meta(kv_connector_metadata))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Start the step's loads (see ``WorkerSide.start`` for those this step's forward pass reads)."""
        self._work.start(_meta(self._get_connector_metadata()).loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: ``start_load_kv`` returns once this step's in-step loads have arrived (a
        request whose load is asynchronous is not scheduled until it arrived)."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing per layer: stores copy whole blocks once the step's forward pass is over."""

    def wait_for_save(self) -> None:
        self._work.start(_meta(self._get_connector_metadata()).stores)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """What vLLM's model runner asks (not ``get_finished``, whose pair of sets cannot say that a load
        failed as a whole: left to the base class's "nothing finished"). In a step that computes
        nothing, first waits briefly for a load in flight (``WorkerSide.idle``)."""
        if self.has_connector_metadata() and _meta(self._get_connector_metadata()).idle:
            self._work.idle()
        done, failed = self._work.take_finished_loads()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work.take_load_errors()

    def build_connector_worker_meta(self) -> KVTierWorkerMetadata | None:
        report = self.worker_side.take_report() if self.worker_side is not None else None
        return KVTierWorkerMetadata(report) if report is not None else None

    def get_kv_connector_stats(self) -> KVTierConnectorStats | None:
        if self.worker_side is not None:
            moved = self.worker_side.take_stats()
            return KVTierConnectorStats(data=moved) if moved is not None else None
        return self._sched.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVTierConnectorStats:
        return KVTierConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVTierPromMetrics:
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # --- scheduler side ------------------------------------------------------------------------

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self._sched.bind_gpu_block_pool(gpu_block_pool)

    def on_new_request(self, request: Request) -> None:
        self._sched.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        if num_external_tokens == 0:
            return {}
        tokens: dict[CacheHitSource, int] = {}
        for name, blocks in self._sched.hit_sources(request).items():
            label = medium(name).hit_source
            if label is not None:
                source = CacheHitSource[label]
                tokens[source] = tokens.get(source, 0) + blocks * self._sched.block_tokens
        tokens[CacheHitSource.EXTERNAL_UNSPECIFIED] = num_external_tokens - sum(tokens.values())
        return {source: n for source, n in tokens.items() if n > 0}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        jobs = self._sched.build_connector_meta(scheduler_output)
        return KVTierMetadata(jobs.loads, jobs.stores, jobs.flush, jobs.idle)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if meta is None:
            return
        if not isinstance(meta, KVTierWorkerMetadata):
            raise TypeError(f"kvtier got worker metadata of type {type(meta).__name__}")
        self._sched.apply_reports(meta.report)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched.request_finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """What vLLM calls instead of ``request_finished`` for a ``SupportsHMA`` connector."""
        return self._sched.request_finished(request)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """The groups a load writes (vLLM leaves their new blocks unzeroed): the attention groups."""
        return tuple(group.vllm_index for group in self._sched.groups)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._sched.take_events()

    def has_pending_push_work(self) -> bool:
        return self._sched.has_pending_work()

    def reset_cache(self) -> bool:
        return self._sched.reset_cache()

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.shutdown()
        if self.scheduler_side is not None:
            self.scheduler_side.shutdown()


def _meta(metadata: KVConnectorMetadata) -> StepJobs:
    if not isinstance(metadata, StepJobs):
        raise TypeError(f"kvtier got connector metadata of type {type(metadata).__name__}")
    return metadata
