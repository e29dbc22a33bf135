"""Connector statistics in vLLM's ``KVConnectorStats`` form: counters that add up across ranks and steps.

The scheduler side counts blocks (hits per tier, failed loads, stored blocks); the workers count bytes
and seconds per direction (into vLLM's KV blocks: load; out of them: store). vLLM aggregates both
through ``aggregate`` and logs ``reduce()``.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

COUNTERS = ("hit_blocks_host", "hit_blocks_disk", "failed_load_blocks", "stored_blocks",
            "load_bytes", "load_seconds", "store_bytes", "store_seconds")


@dataclass
class KVTierConnectorStats(KVConnectorStats):
    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)

    def record_load(self, host_hits: int, disk_hits: int, failed: int) -> None:
        self.data["hit_blocks_host"] += host_hits
        self.data["hit_blocks_disk"] += disk_hits
        self.data["failed_load_blocks"] += failed

    def record_store(self, blocks: int) -> None:
        self.data["stored_blocks"] += blocks

    def record_transfer(self, direction: str, nbytes: int, seconds: float) -> None:
        """``direction`` is "load" (into vLLM's blocks) or "store" (out of them)."""
        self.data[f"{direction}_bytes"] += nbytes
        self.data[f"{direction}_seconds"] += seconds

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0)

    def aggregate(self, other: KVConnectorStats) -> "KVTierConnectorStats":
        if not isinstance(other, KVTierConnectorStats):
            raise TypeError(f"cannot aggregate kvtier stats with {type(other).__name__}")
        return KVTierConnectorStats({k: self.data.get(k, 0) + other.data.get(k, 0) for k in COUNTERS})

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.data)
        for direction in ("load", "store"):
            seconds = self.data[f"{direction}_seconds"]
            out[f"{direction}_GBps"] = round(self.data[f"{direction}_bytes"] / seconds / 1e9, 3) if seconds else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in COUNTERS)
