"""Whom the disk tier trusts: only a directory and slab of the running user's own, and inputs that must
not hang, crash or destroy anything (issue 11). Real files, real modes and owners (uid 65534 plays
another user where the test runs as root), real second processes.

Invariants checked:
- a slab name that is a symbolic link is refused, and its target (a root-owned file elsewhere) is left
  byte for byte; a planted ``kvtier.lock`` link is ignored and its target left alone;
- a directory or slab that another user owns, or that others can write, is refused with an error naming
  the path and the fix; ``shared_directory`` accepts another owner and group write, never write by every
  user; a directory name that is a link another user owns is refused;
- blocks planted by another user are never loaded: the tier refuses to open, and the vLLM restart
  recovery (``read_block_headers``) finds nothing and says why;
- whatever the umask, a new directory and its new parents are 0700 and a new slab 0600 (0660 shared); an
  older slab others can read is narrowed to 0600;
- a file of the slab's name that is not a kvtier slab is refused and left byte for byte, unless
  ``reinitialise: true``; a zero-filled one (a crash right after creating it) is fresh; a slab with a
  second name (hard link) is refused;
- the lock is on the slab itself: a second process is refused also once a lock file is deleted;
- a key longer than a slot header holds fails its block only; a 64-byte key comes back after a restart;
- a forged file header (2^40 slots, a nonsensical stride) or a FIFO as the slab: ``inspect_slab``,
  ``read_block_headers`` and ``kvtier inspect`` answer within a second;
- a capacity the filesystem cannot hold is refused naming the tier and the size, leaving no slab and no
  descriptor behind; a slab the failed open did not create keeps its blocks.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import struct
import subprocess
import sys
import threading

import numpy as np
import pytest
import xxhash

from helpers.disk_helpers import CHILD_OPEN, KEYS, LAYOUT, assert_exact, config_dict, data, get, open_stack, put, umask
from helpers.stack_helpers import key
from kvtier.cli import main
from kvtier.core.keys import MAX_KEY_BYTES
from kvtier.core.storage import buffer_storage
from kvtier.core.transfer import Transfer
from kvtier.tiers.disk.files import SLAB_NAME, DiskTierError
from kvtier.tiers.disk.inspect import inspect_slab, read_block_headers
from kvtier.tiers.disk.slab import DiskSlab, FileStorage
from kvtier.tiers.disk.slots import PAGE
from kvtier.tiers.disk.transfer import DiskBackend

NOBODY = 65534  # another user
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="playing another user needs root (chown)")
# The file header's layout (tiers/disk/format.py): magic, version, block_bytes, slot_stride, num_slots, codec id,
# then an xxh3-64 checksum of those fields.
FILE_HEADER = struct.Struct("<8sIQQQB")
FILE_HEADER_FIELDS = ("magic", "version", "block_bytes", "slot_stride", "num_slots", "codec")


# --- helpers ------------------------------------------------------------------------------------


def private_dir(path):
    path.mkdir(mode=0o700)
    os.chmod(path, 0o700)
    return path


def precious_file(tmp_path):
    """A file outside the tier's directory (root's, when the tests run as root), which nothing may change."""
    victim = private_dir(tmp_path / "outside") / "victim"
    victim.write_bytes(b"precious bytes\n" * 500)
    return victim


def snapshot(path) -> tuple:
    st = os.stat(path)
    return path.read_bytes(), stat.S_IMODE(st.st_mode), st.st_uid, st.st_size


def mode_of(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def written_and_closed(path, keys=KEYS[:4], salt=b"", **options) -> None:
    """A slab at ``path`` holding ``keys`` (bytes named by ``salt``), closed."""
    stack = open_stack(path, host=0, disk=8, **options)
    put(stack, keys, salt)
    stack.close()


def assert_blocks_back(path, keys=KEYS[:4], **options) -> None:
    """The tier at ``path`` opens and serves ``keys`` bit-exact."""
    stack = open_stack(path, host=0, disk=8, **options)
    loaded, out = get(stack, keys)
    assert loaded.loaded == len(keys) and not loaded.failed
    assert_exact(keys, loaded, out)
    stack.close()


def returns_within(seconds: float, fn, *args):
    """``fn(*args)``'s result (or its exception), failing the test when it takes longer than ``seconds``
    (it runs on a daemon thread, so a hang cannot hold up the test run)."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = fn(*args)
        except BaseException as exc:  # handed to the test below
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{getattr(fn, '__name__', fn)} did not return within {seconds} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def forge_file_header(slab_path, **fields) -> None:
    """Rewrite a slab's file header with some fields changed and a matching checksum, as a forger would."""
    with open(slab_path, "r+b") as f:
        values = dict(zip(FILE_HEADER_FIELDS, FILE_HEADER.unpack(f.read(FILE_HEADER.size)), strict=True))
        body = FILE_HEADER.pack(*{**values, **fields}.values())
        f.seek(0)
        f.write(body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)))


def sharing(shared: bool) -> dict:
    """The disk tier option for ``shared``, left out when False (the default) as most configs do."""
    return {"shared_directory": True} if shared else {}


def words(text: str) -> str:
    return " ".join(text.split())  # the CLI's console wraps long lines


# --- symbolic links and foreign files -------------------------------------------------------------


def test_a_slab_that_is_a_symlink_is_refused_and_its_target_left_untouched(tmp_path, caplog):
    victim = precious_file(tmp_path)
    cache = private_dir(tmp_path / "cache")
    (cache / SLAB_NAME).symlink_to(victim)
    before = snapshot(victim)
    with pytest.raises(DiskTierError) as err:
        open_stack(cache)
    assert str(cache / SLAB_NAME) in str(err.value) and "symbolic link" in str(err.value)
    with pytest.raises(DiskTierError, match="symbolic link"):
        inspect_slab(cache)
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"):
        assert read_block_headers(cache, 16, LAYOUT, "model-a") == {}
    assert "symbolic link" in caplog.text
    assert snapshot(victim) == before
    assert (cache / SLAB_NAME).is_symlink()


def test_a_planted_lock_file_link_is_ignored_and_its_target_left_untouched(tmp_path):
    victim = precious_file(tmp_path)
    cache = private_dir(tmp_path / "cache")
    (cache / "kvtier.lock").symlink_to(victim)
    before = snapshot(victim)
    written_and_closed(cache)
    assert_blocks_back(cache)
    assert snapshot(victim) == before


@needs_root
def test_a_directory_link_another_user_owns_is_refused(tmp_path):
    real = private_dir(tmp_path / "real")
    link = tmp_path / "link"
    link.symlink_to(real)
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(DiskTierError) as err:
        open_stack(link)
    assert str(link) in str(err.value) and f"uid {NOBODY}" in str(err.value)
    assert os.listdir(real) == []
    os.lchown(link, os.geteuid(), os.getegid())  # a link of this user's own is followed
    written_and_closed(link)
    assert_blocks_back(real)


def test_a_file_that_is_not_a_slab_is_never_overwritten_unless_reinitialise(tmp_path, caplog):
    crashed = private_dir(tmp_path / "crashed")  # a crash right after creating the slab: zeros, fresh
    (crashed / SLAB_NAME).write_bytes(bytes(3 * PAGE))
    written_and_closed(crashed)
    assert_blocks_back(crashed)

    cache = private_dir(tmp_path / "cache")
    notes = cache / SLAB_NAME
    notes.write_bytes(b"someone's notes, not a cache\n" * 1000)
    before = notes.read_bytes()
    with pytest.raises(DiskTierError) as err:
        open_stack(cache)
    assert str(notes) in str(err.value) and "reinitialise: true" in str(err.value)
    assert notes.read_bytes() == before
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"):
        written_and_closed(cache, reinitialise=True)
    assert "not a kvtier slab; overwriting it" in caplog.text
    assert_blocks_back(cache)


def test_a_slab_with_a_second_name_is_refused(tmp_path):
    cache = tmp_path / "cache"
    written_and_closed(cache)
    (tmp_path / "other-name").hardlink_to(cache / SLAB_NAME)
    before = snapshot(cache / SLAB_NAME)
    with pytest.raises(DiskTierError) as err:
        open_stack(cache)
    assert str(cache / SLAB_NAME) in str(err.value) and "hard links" in str(err.value)
    assert read_block_headers(cache, 8, LAYOUT, "model-a") == {}
    assert snapshot(cache / SLAB_NAME) == before


# --- owners and modes ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode,shared,fix",
    [
        (0o777, False, "chmod 700"),
        (0o1777, False, "chmod 700"),
        (0o770, False, "chmod 700"),
        (0o777, True, "chmod o-w"),
        (0o1777, True, "chmod o-w"),
        (0o770, True, None),
    ],
)
def test_a_directory_others_can_write_is_refused(tmp_path, mode, shared, fix):
    cache = private_dir(tmp_path / "cache")
    os.chmod(cache, mode)
    if fix is None:  # group write in a shared directory: accepted
        written_and_closed(cache, **sharing(shared))
        assert_blocks_back(cache, **sharing(shared))
        return
    with pytest.raises(DiskTierError) as err:
        open_stack(cache, **sharing(shared))
    message = str(err.value)
    assert str(cache) in message and f"{fix} {cache}" in message
    assert os.listdir(cache) == [], "a refused directory was written to"


@needs_root
@pytest.mark.parametrize("shared", [False, True])
def test_a_directory_another_user_owns_is_refused_unless_shared(tmp_path, capsys, shared):
    cache = private_dir(tmp_path / "cache")
    os.chown(cache, NOBODY, NOBODY)
    if shared:
        written_and_closed(cache, shared_directory=True)
        assert mode_of(cache / SLAB_NAME) == 0o660 and os.stat(cache / SLAB_NAME).st_uid == os.geteuid()
        assert_blocks_back(cache, shared_directory=True)
        assert main(["inspect", "--shared-directory", "--json", str(cache)]) == 0
        assert json.loads(capsys.readouterr().out)["blocks"] == 4
        assert main(["inspect", str(cache)]) == 1  # inspect trusts what the tier trusts
        assert f"uid {NOBODY}" in words(capsys.readouterr().out)
        return
    with pytest.raises(DiskTierError) as err:
        open_stack(cache)
    message = str(err.value)
    assert str(cache) in message and f"uid {NOBODY}" in message and f"chown {os.geteuid()} {cache}" in message
    assert os.listdir(cache) == []


@needs_root
@pytest.mark.parametrize("shared", [False, True])
def test_a_slab_another_user_owns_is_refused_unless_shared(tmp_path, shared):
    cache = tmp_path / "cache"
    written_and_closed(cache, **sharing(shared))
    os.chown(cache / SLAB_NAME, NOBODY, NOBODY)
    if shared:
        assert_blocks_back(cache, shared_directory=True)
        return
    before = snapshot(cache / SLAB_NAME)
    with pytest.raises(DiskTierError) as err:
        open_stack(cache)
    assert str(cache / SLAB_NAME) in str(err.value) and f"uid {NOBODY}" in str(err.value)
    assert snapshot(cache / SLAB_NAME) == before


@needs_root
@pytest.mark.parametrize("plant", ["their directory", "their slab in a directory anyone can write"])
def test_blocks_planted_by_another_user_are_never_loaded(tmp_path, plant, caplog):
    """Another user stores bytes of their choosing under the keys of a guessable prompt (a system
    prompt), where this engine's tier will look: the tier refuses to open, the restart recovery finds
    nothing, so none of their bytes can reach a KV cache."""
    cache = tmp_path / "cache"
    written_and_closed(cache, KEYS[:4], salt=b"attacker")
    os.chown(cache / SLAB_NAME, NOBODY, NOBODY)
    if plant == "their directory":
        os.chown(cache, NOBODY, NOBODY)
    else:
        os.chmod(cache, 0o777)
    with pytest.raises(DiskTierError) as err:
        open_stack(cache, host=0, disk=8)
    assert str(cache) in str(err.value)
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"):
        assert read_block_headers(cache, 8, LAYOUT, "model-a") == {}
    assert str(cache) in caplog.text and "none of its blocks are kept" in caplog.text


@pytest.mark.parametrize("mask", [0o000, 0o277])  # open to all; or so tight that mkdir's mode is not even writable
@pytest.mark.parametrize("shared", [False, True])
def test_new_files_are_private_whatever_the_umask(tmp_path, mask, shared):
    cache = tmp_path / "a" / "b" / "cache"
    with umask(mask):
        stack = open_stack(cache, host=0, disk=8, **sharing(shared))
    put(stack, KEYS[:4])
    stack.close()
    assert [mode_of(p) for p in (tmp_path / "a", tmp_path / "a" / "b", cache)] == [0o700] * 3
    assert mode_of(cache / SLAB_NAME) == (0o660 if shared else 0o600)
    assert_blocks_back(cache, **sharing(shared))


def test_an_older_slab_others_can_read_is_narrowed(tmp_path):
    cache = tmp_path / "cache"
    written_and_closed(cache)
    os.chmod(cache / SLAB_NAME, 0o644)  # what kvtier created before
    assert_blocks_back(cache)
    assert mode_of(cache / SLAB_NAME) == 0o600


# --- the lock -------------------------------------------------------------------------------------------


def test_a_deleted_lock_file_does_not_let_a_second_process_in(tmp_path):
    cache = tmp_path / "cache"
    stack = open_stack(cache)
    with contextlib.suppress(FileNotFoundError):
        (cache / "kvtier.lock").unlink()  # what kvtier locked before: deleting it must change nothing
    child = subprocess.run(
        [sys.executable, "-c", CHILD_OPEN, json.dumps(config_dict(cache))],
        input="",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == 3, child.stdout + child.stderr
    assert f"in use by pid {os.getpid()}" in child.stdout
    put(stack, KEYS[:4])
    stack.close()


# --- keys -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [MAX_KEY_BYTES + 1, 100, 70_000])
def test_a_key_longer_than_a_slot_header_holds_fails_only_its_block(tmp_path, run_transfer, length):
    slab = DiskSlab(tmp_path, 4, LAYOUT, "model-a")
    disk = FileStorage(slab, LAYOUT)
    backend = DiskBackend(2)
    keys = [KEYS[0], key(1)[:1] * length, KEYS[2]]
    blocks = np.stack([data(k) for k in keys])
    failed = run_transfer(backend, Transfer(buffer_storage(blocks, LAYOUT), [0, 1, 2], disk, [0, 1, 2], keys))
    assert failed == {1}  # not the whole job
    out = np.zeros((2, LAYOUT.block_bytes), np.uint8)
    failed = run_transfer(
        backend, Transfer(disk, [0, 2], buffer_storage(out, LAYOUT, writable=True), [0, 1], [keys[0], keys[2]])
    )
    assert failed == set()
    assert np.array_equal(out, blocks[[0, 2]])
    backend.close()
    slab.close()
    slab = DiskSlab(tmp_path, 4, LAYOUT, "model-a")
    recovered, damaged = slab.scan()  # the long key's slot holds no header
    assert sorted(k for _, k, _ in recovered) == sorted([keys[0], keys[2]]) and damaged == 0
    slab.close()


def test_a_64_byte_key_comes_back_after_a_restart(tmp_path):
    # the same first 32 bytes: a header that kept only those would confuse them
    keys = [b"p" * 32 + key(i)[:1] * (MAX_KEY_BYTES - 32) for i in range(4)]
    written_and_closed(tmp_path / "cache", keys)
    assert_blocks_back(tmp_path / "cache", keys)


# --- hostile slab files: bounded answers ----------------------------------------------------------------


@pytest.mark.parametrize("forged", [{"num_slots": 2**40}, {"num_slots": 2**40, "slot_stride": 100}])
def test_a_forged_file_header_is_read_within_the_files_real_size(tmp_path, capsys, forged):
    cache = tmp_path / "cache"
    written_and_closed(cache)
    forge_file_header(cache / SLAB_NAME, **forged)
    if "slot_stride" in forged:
        with pytest.raises(DiskTierError, match="slot stride of 100 bytes"):
            returns_within(1, inspect_slab, cache)
    else:
        info = returns_within(1, inspect_slab, cache)
        assert (info["slots"], info["blocks"], info["free_slots"]) == (8, 4, 4)  # what the file really holds
    assert returns_within(1, main, ["inspect", str(cache)]) == (1 if "slot_stride" in forged else 0)
    headers = returns_within(1, read_block_headers, cache, 8, LAYOUT, "model-a")
    assert len(headers) == (0 if "slot_stride" in forged else 4)  # another geometry reads nothing


def test_a_fifo_as_the_slab_is_refused_at_once(tmp_path, capsys, caplog):
    cache = private_dir(tmp_path / "cache")
    os.mkfifo(cache / SLAB_NAME, 0o600)
    with pytest.raises(DiskTierError, match="not a regular file"):
        returns_within(1, inspect_slab, cache)
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"):
        assert returns_within(1, read_block_headers, cache, 8, LAYOUT, "model-a") == {}
    assert str(cache / SLAB_NAME) in caplog.text and "not a regular file" in caplog.text
    capsys.readouterr()
    assert returns_within(1, main, ["inspect", str(cache)]) == 1
    assert "not a regular file" in words(capsys.readouterr().out)
    with pytest.raises(DiskTierError, match="not a regular file"):
        returns_within(1, open_stack, cache)
    assert stat.S_ISFIFO(os.lstat(cache / SLAB_NAME).st_mode)


# --- opening failures ----------------------------------------------------------------------------------


@pytest.mark.parametrize("capacity_blocks", [2**40, 2**60])
def test_a_capacity_the_filesystem_cannot_hold_names_the_tier_and_leaves_nothing(tmp_path, capacity_blocks):
    cache = tmp_path / "cache"
    descriptors = len(os.listdir("/proc/self/fd"))
    with pytest.raises(DiskTierError) as err:
        open_stack(cache, disk=capacity_blocks)
    file_bytes = PAGE + capacity_blocks * (PAGE + LAYOUT.block_bytes)
    message = str(err.value)
    assert str(cache) in message and str(file_bytes) in message and "lower its capacity" in message
    assert os.listdir(cache) == [], "a failed open left a file behind"
    assert len(os.listdir("/proc/self/fd")) == descriptors, "a failed open left a descriptor open"


def test_a_failed_open_keeps_a_slab_it_did_not_create(tmp_path):
    cache = tmp_path / "cache"
    written_and_closed(cache)
    before = snapshot(cache / SLAB_NAME)
    with pytest.raises(DiskTierError):
        open_stack(cache, host=0, disk=2**40)
    assert snapshot(cache / SLAB_NAME) == before
    assert_blocks_back(cache)
