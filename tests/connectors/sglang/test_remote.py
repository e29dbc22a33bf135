"""kvtier's SGLang storage backend over a shared store (a real redis-server and a real Mooncake Store), as
two SGLang servers (two backends, two host pools) would use it.

What it shows: a page one backend stored, another loads bit-exact (through Redis and through Mooncake,
with and without a disk tier between); an MLA model keeps one copy for its TP ranks while MHA ranks keep
separate shards; another model misses; a damaged record is a miss and never loaded; a store that is
stopped answers with misses within the tier's timeout while stores still land locally; SGLang's keys
never become record names.
"""

from __future__ import annotations

import time

import pytest
import torch

from helpers.mooncake_server import MooncakeMaster, SegmentOwner, require_mooncake
from helpers.redis_server import redis_server
from helpers.sglang_pools import fill, indices, keys, mha_host_pool, mla_host_pool, page_bytes, publish

TIMEOUT = 1.0
WAIT = 30.0


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    with redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="module")
def mooncake():
    require_mooncake()
    with MooncakeMaster() as master, SegmentOwner(master, "64MB"):
        yield master


@pytest.fixture(params=["redis", "mooncake"])
def store(request):
    """``(backend name, its settings)`` of a running store."""
    if request.param == "redis":
        server = request.getfixturevalue("redis")
        return "redis", {"url": server.url}
    master = request.getfixturevalue("mooncake")
    return "mooncake", {"master": master.address, "metadata_server": master.metadata_url}


def shared(store, tmp_path=None, namespace: str = "") -> dict:
    """A host staging tier, a disk tier when ``tmp_path`` is given, and the store."""
    backend, settings = store
    tiers = [{"medium": "host", "capacity": "1MiB"}]
    if tmp_path is not None:
        tiers.append({"medium": "disk", "path": str(tmp_path / "kv"), "capacity": "4MiB"})
    tiers.append({"medium": "remote", "backend": backend, "timeout": TIMEOUT, backend: settings})
    return {"tiers": tiers, "placement": "write_through", "namespace": namespace}


@pytest.mark.parametrize("with_disk", [False, True])
def test_a_page_one_server_stored_another_loads_bit_exact(store, tmp_path, backends, with_disk):
    names = keys(6, f"share-{with_disk}-")
    writer_pool, reader_pool = mha_host_pool(), mha_host_pool()
    writer = backends(writer_pool, shared(store, tmp_path / "w" if with_disk else None))
    before = publish(writer, writer_pool, names, range(0, 6), seed=1)
    reader = backends(reader_pool, shared(store, tmp_path / "r" if with_disk else None))
    assert reader.batch_exists(names) == 6
    assert reader.batch_get_v1(names, indices(range(50, 56))) == [True] * 6
    assert all(torch.equal(page_bytes(reader_pool, 50 + i), b) for i, b in enumerate(before))
    assert reader.stack.stats()["remote"]["hits"] == 6


def test_an_mla_model_keeps_one_copy_for_its_tp_ranks(store, backends):
    names = keys(3, "mla-")
    pool0, pool1 = mla_host_pool(), mla_host_pool()
    rank0 = backends(pool0, shared(store), mla=True, tp_rank=0, tp_size=2)
    rank1 = backends(pool1, shared(store), mla=True, tp_rank=1, tp_size=2)
    before = publish(rank0, pool0, names, range(0, 3), seed=2)  # SGLang lets rank 0 alone write MLA pages
    assert rank1.batch_get_v1(names, indices(range(7, 10))) == [True] * 3
    assert all(torch.equal(page_bytes(pool1, 7 + i), b) for i, b in enumerate(before))


def test_mha_tp_ranks_keep_separate_shards_and_another_model_misses(store, backends):
    names = keys(3, "tp-")
    pool0, pool1 = mha_host_pool(), mha_host_pool()
    rank0 = backends(pool0, shared(store), tp_rank=0, tp_size=2)
    publish(rank0, pool0, names, range(0, 3), seed=3)
    assert backends(pool1, shared(store), tp_rank=1, tp_size=2).batch_exists(names) == 0
    assert backends(pool1, shared(store), model="other-model").batch_exists(names) == 0
    assert backends(pool1, shared(store, namespace="tenant-b")).batch_exists(names) == 0
    assert backends(pool1, shared(store), tp_rank=0, tp_size=2).batch_exists(names) == 3


def test_a_damaged_redis_record_is_a_miss_and_never_loaded(redis, backends):
    names = keys(3, "damage-")
    writer_pool, reader_pool = mha_host_pool(), mha_host_pool()
    writer = backends(writer_pool, shared(("redis", {"url": redis.url})))
    before = publish(writer, writer_pool, names, range(0, 3), seed=4)
    client = redis.client()
    record = next(k for k in client.scan_iter("kvtier*") if before[1].numpy().tobytes() in client.get(k))
    value = bytearray(client.get(record))
    value[-5] ^= 0xFF
    client.set(record, bytes(value))
    reader = backends(reader_pool, shared(("redis", {"url": redis.url})))
    result = reader.batch_get_v1(names, indices(range(20, 23)))
    assert result[0] and not result[1]
    assert torch.equal(page_bytes(reader_pool, 20), before[0])


def test_sglang_keys_never_become_record_names(redis, backends):
    names = keys(2, "named-")
    pool = mha_host_pool()
    publish(backends(pool, shared(("redis", {"url": redis.url}))), pool, names, range(0, 2), seed=5)
    records = [k.decode() for k in redis.client().scan_iter("*")]
    assert records and not any(name in record or name[-8:] in record for name in names for record in records)


def test_a_stopped_store_gives_misses_within_the_timeout_and_stores_still_land(tmp_path, backends):
    with redis_server(tmp_path / "redis") as server:
        names = keys(4, "stopped-")
        writer_pool, pool = mha_host_pool(), mha_host_pool()
        publish(backends(writer_pool, shared(("redis", {"url": server.url}))), writer_pool, names, range(0, 4), 6)
        reader = backends(pool, shared(("redis", {"url": server.url})))
        server.stop()
        try:
            started = time.monotonic()
            assert reader.batch_exists(names) == 0
            assert reader.batch_get_v1(names, indices(range(0, 4))) == [False] * 4
            fill(pool, 7)
            assert reader.batch_set_v1(keys(2, "local-"), indices(range(10, 12))) == [True, True]
            assert time.monotonic() - started < 4 * TIMEOUT + 2
            assert reader.batch_exists(keys(2, "local-")) == 2  # the host tier holds them
        finally:
            server.cont()
