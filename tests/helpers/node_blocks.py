"""What the node tier's tests with standalone engines share: prompts of 16-token blocks, waiting for a
daemon's counts, and several engines loading the same blocks at once."""

from __future__ import annotations

import threading
import time

import numpy as np

TOKENS = 16


def prompt(n_blocks: int, start: int = 0) -> list[int]:
    """The tokens of ``n_blocks`` blocks, counting up from ``start``."""
    return list(range(start, start + n_blocks * TOKENS))


def wait_for(predicate, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not predicate():
        assert time.monotonic() < deadline, "the condition never came true"
        time.sleep(0.02)


def load_at_once(engines: list, tokens: list[int], like: np.ndarray, before=None) -> tuple[list, list[np.ndarray]]:
    """Every engine (a ``KVTier``) loads ``tokens`` into blocks shaped as ``like``, all starting together
    (each after ``before(engine)``, where given); their results and the blocks each got. Closes them."""
    outs = [np.zeros_like(like) for _ in engines]
    start = threading.Barrier(len(engines))
    results: list = []

    def load(kv, out):
        start.wait()
        if before is not None:
            before(kv)
        results.append(kv.load_now(tokens, out))

    threads = [threading.Thread(target=load, args=(kv, out)) for kv, out in zip(engines, outs, strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    for kv in engines:
        kv.close()
    return results, outs
