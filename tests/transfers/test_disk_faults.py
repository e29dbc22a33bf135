"""Disk I/O errors fail exactly the blocks they hit, never return wrong bytes, and never break the stack.

Faults are injected at the system calls: ``FaultyDiskBackend`` is the real disk backend with its
``_pwritev`` and ``_preadv`` overridden to raise ENOSPC or EIO, or to move fewer bytes than asked,
for chosen slots and phases. A real small filesystem (a tmpfs mounted under the
test's directory, where root may mount) checks that a disk tier larger than its filesystem is refused
with a message about space, and that a preallocated slab keeps working once the filesystem is full.

Invariants checked:
- a store whose slot write (header and bytes in one call) fails commits nothing for those blocks:
  they are reported failed, the disk tier holds them as FREE, ``aborted`` counts them, and a reopen
  never finds them (their headers are zeroed); where even that zeroing fails, the block a reopen
  finds fails its load (its header's checksum does not match the bytes) and is a miss after that;
- a demotion or write-through copy that fails keeps the block in the host tier, where it stays
  readable, and a later close copies it down;
- a failed or short read reports exactly the failed block indices in ``LoadResult.failed``, counts
  them in ``read_errors`` and drops them, so the next lookup misses them, also after a restart (their
  slot headers are zeroed); other blocks load bit-exact;
- after every fault the stack keeps working: later stores and loads succeed, invariants hold, nothing leaks.
"""

from __future__ import annotations

import errno
import mmap
import os
import subprocess
import threading

import numpy as np
import pytest

from helpers.stack_helpers import assert_no_leaks, content, key, ready
from kvtier.builder import build_stack
from kvtier.core.config import load_config
from kvtier.core.layout import BlockLayout
from kvtier.core.storage import buffer_storage
from kvtier.core.tier import BlockState
from kvtier.tiers.disk.files import SNAPSHOT_NAME, DiskTierError
from kvtier.tiers.disk.slots import PAGE
from kvtier.tiers.disk.transfer import DiskBackend
from kvtier.transfers.cpu import CPUBackend

BLOCK = 16 * 1024
LAYOUT = BlockLayout((BLOCK // 4,) * 4)
KEYS = [key(i) for i in range(64)]


class FaultyDiskBackend(DiskBackend):
    """The real disk backend; chosen system calls fail.

    ``write_faults`` maps (phase, slot) to an errno raised instead of writing, or to "short" for a
    write that really lands only its first half and reports that. Phases: "slot" (a block's header
    page and bytes), "zero" (clearing a header). ``read_faults`` maps a slot to an errno or "short"
    likewise. ``writes`` counts the write calls that ran.
    """

    def __init__(self) -> None:
        super().__init__(io_threads=2)
        self.stride = 0  # set once the stack is built
        self.write_faults: dict[tuple[str, int], int | str] = {}
        self.read_faults: dict[int, int | str] = {}
        self.writes = 0
        self.hits: list[tuple[str, int]] = []
        self._faults_lock = threading.Lock()

    def _where(self, offset: int, buffers) -> list[int]:
        """The slots a call touches (a run of consecutive slots is one call)."""
        length = sum(len(memoryview(b)) for b in buffers)
        first = (offset - PAGE) // self.stride
        last = (offset - PAGE + length - 1) // self.stride
        return list(range(first, last + 1))

    def _fault(self, faults: dict, keys: list) -> tuple[object, object]:
        return next(((k, faults[k]) for k in keys if k in faults), (None, None))

    def _pwritev(self, fd, buffers, offset):
        phase = "slot" if any(bytes(memoryview(buffers[0])[:PAGE])) else "zero"
        hit, fault = self._fault(self.write_faults, [(phase, slot) for slot in self._where(offset, buffers)])
        if fault is None:
            with self._faults_lock:
                self.writes += 1
            return super()._pwritev(fd, buffers, offset)
        with self._faults_lock:
            self.hits.append(hit)
        if fault == "short":  # the first half, in whole pages (O_DIRECT writes nothing smaller)
            return os.pwritev(fd, _first(buffers, sum(len(memoryview(b)) for b in buffers) // 2 // PAGE * PAGE), offset)
        raise OSError(fault, os.strerror(fault))

    def _preadv(self, fd, buffers, offset):
        hit, fault = self._fault(self.read_faults, self._where(offset, buffers))
        if fault is None:
            return super()._preadv(fd, buffers, offset)
        with self._faults_lock:
            self.hits.append(("read", hit))
        if fault == "short":
            return os.preadv(fd, [memoryview(buffers[0])[:PAGE]], offset)  # the header page only
        raise OSError(fault, os.strerror(fault))


def _first(buffers, n: int) -> list[memoryview]:
    """The first ``n`` bytes of ``buffers``."""
    out = []
    for buffer in buffers:
        view = memoryview(buffer)[:n]
        if not len(view):
            break
        out.append(view)
        n -= len(view)
    return out


def open_stack(path, *, host=4, disk=16, placement="write_back", gpu=None, backend=None):
    tiers = (
        ([{"medium": "gpu", "capacity_blocks": gpu}] if gpu else [])
        + ([{"medium": "host", "capacity_blocks": host}] if host else [])
        + [{"medium": "disk", "path": str(path), "capacity_blocks": disk}]
    )
    for tier in tiers:
        tier["eviction"] = "lru"  # which slots get reused, and so which blocks survive a fault, is LRU's order
    config = load_config(
        {"block_bytes": BLOCK, "fragments": 4, "namespace": "faults", "placement": placement, "tiers": tiers}
    )
    backend = backend or FaultyDiskBackend()
    stack = build_stack(config, backends=[CPUBackend(2), backend])
    backend.stride = stack.tiers[-1].storage.slab.slot_stride
    return stack, backend


def put(stack, keys, batch=None):
    batch = batch or stack.tiers[0].capacity
    results = []
    for i in range(0, len(keys), batch):
        chunk = keys[i : i + batch]
        blocks = np.zeros(len(chunk) * BLOCK + 1, np.uint8)[1:].reshape(len(chunk), BLOCK)
        blocks[:] = [content(k, BLOCK) for k in chunk]  # one byte off the page, always: every block its own write
        results.append(stack.store(chunk, buffer_storage(blocks, LAYOUT), range(len(chunk))).result(timeout=30))
    return results


def get(stack, keys, dst_medium=None, aligned=None):
    """Load into a zeroed buffer: page-aligned (read in place under O_DIRECT), one byte off the page
    (read through the backend's bounce buffer), or wherever numpy puts it (None)."""
    n = len(keys) * BLOCK
    if aligned is None:
        out = np.zeros((len(keys), BLOCK), np.uint8)
    elif aligned:
        out = np.frombuffer(mmap.mmap(-1, max(n, 1)), np.uint8)[:n].reshape(len(keys), BLOCK)
    else:
        out = np.zeros(n + 1, np.uint8)[1:].reshape(len(keys), BLOCK)
    result = stack.load(
        keys, buffer_storage(out, LAYOUT, writable=True), range(len(keys)), dst_medium=dst_medium
    ).result(timeout=30)
    return result, out


def assert_exact(keys, result, out):
    for i in range(result.hits):
        if i not in result.failed:
            assert np.array_equal(out[i], content(keys[i], BLOCK)), f"block {i} came back wrong"


def assert_reopen_is_exact(path, expected, **kwargs):
    """Reopen ``path`` with a healthy backend: exactly ``expected`` of KEYS are found, all bit-exact."""
    stack, _ = open_stack(path, **kwargs)
    disk = stack.tiers[-1]
    found = ready(disk, KEYS)
    assert found == expected
    assert disk.usage().used == len(found)
    disk.check_invariants()
    loaded, out = get(stack, found)
    assert loaded.loaded == len(found) and not loaded.failed
    assert_exact(found, loaded, out)
    stack.close()


# --- writes -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", [errno.ENOSPC, errno.EIO, "short"])
def test_a_failed_write_commits_nothing_for_that_block(tmp_path, fault):
    stack, backend = open_stack(tmp_path, host=0, disk=8)  # stores go straight to disk
    (disk,) = stack.tiers
    keys = KEYS[:4]
    backend.write_faults[("slot", 2)] = fault  # slots are handed out lowest first: keys[2] gets slot 2
    (result,) = put(stack, keys)
    assert backend.hits == [("slot", 2)]
    assert result.failed == [keys[2]] and result.stored == 3
    assert disk.state(keys[2]) is BlockState.FREE
    assert disk.stats.aborted == 1 and disk.stats.committed == 3
    assert disk.usage().used == 3
    loaded, out = get(stack, keys)
    assert loaded.hits == 2, "the lookup stops at the block that never landed"
    assert_exact(keys, loaded, out)
    assert_no_leaks(stack)
    stack.close()
    # A short write landed the header and part of the bytes; the failed store zeroed that header.
    assert_reopen_is_exact(tmp_path, [keys[0], keys[1], keys[3]], host=0, disk=8)

    stack, backend = open_stack(tmp_path, host=0, disk=8)  # healthy again: the block stores fine
    put(stack, keys)
    stack.close()
    assert_reopen_is_exact(tmp_path, keys, host=0, disk=8)


def test_a_torn_slot_whose_header_cannot_be_cleared_fails_one_load_and_is_a_miss_after(tmp_path):
    """A write cut short lands a's header over bytes that are not a's; when zeroing that header fails
    too, a reopen that scans (after a crash; a clean close's index snapshot does not name a) finds a,
    and the load must refuse the bytes (checksum) rather than return them."""
    stack, backend = open_stack(tmp_path, host=0, disk=4)
    (disk,) = stack.tiers
    a = KEYS[0]
    backend.write_faults[("slot", 0)] = "short"
    backend.write_faults[("zero", 0)] = errno.EIO
    (result,) = put(stack, [a])
    assert result.failed == [a] and disk.state(a) is BlockState.FREE
    assert backend.hits == [("slot", 0), ("zero", 0)]
    stack.close()
    (tmp_path / SNAPSHOT_NAME).unlink()  # as after a crash: the reopen reads what the disk holds (a scan)
    stack, _ = open_stack(tmp_path, host=0, disk=4)
    (disk,) = stack.tiers
    assert ready(disk, [a]) == [a], "the header landed whole"
    loaded, out = get(stack, [a])
    assert (loaded.hits, loaded.loaded, loaded.failed) == (1, 0, [0])
    assert disk.stats.read_errors == 1 and disk.state(a) is BlockState.FREE
    assert stack.lookup([a]).hits == 0
    assert_no_leaks(stack)
    stack.close()
    assert_reopen_is_exact(tmp_path, [], host=0, disk=4)


def test_a_store_into_reused_slots_is_one_write_per_block(tmp_path):
    """No header is cleared first and none written after: each slot, header and bytes, in one call."""
    stack, backend = open_stack(tmp_path, host=0, disk=4)  # unaligned memory: every block its own write
    (disk,) = stack.tiers
    put(stack, KEYS[:4])
    assert backend.writes == 4
    (result,) = put(stack, KEYS[4:8])  # a full tier: every slot is reused
    assert result.stored == 4 and disk.stats.evicted == 4
    assert backend.writes == 8
    assert_no_leaks(stack)
    stack.close()
    assert_reopen_is_exact(tmp_path, KEYS[4:8], host=0, disk=4)


def test_a_failed_demotion_keeps_the_block_in_host_memory(tmp_path):
    stack, backend = open_stack(tmp_path, host=4, disk=16)
    host, disk = stack.tiers
    put(stack, KEYS[:4])
    backend.write_faults[("slot", 1)] = errno.ENOSPC  # the second block demoted to disk
    results = put(stack, KEYS[4:8])
    stack.wait_idle()
    # every attempt to demote it failed (the stack retries once before storing less)
    assert disk.state(KEYS[1]) is BlockState.FREE and disk.stats.aborted >= 1
    assert set(backend.hits) == {("slot", 1)}, "only the faulty slot's writes failed"
    assert host.state(KEYS[1]) is BlockState.READY, "a failed demotion keeps the block where it was"
    assert ready(disk, KEYS[:8]) == [KEYS[0], KEYS[2], KEYS[3]]
    assert sum(r.stored for r in results) + sum(r.dropped for r in results) == 4
    present = [k for k in KEYS[:8] if stack.lookup([k]).hits]
    loaded, out = get(stack, present)
    assert loaded.loaded == len(present) and not loaded.failed
    assert_exact(present, loaded, out)
    backend.write_faults.clear()
    assert_no_leaks(stack)
    stack.close()  # the close copies what only host memory holds down to disk
    assert_reopen_is_exact(tmp_path, present, host=4, disk=16)


def test_a_failed_write_through_copy_leaves_the_block_in_host_until_close(tmp_path):
    stack, backend = open_stack(tmp_path, host=8, disk=16, placement="write_through")
    host, disk = stack.tiers
    backend.write_faults[("slot", 2)] = errno.EIO
    put(stack, KEYS[:4])
    stack.wait_idle()
    assert ready(disk, KEYS[:4]) == [KEYS[0], KEYS[1], KEYS[3]] and disk.stats.aborted == 1
    assert ready(host, KEYS[:4]) == KEYS[:4]
    assert stack.background_errors == []
    backend.write_faults.clear()
    assert_no_leaks(stack)
    stack.close()
    assert_reopen_is_exact(tmp_path, KEYS[:4], host=8, disk=16)


# --- reads ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("fault", [errno.EIO, errno.ENOSPC, "short"])
def test_a_failed_read_reports_exactly_the_failed_blocks_and_drops_them(tmp_path, fault, aligned):
    stack, backend = open_stack(tmp_path, host=0, disk=8)
    (disk,) = stack.tiers
    keys = KEYS[:6]
    put(stack, keys)
    bad = [1, 4]
    for i in bad:
        backend.read_faults[disk.slots([keys[i]])[0]] = fault
    loaded, out = get(stack, keys, aligned=aligned)
    assert (loaded.hits, loaded.loaded, loaded.failed) == (6, 4, bad)
    assert_exact(keys, loaded, out)
    assert disk.stats.read_errors == 2
    assert [disk.state(keys[i]) for i in bad] == [BlockState.FREE] * 2
    assert stack.lookup(keys).hits == 1
    backend.read_faults.clear()
    again, out = get(stack, keys)  # the dropped blocks are misses now, not failures
    assert (again.hits, again.failed) == (1, [])
    put(stack, [keys[i] for i in bad])  # and store again cleanly into reused slots
    loaded, out = get(stack, keys)
    assert loaded.loaded == 6 and not loaded.failed
    assert_exact(keys, loaded, out)
    assert_no_leaks(stack)
    stack.close()
    assert_reopen_is_exact(tmp_path, keys, host=0, disk=8)


@pytest.mark.parametrize("fault", [errno.EIO, "short"])
def test_blocks_dropped_after_a_failed_read_are_not_found_again_after_a_restart(tmp_path, fault):
    stack, backend = open_stack(tmp_path, host=0, disk=8)
    (disk,) = stack.tiers
    keys = KEYS[:6]
    put(stack, keys)
    for i in (1, 4):
        backend.read_faults[disk.slots([keys[i]])[0]] = fault
    loaded, out = get(stack, keys)
    assert loaded.failed == [1, 4]
    backend.read_faults.clear()  # the bytes on disk are intact: only the dropped headers keep them away
    assert_no_leaks(stack)
    stack.close()
    assert_reopen_is_exact(tmp_path, [keys[i] for i in (0, 2, 3, 5)], host=0, disk=8)


def test_a_header_that_cannot_be_zeroed_after_a_failed_read_is_replaced_by_the_slots_next_store(tmp_path):
    stack, backend = open_stack(tmp_path, host=0, disk=4)
    (disk,) = stack.tiers
    put(stack, KEYS[:4])
    slot = disk.slots([KEYS[1]])[0]
    backend.read_faults[slot] = errno.EIO
    backend.write_faults[("zero", slot)] = errno.EIO
    loaded, _ = get(stack, KEYS[:4])
    assert loaded.failed == [1] and ("zero", slot) in backend.hits
    backend.read_faults.clear()
    backend.write_faults.clear()
    put(stack, KEYS[8:9])  # reuses the slot: its header and bytes are replaced in one write
    assert disk.slots([KEYS[8]]) == [slot]
    assert_no_leaks(stack)
    stack.close()
    assert_reopen_is_exact(tmp_path, [KEYS[0], KEYS[2], KEYS[3], KEYS[8]], host=0, disk=4)


def test_a_failed_read_staged_through_host_fails_only_that_block(tmp_path):
    stack, backend = open_stack(tmp_path, gpu=4, host=4, disk=16)
    gpu, host, disk = stack.tiers
    keys = KEYS[:12]
    put(stack, keys)
    stack.wait_idle()
    assert ready(disk, keys) == keys[:4]
    backend.read_faults[disk.slots([keys[2]])[0]] = errno.EIO
    loaded, out = get(stack, keys[:4], dst_medium="gpu")  # disk -> host -> destination
    assert (loaded.hits, loaded.loaded, loaded.failed) == (4, 3, [2])
    assert_exact(keys, loaded, out)
    assert host.state(keys[2]) is BlockState.FREE and disk.state(keys[2]) is BlockState.FREE
    assert ready(host, keys[:4]) == [keys[0], keys[1], keys[3]]
    assert host.stats.aborted == 1 and disk.stats.read_errors == 1
    assert_no_leaks(stack)
    stack.close()


def test_every_io_failing_still_leaves_a_working_stack(tmp_path):
    stack, backend = open_stack(tmp_path, host=4, disk=8)
    host, disk = stack.tiers
    for slot in range(8):
        for phase in ("zero", "slot"):
            backend.write_faults[(phase, slot)] = errno.EIO
        backend.read_faults[slot] = errno.EIO
    put(stack, KEYS[:16])
    stack.wait_idle()
    assert disk.usage().used == 0 and disk.stats.committed == 0
    present = [k for k in KEYS[:16] if stack.lookup([k]).hits]
    assert present == ready(host, KEYS[:16]) and len(present) == 4
    loaded, out = get(stack, present)
    assert loaded.loaded == 4
    assert_exact(present, loaded, out)
    backend.write_faults.clear()
    backend.read_faults.clear()
    put(stack, KEYS[16:24])  # pushes the four kept in host, then four more, down to disk
    stack.wait_idle()
    assert ready(disk, KEYS[:24]) == present + KEYS[16:20] and ready(host, KEYS[:24]) == KEYS[20:24]
    assert_no_leaks(stack)
    stack.close()
    assert_reopen_is_exact(tmp_path, KEYS[16:24], host=4, disk=8)


# --- a real small filesystem --------------------------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path):
    """A 1 MiB tmpfs mounted under tmp_path; skips where mounting is not permitted."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def test_a_disk_tier_larger_than_its_filesystem_is_refused(small_fs):
    path = small_fs / "cache"
    with pytest.raises(DiskTierError) as err:
        open_stack(path, host=4, disk=64)  # 64 blocks of 16 KiB plus headers > 1 MiB
    message = str(err.value)
    assert str(path) in message and "free" in message and "lower its capacity" in message
    stack, _ = open_stack(path, host=4, disk=16)  # refused without leaving the directory locked
    put(stack, KEYS[:8])
    loaded, out = get(stack, KEYS[:8])
    assert loaded.loaded == 8
    assert_exact(KEYS[:8], loaded, out)
    stack.close()


def test_a_preallocated_slab_keeps_working_on_a_full_filesystem(small_fs):
    path = small_fs / "cache"
    stack, _ = open_stack(path, host=4, disk=16)
    filler = small_fs / "filler"
    with open(filler, "wb", buffering=0) as f:  # take every byte left on the filesystem (no buffer left to flush)
        try:
            while True:
                f.write(b"\xff" * 65536)
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    assert os.statvfs(small_fs).f_bavail == 0
    put(stack, KEYS[:24])
    stack.wait_idle()
    disk = stack.tiers[1]
    assert disk.stats.aborted == 0 and disk.usage().used == 16
    present = [k for k in KEYS[:24] if stack.lookup([k]).hits]
    loaded, out = get(stack, present)
    assert loaded.loaded == len(present) == 20 and not loaded.failed
    assert_exact(present, loaded, out)
    stack.close()
    filler.unlink()
