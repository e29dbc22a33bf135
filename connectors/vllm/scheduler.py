"""The scheduler side of the connector: the hooks vLLM calls in its engine-core process, coordinating
the parts that do the work. It never touches KV bytes.

The planner (``core/planner.py``) decides which key goes into which slot of which tier, over whatever
tiers the configuration puts below vLLM's GPU blocks (host; host and disk; ...); this side ships its
plans to the workers as the per-step metadata and finishes each plan once every rank has reported its
job. A block's life here is the tier's (``core/tier.py``): a store reserves slots (WRITING) and
commits them when every rank has reported the copy; a load pins its sources until every rank has
reported. The work is done by parts with one job each, as vLLM's own offloading connector keeps its
tiers (its ``OffloadingManager``) apart from its hooks; this class calls them in the hooks' order:

- ``tiers.py``: the tiers' indexes, the job manager and the planner, built from the configuration
  (and the disk blocks a restart took back);
- ``request_state.py``: what is tracked per request (keys, block tables, hit, jobs in flight);
- ``lookup.py``: how long a hit is, for every KV cache group, asking a keyed store without waiting;
- ``stores.py``: which blocks each step stores (eager or lazy);
- ``step.py``: each step's metadata for the workers, and the fence over vLLM's GPU blocks;
- ``events.py``: vLLM's KV cache events;
- ``geometry.GroupKeys``: where each KV cache group's blocks lie among a request's keys.

Hooks, in the order vLLM calls them in one step: ``get_num_new_matched_tokens`` (how many leading
blocks past vLLM's own prefix hit some tier holds, leaving the last prompt token to compute; it pins
and touches nothing, so asking twice is harmless), ``update_state_after_alloc`` (plan the load into
the blocks vLLM allocated), ``build_connector_meta`` (stores: eager, every block that is full once
this step has run, or lazy, the cached blocks vLLM's free queue hands out next; demotions; the
fence), then ``apply_reports`` with the workers' reports, and ``take_events``. A vLLM hook cannot
wait: where the planner says room is on its way (victims still being demoted), the lookup answers
"ask again" and blocks that found no room are stored at a later step. Blocks reach a keyed last tier
from the host tier (write-through, by default: a copy job once they are stored there), loads from it
stage through host slots, and slots that a store call past its deadline may still write stay out of
use until the workers report that call over.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data

from kvtier.connectors.counters import miss_counts
from kvtier.connectors.vllm.events import KVEvents
from kvtier.connectors.vllm.geometry import GroupKeys, ServedGroup
from kvtier.connectors.vllm.lookup import HitLookup
from kvtier.connectors.vllm.metadata import StepJobs, TransferJob
from kvtier.connectors.vllm.request_state import BlockRef, Requests, RequestState
from kvtier.connectors.vllm.stats import KVTierConnectorStats
from kvtier.connectors.vllm.step import StepMetadata
from kvtier.connectors.vllm.stores import StorePicker
from kvtier.connectors.vllm.tiers import SchedulerTiers
from kvtier.core.config import StackConfig
from kvtier.core.devices import BASIC, GPU, Capabilities
from kvtier.core.jobs import Job, WorkerReport
from kvtier.core.keys import tenant_of
from kvtier.core.layout import BlockLayout
from kvtier.core.planner import Outcome, Plan, Room
from kvtier.core.tier import Tier
from kvtier.core.tier_config import tenant_labels

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


class SchedulerSide:
    """The connector's scheduler-side hooks over every tier below vLLM's GPU blocks."""

    def __init__(
        self,
        config: StackConfig,
        layout: BlockLayout,
        block_tokens: int,
        num_workers: int,
        namespace: bytes,
        lazy_ahead: int | None = None,
        key_secret: bytes | None = None,
        groups: Sequence[ServedGroup] = (ServedGroup(0),),
        gpu_blocks: int = 0,
        serves_hits: bool = True,
        replicated: bool = False,
        in_step_host_hits: bool = False,
        capabilities: Capabilities = BASIC,
        kv_events: bool = True,
    ) -> None:
        """``lazy_ahead`` None stores every block once it is full (eager); a number stores a block only
        once it is among the next ``lazy_ahead`` blocks vLLM's free queue will hand out again (lazy:
        no copy for blocks vLLM's own prefix cache keeps serving). ``key_secret`` keys every block
        key (``chain_hashes``); only this side hashes, the workers get keys in the metadata. ``groups``
        are the KV cache groups served, ``gpu_blocks`` vLLM's blocks per group; without
        ``serves_hits`` (a Mamba state group) every lookup is a miss and nothing is stored. With
        ``replicated`` KV (MLA: every rank holds the same) the tiers hold one copy per block for all
        ranks (``geometry.replicated``), which rank 0 alone moves between tiers (``worker.py``). With
        ``in_step_host_hits`` a hit that host memory holds whole is loaded in the step that computes the
        rest of the prompt (one KV cache group, as vLLM takes failed blocks of such a load only then,
        and no host slab shared by ranks, whose loads may need two steps). ``capabilities`` decide which
        loads stage through host memory (``core.routes``): none from a node tier where vLLM's own blocks are
        host memory (vLLM built for CPU). ``kv_events``: vLLM's KV cache events are on (each block's tokens
        are then kept for the events of its copies between tiers)."""
        self.config = config
        self.namespace = namespace
        self.geometry = GroupKeys(groups, block_tokens, gpu_blocks)
        self.groups = self.geometry.groups
        self.block_tokens = block_tokens
        self.num_workers = num_workers
        self.serves_hits = serves_hits
        # Replicated KV on several ranks: the one copy in the shared host slab must be staged (by rank 0)
        # before any rank reads it, so a staged load ships in two parts at two steps (``StepMetadata``).
        self.split_staged_loads = replicated and num_workers > 1
        # (not with a shared slab: a block staged into it since the lookup would be read before it arrived)
        self.in_step_host_hits = in_step_host_hits and len(self.groups) == 1 and not self.split_staged_loads
        self.stack = stack = SchedulerTiers(config, layout, namespace, num_workers, replicated, capabilities)
        self.jobs, self.tiers, self.planner, self.keyed = stack.jobs, stack.tiers, stack.planner, stack.keyed
        self.requests = Requests(self.geometry, namespace, key_secret, self.tiers[0])
        self.lookup = HitLookup(self.planner, self.geometry, self.keyed)
        self.step = StepMetadata(self.geometry, self.jobs, num_workers)
        self.events = KVEvents(self.geometry, self.planner.tier, self.stack.restores, keep_tokens=kv_events)
        self.events.watch_keyed(self.stack.tiers)
        self.stores = StorePicker(self.requests, self.planner, self.step, lazy_ahead, self._store)
        self.stats = KVTierConnectorStats()
        named = config.tenant_names()  # counted by tenant where some tier's shares name tenants
        self.tenant_label = tenant_labels(named, key_secret) if named else None

    def tier(self, name: str) -> Tier:
        return self.stack.tier(name)

    def request_namespace(self, lora: str = "", salt: str = "", lora_path: str = "") -> bytes:
        """The key namespace of a request (``Requests.request_namespace``)."""
        return self.requests.request_namespace(lora, salt, lora_path)

    def bind_gpu_block_pool(self, block_pool: BlockPool) -> None:
        self.stores.bind_gpu_block_pool(block_pool)

    def on_new_request(self, request: Request) -> None:
        self.requests.state(request)

    # --- lookup and load -----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens of the leading blocks after ``num_computed_tokens`` that some tier holds; always leaves
        the last prompt token to compute. Pins and touches nothing (vLLM may ask again and again); the
        one thing it may start is making room for the blocks the load would stage. None (ask again
        next step) while a block of the prefix is being staged by another load, room for staging is
        being demoted, or the keyed store has not answered yet for the blocks past the local hit."""
        state = self.requests.state(request)
        if state is None or not self.serves_hits:
            return 0, False
        keys = self.requests.keys(state)
        start = num_computed_tokens // self.block_tokens
        limit = min(len(keys), (request.num_tokens - 1) // self.block_tokens)
        if start % self.geometry.hit_keys or start * self.block_tokens != num_computed_tokens:
            return 0, False  # (vLLM hits end on every group's block boundary: not expected)
        end, found = self.lookup.find(state, start, limit)
        if end is None or not self._room_to_stage(found.staging):
            return None, False
        if not state.looked_up:
            state.looked_up = True
            self.lookup.count_miss(keys, start, end, limit, partial=request.num_tokens % self.block_tokens != 0)
        state.lookup_start = start
        self.requests.release(state)
        state.in_step = self.in_step_host_hits and end > start and not any(found.sources[: end - start])
        if state.in_step:
            self.requests.reserve(state, keys[start:end])
        return (end - start) * self.block_tokens, end > start and not state.in_step

    def _room_to_stage(self, staging: dict[int, int]) -> bool:
        """Make room for the blocks a load would stage (disk blocks load through host slots). Clean
        victims free theirs at once, dirty ones (write-back) once their demotion lands: False while
        that room is still on its way, so the lookup is asked again rather than the blocks recomputed."""
        for index, n in staging.items():
            room = self.planner.make_room(index, n)
            self._ship(room)
            if n > self.tiers[index].usage().free and room.pending:
                return False
        return True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Plan the load of the blocks counted as hits into the GPU blocks vLLM allocated.

        The planner pins the sources now; a disk block gets a host staging slot (where it stays
        cached). A block that left every tier since the lookup, and every block after it, is planned
        as missing: the workers report those GPU blocks as load errors and vLLM recomputes them (an
        in-step load's blocks cannot leave: its lookup pinned them until now).
        """
        block_ids = blocks.get_block_ids()
        self.step.allocate(block_ids)
        state = self.requests.state(request)
        if state is None:  # a request kvtier does not cache counted no hits
            return
        try:
            if num_external_tokens:
                self._plan_load(request, state, block_ids, num_external_tokens)
        finally:
            self.requests.release(state)

    def _plan_load(
        self, request: Request, state: RequestState, block_ids: tuple[list[int], ...], num_external_tokens: int
    ) -> None:
        """The load of a request's hit into the GPU blocks vLLM allocated (``update_state_after_alloc``)."""
        start = state.lookup_start
        tables = [block_ids[g.vllm_index] for g in self.groups]
        end = start + num_external_tokens // self.block_tokens
        keys, gpu_slots, positions = self.requests.load_blocks(state, tables, start, end)
        count = len(keys)
        planned = self.planner.load(keys, gpu_slots, GPU)
        self._ship(planned.room)
        plan = planned.plan
        loading = gpu_slots[: plan.num_blocks]
        sources = planned.sources  # each block counted once, where its first group's copy comes from
        if len(self.groups) > 1:
            sources = tuple(src for k, src in enumerate(sources) if k == 0 or positions[k] != positions[k - 1])
        state.load_sources = self.stack.per_medium({self.tiers[i].name: n for i, n in Counter(sources).items()})

        def done(job: Job) -> None:
            outcome = self._finish(plan, job)
            failed = len(outcome.lost) + count - plan.num_blocks  # lost on the way, or never planned
            self.stats.record_load(self.stack.per_medium(outcome.served), failed)
            if self.tenant_label is not None:
                self.stats.record_tenant(
                    "tenant_hit_blocks", self.tenant_label(state.tag), sum(outcome.served.values())
                )
            self._job_ended(job.id, request.request_id, loading, reads=False)

        # (a block staged through host memory since the lookup still loads in this step, only slower)
        split = self.split_staged_loads and len(plan.stages) > 1
        job = self._start(plan, done, parts=2 if split else 1)
        state.jobs.add(job.id)
        missing = gpu_slots[len(loading) :]
        self.step.add_load(TransferJob.of(job.id, plan, request.request_id, loading, missing, state.in_step), split)

    # --- stores --------------------------------------------------------------------------------

    def _store(self, picked: list[BlockRef], state: RequestState | None) -> tuple[int, int]:
        """A store of these blocks into the first tier (and on down, write-through), with this step's
        stores; fewer when room runs out or the tier's policy declines the last ones. Returns how many
        leading blocks it takes, and how many trailing blocks were declined (``Planned.declined``)."""
        if not picked:
            return 0, 0
        planned = self.planner.store([b.key for b in picked], [b.gpu_block for b in picked], self.stack.store_hops)
        self._ship(planned.room)
        plan = planned.plan
        if not plan.num_blocks:
            return 0, planned.declined
        picked = picked[: plan.num_blocks]
        gpu_blocks = [b.gpu_block for b in picked]
        req_id = state.request.request_id if state is not None else None
        blocks = {b.key: b for b in picked}

        def done(job: Job) -> None:
            outcome = self._finish(plan, job, blocks)
            stored = outcome.stored.get(self.tiers[0].name, [])
            self.stats.record_store(len(stored))
            if self.tenant_label is not None:
                for label, n in Counter(self.tenant_label(tenant_of(key)) for key in stored).items():
                    self.stats.record_tenant("tenant_stored_blocks", label, n)
            self._job_ended(job.id, req_id, gpu_blocks, reads=True)

        job = self._start(plan, done)
        if state is not None:
            state.jobs.add(job.id)
        self.step.add_store(TransferJob.of(job.id, plan, req_id), gpu_blocks)
        return plan.num_blocks, planned.declined

    # --- plans and jobs ------------------------------------------------------------------------

    def _start(self, plan: Plan, done: Callable[[Job], Any], parts: int = 1) -> Job:
        """The job every rank runs for ``plan``, in ``parts`` shipped one after the other: it holds the
        plan's fences until all ranks have reported every part."""
        job = self.jobs.create(plan.kind, plan.num_blocks, self.num_workers * parts, plan.fences, done)
        self.jobs.start(job.id)
        return job

    def _ship(self, room: Room) -> None:
        """What making room did, sent out: eviction events for the keys dropped, and the demotions
        as this step's jobs (run after the forward pass, with the stores)."""
        self.events.dropped(room.dropped)
        for plan in room.demotions:
            self._ship_copy(plan)

    def _ship_copy(self, plan: Plan) -> None:
        """A copy between tiers (a demotion, a copy to a keyed store) as a job of the next step's."""
        job = self._start(plan, lambda job: self._finish(plan, job))
        self.step.add_copy(TransferJob.of(job.id, plan))

    def _finish(self, plan: Plan, job: Job, blocks: dict[bytes, BlockRef] | None = None) -> Outcome:
        """Let the planner finish a plan whose job every rank reported; events for what changed. Blocks
        now in host memory are copied on to a keyed store placed write-through; host slots a store
        call may still write stay out of use until the workers report that call over."""
        outcome = self.planner.finish(plan, job)
        if outcome.holds:
            self.jobs.when_lifted(job, lambda job: self.planner.lift(outcome))
        for name, keys in outcome.stored.items():
            self.events.stored(keys, self.tier(name), blocks)
            index = self.stack.index(name)
            for target in self.planner.copy_targets(index, write_through=False):  # write-through hops: in the plan
                copied = self.planner.copy_down(index, keys, target)
                self._ship(copied.room)
                if copied.plan.num_blocks:
                    self._ship_copy(copied.plan)
        self.events.dropped(outcome.dropped)
        return outcome

    def _job_ended(self, job_id: int, req_id: str | None, gpu_slots: Iterable[int], reads: bool) -> None:
        self.step.job_ended(job_id, gpu_slots, reads)
        self.requests.job_ended(req_id, job_id)

    # --- the step ------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StepJobs:
        """This step's loads, stores, demotions and fence; resets the step's state (blocks a lookup
        reserved for a request vLLM did not allocate are let go)."""
        self.requests.release_step()
        live = getattr(scheduler_output, "kv_connector_block_state", None)  # (vLLM 0.32 has none)
        for req_id, block_id_groups, is_full_table in yield_req_data(scheduler_output):
            self.step.allocate(block_id_groups or ())
            self.requests.new_blocks(req_id, block_id_groups, is_full_table, live)
        flush = self.step.flush(self.requests.jobs_of(scheduler_output.preempted_req_ids or ()))
        if self.serves_hits:
            self.stores.store_step(scheduler_output)
        for index, tier in enumerate(self.tiers):  # above a high mark: demote or evict down to the low mark
            if tier.watermark is not None:
                self._ship(self.planner.relieve(index))
        return self.step.take(flush, idle=not scheduler_output.total_num_scheduled_tokens)

    def apply_reports(self, report: WorkerReport) -> None:
        """The workers' job completions of one step (every rank's, merged): plans whose jobs every
        rank has now reported are finished (their callbacks commit, release and count). A split load
        whose first part every rank has reported ships its second part with the next step's loads."""
        self.jobs.apply(report)
        self.step.apply_reports(report)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Blocks go back to vLLM at once: stores still reading them are flushed when they are reused."""
        self.requests.finished(request.request_id)
        return False, None

    def has_pending_work(self) -> bool:
        """Jobs in flight, and jobs whose quarantined slots await the workers' lift, keep the engine
        stepping, so their reports come back and their pins end."""
        return bool(self.jobs.in_flight() or self.jobs.held())

    def shutdown(self) -> None:
        """Stop asking the keyed store, and leave each disk tier's index for the next start
        (``SchedulerTiers.shutdown``)."""
        self.lookup.shutdown()
        self.stack.shutdown()

    # --- events, stats, reset ------------------------------------------------------------------

    def take_events(self) -> list[KVCacheEvent]:
        return self.events.take()

    def hit_sources(self, request: Request) -> dict[str, int]:
        """Blocks of the request's planned load per medium ("host", "disk", "remote"), each block (of
        every group) counted where its first group's copy comes from."""
        return self.requests.hit_sources(request.request_id)

    def take_stats(self) -> KVTierConnectorStats | None:
        """The step's counts: loads, stores, and the requests whose lookup ended early (``HitLookup.count_miss``)."""
        self.stats.record_misses(miss_counts(self.lookup.misses.take(), lambda name: self.tier(name).medium))
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, KVTierConnectorStats()
        return stats

    def reset_cache(self) -> bool:
        """Drop every block no job is using; True when every tier is empty afterwards. A keyed store is
        left as it is: it is shared, and its records are not this engine's to drop."""
        local = [t for t in self.tiers if not t.by_key]
        for tier in local:
            self.events.removed(tier.evict(tier.capacity), tier)
        return all(t.usage().used == 0 for t in local)

    def leaks(self) -> dict[str, Any]:
        """Pins, writes, jobs and GPU fences still held (all empty when kvtier is idle)."""
        return {
            "tiers": {t.name: t.leaks() for t in self.tiers if any(t.leaks().values())},
            "jobs": [j.id for j in self.jobs.in_flight()],
            **self.step.leaks(),
        }
