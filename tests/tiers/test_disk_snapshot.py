"""The disk tier's index snapshot: a clean close leaves one beside the slab, the next open restores from
it instead of reading every slot header, and nothing in it can make a load return wrong bytes.

Real stacks over a real slab in a temporary directory; a real child process killed with SIGKILL for
the crash; snapshots damaged with plain file I/O and forged with the real writer (a valid checksum and
identity: what someone who can write the directory could make).

Invariants checked:
- a clean close then a reopen restores every block from the snapshot (the tier says so), at the same
  slots, in the same order, bit-exact, with the same answer a scan gives; the snapshot file is gone as
  soon as the tier is open; new stores get sequence numbers above every old header's; keys of every
  length (1 to 64 bytes, trailing zeros included) and an empty tier round-trip; the file is 0600
  whatever the umask (0660 with ``shared_directory``); a slab holding a header it could not zero
  writes none;
- a crash (a child holding the tier killed with SIGKILL, after its open took the snapshot) leaves no
  snapshot, and the reopen scans and finds every block, bit-exact;
- a stale snapshot is ignored and the slab scanned: an older snapshot put back after the slab was
  written again, a slab header zeroed right after the close (within the clock's tick), a slab
  replaced by a copy, a reopen at another capacity;
- a damaged, truncated, oversized or forged snapshot (bad checksum, a slot out of range or named twice,
  key lengths out of bounds, huge counts, another namespace) is ignored with one log line naming it
  and why, never crashes the open, and the scan finds every block (a key named twice is the
  restore's to drop: ``test_disk_restore.py``);
- a forged snapshot that passes every check but points keys at each other's slots only causes misses:
  those loads fail and their bytes are never returned, every other block loads bit-exact;
- restoring while serving (``core/restore.py``, chunks of two blocks held by a gate): every slot is taken
  at open and a block not back yet is a miss, never an error; blocks load bit-exact once their chunk
  is in, oldest first; a store of a block still to come back wins (its bytes stay, the old slot is
  freed: free slots counted); a close mid-restore lists what is back, what was stored meanwhile and
  what was still to come, and the reopen has every block; eviction meanwhile takes only blocks
  already back, a store that finds no more room stores less; a forged snapshot naming a key twice
  (either copy the wrong one, in one chunk or two) serves no wrong bytes and leaks no slot; a restore
  thread that fails logs why, frees the slots of the blocks not back, and the tier keeps serving;
- a snapshot another user owns, that its group or every user can write, that is a symbolic link, a
  FIFO or has a second name is refused like such a slab (the open scans, the link's target and the
  other name are left alone); a file planted under the temporary name is never written through; a
  directory under the snapshot's name costs the snapshot, never the tier.
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import struct
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import xxhash

from helpers.disk_helpers import KEYS, LAYOUT, assert_exact, data, get, open_stack, put, umask
from helpers.stack_helpers import ready
from kvtier.core.restore import ChunkedRestore
from kvtier.core.tier import BlockState, Tier
from kvtier.tiers.disk.compression import CODEC_IDS
from kvtier.tiers.disk.files import SLAB_NAME, SNAPSHOT_NAME
from kvtier.tiers.disk.format import VERSION, namespace_digest
from kvtier.tiers.disk.inspect import read_block_headers
from kvtier.tiers.disk.slots import slot_stride
from kvtier.tiers.disk.snapshot import SlabIdentity, write_snapshot

SLOTS = 16  # the disk tier's capacity in these tests
N = 10  # blocks stored before the close
NAMESPACE = "model-a"  # disk_helpers' default
NOBODY = 65534  # another user
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="playing another user needs root (chown)")
# The snapshot's documented layout (tiers/disk/snapshot.py): magic (8 bytes), block count (u64), key
# width (u32), ...; rows of key lengths, keys and slots; then the xxh3-64 of everything before it.
COUNT_AT, WIDTH_AT = 8, 16


# --- helpers ------------------------------------------------------------------------------------


def stored_and_closed(path, keys=KEYS[:N], **options) -> dict[bytes, int]:
    """A disk-only tier at ``path`` holding ``keys``, closed cleanly; returns each key's slot."""
    stack = open_stack(path, host=0, disk=SLOTS, **options)
    put(stack, keys)
    slots = dict(zip(keys, stack.tiers[0].slots(keys), strict=True))
    stack.close()
    assert (Path(path) / SNAPSHOT_NAME).is_file()
    return slots


def reopened(path, source: str, keys=KEYS[:N], **options):
    """Open the tier at ``path``, check it recovered from ``source`` ("index snapshot" or "scan") with no
    snapshot left behind, and that every one of ``keys`` is there and loads bit-exact; returns the
    open stack."""
    stack = open_stack(path, host=0, disk=SLOTS, **options)
    disk = stack.tiers[0]
    assert f"{len(keys)} blocks recovered ({source})" in disk.note
    assert not os.path.lexists(Path(path) / SNAPSHOT_NAME), "the snapshot outlived the open"
    assert ready(disk, keys) == list(keys) and disk.usage().used == len(keys)
    loaded, out = get(stack, list(keys))
    assert (loaded.loaded, loaded.failed) == (len(keys), [])
    assert_exact(list(keys), loaded, out)
    disk.check_invariants()
    return stack


def identity(path, namespace=NAMESPACE) -> SlabIdentity:
    """The identity of the slab at ``path`` as it is now, as a snapshot names it."""
    st = os.stat(Path(path) / SLAB_NAME)
    stride = slot_stride(LAYOUT.block_bytes)
    digest = namespace_digest(namespace, LAYOUT)
    geometry = (VERSION, LAYOUT.block_bytes, stride, SLOTS, CODEC_IDS["none"], digest)
    return SlabIdentity(*geometry, st.st_ino, st.st_size, st.st_mtime_ns)


def forge(path, keys, slots, namespace=NAMESPACE) -> None:
    """Replace the snapshot at ``path`` by one naming ``keys`` at ``slots``, with a valid identity and
    checksum."""
    dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        forged = identity(path, namespace)
        write_snapshot(dir_fd, shared=False, identity=forged, keys=list(keys), slots=list(slots), sequence=1000)
    finally:
        os.close(dir_fd)


def rewrite(path, edit, checksum=True) -> None:
    """Edit the snapshot's bytes in place (``edit(bytearray)``), and make its checksum fit again."""
    file = Path(path) / SNAPSHOT_NAME
    raw = bytearray(file.read_bytes())
    edit(raw)
    if checksum:
        raw[-8:] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(raw[:-8])))
    file.write_bytes(raw)


def set_field(fmt: str, offset: int, value: int):
    return lambda raw: struct.pack_into(fmt, raw, offset, value)


def set_key_length(row: int, value: int):
    def edit(raw: bytearray) -> None:
        (count,) = struct.unpack_from("<Q", raw, COUNT_AT)
        (width,) = struct.unpack_from("<I", raw, WIDTH_AT)
        raw[len(raw) - 8 - count * (1 + width + 8) + row] = value

    return edit


# --- a clean close, a restart ---------------------------------------------------------------------


def test_a_clean_close_reopens_every_block_from_the_snapshot_bit_exact(tmp_path):
    slots = stored_and_closed(tmp_path)
    stack = reopened(tmp_path, "index snapshot")
    disk = stack.tiers[0]
    assert disk.slots(KEYS[:N]) == [slots[k] for k in KEYS[:N]]
    assert disk.ready_keys() == KEYS[:N]  # oldest first: the eviction order survives
    assert disk.stats.damaged == 0
    old = read_block_headers(tmp_path, SLOTS, LAYOUT, NAMESPACE)
    put(stack, KEYS[N : N + 2])  # new headers must be newer than every old one (a scan keeps the newest)
    new = read_block_headers(tmp_path, SLOTS, LAYOUT, NAMESPACE)
    assert min(new[s].sequence for s in disk.slots(KEYS[N : N + 2])) > max(h.sequence for h in old.values())
    stack.close()
    reopened(tmp_path, "index snapshot", KEYS[: N + 2]).close()


def test_the_snapshot_gives_what_a_scan_gives(tmp_path):
    stack = open_stack(tmp_path, host=0, disk=8)
    put(stack, KEYS[:20], batch=3)  # a full LRU tier: evictions, slots reused
    loaded, _ = get(stack, KEYS[14:16])  # touched: eviction order is not write order any more
    assert loaded.loaded == 2
    stack.close()
    answers = []
    for source in ("index snapshot", "scan"):
        if source == "scan":
            os.unlink(tmp_path / SNAPSHOT_NAME)
        stack = open_stack(tmp_path, host=0, disk=8)
        disk = stack.tiers[0]
        assert f"recovered ({source})" in disk.note
        answers.append(sorted(zip(disk.ready_keys(), disk.slots(disk.ready_keys()), strict=True)))
        stack.close()
    # (the same blocks at the same slots; the order may differ within one store, whose blocks take
    # their header sequence numbers in the order the I/O threads write them)
    assert answers[0] == answers[1] and len(answers[0]) == 8


@pytest.mark.parametrize("shared,mode", [(False, 0o600), (True, 0o660)])
def test_the_snapshot_is_private_whatever_the_umask(tmp_path, shared, mode):
    options = {"shared_directory": True} if shared else {}
    with umask(0):
        stored_and_closed(tmp_path / "cache", **options)
    assert stat.S_IMODE(os.stat(tmp_path / "cache" / SNAPSHOT_NAME).st_mode) == mode
    reopened(tmp_path / "cache", "index snapshot", **options).close()


def test_keys_of_every_length_round_trip(tmp_path):
    keys = [b"\x01", b"\x01\x00", b"\x01\x00\x00", KEYS[0], KEYS[1][:7] + bytes(9), bytes(63) + b"\x02", b"\xff" * 64]
    slots = stored_and_closed(tmp_path, keys)
    stack = reopened(tmp_path, "index snapshot", keys)
    assert stack.tiers[0].slots(keys) == [slots[k] for k in keys]
    stack.close()


def test_an_empty_tier_round_trips(tmp_path):
    stored_and_closed(tmp_path, [])
    reopened(tmp_path, "index snapshot", []).close()


# --- a crash ----------------------------------------------------------------------------------------

CHILD = r"""
import sys
sys.path.insert(0, sys.argv[1])
from helpers.disk_helpers import KEYS, open_stack, put
stack = open_stack(sys.argv[2], host=0, disk=int(sys.argv[3]))
put(stack, KEYS[int(sys.argv[4]) : int(sys.argv[5])])
print("STORED", flush=True)
sys.stdin.read()  # hold the tier until killed
"""


def test_a_crash_after_the_open_leaves_no_snapshot_and_the_scan_finds_every_block(tmp_path):
    stored_and_closed(tmp_path)
    tests = Path(__file__).parents[1]
    args = [str(tests), str(tmp_path), str(SLOTS), str(N), str(N + 4)]
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "STORED\n"
        assert not os.path.lexists(tmp_path / SNAPSHOT_NAME)  # taken by the child's open
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    reopened(tmp_path, "scan", KEYS[: N + 4]).close()


# --- stale snapshots -------------------------------------------------------------------------------


def test_an_older_snapshot_put_back_after_the_slab_was_written_is_ignored(tmp_path, caplog):
    stored_and_closed(tmp_path)
    older = (tmp_path / SNAPSHOT_NAME).read_bytes()
    stack = reopened(tmp_path, "index snapshot")
    put(stack, KEYS[N : N + 3])
    stack.close()
    (tmp_path / SNAPSHOT_NAME).write_bytes(older)
    with caplog.at_level(logging.WARNING):
        reopened(tmp_path, "scan", KEYS[: N + 3]).close()
    assert "index snapshot not used" in caplog.text and "stale" in caplog.text and "mtime_ns" in caplog.text


def test_a_slab_write_right_after_the_close_makes_the_snapshot_stale(tmp_path):
    """Where the kernel stamps files with a coarse clock, a write within the clock's tick leaves the
    mtime as it was; the close sets the mtime below its last write's, a time no later write gives, so
    even such a write shows (kernels with fine-grained stamps show it anyway)."""
    stack = open_stack(tmp_path, host=0, disk=SLOTS)
    put(stack, KEYS[:N])
    slots = dict(zip(KEYS[:N], stack.tiers[0].slots(KEYS[:N]), strict=True))
    last_write = os.stat(tmp_path / SLAB_NAME).st_mtime_ns
    stack.close()
    assert os.stat(tmp_path / SLAB_NAME).st_mtime_ns < last_write
    fd = os.open(tmp_path / SLAB_NAME, os.O_RDWR)
    try:
        os.pwrite(fd, bytes(4096), 4096 + slots[KEYS[3]] * slot_stride(LAYOUT.block_bytes))  # zero a header
    finally:
        os.close(fd)
    reopened(tmp_path, "scan", KEYS[:3] + KEYS[4:N]).close()


def test_a_slab_replaced_by_a_copy_is_scanned(tmp_path):
    stored_and_closed(tmp_path)
    copy = tmp_path / "copy"
    copy.write_bytes((tmp_path / SLAB_NAME).read_bytes())
    os.chmod(copy, 0o600)
    os.replace(copy, tmp_path / SLAB_NAME)
    reopened(tmp_path, "scan").close()


def test_a_reopen_at_another_capacity_scans(tmp_path, caplog):
    stored_and_closed(tmp_path)
    with caplog.at_level(logging.WARNING):
        stack = open_stack(tmp_path, host=0, disk=2 * SLOTS)
    assert f"{N} blocks recovered (scan)" in stack.tiers[0].note
    assert "changes the slab's geometry" in caplog.text
    assert not (tmp_path / SNAPSHOT_NAME).exists()
    stack.close()


# --- damaged and forged snapshots ------------------------------------------------------------------

DAMAGE = {
    "a flipped byte": lambda path: rewrite(path, lambda raw: raw.__setitem__(40, raw[40] ^ 1), checksum=False),
    "cut short": lambda path: (path / SNAPSHOT_NAME).write_bytes((path / SNAPSHOT_NAME).read_bytes()[:-100]),
    "empty": lambda path: (path / SNAPSHOT_NAME).write_bytes(b""),
    "not a snapshot": lambda path: (path / SNAPSHOT_NAME).write_bytes(os.urandom(1000)),
    "larger than any slab of this size": lambda path: os.truncate(path / SNAPSHOT_NAME, 1 << 40),
    "a huge count": lambda path: rewrite(path, set_field("<Q", COUNT_AT, 1 << 40)),
    "one block more than the file holds": lambda path: rewrite(path, set_field("<Q", COUNT_AT, N + 1)),
    "keys wider than any key": lambda path: rewrite(path, set_field("<I", WIDTH_AT, 65)),
    "an empty key": lambda path: rewrite(path, set_key_length(3, 0)),
    "a key longer than the key width": lambda path: rewrite(path, set_key_length(3, 17)),
    "a slot out of range": lambda path: forge(path, KEYS[:N], [*range(N - 1), SLOTS]),
    "a slot named twice": lambda path: forge(path, KEYS[:N], [*range(N - 1), 0]),
    "another namespace": lambda path: forge(path, KEYS[:N], range(N), namespace="model-b"),
}
WHY = {
    "a flipped byte": "checksum",
    "cut short": "checksum",
    "empty": "cannot describe",
    "not a snapshot": "checksum",
    "larger than any slab of this size": "cannot describe",
    "a huge count": "names 1099511627776 blocks",
    "one block more than the file holds": "do not hold",
    "keys wider than any key": "65 bytes wide",
    "an empty key": "key length",
    "a key longer than the key width": "key length",
    "a slot out of range": "outside",
    "a slot named twice": "named twice",
    "another namespace": "namespace",
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_or_forged_snapshot_is_ignored_and_the_slab_scanned(tmp_path, caplog, damage):
    stored_and_closed(tmp_path)
    DAMAGE[damage](tmp_path)
    with caplog.at_level(logging.WARNING):
        reopened(tmp_path, "scan").close()
    lines = [r.getMessage() for r in caplog.records if "index snapshot not used" in r.getMessage()]
    assert len(lines) == 1 and WHY[damage] in lines[0] and str(tmp_path) in lines[0], caplog.text


def test_a_forged_snapshot_pointing_keys_at_other_slots_only_causes_misses(tmp_path):
    """Every load checks its slot's header: a key sent to another block's slot fails, never returns
    that block's bytes as its own."""
    slots = stored_and_closed(tmp_path)
    a, b = KEYS[2], KEYS[5]
    forged = {**slots, a: slots[b], b: slots[a]}
    forge(tmp_path, KEYS[:N], [forged[k] for k in KEYS[:N]])
    stack = open_stack(tmp_path, host=0, disk=SLOTS)
    disk = stack.tiers[0]
    assert f"{N} blocks recovered (index snapshot)" in disk.note  # it passes every check of its own
    loaded, out = get(stack, KEYS[:N])
    assert loaded.hits == N and sorted(loaded.failed) == [2, 5] and loaded.loaded == N - 2
    assert_exact(KEYS[:N], loaded, out)
    for i in (2, 5):  # whatever the failed loads left in the buffer, it is reported failed: never used
        assert disk.state(KEYS[i]) is BlockState.FREE and stack.lookup([KEYS[i]]).hits == 0
    assert disk.stats.read_errors == 2
    disk.check_invariants()
    stack.close()


# --- whom the snapshot trusts ------------------------------------------------------------------------


@needs_root
def test_a_snapshot_another_user_owns_is_refused(tmp_path, caplog):
    stored_and_closed(tmp_path)
    os.chown(tmp_path / SNAPSHOT_NAME, NOBODY, NOBODY)
    with caplog.at_level(logging.WARNING):
        reopened(tmp_path, "scan").close()
    assert f"belongs to uid {NOBODY}" in caplog.text and str(tmp_path / SNAPSHOT_NAME) in caplog.text


@pytest.mark.parametrize(
    "mode,shared,used", [(0o620, False, False), (0o602, False, False), (0o660, True, True), (0o666, True, False)]
)
def test_a_snapshot_others_can_write_is_refused(tmp_path, caplog, mode, shared, used):
    options = {"shared_directory": True} if shared else {}
    stored_and_closed(tmp_path / "cache", **options)
    os.chmod(tmp_path / "cache" / SNAPSHOT_NAME, mode)
    with caplog.at_level(logging.WARNING):
        reopened(tmp_path / "cache", "index snapshot" if used else "scan", **options).close()
    assert ("writable by" in caplog.text) is not used


def test_a_snapshot_that_is_a_link_is_refused_and_its_target_left_alone(tmp_path, caplog):
    cache = tmp_path / "cache"
    stored_and_closed(cache)
    target = tmp_path / "target"
    os.replace(cache / SNAPSHOT_NAME, target)  # a valid snapshot, reached through a link
    before = target.read_bytes()
    (cache / SNAPSHOT_NAME).symlink_to(target)
    with caplog.at_level(logging.WARNING):
        reopened(cache, "scan").close()
    assert "symbolic link" in caplog.text
    assert target.read_bytes() == before


def test_a_snapshot_with_a_second_name_is_refused_and_that_name_left_alone(tmp_path, caplog):
    cache = tmp_path / "cache"
    stored_and_closed(cache)
    (tmp_path / "other-name").hardlink_to(cache / SNAPSHOT_NAME)
    before = (tmp_path / "other-name").read_bytes()
    with caplog.at_level(logging.WARNING):
        reopened(cache, "scan").close()
    assert "hard links" in caplog.text
    assert (tmp_path / "other-name").read_bytes() == before


def test_a_fifo_as_the_snapshot_cannot_hold_up_the_open(tmp_path, caplog):
    stored_and_closed(tmp_path)
    os.unlink(tmp_path / SNAPSHOT_NAME)
    os.mkfifo(tmp_path / SNAPSHOT_NAME, 0o600)
    with caplog.at_level(logging.WARNING):
        reopened(tmp_path, "scan").close()
    assert "not a regular file" in caplog.text


def test_a_file_planted_under_the_temporary_name_is_never_written_through(tmp_path):
    cache = tmp_path / "cache"
    stored_and_closed(cache)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious bytes\n" * 100)
    (cache / (SNAPSHOT_NAME + ".tmp")).hardlink_to(victim)
    stack = reopened(cache, "index snapshot")
    stack.close()
    assert victim.read_bytes() == b"precious bytes\n" * 100
    assert not (cache / (SNAPSHOT_NAME + ".tmp")).exists()
    reopened(cache, "index snapshot").close()


def test_a_directory_under_the_snapshots_name_costs_the_snapshot_not_the_tier(tmp_path, caplog):
    stored_and_closed(tmp_path)
    os.unlink(tmp_path / SNAPSHOT_NAME)
    (tmp_path / SNAPSHOT_NAME).mkdir()
    (tmp_path / SNAPSHOT_NAME / "inside").write_bytes(b"x")
    with caplog.at_level(logging.WARNING):
        stack = open_stack(tmp_path, host=0, disk=SLOTS)
        assert f"{N} blocks recovered (scan)" in stack.tiers[0].note
        stack.close()  # cannot rename over a directory: logged, the tier closes
    assert "index snapshot not used" in caplog.text and "index snapshot not written" in caplog.text
    stack = open_stack(tmp_path, host=0, disk=SLOTS)
    loaded, out = get(stack, KEYS[:N])
    assert loaded.loaded == N and not loaded.failed
    assert np.array_equal(out[0], data(KEYS[0]))
    stack.close()


# --- restoring while the tier serves (``core/restore.py``) -------------------------------------


class Gate:
    """Holds a disk tier's restore thread before each chunk until the test lets it through (``allow``):
    which blocks are back is the test's choice, with no timing involved."""

    def __init__(self) -> None:
        self._permits = threading.Semaphore(0)
        self._passed = threading.Condition()
        self._steps = 0

    def wrap(self, step):
        def gated(restore: ChunkedRestore) -> bool:
            if restore.thread is not threading.current_thread():
                return step(restore)  # a restore of one chunk, before the open returns
            self._permits.acquire()
            try:
                return step(restore)
            finally:
                with self._passed:
                    self._steps += 1
                    self._passed.notify_all()

        return gated

    def allow(self, chunks: int) -> None:
        """Let ``chunks`` more chunks through, and wait until they are in."""
        with self._passed:
            target = self._steps + chunks
            self._permits.release(chunks)
            assert self._passed.wait_for(lambda: self._steps >= target, timeout=60)

    def finish(self, disk) -> None:
        """Let every chunk through and wait until the restore thread has ended."""
        self._permits.release(SLOTS)
        restoring = disk.storage.slab.restoring
        restoring.thread.join(timeout=60)
        assert not restoring.thread.is_alive() and restoring.done.is_set()


@pytest.fixture
def gate(monkeypatch):
    """Restores of two blocks a chunk, each chunk held until the test allows it."""
    monkeypatch.setattr(ChunkedRestore, "chunk", 2)
    gate = Gate()
    monkeypatch.setattr(ChunkedRestore, "step", gate.wrap(ChunkedRestore.step))
    yield gate
    gate._permits.release(SLOTS)  # (a test that failed half way leaves no thread waiting)


def free_slots(disk) -> int:
    return disk.capacity - disk.usage().used


def test_blocks_come_back_chunk_by_chunk_and_load_bit_exact_once_in(tmp_path, gate):
    slots = stored_and_closed(tmp_path)
    stack = open_stack(tmp_path, host=0, disk=SLOTS)
    disk = stack.tiers[0]
    assert f"{N} blocks recovered (index snapshot)" in disk.note
    assert disk.usage().used == N  # every slot is taken from the start, no block is readable yet
    loaded, _ = get(stack, KEYS[:N])
    assert (stack.lookup(KEYS[:N]).hits, loaded.hits, loaded.failed) == (0, 0, [])  # a miss, not an error
    disk.check_invariants()
    gate.allow(2)  # oldest first: the first four
    assert ready(disk, KEYS[:N]) == KEYS[:4] and disk.slots(KEYS[:4]) == [slots[k] for k in KEYS[:4]]
    loaded, out = get(stack, KEYS[:N])
    assert (loaded.hits, loaded.loaded, loaded.failed) == (4, 4, [])
    assert_exact(KEYS[:4], loaded, out)
    disk.check_invariants()
    gate.finish(disk)
    assert disk.ready_keys() == KEYS[:N] and disk.slots(KEYS[:N]) == [slots[k] for k in KEYS[:N]]
    loaded, out = get(stack, KEYS[:N])
    assert (loaded.hits, loaded.loaded, loaded.failed) == (N, N, [])
    assert_exact(KEYS[:N], loaded, out)
    assert disk.usage().used == N and disk.leaks() == {"pinned": 0, "writing": 0}
    disk.check_invariants()
    stack.close()


def test_a_store_of_a_block_still_to_come_back_wins(tmp_path, gate):
    """The store's bytes stay (salted here, so they differ from the old copy), the old slot is freed
    when its chunk comes, and the next open has the stored block."""
    old = stored_and_closed(tmp_path)
    stack = open_stack(tmp_path, host=0, disk=SLOTS)
    disk = stack.tiers[0]
    gate.allow(1)
    new = KEYS[5]
    put(stack, [new], salt=b"again")
    assert disk.state(new) is BlockState.READY and disk.slots([new])[0] not in old.values()
    assert free_slots(disk) == SLOTS - N - 1
    gate.finish(disk)
    assert free_slots(disk) == SLOTS - N  # the old copy's slot is free again: none leaked
    assert disk.ready_keys() == KEYS[:2] + [new] + KEYS[2:5] + KEYS[6:N]
    loaded, out = get(stack, [new])
    assert loaded.loaded == 1 and np.array_equal(out[0], data(new, b"again"))
    disk.check_invariants()
    put(stack, KEYS[N : N + SLOTS - N])  # every free slot is handed out, the old copy's too
    assert disk.usage().used == SLOTS and disk.lookup([new]) == 1
    stack.close()
    stack = open_stack(tmp_path, host=0, disk=SLOTS)
    gate.finish(stack.tiers[0])  # (the reopen restores on a thread too: a block not back yet is a miss)
    loaded, out = get(stack, [new])
    assert loaded.loaded == 1 and np.array_equal(out[0], data(new, b"again"))
    stack.close()


def test_a_close_mid_restore_keeps_every_block(tmp_path, gate):
    """The snapshot lists the blocks back, the blocks stored meanwhile and, after them, the blocks
    still to come (less one stored again meanwhile): the next open has every one."""
    stored_and_closed(tmp_path)
    stack = open_stack(tmp_path, host=0, disk=SLOTS)
    disk = stack.tiers[0]
    gate.allow(2)
    put(stack, KEYS[N : N + 2])
    put(stack, [KEYS[8]], salt=b"again")  # its old copy is still to come back
    stack.close()
    gate.finish(disk)
    stack = open_stack(tmp_path, host=0, disk=SLOTS)  # (chunks of two, none held: the gate is the thread's)
    disk = stack.tiers[0]
    assert f"{N + 2} blocks recovered (index snapshot)" in disk.note
    gate.finish(disk)
    assert disk.ready_keys() == KEYS[:4] + KEYS[N : N + 2] + [KEYS[8]] + KEYS[4:8] + [KEYS[9]]
    assert disk.usage().used == N + 2
    keys = [k for k in KEYS[: N + 2] if k != KEYS[8]]
    loaded, out = get(stack, keys)
    assert (loaded.loaded, loaded.failed) == (N + 1, [])
    assert_exact(keys, loaded, out)
    loaded, out = get(stack, [KEYS[8]])
    assert loaded.loaded == 1 and np.array_equal(out[0], data(KEYS[8], b"again"))
    disk.check_invariants()
    stack.close()


def test_eviction_during_the_restore_takes_only_blocks_already_back(tmp_path, gate):
    stored_and_closed(tmp_path, KEYS[:SLOTS])  # a full tier
    stack = open_stack(tmp_path, host=0, disk=SLOTS)
    disk = stack.tiers[0]
    gate.allow(1)  # KEYS[0] and KEYS[1] are back, the other 14 still to come
    put(stack, KEYS[SLOTS : SLOTS + 2])  # room made by evicting the two blocks back
    assert disk.state(KEYS[0]) is disk.state(KEYS[1]) is BlockState.FREE
    assert disk.stats.evicted == 2
    (result,) = put(stack, KEYS[SLOTS + 2 : SLOTS + 5])  # three, two blocks to evict: the blocks to come stay
    assert (result.stored, result.dropped) == (2, 1) and disk.stats.evicted == 4
    assert disk.ready_keys() == KEYS[SLOTS + 2 : SLOTS + 4]
    gate.finish(disk)
    keys = KEYS[SLOTS + 2 : SLOTS + 4] + KEYS[2:SLOTS]
    assert disk.ready_keys() == keys and disk.usage().used == SLOTS
    loaded, out = get(stack, keys)
    assert (loaded.loaded, loaded.failed) == (SLOTS, [])
    assert_exact(keys, loaded, out)
    disk.check_invariants()
    stack.close()


@pytest.mark.parametrize("chunk", [2, 64], ids=["chunks-of-2", "one-chunk"])
@pytest.mark.parametrize("wrong", ["second", "first"])
def test_a_forged_snapshot_naming_a_key_twice_never_serves_wrong_bytes(tmp_path, monkeypatch, chunk, wrong):
    """KEYS[0] named at its own slot and at KEYS[9]'s: the first one named stays, the other slot is
    freed. Where the first is the wrong one, its load fails its header check and is dropped."""
    monkeypatch.setattr(ChunkedRestore, "chunk", chunk)
    slots = stored_and_closed(tmp_path)
    own, other = (slots[KEYS[0]], slots[KEYS[9]]) if wrong == "second" else (slots[KEYS[9]], slots[KEYS[0]])
    forge(tmp_path, [KEYS[0], *KEYS[1 : N - 1], KEYS[0]], [own, *(slots[k] for k in KEYS[1 : N - 1]), other])
    stack = open_stack(tmp_path, host=0, disk=SLOTS)
    disk = stack.tiers[0]
    disk.storage.slab.restoring.done.wait(timeout=60)
    assert disk.usage().used == N - 1 and disk.lookup([KEYS[9]]) == 0
    loaded, out = get(stack, KEYS[: N - 1])
    assert loaded.hits == N - 1 and loaded.failed == ([] if wrong == "second" else [0])
    assert_exact(KEYS[: N - 1], loaded, out)
    if wrong == "first":
        assert disk.state(KEYS[0]) is BlockState.FREE and disk.stats.read_errors == 1
    disk.check_invariants()
    stack.close()


def test_a_restore_that_fails_drops_the_blocks_not_back_and_frees_their_slots(tmp_path, gate, monkeypatch, caplog):
    stored_and_closed(tmp_path)
    restore_claimed = Tier.restore_claimed

    def fails_on_the_third_chunk(tier, keys, slots, then=None):
        if KEYS[4] in keys:
            raise MemoryError("injected")
        return restore_claimed(tier, keys, slots, then)

    monkeypatch.setattr(Tier, "restore_claimed", fails_on_the_third_chunk)
    stack = open_stack(tmp_path, host=0, disk=SLOTS)
    disk = stack.tiers[0]
    with caplog.at_level(logging.ERROR):
        gate.finish(disk)
    assert "restoring its index failed" in caplog.text and "MemoryError: injected" in caplog.text
    assert disk.ready_keys() == KEYS[:4] and disk.usage().used == 4  # the other slots are free
    put(stack, KEYS[N : N + SLOTS - 4])  # and handed out again
    assert disk.usage().used == SLOTS
    disk.check_invariants()
    stack.close()
    stack = open_stack(tmp_path, host=0, disk=SLOTS)  # the snapshot lists what the tier held, nothing dropped
    disk = stack.tiers[0]
    gate.finish(disk)
    keys = KEYS[:4] + KEYS[N : N + SLOTS - 4]
    assert disk.ready_keys() == keys
    loaded, out = get(stack, keys)
    assert (loaded.loaded, loaded.failed) == (SLOTS, [])
    assert_exact(keys, loaded, out)
    stack.close()
