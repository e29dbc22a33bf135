"""Traces the replay tests share: the trace worked through by hand, random chained traces, trace files."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from hypothesis import strategies as st

from kvtier.replay.trace import Request

BB = 4096
"""Block bytes of the stacks the hand-worked trace runs through."""

# The trace worked through by hand (tests/replay/test_replay_stack.py, and `kvtier replay` in
# tests/cli/test_replay_cli.py); capacities: upper tier 2 blocks, lower tier 4 blocks.
TRACE = [[1, 2], [1, 3], [2, 4], [1, 2, 5], [4, 5, 6], [3, 7], [1, 2]]


def requests_from_ids(chains: Iterable[Sequence[int]]) -> list[Request]:
    """Requests made of bare id lists."""
    return [Request(0, 0, 0, tuple(ids)) for ids in chains]


@st.composite
def chained_traces(draw, max_requests=12, max_new=4):
    """Requests that extend a prefix of an earlier request with fresh ids, so an id is only ever
    reused after the same prefix (as in Mooncake traces)."""
    chains: list[list[int]] = []
    next_id = 0
    for _ in range(draw(st.integers(1, max_requests))):
        prefix: list[int] = []
        if chains and draw(st.booleans()):
            base = chains[draw(st.integers(0, len(chains) - 1))]
            prefix = base[: draw(st.integers(1, len(base)))]
        new = draw(st.integers(0 if prefix else 1, max_new))
        chains.append(prefix + list(range(next_id, next_id + new)))
        next_id += new
    return chains


def write(path, chains, tail=12):
    """A Mooncake trace file at ``path``: one request per chain of block ids, ``tail`` tokens short of full."""
    path.write_text(
        "".join(
            json.dumps({"timestamp": i, "input_length": 512 * len(c) - tail, "output_length": 1, "hash_ids": c}) + "\n"
            for i, c in enumerate(chains)
        )
    )
    return path
