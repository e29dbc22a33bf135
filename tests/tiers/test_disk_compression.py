"""Disk tier compression (``compression: lz4 | zstd``, ``slot_bytes``): more blocks in the same disk
budget, and never a wrong byte.

Blocks here are bf16 KV-like values (``torch.randn`` cast to bfloat16, seeded by the block's key),
which the byte-split codecs shrink to about 0.69 (zstd) and 0.85 (lz4) of their size.

Invariants checked:
- every block stored through a host-over-disk stack comes back bit-exact with either codec, also
  after close and reopen, for page-sized and odd block sizes, from one contiguous buffer or from
  per-layer arrays (gathered on store, scattered on load);
- the same disk ``capacity`` in bytes counts more slots with compression on than off (a 4 KiB header
  and ``slot_bytes`` rounded up to 4 KiB per slot), and all those blocks really are stored and read back;
- a block that does not compress into its slot (random bytes) is not stored: the store reports it
  failed, ``incompressible`` and ``aborted`` count it, it is a miss, and the stack keeps working;
- with write-back, a host victim the disk refuses that way is dropped from host (``demotion_refused``),
  so such blocks never clog host memory, while a victim whose demotion fails for a passing reason
  (an I/O error) stays in host and lands on disk when the stack tries again;
- damage to a compressed payload (its frames or its length prefix) or to its slot header is a failed
  load or a damaged header, then a miss; never wrong bytes;
- reopening the directory with another codec or another slot size finds nothing;
- a codec whose package is missing is a ConfigError naming the package and the extra to install,
  before any file is created; bad codec names and slot sizes are ConfigErrors naming the key.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import sys
import threading

import numpy as np
import pytest
import torch

from helpers.stack_helpers import assert_no_leaks, flip, key, ready
from kvtier.builder import build_stack
from kvtier.core.config import capacity_in_blocks, load_config
from kvtier.core.errors import ConfigError, StateError
from kvtier.core.layout import BlockLayout
from kvtier.core.storage import StridedStorage, buffer_storage
from kvtier.core.tier import BlockState
from kvtier.tiers.disk.files import SLAB_NAME
from kvtier.tiers.disk.format import SlotHeader
from kvtier.tiers.disk.inspect import inspect_slab
from kvtier.tiers.disk.slots import PAGE
from kvtier.tiers.disk.transfer import DiskBackend
from kvtier.transfers.cpu import CPUBackend

BLOCK = 256 * 1024
LAYOUT = BlockLayout((BLOCK // 4,) * 4)
KEYS = [key(i) for i in range(64)]
CODECS = ["lz4", "zstd"]
ROOM = {"zstd": 192 * 1024, "lz4": 224 * 1024}  # the default slot_bytes: 3/4 and 7/8 of a block


def bf16(k: bytes, nbytes: int = BLOCK) -> np.ndarray:
    """A block of bf16 N(0, 1) values as bytes, a pure function of its key (odd sizes cut the last value)."""
    gen = torch.Generator().manual_seed(int.from_bytes(k[:8], "little") >> 1)
    values = torch.randn((nbytes + 1) // 2, generator=gen).to(torch.bfloat16)
    return values.view(torch.int16).numpy().view(np.uint8)[:nbytes].copy()


def noise(k: bytes, nbytes: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(k[:8], "little")).integers(0, 256, nbytes, dtype=np.uint8)


def config(
    path,
    compression="zstd",
    *,
    host=4,
    disk=16,
    capacity=None,
    slot_bytes=None,
    block_bytes=BLOCK,
    fragments=4,
    placement="write_back",
    o_direct="auto",
) -> dict:
    disk_cfg = {"medium": "disk", "path": str(path), "compression": compression, "o_direct": o_direct}
    disk_cfg.update({"capacity": capacity} if capacity is not None else {"capacity_blocks": disk})
    if slot_bytes is not None:
        disk_cfg["slot_bytes"] = slot_bytes
    tiers = ([{"medium": "host", "capacity_blocks": host}] if host else []) + [disk_cfg]
    return {
        "block_bytes": block_bytes,
        "fragments": fragments,
        "namespace": "compress",
        "placement": placement,
        "tiers": tiers,
    }


def open_stack(path, compression="zstd", **kwargs):
    return build_stack(load_config(config(path, compression, **kwargs)))


def put(stack, keys, make=bf16, layout=LAYOUT):
    """Store ``keys`` in batches the first tier can hold; returns the StoreResults."""
    batch = stack.tiers[0].capacity
    results = []
    for i in range(0, len(keys), batch):
        chunk = keys[i : i + batch]
        blocks = np.stack([make(k, layout.block_bytes) for k in chunk])
        results.append(stack.store(chunk, buffer_storage(blocks, layout), range(len(chunk))).result(timeout=60))
    return results


def get(stack, keys, layout=LAYOUT, out=None):
    if out is None:
        out = np.zeros((len(keys), layout.block_bytes), np.uint8)
    result = stack.load(keys, buffer_storage(out, layout, writable=True), range(len(keys))).result(timeout=60)
    return result, out


def assert_exact(keys, result, out, make=bf16):
    for i in range(result.hits):
        if i not in result.failed:
            assert np.array_equal(out[i], make(keys[i], out.shape[1])), f"block {i} came back wrong"


def header_of(path, slot: int, stride: int) -> SlotHeader:
    fd = os.open(path / SLAB_NAME, os.O_RDONLY)
    try:
        return SlotHeader.unpack(os.pread(fd, PAGE, PAGE + slot * stride))
    finally:
        os.close(fd)


def write_header(path, slot: int, stride: int, header: SlotHeader) -> None:
    fd = os.open(path / SLAB_NAME, os.O_RDWR)
    try:
        os.pwrite(fd, header.pack(), PAGE + slot * stride)
    finally:
        os.close(fd)


# --- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("o_direct", ["off", "auto"])
@pytest.mark.parametrize("compression", CODECS)
def test_round_trip_through_host_and_disk_is_bit_exact_also_after_reopen(tmp_path, compression, o_direct):
    stack = open_stack(tmp_path, compression, host=4, disk=16, o_direct=o_direct)
    host, disk = stack.tiers
    assert disk.storage.slab.room == ROOM[compression] and compression in repr(disk)
    keys = KEYS[:14]
    assert all(r.stored == 4 or r.stored == 2 for r in put(stack, keys))
    stack.wait_idle()
    assert ready(disk, keys) == keys[:10] and ready(host, keys) == keys[10:]
    assert disk.stats.incompressible == 0 and disk.stats.committed == 10
    loaded, out = get(stack, keys)
    assert (loaded.loaded, loaded.failed, loaded.per_tier) == (14, [], {"disk": 10, "host": 4})
    assert_exact(keys, loaded, out)
    assert_no_leaks(stack)
    stack.close()
    for _ in range(2):
        stack = open_stack(tmp_path, compression, host=4, disk=16, o_direct=o_direct)
        disk = stack.tiers[1]
        assert disk.usage().used == 14 and disk.stats.damaged == 0
        loaded, out = get(stack, keys)
        assert (loaded.loaded, loaded.failed, loaded.per_tier) == (14, [], {"disk": 14})
        assert_exact(keys, loaded, out)
        stack.close()
    info = inspect_slab(tmp_path)
    assert (info["compression"], info["slot_bytes"], info["blocks"]) == (compression, ROOM[compression], 14)
    assert info["stored_bytes"] <= 14 * ROOM[compression]


@pytest.mark.parametrize("compression", CODECS)
@pytest.mark.parametrize("block_bytes", [3 * PAGE + 13, PAGE + 1])
def test_odd_block_sizes_from_unaligned_memory(tmp_path, compression, block_bytes):
    layout = BlockLayout((block_bytes,))
    stack = open_stack(tmp_path, compression, host=0, disk=8, block_bytes=block_bytes, fragments=1)
    keys = KEYS[:6]
    raw = np.zeros(6 * block_bytes + 1, np.uint8)
    src = raw[1:].reshape(6, block_bytes)  # one byte off the page
    src[:] = np.stack([bf16(k, block_bytes) for k in keys])
    result = stack.store(keys, buffer_storage(src, layout), range(6)).result(timeout=60)
    assert result.stored == 6 and not result.failed
    stack.close()
    stack = open_stack(tmp_path, compression, host=0, disk=8, block_bytes=block_bytes, fragments=1)
    out = np.zeros(6 * block_bytes + 3, np.uint8)[3:].reshape(6, block_bytes)
    loaded, out = get(stack, keys, layout, out)
    assert loaded.loaded == 6 and not loaded.failed
    assert_exact(keys, loaded, out)
    stack.close()


@pytest.mark.parametrize("compression", CODECS)
def test_per_layer_arrays_are_gathered_and_scattered(tmp_path, compression):
    """A block spread over four per-layer arrays (as an engine's KV tensors) is one payload on disk."""
    stack = open_stack(tmp_path, compression, host=0, disk=8)
    frag = LAYOUT.fragment_bytes[0]

    def per_layer(blocks: np.ndarray):
        layers = [np.ascontiguousarray(blocks[:, f * frag : (f + 1) * frag]) for f in range(4)]
        storage = StridedStorage(LAYOUT, len(blocks), [a.ctypes.data for a in layers], [frag] * 4, keepalive=layers)
        return storage, layers

    keys = KEYS[:5]
    src, _ = per_layer(np.stack([bf16(k) for k in keys]))
    assert stack.store(keys, src, range(5)).result(timeout=60).stored == 5
    dst, layers = per_layer(np.zeros((5, BLOCK), np.uint8))
    loaded = stack.load(keys, dst, range(5)).result(timeout=60)
    assert loaded.loaded == 5 and not loaded.failed
    assert np.array_equal(np.concatenate(layers, axis=1), np.stack([bf16(k) for k in keys]))
    stack.close()


# --- capacity -------------------------------------------------------------------------------------


def test_the_same_disk_budget_holds_more_blocks_compressed(tmp_path):
    budget = 12 * (PAGE + BLOCK)  # 12 uncompressed slots
    counts = {}
    for compression, slot_bytes in [("none", None), ("lz4", None), ("zstd", None), ("zstd", "200KiB")]:
        path = tmp_path / f"{compression}-{slot_bytes}"
        cfg = load_config(config(path, compression, host=0, capacity=budget, slot_bytes=slot_bytes))
        n = capacity_in_blocks(cfg.tiers[0], BLOCK)
        assert n == budget // cfg.tiers[0].footprint(BLOCK)
        stack = build_stack(cfg)
        (disk,) = stack.tiers
        assert disk.capacity == n and disk.storage.slab.file_bytes <= PAGE + budget
        keys = KEYS[:n]
        for r in put(stack, keys):
            assert not r.failed and not r.dropped
        assert disk.usage().used == n and disk.stats.evicted == 0 and disk.stats.incompressible == 0
        stack.close()
        stack = build_stack(cfg)
        loaded, out = get(stack, keys)
        assert (loaded.loaded, loaded.failed) == (n, [])
        assert_exact(keys, loaded, out)
        stack.close()
        counts[(compression, slot_bytes)] = n
    # 260 KiB per uncompressed slot; 228 KiB with lz4 (224 KiB of room); 196 KiB with zstd; 204 KiB with 200 KiB
    assert counts == {("none", None): 12, ("lz4", None): 13, ("zstd", None): 15, ("zstd", "200KiB"): 15}


@pytest.mark.parametrize("fragments", [1, 4])
def test_slots_exactly_as_long_as_a_block_keep_blocks_apart(tmp_path, fragments):
    """16 KiB blocks with zstd get 12 KiB of room: slot header plus room is exactly one block long, so
    one block's raw bytes would run straight into the next slot's; each block still goes its own way."""
    layout = BlockLayout((16384 // fragments,) * fragments)
    stack = open_stack(tmp_path, "zstd", host=0, disk=8, block_bytes=16384, fragments=fragments)
    (disk,) = stack.tiers
    assert disk.storage.slab.slot_stride == 16384
    keys = KEYS[:6]
    assert [r.stored for r in put(stack, keys, layout=layout)] == [6]
    stack.close()
    stack = open_stack(tmp_path, "zstd", host=0, disk=8, block_bytes=16384, fragments=fragments)
    loaded, out = get(stack, keys, layout=layout)
    assert loaded.loaded == 6 and not loaded.failed
    assert_exact(keys, loaded, out)
    stack.close()


# --- incompressible blocks ----------------------------------------------------------------------------


@pytest.mark.parametrize("compression", CODECS)
def test_an_incompressible_block_is_not_stored_counted_and_a_miss(tmp_path, compression):
    stack = open_stack(tmp_path, compression, host=0, disk=8)
    (disk,) = stack.tiers
    keys = KEYS[:4]
    blocks = np.stack([bf16(keys[0]), noise(keys[1]), bf16(keys[2]), bf16(keys[3])])
    result = stack.store(keys, buffer_storage(blocks, LAYOUT), range(4)).result(timeout=60)
    assert (result.stored, result.failed) == (3, [keys[1]])
    assert (disk.stats.incompressible, disk.stats.aborted, disk.stats.committed) == (1, 1, 3)
    assert stack.stats()["disk"]["incompressible"] == 1
    assert disk.state(keys[1]) is BlockState.FREE and stack.lookup(keys).hits == 1
    loaded, out = get(stack, [keys[0], keys[2], keys[3]])
    assert loaded.loaded == 3 and not loaded.failed
    assert_exact([keys[0], keys[2], keys[3]], loaded, out)
    assert put(stack, KEYS[10:15])[0].stored == 5  # the stack keeps working
    assert_no_leaks(stack)
    stack.close()
    stack = open_stack(tmp_path, compression, host=0, disk=8)
    assert ready(stack.tiers[0], keys) == [keys[0], keys[2], keys[3]]
    stack.close()


def test_an_incompressible_block_stays_readable_in_the_host_tier_above(tmp_path):
    stack = open_stack(tmp_path, "zstd", host=4, disk=8, placement="write_through")
    host, disk = stack.tiers
    keys = KEYS[:2]
    put(stack, keys, make=noise)
    stack.wait_idle()
    assert disk.stats.incompressible == 2 and ready(disk, keys) == [] and ready(host, keys) == keys
    loaded, out = get(stack, keys)
    assert loaded.per_tier == {"host": 2} and loaded.loaded == 2
    assert_exact(keys, loaded, out, make=noise)
    assert_no_leaks(stack)
    stack.close()  # the flush at close tries again, and fails again: still no wrong data on disk
    assert inspect_slab(tmp_path)["blocks"] == 0


def test_incompressible_victims_are_dropped_from_host_instead_of_filling_it(tmp_path):
    """Write-back: a host victim whose demotion the disk refuses for good (random bytes under zstd)
    leaves host memory, counted; kept, such blocks would pile up until host stored nothing new."""
    stack = open_stack(tmp_path, "zstd", host=4, disk=16)
    host, disk = stack.tiers
    noisy, kv = KEYS[:12], KEYS[12:28]
    noisy_pairs, kv_pairs = zip(noisy[::2], noisy[1::2], strict=True), zip(kv[:12:2], kv[1:12:2], strict=True)
    mixed = [k for pair in zip(noisy_pairs, kv_pairs, strict=True) for k in sum(pair, ())]
    make = lambda k, n=BLOCK: noise(k, n) if k in noisy else bf16(k, n)  # noqa: E731
    results = put(stack, mixed + kv[12:], make=make)  # batches of 4: two noise, two bf16; then four bf16
    stack.wait_idle()
    assert [(r.stored, r.dropped, r.failed) for r in results] == [(4, 0, [])] * 7, "host never clogged"
    assert (host.stats.demotion_refused, host.stats.demoted, host.stats.evicted) == (12, 12, 24)
    assert (disk.stats.incompressible, disk.stats.aborted, disk.stats.committed) == (12, 12, 12)
    assert ready(host, KEYS[:28]) == kv[12:] and ready(disk, KEYS[:28]) == kv[:12]
    assert all(stack.lookup([k]).hits == 0 for k in noisy), "dropped blocks are misses"
    loaded, out = get(stack, kv)
    assert loaded.loaded == 16 and loaded.per_tier == {"disk": 12, "host": 4}
    assert_exact(kv, loaded, out, make=make)
    assert_no_leaks(stack)
    stack.close()
    stack = open_stack(tmp_path, "zstd", host=4, disk=16)
    assert ready(stack.tiers[1], KEYS[:28]) == kv  # the close copied host's four down; no noise block
    loaded, out = get(stack, kv)
    assert loaded.loaded == 16 and not loaded.failed
    assert_exact(kv, loaded, out, make=make)
    stack.close()


class FlakyWriteBackend(DiskBackend):
    """The real disk backend; the next ``failures`` slot writes raise EIO (a fault that passes). Writes
    that clear a header (all zeros) pass."""

    def __init__(self) -> None:
        super().__init__(io_threads=2)
        self.failures = 0
        self._lock = threading.Lock()

    def _pwritev(self, fd: int, buffers, offset: int) -> int:
        with self._lock:
            fail = self.failures > 0 and any(bytes(memoryview(buffers[0])[:PAGE]))
            self.failures -= fail
        if fail:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return super()._pwritev(fd, buffers, offset)


def test_a_demotion_that_fails_for_a_passing_reason_keeps_the_block_and_retries(tmp_path):
    """Only a refusal for good drops a victim: compressible victims whose demotion hits an I/O error
    stay in host memory, and the stack's retry then lands them on disk bit-exact."""
    backend = FlakyWriteBackend()
    stack = build_stack(load_config(config(tmp_path, "zstd", host=4, disk=16)), backends=[CPUBackend(2), backend])
    host, disk = stack.tiers
    put(stack, KEYS[:4])
    backend.failures = 4  # every slot write of the first demotion job
    (result,) = put(stack, KEYS[4:8])
    stack.wait_idle()
    assert (result.stored, result.dropped, result.failed) == (4, 0, [])
    assert (disk.stats.aborted, disk.stats.committed, disk.stats.incompressible) == (4, 4, 0)
    assert (host.stats.demoted, host.stats.demotion_refused) == (4, 0)
    assert ready(disk, KEYS[:8]) == KEYS[:4] and ready(host, KEYS[:8]) == KEYS[4:8]
    loaded, out = get(stack, KEYS[:8])
    assert loaded.loaded == 8 and loaded.per_tier == {"disk": 4, "host": 4}
    assert_exact(KEYS[:8], loaded, out)
    assert_no_leaks(stack)
    stack.close()


def test_only_reserved_blocks_can_be_refused(tmp_path):
    stack = open_stack(tmp_path, "zstd", host=0, disk=4)
    (disk,) = stack.tiers
    put(stack, KEYS[:1])
    with pytest.raises(StateError, match="not reserved"):
        disk.refuse([KEYS[0]])  # READY, not being written
    with pytest.raises(StateError, match="not reserved"):
        disk.refuse([KEYS[1]])  # absent
    disk.reserve([KEYS[2], KEYS[3]])
    disk.refuse([KEYS[2]])
    assert disk.abort([KEYS[2], KEYS[3]]) == [KEYS[2]]
    assert disk.usage().used == 1
    assert_no_leaks(stack)
    stack.close()


# --- damage -------------------------------------------------------------------------------------------


@pytest.fixture(params=CODECS)
def written(request, tmp_path):
    """Six blocks written to a disk-only stack and closed: (path, codec, stride, slot of each key)."""
    stack = open_stack(tmp_path, request.param, host=0, disk=8)
    (disk,) = stack.tiers
    put(stack, KEYS[:6])
    slots = dict(zip(KEYS[:6], disk.slots(KEYS[:6]), strict=True))
    stride = disk.storage.slab.slot_stride
    stack.close()
    return tmp_path, request.param, stride, slots


def check_one_failed(path, compression, victim, reopen_damaged=0, may_survive=False):
    """Loading all six: only ``victim`` fails (or is already gone at reopen), the rest come back exact,
    and the victim is a miss afterwards. With ``may_survive`` the victim may also load bit-exact (damage
    the codec and checksum show to be harmless)."""
    stack = open_stack(path, compression, host=0, disk=8)
    (disk,) = stack.tiers
    assert disk.stats.damaged == reopen_damaged
    present = ready(disk, KEYS[:6])
    loaded, out = get(stack, present)
    failed = [present[i] for i in loaded.failed]
    assert_exact(present, loaded, out)
    if may_survive and not failed:
        stack.close()
        return
    assert failed == ([] if reopen_damaged else [victim]) and victim not in ready(disk, KEYS[:6])
    assert stack.lookup([victim]).hits == 0 and disk.stats.read_errors == len(failed)
    assert put(stack, KEYS[20:22])[0].stored == 2
    assert_no_leaks(stack)
    stack.close()


@pytest.mark.parametrize("where", ["length prefix", "high-plane frame", "end of the payload"])
def test_a_damaged_payload_is_a_failed_load_then_a_miss(written, where):
    path, compression, stride, slots = written
    victim = KEYS[2]
    header = header_of(path, slots[victim], stride)
    offset = {"length prefix": 1, "high-plane frame": 4 + 1000, "end of the payload": header.payload - 1}[where]
    flip(path / SLAB_NAME, PAGE + slots[victim] * stride + PAGE + offset)
    check_one_failed(path, compression, victim)


@pytest.mark.parametrize("change", ["payload shorter", "payload longer", "checksum"])
def test_a_forged_header_is_a_failed_load(written, change):
    """Valid headers (their own checksum right) that lie about the payload never give wrong bytes. (A
    longer payload only adds zero padding after the last frame, which zstd may ignore: then the block is
    whole and may load.)"""
    path, compression, stride, slots = written
    victim = KEYS[4]
    header = header_of(path, slots[victim], stride)
    forged = {
        "payload shorter": {"payload": header.payload - 7},
        "payload longer": {"payload": min(header.payload + 4096, stride - PAGE)},
        "checksum": {"checksum": header.checksum ^ 1},
    }[change]
    write_header(path, slots[victim], stride, dataclasses.replace(header, **forged))
    check_one_failed(path, compression, victim, may_survive=change == "payload longer")


@pytest.mark.parametrize("change", ["flipped byte", "payload past the slot", "other codec", "raw length"])
def test_a_damaged_or_impossible_header_is_damaged_at_reopen(written, change):
    path, compression, stride, slots = written
    victim = KEYS[1]
    if change == "flipped byte":
        flip(path / SLAB_NAME, PAGE + slots[victim] * stride + 70)
    else:
        header = header_of(path, slots[victim], stride)
        forged = {
            "payload past the slot": {"payload": stride - PAGE + 1},
            "other codec": {"codec": 0 if header.codec else 1},
            "raw length": {"length": BLOCK - 2},
        }[change]
        write_header(path, slots[victim], stride, dataclasses.replace(header, **forged))
    check_one_failed(path, compression, victim, reopen_damaged=1)


# --- geometry changes --------------------------------------------------------------------------------


@pytest.mark.parametrize("other", [("lz4", None), ("none", None), ("zstd", "200KiB")])
def test_reopening_with_another_codec_or_slot_size_finds_nothing(tmp_path, other):
    stack = open_stack(tmp_path, "zstd", host=0, disk=8)
    put(stack, KEYS[:4])
    stack.close()
    compression, slot_bytes = other
    stack = open_stack(tmp_path, compression, host=0, disk=8, slot_bytes=slot_bytes)
    (disk,) = stack.tiers
    assert disk.usage().used == 0 and stack.lookup(KEYS[:4]).hits == 0 and disk.stats.damaged == 0
    put(stack, KEYS[:2])  # the fresh file works
    loaded, out = get(stack, KEYS[:2])
    assert loaded.loaded == 2
    assert_exact(KEYS[:2], loaded, out)
    stack.close()
    assert inspect_slab(tmp_path)["compression"] == compression


# --- configuration ------------------------------------------------------------------------------------


@pytest.mark.parametrize("compression,package", [("zstd", "zstandard"), ("lz4", "lz4")])
def test_a_missing_codec_package_is_a_clear_error_and_creates_nothing(tmp_path, monkeypatch, compression, package):
    monkeypatch.setitem(sys.modules, package, None)  # makes ``import package`` fail
    path = tmp_path / "cache"
    with pytest.raises(ConfigError) as err:
        open_stack(path, compression)
    message = str(err.value)
    assert repr(package) in message and "pip install 'kvtier[compression]'" in message
    assert not path.exists()
    stack = open_stack(path, "none")  # other settings are unaffected
    stack.close()


def error_of(cfg) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    return str(err.value)


def test_config_refuses_bad_codecs_and_slot_sizes(tmp_path):
    assert "tiers[1].compression: 'gzip' is not allowed; allowed: none, lz4, zstd" in error_of(config(tmp_path, "gzip"))
    assert "tiers[1].slot_bytes: 2KiB (2048 bytes) is less than 4KiB" in error_of(config(tmp_path, slot_bytes="2KiB"))
    assert "tiers[1].slot_bytes: slot_bytes 266240 is larger than block_bytes 262144" in error_of(
        config(tmp_path, slot_bytes="260KiB")
    )
    assert (
        "tiers[1].slot_bytes: slot_bytes 131072 is smaller than block_bytes 262144, which only fits with "
        "compression" in error_of(config(tmp_path, "none", slot_bytes="128KiB"))
    )
    assert (
        "tiers[1].capacity: 256KiB (262144 bytes) holds no block of block_bytes 256KiB; give at least 260KiB"
        in error_of(config(tmp_path, "none", capacity="256KiB"))
    )
    cfg = load_config(config(tmp_path, "none", slot_bytes="256KiB"))  # the block size itself is fine uncompressed
    assert cfg.tiers[1].compression == "none" and cfg.tiers[1].slot_bytes == BLOCK
    assert load_config(config(tmp_path)).tiers[1].slot_bytes is None
    defaults = load_config(
        {"block_bytes": BLOCK, "tiers": [{"medium": "disk", "path": str(tmp_path), "capacity": "1GiB"}]}
    )
    assert defaults.tiers[0].compression == "none"
    assert capacity_in_blocks(defaults.tiers[0], BLOCK) == 2**30 // (PAGE + BLOCK)
