"""A damaged slab file never returns wrong bytes: every damaged block is a miss or a failed load.

The slab is ``<dir>/slab.kvt``: a 4 KiB file header, then slots of ``slot_stride`` bytes, each a
4 KiB slot header followed by the block's bytes. These tests write blocks through a real stack,
close it, damage the file with plain file I/O (flipped bytes, truncation, garbage, forged headers),
reopen, and load everything the tier finds.

Invariants checked:
- a flipped byte anywhere in a block's data: the block is reported in ``LoadResult.failed`` (never
  returned), counted in ``read_errors``, dropped, and the next lookup misses it; its slot header is
  zeroed, so a restart does not find it again;
- a flipped byte in the checksummed part of a slot header: the block is a miss at reopen, its slot is
  free, and ``tier.stats.damaged`` (and ``inspect_slab``) count exactly one damaged header; bytes of
  the header page past the checksummed part do not matter;
- forged headers (a header copied onto another slot's bytes, a newer copy, a wrong length) never
  make one key return another key's bytes;
- a damaged file header discards the whole cache (geometry unknown): nothing is found, the file is
  rebuilt and works; a damaged magic makes the file no kvtier slab: it is refused, left byte for byte
  as it was, and rebuilt only with ``reinitialise: true``;
- a slot torn between two stores (new header over old bytes, old header over new bytes, half a
  block: what a power loss can leave, since a store never syncs) is a failed load, then a miss;
- a truncated slab keeps the blocks wholly before the cut, bit-exact, finds nothing after it, and a
  block cut in half is a failed load, never partial bytes;
- garbage over slots makes them damaged and free; they are reused cleanly afterwards;
- after every kind of damage the index, the allocator and the policy stay consistent, the tier takes
  new blocks, and they survive the next reopen: from the clean close's index snapshot, and by a scan
  (the snapshot removed, as after a crash), which alone counts the damaged headers left.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import numpy as np
import pytest
import xxhash

from helpers.stack_helpers import assert_no_leaks, content, flip, key, ready
from kvtier.builder import build_stack
from kvtier.core.config import load_config
from kvtier.core.layout import BlockLayout
from kvtier.core.storage import buffer_storage
from kvtier.core.tier import BlockState
from kvtier.tiers.disk.files import SLAB_NAME, SNAPSHOT_NAME, DiskTierError
from kvtier.tiers.disk.format import SlotHeader
from kvtier.tiers.disk.inspect import inspect_slab
from kvtier.tiers.disk.slots import PAGE

BLOCK = 16 * 1024
LAYOUT = BlockLayout((BLOCK // 4,) * 4)
KEYS = [key(i) for i in range(32)]
N = 6  # blocks written before the damage, into slots 0..N-1
CAPACITY = 8
HEADER_BYTES = 131  # the checksummed part of a slot header: fields (123 bytes) and their checksum (8)
FILE_HEADER_BYTES = 45  # the compared part of the file header: fields (37 bytes) and their checksum (8)


def open_stack(path, host=0, disk=CAPACITY, reinitialise=False):
    tiers = ([{"medium": "host", "capacity_blocks": host}] if host else []) + [
        {"medium": "disk", "path": str(path), "capacity_blocks": disk, "reinitialise": reinitialise}
    ]
    return build_stack(load_config({"block_bytes": BLOCK, "fragments": 4, "namespace": "corrupt", "tiers": tiers}))


def put(stack, keys):
    blocks = np.stack([content(k, BLOCK) for k in keys])
    result = stack.store(keys, buffer_storage(blocks, LAYOUT), range(len(keys))).result(timeout=30)
    assert result.stored == len(keys) and not result.failed
    return result


def get(stack, keys):
    out = np.zeros((len(keys), BLOCK), np.uint8)
    result = stack.load(keys, buffer_storage(out, LAYOUT, writable=True), range(len(keys))).result(timeout=30)
    return result, out


@dataclasses.dataclass
class Slab:
    """A slab file written with N blocks: where each block's slot, header and data lie."""

    path: os.PathLike
    file: os.PathLike
    stride: int
    file_bytes: int
    slot_of: dict[bytes, int]

    def header_at(self, k: bytes) -> int:
        return PAGE + self.slot_of[k] * self.stride

    def data_at(self, k: bytes) -> int:
        return self.header_at(k) + PAGE


@pytest.fixture
def slab(tmp_path) -> Slab:
    stack = open_stack(tmp_path)
    (disk,) = stack.tiers
    put(stack, KEYS[:N])
    slot_of = dict(zip(KEYS[:N], disk.slots(KEYS[:N]), strict=True))
    assert sorted(slot_of.values()) == list(range(N))
    s = disk.storage.slab
    info = Slab(tmp_path, tmp_path / SLAB_NAME, s.slot_stride, s.file_bytes, slot_of)
    stack.close()
    return info


def write_at(path, offset: int, raw: bytes) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, raw, offset)
    finally:
        os.close(fd)


def read_at(path, offset: int, n: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, n, offset)
    finally:
        os.close(fd)


def load_everything(stack, keys=KEYS):
    """Load every block the disk tier finds among ``keys``: each is bit-exact or reported failed, and a
    failed one is dropped (the next lookup misses it). Returns (found, failed keys)."""
    disk = stack.tiers[-1]
    found = ready(disk, keys)
    loaded, out = get(stack, found)
    assert loaded.hits == len(found)
    for i, k in enumerate(found):
        if i not in loaded.failed:
            assert np.array_equal(out[i], content(k, BLOCK)), "a block came back with wrong bytes"
    bad = [found[i] for i in loaded.failed]
    assert all(disk.state(k) is BlockState.FREE and stack.lookup([k]).hits == 0 for k in bad)
    assert disk.stats.read_errors == len(bad)
    disk.check_invariants()
    assert disk.usage().used == len(found) - len(bad)
    return found, bad


def still_works(path, stack, damaged_left=0):
    """The damaged tier takes new blocks, and they (with what survived) come back after a reopen: from
    the index snapshot of the clean close, and again by a scan (the snapshot removed, as after a
    crash), which finds the ``damaged_left`` damaged headers that remain (slots not reused since)."""
    put(stack, KEYS[20:23])
    survivors = ready(stack.tiers[-1], KEYS)
    assert set(KEYS[20:23]) <= set(survivors)
    assert_no_leaks(stack)
    stack.close()
    for source, damaged in (("index snapshot", 0), ("scan", damaged_left)):
        if source == "scan":
            os.unlink(os.path.join(path, SNAPSHOT_NAME))
        stack = open_stack(path)
        disk = stack.tiers[-1]
        assert f"recovered ({source})" in disk.note
        assert ready(disk, KEYS) == survivors and disk.stats.damaged == damaged
        found, bad = load_everything(stack)
        assert bad == []
        stack.close()


# --- block data -------------------------------------------------------------------------------------


def test_a_block_dropped_after_a_failed_load_is_not_found_again_after_a_restart(slab):
    victim = KEYS[2]
    flip(slab.file, slab.data_at(victim) + 7)
    stack = open_stack(slab.path)
    loaded, _ = get(stack, KEYS[:N])
    assert loaded.failed == [2]
    assert_no_leaks(stack)
    stack.close()  # nothing stored since: the victim's slot was not reused
    assert read_at(slab.file, slab.header_at(victim), PAGE) == bytes(PAGE), "its slot header is zeroed"
    info = inspect_slab(slab.path)
    assert (info["blocks"], info["damaged_headers"]) == (N - 1, 0)
    stack = open_stack(slab.path)
    assert ready(stack.tiers[0], KEYS) == [k for k in KEYS[:N] if k != victim]
    assert stack.tiers[0].stats.damaged == 0
    found, bad = load_everything(stack)
    assert bad == []
    stack.close()


@pytest.mark.parametrize("where", [0, 1, BLOCK // 2, BLOCK - 1])
def test_a_flipped_data_byte_is_a_failed_load_then_a_miss(slab, where):
    victim = KEYS[2]
    flip(slab.file, slab.data_at(victim) + where, mask=0x01)  # a single bit
    stack = open_stack(slab.path)
    assert stack.tiers[0].stats.damaged == 0  # headers are fine; the data is checked on read
    loaded, out = get(stack, KEYS[:N])
    assert (loaded.hits, loaded.loaded, loaded.failed) == (N, N - 1, [2])
    for i in (0, 1, 3, 4, 5):
        assert np.array_equal(out[i], content(KEYS[i], BLOCK))
    assert stack.tiers[0].stats.read_errors == 1
    assert stack.lookup(KEYS[:N]).hits == 2 and stack.tiers[0].state(victim) is BlockState.FREE
    still_works(slab.path, stack)


def test_every_block_with_damaged_data_is_reported_and_none_returned(slab):
    rng = np.random.default_rng(1)
    damaged = KEYS[1:N:2]
    for k in damaged:
        for offset in rng.integers(0, BLOCK, 3):
            flip(slab.file, slab.data_at(k) + int(offset))
    stack = open_stack(slab.path)
    found, bad = load_everything(stack, KEYS[:N])
    assert found == KEYS[:N] and bad == damaged
    still_works(slab.path, stack)


# --- slot headers -----------------------------------------------------------------------------------


def test_a_flipped_byte_anywhere_in_a_slot_header_is_a_miss_counted_as_damaged(slab):
    victim = KEYS[3]
    at = slab.header_at(victim)
    for offset in range(HEADER_BYTES):
        flip(slab.file, at + offset)
        stack = open_stack(slab.path)
        disk = stack.tiers[0]
        assert disk.stats.damaged == 1, f"byte {offset} of the slot header"
        assert disk.state(victim) is BlockState.FREE and disk.usage().used == N - 1
        stack.close()
        assert inspect_slab(slab.path)["damaged_headers"] == 1
        flip(slab.file, at + offset)  # undo
    stack = open_stack(slab.path)
    found, bad = load_everything(stack, KEYS[:N])
    assert found == KEYS[:N] and bad == [] and stack.tiers[0].stats.damaged == 0
    stack.close()


@pytest.mark.parametrize("offset", [HEADER_BYTES, 1000, PAGE - 1])
def test_bytes_past_the_checksummed_header_do_not_matter(slab, offset):
    flip(slab.file, slab.header_at(KEYS[0]) + offset)
    stack = open_stack(slab.path)
    found, bad = load_everything(stack, KEYS[:N])
    assert found == KEYS[:N] and bad == [] and stack.tiers[0].stats.damaged == 0
    stack.close()


def test_damaged_headers_of_a_reopened_tier_are_misses_and_their_slots_reused(slab):
    for k in KEYS[:N:2]:
        flip(slab.file, slab.header_at(k) + 40)  # inside the key
    stack = open_stack(slab.path)
    disk = stack.tiers[0]
    assert disk.stats.damaged == 3 and ready(disk, KEYS[:N]) == KEYS[1:N:2]
    found, bad = load_everything(stack, KEYS[:N])
    assert bad == []
    put(stack, KEYS[10:15])  # three damaged slots, two blank ones: all taken, no eviction
    assert disk.usage().used == CAPACITY and disk.stats.evicted == 0
    still_works(slab.path, stack)


def test_a_header_damaged_while_the_tier_is_open_fails_the_load(slab):
    stack = open_stack(slab.path)
    flip(slab.file, slab.header_at(KEYS[4]) + 60)  # inside the payload length
    loaded, out = get(stack, KEYS[:N])
    assert loaded.failed == [4] and loaded.loaded == N - 1
    assert stack.tiers[0].state(KEYS[4]) is BlockState.FREE
    stack.close()
    stack = open_stack(slab.path)
    # the failed load zeroed the damaged header: a blank slot now, not a damaged one
    assert stack.tiers[0].stats.damaged == 0 and stack.tiers[0].state(KEYS[4]) is BlockState.FREE
    assert read_at(slab.file, slab.header_at(KEYS[4]), PAGE) == bytes(PAGE)
    still_works(slab.path, stack)


@pytest.mark.parametrize("newer", [False, True])
def test_a_header_copied_onto_another_slot_never_returns_that_slots_bytes(slab, newer):
    """Slot of b gets a's header (a valid header, but not describing b's bytes)."""
    a, b = KEYS[1], KEYS[4]
    page = read_at(slab.file, slab.header_at(a), PAGE)
    if newer:  # and wins over a's own slot at reopen
        header = SlotHeader.unpack(page)
        page = dataclasses.replace(header, sequence=header.sequence + 100).pack()
    write_at(slab.file, slab.header_at(b), page)
    stack = open_stack(slab.path)
    disk = stack.tiers[0]
    assert disk.state(b) is BlockState.FREE and disk.state(a) is BlockState.READY
    assert disk.slots([a])[0] == slab.slot_of[b if newer else a]
    found, bad = load_everything(stack, KEYS[:N])
    assert bad == ([a] if newer else [])
    stack.close()
    inspect = inspect_slab(slab.path)
    # the forged header that failed its load was zeroed; a's own (older) header remains
    assert inspect["damaged_headers"] == 0 and inspect["blocks"] == N - newer
    # the clean close's index snapshot names what the tier held: not a, when the tier dropped it
    stack = open_stack(slab.path)
    assert stack.tiers[0].state(a) is (BlockState.FREE if newer else BlockState.READY)
    assert load_everything(stack, KEYS[:N])[1] == []
    stack.close()
    os.unlink(slab.path / SNAPSHOT_NAME)  # as after a crash: a scan finds a's own header again
    stack = open_stack(slab.path)
    assert stack.tiers[0].slots([a]) == [slab.slot_of[a]] and stack.tiers[0].state(b) is BlockState.FREE
    assert load_everything(stack, KEYS[:N])[1] == []
    stack.close()


@pytest.mark.parametrize("torn", ["new header over old bytes", "old header over new bytes", "half a block"])
def test_a_slot_torn_between_two_stores_is_a_miss(slab, torn):
    """What a power loss can leave of a slot that block b was being stored into over block a: the
    store writes header and bytes in one call and never syncs, so any part of it may be lost. The
    header's checksum of the bytes decides: the block the header names fails its load, never returns."""
    a, b = KEYS[2], KEYS[10]
    old = SlotHeader.unpack(read_at(slab.file, slab.header_at(a), PAGE))
    new = dataclasses.replace(
        old, key=b, checksum=xxhash.xxh3_64_intdigest(content(b, BLOCK).data), sequence=old.sequence + 1
    )
    if torn != "old header over new bytes":
        write_at(slab.file, slab.header_at(a), new.pack())
    new_bytes = content(b, BLOCK).tobytes()
    if torn != "new header over old bytes":
        write_at(slab.file, slab.data_at(a), new_bytes[: BLOCK // 2] if torn == "half a block" else new_bytes)
    named = a if torn == "old header over new bytes" else b
    stack = open_stack(slab.path)
    assert stack.tiers[0].state(named) is BlockState.READY
    found, bad = load_everything(stack, [*KEYS[:N], b])
    assert bad == [named] and len(found) == N
    still_works(slab.path, stack)


def test_a_valid_header_with_the_wrong_length_is_damaged(slab):
    victim = KEYS[5]
    header = SlotHeader.unpack(read_at(slab.file, slab.header_at(victim), PAGE))
    write_at(slab.file, slab.header_at(victim), dataclasses.replace(header, length=BLOCK // 2).pack())
    stack = open_stack(slab.path)
    disk = stack.tiers[0]
    assert disk.stats.damaged == 1 and disk.state(victim) is BlockState.FREE
    found, bad = load_everything(stack, KEYS[:N])
    assert found == KEYS[: N - 1] and bad == []
    still_works(slab.path, stack)


# --- the file header --------------------------------------------------------------------------------


def assert_discarded(slab, stack) -> None:
    disk = stack.tiers[0]
    assert disk.usage().used == 0 and ready(disk, KEYS) == [] and disk.stats.damaged == 0
    assert os.path.getsize(slab.file) == slab.file_bytes
    still_works(slab.path, stack)


@pytest.mark.parametrize("offset", [8, 12, 20, 28, 36, 37, 44])  # version, sizes, count, codec, checksum
def test_a_damaged_file_header_discards_the_cache(slab, offset, caplog):
    flip(slab.file, offset)
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"):
        stack = open_stack(slab.path)
    assert "discarding the old cache" in caplog.text
    assert_discarded(slab, stack)


@pytest.mark.parametrize("offset", [0, 7])  # first and last byte of the magic
def test_a_damaged_magic_is_kept_untouched_unless_reinitialise(slab, offset, caplog):
    flip(slab.file, offset)
    before = slab.file.read_bytes()
    with pytest.raises(DiskTierError) as err:
        open_stack(slab.path)
    assert str(slab.file) in str(err.value) and "reinitialise: true" in str(err.value)
    assert slab.file.read_bytes() == before
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"):
        stack = open_stack(slab.path, reinitialise=True)
    assert "not a kvtier slab; overwriting it" in caplog.text
    assert_discarded(slab, stack)


def test_bytes_past_the_file_header_fields_do_not_matter(slab):
    flip(slab.file, 2000)
    stack = open_stack(slab.path)
    found, bad = load_everything(stack, KEYS[:N])
    assert found == KEYS[:N] and bad == []
    stack.close()


# --- truncation -------------------------------------------------------------------------------------


def _cuts(stride):
    slot = lambda s: PAGE + s * stride  # noqa: E731
    return {
        "empty": 0,
        "inside the file header": 20,
        "after the file header fields": 100,
        "after the file header": PAGE,
        "inside slot 2's header fields": slot(2) + 50,
        "after slot 2's header fields": slot(2) + HEADER_BYTES + 10,
        "inside slot 2's data": slot(2) + PAGE + 5000,
        "one byte short of slot 2's end": slot(3) - 1,
        "at slot 3": slot(3),
        "one byte short of the last block": slot(N) - 1,
    }


@pytest.mark.parametrize("cut", list(_cuts(PAGE + BLOCK)))
def test_a_truncated_slab_keeps_whole_blocks_and_never_returns_partial_ones(slab, cut):
    size = _cuts(slab.stride)[cut]
    os.truncate(slab.file, size)
    stack = open_stack(slab.path)
    disk = stack.tiers[0]
    assert os.path.getsize(slab.file) == slab.file_bytes, "the slab is preallocated to full size again"
    file_header_intact = size >= FILE_HEADER_BYTES
    expect_found = [k for k in KEYS[:N] if file_header_intact and slab.header_at(k) + HEADER_BYTES <= size]
    # a header kept with its bytes cut: the cut part reads back as zeros, which fails the checksum
    # (unless the lost bytes were zeros, when the block is whole after all)
    expect_bad = [k for k in expect_found if content(k, BLOCK)[max(size - slab.data_at(k), 0) :].any()]
    expect_damaged = sum(
        file_header_intact and slab.header_at(k) < size < slab.header_at(k) + HEADER_BYTES for k in KEYS[:N]
    )
    assert disk.stats.damaged == expect_damaged
    found, bad = load_everything(stack, KEYS[:N])
    assert (found, bad) == (expect_found, expect_bad)
    still_works(slab.path, stack)


# --- garbage ----------------------------------------------------------------------------------------


def test_garbage_over_one_slot_is_one_damaged_slot(slab):
    victim = KEYS[2]
    rng = np.random.default_rng(5)
    write_at(slab.file, slab.header_at(victim), rng.integers(0, 256, slab.stride, dtype=np.uint8).tobytes())
    stack = open_stack(slab.path)
    disk = stack.tiers[0]
    assert disk.stats.damaged == 1 and disk.state(victim) is BlockState.FREE
    found, bad = load_everything(stack, KEYS[:N])
    assert found == [k for k in KEYS[:N] if k != victim] and bad == []
    still_works(slab.path, stack)


def test_garbage_over_every_slot_leaves_an_empty_working_tier(slab):
    rng = np.random.default_rng(6)
    write_at(slab.file, PAGE, rng.integers(0, 256, slab.file_bytes - PAGE, dtype=np.uint8).tobytes())
    stack = open_stack(slab.path)
    disk = stack.tiers[0]
    assert disk.stats.damaged == CAPACITY and disk.usage().used == 0
    assert inspect_slab(slab.path)["damaged_headers"] == CAPACITY
    still_works(slab.path, stack, damaged_left=CAPACITY - 3)


def test_garbage_in_block_data_through_a_host_tier_is_never_returned(slab):
    """The same damage seen through a host tier above the disk: still a failed load, then a miss."""
    rng = np.random.default_rng(7)
    for k in KEYS[:N]:
        if slab.slot_of[k] % 2:
            write_at(slab.file, slab.data_at(k) + 4096, rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    stack = open_stack(slab.path, host=4)
    found, bad = load_everything(stack, KEYS[:N])
    assert found == KEYS[:N] and bad == [k for k in KEYS[:N] if slab.slot_of[k] % 2]
    assert_no_leaks(stack)
    stack.close()
