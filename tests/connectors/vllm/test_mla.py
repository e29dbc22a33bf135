"""MLA under tensor parallelism: the latent KV is the same on every rank, so the ranks of one engine
keep one copy per block in every tier: a host slab they share, rank 0's disk slab, one remote record.
Rank 0 alone moves blocks into and between the tiers; every rank loads from the shared slab once
rank 0 has staged what it needs there."""

from __future__ import annotations

import ctypes
import os

import redis as redis_py

from helpers.redis_server import redis_server
from helpers.vllm_helpers import BLOCK, assert_loads_back, assert_recomputed_from, prompt
from kvtier.connectors.vllm import worker
from kvtier.connectors.vllm.worker import shared_slab_name
from kvtier.core.keys import chain_hashes
from kvtier.tiers import host

HOST_ONLY = {"tiers": [{"medium": "host", "capacity_blocks": 32}]}


def host_storage(engine, rank: int):
    return engine.workers[rank].connector.worker_side.storages["host"]


def test_the_ranks_share_one_host_slab_and_leave_no_name_behind(make_engine, monkeypatch):
    names: list[str] = []  # the names the ranks met under (other tests, running at once, may hold names of their own)
    monkeypatch.setattr(worker, "shared_slab_name", lambda *args: names.append(shared_slab_name(*args)) or names[-1])
    engine = make_engine(HOST_ONLY, tp=2, mla=True)
    assert len(set(names)) == 1 and len(names) == 2
    assert not os.path.exists(os.path.join(host.SHARED_DIR, names[0]))  # both arrived: the name is gone
    first = int(host_storage(engine, 0).fragment_addresses([5])[0, 0])
    second = int(host_storage(engine, 1).fragment_addresses([5])[0, 0])
    assert first != second  # two mappings ...
    ctypes.memset(first, 0x3C, 64)
    assert ctypes.string_at(second, 64) == b"\x3c" * 64  # ... of one memory


def test_a_prefix_loads_bit_exact_into_both_ranks_from_the_shared_slab(make_engine):
    engine = make_engine(HOST_ONLY, tp=2, mla=True)
    engine.run([engine.add(prompt(4, 5, seed=1), max_tokens=2)])
    assert engine.kvtier.tier("host").usage().used == 4  # one copy for both ranks
    assert_loads_back(engine, prompt(4, 9, seed=2), computed=9, blocks=4)  # into both ranks
    block_bytes = engine.kvtier.tier("host").block_bytes
    totals = {k: sum(s.get(k, 0) for s in engine.stats) for k in ("store_bytes", "load_bytes")}
    assert totals == {"store_bytes": 4 * block_bytes, "load_bytes": 2 * 4 * block_bytes}  # stored once, loaded twice


def test_disk_blocks_stage_through_the_shared_slab_into_both_ranks(make_engine, tmp_path):
    config = {
        "placement": "write_through",
        "tiers": [
            {"medium": "host", "capacity_blocks": 4},
            {"medium": "disk", "capacity_blocks": 32, "path": str(tmp_path / "disk")},
        ],
    }
    engine = make_engine(config, tp=2, mla=True)
    for p in (1, 2):  # the second prefix pushes the first out of the 4-block host tier
        engine.run([engine.add(prompt(4, 5, seed=p, prefix=p), max_tokens=2)])
    assert_loads_back(engine, prompt(4, 9, seed=3, prefix=1), computed=9, blocks=4)
    assert sum(s["hit_blocks_disk"] for s in engine.stats) == 4


def test_workers_in_separate_processes_keep_one_copy_and_each_loads_it(make_engine, tmp_path):
    """Ranks as vLLM runs them, each in a process of its own and stepping at once: one host slab, one
    disk slab (rank 0's) and one record per block in the store; a prefix the host tier let go of comes
    back from disk into both ranks' KV bit-exact, its host->KV copies only after rank 0 staged it."""
    with redis_server(tmp_path / "redis") as server:
        config = {
            "placement": "write_through",
            "tiers": [
                {"medium": "host", "capacity_blocks": 4},
                {"medium": "disk", "capacity_blocks": 32, "path": str(tmp_path / "disk")},
                {"medium": "remote", "backend": "redis", "timeout": 5.0, "redis": {"url": server.url}},
            ],
        }
        engine = make_engine(config, tp=2, mla=True, processes=True)
        for p in (1, 2):  # the second prefix pushes the first out of the 4-block host tier
            engine.run([engine.add(prompt(4, 5, seed=p, prefix=p), max_tokens=2)])
        engine.drain()
        assert sorted(path.name for path in (tmp_path / "disk").iterdir()) == ["rank0"]
        assert engine.kvtier.tier("disk").usage().used == 8
        client = redis_py.Redis.from_url(server.url)
        try:
            assert client.dbsize() == 8  # 2 prefixes x 4 blocks, one record each for both ranks
        finally:
            client.close()
        assert_loads_back(engine, prompt(4, 9, seed=3, prefix=1), computed=9, blocks=4)
        assert sum(s["hit_blocks_disk"] for s in engine.stats) == 4


def test_a_block_rank_0_could_not_stage_is_recomputed_on_every_rank(make_engine, tmp_path):
    """Rank 0 alone reads the disk: a block whose bytes there are damaged fails there, and the second
    part of the load leaves it out on every rank, reporting its GPU block for recomputation (rank 1
    copies nothing from a slot rank 0 did not fill)."""
    config = {
        "placement": "write_through",
        "tiers": [
            {"medium": "host", "capacity_blocks": 4},
            {"medium": "disk", "capacity_blocks": 16, "path": str(tmp_path / "disk"), "o_direct": "off"},
        ],
    }
    engine = make_engine(config, tp=2, mla=True)
    engine.run([engine.add(prompt(4, 5, seed=1, prefix=1), max_tokens=2)])
    keys = chain_hashes(prompt(4, 0, seed=0, prefix=1), BLOCK, engine.kvtier.request_namespace())
    slab = engine.workers[0].connector.worker_side.storages["disk"].slab
    assert "disk" not in engine.workers[1].connector.worker_side.storages
    with open(slab.path, "r+b") as f:  # flip bytes inside block 2's data on disk
        f.seek(slab.slot_offset(engine.kvtier.tier("disk").slots([keys[2]])[0]) + 4096 + 100)
        f.write(b"\x00\xff" * 8)
    engine.run([engine.add(prompt(4, 5, seed=2, prefix=2), max_tokens=2)])  # pushes prefix 1 out of host memory
    again = assert_recomputed_from(engine, prompt(4, 7, seed=3, prefix=1), damaged=2, blocks=4, computed=2 * BLOCK + 7)
    engine.run([again])
    assert sum(s["failed_load_blocks"] for s in engine.stats) == 1
    engine.assert_no_leaks()
