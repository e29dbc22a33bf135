"""Why a prefix missed, through the Python API: ``KVTier.stats()["misses"]``, ``KVTier.explain`` and the
``kvtier.misses`` debug line; the partial last block of token ids; a remote store killed (a remote error)
and a damaged record in it (damaged, remote), on a real redis-server."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from helpers.redis_server import redis_server
from kvtier import KVTier
from kvtier.core.misses import TOTAL, MissReason
from kvtier.tiers.remote.record import HEADER_BYTES

BLOCK = 4096
TOKENS = 16
WAIT = 30.0


def prompt(n: int, extra: int = 0) -> list[int]:
    """Token ids of ``n`` full blocks and ``extra`` tokens of a partial one."""
    return list(range(TOKENS * n + extra))


def data(n: int) -> np.ndarray:
    return np.random.default_rng(n).integers(0, 256, (n, BLOCK), dtype=np.uint8)


def host_only() -> dict:
    return {"block_bytes": BLOCK, "block_tokens": TOKENS, "tiers": [{"medium": "host", "capacity_blocks": 8}]}


@pytest.fixture
def server(tmp_path):
    with redis_server(tmp_path / "redis") as server:
        yield server


def over(server) -> dict:
    remote = {"medium": "remote", "backend": "redis", "timeout": 1.0, "redis": {"url": server.url}}
    return {**host_only(), "tiers": [{"medium": "host", "capacity_blocks": 8}, remote]}


def test_stats_count_a_partial_last_block_and_explain_counts_nothing(caplog):
    with KVTier.open(host_only()) as kv:
        kv.store(prompt(2), data(2)).result(WAIT)
        assert kv.lookup(prompt(2)) == 2 and kv.stats()["misses"]["total"]["partial_block"] == 0
        miss = kv.explain(prompt(2, extra=5))
        assert (miss.reason, miss.hits, miss.blocks) == (MissReason.PARTIAL_BLOCK, 2, 2)
        assert kv.explain(prompt(2)) is None
        with caplog.at_level(logging.DEBUG, logger="kvtier.misses"):
            assert kv.lookup(prompt(2, extra=5)) == 2
            assert kv.lookup(prompt(3)) == 2
        stats = kv.stats()
        assert stats["host"]["committed"] == 2, "the tiers' counters stay as they were"
        assert stats["misses"]["total"] == {
            r.value: int(r in (MissReason.PARTIAL_BLOCK, MissReason.NEVER_STORED)) for r in MissReason
        }
        assert stats["misses"]["by_tier"]["host"] == stats["misses"]["total"]
        lines = [r.getMessage() for r in caplog.records if r.name == "kvtier.misses"]
        assert lines == [
            "lookup hit 2/2 full blocks; miss: partial_block; per tier: host=partial_block",
            "lookup hit 2/3 full blocks; miss: never_stored; per tier: host=never_stored",
        ]
        kv.lookup(prompt(2, extra=5))  # keys instead of tokens never count a partial block:
        assert kv.lookup(kv.keys(prompt(2, extra=5))) == 2
        assert kv.stack.misses.take() == {
            (MissReason.PARTIAL_BLOCK, TOTAL): 2,
            (MissReason.PARTIAL_BLOCK, "host"): 2,
            (MissReason.NEVER_STORED, TOTAL): 1,
            (MissReason.NEVER_STORED, "host"): 1,
        }


def test_a_killed_store_is_a_remote_error(server):
    with KVTier.open(over(server)) as writer:
        writer.store(prompt(3), data(3)).result(WAIT)
        writer.wait_idle(WAIT)
    with KVTier.open(over(server)) as reader:
        server.kill()
        assert reader.lookup(prompt(3)) == 0  # the store holds them, but cannot say so
        miss = reader.explain(prompt(3))
        assert (miss.reason, miss.tier) == (MissReason.REMOTE_ERROR, "remote")
        assert reader.stats()["misses"] == {
            "total": {r.value: int(r is MissReason.REMOTE_ERROR) for r in MissReason},
            "by_tier": {
                "host": {r.value: int(r is MissReason.NEVER_STORED) for r in MissReason},
                "remote": {r.value: int(r is MissReason.REMOTE_ERROR) for r in MissReason},
            },
        }


def test_a_damaged_record_is_damaged_in_the_remote_tier(server):
    with KVTier.open(over(server)) as writer:
        writer.store(prompt(3), data(3)).result(WAIT)
        writer.wait_idle(WAIT)
    with KVTier.open(over(server)) as reader:
        remote = reader.stack.tiers[-1]
        name = remote.records[0].name(reader.keys(prompt(3))[1])
        server.client().set(name, b"\xff" * (HEADER_BYTES + BLOCK))
        out = np.zeros((3, BLOCK), np.uint8)
        assert reader.load(prompt(3), out).result(WAIT).failed == [1]
        assert reader.lookup(prompt(3)) == 1
        assert reader.stack.misses.take() == {
            (MissReason.DAMAGED, TOTAL): 1,
            (MissReason.NEVER_STORED, "host"): 1,
            (MissReason.DAMAGED, "remote"): 1,
        }
