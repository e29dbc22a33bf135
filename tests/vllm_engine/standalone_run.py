"""A standalone ``KVTier`` on a node daemon, in a process of its own, beside engines on the same daemon (for
test_engine_node.py): run as a script, prints ``RESULT {json}`` once ``STOP_FILE`` exists.

``python standalone_run.py SOCKET STOP_FILE`` stores BLOCKS blocks of its own (random bytes, a
namespace of its own) once, then, until STOP_FILE appears, loads them back and compares them with what
it stored; it counts the rounds, those that found fewer than all its blocks, and every block that did
not come back bit-exact. Prints ``READY`` once its blocks are stored.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from kvtier import KVTier

BLOCKS, TOKENS, BLOCK_BYTES = 8, 16, 64 * 1024
WITHIN_S = 300.0


def main(socket: str, stop_file: str) -> int:
    blocks = np.random.default_rng(7).integers(0, 256, (BLOCKS, BLOCK_BYTES), dtype=np.uint8)
    tokens = list(range(1, 1 + BLOCKS * TOKENS))  # the engines' first prefix starts with the same ids
    config = {
        "block_tokens": TOKENS,
        "block_bytes": BLOCK_BYTES,
        "namespace": "standalone",
        "tiers": [{"medium": "node", "socket": socket, "timeout": 2.0}],
    }
    rounds = wrong = short = 0
    deadline = time.monotonic() + WITHIN_S
    with KVTier.open(config) as kv:
        stored = kv.store_now(tokens, blocks).stored
        print("READY", flush=True)
        while not Path(stop_file).exists() and time.monotonic() < deadline:
            out = np.zeros_like(blocks)
            loaded = kv.load_now(tokens, out).loaded
            short += loaded < BLOCKS
            wrong += int(sum(not np.array_equal(out[i], blocks[i]) for i in range(loaded)))
            rounds += 1
            time.sleep(0.01)
        node = kv.stats()["node"]  # (its hits, and why a round came back short: errors, timeouts, misses)
    result = {"stored": stored, "rounds": rounds, "short": short, "wrong": wrong, "hits": node["hits"], "node": node}
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
