"""Builders shared by the stack tests: small real stacks (GPU tier on CPU tensors over a host tier)
and blocks whose bytes are a pure function of their key, so any load can be checked bit-exact."""

from __future__ import annotations

import hashlib
import os

import numpy as np

from kvtier.core.jobs import JobManager
from kvtier.core.layout import BlockLayout
from kvtier.core.stack import TierStack
from kvtier.core.storage import buffer_storage
from kvtier.core.tier import BlockState
from kvtier.policies import LRUPolicy, Watermark
from kvtier.tiers.gpu import gpu_tier
from kvtier.tiers.host import host_tier
from kvtier.transfers.cpu import CPUBackend

LAYOUT = BlockLayout.per_layer(4, 256)  # 1 KiB blocks in 4 fragments: gathers and scatters every time


def key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def content(k: bytes, nbytes: int = LAYOUT.block_bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(k[:8], "little")).integers(0, 256, nbytes, dtype=np.uint8)


def blocks_for(keys: list[bytes]) -> np.ndarray:
    return np.stack([content(k) for k in keys]) if keys else np.empty((0, LAYOUT.block_bytes), np.uint8)


def make_stack(
    gpu: int = 8,
    host: int = 32,
    placement: str = "write_back",
    backend=None,
    gpu_watermark: Watermark | None = None,
    host_watermark: Watermark | None = None,
    **kwargs,
) -> TierStack:
    jobs = JobManager()
    tiers = [
        gpu_tier("gpu", gpu, LAYOUT, LRUPolicy(), gpu_watermark, jobs.is_fenced),
        host_tier("host", host, LAYOUT, LRUPolicy(), host_watermark, jobs.is_fenced),
    ]
    return TierStack(tiers, [backend or CPUBackend(2)], jobs, placement, **kwargs)


def store(stack: TierStack, keys: list[bytes]):
    return stack.store(keys, buffer_storage(blocks_for(keys), LAYOUT), range(len(keys))).result(timeout=30)


def load(stack: TierStack, keys: list[bytes]):
    """Load ``keys`` into a fresh buffer; returns (LoadResult, buffer)."""
    out = np.zeros((len(keys), LAYOUT.block_bytes), np.uint8)
    result = stack.load(keys, buffer_storage(out, LAYOUT, writable=True), range(len(keys))).result(timeout=30)
    return result, out


def assert_loaded_exact(keys: list[bytes], result, out: np.ndarray) -> None:
    for i in range(result.hits):
        if i not in result.failed:
            assert np.array_equal(out[i], content(keys[i])), f"block {i} came back wrong"


def assert_no_leaks(stack: TierStack) -> None:
    stack.wait_idle()
    for tier in stack.tiers:
        tier.check_invariants()
        assert tier.leaks() == {"pinned": 0, "writing": 0}, tier.name
    assert stack.jobs.in_flight() == []
    assert stack.background_errors == []


def ready(tier, keys) -> list[bytes]:
    """The keys among ``keys`` that ``tier`` can serve now."""
    return [k for k in keys if tier.state(k) is BlockState.READY]


def flip(path, offset: int, mask: int = 0xFF) -> None:
    """XOR one byte of a file in place (damage for corruption tests)."""
    fd = os.open(path, os.O_RDWR)
    try:
        (b,) = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([b ^ mask]), offset)
    finally:
        os.close(fd)
