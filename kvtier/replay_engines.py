"""``kvtier replay --engines N [--split ...] [--node]``: a trace split across several engines on one machine,
each with a stack of its own, or all sharing the machine's node daemon.

- Private tiers (without ``--node``): every engine gets the config's stack with each tier's capacity cut
  to 1/N: the same memory in all as one engine's stack.
- ``--node``: the config's last tier must be a host tier; it becomes the slab of a node daemon this
  command runs (a real one: its socket, its slab in /dev/shm, its index and policy, in a thread of this
  process), at the full capacity, and every engine's stack ends in a node tier on it (tiers above it cut
  to 1/N as before). With N > 1 the same split is also replayed on private tiers, and the summary says
  both (``private``, ``hit_gain``: the node tier's hit ratio over the private tiers').

The engines' counts are summed into one summary (``engines`` lists each engine's hit ratio); the node
tier's capacity, use and evictions are the daemon's.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvtier.core.config import StackConfig, capacity_in_blocks, load_config
from kvtier.core.devices import HOST
from kvtier.core.errors import ConfigError
from kvtier.node_config import load_node_config
from kvtier.node_daemon import NodeDaemon
from kvtier.replay.stack import StackReplayResult


def divided(config: StackConfig, engines: int, keep_last: bool = False) -> StackConfig:
    """``config`` with every sized tier's capacity cut to 1/``engines`` (at least one block each); the last
    tier left whole with ``keep_last``."""
    data = config.model_dump(exclude_none=True)
    for i, tier in enumerate(data["tiers"]):
        blocks = capacity_in_blocks(config.tiers[i], config.block_bytes, config.header_room)
        if blocks is None or (keep_last and i == len(data["tiers"]) - 1):
            continue
        tier.pop("capacity", None)
        tier["capacity_blocks"] = max(1, blocks // engines)
    return load_config(data)


@contextmanager
def node_daemon_for(config: StackConfig) -> Iterator[tuple[StackConfig, NodeDaemon]]:
    """A node daemon whose slab is ``config``'s last tier (a host tier; ConfigError otherwise), serving
    from a thread of this process, and the engines' config: the same tiers, the last one a node tier on
    that daemon. Everything is gone afterwards, the slab included."""
    last = config.tiers[-1]
    if last.medium != HOST:
        raise ConfigError(
            f"--node: the config's last tier is {last.medium}; it must be a host tier, which becomes the node "
            f"daemon's slab"
        )
    directory = tempfile.mkdtemp(prefix="kvn", dir="/tmp")
    socket_path = os.path.join(directory, "node.sock")
    slab = f"/dev/shm/kvtier-replay-{os.getpid()}-{uuid.uuid4().hex[:12]}"  # (whose it is, if one is ever left)
    slab_tier = last.model_dump(exclude_none=True, exclude={"name"})
    try:
        daemon = NodeDaemon(
            load_node_config(
                {
                    "node": {"socket": socket_path, "slab": slab, "max_held": 1.0},
                    "block_bytes": config.block_bytes,
                    "tiers": [slab_tier],
                    # (the slab's shares know the tenants they name by their tags under the engines' secret)
                    **({"key_secret_env": config.key_secret_env} if config.key_secret_env else {}),
                }
            )
        )
        serving = threading.Thread(target=daemon.serve, name="kvtier-replay-node", daemon=True)
        serving.start()
        try:
            data = config.model_dump(exclude_none=True)
            name = config.tier_name(len(config.tiers) - 1)  # (the tier keeps its name: --tier and the tables use it)
            data["tiers"][-1] = {"medium": "node", "name": name, "socket": socket_path, "timeout": 30.0}
            yield load_config(data), daemon
        finally:
            daemon.request_stop()
            serving.join()
            daemon.stop()
    finally:
        if os.path.exists(slab):
            os.unlink(slab)
        shutil.rmtree(directory, ignore_errors=True)


def merged(results: list[StackReplayResult]) -> StackReplayResult:
    """The engines' results as one: every count summed (tier counters by tier), occupancy and load times
    of the first engine's."""
    total = StackReplayResult()
    for result in results:
        for name in (
            "requests",
            "references",
            "hits",
            "prefill_tokens",
            "prefill_tokens_saved",
            "verified_blocks",
            "corrupt_blocks",
            "failed_blocks",
            "stored_blocks",
        ):
            setattr(total, name, getattr(total, name) + getattr(result, name))
        total.seconds = max(total.seconds, result.seconds)
        total.tiers = _summed(total.tiers, result.tiers)
        total.misses = _summed(total.misses, result.misses)
        total.tenants = _summed(total.tenants, result.tenants)
        total.loads.merge(result.loads)
    total.occupancy = results[0].occupancy
    return total


def _summed(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Nested dicts of numbers added key by key."""
    out = dict(a)
    for key, value in b.items():
        out[key] = _summed(out.get(key, {}), value) if isinstance(value, dict) else out.get(key, 0) + value
    return out


def daemon_counts(daemon: NodeDaemon) -> dict[str, Any]:
    """The node tier's capacity, use and evictions: the daemon's slab's; its tenants' where it has shares."""
    usage = daemon.tier.usage()
    counts: dict[str, Any] = {"capacity": usage.capacity, "used": usage.used, "evicted": daemon.tier.stats.evicted}
    tenants = daemon.tier.tenant_counts()
    if tenants is not None:
        counts["tenants"] = tenants
    return counts
