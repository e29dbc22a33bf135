"""MLA under tensor parallelism: the latent KV is the same on every rank, so the ranks of one engine
keep one copy in host memory (a slab they share) and a remote store holds one record per block.
Every rank still makes every copy into and out of the shared slots (identical bytes), so no rank
waits for another; the memory is counted once."""

from __future__ import annotations

import ctypes
import glob
import os

from helpers.vllm_helpers import assert_loads_back, prompt
from kvtier.tiers import host

HOST_ONLY = {"tiers": [{"medium": "host", "capacity_blocks": 32}]}


def host_storage(engine, rank: int):
    return engine.workers[rank].connector.worker_side.storages["host"]


def test_the_ranks_share_one_host_slab_and_leave_no_name_behind(make_engine):
    before = set(glob.glob(os.path.join(host.SHARED_DIR, "kvtier-*")))
    engine = make_engine(HOST_ONLY, tp=2, mla=True)
    assert set(glob.glob(os.path.join(host.SHARED_DIR, "kvtier-*"))) == before  # both arrived: the name is gone
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


def test_disk_blocks_stage_through_the_shared_slab_into_both_ranks(make_engine, tmp_path):
    config = {"placement": "write_through", "tiers": [
        {"medium": "host", "capacity_blocks": 4},
        {"medium": "disk", "capacity_blocks": 32, "path": str(tmp_path / "disk")}]}
    engine = make_engine(config, tp=2, mla=True)
    for p in (1, 2):  # the second prefix pushes the first out of the 4-block host tier
        engine.run([engine.add(prompt(4, 5, seed=p, prefix=p), max_tokens=2)])
    assert_loads_back(engine, prompt(4, 9, seed=3, prefix=1), computed=9, blocks=4)
    assert sum(s["hit_blocks_disk"] for s in engine.stats) == 4
