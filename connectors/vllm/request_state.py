"""What the scheduler side tracks per live request: its keys, its block tables, its last lookup's hit,
the blocks that lookup pinned, its jobs in flight, and its last question to a keyed store.

A part of its own because every hook reads or writes it, under rules that hold for all of them: a
request's state is made on first sight, never for a request whose token ids do not name its KV (prompt
embeddings, multimodal inputs); its keys are hashed once, block by block, as its tokens grow (under
its namespace and its tenant's tag); its block tables follow what vLLM allocates, replaces (a
preempted request resumed) or, for a sliding window, lets go of; and blocks a lookup pinned for an
in-step load are let go by the end of the step, whatever becomes of the request.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from kvtier.connectors.vllm.geometry import GroupKeys
from kvtier.connectors.vllm.namespace import request_namespace, request_tenant
from kvtier.core.keys import chain_hashes, tenant_tag
from kvtier.core.tier import Tier

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import KVConnectorBlockState
    from vllm.v1.request import Request


class StoreQuery(NamedTuple):
    """A batched existence query of the keyed store for blocks ``first`` to ``end`` of a request; its
    answers count until ``expires`` (``time.monotonic``)."""

    first: int
    end: int
    expires: float
    future: Future[int]


class BlockRef(NamedTuple):
    """A full block of a request in one KV cache group: its key, the GPU slot holding its KV (the group's
    vLLM block), its tokens and the key of the group's block before it (None for the first): events name
    both, so that a router hashing tokens itself can chain each block to its parent."""

    key: bytes
    gpu_block: int
    tokens: tuple[int, ...]
    parent: bytes | None


@dataclass
class RequestState:
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
    store_query: StoreQuery | None = None  # the last question to the keyed store about its blocks
    looked_up: bool = False  # a lookup answered (and its miss, if any, counted): vLLM asks again and again


class Requests:
    """The live requests' states by request id. ``first_tier`` is where an in-step load's blocks are
    pinned from its lookup until the load is planned."""

    def __init__(self, geometry: GroupKeys, namespace: bytes, key_secret: bytes | None, first_tier: Tier) -> None:
        self.geometry = geometry
        self.namespace = namespace
        self.key_secret = key_secret
        self._first_tier = first_tier
        self._states: dict[str, RequestState] = {}
        self._reserving: list[RequestState] = []  # requests whose lookup pinned blocks in this step

    def state(self, request: Request) -> RequestState | None:
        """The request's state, created on first sight; None for requests kvtier does not cache
        (prompt embeddings or multimodal inputs: token ids alone do not name their KV)."""
        state = self._states.get(request.request_id)
        if state is None:
            if request.prompt_embeds is not None or request.mm_features:
                return None
            lora = request.lora_request
            lora_name, salt = lora.lora_name if lora else "", request.cache_salt or ""
            state = RequestState(
                request,
                self.request_namespace(lora_name, salt, lora.lora_path if lora else ""),
                tenant_tag(request_tenant(lora_name, salt), self.key_secret),
            )
            self._states[request.request_id] = state
        return state

    def get(self, req_id: str) -> RequestState | None:
        """The state of a request already seen (None: never seen, finished, or not cached)."""
        return self._states.get(req_id)

    def finished(self, req_id: str) -> None:
        self._states.pop(req_id, None)

    def request_namespace(self, lora: str = "", salt: str = "", lora_path: str = "") -> bytes:
        """The key namespace of a request: the engine's, its LoRA adapter and its cache salt (blocks
        of another adapter hold other KV; a salt keeps tenants' blocks apart), encoded unambiguously."""
        return request_namespace(self.namespace, lora, lora_path, salt)

    def keys(self, state: RequestState) -> list[bytes]:
        """Keys of every full block of the request's tokens so far, hashing only blocks not yet hashed."""
        block_tokens = self.geometry.block_tokens
        tokens = state.request.all_token_ids
        full = len(tokens) // block_tokens
        if full > len(state.keys):
            new = tokens[len(state.keys) * block_tokens : full * block_tokens]
            parent = state.keys[-1] if state.keys else None
            state.keys += chain_hashes(
                list(new),
                block_tokens,
                state.namespace if parent is None else b"",
                parent=parent,
                secret=self.key_secret,
                tag=state.tag,
            )
        return state.keys

    # --- block tables and jobs -----------------------------------------------------------------

    def new_blocks(
        self, req_id: str, new: tuple[list[int], ...] | None, is_full_table: bool, live: KVConnectorBlockState | None
    ) -> None:
        """vLLM's blocks for a request in this step (``yield_req_data``): ``new`` ones to append, or its
        whole table (``is_full_table``: a preempted request resumed, whose blocks are all stored
        again). ``live``: vLLM's ``kv_connector_block_state``, each request's whole table now, which
        a sliding window's group takes (the blocks its window let go of are 0)."""
        state = self._states.get(req_id)
        if state is None:
            return
        groups = self.geometry.groups
        table = live.get_block_ids(req_id) if live is not None and self.geometry.windowed else None
        if table is not None:
            state.block_ids = [list(table[g.vllm_index]) for g in groups]
        elif is_full_table or not state.block_ids:  # (vLLM 0.32 marks a new request's table not full)
            state.block_ids = [list(new[g.vllm_index]) if new else [] for g in groups]
        elif new:
            state.block_ids = [ids + list(new[g.vllm_index]) for ids, g in zip(state.block_ids, groups, strict=True)]
        if is_full_table:
            state.stored = 0

    def jobs_of(self, req_ids: Iterable[str]) -> set[int]:
        """The jobs in flight of these requests (those kvtier does not track have none)."""
        jobs: set[int] = set()
        for req_id in req_ids:
            state = self._states.get(req_id)
            if state is not None:
                jobs |= state.jobs
        return jobs

    def job_ended(self, req_id: str | None, job_id: int) -> None:
        state = self._states.get(req_id) if req_id is not None else None
        if state is not None:
            state.jobs.discard(job_id)

    def hit_sources(self, req_id: str) -> dict[str, int]:
        """Blocks of the request's planned load per medium (``RequestState.load_sources``)."""
        state = self._states.get(req_id)
        return dict(state.load_sources) if state is not None else {}

    # --- blocks an in-step load keeps --------------------------------------------------------------

    def reserve(self, state: RequestState, keys: list[bytes]) -> None:
        """Pin the blocks of an in-step load from its lookup until the load is planned or the step ends
        (a block leaving before would be recomputed after vLLM read it)."""
        state.reserved = keys
        self._first_tier.pin(keys, use=False)  # (the load counts as the use, once)
        self._reserving.append(state)

    def release(self, state: RequestState) -> None:
        """Unpin the blocks the request's last lookup reserved for an in-step load."""
        if state.reserved:
            self._first_tier.unpin(state.reserved)
            state.reserved = []

    def release_step(self) -> None:
        """The step is over: let go of the blocks lookups reserved for requests vLLM did not allocate."""
        for state in self._reserving:
            self.release(state)
        self._reserving.clear()

    # --- a request's blocks --------------------------------------------------------------------

    def unstored_full(self, state: RequestState, num_tokens: int) -> range:
        """Indices of the request's blocks full with ``num_tokens`` tokens that no store has taken
        yet (``state.stored`` counts those taken, from the first block on)."""
        tables = (
            min(len(ids) * m for ids, m in zip(state.block_ids, self.geometry.keys_per_block, strict=True))
            if state.block_ids
            else 0
        )
        full = min(num_tokens // self.geometry.block_tokens, tables, len(self.keys(state)))
        return range(state.stored, full)

    def block(self, state: RequestState, i: int, group: int) -> BlockRef:
        """The request's block of served group ``group`` that ends at key ``i`` (its tokens sliced only
        for blocks about to be stored)."""
        block_tokens = self.geometry.block_tokens
        first = i + 1 - self.geometry.keys_per_block[group]
        tokens = state.request.all_token_ids[first * block_tokens : (i + 1) * block_tokens]
        gpu_slot = self.geometry.gpu_slot(group, self.block_id_at(state, i, group))
        parent = self.geometry.group_key(state.keys[first - 1], group) if first > 0 else None
        return BlockRef(self.geometry.group_key(state.keys[i], group), gpu_slot, tuple(tokens), parent)

    def block_id_at(self, state: RequestState, i: int, group: int) -> int:
        """vLLM's block id of the request's block of ``group`` that ends at key ``i``."""
        return state.block_ids[group][self.geometry.table_index(i, group)]

    def held_in(self, state: RequestState, i: int) -> list[int]:
        """The served groups with a block ending at key ``i`` that vLLM holds (a window's old ones it does not)."""
        return [
            p
            for p, ids in enumerate(state.block_ids)
            if (i + 1) % self.geometry.keys_per_block[p] == 0 and ids[self.geometry.table_index(i, p)]
        ]

    def load_blocks(
        self, state: RequestState, tables: Sequence[list[int]], start: int, end: int
    ) -> tuple[list[bytes], tuple[int, ...], list[int]]:
        """The keys, GPU slots and positions of the blocks a load from ``start`` to ``end`` writes: those
        vLLM allocated in each served group's ``tables`` (a sliding-window group's out-of-window
        positions are its null block, 0, and load nothing)."""
        keys = self.keys(state)
        if len(tables) == 1:  # one group: every position, vLLM's block ids as they are
            return keys[start:end], tuple(tables[0][start:end]), list(range(start, end))
        geometry = self.geometry
        rows = [
            (geometry.group_key(keys[i], p), geometry.gpu_slot(p, tables[p][b]), i)
            for i, p in geometry.ends(start, end, range(len(tables)))
            if tables[p][b := geometry.table_index(i, p)]
        ]
        return [r[0] for r in rows], tuple(r[1] for r in rows), [r[2] for r in rows]
