"""kvtier's SGLang storage backend on the machine's node daemon (a real daemon process), as two SGLang
servers (two backends, two host pools) on one machine would use it: a page one backend stored, another
loads bit-exact straight from the shared slab into its host pool (a node tier needs no host tier of
kvtier's above it); an MLA model keeps one copy for its TP ranks while MHA ranks keep separate shards; a
damaged page is a miss, never loaded; a stopped daemon answers with misses within the tier's timeout."""

from __future__ import annotations

import time

import pytest
import torch

from helpers.node_daemon import node_daemon
from helpers.sglang_pools import indices, keys, mha_host_pool, mla_host_pool, page_bytes, publish
from kvtier.tiers.node.protocol import Op

TIMEOUT = 1.0


@pytest.fixture
def daemon(tmp_path):
    with node_daemon(tmp_path / "node", capacity="32MiB", block_bytes="256KiB", max_held=1.0) as running:
        yield running


def on_node(daemon, namespace: str = "") -> dict:
    return {"tiers": [daemon.tier(timeout=TIMEOUT)], "namespace": namespace}


def test_a_page_one_server_stored_another_loads_bit_exact_from_the_slab(daemon, backends):
    names = keys(6, "share-")
    writer_pool, reader_pool = mha_host_pool(), mha_host_pool()
    writer = backends(writer_pool, on_node(daemon))
    before = publish(writer, writer_pool, names, range(0, 6), seed=1)
    daemon.wait_stores(6)
    reader = backends(reader_pool, on_node(daemon))
    assert reader.batch_exists(names) == 6
    assert reader.batch_get_v1(names, indices(range(50, 56))) == [True] * 6
    assert all(torch.equal(page_bytes(reader_pool, 50 + i), b) for i, b in enumerate(before))
    assert reader.stack.stats()["node"]["hits"] == 6


def test_an_mla_model_keeps_one_copy_for_its_tp_ranks_and_mha_ranks_keep_their_own(daemon, backends):
    names = keys(3, "mla-")
    pool0, pool1 = mla_host_pool(), mla_host_pool()
    rank0 = backends(pool0, on_node(daemon), mla=True, tp_rank=0, tp_size=2)
    rank1 = backends(pool1, on_node(daemon), mla=True, tp_rank=1, tp_size=2)
    before = publish(rank0, pool0, names, range(0, 3), seed=2)  # SGLang lets rank 0 alone write MLA pages
    daemon.wait_stores(3)
    assert rank1.batch_get_v1(names, indices(range(7, 10))) == [True] * 3
    assert all(torch.equal(page_bytes(pool1, 7 + i), b) for i, b in enumerate(before))
    mha0, mha1 = mha_host_pool(), mha_host_pool()
    shard0 = backends(mha0, on_node(daemon), tp_rank=0, tp_size=2)
    shard1 = backends(mha1, on_node(daemon), tp_rank=1, tp_size=2)
    publish(shard0, mha0, keys(2, "mha-"), range(0, 2), seed=3)
    daemon.wait_stores(5)
    assert shard1.batch_exists(keys(2, "mha-")) == 0  # rank 1's shard is another block


def test_a_damaged_page_is_a_miss_never_loaded(daemon, backends):
    names = keys(3, "damaged-")
    writer_pool, reader_pool = mha_host_pool(), mha_host_pool()
    writer = backends(writer_pool, on_node(daemon))
    publish(writer, writer_pool, names, range(0, 3), seed=4)
    daemon.wait_stores(3)
    node = writer.stack.tiers[0].storage
    client = node.client
    (found,), epoch, view = client.call(Op.PIN, node.node_keys(writer._keys(names)), node.layout.block_bytes)
    slot = found[1][0]
    view.block(slot, 64)[10] ^= 0xFF  # page 1's bytes under its writer's checksum
    client.post(Op.RELEASE, epoch, node.node_keys(writer._keys(names)))
    reader = backends(reader_pool, on_node(daemon))
    assert reader.batch_get_v1(names, indices(range(20, 23))) == [True, False, True]  # SGLang recomputes page 1
    assert reader.stack.stats()["node"]["read_errors"] == 1
    assert reader.batch_exists(names) == 1  # dropped at the daemon: a miss for everyone from now on


def test_a_stopped_daemon_answers_misses_within_the_timeout(daemon, backends):
    names = keys(2, "stopped-")
    pool = mha_host_pool()
    backend = backends(pool, on_node(daemon))
    daemon.pause()
    try:
        start = time.monotonic()
        assert backend.batch_exists(names) == 0
        assert backend.batch_set_v1(names, indices(range(0, 2))) == [False, False]
        assert time.monotonic() - start < 3 * TIMEOUT
    finally:
        daemon.resume()
