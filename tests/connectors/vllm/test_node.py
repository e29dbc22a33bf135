"""The connector over the machine's node daemon, under vLLM's real Scheduler: what only the node tier
does (what every shared tier does, on Redis and on a node daemon alike: ``test_keyed.py``).

A load pins its blocks at the daemon while it copies them and releases every pin once it is done, so
that a load can neither leave a block the daemon may never evict nor read one it has reused.
"""

from __future__ import annotations

from helpers.node_daemon import node_daemon
from helpers.vllm_keyed import assert_second_engine_hit


def test_a_load_leaves_nothing_pinned_at_the_daemon(make_engine, tmp_path):
    with node_daemon(tmp_path / "node", capacity="16MiB", block_bytes="512KiB", max_held=1.0) as daemon:
        config = {"tiers": [{"medium": "host", "capacity_blocks": 32}, daemon.tier(timeout=1.0)]}
        assert_second_engine_hit(make_engine, config, "node", staged=False)
        assert daemon.stats()["held"] == 0
