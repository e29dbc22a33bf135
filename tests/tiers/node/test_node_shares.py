"""Tenant shares of a node daemon's slab, against a real daemon process: engines tell the daemon each
block's tenant (its key's tag) when they reserve its slot, and the slab's ``tenants:`` shares hold a
steady tenant's blocks while another tenant floods the slab from another engine. Without shares the
flood pushes them out. The daemon counts blocks per tenant (``stats()["tenants"]``); a RESERVE whose
tags are not tags is a protocol error.
"""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from helpers.node_blocks import TOKENS, prompt
from helpers.node_daemon import NodeDaemonProcess
from kvtier import KVTier
from kvtier.node_metrics import tenant_families
from kvtier.tiers.node.protocol import Op, ProtocolError, request

BLOCK = 64 * 1024


@pytest.fixture(params=[{"shares": {"steady": 0.5}}, None], ids=["shares", "no shares"])
def daemon(request, tmp_path):
    running = NodeDaemonProcess(tmp_path / "node", {}, "1MiB", "64KiB", "lru")
    if request.param is not None:
        document = yaml.safe_load(running.config.read_text())
        document["tiers"][0]["tenants"] = request.param
        running.config.write_text(yaml.safe_dump(document))
    running.start()
    try:
        yield running, request.param is not None
    finally:
        running.close()


def test_a_flooding_engine_leaves_a_steady_tenants_blocks_in_the_slab_with_shares(daemon):
    running, shared = daemon
    slots = running.stats()["slots"]
    cfg = {"block_tokens": TOKENS, "block_bytes": BLOCK, "tiers": [running.tier()]}
    data = np.random.default_rng(0).integers(0, 256, (4, BLOCK), dtype=np.uint8)
    steady_tokens = prompt(4, start=0)
    with KVTier.open(cfg) as steady, KVTier.open(cfg) as flood:
        assert steady.store_now(steady_tokens, data, tenant="steady").stored == 4
        steady.wait_idle(10)
        for i in range(2 * slots // 4):  # twice the slab in prefixes nobody asks for again
            flood.store_now(prompt(4, start=100_000 * (i + 1)), data, tenant="flood")
            flood.wait_idle(10)
        held = steady.lookup(steady_tokens, tenant="steady")
        tenants = running.stats()["tenants"]
        if not shared:
            assert held == 0 and tenants == {}
            return
        assert held == 4
        out = np.zeros_like(data)
        assert steady.load_now(steady_tokens, out, tenant="steady").loaded == 4 and np.array_equal(out, data)
    assert tenants["steady"]["held"] == 4 and tenants["steady"]["evicted"] == 0
    assert tenants["other"]["evicted"] > 0 and tenants["steady"]["held"] + tenants["other"]["held"] <= slots
    scraped = {(m.name, s.labels["tenant"]): s.value for m in tenant_families(tenants) for s in m.samples}
    assert scraped[("kvtier_node_tenant_held", "steady")] == 4
    assert scraped[("kvtier_node_tenant_evicted", "other")] == tenants["other"]["evicted"]


def test_reserve_tags_must_be_tenant_tags_one_per_key():
    key = b"k" * 16
    assert request([Op.RESERVE, [key], [1], [b"8 bytes!"]])[1][2] == [b"8 bytes!"]
    for tags in ([b"short"], [b"", b""], ["text-tag"], [None]):
        with pytest.raises(ProtocolError, match="RESERVE"):
            request([Op.RESERVE, [key], [1], tags])
    with pytest.raises(ProtocolError, match="RESERVE takes 3 arguments"):
        request([Op.RESERVE, [key], [1]])
