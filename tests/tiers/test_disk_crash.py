"""A process killed with SIGKILL at any instant leaves a disk tier that reopens consistent.

A child python process opens a stack (a host tier over a disk tier, or a disk tier alone) on a
shared directory and stores blocks whose bytes are a pure function of their key, in a loop, closing
and reopening the stack now and then; the parent kills it with SIGKILL after a random (seeded)
delay, while it is opening, storing, demoting, evicting or closing. Every child starts from the
directory the previous one crashed on, so recovery after a crash is itself crashed into.

Invariants checked after every kill, by reopening the directory in the parent:
- every block the disk tier finds loads bit-exact, with no failed block: only complete blocks come back;
- ``check_invariants()`` holds: the index, the allocator and the policy agree;
- the used slots are exactly the recovered blocks (every one a key the child wrote);
- the directory lock died with the child.
After the last kill the parent keeps storing into the crashed directory, closes cleanly, and a final
reopen finds every block it stored, bit-exact, besides whatever the children left.
"""

from __future__ import annotations

import hashlib
import json
import select
import signal
import subprocess
import sys
import time

import numpy as np

from kvtier.builder import build_stack, config_layout
from kvtier.core.config import load_config
from kvtier.core.storage import buffer_storage
from kvtier.core.tier import BlockState

BLOCK = 16 * 1024
DISK_SLOTS = 40
UNIVERSE = 160  # keys the children draw from; far more than the disk holds, so slots are reused all the time
ROUNDS = 30

CHILD = r"""
import hashlib, json, sys
import numpy as np
from kvtier.builder import build_stack, config_layout
from kvtier.core.config import load_config
from kvtier.core.storage import buffer_storage

config, seed, universe = load_config(json.loads(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3])
layout = config_layout(config)
rng = np.random.default_rng(seed)

def key(i):
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()

def content(k):
    return np.random.default_rng(int.from_bytes(k[:8], "little")).integers(0, 256, layout.block_bytes, dtype=np.uint8)

announced = False
while True:
    stack = build_stack(config)
    batch = min(stack.tiers[0].capacity, 8)
    for _ in range(int(rng.integers(5, 40))):
        start = int(rng.integers(0, universe))
        keys = [key(i % universe) for i in range(start, start + int(rng.integers(1, batch + 1)))]
        blocks = np.stack([content(k) for k in keys])
        stack.store(keys, buffer_storage(blocks, layout), range(len(keys))).result(timeout=60)
        if not announced:
            print("storing", flush=True)
            announced = True
    stack.close()
"""


def key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def content(k: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(k[:8], "little")).integers(0, 256, BLOCK, dtype=np.uint8)


UNIVERSE_KEYS = [key(i) for i in range(UNIVERSE)]


def config_dict(path, variant: int) -> dict:
    """The same disk tier (path, namespace, geometry, capacity) under different stacks above it."""
    # LRU everywhere: a policy that may decline blocks (the last tier's default, adaptive) would make
    # "every block stored is found again" a question of its duel, not of crash safety.
    disk = {
        "medium": "disk",
        "path": str(path),
        "capacity_blocks": DISK_SLOTS,
        "o_direct": ("auto", "off")[variant % 2],
        "eviction": "lru",
    }
    host = [] if variant % 3 == 2 else [{"medium": "host", "capacity_blocks": 4}]
    return {
        "block_bytes": BLOCK,
        "fragments": 4,
        "namespace": "crash",
        "placement": ("write_back", "write_through")[variant % 2 if host else 0],
        "tiers": [*host, disk],
    }


def verify(path, extra_keys=()) -> list[bytes]:
    """Reopen ``path``: every found block is complete and bit-exact, and the tier is consistent."""
    config = load_config(config_dict(path, 0))
    layout = config_layout(config)
    stack = build_stack(config)  # also proves the dead child's lock is gone
    try:
        host, disk = stack.tiers
        assert host.usage().used == 0
        candidates = UNIVERSE_KEYS + list(extra_keys)
        found = [k for k in candidates if disk.state(k) is BlockState.READY]
        disk.check_invariants()
        assert disk.usage().used == len(found), "a used slot holds no block the children wrote"
        out = np.zeros((max(len(found), 1), BLOCK), np.uint8)
        if found:
            loaded = stack.load(found, buffer_storage(out, layout, writable=True), range(len(found))).result(timeout=60)
            assert (loaded.hits, loaded.loaded, loaded.failed) == (len(found), len(found), [])
        for i, k in enumerate(found):
            assert np.array_equal(out[i], content(k)), "a recovered block is not bit-exact"
        assert disk.stats.read_errors == 0
        return found
    finally:
        stack.close()


def run_child(path, variant: int, seed: int, wait_for_storing: bool, delay: float) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(config_dict(path, variant)), str(seed), str(UNIVERSE)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        if wait_for_storing:
            readable, _, _ = select.select([child.stdout], [], [], 60)
            assert readable, "the child never started storing"
            line = child.stdout.readline()
            assert line.strip() == "storing", child.stderr.read()
        time.sleep(delay)
        assert child.poll() is None, f"the child died before it was killed: {child.stderr.read()}"
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
        child.stderr.close()


def test_sigkill_at_random_points_leaves_only_complete_blocks(tmp_path):
    rng = np.random.default_rng(20240601)
    seen = 0
    for round_ in range(ROUNDS):
        # Most kills land while blocks are stored; every fourth may land while the child starts,
        # opens and scans the slab, or before it has done anything at all.
        early = round_ % 4 == 3
        run_child(
            tmp_path,
            variant=round_,
            seed=int(rng.integers(1 << 31)),
            wait_for_storing=not early,
            delay=float(rng.uniform(0.05, 0.6) if early else rng.uniform(0.0, 0.4)),
        )
        found = verify(tmp_path)
        seen += len(found)
    assert seen > 0, "the children never got a block to disk: the test proved nothing"

    # Keep storing into the crashed directory, then close cleanly: everything stored is found again.
    config = load_config(config_dict(tmp_path, 0))
    layout = config_layout(config)
    fresh = [hashlib.blake2b(b"after" + bytes([i]), digest_size=16).digest() for i in range(DISK_SLOTS // 2)]
    stack = build_stack(config)
    for i in range(0, len(fresh), 4):
        keys = fresh[i : i + 4]
        result = stack.store(
            keys, buffer_storage(np.stack([content(k) for k in keys]), layout), range(len(keys))
        ).result(timeout=60)
        assert result.stored == len(keys) and not result.failed
    stack.close()
    found = verify(tmp_path, extra_keys=fresh)
    assert set(fresh) <= set(found)
