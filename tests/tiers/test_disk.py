"""The disk tier inside a whole stack (host -> disk -> host), on a real slab file in a temporary directory.

Invariants checked:
- every block that goes down to disk comes back bit-exact: through ``build_stack`` and through the
  ``KVTier`` API, with O_DIRECT off, auto and on, from aligned and unaligned caller memory, for block
  sizes that are and are not a multiple of the 4 KiB page, directly and staged through the host tier;
- closing flushes the blocks only memory tiers hold down to disk, and reopening the same directory with
  the same namespace and geometry finds every committed block, bit-exact, oldest-written first for
  eviction; a duplicate older copy of a key is ignored;
- another namespace or another fragment geometry finds none of them and never returns their bytes;
  another block size or capacity never returns foreign bytes either;
- a larger capacity at reopen keeps every block, a smaller one the blocks in the slots that remain (the
  file is cut, a warning counts what was dropped); another block size, codec or slot size discards the
  cache with a warning that names the change;
- the directory lock (a flock on the slab file): a second open, in this process or another, fails with a
  DiskTierError naming the directory and the holder's pid, and the first holder keeps working;
- counters (committed, demoted, evicted, hits, bytes, read_errors, damaged) count what happened;
- write-through copies every block to disk, write-back only what is pushed out of the host tier;
- a full disk tier evicts its least recently used blocks, a disk watermark brings usage to the low mark;
- a block that fails its checksum is reported failed, counted in ``read_errors`` and dropped, so the
  next lookup misses it; the slot is reused cleanly afterwards;
- the index, the allocator and the policy stay consistent and nothing leaks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from helpers.disk_helpers import BLOCK, CHILD_OPEN, KEYS, assert_exact, config_dict, data, get, open_stack, put
from helpers.stack_helpers import assert_no_leaks, flip, ready
from kvtier.api import KVTier
from kvtier.builder import build_stack, config_layout
from kvtier.core.config import load_config
from kvtier.core.errors import ConfigError
from kvtier.core.layout import BlockLayout
from kvtier.core.storage import buffer_storage
from kvtier.core.tier import BlockState
from kvtier.tiers.disk.files import SLAB_NAME, DiskTierError
from kvtier.tiers.disk.inspect import inspect_slab
from kvtier.tiers.disk.slab import DiskSlab
from kvtier.tiers.disk.slots import PAGE

# --- round trips --------------------------------------------------------------------------------


def test_round_trip_host_disk_host_is_bit_exact(tmp_path):
    stack = open_stack(tmp_path, host=4, disk=32)
    host, disk = stack.tiers
    keys = KEYS[:20]
    results = put(stack, keys)
    assert [(r.stored, r.failed, r.dropped) for r in results] == [(4, [], 0)] * 5
    stack.wait_idle()
    assert ready(disk, keys) == keys[:16] and ready(host, keys) == keys[16:]
    found = stack.lookup(keys)
    assert found.hits == 20 and found.tiers == ("disk",) * 16 + ("host",) * 4
    loaded, out = get(stack, keys)
    assert (loaded.hits, loaded.loaded, loaded.failed, loaded.per_tier) == (20, 20, [], {"disk": 16, "host": 4})
    assert_exact(keys, loaded, out)
    assert_no_leaks(stack)
    stack.close()


def test_close_flushes_memory_blocks_and_reopen_finds_every_block(tmp_path):
    stack = open_stack(tmp_path, host=4, disk=32)
    keys = KEYS[:10]
    put(stack, keys)
    stack.close()
    for _ in range(2):  # twice: a reopen that stores nothing keeps everything too
        stack = open_stack(tmp_path, host=4, disk=32)
        host, disk = stack.tiers
        assert host.usage().used == 0 and disk.usage().used == 10
        assert "10 blocks recovered" in repr(disk)
        found = stack.lookup(keys)
        assert found.hits == 10 and set(found.tiers) == {"disk"}
        loaded, out = get(stack, keys)
        assert (loaded.loaded, loaded.failed) == (10, [])
        assert_exact(keys, loaded, out)
        assert disk.stats.damaged == 0 and disk.stats.read_errors == 0
        assert_no_leaks(stack)
        stack.close()


def test_reopen_repeatedly_while_storing_more_each_time(tmp_path):
    stored: list[bytes] = []
    for round_ in range(4):
        stack = open_stack(tmp_path, host=4, disk=48)
        disk = stack.tiers[1]
        assert disk.usage().used == len(stored)
        assert ready(disk, stored) == stored
        new = KEYS[round_ * 10 : round_ * 10 + 10]
        put(stack, new)
        stored += new
        loaded, out = get(stack, stored)
        assert loaded.loaded == len(stored) and not loaded.failed
        assert_exact(stored, loaded, out)
        assert_no_leaks(stack)
        stack.close()


def test_reopen_keeps_write_order_for_eviction(tmp_path):
    stack = open_stack(tmp_path, host=0, disk=8)  # a disk-only stack: stores go straight to disk
    put(stack, KEYS[:8], batch=2)
    stack.close()
    stack = open_stack(tmp_path, host=0, disk=8)
    (disk,) = stack.tiers
    assert disk.usage().used == 8
    put(stack, KEYS[8:11])  # a full tier: the three oldest written go
    assert ready(disk, KEYS[:11]) == KEYS[3:11]
    assert disk.stats.evicted == 3
    loaded, out = get(stack, KEYS[3:11])
    assert loaded.loaded == 8
    assert_exact(KEYS[3:11], loaded, out)
    stack.close()


def test_an_older_copy_of_a_key_is_ignored_at_reopen(tmp_path):
    a, b, c, d = KEYS[:4]
    stack = open_stack(tmp_path, host=0, disk=4)
    (disk,) = stack.tiers
    put(stack, [a, b, c, d], batch=1)
    (slot_a,) = disk.slots([a])
    disk.evict(2)  # a, b leave the index; their headers stay on disk until the slots are reused
    assert disk.state(a) is BlockState.FREE
    put(stack, [a])
    (new_slot_a,) = disk.slots([a])
    assert new_slot_a != slot_a, "the premise: a lands in another slot than its old copy"
    stack.close()
    info = inspect_slab(tmp_path)
    assert info["blocks"] == 4, "the old copy of a is still a valid header"
    stack = open_stack(tmp_path, host=0, disk=4)
    (disk,) = stack.tiers
    assert ready(disk, [a, b, c, d]) == [a, c, d] and disk.usage().used == 3
    assert disk.slots([a]) == [new_slot_a], "the newer copy wins"
    disk.check_invariants()
    put(stack, KEYS[10:12])  # one free slot (the old copy's), then an eviction
    assert disk.usage().used == 4
    keys = ready(disk, KEYS[:12])
    loaded, out = get(stack, keys)
    assert loaded.loaded == len(keys)
    assert_exact(keys, loaded, out)
    assert_no_leaks(stack)
    stack.close()
    stack = open_stack(tmp_path, host=0, disk=4)
    assert ready(stack.tiers[0], KEYS[:12]) == keys
    stack.close()


def test_kvtier_api_round_trip_with_token_ids_and_reopen(tmp_path):
    cfg = config_dict(tmp_path, host=4, disk=32)
    cfg["block_tokens"] = 8
    tokens = list(range(1000, 1000 + 8 * 12))
    rng = np.random.default_rng(7)
    blocks = rng.standard_normal((12, 4, BLOCK // 8)).astype(np.float16)  # 16 KiB blocks of float16
    with KVTier.open(cfg) as kv:
        keys = kv.keys(tokens)
        assert len(keys) == 12
        for i in range(0, 12, 4):
            result = kv.store(keys[i : i + 4], blocks[i : i + 4]).result(timeout=30)
            assert result.stored == 4 and not result.failed
        assert kv.lookup(tokens) == 12
    with KVTier.open(cfg) as kv:
        found = kv.locate(tokens)
        assert found.hits == 12 and set(found.tiers) == {"disk"}
        out = np.zeros_like(blocks)
        loaded = kv.load(tokens, out).result(timeout=30)
        assert loaded.loaded == 12 and loaded.ok
        assert np.array_equal(out.view(np.uint8), blocks.view(np.uint8))

        async def roundtrip():
            more = list(range(5000, 5000 + 8 * 2))
            two = blocks[:2].copy()
            stored = await kv.astore(more, two)
            back = np.zeros_like(two)
            got = await kv.aload(more, back)
            return stored, got, two, back

        stored, got, two, back = asyncio.run(roundtrip())
        assert stored.stored == 2 and got.loaded == 2
        assert np.array_equal(back.view(np.uint8), two.view(np.uint8))


@pytest.mark.parametrize("o_direct", ["off", "auto", "on"])
def test_o_direct_modes_round_trip_and_read_each_others_files(tmp_path, o_direct):
    try:
        stack = open_stack(tmp_path, o_direct=o_direct)
    except DiskTierError as exc:  # "on" where the filesystem refuses O_DIRECT must say so
        assert o_direct == "on" and "O_DIRECT" in str(exc) and str(tmp_path) in str(exc)
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    disk = stack.tiers[1]
    slab = disk.storage.slab
    if o_direct == "off":
        assert not slab.o_direct and "buffered I/O" in repr(disk)
    if o_direct == "on":
        assert slab.o_direct and "O_DIRECT" in repr(disk)
    put(stack, KEYS[:12])
    loaded, out = get(stack, KEYS[:12])
    assert loaded.loaded == 12
    assert_exact(KEYS[:12], loaded, out)
    stack.close()
    for other in ("off", "auto"):  # what one mode wrote, the other reads
        stack = open_stack(tmp_path, o_direct=other)
        loaded, out = get(stack, KEYS[:12])
        assert loaded.loaded == 12 and loaded.per_tier == {"disk": 12}
        assert_exact(KEYS[:12], loaded, out)
        stack.close()


@pytest.mark.parametrize("o_direct", ["off", "auto"])
@pytest.mark.parametrize("block_bytes,fragments", [(BLOCK, 4), (5000, 2), (4096 * 3 + 12, 1)])
@pytest.mark.parametrize("host", [0, 3])
def test_unaligned_memory_and_odd_block_sizes(tmp_path, o_direct, block_bytes, fragments, host):
    """Caller buffers off the page boundary and blocks that are not whole pages take the bounce path."""
    layout = BlockLayout((block_bytes // fragments,) * fragments)
    stack = open_stack(tmp_path, host=host, disk=12, block_bytes=block_bytes, fragments=fragments, o_direct=o_direct)
    keys = KEYS[:9]
    for i in range(0, 9, 3):
        raw = np.zeros(3 * block_bytes + 1, np.uint8)
        src = raw[1:].reshape(3, block_bytes)  # one byte off: never page-aligned
        src[:] = np.stack([data(k, b"", block_bytes) for k in keys[i : i + 3]])
        result = stack.store(keys[i : i + 3], buffer_storage(src, layout), range(3)).result(timeout=30)
        assert result.stored == 3 and not result.failed
    stack.close()
    stack = open_stack(tmp_path, host=host, disk=12, block_bytes=block_bytes, fragments=fragments, o_direct=o_direct)
    assert stack.tiers[-1].usage().used == 9
    raw = np.zeros(9 * block_bytes + 3, np.uint8)
    out = raw[3:].reshape(9, block_bytes)
    loaded, out = get(stack, keys, layout=layout, out=out)
    assert loaded.loaded == 9 and not loaded.failed
    assert_exact(keys, loaded, out, nbytes=block_bytes)
    assert_no_leaks(stack)
    stack.close()


def test_load_staged_from_disk_through_host_to_the_gpu_tier(tmp_path):
    stack = open_stack(tmp_path, gpu=4, host=4, disk=32)
    gpu, host, disk = stack.tiers
    keys = KEYS[:16]
    put(stack, keys)
    stack.wait_idle()
    assert ready(disk, keys) == keys[:8] and ready(host, keys) == keys[8:12] and ready(gpu, keys) == keys[12:]
    loaded, out = get(stack, keys[:4], dst_medium="gpu")  # disk -> host -> destination
    assert loaded.loaded == 4 and loaded.per_tier == {"disk": 4}
    assert_exact(keys[:4], loaded, out)
    assert ready(host, keys[:4]) == keys[:4], "staged blocks are cached in the host tier"
    assert_no_leaks(stack)
    stack.close()


# --- persistence across namespaces and geometry ---------------------------------------------------


def test_another_namespace_finds_nothing_and_never_returns_foreign_bytes(tmp_path):
    keys = KEYS[:6]
    stack = open_stack(tmp_path, namespace="model-a")
    put(stack, keys, salt=b"a")
    stack.close()

    stack = open_stack(tmp_path, namespace="model-b")  # the same keys, other bytes
    disk = stack.tiers[1]
    assert disk.usage().used == 0 and stack.lookup(keys).hits == 0
    loaded, out = get(stack, keys)
    assert loaded.hits == 0 and not out.any()
    put(stack, keys[:2], salt=b"b")
    stack.close()  # b's two blocks reuse two of a's slots

    stack = open_stack(tmp_path, namespace="model-a")
    disk = stack.tiers[1]
    survivors = ready(disk, keys)
    assert len(survivors) == 4 and disk.usage().used == 4
    loaded, out = get(stack, survivors)
    assert loaded.loaded == 4
    assert_exact(survivors, loaded, out, salt=b"a")
    stack.close()

    stack = open_stack(tmp_path, namespace="model-b")
    assert ready(stack.tiers[1], keys) == keys[:2] and stack.tiers[1].usage().used == 2
    loaded, out = get(stack, keys[:2])
    assert loaded.loaded == 2
    assert_exact(keys[:2], loaded, out, salt=b"b")
    stack.close()


def test_another_fragment_geometry_finds_nothing(tmp_path):
    keys = KEYS[:6]
    stack = open_stack(tmp_path, fragments=4)
    put(stack, keys)
    stack.close()
    stack = open_stack(tmp_path, fragments=2)  # same block size, other fragments: other bytes per key
    assert stack.tiers[1].usage().used == 0 and stack.lookup(keys).hits == 0
    stack.close()
    stack = open_stack(tmp_path, fragments=4)  # nothing was overwritten: all still there
    loaded, out = get(stack, keys)
    assert loaded.loaded == 6
    assert_exact(keys, loaded, out)
    stack.close()


@pytest.mark.parametrize("change", [{"block_bytes": BLOCK // 2}, {"disk": 20}])
def test_another_block_size_or_capacity_never_returns_foreign_bytes(tmp_path, change):
    keys = KEYS[:6]
    stack = open_stack(tmp_path)
    put(stack, keys)
    stack.close()
    stack = open_stack(tmp_path, **change)
    disk = stack.tiers[1]
    disk.check_invariants()
    layout = config_layout(load_config(config_dict(tmp_path, **change)))
    found = ready(disk, keys)
    if "block_bytes" in change:
        assert found == [], "blocks of another size are never found"
    loaded, out = get(stack, found, layout=layout)
    assert loaded.loaded == len(found)
    assert_exact(found, loaded, out, nbytes=layout.block_bytes)
    put(stack, KEYS[20:24], layout=layout)
    stack.close()
    stack = open_stack(tmp_path, **change)
    loaded, out = get(stack, KEYS[20:24], layout=layout)
    assert loaded.loaded == 4
    assert_exact(KEYS[20:24], loaded, out, nbytes=layout.block_bytes)
    stack.close()


def test_a_larger_capacity_at_reopen_keeps_every_block(tmp_path, caplog):
    stack = open_stack(tmp_path, host=0, disk=8)
    put(stack, KEYS[:8])
    stack.close()
    with caplog.at_level(logging.INFO, logger="kvtier.tiers.disk"):
        stack = open_stack(tmp_path, host=0, disk=24)
    assert "capacity grew from 8 to 24 slots; keeping every block" in caplog.text
    slab = os.stat(tmp_path / SLAB_NAME)  # the grown file is reserved whole again (a reopen at the same size skips it)
    assert slab.st_blocks * 512 >= slab.st_size == PAGE + 24 * (PAGE + BLOCK)
    (disk,) = stack.tiers
    assert ready(disk, KEYS) == KEYS[:8] and disk.stats.damaged == 0
    put(stack, KEYS[8:24])  # the new slots take sixteen more without evicting
    assert disk.usage().used == 24 and disk.stats.evicted == 0
    assert_no_leaks(stack)
    stack.close()
    assert inspect_slab(tmp_path)["slots"] == 24
    stack = open_stack(tmp_path, host=0, disk=24)
    assert ready(stack.tiers[0], KEYS) == KEYS[:24]
    loaded, out = get(stack, KEYS[:24])
    assert loaded.loaded == 24 and not loaded.failed
    assert_exact(KEYS[:24], loaded, out)
    stack.close()


def test_a_smaller_capacity_at_reopen_keeps_the_blocks_in_the_remaining_slots(tmp_path, caplog):
    stack = open_stack(tmp_path, host=0, disk=8)
    put(stack, KEYS[:8])
    slot_of = dict(zip(KEYS[:8], stack.tiers[0].slots(KEYS[:8]), strict=True))
    stride = stack.tiers[0].storage.slab.slot_stride
    stack.close()
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"):
        stack = open_stack(tmp_path, host=0, disk=5)
    assert "capacity shrank from 8 to 5 slots; dropping the 3 block(s) stored past the new end" in caplog.text
    (disk,) = stack.tiers
    kept = [k for k in KEYS[:8] if slot_of[k] < 5]
    assert len(kept) == 5 and ready(disk, KEYS) == kept and disk.stats.damaged == 0
    assert os.path.getsize(tmp_path / SLAB_NAME) == PAGE + 5 * stride
    loaded, out = get(stack, kept)
    assert loaded.loaded == 5 and not loaded.failed
    assert_exact(kept, loaded, out)
    put(stack, KEYS[10:12])  # a full tier of five: evicts two
    assert disk.usage().used == 5 and disk.stats.evicted == 2
    assert_no_leaks(stack)
    survivors = ready(disk, KEYS)
    stack.close()
    stack = open_stack(tmp_path, host=0, disk=5)
    assert ready(stack.tiers[0], KEYS) == survivors
    loaded, out = get(stack, survivors)
    assert loaded.loaded == 5 and not loaded.failed
    assert_exact(survivors, loaded, out)
    stack.close()


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"block_bytes": BLOCK // 2}, f"the block size changed from {BLOCK} to {BLOCK // 2} bytes"),
        ({"compression": "zstd"}, "compression changed from none to zstd"),
        ({"compression": "zstd", "slot_bytes": 8192}, "slot size changed from 12288 to 8192 bytes (slot_bytes)"),
    ],
)
def test_a_geometry_change_at_reopen_discards_the_cache_and_says_why(tmp_path, caplog, change, reason):
    def config(block_bytes=BLOCK, **disk):
        cfg = config_dict(tmp_path, host=0, disk=8, block_bytes=block_bytes)
        cfg["tiers"][-1].update(disk)
        return load_config(cfg)

    before = {"compression": "zstd"} if "slot_bytes" in change else {}  # zstd's default slot, then 8 KiB
    stack = build_stack(config(**before))
    put(stack, KEYS[:4])
    stack.close()
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"):
        stack = build_stack(config(**change))
    assert f"{reason}; discarding the old cache" in caplog.text
    assert ready(stack.tiers[0], KEYS) == [] and stack.tiers[0].stats.damaged == 0
    stack.close()


# --- the directory lock -----------------------------------------------------------------------------


def test_a_second_open_in_this_process_fails_and_names_the_directory(tmp_path):
    stack = open_stack(tmp_path)
    put(stack, KEYS[:6])
    with pytest.raises(DiskTierError) as err:
        open_stack(tmp_path)
    message = str(err.value)
    assert str(tmp_path) in message and "in use" in message and f"pid {os.getpid()}" in message
    # the refused open took nothing away from the holder
    loaded, out = get(stack, KEYS[:6])
    assert loaded.loaded == 6
    assert_exact(KEYS[:6], loaded, out)
    assert inspect_slab(tmp_path)["lock_holder"] == f"pid {os.getpid()}"
    stack.close()
    assert inspect_slab(tmp_path)["lock_holder"] is None
    stack = open_stack(tmp_path)  # free again after close
    assert stack.lookup(KEYS[:6]).hits == 6
    stack.close()


def test_a_second_process_cannot_open_a_directory_this_process_holds(tmp_path):
    stack = open_stack(tmp_path)
    child = subprocess.run(
        [sys.executable, "-c", CHILD_OPEN, json.dumps(config_dict(tmp_path))],
        input="",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == 3, child.stderr
    assert child.stdout.startswith("REFUSED") and str(tmp_path) in child.stdout
    assert f"pid {os.getpid()}" in child.stdout and "cannot share one directory" in child.stdout
    put(stack, KEYS[:4])
    stack.close()


def test_this_process_cannot_open_a_directory_another_process_holds(tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD_OPEN, json.dumps(config_dict(tmp_path))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "OPENED", child.stderr.read()
        with pytest.raises(DiskTierError) as err:
            open_stack(tmp_path)
        assert str(tmp_path) in str(err.value) and f"pid {child.pid}" in str(err.value)
        assert inspect_slab(tmp_path)["lock_holder"] == f"pid {child.pid}"
    finally:
        child.stdin.close()
        assert child.wait(timeout=60) == 0, child.stderr.read()
        child.stdout.close()
        child.stderr.close()
    stack = open_stack(tmp_path)  # released when the other process closed its stack
    stack.close()


def test_a_tier_that_cannot_open_leaves_nothing_open(tmp_path):
    holder = open_stack(tmp_path)
    descriptors = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with pytest.raises(DiskTierError):
            open_stack(tmp_path)
    assert len(os.listdir("/proc/self/fd")) == descriptors, "a refused open leaked a file descriptor"
    holder.close()
    stack = open_stack(tmp_path)
    stack.close()
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(DiskTierError, match="cannot be created"):
        open_stack(tmp_path / "file" / "sub")


# --- placement, eviction, watermarks, counters ----------------------------------------------------


def test_counters_count_what_happened(tmp_path):
    stack = open_stack(tmp_path, host=4, disk=16)
    host, disk = stack.tiers
    put(stack, KEYS[:12])
    stack.wait_idle()
    assert (host.stats.committed, host.stats.demoted, host.stats.evicted) == (12, 8, 8)
    assert host.stats.bytes_out == 8 * BLOCK
    assert (disk.stats.committed, disk.stats.bytes_in, disk.stats.aborted, disk.stats.evicted) == (8, 8 * BLOCK, 0, 0)
    loaded, _ = get(stack, KEYS[:12])
    assert loaded.per_tier == {"disk": 8, "host": 4}
    assert (disk.stats.hits, disk.stats.bytes_out, disk.stats.read_errors) == (8, 8 * BLOCK, 0)
    assert host.stats.hits == 4
    stats = stack.stats()["disk"]
    assert (stats["used"], stats["capacity"], stats["committed"], stats["damaged"]) == (8, 16, 8, 0)
    stack.close()
    stack = open_stack(tmp_path, host=4, disk=16)
    disk = stack.tiers[1]
    assert disk.usage().used == 12 and disk.stats.committed == 0 and disk.stats.damaged == 0
    stack.close()


@pytest.mark.parametrize("placement", ["write_through", "write_back"])
def test_write_through_copies_everything_down_write_back_only_what_is_pushed_out(tmp_path, placement):
    stack = open_stack(tmp_path, host=4, disk=32, placement=placement)
    host, disk = stack.tiers
    keys = KEYS[:12]
    for i in range(0, 12, 4):
        put(stack, keys[i : i + 4])
        stack.wait_idle()
    assert ready(host, keys) == keys[8:]
    if placement == "write_through":
        assert ready(disk, keys) == keys and disk.stats.committed == 12
        assert host.stats.demoted == 0 and host.stats.evicted == 8
    else:
        assert ready(disk, keys) == keys[:8] and disk.stats.committed == 8
        assert host.stats.demoted == 8
    loaded, out = get(stack, keys)
    assert loaded.loaded == 12
    assert_exact(keys, loaded, out)
    assert_no_leaks(stack)
    stack.close()
    stack = open_stack(tmp_path, host=4, disk=32, placement=placement)
    assert ready(stack.tiers[1], keys) == keys and stack.tiers[1].usage().used == 12
    stack.close()


def test_a_full_disk_tier_evicts_its_least_recently_used_blocks(tmp_path):
    stack = open_stack(tmp_path, host=4, disk=8)
    host, disk = stack.tiers
    keys = KEYS[:20]
    put(stack, keys)
    stack.wait_idle()
    assert ready(host, keys) == keys[16:] and ready(disk, keys) == keys[8:16]
    assert disk.stats.evicted == 8 and disk.usage().used == 8
    assert stack.lookup(keys).hits == 0 and stack.lookup(keys[8:]).hits == 12
    loaded, out = get(stack, keys[8:])
    assert loaded.loaded == 12
    assert_exact(keys[8:], loaded, out)
    assert_no_leaks(stack)
    stack.close()  # the host's four go down, pushing out the four oldest on disk
    stack = open_stack(tmp_path, host=4, disk=8)
    disk = stack.tiers[1]
    assert ready(disk, keys) == keys[12:] and disk.usage().used == 8
    loaded, out = get(stack, keys[12:])
    assert loaded.loaded == 8
    assert_exact(keys[12:], loaded, out)
    stack.close()


def test_a_disk_watermark_evicts_down_to_the_low_mark(tmp_path):
    stack = open_stack(tmp_path, host=4, disk=16, disk_watermark=(0.75, 0.5))
    host, disk = stack.tiers
    keys = KEYS[:24]
    put(stack, keys)
    stack.wait_idle()
    assert disk.usage().used <= 12 and disk.excess() == 0
    assert disk.stats.evicted >= 8
    assert ready(host, keys) == keys[20:]
    present = ready(disk, keys)
    assert present == keys[20 - len(present) : 20], "the newest demoted blocks stay"
    loaded, out = get(stack, present)
    assert loaded.loaded == len(present)
    assert_exact(present, loaded, out)
    assert_no_leaks(stack)
    stack.close()


# --- checksums --------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_failed_checksum_discards_the_block_and_the_next_lookup_misses(tmp_path, where):
    stack = open_stack(tmp_path, host=4, disk=16)
    host, disk = stack.tiers
    keys = KEYS[:12]
    put(stack, keys)
    stack.wait_idle()
    victim = 3
    assert disk.state(keys[victim]) is BlockState.READY
    slab = disk.storage.slab
    offset = slab.slot_offset(disk.slots([keys[victim]])[0]) + PAGE
    offset += {"first": 0, "middle": BLOCK // 2, "last": BLOCK - 1}[where]
    flip(tmp_path / SLAB_NAME, offset)

    loaded, out = get(stack, keys)
    assert loaded.hits == 12 and loaded.failed == [victim] and loaded.loaded == 11
    assert_exact(keys, loaded, out)
    assert disk.stats.read_errors == 1 and disk.state(keys[victim]) is BlockState.FREE
    assert stack.lookup(keys).hits == victim and stack.lookup(keys[victim : victim + 1]).hits == 0
    again, out = get(stack, keys)
    assert again.hits == victim and again.failed == []
    assert not out[victim:].any(), "nothing past the miss is written"
    disk.check_invariants()

    put(stack, [keys[victim]])  # stored again: lands cleanly, and its new copy reads back
    stack.wait_idle()
    put(stack, KEYS[30:34])  # pushes it down to disk
    stack.wait_idle()
    assert disk.state(keys[victim]) is BlockState.READY
    loaded, out = get(stack, keys)
    assert loaded.loaded == 12 and not loaded.failed
    assert_exact(keys, loaded, out)
    assert_no_leaks(stack)
    stack.close()
    stack = open_stack(tmp_path, host=4, disk=16)
    loaded, out = get(stack, keys)
    assert loaded.loaded == 12 and not loaded.failed
    assert_exact(keys, loaded, out)
    stack.close()


# --- concurrency --------------------------------------------------------------------------------------


@pytest.mark.parametrize("host", [8, 0])
def test_concurrent_stores_and_loads_over_disk_stay_bit_exact(tmp_path, host):
    stack = open_stack(tmp_path, host=host, disk=24)
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(30):
                start = int(rng.integers(0, 50))
                keys = KEYS[start : start + int(rng.integers(1, 6))]
                if rng.random() < 0.5:
                    for r in put(stack, keys):
                        assert not r.failed
                else:
                    loaded, out = get(stack, keys)
                    assert not loaded.failed
                    assert_exact(keys, loaded, out)
        except Exception as exc:  # reported to the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    assert_no_leaks(stack)
    stack.close()
    stack = open_stack(tmp_path, host=host, disk=24)
    disk = stack.tiers[-1]
    present = ready(disk, KEYS)
    assert disk.usage().used == len(present) > 0
    loaded, out = get(stack, present)
    assert loaded.loaded == len(present)
    assert_exact(present, loaded, out)
    stack.close()


def test_a_slab_refuses_an_unknown_o_direct_mode_before_it_touches_the_directory(tmp_path):
    """Every way to a slab (a stack, the vLLM worker, a bench) passes through DiskSlab: it checks the mode."""
    with pytest.raises(ConfigError, match="o_direct must be auto, on or off, got 'sometimes'"):
        DiskSlab(tmp_path / "disk", 4, BlockLayout((BLOCK,)), "ns", "sometimes")
    assert not (tmp_path / "disk").exists()
