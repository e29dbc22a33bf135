"""The node tier's rules when processes die or stop, with real processes: engines killed with SIGKILL in
the middle of a store or a load leave nothing pinned or reserved at the daemon; an engine stopped while
it holds blocks loses them after the lease; the daemon killed or stopped costs engines misses and
dropped stores within the tier's timeout, never a hang, and they reconnect by themselves when it is
back; a restarted daemon finds its slab and serves what it held (a warm restart)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers.node_blocks import TOKENS, prompt, wait_for
from helpers.node_daemon import node_daemon
from kvtier import KVTier
from kvtier.tiers.node import client as node_client, tier as node_tier

BLOCK = 64 * 1024
TIMEOUT = 1.0


def stack(daemon) -> dict:
    return {"block_tokens": TOKENS, "block_bytes": BLOCK, "tiers": [daemon.tier(timeout=TIMEOUT)]}


# An engine process that takes a hold at the daemon (reserves or pins the blocks of a prompt), says so,
# then waits to be killed or stopped.
HOLDER = """
import sys, time
import numpy as np
from kvtier import KVTier
from kvtier.tiers.node.protocol import Op
socket, op, start, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
kv = KVTier.open({"block_tokens": 16, "block_bytes": 65536, "tiers": [{"medium": "node", "socket": socket}]})
node = kv.stack.tiers[0].storage
names = node.node_keys(kv.keys(list(range(start, start + 16 * n))))
if op == "reserve":
    (given,), _, view = node.client.call(Op.RESERVE, names, [65536] * n, [b""] * n)
    for slot, _ in given:
        view.block(slot, 65536)[:] = bytes([7]) * 65536  # half-written, never committed
else:
    (given,), _, _ = node.client.call(Op.PIN, names, 65536)
assert all(isinstance(entry, list) for entry in given), given
print("held", flush=True)
time.sleep(600)
"""


def holder(daemon, op: str, start: int, n: int) -> subprocess.Popen:
    """An engine process holding ``n`` blocks from token ``start`` (``op``: reserve or pin), once it says so."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, daemon.socket, op, str(start), str(n)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "held", "the holder engine failed"
    return process


def held_at_daemon(daemon) -> int:
    return daemon.stats()["held"]


def engines_at_daemon(daemon) -> int:
    """Connections open, not counting the one that asks."""
    return daemon.stats()["connected"] - 1


@pytest.fixture
def quick_retries(monkeypatch):
    """Reconnect 0.2 s after a failed call, and forget a failed load's verdict after 0.3 s (1 s and 2 s
    by default), so a test sees the daemon's return soon."""
    monkeypatch.setattr(node_client, "RETRY_AFTER_S", 0.2)
    monkeypatch.setattr(node_tier, "KNOWN_FOR_S", 0.3)


@pytest.mark.parametrize("op", ["reserve", "pin"])
def test_an_engine_killed_while_it_holds_blocks_leaves_nothing_held(tmp_path, rng, op):
    with node_daemon(tmp_path) as daemon, KVTier.open(stack(daemon)) as other:
        tokens = prompt(4, start=100)
        blocks = rng.integers(0, 256, (4, BLOCK), dtype=np.uint8)
        if op == "pin":
            other.store_now(tokens, blocks)
        process = holder(daemon, op, 100, 4)
        assert held_at_daemon(daemon) == 4
        used = daemon.stats()["used_slots"]
        process.send_signal(signal.SIGKILL)
        process.wait()
        wait_for(lambda: held_at_daemon(daemon) == 0 and engines_at_daemon(daemon) == 1)
        if op == "reserve":  # the half-written blocks never became visible, and their slots are free again
            assert daemon.stats()["used_slots"] == used - 4
            assert other.lookup(tokens) == 0
            assert other.store_now(tokens, blocks).stored == 4
        out = np.zeros_like(blocks)
        assert other.load_now(tokens, out).loaded == 4 and np.array_equal(out, blocks)


def test_an_engine_stopped_while_it_holds_blocks_loses_them_after_the_lease(tmp_path):
    with node_daemon(tmp_path, lease=1.0) as daemon:
        process = holder(daemon, "reserve", 200, 3)
        try:
            process.send_signal(signal.SIGSTOP)
            started = time.monotonic()
            wait_for(lambda: held_at_daemon(daemon) == 0 and engines_at_daemon(daemon) == 0)
            assert time.monotonic() - started < 5
            assert daemon.stats()["revoked"] == 1
        finally:
            process.kill()
            process.wait()
        assert "held blocks over the 1 s lease" in daemon.log.read_text()


def test_a_killed_daemon_costs_misses_within_the_timeout_and_a_restart_keeps_the_cache_warm(
    tmp_path, rng, quick_retries
):
    tokens, later = prompt(6, start=300), prompt(2, start=900)
    blocks = rng.integers(0, 256, (6, BLOCK), dtype=np.uint8)
    with node_daemon(tmp_path) as daemon, KVTier.open(stack(daemon)) as kv:
        assert kv.store_now(tokens, blocks).stored == 6
        wait_for(lambda: daemon.stats()["stores"] == 6)  # (COMMIT is posted: the daemon reads it soon after)
        daemon.kill()
        out = np.zeros_like(blocks)
        started = time.monotonic()
        assert kv.store_now(later, blocks[:2]).stored == 0  # dropped: the daemon is gone, and the engine knows
        assert kv.load_now(tokens, out).loaded == 0  # nothing the dead daemon said is read on its word
        assert kv.lookup(later) == 0
        assert time.monotonic() - started < 2 * TIMEOUT
        daemon.start()
        assert "(6 blocks restored)" in daemon.log.read_text()
        time.sleep(0.4)  # (past the retry interval and the failed loads' verdict: the next call reconnects)
        out = np.zeros_like(blocks)
        result = kv.load_now(tokens, out)
        assert (result.loaded, result.failed) == (6, []) and np.array_equal(out, blocks)
        assert kv.store_now(later, blocks[:2]).stored == 2


def test_a_stopped_daemon_costs_misses_within_the_timeout_then_engines_go_on(tmp_path, rng, quick_retries):
    tokens, fresh = prompt(4, start=400), prompt(4, start=800)
    blocks = rng.integers(0, 256, (4, BLOCK), dtype=np.uint8)
    with node_daemon(tmp_path) as daemon, KVTier.open(stack(daemon)) as kv, KVTier.open(stack(daemon)) as reader:
        kv.store_now(tokens, blocks)
        daemon.pause()
        try:
            out = np.zeros_like(blocks)
            started = time.monotonic()
            assert reader.load_now(tokens, out).loaded == 0
            assert kv.store_now(fresh, blocks).stored == 0
            assert time.monotonic() - started < 3 * TIMEOUT
        finally:
            daemon.resume()
        time.sleep(0.4)
        wait_for(lambda: held_at_daemon(daemon) == 0)  # (what the timed-out calls took was given back)
        out = np.zeros_like(blocks)
        assert reader.load_now(tokens, out).loaded == 4 and np.array_equal(out, blocks)
        assert kv.store_now(fresh, blocks).stored == 4


def test_a_daemon_stopped_by_sigterm_exits_cleanly_and_the_next_one_finds_the_slab(tmp_path, rng):
    tokens = prompt(3, start=500)
    blocks = rng.integers(0, 256, (3, BLOCK), dtype=np.uint8)
    with node_daemon(tmp_path) as daemon:
        with KVTier.open(stack(daemon)) as kv:
            kv.store_now(tokens, blocks)
            wait_for(lambda: daemon.stats()["stores"] == 3)
            assert daemon.stop() == 0
            daemon.start()
        with KVTier.open(stack(daemon)) as kv:
            out = np.zeros_like(blocks)
            assert kv.load_now(tokens, out).loaded == 3 and np.array_equal(out, blocks)
        assert "node: stopped" in daemon.log.read_text()
