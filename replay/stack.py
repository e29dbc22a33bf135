"""Replay a request trace through a real tier stack: bytes are stored, evicted, demoted and loaded back.

Why this exists
    ``kvtier.replay.cache`` answers "which policy keeps the right blocks" on the index alone. A user
    deciding whether kvtier pays off also asks where the hits land (GPU, host or disk), how many
    bytes move, and whether the bytes that come back are the bytes that went in. This module drives
    a ``TierStack`` with the same requests and the same hit rule, through the real tiers, the real
    policies and the real transfer backends, and reads every figure from the stack's own counters.

What one request does (serially, in trace order)
    1. ``stack.load`` the longest present prefix of its block keys into a caller buffer (the
       engine's memory; ``dst_medium`` "gpu" when the stack has a GPU tier, so a block found on
       disk is staged through host memory as it would be on its way to a GPU). Those blocks are
       the hits; each is compared with the bytes it was stored with (a pure function of its id),
       and a block that comes back different is counted in ``corrupt``, never as a hit. A block the
       stack reports failed ends the prefix there.
    2. Every other block of the request is referenced: a block some tier still holds (after a
       missing one, so not a hit) is pinned in the fastest tier holding it, which counts as a use
       for that tier's policy and keeps it while the request runs; a missing one is "computed"
       (filled from its id) and stored. Stores never exceed the first tier's capacity: the leading
       blocks that fit are stored, as in the metadata replay.
    3. The pins are released and the stack is left idle (background demotions finished), so a
       replay is deterministic and the next request sees a settled stack.

Load bandwidth per tier (for sizing, ``kvtier.replay.sizing``)
    Each load is timed, from the call to its last block arriving in the caller's buffer (staging
    included: a block on disk reaches the engine through host memory). A load whose hits all come
    from one tier adds its bytes and seconds to that tier's (``StackReplayResult.loads``); a load
    that reads from several tiers is left out, since the copies of one plan run together and its
    time cannot be split between them.

The one difference from ``kvtier.replay.cache.replay``: a load unpins the hit prefix once it has
arrived, so the request's own store may evict those blocks, where the metadata replay protects
every block of the request. With LRU that happens only to a request longer than the tier, so with
one tier, no watermark and LRU both count the same hits and evictions on such traces (tested);
other policies may also, rarely, pick a just-read block.

Block ids become 8-byte keys; ``block_content`` fills a block from its id, so any block read back
can be checked without remembering what was written.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.core.devices import CUDA_DEVICE, GPU, HOST
from kvtier.core.keys import tenant_tag
from kvtier.core.layout import BlockLayout
from kvtier.core.misses import MissCounter
from kvtier.core.stack import TierStack
from kvtier.core.storage import buffer_storage
from kvtier.core.tier import Tier
from kvtier.replay.routing import FixedRouter, Router
from kvtier.replay.sizing import LoadTimes
from kvtier.replay.tenants import count
from kvtier.replay.trace import Request

_MIX = np.uint64(0x9E3779B97F4A7C15)  # odd 64-bit constant: distinct ids give distinct fills


def block_key(block_id: int, tag: bytes = b"") -> bytes:
    """The stack key of a trace block id (ids are 64-bit; load_trace checks the range); a tenant's
    (``tag``: its ``keys.tenant_tag``) is a tenant's key, the tag then the id in 16 bytes."""
    return tag + block_id.to_bytes(16 if tag else 8, "little", signed=False)


def request_keys(request: Request, tags: dict[str, bytes]) -> list[bytes]:
    """The keys of a request's blocks: its tenant's (``tags``: each tenant's tag, by name), if it has one."""
    tag = tags[request.tenant] if request.tenant else b""
    return [block_key(h, tag) for h in request.hash_ids]


def block_content(block_id: int, nbytes: int) -> np.ndarray:
    """The bytes stored for block ``block_id``: 64-bit words ``i + id * K`` (mod 2**64), cut to ``nbytes``.

    Every word of every block differs from the same word of any other block, so a block served
    from the wrong slot, a stale slot or a torn copy never compares equal.
    """
    words = np.arange(-(-nbytes // 8), dtype=np.uint64)
    with np.errstate(over="ignore"):
        words += np.uint64(block_id) * _MIX
    return words.view(np.uint8)[:nbytes]


def prefill_tokens_saved(request: Request, hits: int, block_tokens: int) -> int:
    """Prompt tokens not recomputed thanks to ``hits`` leading blocks (at most the prompt's length when known)."""
    saved = hits * block_tokens
    return min(saved, request.input_length) if request.input_length > 0 else saved


@dataclass
class StackReplayResult:
    """What a replay through a stack counted; ``tiers`` is ``TierStack.stats()`` at the end."""

    requests: int = 0
    references: int = 0
    hits: int = 0
    prefill_tokens: int = 0
    prefill_tokens_saved: int = 0
    verified_blocks: int = 0  # hit blocks compared bit-exact with what was stored
    corrupt_blocks: int = 0  # hit blocks that came back different (each ends its request's prefix)
    failed_blocks: int = 0  # blocks the stack found but reported failed on load
    stored_blocks: int = 0
    seconds: float = 0.0
    tiers: dict[str, dict[str, int]] = field(default_factory=dict)
    occupancy: list[tuple[int, dict[str, int]]] = field(default_factory=list)  # (request index, used per tier)
    loads: LoadTimes = field(default_factory=LoadTimes)  # the loads one tier served alone, timed
    misses: dict[str, dict] = field(default_factory=dict)  # requests whose prefix missed (``MissCounter.stats``)
    tenants: dict[str, dict[str, int]] = field(default_factory=dict)  # hits and references by tenant (``count``)

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.references if self.references else 0.0


def replay_through_stack(
    requests: Sequence[Request],
    stack: TierStack,
    block_tokens: int = 512,
    on_request: Callable[[int], None] | None = None,
    samples: int = 400,
    timeout: float = 120.0,
    key_secret: bytes | None = None,
) -> StackReplayResult:
    """Run ``requests`` through ``stack`` (which must be empty); ``on_request(i)`` after each one.

    Raises ValueError when a tier already holds blocks (hits would come from an earlier run).
    """
    router = FixedRouter([0] * len(requests))
    return replay_through_engines(requests, [stack], router, block_tokens, on_request, samples, timeout, key_secret)[0]


def replay_through_engines(
    requests: Sequence[Request],
    stacks: Sequence[TierStack],
    router: Router,
    block_tokens: int = 512,
    on_request: Callable[[int], None] | None = None,
    samples: int = 400,
    timeout: float = 120.0,
    key_secret: bytes | None = None,
) -> list[StackReplayResult]:
    """Run ``requests`` in trace order, each through the stack ``router`` chooses for it (engines that may
    share a tier: a node daemon's slab), the router told of every load a single tier served; each
    engine's result. Every stack must be empty (ValueError). A request of a tenant has its tenant's keys
    (tagged under the stacks' ``key_secret``)."""
    longest = max((len(r.hash_ids) for r in requests), default=0)
    every = max(1, -(-len(requests) // max(samples, 1)))
    tags = {tenant: tenant_tag(tenant, key_secret) for tenant in {r.tenant for r in requests if r.tenant}}
    replayers = [_Replayer(stack, longest, block_tokens, timeout, router.loaded) for stack in stacks]
    started = time.perf_counter()
    for index, request in enumerate(requests):
        keys = request_keys(request, tags)
        replayer = replayers[router.choose(index, request, keys)]
        replayer.step(request, keys)
        if index % every == 0 or index == len(requests) - 1:
            replayer.sample(index)
        if on_request is not None:
            on_request(index)
    seconds = time.perf_counter() - started
    return [replayer.finish(seconds) for replayer in replayers]


class _Replayer:
    """One engine of a replay: its stack, its memory, what it counted so far."""

    def __init__(
        self,
        stack: TierStack,
        longest: int,
        block_tokens: int,
        timeout: float,
        on_load: Callable[[str, int, float], None],
    ) -> None:
        busy = {t.name: t.usage().used for t in stack.tiers if t.usage().used}
        if busy:
            raise ValueError(
                f"the replay needs an empty stack, but tiers hold blocks already: {busy} "
                f"(a disk tier keeps its blocks across runs: give it an empty directory)"
            )
        self.stack = stack
        self.on_load = on_load  # (tier, blocks, seconds) of each load one tier served alone
        self.block_tokens = block_tokens
        self.timeout = timeout
        layout: BlockLayout = stack.tiers[0].storage.layout
        self.block_bytes = layout.block_bytes
        on_cuda = any(t.storage.device == CUDA_DEVICE for t in stack.tiers)
        self.engine = EngineBuffers(max(longest, 1), self.block_bytes, on_cuda)
        self.loaded_into = buffer_storage(self.engine.loaded, layout, writable=True)
        self.computed_from = buffer_storage(self.engine.computed, layout)
        self.dst_medium = GPU if any(t.medium == GPU for t in stack.tiers) else HOST
        top = stack.tiers[0]
        self.top_capacity = None if top.by_key else top.capacity  # (a tier by key: its owner makes room)
        self.result = StackReplayResult()
        self.misses = MissCounter([t.name for t in stack.tiers])  # this run's alone

    def step(self, request: Request, keys: list[bytes]) -> None:
        """Load the request's present prefix (checked bit-exact), reference the rest, store what is missing."""
        stack, result, bb, timeout = self.stack, self.result, self.block_bytes, self.timeout
        ids = request.hash_ids
        load_started = time.perf_counter()
        loaded = stack.load(keys, self.loaded_into, range(len(keys)), self.dst_medium).result(timeout)
        load_seconds = time.perf_counter() - load_started
        if len(set(loaded.sources)) == 1 and not loaded.failed:
            result.loads.add(loaded.sources[0], loaded.loaded * bb, load_seconds)
            self.on_load(loaded.sources[0], loaded.loaded, load_seconds)
        good = loaded.failed[0] if loaded.failed else loaded.hits
        result.failed_blocks += len(loaded.failed)
        arrived = self.engine.loaded_bytes(good)
        for i in range(good):
            if not np.array_equal(arrived[i], block_content(ids[i], bb)):
                result.corrupt_blocks += 1
                good = i
                break
        result.verified_blocks += good
        miss = stack.misses.explain(keys, good)
        if miss is not None:
            self.misses.add(miss)
        result.hits += good
        count(result.tenants, request, good)
        result.references += len(ids)
        result.requests += 1
        result.prefill_tokens += request.input_length or len(ids) * self.block_tokens
        result.prefill_tokens_saved += prefill_tokens_saved(request, good, self.block_tokens)
        pinned, missing = _reference_rest(stack.tiers, keys[good:], ids[good:])
        try:
            missing = missing[: self.top_capacity]
            if missing:
                self.engine.compute([block_id for _, block_id in missing])
                stored = stack.store([k for k, _ in missing], self.computed_from, range(len(missing))).result(timeout)
                result.stored_blocks += stored.stored
        finally:
            for tier, key in pinned:
                tier.unpin([key])
        stack.wait_idle(timeout)

    def sample(self, index: int) -> None:
        self.result.occupancy.append((index, {t.name: t.usage().used for t in self.stack.tiers}))

    def finish(self, seconds: float) -> StackReplayResult:
        self.result.seconds = seconds
        self.result.tiers = self.stack.stats()
        self.result.misses = self.misses.stats()
        return self.result


class EngineBuffers:
    """The engine's memory a replay loads into and stores from: on the GPU where the stack has a CUDA GPU
    tier (loads end in device memory, stores read it, as under an engine), else host arrays.
    ``compute`` writes blocks' contents as a prefill would; ``loaded_bytes`` reads loaded ones
    back to the host for checking."""

    def __init__(self, rows: int, block_bytes: int, on_cuda: bool) -> None:
        self.block_bytes = block_bytes
        self._host = np.empty((rows, block_bytes), dtype=np.uint8)
        self.loaded: Any  # torch CUDA tensors or numpy arrays
        self.computed: Any
        if on_cuda:
            import torch

            self.loaded = torch.empty((rows, block_bytes), dtype=torch.uint8, device="cuda")
            self.computed = torch.empty((rows, block_bytes), dtype=torch.uint8, device="cuda")
        else:
            self.loaded = np.empty((rows, block_bytes), dtype=np.uint8)
            self.computed = self._host

    def compute(self, block_ids: Sequence[int]) -> None:
        for row, block_id in enumerate(block_ids):
            self._host[row] = block_content(block_id, self.block_bytes)
        if self.computed is not self._host:  # on the current stream, which kvtier's stores order after
            import torch

            self.computed[: len(block_ids)].copy_(torch.from_numpy(self._host[: len(block_ids)]))

    def loaded_bytes(self, count: int) -> np.ndarray:
        if isinstance(self.loaded, np.ndarray):
            return self.loaded[:count]
        return self.loaded[:count].cpu().numpy()


def _reference_rest(
    tiers: Sequence[Tier], keys: Sequence[bytes], ids: Sequence[int]
) -> tuple[list[tuple[Tier, bytes]], list[tuple[bytes, int]]]:
    """Pin each key some tier holds (the fastest; a use for its policy); return those pins and the
    (key, id) pairs no tier holds, in request order."""
    pinned, missing = [], []
    for key, block_id in zip(keys, ids, strict=True):
        tier = next((t for t in tiers if t.try_pin(key)), None)
        if tier is None:
            missing.append((key, block_id))
        else:
            pinned.append((tier, key))
    return pinned, missing
