"""The scheduler side of the connector: the tiers' index, their policies and the job manager.

It runs in vLLM's engine-core process and never touches KV bytes: it decides which key goes into
which slot of which tier, and which copies the workers run, through the per-step metadata. A block's
life here is the tier's (``core/tier.py``): a store reserves host slots (WRITING) and commits them
when every rank has reported the copy; a load pins its sources until every rank has reported.

Hooks, in the order vLLM calls them in one step: ``get_num_new_matched_tokens`` (how many leading
blocks past vLLM's own prefix hit some tier holds, leaving the last prompt token to compute; it pins
and touches nothing, so asking twice is harmless), ``update_state_after_alloc`` (plan the load into
the blocks vLLM allocated), ``build_connector_meta`` (stores: eager, every block that is full once
this step has run, or lazy, the cached blocks vLLM's free queue hands out next; demotions; the
fence), then ``update_connector_output`` with the workers' reports, and ``take_events``. GPU blocks are fenced the way vLLM's own offloading connector
does it: a running request's blocks are held by vLLM, and a store still reading blocks that vLLM
hands out again (after a finish or a preemption) is flushed by the workers before the forward pass.
At start, the disk tier takes back the blocks every rank's slab still holds (``recovery.py``).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data

from kvtier.connectors.vllm.metadata import GPU, Copy, KVTierMetadata, KVTierWorkerMetadata, TransferJob
from kvtier.connectors.vllm.namespace import request_namespace
from kvtier.connectors.vllm.recovery import blocks_on_every_rank
from kvtier.connectors.vllm.stats import KVTierConnectorStats
from kvtier.core.config import DiskTierConfig, StackConfig, capacity_in_blocks, eviction_policy
from kvtier.core.errors import ConfigError, TransferError
from kvtier.core.jobs import Fence, Job, JobManager, JobState
from kvtier.core.keys import chain_hashes
from kvtier.core.layout import BlockLayout
from kvtier.core.storage import BlockStorage
from kvtier.core.tier import BlockState, Tier
from kvtier.policies import Watermark

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

EVENT_MEDIUM = {"host": "CPU", "disk": "STORAGE"}


class RemoteSlots(BlockStorage):
    """The slots of a tier whose bytes live in the worker processes: the scheduler side keeps only
    the count and the geometry, so asking it for an address is a bug and raises."""

    def __init__(self, layout: BlockLayout, num_slots: int) -> None:
        super().__init__(layout, num_slots, "worker")

    def _addresses(self, slots):
        raise TransferError("the scheduler side holds no KV bytes; workers address the slots")


def tier_slots(config: StackConfig, block_bytes: int) -> list[tuple[str, str, int]]:
    """(name, medium, number of slots) of every tier kvtier keeps under vLLM (the GPU is vLLM's own).

    Scheduler and workers both call this, so they agree on every tier's slot count.
    """
    out = []
    for i, tier_cfg in enumerate(config.tiers):
        if tier_cfg.medium == "gpu":
            continue
        blocks = capacity_in_blocks(tier_cfg, block_bytes)
        if blocks is None or blocks < 1:
            raise ConfigError(f"tiers[{i}] ({config.tier_name(i)}): capacity holds no block of {block_bytes} "
                              f"bytes (one rank's share of a vLLM block)")
        out.append((config.tier_name(i), tier_cfg.medium, blocks))
    if not out or out[0][1] != "host":
        raise ConfigError("under vLLM the first tier below the GPU must be a host tier (disk blocks are loaded "
                          "through host memory)")
    return out


@dataclass
class _RequestState:
    """What the scheduler side knows about one live request."""

    request: "Request"
    namespace: bytes
    keys: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    stored: int = 0          # leading blocks already handed to the store planner
    lookup_start: int = 0    # first block past vLLM's own prefix hit, from the last lookup
    load_sources: dict[str, int] = field(default_factory=dict)  # medium -> blocks of the planned load
    jobs: set[int] = field(default_factory=set)  # store and load jobs in flight


class SchedulerSide:
    """Index, policies and jobs for every tier below vLLM's GPU blocks."""

    def __init__(self, config: StackConfig, layout: BlockLayout, block_tokens: int, num_workers: int,
                 namespace: bytes, lazy_ahead: int | None = None, key_secret: bytes | None = None) -> None:
        """``lazy_ahead`` None stores every block once it is full (eager); a number stores a block only
        once it is among the next ``lazy_ahead`` blocks vLLM's free queue will hand out again (lazy:
        no copy for blocks vLLM's own prefix cache keeps serving). ``key_secret`` keys every block
        key (``chain_hashes``); only this side hashes, the workers get keys in the metadata."""
        self.config = config
        self.key_secret = key_secret
        self.lazy_ahead = lazy_ahead
        self.block_tokens = block_tokens
        self.num_workers = num_workers
        self.namespace = namespace
        self.jobs = JobManager()
        self.tiers: list[Tier] = []
        tier_cfgs = {config.tier_name(j): t for j, t in enumerate(config.tiers)}
        for name, medium, slots in tier_slots(config, layout.block_bytes):
            wm = tier_cfgs[name].watermark
            self.tiers.append(Tier(name, medium, RemoteSlots(layout, slots), eviction_policy(tier_cfgs[name].eviction)(),
                                   Watermark(wm.high, wm.low) if wm else None, self.jobs.is_fenced))
        self.host = self.tiers[0]
        self.disk = self.tiers[1] if len(self.tiers) > 1 else None
        self.write_through = config.placement == "write_through"
        self.stats = KVTierConnectorStats()
        self._requests: dict[str, _RequestState] = {}
        self._events: list[KVCacheEvent] = []
        if self.disk is not None:
            self._recover_disk(tier_cfgs[self.disk.name], layout)
        self._step_loads: list[TransferJob] = []
        self._step_demotions: list[TransferJob] = []
        self._step_allocated: set[int] = set()
        self._gpu_readers: dict[int, set[int]] = {}   # GPU block id -> store jobs reading it
        self._gpu_loading: dict[int, int] = {}        # GPU block id -> the load job writing it
        self._demoting = 0                            # host blocks whose demotion to disk is in flight
        self._gpu_keys: dict[int, tuple[bytes, tuple[int, ...]]] = {}  # lazy: GPU block -> key and tokens it holds
        self._block_pool: "BlockPool | None" = None

    def _recover_disk(self, tier_cfg: DiskTierConfig, layout: BlockLayout) -> None:
        """Take back the blocks a previous engine left on every rank's disk slab (``recovery.py``)."""
        blocks = blocks_on_every_rank(tier_cfg, self.num_workers, self.disk.capacity, layout, self.namespace.hex())
        self.disk.restore(blocks)
        self._stored_events([key for key, _ in blocks], self.disk)
        if blocks:
            log.info("kvtier disk tier %s: %d blocks kept from before the restart", tier_cfg.path, len(blocks))

    # --- requests and keys ---------------------------------------------------------------------

    def bind_gpu_block_pool(self, block_pool: "BlockPool") -> None:
        """vLLM's GPU block pool: lazy mode walks its free queue for blocks about to be reused."""
        self._block_pool = block_pool

    def on_new_request(self, request: "Request") -> None:
        self._state(request)

    def _state(self, request: "Request") -> _RequestState | None:
        """The request's state, created on first sight; None for requests kvtier does not cache
        (prompt embeddings or multimodal inputs: token ids alone do not name their KV)."""
        state = self._requests.get(request.request_id)
        if state is None:
            if request.prompt_embeds is not None or request.mm_features:
                return None
            lora = request.lora_request
            state = _RequestState(request, self.request_namespace(lora.lora_name if lora else "",
                                                                  request.cache_salt or "",
                                                                  lora.lora_path if lora else ""))
            self._requests[request.request_id] = state
        return state

    def request_namespace(self, lora: str = "", salt: str = "", lora_path: str = "") -> bytes:
        """The key namespace of a request: the engine's, its LoRA adapter and its cache salt (blocks
        of another adapter hold other KV; a salt keeps tenants' blocks apart), encoded unambiguously."""
        return request_namespace(self.namespace, lora, lora_path, salt)

    def _keys(self, state: _RequestState) -> list[bytes]:
        """Keys of every full block of the request's tokens so far, hashing only blocks not yet hashed."""
        tokens = state.request.all_token_ids
        full = len(tokens) // self.block_tokens
        if full > len(state.keys):
            new = tokens[len(state.keys) * self.block_tokens: full * self.block_tokens]
            parent = state.keys[-1] if state.keys else None
            state.keys += chain_hashes(list(new), self.block_tokens, state.namespace if parent is None else b"",
                                       parent=parent, secret=self.key_secret)
        return state.keys

    def _tier_holding(self, key: bytes) -> Tier | None:
        return next((t for t in self.tiers if t.state(key) is BlockState.READY), None)

    # --- lookup and load -----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens of the leading blocks after ``num_computed_tokens`` that some tier holds; always leaves
        the last prompt token to compute. Pins and touches nothing (vLLM may ask again and again); the
        one thing it may start is making host room for disk hits. None (ask again next step) while a
        disk block of the prefix is being staged by another load, or host room is being demoted."""
        state = self._state(request)
        if state is None:
            return 0, False
        keys = self._keys(state)
        start = num_computed_tokens // self.block_tokens
        limit = min(len(keys), (request.num_tokens - 1) // self.block_tokens)
        window = keys[start:limit]
        hits = self.host.lookup(window)  # the usual case, a run of host blocks, under one lock
        staged = 0
        for key in window[hits:]:
            tier = self._tier_holding(key)
            if tier is None:
                break
            if tier is not self.host:
                if self.host.state(key) is BlockState.WRITING:
                    return None, False  # another load is staging it into host memory: ask again next step
                staged += 1
            hits += 1
        if staged > self.host.usage().free:
            # Disk blocks are loaded through host slots. Clean victims free theirs at once; dirty ones
            # (write-back) only once their demotion lands, so wait for it rather than recompute.
            self._make_host_room(staged - self.host.usage().free - self._demoting)
            if staged > self.host.usage().free and self._demoting:
                return None, False
        state.lookup_start = start
        return hits * self.block_tokens, hits > 0

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        """Plan the load of the blocks counted as hits into the GPU blocks vLLM allocated.

        Sources are pinned now; a disk block gets a host staging slot (where it stays cached). A block
        that left every tier since the lookup, and every block after it, is planned as missing: the
        workers report those GPU blocks as load errors and vLLM recomputes them.
        """
        block_ids = blocks.get_block_ids()[0]
        self._step_allocated.update(block_ids)
        if num_external_tokens == 0:
            return
        state = self._state(request)
        count = num_external_tokens // self.block_tokens
        start = state.lookup_start
        keys = self._keys(state)[start:start + count]
        gpu_blocks = tuple(block_ids[start:start + count])
        run = self.host.lookup(keys)  # the leading host blocks, pinned in one call (all READY right now)
        direct: list[tuple[int, int]] = list(enumerate(self.host.pin(keys[:run])))  # (job block, host slot)
        staged: list[tuple[int, int, int]] = []   # (job block, disk slot, host staging slot)
        for i, key in enumerate(keys[run:], start=run):
            if self.host.try_pin(key):
                direct.append((i, self.host.slots([key])[0]))
                continue
            if self.disk is None or self.host.state(key) is not BlockState.FREE or not self.disk.try_pin(key):
                break
            slot = self._host_slots([key])
            if not slot:
                self.disk.unpin([key])
                break
            staged.append((i, self.disk.slots([key])[0], slot[0]))
        planned = len(direct) + len(staged)
        state.load_sources = {"host": len(direct), "disk": len(staged)}
        stages: list[tuple[Copy, ...]] = []
        if staged:
            stages.append((Copy(self.disk.name, tuple(d for _, d, _ in staged), self.host.name,
                                tuple(h for _, _, h in staged), tuple(keys[i] for i, _, _ in staged),
                                tuple(i for i, _, _ in staged)),))
        to_gpu = sorted(direct + [(i, h) for i, _, h in staged])
        if to_gpu:
            stages.append((Copy(self.host.name, tuple(h for _, h in to_gpu), GPU, tuple(gpu_blocks[i] for i, _ in to_gpu),
                                tuple(keys[i] for i, _ in to_gpu), tuple(i for i, _ in to_gpu)),))
        fences = [Fence(self.host.name, h, False) for _, h in direct]
        fences += [f for _, d, h in staged for f in (Fence(self.disk.name, d, False), Fence(self.host.name, h, True))]

        def done(job: Job) -> None:
            failed = set(range(planned)) if job.state is JobState.CANCELLED else job.failed_blocks
            direct_keys = [keys[i] for i, _ in direct]
            self.host.unpin(direct_keys)
            self.host.discard([keys[i] for i, _ in direct if i in failed])
            if staged:
                disk_keys = [keys[i] for i, _, _ in staged]
                self.disk.unpin(disk_keys)
                self.disk.discard([keys[i] for i, _, _ in staged if i in failed])
                self.host.abort([keys[i] for i, _, _ in staged if i in failed])
                landed = [keys[i] for i, _, _ in staged if i not in failed]
                self.host.commit(landed)
                self._stored_events(landed, self.host)
            host_hits, disk_hits = sum(i not in failed for i, _ in direct), sum(i not in failed for i, _, _ in staged)
            self.host.record(hits=host_hits, bytes_out=host_hits * self.host.block_bytes)
            if self.disk is not None:
                self.disk.record(hits=disk_hits, bytes_out=disk_hits * self.disk.block_bytes)
            self.stats.record_load(host_hits, disk_hits, len(failed) + count - planned)
            self._job_ended(job.id, request.request_id, gpu_blocks[:planned], reads=False)

        job = self.jobs.create("load", max(planned, 1), self.num_workers, fences, done)
        self.jobs.start(job.id)
        state.jobs.add(job.id)
        for block in gpu_blocks[:planned]:
            self._gpu_loading[block] = job.id
        self._step_loads.append(TransferJob(job.id, "load", max(planned, 1), tuple(stages), request.request_id,
                                            gpu_blocks[:planned], gpu_blocks[planned:]))

    # --- stores --------------------------------------------------------------------------------

    def _host_slots(self, keys: list[bytes]) -> list[int]:
        """Reserve host slots for ``keys`` (a prefix of them when room runs out: a full tier stores less).

        Room is made through the host policy: victims the disk tier holds (or that have no tier
        below) are dropped at once, others are demoted by a job and free their slots when it ends
        (so slots of demotions in flight count as room: a store retried before they end does not
        evict again).
        """
        short = len(keys) - self.host.usage().free - self._demoting
        if short > 0:
            self._make_host_room(short)
        return self._reserve_free(self.host, keys)

    def _make_host_room(self, n: int) -> None:
        if n <= 0:
            return
        victims = [key for key, _ in self.host.begin_evict(n)]
        if self.disk is None:
            self._end_evict(self.host, victims)
            return
        dirty = [k for k in victims if self.disk.state(k) is BlockState.FREE]
        self._end_evict(self.host, [k for k in victims if self.disk.state(k) is not BlockState.FREE])
        slots = self._disk_slots(dirty)
        self._end_evict(self.host, dirty[len(slots):])  # no room on disk either: dropped
        if slots:
            self._demote(dirty[:len(slots)], slots)

    def _disk_slots(self, keys: list[bytes]) -> list[int]:
        short = len(keys) - self.disk.usage().free
        if short > 0:
            self._removed_events(self.disk.evict(short), self.disk)
        return self._reserve_free(self.disk, keys)

    @staticmethod
    def _reserve_free(tier: Tier, keys: list[bytes]) -> list[int]:
        """Slots for the leading keys that fit in the tier's free slots, evicting nothing."""
        room = min(len(keys), tier.usage().free)
        if room == 0:
            return []
        return tier.reserve(keys[:room], allow_evict=False) or []

    def _end_evict(self, tier: Tier, keys: list[bytes]) -> None:
        tier.end_evict(keys)
        self._removed_events([k for k in keys if tier.state(k) is BlockState.FREE], tier)

    def _demote(self, keys: list[bytes], disk_slots: list[int]) -> None:
        host_slots = self.host.slots(keys)
        fences = [*(Fence(self.host.name, s, False) for s in host_slots), *(Fence(self.disk.name, s, True) for s in disk_slots)]

        def done(job: Job) -> None:
            failed = set(range(len(keys))) if job.state is JobState.CANCELLED else job.failed_blocks
            ok = [k for i, k in enumerate(keys) if i not in failed]
            self.disk.commit(ok)
            self._refused(keys, job.refused_blocks)
            refused = self.disk.abort([k for i, k in enumerate(keys) if i in failed])
            self._stored_events(ok, self.disk)
            self.host.end_demotion(ok, [k for i, k in enumerate(keys) if i in failed], refused)
            self._removed_events([k for k in keys if self.host.state(k) is BlockState.FREE], self.host)
            self._demoting -= len(keys)

        job = self.jobs.create("demote", len(keys), self.num_workers, fences, done)
        self.jobs.start(job.id)
        self._demoting += len(keys)
        copy = Copy(self.host.name, tuple(host_slots), self.disk.name, tuple(disk_slots), tuple(keys),
                    tuple(range(len(keys))))
        self._step_demotions.append(TransferJob(job.id, "demote", len(keys), ((copy,),)))

    def _refused(self, keys: list[bytes], blocks: Iterable[int]) -> None:
        """Mark the reserved disk slots of the job blocks the workers' disk slabs refused for good
        (compressed, they outgrow a slot), so ``abort`` names them, and count them."""
        refused = [keys[i] for i in blocks]
        if refused:
            self.disk.refuse(refused)
            self.disk.record(incompressible=len(refused))

    def _unstored_full(self, state: _RequestState, num_tokens: int) -> list[tuple[bytes, int, tuple[int, ...]]]:
        """(key, GPU block, tokens) of the request's blocks full with ``num_tokens`` tokens that no
        store has taken yet (``state.stored`` counts those taken, from the first block on)."""
        keys = self._keys(state)
        full = min(num_tokens // self.block_tokens, len(state.block_ids), len(keys))
        tokens = state.request.all_token_ids
        return [(keys[i], state.block_ids[i], tuple(tokens[i * self.block_tokens:(i + 1) * self.block_tokens]))
                for i in range(state.stored, full)]

    def _store_full(self, state: _RequestState, num_tokens: int) -> TransferJob | None:
        """Store the request's full blocks no tier holds yet. Those that find no host room now (its
        victims are still being demoted) are tried again at the request's next step, in chain order."""
        full = self._unstored_full(state, num_tokens)
        todo = [b for b in full if self._storable(b[0], b[1])]
        job = self._store(todo, state)
        taken = job.num_blocks if job is not None else 0
        state.stored += len(full) if taken == len(todo) else full.index(todo[taken])
        return job

    def _storable(self, key: bytes, block: int) -> bool:
        """Neither being loaded (so a tier has it) nor held or being written by any tier already."""
        return block not in self._gpu_loading and all(t.state(key) is BlockState.FREE for t in self.tiers)

    def _lazy_candidates(self) -> list[tuple[bytes, int, tuple[int, ...]]]:
        """Cached GPU blocks among the next ``lazy_ahead`` vLLM will reuse, whose KV no tier holds yet;
        one per key (requests with the same prompt computed in one step hold the same KV twice)."""
        picked: dict[bytes, tuple[bytes, int, tuple[int, ...]]] = {}
        for block in itertools.islice(self._block_pool.free_block_queue.iter_blocks_after(None), self.lazy_ahead):
            known = self._gpu_keys.get(block.block_id)
            if (block.block_hash is not None and known is not None and known[0] not in picked
                    and self._storable(known[0], block.block_id)):
                picked[known[0]] = (known[0], block.block_id, known[1])
        return list(picked.values())

    def _store(self, picked: list[tuple[bytes, int, tuple[int, ...]]], state: _RequestState | None) -> TransferJob | None:
        """A store of these (key, GPU block, tokens) into host slots (and disk, write-through); fewer
        when room runs out, None when none fits."""
        if not picked:
            return None
        host_slots = self._host_slots([k for k, _, _ in picked])
        picked = picked[:len(host_slots)]
        if not picked:
            return None
        keys = [k for k, _, _ in picked]
        disk_slots = self._disk_slots(keys) if self.write_through and self.disk is not None else []
        n = len(picked)
        stages = [(Copy(GPU, tuple(b for _, b, _ in picked), self.host.name, tuple(host_slots), tuple(keys),
                        tuple(range(n))),)]
        if disk_slots:
            stages.append((Copy(self.host.name, tuple(host_slots[:len(disk_slots)]), self.disk.name, tuple(disk_slots),
                                tuple(keys[:len(disk_slots)]), tuple(range(len(disk_slots)))),))
        fences = [*(Fence(self.host.name, s, True) for s in host_slots), *(Fence(self.disk.name, s, True) for s in disk_slots)]
        gpu_blocks = [b for _, b, _ in picked]
        req_id = state.request.request_id if state is not None else None
        block_tokens = {k: t for k, _, t in picked}

        def done(job: Job) -> None:
            cancelled = job.state is JobState.CANCELLED
            failed = set(range(n)) if cancelled else job.failed_blocks
            # A block that failed only in the disk stage (refused, a disk error) has its host copy
            # whole on every rank: it stays.
            host_failed = failed if cancelled else job.first_stage_failed
            refused = set() if cancelled else job.refused_blocks
            ok = [k for i, k in enumerate(keys) if i not in host_failed]
            self.host.commit(ok)
            self.host.abort([k for i, k in enumerate(keys) if i in host_failed])
            self._stored_events(ok, self.host, block_tokens)
            if disk_slots:
                on_disk = [k for i, k in enumerate(keys[:len(disk_slots)]) if i not in failed]
                self.disk.commit(on_disk)
                self._refused(keys, refused)
                self.disk.abort([k for i, k in enumerate(keys[:len(disk_slots)]) if i in failed])
                self._stored_events(on_disk, self.disk, block_tokens)
            self.stats.record_store(len(ok))
            self._job_ended(job.id, req_id, gpu_blocks, reads=True)

        job = self.jobs.create("store", n, self.num_workers, fences, done)
        self.jobs.start(job.id)
        if state is not None:
            state.jobs.add(job.id)
        for block in gpu_blocks:
            self._gpu_readers.setdefault(block, set()).add(job.id)
        return TransferJob(job.id, "store", n, tuple(stages), req_id)

    def _job_ended(self, job_id: int, req_id: str | None, gpu_blocks: Iterable[int], reads: bool) -> None:
        for block in gpu_blocks:
            if reads:
                readers = self._gpu_readers[block]
                readers.discard(job_id)
                if not readers:
                    del self._gpu_readers[block]
            elif self._gpu_loading.get(block) == job_id:
                del self._gpu_loading[block]
        state = self._requests.get(req_id) if req_id is not None else None
        if state is not None:
            state.jobs.discard(job_id)

    # --- the step ------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVTierMetadata:
        """This step's loads, stores, demotions and fence; resets the step's state."""
        allocated = self._step_allocated
        for req_id, block_id_groups, is_full_table in yield_req_data(scheduler_output):
            state = self._requests.get(req_id)
            new = block_id_groups[0] if block_id_groups else []
            allocated.update(new)
            if state is None:
                continue
            if is_full_table:
                state.block_ids = list(new)
                state.stored = 0
            else:
                state.block_ids += new
        flush = {job for block in allocated for job in self._gpu_readers.get(block, ())}
        for req_id in scheduler_output.preempted_req_ids or ():
            state = self._requests.get(req_id)
            if state is not None:
                flush |= {j for j in state.jobs if j not in {t.job_id for t in self._step_loads}}
        stores = []
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(req_id)
            if state is None:
                continue
            num_tokens = state.request.num_computed_tokens + scheduled
            if self.lazy_ahead is None:
                stores.append(self._store_full(state, num_tokens))
            else:
                full = self._unstored_full(state, num_tokens)
                self._gpu_keys.update((block, (key, tokens)) for key, block, tokens in full)
                state.stored += len(full)
        if self.lazy_ahead is not None:
            stores.append(self._store(self._lazy_candidates(), None))
        stores = [job for job in stores if job is not None]
        excess = self.host.excess()
        if excess > 0:
            self._make_host_room(excess)
        meta = KVTierMetadata(self._step_loads, stores + self._step_demotions, flush)
        self._step_loads, self._step_demotions, self._step_allocated = [], [], set()
        return meta

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        meta = output.kv_connector_worker_meta
        if meta is None:
            return
        if not isinstance(meta, KVTierWorkerMetadata):
            raise TypeError(f"kvtier got worker metadata of type {type(meta).__name__}")
        self.jobs.apply(meta.report)

    def request_finished(self, request: "Request") -> tuple[bool, dict[str, Any] | None]:
        """Blocks go back to vLLM at once: stores still reading them are flushed when they are reused."""
        self._requests.pop(request.request_id, None)
        return False, None

    def has_pending_work(self) -> bool:
        """Jobs in flight keep the engine stepping, so their reports come back and their pins end."""
        return bool(self.jobs.in_flight())

    # --- events, stats, reset ------------------------------------------------------------------

    def _stored_events(self, keys: list[bytes], tier: Tier, tokens: dict[bytes, Any] | None = None) -> None:
        for key in keys:
            block = list(tokens[key]) if tokens else []
            self._events.append(BlockStored(block_hashes=[key], parent_block_hash=None, token_ids=block,
                                            block_size=self.block_tokens, lora_id=None,
                                            medium=EVENT_MEDIUM[tier.medium], lora_name=None))

    def _removed_events(self, keys: list[bytes], tier: Tier) -> None:
        if keys:
            self._events.append(BlockRemoved(block_hashes=list(keys), medium=EVENT_MEDIUM[tier.medium]))

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def hit_sources(self, request: "Request") -> dict[str, int]:
        """Blocks of the request's planned load per medium ("host", "disk")."""
        state = self._requests.get(request.request_id)
        return dict(state.load_sources) if state is not None else {}

    def take_stats(self) -> KVTierConnectorStats | None:
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, KVTierConnectorStats()
        return stats

    def reset_cache(self) -> bool:
        """Drop every block no job is using; True when every tier is empty afterwards."""
        for tier in self.tiers:
            self._removed_events(tier.evict(tier.capacity), tier)
        return all(t.usage().used == 0 for t in self.tiers)

    def leaks(self) -> dict[str, Any]:
        """Pins, writes, jobs and GPU fences still held (all empty when kvtier is idle)."""
        return {"tiers": {t.name: t.leaks() for t in self.tiers if any(t.leaks().values())},
                "jobs": [j.id for j in self.jobs.in_flight()], "gpu_readers": dict(self._gpu_readers),
                "gpu_loading": dict(self._gpu_loading)}
