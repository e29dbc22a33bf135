"""The disk tier's index snapshot: what a clean close leaves beside the slab, so that a restart need not
read every slot header.

A scan reads one header page per slot: minutes for the 16.7 M slots of a 1 TiB slab of 64 KiB
blocks. The snapshot holds the tier's index at close instead (every READY block as key and slot, in
the order they became readable, as ``Tier.restore`` wants them: what a scan would find, less blocks
the tier had dropped whose old headers are still there), in columns that a restart reads in one go
and checks with numpy.

It is a hint about where blocks are, never a source of bytes: every load still checks its slot's
header (key, namespace, lengths, checksum), so a snapshot that is wrong in any way, stale, damaged or
forged by someone who can write the directory, can only cause misses. What keeps a crash from
leaving a stale one: it is taken (read and removed, the directory synced) when the slab opens, before
anything writes to the slab, so a process that dies later leaves no snapshot and the next open scans.
It names the slab it describes (``SlabIdentity``: geometry, namespace digest, inode, size and mtime as
of the close) and carries a checksum of the whole file; one that does not match the slab as opened,
fails its checksum or breaks a bound (a slot outside the slab or named twice, a key of 0 or more than
MAX_KEY_BYTES bytes, counts the file cannot hold) is not used: one log line, and the slab is scanned.

The same file indexes the slabs of an engine's ranks under vLLM (``connectors/vllm/recovery.py``): one
slab per rank, each holding its shard of every block at the same slot. Its identity then also names
how many ranks there are and the other ranks' slabs (``ranks``, ``other_slabs``); the fields of one
slab describe rank 0's.

Format, little-endian: ``_HEADER`` (magic, which carries the format's version; block count, key
width, the highest sequence number of the slab's headers, the identity), then three columns of
``count`` rows (key lengths as u8, keys zero-padded to the key width, slots as u64), then the xxh3-64
of everything before it. No pickle or other format that runs code: the file is input from disk.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import overload

import numpy as np
import xxhash

from kvtier.core.keys import MAX_KEY_BYTES
from kvtier.tiers.disk.files import SNAPSHOT_NAME, open_file_for_reading, remove_file, replace_file

log = logging.getLogger(__name__)

_MAGIC = b"KVTIDX02"  # 02: the identity names the ranks' slabs (01 named one slab)
# magic, count, key width, highest sequence, then the identity: slab format version, block bytes, slot
# stride, slot count, codec id, namespace digest, inode, size, mtime (ns), ranks, other ranks' slabs
_HEADER = struct.Struct("<8sQIQIQQQB16sQQqI16s")
_CHECKSUM = struct.Struct("<Q")
_ROW_BYTES = 1 + MAX_KEY_BYTES + 8  # the most one block takes: key length, key, slot


class SnapshotError(ValueError):
    """Why a snapshot is not used (the slab is scanned instead)."""


@dataclass(frozen=True)
class SlabIdentity:
    """The slab a snapshot describes, as a clean close left it: any write after the close changes its
    mtime (``DiskSlab.close`` sets it to one no write can produce), another geometry or namespace
    would read the blocks differently, and another inode is another file."""

    version: int  # the slab's format version
    block_bytes: int
    slot_stride: int
    num_slots: int
    codec_id: int
    namespace: bytes  # digest, 16 bytes
    inode: int
    size: int
    mtime_ns: int
    ranks: int = 1  # the slabs indexed: one, or an engine's ranks (each its shard of a block, at the same slot)
    other_slabs: bytes = bytes(16)  # with several ranks: a digest of ranks 1.. slabs' inode, size and mtime


class KeyColumn(Sequence[bytes]):
    """A snapshot's keys, each made into a bytes object only when read: a disk tier takes them back
    chunk by chunk while it already serves (``restore``), where making 15.8 M of them at once
    would keep it from answering for a second. A slice gives a list of keys."""

    def __init__(self, lengths: np.ndarray, matrix: np.ndarray) -> None:
        self._lengths = lengths
        self._matrix = matrix

    def __len__(self) -> int:
        return len(self._lengths)

    @overload
    def __getitem__(self, index: int) -> bytes: ...
    @overload
    def __getitem__(self, index: slice) -> list[bytes]: ...
    def __getitem__(self, index: int | slice) -> bytes | list[bytes]:
        if isinstance(index, slice):
            return _key_objects(self._lengths[index], self._matrix[index])
        return bytes(self._matrix[index, : self._lengths[index]])

    def __iter__(self) -> Iterator[bytes]:
        return iter(self[:])


@dataclass(frozen=True)
class Snapshot:
    """The blocks a snapshot names, oldest first, as ``Tier.restore`` takes them: ``keys[i]`` in
    ``slots[i]`` (int64). ``sequence``: the highest sequence number of the slab's slot headers at close."""

    keys: KeyColumn
    slots: np.ndarray
    sequence: int

    def __len__(self) -> int:
        return len(self.keys)


def write_snapshot(
    dir_fd: int, *, shared: bool, identity: SlabIdentity, keys: list[bytes], slots: list[int], sequence: int
) -> None:
    """Write the snapshot of the blocks ``keys`` at ``slots`` (oldest first, each key 1 to MAX_KEY_BYTES
    bytes, as a tier holds them) of the slab ``identity`` names into ``dir_fd``, atomically
    (``replace_file``). Raises OSError when it cannot be written whole."""
    count = len(keys)
    lengths = np.fromiter(map(len, keys), np.uint8, count)
    width = int(lengths.max()) if count else 0
    if count and int(lengths.min()) == width:
        padded = b"".join(keys)
    else:
        padded = b"".join(key.ljust(width, b"\0") for key in keys)
    chunks: list[bytes | memoryview] = [
        _HEADER.pack(_MAGIC, count, width, sequence, *astuple(identity)),
        lengths.data,
        padded,
        np.asarray(slots, dtype="<u8").data,
    ]
    checksum = xxhash.xxh3_64()
    for chunk in chunks:
        checksum.update(chunk)
    replace_file(dir_fd, SNAPSHOT_NAME, [*chunks, _CHECKSUM.pack(checksum.intdigest())], shared=shared)


def take_snapshot(dir_fd: int, directory: Path, *, shared: bool, identity: SlabIdentity | None) -> Snapshot | None:
    """The blocks of the snapshot in ``dir_fd`` (the slab's checked directory ``directory``), which is
    removed durably whatever it holds; call it holding the slab's lock, before anything writes to the
    slab. None when there is none, and, with one log line saying why, when it cannot be removed, fails
    the slab's file checks (``files``), is unreadable, damaged or out of bounds, or does not
    describe the slab ``identity`` names (None: the open changes the slab's geometry)."""
    path = directory / SNAPSHOT_NAME
    fd = None
    try:
        try:
            fd = open_file_for_reading(dir_fd, directory, SNAPSHOT_NAME, "index snapshot", shared=shared)
        finally:
            removed = remove_file(dir_fd, SNAPSHOT_NAME)  # a hostile one too: only its name goes
        if not removed:
            return None  # (and fd is None: nothing was there)
        if fd is None:
            raise SnapshotError("it appeared while the slab was being opened")
        if identity is None:
            raise SnapshotError("this open changes the slab's geometry")
        return _decode(_read_bounded(fd, identity.num_slots), identity)
    except (OSError, SnapshotError) as exc:  # DiskTierError included
        log.warning("disk tier %s: index snapshot not used (%s); scanning every slot header", path, exc)
        return None
    finally:
        if fd is not None:
            os.close(fd)


def _read_bounded(fd: int, num_slots: int) -> np.ndarray:
    """The whole file, once its size proves possible for a slab of ``num_slots`` slots (a forged size
    must not make us allocate or read without bound)."""
    size = os.fstat(fd).st_size
    most = _HEADER.size + num_slots * _ROW_BYTES + _CHECKSUM.size
    if not _HEADER.size + _CHECKSUM.size <= size <= most:
        raise SnapshotError(f"its {size} bytes cannot describe a slab of {num_slots} slots")
    raw = np.empty(size, np.uint8)
    view = raw.data
    done = 0
    while done < size:
        got = os.preadv(fd, [view[done:]], done)
        if got == 0:
            raise SnapshotError(f"it was cut to {done} of {size} bytes while being read")
        done += got
    return raw


def _decode(raw: np.ndarray, identity: SlabIdentity) -> Snapshot:
    """The blocks in a snapshot file's bytes ``raw``, checked against ``identity`` (SnapshotError)."""
    body = raw[: -_CHECKSUM.size]
    if xxhash.xxh3_64_intdigest(body.data) != _CHECKSUM.unpack_from(raw.data, len(body))[0]:
        raise SnapshotError("it fails its checksum: damaged or cut short")
    magic, count, width, sequence, *identity_fields = _HEADER.unpack_from(raw.data)
    if magic != _MAGIC:
        raise SnapshotError("it is not a kvtier index snapshot")
    described = SlabIdentity(*identity_fields)
    if described != identity:
        differ = [f.name for f in fields(identity) if getattr(described, f.name) != getattr(identity, f.name)]
        raise SnapshotError(
            f"it describes another slab than the one opened (its {', '.join(differ)} differ): stale, "
            f"since the slab was written after it, or for another slab"
        )
    if count > identity.num_slots or not (0 < width <= MAX_KEY_BYTES or count == width == 0):
        raise SnapshotError(f"it names {count} blocks with keys {width} bytes wide")
    if len(body) != _HEADER.size + count * (1 + width + 8):
        raise SnapshotError(f"its {len(raw)} bytes do not hold the {count} blocks it names")
    keys_at = _HEADER.size + count
    lengths = body[_HEADER.size : keys_at]
    matrix = body[keys_at : keys_at + count * width].reshape(count, width)
    slots = body[keys_at + count * width :].view("<u8")
    if count and not (lengths.min() >= 1 and lengths.max() <= width):
        raise SnapshotError(f"a key length is outside 1..{width}")
    if count and int(slots.max()) >= identity.num_slots:
        raise SnapshotError(f"a slot lies outside the slab's {identity.num_slots}")
    seen = np.zeros(identity.num_slots, np.bool_)
    seen[slots] = True
    if int(np.count_nonzero(seen)) != count:
        raise SnapshotError("a slot is named twice")
    return Snapshot(KeyColumn(lengths, matrix), slots.astype(np.int64), sequence)


def _key_objects(lengths: np.ndarray, matrix: np.ndarray) -> list[bytes]:
    """One bytes object per row of ``matrix``: its first ``lengths[row]`` bytes. numpy makes them (a
    void view's ``tolist`` keeps every byte, zeros included); only keys of mixed lengths are then
    cut one by one."""
    width = matrix.shape[1]
    padded = matrix.view(f"V{width}").ravel().tolist() if width else []
    if not len(lengths) or int(lengths.min()) == width:
        return padded
    return [key[:length] for key, length in zip(padded, lengths.tolist(), strict=True)]
