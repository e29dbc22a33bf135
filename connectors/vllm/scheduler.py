"""The scheduler side of the connector: the tiers' index, their policies, the job manager and the planner.

It runs in vLLM's engine-core process and never touches KV bytes. The planner (``core/planner.py``)
decides which key goes into which slot of which tier, over whatever tiers the configuration puts
below vLLM's GPU blocks (host; host and disk; ...); this side ships its plans to the workers as the
per-step metadata and finishes each plan once every rank has reported its job. A block's life here is
the tier's (``core/tier.py``): a store reserves slots (WRITING) and commits them when every rank has
reported the copy; a load pins its sources until every rank has reported.

Hooks, in the order vLLM calls them in one step: ``get_num_new_matched_tokens`` (how many leading
blocks past vLLM's own prefix hit some tier holds, leaving the last prompt token to compute; it pins
and touches nothing, so asking twice is harmless), ``update_state_after_alloc`` (plan the load into
the blocks vLLM allocated), ``build_connector_meta`` (stores: eager, every block that is full once
this step has run, or lazy, the cached blocks vLLM's free queue hands out next; demotions; the
fence), then ``apply_reports`` with the workers' reports, and ``take_events``. A vLLM hook cannot
wait: where the planner says room is on its way (victims still being demoted), the lookup answers
"ask again" and blocks that found no room are stored at a later step. GPU blocks are fenced the way
vLLM's own offloading connector does it: a running request's blocks are held by vLLM, and a store
still reading blocks that vLLM hands out again (after a finish or a preemption) is flushed by the
workers before the forward pass. At start, each disk tier takes back the blocks every rank's slab
still holds, from the index its last clean shutdown left or else from every rank's slot headers
(``recovery.py``), putting them back into its index on a thread while this side already serves.

Hybrid models have several KV cache groups (``geometry.served_groups``): each block of each group is a
kvtier block of its own, keyed by the chain key tagged with the group, in a GPU slot naming the group
(``g * num_blocks + block id``). A hit needs every full-attention group's blocks from the start of the
hit and a sliding-window group's blocks only within its window before the hit's end; loads copy only
the blocks vLLM allocated (out-of-window positions are vLLM's null block). Keys are ``block_tokens``
apart; a group whose blocks are larger has a block every ``keys_per_block`` keys, keyed where it ends,
and hits end on every group's block boundary. A model with a Mamba state group gets no hits: the state
at a hit's end is not something kvtier holds.

A last tier addressed by key (a store shared with other engines, ``tiers/remote``, or the machine's
node daemon, ``tiers/node``: its medium opens it here, ``Medium.engine_tier``) is asked with a client
of this side's own, never through the workers, and never while a hook waits: the lookup asks its owner
only for the blocks past the local (host, disk) hit, in one batched query on a thread of its own, and
answers "ask again" until it has answered (at most the tier's timeout; an owner that is down is a
miss). Each rank's shard of a block is a copy of its own, so a block is a hit only when every rank's
copy exists (MLA: one copy for all ranks, as every tier holds one copy for them). Blocks reach it from
the host tier (write-through, by default: a copy job once they are stored there), loads stage through
host slots, and slots that a store call past its deadline may still write stay out of use until the
workers report that call over.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data

from kvtier.connectors.counters import miss_counts
from kvtier.connectors.vllm.geometry import ServedGroup, tier_slots
from kvtier.connectors.vllm.metadata import StepJobs, TransferJob
from kvtier.connectors.vllm.namespace import request_namespace, request_tenant
from kvtier.connectors.vllm.recovery import ChunksBack, RankSlabs
from kvtier.connectors.vllm.stats import KVTierConnectorStats
from kvtier.core.config import StackConfig, tenant_labels
from kvtier.core.errors import ConfigError
from kvtier.core.jobs import Job, JobManager, WorkerReport, mark_kvtier_thread
from kvtier.core.keys import chain_hashes, tenant_of, tenant_tag
from kvtier.core.layout import BlockLayout
from kvtier.core.media import BASIC, Capabilities, EngineTierRequest, medium
from kvtier.core.misses import Misses
from kvtier.core.planner import Lookup, Outcome, Plan, Planner, Room, SlotCount
from kvtier.core.tier import Tier
from kvtier.tiers.disk.config import DiskTierConfig
from kvtier.tiers.keyed import KeyedTier

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

LOAD_MEDIUM = "gpu"
"""What loads copy into: vLLM's KV blocks (routes from disk stage through host memory)."""

RESTORED_PER_EVENT = 65536
"""Keys per BlockStored event for blocks taken back at start (``_restored_events``)."""

RESTORED_PER_STEP = RESTORED_PER_EVENT
"""Blocks taken back at start announced per step at most (``_announce_restored``): about 3 ms of vLLM's
thread each (12 ms at worst; 2-core VM, 15.8 M blocks), for a chunk the restore's thread put back in
80 ms or more (``ChunkedRestore.chunk``)."""


class _StoreQuery(NamedTuple):
    """A batched existence query of the remote store for blocks ``first`` to ``end`` of a request; its
    answers count until ``expires`` (``time.monotonic``)."""

    first: int
    end: int
    expires: float
    future: Future[int]


class BlockRef(NamedTuple):
    """A full block of a request in one KV cache group: its key, the GPU slot holding its KV (the group's
    vLLM block), and its tokens (events name them)."""

    key: bytes
    gpu_block: int
    tokens: tuple[int, ...]


@dataclass
class _RequestState:
    """What the scheduler side knows about one live request."""

    request: Request
    namespace: bytes
    tag: bytes  # its tenant's (``keys.tenant_tag``): its keys begin with it; b"" for no tenant
    keys: list[bytes] = field(default_factory=list)
    block_ids: list[list[int]] = field(default_factory=list)  # per served group: vLLM's blocks (0: none there)
    stored: int = 0  # leading blocks already handed to the store planner
    lookup_start: int = 0  # first block past vLLM's own prefix hit, from the last lookup
    load_sources: dict[str, int] = field(default_factory=dict)  # medium -> blocks of the planned load
    in_step: bool = False  # the last lookup offered a hit to load in the step that computes the rest
    reserved: list[bytes] = field(default_factory=list)  # its blocks, pinned until they are planned or the step ends
    jobs: set[int] = field(default_factory=set)  # store and load jobs in flight
    store_query: _StoreQuery | None = None  # the last question to the remote store about its blocks
    looked_up: bool = False  # a lookup answered (and its miss, if any, counted): vLLM asks again and again


class SchedulerSide:
    """Index, policies, jobs and the planner for every tier below vLLM's GPU blocks."""

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
        host memory (vLLM built for CPU)."""
        self.config = config
        self.groups = list(groups)
        self.full_groups = [p for p, g in enumerate(self.groups) if g.window_blocks is None]
        self.windowed = len(self.full_groups) < len(self.groups)
        self.keys_per_block = [g.keys_per_block for g in self.groups]
        self.uniform = all(m == 1 for m in self.keys_per_block)  # every group's block is one key
        self.hit_keys = math.lcm(*self.keys_per_block)  # a hit ends on a block boundary of every group
        self.gpu_blocks = gpu_blocks
        self.serves_hits = serves_hits
        self.key_secret = key_secret
        self.lazy_ahead = lazy_ahead
        self.block_tokens = block_tokens
        self.num_workers = num_workers
        self.namespace = namespace
        self.copy_ranks = 1 if replicated else num_workers  # ranks holding a copy of their own in the tiers
        # Replicated KV on several ranks: the one copy in the shared host slab must be staged (by rank 0)
        # before any rank reads it, so a staged load ships in two parts at two steps (``apply_reports``).
        self.split_staged_loads = replicated and num_workers > 1
        self._staging: dict[int, TransferJob] = {}  # split loads whose second part waits for the first
        # (not with a shared slab: a block staged into it since the lookup would be read before it arrived)
        self.in_step_host_hits = in_step_host_hits and len(self.groups) == 1 and not self.split_staged_loads
        self._reserving: list[_RequestState] = []  # requests whose lookup pinned blocks in this step
        self.jobs = JobManager()
        position = {config.tier_name(j): j for j in range(len(config.tiers))}
        self.tiers: list[Tier] = []
        for name, kind, slots in tier_slots(config, layout.block_bytes):
            policy, watermark = config.tier_policy(position[name])
            self.tiers.append(Tier(name, kind, SlotCount(layout, slots), policy, watermark, self.jobs.is_fenced))
        self.keyed: KeyedTier | None = None  # the last tier, where it is addressed by key (remote, node)
        self._lookups: ThreadPoolExecutor | None = None
        if config.tiers[-1].keyed:
            self.keyed = self._keyed_tier(config, layout, namespace, [None] if replicated else range(num_workers))
            self.tiers.append(self.keyed)
            self._lookups = ThreadPoolExecutor(1, thread_name_prefix="kvtier-lookup", initializer=mark_kvtier_thread)
        self.planner = Planner(self.tiers, capabilities=capabilities)
        self.misses = Misses([t.name for t in self.tiers], self.planner.ghost, [t.why_absent for t in self.tiers])
        self._index = {tier.name: i for i, tier in enumerate(self.tiers)}
        # Write-through: a store's job also copies on into every tier below, stage after stage.
        self.hops = len(self.tiers) - 1 if config.placement == "write_through" else 0
        self.stats = KVTierConnectorStats()
        named = config.tenant_names()  # counted by tenant where some tier's shares name tenants
        self.tenant_label = tenant_labels(named, key_secret) if named else None
        self._requests: dict[str, _RequestState] = {}
        self._events: list[KVCacheEvent] = []
        self._disk_indexes: list[tuple[RankSlabs, ChunksBack]] = []  # disk tiers whose index shutdown leaves
        self._restoring: list[ChunksBack] = []  # their restores whose blocks are not all announced yet
        for tier in self.tiers:
            tier_cfg = config.tiers[position[tier.name]]
            if isinstance(tier_cfg, DiskTierConfig):
                self._recover(tier, tier_cfg, layout)
        self._step_loads: list[TransferJob] = []
        self._step_copies: list[TransferJob] = []  # demotions and copies to a remote store: no GPU block
        self._step_allocated: set[int] = set()
        self._gpu_readers: dict[int, set[int]] = {}  # GPU block id -> store jobs reading it
        self._gpu_loading: dict[int, int] = {}  # GPU block id -> the load job writing it
        self._gpu_keys: dict[int, BlockRef] = {}  # lazy: GPU block -> the block of a request it holds
        self._block_pool: BlockPool | None = None

    @staticmethod
    def _keyed_tier(
        config: StackConfig, layout: BlockLayout, namespace: bytes, ranks: Sequence[int | None]
    ) -> KeyedTier:
        """The last tier, addressed by key, as its medium opens it on this side: a client of this side's
        own, asking for the copies of ``ranks`` written under the workers' namespace."""
        i = len(config.tiers) - 1
        open_tier = medium(config.tiers[i].medium).engine_tier
        if open_tier is None:
            raise ConfigError(f"tiers[{i}] ({config.tier_name(i)}): its medium serves no engine's scheduler side")
        tier = open_tier(EngineTierRequest(config.tier_name(i), config.tiers[i], layout, namespace.hex(), ranks))
        assert isinstance(tier, KeyedTier)
        return tier

    def _recover(self, tier: Tier, tier_cfg: DiskTierConfig, layout: BlockLayout) -> None:
        """Take back the blocks a previous engine left on every rank's disk slab (``recovery.py``): their
        slots at once, the blocks into the tier's index on a thread while this side already serves
        (each a miss until it is back), their KV events as they come (``_announce_restored``). The
        tier's index is left for the next start at ``shutdown``."""
        slabs = RankSlabs(tier_cfg, self.copy_ranks, tier.capacity, layout, self.namespace.hex())
        restore = ChunksBack(tier, tier_cfg.path)
        source = slabs.recover(restore.start)
        log.info(
            "kvtier disk tier %s: %d blocks kept from before the restart (from the %s), going back into its index",
            tier_cfg.path,
            tier.usage().used,
            source,
        )
        self._disk_indexes.append((slabs, restore))
        self._restoring.append(restore)

    def tier(self, name: str) -> Tier:
        return self.planner.tier(name)

    # --- requests and keys ---------------------------------------------------------------------

    def bind_gpu_block_pool(self, block_pool: BlockPool) -> None:
        """vLLM's GPU block pool: lazy mode walks its free queue for blocks about to be reused."""
        self._block_pool = block_pool

    def on_new_request(self, request: Request) -> None:
        self._state(request)

    def _state(self, request: Request) -> _RequestState | None:
        """The request's state, created on first sight; None for requests kvtier does not cache
        (prompt embeddings or multimodal inputs: token ids alone do not name their KV)."""
        state = self._requests.get(request.request_id)
        if state is None:
            if request.prompt_embeds is not None or request.mm_features:
                return None
            lora = request.lora_request
            lora_name, salt = lora.lora_name if lora else "", request.cache_salt or ""
            state = _RequestState(
                request,
                self.request_namespace(lora_name, salt, lora.lora_path if lora else ""),
                tenant_tag(request_tenant(lora_name, salt), self.key_secret),
            )
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
            new = tokens[len(state.keys) * self.block_tokens : full * self.block_tokens]
            parent = state.keys[-1] if state.keys else None
            state.keys += chain_hashes(
                list(new),
                self.block_tokens,
                state.namespace if parent is None else b"",
                parent=parent,
                secret=self.key_secret,
                tag=state.tag,
            )
        return state.keys

    # --- lookup and load -----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens of the leading blocks after ``num_computed_tokens`` that some tier holds; always leaves
        the last prompt token to compute. Pins and touches nothing (vLLM may ask again and again); the
        one thing it may start is making room for the blocks the load would stage. None (ask again
        next step) while a block of the prefix is being staged by another load, room for staging is
        being demoted, or the remote store has not answered yet for the blocks past the local hit."""
        state = self._state(request)
        if state is None or not self.serves_hits:
            return 0, False
        keys = self._keys(state)
        start = num_computed_tokens // self.block_tokens
        limit = min(len(keys), (request.num_tokens - 1) // self.block_tokens)
        if start % self.hit_keys or start * self.block_tokens != num_computed_tokens:
            return 0, False  # (vLLM hits end on every group's block boundary: not expected)
        end, found = self._hit(keys, start, limit)
        if end is not None and end < limit and self.keyed is not None:
            if not self._store_answered(state, end, limit):
                return None, False
            end, found = self._hit(keys, start, limit)  # now with the store's answers
        if end is None or not self._room_to_stage(found.staging):
            return None, False
        if not state.looked_up:
            state.looked_up = True
            self._count_miss(keys, start, end, limit, partial=request.num_tokens % self.block_tokens != 0)
        state.lookup_start = start
        self._release(state)
        state.in_step = self.in_step_host_hits and end > start and not any(found.sources[: end - start])
        if state.in_step:  # (a block leaving before the load is planned would be recomputed after vLLM read it)
            state.reserved = keys[start:end]
            self.tiers[0].pin(state.reserved, use=False)  # (the load counts as the use, once)
            self._reserving.append(state)
        return (end - start) * self.block_tokens, end > start and not state.in_step

    def _count_miss(self, keys: list[bytes], start: int, end: int, limit: int, partial: bool) -> None:
        """Count a request's lookup in ``misses`` when it ended early: a hit from ``start`` (past vLLM's own
        prefix hit) to ``end`` short of ``limit``, the most vLLM can take (the prompt's full blocks, less
        the one holding its last token when no partial block follows them), or up to it with a
        ``partial`` block after it (vLLM computes that one itself: ``partial_block``). Explained on the
        blocks of the first full-attention group, which every hit needs."""
        group = self.full_groups[0] if self.full_groups else 0
        looked_up = self._group_keys(keys, start, limit, [group])
        hits = len(self._group_keys(keys, start, end, [group]))
        self.misses.count(self.misses.explain(looked_up, hits, partial))

    def _release(self, state: _RequestState) -> None:
        """Unpin the blocks the request's last lookup reserved for an in-step load."""
        if state.reserved:
            self.tiers[0].unpin(state.reserved)
            state.reserved = []

    def _hit(self, keys: list[bytes], start: int, limit: int) -> tuple[int | None, Lookup]:
        """The end of the longest hit from key ``start`` (at most ``limit``), and the planner's lookup
        of the blocks a load to there needs; None while one of them is being staged. Full-attention
        groups need every block from ``start``, a sliding-window group those within its window."""
        if self.full_groups:
            found = self.planner.lookup(self._group_keys(keys, start, limit, self.full_groups), LOAD_MEDIUM)
            if found.hits is None:
                return None, found
            if self.uniform:
                end = start + found.hits // len(self.full_groups)
            else:  # up to the start of the first block missing
                ends = self._ends(start, limit, self.full_groups)
                end = limit
                if found.hits < len(ends):
                    i, p = ends[found.hits]
                    end = i + 1 - self.keys_per_block[p]
        else:
            end = limit
        end -= end % self.hit_keys  # on every group's block boundary
        if not self.windowed and self.uniform:
            return end, found
        end = self._window_end(keys, start, end)
        found = self.planner.lookup(self._needed(keys, start, end), LOAD_MEDIUM)
        return (end if found.hits is not None else None), found

    def _window_end(self, keys: list[bytes], start: int, end: int) -> int:
        """The largest hit end at most ``end`` for which every sliding-window group holds the blocks of
        its window before it. The first block of a window missing at ``b`` lies in the window of every
        end past it up to ``end``, so the next candidate is where ``b`` starts (on every group's block
        boundary); repeated until every group agrees."""
        settled = False
        while not settled and end > start:
            settled = True
            for p, group in enumerate(self.groups):
                if group.window_blocks is not None:
                    m = self.keys_per_block[p]
                    first = max(start // m, end // m - group.window_blocks)
                    window = [self._group_key(keys[(b + 1) * m - 1], p) for b in range(first, end // m)]
                    held = self.planner.lookup(window).hits or 0
                    if held < len(window):
                        end, settled = (first + held) * m, False
                        end -= end % self.hit_keys
        return end

    def _needed(self, keys: list[bytes], start: int, end: int) -> list[bytes]:
        """The blocks a hit from ``start`` to ``end`` loads, in key order, group by group."""
        if self.uniform:  # (every lookup of a windowed model: block i of each group ends at key i)
            return [
                self._group_key(keys[i], p)
                for i in range(start, end)
                for p, group in enumerate(self.groups)
                if group.window_blocks is None or i >= end - group.window_blocks
            ]
        return [
            self._group_key(keys[i], p)
            for i, p in self._ends(start, end, range(len(self.groups)))
            if self._table_index(i, p) >= self._window_start(p, end)
        ]

    def _window_start(self, group: int, end: int) -> int:
        """The first of served group ``group``'s blocks a hit ending at key ``end`` needs (0: all of them)."""
        window = self.groups[group].window_blocks
        return 0 if window is None else end // self.keys_per_block[group] - window

    def _group_keys(self, keys: list[bytes], start: int, end: int, groups: Iterable[int]) -> list[bytes]:
        """The blocks of these served groups that end within keys ``start`` to ``end``, in key order."""
        groups = list(groups)
        if groups == [0] and len(self.groups) == 1:
            return keys[start:end]
        return [self._group_key(keys[i], p) for i, p in self._ends(start, end, groups)]

    def _ends(self, start: int, end: int, groups: Iterable[int]) -> list[tuple[int, int]]:
        """(key index, served group) of each block of these groups that ends within keys ``start`` to
        ``end``, in key order (every key ends a block of a group whose blocks are one key)."""
        groups = list(groups)
        if self.uniform:
            return [(i, p) for i in range(start, end) for p in groups]
        return [(i, p) for i in range(start, end) for p in groups if (i + 1) % self.keys_per_block[p] == 0]

    def _table_index(self, i: int, group: int) -> int:
        """Which of served group ``group``'s blocks ends at key ``i`` (its index in the block table)."""
        return (i + 1) // self.keys_per_block[group] - 1

    def _group_key(self, key: bytes, group: int) -> bytes:
        """The key of a block of served group ``group``: the chain key, tagged when there are several groups."""
        return key if len(self.groups) == 1 else key + group.to_bytes(2, "big")

    def _gpu_slot(self, group: int, block_id: int) -> int:
        """The GPU slot of vLLM's block ``block_id`` of served group ``group`` (``geometry.kv_cache_storage``)."""
        return group * self.gpu_blocks + block_id

    def _block_id(self, gpu_slot: int) -> int:
        """vLLM's block id of a GPU slot: what vLLM allocates and frees, whatever the group."""
        return gpu_slot % self.gpu_blocks if self.gpu_blocks else gpu_slot

    def _store_answered(self, state: _RequestState, first: int, end: int) -> bool:
        """Whether the remote store answered recently which of the request's blocks ``first`` to ``end``
        it holds (its answers are then the remote tier's READY keys); else asks it, one batched query
        on the lookup thread, and says False until the answer is in."""
        assert self.keyed is not None and self._lookups is not None
        query = state.store_query
        if query is None or query.first > first or query.end < end or query.expires <= time.monotonic():
            keys = self._group_keys(state.keys, first, end, range(len(self.groups)))
            future = self._lookups.submit(self.keyed.query, keys)
            future.add_done_callback(_log_failure)
            query = state.store_query = _StoreQuery(first, end, time.monotonic() + self.keyed.known_for, future)
        return query.future.done()

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
        self._step_allocated.update(b for ids in block_ids for b in ids if b)
        state = self._state(request)
        if state is None:  # a request kvtier does not cache counted no hits
            return
        try:
            if num_external_tokens:
                self._plan_load(request, state, block_ids, num_external_tokens)
        finally:
            self._release(state)

    def _plan_load(
        self, request: Request, state: _RequestState, block_ids: tuple[list[int], ...], num_external_tokens: int
    ) -> None:
        """The load of a request's hit into the GPU blocks vLLM allocated (``update_state_after_alloc``)."""
        start = state.lookup_start
        tables = [block_ids[g.vllm_index] for g in self.groups]
        end = start + num_external_tokens // self.block_tokens
        keys, gpu_slots, positions = self._load_blocks(state, tables, start, end)
        count = len(keys)
        planned = self.planner.load(keys, gpu_slots, LOAD_MEDIUM)
        self._ship(planned.room)
        plan = planned.plan
        loading = gpu_slots[: plan.num_blocks]
        sources = planned.sources  # each block counted once, where its first group's copy comes from
        if len(self.groups) > 1:
            sources = tuple(src for k, src in enumerate(sources) if k == 0 or positions[k] != positions[k - 1])
        state.load_sources = self._per_medium({self.tiers[i].name: n for i, n in Counter(sources).items()})

        def done(job: Job) -> None:
            outcome = self._finish(plan, job)
            failed = len(outcome.lost) + count - plan.num_blocks  # lost on the way, or never planned
            self.stats.record_load(self._per_medium(outcome.served), failed)
            if self.tenant_label is not None:
                self.stats.record_tenant(
                    "tenant_hit_blocks", self.tenant_label(state.tag), sum(outcome.served.values())
                )
            self._job_ended(job.id, request.request_id, loading, reads=False)

        # (a block staged through host memory since the lookup still loads in this step, only slower)
        split = self.split_staged_loads and len(plan.stages) > 1
        job = self._start(plan, done, parts=2 if split else 1)
        state.jobs.add(job.id)
        for slot in loading:
            self._gpu_loading[self._block_id(slot)] = job.id
        transfer = TransferJob.of(job.id, plan, request.request_id, loading, gpu_slots[len(loading) :], state.in_step)
        if split:
            self._staging[job.id] = transfer
            transfer = transfer.staging_part()
        self._step_loads.append(transfer)

    def _load_blocks(
        self, state: _RequestState, tables: list[list[int]], start: int, end: int
    ) -> tuple[list[bytes], tuple[int, ...], list[int]]:
        """The keys, GPU slots and positions of the blocks a load from ``start`` to ``end`` writes: those
        vLLM allocated in each served group's ``tables`` (a sliding-window group's out-of-window
        positions are its null block, 0, and load nothing)."""
        keys = self._keys(state)
        if len(tables) == 1:  # one group: every position, vLLM's block ids as they are
            return keys[start:end], tuple(tables[0][start:end]), list(range(start, end))
        rows = [
            (self._group_key(keys[i], p), self._gpu_slot(p, tables[p][b]), i)
            for i, p in self._ends(start, end, range(len(tables)))
            if tables[p][b := self._table_index(i, p)]
        ]
        return [r[0] for r in rows], tuple(r[1] for r in rows), [r[2] for r in rows]

    # --- stores --------------------------------------------------------------------------------

    def _unstored_full(self, state: _RequestState, num_tokens: int) -> range:
        """Indices of the request's blocks full with ``num_tokens`` tokens that no store has taken
        yet (``state.stored`` counts those taken, from the first block on)."""
        tables = (
            min(len(ids) * m for ids, m in zip(state.block_ids, self.keys_per_block, strict=True))
            if state.block_ids
            else 0
        )
        full = min(num_tokens // self.block_tokens, tables, len(self._keys(state)))
        return range(state.stored, full)

    def _block(self, state: _RequestState, i: int, group: int) -> BlockRef:
        """The request's block of served group ``group`` that ends at key ``i`` (its tokens sliced only
        for blocks about to be stored)."""
        first = i + 1 - self.keys_per_block[group]
        tokens = state.request.all_token_ids[first * self.block_tokens : (i + 1) * self.block_tokens]
        gpu_slot = self._gpu_slot(group, self._block_id_at(state, i, group))
        return BlockRef(self._group_key(state.keys[i], group), gpu_slot, tuple(tokens))

    def _block_id_at(self, state: _RequestState, i: int, group: int) -> int:
        """vLLM's block id of the request's block of ``group`` that ends at key ``i``."""
        return state.block_ids[group][self._table_index(i, group)]

    def _held_in(self, state: _RequestState, i: int) -> list[int]:
        """The served groups with a block ending at key ``i`` that vLLM holds (a window's old ones it does not)."""
        return [
            p
            for p, ids in enumerate(state.block_ids)
            if (i + 1) % self.keys_per_block[p] == 0 and ids[self._table_index(i, p)]
        ]

    def _store_full(self, state: _RequestState, num_tokens: int) -> TransferJob | None:
        """Store the request's full blocks no tier holds yet. Those that find no room now (the first
        tier's victims are still being demoted) are tried again at the request's next step, in chain
        order."""
        full = self._unstored_full(state, num_tokens)
        if len(self.groups) == 1:  # (the common case, every step: no per-group work)
            ids = state.block_ids[0]
            todo = [(i, 0) for i in full if self._storable(state.keys[i], ids[i])]
        else:
            todo = [
                (i, p)
                for i in full
                for p in self._held_in(state, i)
                if self._storable(self._group_key(state.keys[i], p), self._block_id_at(state, i, p))
            ]
        job, declined = self._store([self._block(state, i, p) for i, p in todo], state)
        taken = job.num_blocks if job is not None else 0
        # Blocks the first tier's policy declined are not offered again by this request (a second ask
        # would count as a second sight); the others that found no room are, at its next step.
        state.stored = todo[taken][0] if taken < len(todo) - declined else full.stop
        return job

    def _storable(self, key: bytes, block_id: int) -> bool:
        """Neither being loaded (so a tier has it) nor held or being written by any tier already."""
        return block_id not in self._gpu_loading and self.planner.is_new(key)

    def _lazy_candidates(self) -> list[BlockRef]:
        """Cached GPU blocks among the next ``lazy_ahead`` vLLM will reuse, whose KV no tier holds yet;
        one per key (requests with the same prompt computed in one step hold the same KV twice)."""
        if self._block_pool is None:
            raise RuntimeError("lazy stores walk vLLM's GPU block pool, which vLLM has not bound (bind_gpu_block_pool)")
        picked: dict[bytes, BlockRef] = {}
        for block in itertools.islice(self._block_pool.free_block_queue.iter_blocks_after(None), self.lazy_ahead):
            ref = self._gpu_keys.get(block.block_id)
            if (
                block.block_hash is not None
                and ref is not None
                and ref.key not in picked
                and self._storable(ref.key, block.block_id)
            ):
                picked[ref.key] = ref
        return list(picked.values())

    def _store(self, picked: list[BlockRef], state: _RequestState | None) -> tuple[TransferJob | None, int]:
        """A store of these blocks into the first tier (and on down, write-through); fewer when room
        runs out or the tier's policy declines the last ones, None when none is stored. Also returns
        how many trailing blocks were declined (``Planned.declined``)."""
        if not picked:
            return None, 0
        planned = self.planner.store([b.key for b in picked], [b.gpu_block for b in picked], self.hops)
        self._ship(planned.room)
        plan = planned.plan
        if not plan.num_blocks:
            return None, planned.declined
        picked = picked[: plan.num_blocks]
        gpu_blocks = [b.gpu_block for b in picked]
        req_id = state.request.request_id if state is not None else None
        tokens = {b.key: b.tokens for b in picked}

        def done(job: Job) -> None:
            outcome = self._finish(plan, job, tokens)
            stored = outcome.stored.get(self.tiers[0].name, [])
            self.stats.record_store(len(stored))
            if self.tenant_label is not None:
                for label, n in Counter(self.tenant_label(tenant_of(key)) for key in stored).items():
                    self.stats.record_tenant("tenant_stored_blocks", label, n)
            self._job_ended(job.id, req_id, gpu_blocks, reads=True)

        job = self._start(plan, done)
        if state is not None:
            state.jobs.add(job.id)
        for slot in gpu_blocks:
            self._gpu_readers.setdefault(self._block_id(slot), set()).add(job.id)
        return TransferJob.of(job.id, plan, req_id), planned.declined

    # --- plans and jobs ------------------------------------------------------------------------

    def _start(self, plan: Plan, done, parts: int = 1) -> Job:
        """The job every rank runs for ``plan``, in ``parts`` shipped one after the other: it holds the
        plan's fences until all ranks have reported every part."""
        job = self.jobs.create(plan.kind, plan.num_blocks, self.num_workers * parts, plan.fences, done)
        self.jobs.start(job.id)
        return job

    def _ship(self, room: Room) -> None:
        """What making room did, sent out: eviction events for the keys dropped, and the demotions
        as this step's jobs (run after the forward pass, with the stores)."""
        for name, keys in room.dropped.items():
            self._removed_events(keys, self.tier(name))
        for plan in room.demotions:
            self._ship_copy(plan)

    def _ship_copy(self, plan: Plan) -> None:
        """A copy between tiers (a demotion, a copy to the remote store) as a job of the next step's."""
        job = self._start(plan, lambda job: self._finish(plan, job))
        self._step_copies.append(TransferJob.of(job.id, plan))

    def _finish(self, plan: Plan, job: Job, tokens: dict[bytes, tuple[int, ...]] | None = None) -> Outcome:
        """Let the planner finish a plan whose job every rank reported; events for what changed. Blocks
        now in host memory are copied on to a remote store placed write-through; host slots a store
        call may still write stay out of use until the workers report that call over."""
        outcome = self.planner.finish(plan, job)
        if outcome.holds:
            self.jobs.when_lifted(job, lambda job: self.planner.lift(outcome))
        for name, keys in outcome.stored.items():
            self._stored_events(keys, self.tier(name), tokens)
            index = self._index[name]
            for target in self.planner.copy_targets(index, write_through=False):  # write-through hops: in the plan
                copied = self.planner.copy_down(index, keys, target)
                self._ship(copied.room)
                if copied.plan.num_blocks:
                    self._ship_copy(copied.plan)
        for name, keys in outcome.dropped.items():
            self._removed_events(keys, self.tier(name))
        return outcome

    def _per_medium(self, per_tier: dict[str, int]) -> dict[str, int]:
        """Counts per tier as counts per medium ("host", "disk", "remote"): what vLLM's hit sources and our
        stats name."""
        out: dict[str, int] = {}
        for name, n in per_tier.items():
            medium = self.tier(name).medium
            out[medium] = out.get(medium, 0) + n
        return out

    def _job_ended(self, job_id: int, req_id: str | None, gpu_slots: Iterable[int], reads: bool) -> None:
        for block in map(self._block_id, gpu_slots):
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

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StepJobs:
        """This step's loads, stores, demotions and fence; resets the step's state (blocks a lookup
        reserved for a request vLLM did not allocate are let go)."""
        for reserved in self._reserving:
            self._release(reserved)
        self._reserving.clear()
        allocated = self._step_allocated
        live = getattr(scheduler_output, "kv_connector_block_state", None)  # each request's whole table now
        for req_id, block_id_groups, is_full_table in yield_req_data(scheduler_output):
            new = block_id_groups or ()
            allocated.update(b for ids in new for b in ids if b)
            state = self._requests.get(req_id)
            if state is None:
                continue
            # a window's group: the request's whole table now, where blocks the window let go of are 0
            table = live.get_block_ids(req_id) if live is not None and self.windowed else None
            if table is not None:
                state.block_ids = [list(table[g.vllm_index]) for g in self.groups]
            elif is_full_table or not state.block_ids:  # (vLLM 0.32 marks a new request's table not full)
                state.block_ids = [list(new[g.vllm_index]) if new else [] for g in self.groups]
            elif new:
                state.block_ids = [
                    ids + list(new[g.vllm_index]) for ids, g in zip(state.block_ids, self.groups, strict=True)
                ]
            if is_full_table:
                state.stored = 0
        flush = {job for block in allocated for job in self._gpu_readers.get(block, ())}
        for req_id in scheduler_output.preempted_req_ids or ():
            state = self._requests.get(req_id)
            if state is not None:
                flush |= {j for j in state.jobs if j not in {t.job_id for t in self._step_loads}}
        planned = []
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(req_id)
            if state is None:
                continue
            num_tokens = state.request.num_computed_tokens + scheduled
            if not self.serves_hits:
                continue
            if self.lazy_ahead is None:
                planned.append(self._store_full(state, num_tokens))
            else:
                full = self._unstored_full(state, num_tokens)
                for i in full:
                    for p in self._held_in(state, i):
                        self._gpu_keys[self._block_id_at(state, i, p)] = self._block(state, i, p)
                state.stored = full.stop
        if self.lazy_ahead is not None and self.serves_hits:
            candidates = self._lazy_candidates()
            job, declined = self._store(candidates, None)
            for ref in candidates[len(candidates) - declined :]:  # declined: not offered again (see _store_full)
                self._gpu_keys.pop(self._block_id(ref.gpu_block), None)
            planned.append(job)
        stores = [job for job in planned if job is not None]
        for index, tier in enumerate(self.tiers):  # above a high mark: demote or evict down to the low mark
            if tier.watermark is not None:
                self._ship(self.planner.relieve(index))
        meta = StepJobs(
            self._step_loads, stores + self._step_copies, flush, idle=not scheduler_output.total_num_scheduled_tokens
        )
        self._step_loads, self._step_copies, self._step_allocated = [], [], set()
        return meta

    def apply_reports(self, report: WorkerReport) -> None:
        """The workers' job completions of one step (every rank's, merged): plans whose jobs every
        rank has now reported are finished (their callbacks commit, release and count). A split load
        whose first part every rank has reported ships its second part with the next step's loads."""
        self.jobs.apply(report)
        for job_id in report.finished.keys() & self._staging.keys():
            job = self.jobs.get(job_id)
            if job.reports == self.num_workers:
                self._step_loads.append(self._staging.pop(job_id).loading_part(job.failed_blocks))

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Blocks go back to vLLM at once: stores still reading them are flushed when they are reused."""
        self._requests.pop(request.request_id, None)
        return False, None

    def has_pending_work(self) -> bool:
        """Jobs in flight, and jobs whose quarantined slots await the workers' lift, keep the engine
        stepping, so their reports come back and their pins end."""
        return bool(self.jobs.in_flight() or self.jobs.held())

    def shutdown(self) -> None:
        """Stop asking the remote store (a query in flight ends by its deadline, unread), and leave each
        disk tier's index for the next start (``RankSlabs.save``; vLLM has stopped the workers by now):
        its READY blocks, then those its restore had not put back yet (stopped here), so a quick
        restart loses none. Once: a second call leaves nothing, as this side's index may be out of
        date by then (a new engine may have started on the same directories)."""
        if self._lookups is not None:
            self._lookups.shutdown(wait=False, cancel_futures=True)
        if self.keyed is not None:
            self.keyed.disconnect()
        indexes, self._disk_indexes = self._disk_indexes, []
        for slabs, restore in indexes:
            slabs.save(*restore.held_blocks())

    # --- events, stats, reset ------------------------------------------------------------------

    def _stored_events(self, keys: list[bytes], tier: Tier, tokens: dict[bytes, Any] | None = None) -> None:
        """BlockStored per key, for a tier whose medium names a KV-event medium; none for a remote store:
        what it holds changes without this engine (other engines add, the store evicts), so this engine's
        events could only mislead about it."""
        label = medium(tier.medium).event_medium
        if label is None:
            return
        for key in keys:
            block = list(tokens[key]) if tokens else []
            self._events.append(
                BlockStored(
                    block_hashes=[key],
                    parent_block_hash=None,
                    token_ids=block,
                    block_size=self._block_tokens_of(key),
                    lora_id=None,
                    medium=label,
                    lora_name=None,
                )
            )

    def _announce_restored(self) -> None:
        """BlockStored events for the blocks the disk tiers' restores have put back since the last call, at
        most ``RESTORED_PER_STEP`` of them (the rest at the next calls). Runs on vLLM's thread, which
        alone stores and drops blocks: a block announced is one that went into the tier (a key stored
        meanwhile keeps the stored block, whose store announced it) and that the tier has not dropped
        since (``ChunksBack.announce``), so every restored block still in the tier is announced once."""
        budget = RESTORED_PER_STEP
        for restore in list(self._restoring):
            while budget > 0:
                try:
                    first, went_in = restore.back.get_nowait()
                except queue.Empty:
                    if restore.done.is_set() and restore.back.empty():  # (no chunk came since get_nowait)
                        self._restoring.remove(restore)  # (and its keys let go)
                        restore.keys, restore.left = [], {}
                    break
                self._restored_events(restore.announce(first, went_in), restore.tier)
                budget -= len(went_in)

    def _restored_events(self, keys: Sequence[bytes], tier: Tier) -> None:
        """BlockStored for blocks taken back at start, whose tokens are unknown: many keys per event
        (one event per key costs 3 us, 47 s for the 15.8 M blocks of a 1 TiB disk tier of 64 KiB
        blocks), one block size per event."""
        label = medium(tier.medium).event_medium
        if label is None or not keys:
            return
        by_size: Mapping[int, Sequence[bytes]] = {self.block_tokens: keys}
        if not self.uniform:
            grouped: dict[int, list[bytes]] = {}
            for key in keys:
                grouped.setdefault(self._block_tokens_of(key), []).append(key)
            by_size = grouped
        for size, same in by_size.items():
            for start in range(0, len(same), RESTORED_PER_EVENT):
                self._events.append(
                    BlockStored(
                        block_hashes=list(same[start : start + RESTORED_PER_EVENT]),
                        parent_block_hash=None,
                        token_ids=[],
                        block_size=size,
                        lora_id=None,
                        medium=label,
                        lora_name=None,
                    )
                )

    def _block_tokens_of(self, key: bytes) -> int:
        """Tokens in the block a key names: its group's block size (the key's tag names the group)."""
        if self.uniform:
            return self.block_tokens
        return self.block_tokens * self.keys_per_block[int.from_bytes(key[-2:], "big")]

    def _removed_events(self, keys: list[bytes], tier: Tier) -> None:
        for restore in self._restoring:  # (a block dropped after it went back is not announced as back)
            if restore.tier is tier:
                restore.dropped(keys)
        label = medium(tier.medium).event_medium
        if keys and label is not None:
            self._events.append(BlockRemoved(block_hashes=list(keys), medium=label))

    def take_events(self) -> list[KVCacheEvent]:
        if self._restoring:
            self._announce_restored()
        events, self._events = self._events, []
        return events

    def hit_sources(self, request: Request) -> dict[str, int]:
        """Blocks of the request's planned load per medium ("host", "disk", "remote"), each block (of
        every group) counted where its first group's copy comes from."""
        state = self._requests.get(request.request_id)
        return dict(state.load_sources) if state is not None else {}

    def take_stats(self) -> KVTierConnectorStats | None:
        """The step's counts: loads, stores, and the requests whose lookup ended early (``_count_miss``)."""
        self.stats.record_misses(miss_counts(self.misses.take(), lambda name: self.tier(name).medium))
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, KVTierConnectorStats()
        return stats

    def reset_cache(self) -> bool:
        """Drop every block no job is using; True when every tier is empty afterwards. A remote store is
        left as it is: it is shared, and its records are not this engine's to drop."""
        local = [t for t in self.tiers if not t.by_key]
        for tier in local:
            self._removed_events(tier.evict(tier.capacity), tier)
        return all(t.usage().used == 0 for t in local)

    def leaks(self) -> dict[str, Any]:
        """Pins, writes, jobs and GPU fences still held (all empty when kvtier is idle)."""
        return {
            "tiers": {t.name: t.leaks() for t in self.tiers if any(t.leaks().values())},
            "jobs": [j.id for j in self.jobs.in_flight()],
            "gpu_readers": dict(self._gpu_readers),
            "gpu_loading": dict(self._gpu_loading),
        }


def _log_failure(query: Future[int]) -> None:
    """A store query that raised (not a store failure, which is a miss: a bug) is logged, never lost."""
    if not query.cancelled() and query.exception() is not None:
        log.error("kvtier remote lookup failed", exc_info=query.exception())
