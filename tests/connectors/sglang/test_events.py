"""kvtier's SGLang backend publishes its tiers' KV events (``events:`` in its kvtier config) on SGLang's real
host pools: each TP rank on an endpoint of its own (IPC path plus ``-rank``, TCP port plus rank), the
pages it stores announced as BlockStored with SGLang's page size, decodable as vLLM's format."""

from __future__ import annotations

import pytest

from helpers.kv_events import Subscriber, decode
from helpers.ports import free_port
from helpers.sglang_pools import PAGE, fill, indices, keys, mha_host_pool
from kvtier.core.errors import ConfigError


def config(tmp_path, endpoint: str, replay: str | None) -> dict:
    return {
        "tiers": [{"medium": "disk", "path": str(tmp_path / "kv"), "capacity": "4MiB"}],
        "events": {"endpoint": endpoint, "replay_endpoint": replay, "interval": 0.01},
    }


def test_each_rank_publishes_what_it_stores_on_its_own_endpoint(tmp_path, backends):
    pool = mha_host_pool()
    fill(pool, 1)
    ranks = [
        backends(pool, config(tmp_path, f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/re"), tp_rank=rank, tp_size=2)
        for rank in (0, 1)
    ]
    for rank, backend in enumerate(ranks):
        names = keys(3, f"r{rank}")
        assert backend.batch_set_v1(names, indices(range(3))) == [True] * 3
        assert backend.publisher.flush()
    for rank, suffix in enumerate(["", "-1"]):
        with Subscriber(f"ipc://{tmp_path}/ev{suffix}", f"ipc://{tmp_path}/re{suffix}") as sub:
            events = [event for _, _, payload in sub.replay(0) for event in decode(payload)]
        stored = [event for event in events if event["type"] == "BlockStored"]
        assert {(e["medium"], e["locality"], e["block_size"]) for e in stored} == {("STORAGE", "LOCAL", PAGE)}
        assert sum(len(e["block_hashes"]) for e in stored) == 3, f"rank {rank}'s three pages"


def test_tcp_endpoints_move_by_rank_and_one_without_a_port_is_refused(tmp_path, backends):
    port = free_port()
    pool = mha_host_pool()
    second = backends(pool, config(tmp_path, f"tcp://127.0.0.1:{port}", None), tp_rank=1, tp_size=2)
    assert second.publisher.config.endpoint == f"tcp://127.0.0.1:{port + 1}"
    with pytest.raises(ConfigError, match="give a port"):
        backends(pool, config(tmp_path / "b", "tcp://127.0.0.1", None), tp_rank=1, tp_size=2)
