"""Which of vLLM's blocks the scheduler side stores at the end of each step, and when a block that was
not stored is offered again.

A part of its own because the two modes pick from different places. Eager stores every block that is
full once the step has run, from each scheduled request's block table, in chain order; blocks that
found no room (the first tier's victims still being demoted) are offered again at the request's next
step. Lazy stores only the cached blocks among the next ``lazy_ahead`` that vLLM's free queue will hand
out again (no copy for blocks vLLM's own prefix cache keeps serving), so it remembers which request's
block each full GPU block holds. Either way a block is stored only where no tier holds or writes it
and no load writes its GPU block, and blocks the first tier's policy declined are not offered again
(a second ask would count as a second sight). Planning the store itself is the coordinator's
(``SchedulerSide._store``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvtier.connectors.vllm.request_state import BlockRef, Requests, RequestState
from kvtier.connectors.vllm.step import StepMetadata
from kvtier.core.planner import Planner

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.sched.output import SchedulerOutput

Store = Callable[[list[BlockRef], RequestState | None], tuple[int, int]]
"""Stores these blocks (of this request, if one); returns how many leading ones it takes and how many
trailing ones the first tier's policy declined."""


class StorePicker:
    """The blocks each step stores: eager (``lazy_ahead`` None) or lazy, each pick handed to ``store``."""

    def __init__(
        self, requests: Requests, planner: Planner, step: StepMetadata, lazy_ahead: int | None, store: Store
    ) -> None:
        self.requests = requests
        self.planner = planner
        self.step = step
        self.lazy_ahead = lazy_ahead
        self._store = store
        self._gpu_keys: dict[int, BlockRef] = {}  # lazy: GPU block -> the block of a request it holds
        self._block_pool: BlockPool | None = None

    def bind_gpu_block_pool(self, block_pool: BlockPool) -> None:
        """vLLM's GPU block pool: lazy mode walks its free queue for blocks about to be reused."""
        self._block_pool = block_pool

    def store_step(self, scheduler_output: SchedulerOutput) -> None:
        """Store what this step makes full (eager), or what vLLM reuses next (lazy)."""
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self.requests.get(req_id)
            if state is None:
                continue
            num_tokens = state.request.num_computed_tokens + scheduled
            if self.lazy_ahead is None:
                self._store_full(state, num_tokens)
            else:
                self._note_full(state, num_tokens)
        if self.lazy_ahead is not None:
            candidates = self._lazy_candidates()
            _, declined = self._store(candidates, None)
            for ref in candidates[len(candidates) - declined :]:  # declined: not offered again
                self._gpu_keys.pop(self.requests.geometry.block_id(ref.gpu_block), None)

    def _store_full(self, state: RequestState, num_tokens: int) -> None:
        """Store the request's full blocks no tier holds yet. Those that find no room now are tried
        again at the request's next step, in chain order."""
        requests = self.requests
        full = requests.unstored_full(state, num_tokens)
        if len(requests.geometry.groups) == 1:  # (the common case, every step: no per-group work)
            ids = state.block_ids[0]
            todo = [(i, 0) for i in full if self._storable(state.keys[i], ids[i])]
        else:
            todo = [
                (i, p)
                for i in full
                for p in requests.held_in(state, i)
                if self._storable(requests.geometry.group_key(state.keys[i], p), requests.block_id_at(state, i, p))
            ]
        taken, declined = self._store([requests.block(state, i, p) for i, p in todo], state)
        # Blocks the first tier's policy declined are not offered again by this request; the others
        # that found no room are, at its next step.
        state.stored = todo[taken][0] if taken < len(todo) - declined else full.stop

    def _note_full(self, state: RequestState, num_tokens: int) -> None:
        """Lazy: remember which of the request's blocks each of its full GPU blocks holds, for when vLLM's
        free queue nears it (``_lazy_candidates``)."""
        full = self.requests.unstored_full(state, num_tokens)
        for i in full:
            for p in self.requests.held_in(state, i):
                self._gpu_keys[self.requests.block_id_at(state, i, p)] = self.requests.block(state, i, p)
        state.stored = full.stop

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

    def _storable(self, key: bytes, block_id: int) -> bool:
        """Neither being loaded (so a tier has it) nor held or being written by any tier already."""
        return not self.step.being_loaded(block_id) and self.planner.is_new(key)
