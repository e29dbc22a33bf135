"""``read_block_headers``: another process's view of a disk tier's blocks (the vLLM scheduler side
reading the workers' slabs), taken while the owner holds the directory lock, without writing.

Invariants checked: it reports exactly the slots the owner's index holds, with their keys; it leaves
the file byte for byte as it was and the lock with its holder; another namespace, fragment geometry,
block size or codec reads nothing; a damaged header or a slot past ``num_slots`` is left out; a
directory without a slab reads nothing and is not created.
"""

from __future__ import annotations

import hashlib
import logging

import pytest

from helpers.disk_helpers import KEYS, config_dict, open_stack, put
from helpers.stack_helpers import flip, ready
from kvtier.builder import config_layout
from kvtier.core.config import load_config
from kvtier.core.layout import BlockLayout
from kvtier.tiers.disk.files import SLAB_NAME
from kvtier.tiers.disk.inspect import inspect_slab, read_block_headers
from kvtier.tiers.disk.slots import PAGE

LAYOUT = config_layout(load_config(config_dict("unused")))


def file_digest(path) -> str:
    return hashlib.sha256((path / SLAB_NAME).read_bytes()).hexdigest()


def test_reads_the_owners_blocks_while_it_holds_the_lock_and_writes_nothing(tmp_path):
    stack = open_stack(tmp_path, host=0, disk=8)
    (disk,) = stack.tiers
    put(stack, KEYS[:5], batch=1)
    before = file_digest(tmp_path)
    headers = read_block_headers(tmp_path, 8, LAYOUT, "model-a")
    assert {slot: h.key for slot, h in headers.items()} == {disk.slots([k])[0]: k for k in KEYS[:5]}
    assert all(h.length == LAYOUT.block_bytes for h in headers.values())
    assert len({h.sequence for h in headers.values()}) == 5  # each write has its own sequence
    assert file_digest(tmp_path) == before
    assert inspect_slab(tmp_path)["lock_holder"] is not None  # still the owner's
    put(stack, KEYS[5:6])  # the owner goes on working
    assert len(read_block_headers(tmp_path, 8, LAYOUT, "model-a")) == 6
    stack.close()


@pytest.mark.parametrize("change", ["namespace", "fragments", "block size", "codec"])
def test_another_namespace_or_geometry_reads_nothing(tmp_path, change):
    stack = open_stack(tmp_path, host=0, disk=8)
    put(stack, KEYS[:4])
    stack.close()
    namespace, layout, compression = "model-a", LAYOUT, "none"
    if change == "namespace":
        namespace = "model-b"
    elif change == "fragments":  # the same block size cut another way
        layout = BlockLayout((LAYOUT.block_bytes // 2,) * 2)
    elif change == "block size":
        layout = BlockLayout((LAYOUT.block_bytes // 8,) * 4)
    else:
        compression = "lz4"
    assert read_block_headers(tmp_path, 8, layout, namespace, compression) == {}
    assert len(read_block_headers(tmp_path, 8, LAYOUT, "model-a")) == 4  # nothing was lost by looking


def test_damaged_headers_and_slots_past_the_end_are_left_out(tmp_path):
    stack = open_stack(tmp_path, host=0, disk=8)
    (disk,) = stack.tiers
    put(stack, KEYS[:6], batch=1)
    slots = {k: disk.slots([k])[0] for k in KEYS[:6]}
    stack.close()
    damaged = KEYS[1]
    flip(tmp_path / SLAB_NAME, PAGE + slots[damaged] * (PAGE + LAYOUT.block_bytes) + 40)  # inside the key
    found = read_block_headers(tmp_path, 8, LAYOUT, "model-a")
    assert {h.key for h in found.values()} == set(KEYS[:6]) - {damaged}
    cut = read_block_headers(tmp_path, 3, LAYOUT, "model-a")  # a smaller slab keeps slots 0..2
    assert set(cut) == {s for k, s in slots.items() if s < 3 and k != damaged}
    stack = open_stack(tmp_path, host=0, disk=8)  # what the owner itself recovers agrees
    assert ready(stack.tiers[0], KEYS[:6]) == [k for k in KEYS[:6] if k != damaged]
    stack.close()


def test_no_slab_reads_nothing_and_creates_nothing(tmp_path):
    missing = tmp_path / "never-opened"
    assert read_block_headers(missing, 8, LAYOUT, "model-a") == {}
    assert not missing.exists()


def test_a_path_that_cannot_be_read_keeps_nothing_and_says_so(tmp_path, caplog):
    (tmp_path / "a-file").write_bytes(b"not a directory")
    (tmp_path / "odd" / SLAB_NAME).mkdir(parents=True)  # opens, but every read fails (EISDIR)
    for path in (tmp_path / "a-file", tmp_path / "odd"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"):
            assert read_block_headers(path, 8, LAYOUT, "model-a") == {}
        assert "none of its blocks are kept" in caplog.text
