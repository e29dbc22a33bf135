"""A disk tier below the node daemon's slab (one disk cache for the machine), with a real daemon process:
every block committed into the slab is copied down (write-through); a block the slab evicted since comes
back up for the engine that asks for it (a lookup says "present", a pin brings it into the slab, checked as
any); engines asking for the same blocks at once read each from disk once; a daemon started with a new
slab finds the machine's blocks on its disk."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from helpers.node_blocks import TOKENS, load_at_once, prompt, wait_for
from helpers.node_daemon import node_daemon, node_daemon_here
from kvtier import KVTier
from kvtier.core.tier import BlockState

BLOCK = 64 * 1024


def stack(daemon) -> dict:
    return {"block_tokens": TOKENS, "block_bytes": BLOCK, "tiers": [daemon.tier()]}


@pytest.fixture
def daemon(tmp_path):
    disk = {"medium": "disk", "path": str(tmp_path / "disk"), "capacity_blocks": 64}
    with node_daemon(tmp_path / "node", capacity="512KiB", block_bytes="64KiB", below=[disk], max_held=1.0) as running:
        yield running  # a slab of 8 slots over 64 on disk


def test_blocks_the_slab_evicted_come_back_up_from_its_disk(daemon, rng):
    tokens = prompt(12)
    blocks = rng.integers(0, 256, (12, BLOCK), dtype=np.uint8)
    with KVTier.open(stack(daemon)) as writer:
        assert writer.store_now(tokens[: 6 * TOKENS], blocks[:6]).stored == 6
        wait_for(lambda: daemon.stats()["copied_down"] == 6)  # (blocks in their copy down cannot be evicted)
        assert writer.store_now(tokens, blocks).stored == 6  # (the first 6 are there already)
    wait_for(lambda: daemon.stats()["copied_down"] == 12)  # the slab is full: 4 blocks live on disk alone
    with KVTier.open(stack(daemon)) as reader:
        assert reader.lookup(tokens) == 12
        out = np.zeros_like(blocks)
        result = reader.load_now(tokens, out)
        assert (result.loaded, result.failed) == (12, []) and np.array_equal(out, blocks)
    assert daemon.stats()["promoted"] >= 4


def test_engines_that_want_the_same_blocks_at_once_read_each_from_disk_once(daemon, rng):
    tokens, other = prompt(8), prompt(8, start=10_000)
    blocks = rng.integers(0, 256, (8, BLOCK), dtype=np.uint8)
    with KVTier.open(stack(daemon)) as writer:
        writer.store_now(tokens, blocks)
        wait_for(lambda: daemon.stats()["copied_down"] == 8)
        writer.store_now(other, rng.integers(0, 256, (8, BLOCK), dtype=np.uint8))  # pushes the first 8 out
    wait_for(lambda: daemon.stats()["copied_down"] == 16)
    results, outs = load_at_once([KVTier.open(stack(daemon)) for _ in range(3)], tokens, blocks)
    assert all(r.loaded == 8 for r in results) and all(np.array_equal(out, blocks) for out in outs)
    assert daemon.stats()["promoted"] == 8  # once each, whoever asked first


def test_a_daemon_with_a_new_slab_finds_the_machines_blocks_on_its_disk(daemon, rng):
    tokens = prompt(5)
    blocks = rng.integers(0, 256, (5, BLOCK), dtype=np.uint8)
    with KVTier.open(stack(daemon)) as writer:
        writer.store_now(tokens, blocks)
    wait_for(lambda: daemon.stats()["copied_down"] == 5)
    assert daemon.stop() == 0
    os.unlink(daemon.slab)  # the machine rebooted: /dev/shm is empty, the disk is not
    daemon.start()
    with KVTier.open(stack(daemon)) as reader:
        out = np.zeros_like(blocks)
        assert reader.load_now(tokens, out).loaded == 5 and np.array_equal(out, blocks)
    assert daemon.stats()["promoted"] == 5


@pytest.fixture
def stuck_disk(tmp_path, monkeypatch):
    """A daemon in this process (so that its constants can be changed) over a disk tier whose reads hang
    until the event yielded is set (each then runs as usual, late): promotions give up after 0.3 s;
    ``reads`` holds the reads asked for."""
    import kvtier.node_daemon as node_daemon_module
    from kvtier.core.devices import FILE_DEVICE
    from kvtier.tiers.disk.transfer import DiskBackend

    monkeypatch.setattr(node_daemon_module, "PROMOTE_TIMEOUT_S", 0.3)
    released, reads = threading.Event(), []
    submit = DiskBackend.submit

    def hanging_submit(self, transfer, on_complete):
        if transfer.src.device != FILE_DEVICE:
            return submit(self, transfer, on_complete)
        reads.append(transfer)
        threading.Thread(target=lambda: (released.wait(30), submit(self, transfer, on_complete))).start()

    monkeypatch.setattr(DiskBackend, "submit", hanging_submit)
    disk = {"medium": "disk", "path": str(tmp_path / "disk"), "capacity_blocks": 64}
    with node_daemon_here("512KiB", "64KiB", [disk], max_held=1.0) as daemon:
        engine = {
            "block_tokens": TOKENS,
            "block_bytes": BLOCK,
            "tiers": [{"medium": "node", "socket": daemon.settings.socket}],
        }
        try:
            yield daemon, engine, released, reads
        finally:
            released.set()


def test_a_read_from_disk_past_its_time_is_a_miss_and_its_slots_stay_reserved_until_it_ends(stuck_disk, rng):
    daemon, engine, released, reads = stuck_disk
    tokens = prompt(12)
    blocks = rng.integers(0, 256, (12, BLOCK), dtype=np.uint8)
    with KVTier.open(engine) as writer:
        assert writer.store_now(tokens[: 6 * TOKENS], blocks[:6]).stored == 6
        wait_for(lambda: daemon.stats()["copied_down"] == 6)
        assert writer.store_now(tokens, blocks).stored == 6
    wait_for(lambda: daemon.stats()["copied_down"] == 12)  # blocks 0-3 live on disk alone
    stuck, out = tokens[: 4 * TOKENS], np.zeros_like(blocks[:4])
    with KVTier.open(engine) as reader:
        assert reader.load_now(stuck, out).failed == [0, 1, 2, 3]  # the disk hangs: misses after 0.3 s
    assert len(reads) == 1
    promoting = list(daemon._promotions)
    assert len(promoting) == 4 and all(daemon.tier.state(k) is BlockState.WRITING for k in promoting)
    started = time.monotonic()
    with KVTier.open(engine) as reader:  # (a new engine: the first remembers its failed blocks a while)
        assert reader.load_now(stuck, out).failed == [0, 1, 2, 3]  # asked again: no wait, no second read
    assert time.monotonic() - started < 0.3 and len(reads) == 1
    assert all(daemon.tier.state(k) is BlockState.WRITING for k in promoting)  # (the read may still land)
    released.set()  # the read ends: its slots are given back
    wait_for(lambda: not daemon._promotions)
    assert all(daemon.tier.state(k) is BlockState.FREE for k in promoting)
    with KVTier.open(engine) as reader:
        result = reader.load_now(stuck, out)
    assert (result.loaded, result.failed) == (4, []) and np.array_equal(out, blocks[:4]) and len(reads) == 2
    wait_for(lambda: daemon.stats()["held"] == 0)  # (the daemon sees the last engine go in its own time)
