"""What a stack over Mooncake Store does beyond the suite every store runs (tests/contracts/test_remote_stack.py):
a host tier with the shared store below it (``backend: mooncake``), as engines use it through ``KVTier``.

The fault tests kill the master or the segment owner while a load moves bytes and check that exactly the
affected blocks fail, within the tier's timeout, every other block bit-exact; the memory an engine lends
the store (``segment_size``) is mounted by its transfer client alone, never by its lookup client.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from helpers.mooncake_server import MooncakeMaster, SegmentOwner
from kvtier import KVTier

BLOCK = 64 << 10
TOKENS = 4
TIMEOUT = 2.0
WAIT = 30.0
"""Seconds any future here may take; a test that hits it fails instead of hanging."""


def config(master: MooncakeMaster, namespace: str = "test-model", host: str = "4MiB", block: int = BLOCK) -> dict:
    return {
        "block_tokens": TOKENS,
        "block_bytes": block,
        "fragments": 2,
        "namespace": namespace,
        "tiers": [{"medium": "host", "capacity": host, "eviction": "lru"}, master.tier(TIMEOUT)],
    }


def blocks(count: int, seed: int, size: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, size), dtype=np.uint8)


def tokens(count: int, start: int = 0) -> list[int]:
    return list(range(start, start + count * TOKENS))


def stored(kv: KVTier, ids: list[int], data: np.ndarray) -> None:
    """Store through the host tier and wait until the write-through copies reached the store."""
    assert kv.store(ids, data).result(WAIT).stored == len(data)
    kv.wait_idle(WAIT)


def load(kv: KVTier, ids: list[int], count: int):
    out = np.zeros((count, BLOCK), dtype=np.uint8)
    return kv.load(ids, out).result(WAIT), out


@pytest.fixture(scope="module")
def store():
    with MooncakeMaster() as master, SegmentOwner(master, "256MB"):
        yield master


BIG = 1 << 20
"""Block size of the fault tests: a load of 24 such blocks takes about 20 ms on loopback (1.5 GB/s)."""
KILL_AFTER = 0.005


def kill_during_load(master: MooncakeMaster, victim):
    """Store two batches of 24 blocks; load the first and kill ``victim`` (the master or the segment
    owner) while that load moves bytes; then load the second, which the stack still believes in (its
    lookup said present). Every block either arrives bit-exact or is reported failed, each load within
    the tier's timeout and a second; returns the first load's result."""
    first, second, warm = tokens(24), tokens(24, start=10_000), tokens(1, start=20_000)
    data = blocks(24, seed=6, size=BIG)
    with KVTier.open(config(master, host="128MiB", block=BIG)) as writer:
        for ids in (first, second, warm):
            stored(writer, ids, data[: len(ids) // TOKENS])
    with KVTier.open(config(master, host="128MiB", block=BIG)) as reader:
        out = np.zeros((24, BIG), dtype=np.uint8)
        assert reader.load(warm, out).result(WAIT).loaded == 1  # the reader's load client is connected
        assert reader.lookup(first) == 24 and reader.lookup(second) == 24
        start = time.monotonic()
        future = reader.load(first, out)
        time.sleep(KILL_AFTER)
        victim.kill()
        during = future.result(WAIT)
        assert time.monotonic() - start < TIMEOUT + 1.0
        assert during.hits == 24 and during.loaded + len(during.failed) == 24
        assert all(np.array_equal(out[i], data[i]) for i in range(24) if i not in during.failed)
        start = time.monotonic()
        after = reader.load(second, out).result(WAIT)
        assert time.monotonic() - start < TIMEOUT + 1.0
        assert (after.hits, after.loaded, len(after.failed)) == (24, 0, 24)
        return during


def test_master_killed_mid_load_fails_the_affected_blocks_within_the_timeout():
    """A transfer under way needs no master (its blocks arrive); every later load and lookup fails."""
    with MooncakeMaster() as master, SegmentOwner(master, "256MB"):
        kill_during_load(master, master)
        with KVTier.open(config(master)) as engine:
            start = time.monotonic()
            assert engine.lookup(tokens(4, start=90_000)) == 0
            assert time.monotonic() - start < TIMEOUT + 1.0


def test_owner_killed_mid_load_fails_exactly_the_blocks_not_yet_moved():
    with MooncakeMaster() as master, SegmentOwner(master, "256MB") as owner:
        during = kill_during_load(master, owner)
        assert during.failed, "the owner died while the load moved its blocks: those not yet moved fail"


def test_only_the_transfer_client_lends_memory_lookups_mount_no_segment(store):
    """``segment_size`` is the memory an engine lends the store: its transfer client mounts it, its lookup
    client (the vLLM scheduler's, in an engine) never does, so the store gets one segment, not two."""
    owners = len(store.segments())
    lending = config(store)
    lending["tiers"][1]["mooncake"]["segment_size"] = "32MB"
    ids = tokens(2, start=4000)
    with KVTier.open(lending) as kv:
        stored(kv, ids, blocks(2, seed=9))  # the transfer client connects
        assert kv.lookup(tokens(2, start=4100)) == 0  # and so does the lookup client
        assert len(store.segments()) == owners + 1
    with KVTier.open(config(store)) as reader:  # the lender's records left with its segment, or stayed elsewhere:
        result, _ = load(reader, ids, 2)  # whatever the store answers, never wrong bytes
        assert result.loaded + len(result.failed) == result.hits
