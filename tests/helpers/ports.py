"""Loopback ports for the servers the tests start, from a block of this pytest process's own.

A port the kernel hands out for ``bind(0)`` lies in its ephemeral range (32768-60999 on Linux), where every
outgoing connection's source port comes from too: between the moment a helper picks one and the moment
its server binds it, a connection of any process may take it (the server then fails to start), and
pytest processes started side by side (pytest-xdist) hand out the same ones. So ports come from below
that range, a block of ``BLOCK`` per xdist worker (``PYTEST_XDIST_WORKER``: gw0, gw1, ...; one process
alone takes the first), each port in turn from a random start and checked free. The blocks begin above
the ports Mooncake's clients pick for themselves (12300-17000).
"""

from __future__ import annotations

import itertools
import os
import random
import re
import socket

FIRST = 18000
BLOCK = 1000
BLOCKS = 14
"""Blocks below the ephemeral range (18000 + 14 * 1000 = 32000); worker 14 shares the first again."""


def _block() -> int:
    worker = re.fullmatch(r"gw(\d+)", os.environ.get("PYTEST_XDIST_WORKER", ""))
    return int(worker.group(1)) % BLOCKS if worker else 0


def _ports() -> itertools.cycle[int]:
    start = FIRST + _block() * BLOCK
    offset = random.randrange(BLOCK)  # (a run right after another does not meet its ports in TIME_WAIT)
    return itertools.cycle([*range(start + offset, start + BLOCK), *range(start, start + offset)])


_next = _ports()


def free_port() -> int:
    """The next port of this process's block that nothing is bound to on loopback now."""
    for _ in range(BLOCK):
        port = next(_next)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free loopback port in {FIRST + _block() * BLOCK}-{FIRST + (_block() + 1) * BLOCK - 1}")
