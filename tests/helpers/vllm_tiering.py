"""vLLM's own tiered offloading on CPU, for the tests of kvtier's secondary tiers and policy.

``TieringEngine`` builds vLLM 0.33's ``OffloadingConnector`` with ``spec_name: TieringOffloadingSpec``
on the scheduler side through vLLM's ``KVConnectorFactory``, from an extra config exactly as a user
writes it, and drives its real ``TieringOffloadingManager`` the way vLLM's offloading scheduler does:
lookups under the manager's lock, GPU -> CPU stores (``prepare_store``, the worker's copy, then
``complete_store``, which cascades to the secondary tiers), promotions finished by polling, one
``on_schedule_end`` per step. vLLM's GPU worker is the one part played here: it writes a chunk's
bytes into the CPU tier's row (the shared region's memoryview) between ``prepare_store`` and
``complete_store``, as its DMA would, and a test reads a promoted row back from there.

Imports vLLM: tests/connectors/vllm (whose conftest sets vLLM's environment up) and the two vLLM tiering benches
use it.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Sequence

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, ScheduleEndContext, make_offload_key

from helpers.vllm_harness import kv_cache_config, make_vllm_config
from helpers.vllm_helpers import BLOCK

MODULE = "kvtier.connectors.vllm_tiering"
POLL_S = 0.001
"""Pause between steps while work is in flight: vLLM's engine core sleeps 1 ms after a step that ran no model
(``v1/engine/core.py``), which lets transfer threads have the GIL."""


def kvtier_tier(kind: str, **settings) -> dict:
    """A ``secondary_tiers`` entry for kvtier's tier ``kind`` ("KVTierDisk", "KVTierRemote")."""
    return {"type": kind, "module_path": MODULE, **settings}


def chunk_key(n: int, group: int = 0) -> OffloadKey:
    """The OffloadKey of chunk ``n`` (its block hash is any 32 bytes; vLLM's are SHA-256 digests)."""
    return make_offload_key(n.to_bytes(4, "big") * 8, group)


def chunk_bytes(key: OffloadKey, size: int) -> np.ndarray:
    """The bytes a worker would write for ``key``: a pure function of it."""
    seed = int.from_bytes(key[:8], "big") ^ int.from_bytes(key[-4:], "big")
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def maximal_prefix(manager, keys: Sequence[OffloadKey], ctx: ReqContext) -> tuple[int, set[LookupResult]]:
    """vLLM's maximal-prefix lookup (its offloading scheduler's ``_maximal_prefix_lookup``), under the
    caller's hold of the manager's lock: how many leading chunks are HIT, HIT_PENDING or RETRY before
    the first MISS, and the answers seen (a RETRY or HIT_PENDING among them: ask again next step;
    RETRY chunks are not counted)."""
    hits, answers = 0, set()
    for key in keys:
        answer = manager.lookup(key, ctx)
        answers.add(answer)
        if answer is LookupResult.MISS:
            break
        hits += answer is not LookupResult.RETRY
    return hits, answers


DEFERRED = frozenset({LookupResult.RETRY, LookupResult.HIT_PENDING})
"""Answers after which vLLM's scheduler asks again at the next step."""


def serve(manager, req_id: str, chain: Sequence[OffloadKey]) -> int:
    """One request as vLLM's offloading connector drives a CPU tier's manager (metadata only): the
    chain's keys positioned in the request, its leading HITs loaded, the rest stored (a store the tier
    has no room for is dropped, as vLLM drops it), the request finished. Returns its prefix hits."""
    ctx = ReqContext(req_id=req_id)
    for index, key in enumerate(chain):
        ctx.set_offload_key_position(key, (index + 1) * BLOCK)
    with manager.lock:
        manager.on_new_request(ctx)
        hits = 0
        for key in chain:
            if manager.lookup(key, ctx) is not LookupResult.HIT:
                break
            hits += 1
        if hits:
            manager.prepare_load(chain[:hits], ctx)
            manager.complete_load(chain[:hits], ctx)
        if hits < len(chain):
            out = manager.prepare_store(chain[hits:], ctx)
            if out is not None:
                manager.complete_store(out.keys_to_store, ctx)
        manager.on_request_finished(ctx)
    return hits


class TieringEngine:
    """vLLM's tiering manager of one engine (scheduler side), with its CPU tier's rows in reach."""

    def __init__(
        self,
        model_dir,
        secondary_tiers: Sequence[dict],
        cpu_chunks: int = 8,
        eviction_policy: str = "lru",
        num_gpu_blocks: int = 64,
        extra: dict | None = None,
        kv_events: bool = False,
        head_size: int = 8,
        cpu_bytes: int | None = None,
        kv_config=None,
        tp: int = 1,
    ) -> None:
        """``cpu_chunks`` chunks of one GPU block each in the CPU tier (or ``cpu_bytes`` of it, with chunks of
        ``extra["block_size"]`` tokens); a GPU block holds two layers of ``kv_cache_config(head_size)``, or
        is one of ``kv_config``'s; ``tp`` workers each hold a shard of it (a CPU tier row holds them all)."""
        kv_config = kv_config or kv_cache_config(num_gpu_blocks, head_size=head_size)
        group = kv_config.kv_cache_groups[0]
        block = group.kv_cache_spec.page_size_bytes * len(group.layer_names)  # one GPU block of every layer
        self.engine_id = f"kvtier-test-{uuid.uuid4().hex[:12]}"
        cpu_bytes = cpu_bytes or cpu_chunks * max(block, 4096)
        extra_config = {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": cpu_bytes,
            "eviction_policy": eviction_policy,
            "secondary_tiers": list(secondary_tiers),
            **(extra or {}),
        }
        if eviction_policy not in ("lru", "arc"):
            extra_config["cache_policy_module_path"] = MODULE
        config = make_vllm_config(
            model_dir,
            None,  # vLLM's OffloadingConnector, from extra_config
            num_gpu_blocks,
            tp,
            extra=extra_config,
            max_num_batched_tokens=2048,
            engine_id=self.engine_id,
            kv_events=kv_events,
        )
        self.connector = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_config)
        self.manager = self.connector.connector_scheduler.manager
        self.rows = np.asarray(self.manager.primary_tier.get_kv_memoryview()).view(np.uint8)
        self.tiers = self.manager.secondary_tiers
        self._ids = itertools.count()

    @property
    def chunk_size(self) -> int:
        return self.rows.shape[1]

    def request(self) -> ReqContext:
        ctx = ReqContext(req_id=f"req-{next(self._ids)}")
        with self.manager.lock:
            self.manager.on_new_request(ctx)
        return ctx

    def finish(self, ctx: ReqContext) -> None:
        with self.manager.lock:
            self.manager.on_request_finished(ctx)

    def store(self, keys: Sequence[OffloadKey], write=chunk_bytes) -> list[OffloadKey]:
        """One request stores ``keys`` into the CPU tier (the worker writes each row) and finishes; the
        manager cascades them to the secondary tiers, and the steps go on until the cascades are over
        (their chunks stay pinned in the CPU tier until then). Returns the keys the CPU tier took."""
        ctx = self.request()
        with self.manager.lock:
            out = self.manager.prepare_store(list(keys), ctx)
        assert out is not None, "the CPU tier refused the store"
        for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
            self.rows[chunk] = write(key, self.chunk_size)
        with self.manager.lock:
            self.manager.complete_store(out.keys_to_store, ctx)
        self.finish(ctx)
        self.settle()
        return out.keys_to_store

    def step(self) -> None:
        """The end of one scheduler step (vLLM's connector calls it in build_connector_meta)."""
        with self.manager.lock:
            self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def settle(self, timeout: float = 120.0) -> None:
        """Steps until no tier has work in flight (cascades and promotions finished and collected)."""
        deadline = time.monotonic() + timeout
        while True:
            self.step()
            with self.manager.lock:
                if not self.manager.has_pending_work():
                    return
            if time.monotonic() > deadline:
                raise TimeoutError("the tiering manager still has work in flight")
            time.sleep(POLL_S)

    def lookup(self, keys: Sequence[OffloadKey], timeout: float = 30.0) -> int:
        """How many leading chunks of ``keys`` are offloaded, asked as vLLM's scheduler asks (its maximal
        prefix lookup): key by key until a MISS, and again at the next step while any answer was RETRY
        or HIT_PENDING (a store's answer or a promotion on its way). A hit found in a secondary tier is
        promoted into the CPU tier meanwhile."""
        ctx = self.request()
        deadline = time.monotonic() + timeout
        try:
            while True:
                with self.manager.lock:
                    hits, answers = maximal_prefix(self.manager, keys, ctx)
                if not answers & DEFERRED:
                    return hits
                assert time.monotonic() < deadline, "lookups still deferred"
                self.step()
                time.sleep(POLL_S)
        finally:
            self.finish(ctx)

    def read(self, keys: Sequence[OffloadKey]) -> list[np.ndarray]:
        """The CPU tier's rows of ``keys`` (each must be a HIT there), as the worker would read them."""
        ctx = self.request()
        with self.manager.lock:
            spec = self.manager.prepare_load(list(keys), ctx)
        rows = [self.rows[chunk].copy() for chunk in spec.chunk_ids]
        with self.manager.lock:
            self.manager.complete_load(list(keys), ctx)
        self.finish(ctx)
        return rows

    def shutdown(self) -> None:
        """Shut the connector down as vLLM does at exit (the test's own view of the rows goes first: vLLM
        releases the memoryview, which it cannot while anything still holds it)."""
        self.rows = None
        self.connector.shutdown()
