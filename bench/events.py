"""What KV events cost a standalone stack's stores and loads (``kvtier/event_publisher.py``).

What is measured
    The same stream through a host tier over a disk tier (LRU both, so every store demotes and evicts
    once the stack is full: three events per block), once without ``events:`` and once with a publisher
    that a subscriber connected to but never reads (the worst case for its socket): stores of
    ``--batch`` new blocks by token ids (so the events carry their tokens) and a load of the previous
    batch, ``--rounds`` times. Runs alternate (off,
    on, off, on, ...) ``--repeats`` times; each figure is the best of its runs (blocks per second).

Reference, measured in the same run
    The same stack without events: ``ratio`` = blocks/s with events / blocks/s without (1.0: free).
    The issue's bound for a vLLM step with events is 0.95 of one without (``bench/scheduler_overhead.py``
    measures that); this stream is harsher: small blocks, each stored, demoted and evicted.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np
import zmq

from kvtier import KVTier

BLOCK = 64 * 1024
BLOCK_TOKENS = 16


def tokens_of(round_: int, batch: int) -> list[int]:
    """A prompt of ``batch`` blocks of its own."""
    n = batch * BLOCK_TOKENS
    return list(range(round_ * n, (round_ + 1) * n))


def stream(config: dict, rounds: int, batch: int) -> float:
    """Blocks per second stored and loaded through a stack of ``config``."""
    data = np.ones((batch, BLOCK), np.uint8)
    out = np.empty_like(data)
    with KVTier.open(config) as kv:
        started = time.perf_counter()
        for r in range(rounds):
            kv.store(tokens_of(r, batch), data).result(60)
            if r:
                kv.load(tokens_of(r - 1, batch), out).result(60)
        kv.wait_idle()
        return 2 * rounds * batch / (time.perf_counter() - started)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=400)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        tiers = [
            {"medium": "host", "capacity_blocks": 256, "eviction": "lru"},
            {"medium": "disk", "path": f"{directory}/disk", "capacity_blocks": 1024, "eviction": "lru"},
        ]
        off = {"block_bytes": BLOCK, "block_tokens": BLOCK_TOKENS, "tiers": tiers}
        on = {**off, "events": {"endpoint": f"ipc://{directory}/events"}}
        subscriber = zmq.Context.instance().socket(zmq.SUB)
        subscriber.setsockopt(zmq.SUBSCRIBE, b"")
        subscriber.connect(f"ipc://{directory}/events")  # (connected, never reading)
        runs: dict[str, list[float]] = {"off": [], "on": []}
        for _ in range(args.repeats):
            for name, config in (("off", off), ("on", on)):
                runs[name].append(stream(config, args.rounds, args.batch))
        subscriber.close(linger=0)
    best = {name: max(figures) for name, figures in runs.items()}
    for name, figures in runs.items():
        print(f"events {name}: {', '.join(f'{f:,.0f}' for f in figures)} blocks/s")
    print(json.dumps({"ratio": best["on"] / best["off"], "blocks_per_s": best, "runs": runs, **vars(args)}))


if __name__ == "__main__":
    main()
