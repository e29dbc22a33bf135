"""Reading a slab that another process may own: without its lock, and without writing to it.

``read_block_headers`` finds the blocks a slab holds for one namespace (an engine's scheduler side
reading its workers' slabs, ``connectors/vllm/recovery.py``); ``inspect_slab`` describes a whole
directory (``kvtier inspect``). Both apply the owner's file checks (``files``) first.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from kvtier.core.layout import BlockLayout
from kvtier.tiers.disk.files import SLAB_NAME, DiskTierError, lock_holder, open_slab_for_reading
from kvtier.tiers.disk.format import (
    FILE_HEADER_BYTES,
    FILE_MAGIC,
    VERSION,
    SlotHeader,
    checked_slot_room,
    compression_name,
    geometry_change,
    header_fits,
    namespace_digest,
    read_slot_headers,
    sealing_name,
    slab_codec_id,
    slots_in_file,
    unpack_file_header,
)
from kvtier.tiers.disk.slots import PAGE

log = logging.getLogger(__name__)


def read_block_headers(
    path: str | os.PathLike,
    num_slots: int,
    layout: BlockLayout,
    namespace: str,
    compression: str = "none",
    slot_bytes: int | None = None,
    shared_directory: bool = False,
    sealed: bool = False,
) -> dict[int, SlotHeader]:
    """The valid headers of this namespace's blocks in the slab in directory ``path``, by slot: what a
    ``DiskSlab`` opened there with the same arguments would recover, found without taking the lock and
    without writing (the process that owns the directory may be opening or using it meanwhile).

    Empty when there is no slab or its file header is damaged or names another geometry (its owner
    discards such a file when it opens it), and, with a warning naming the path, when the directory or
    slab fails the owner's checks (``files``: the same ownership, mode and file-type rules,
    ``shared_directory`` as configured) or cannot be read: never an exception into the engine. Slots
    from ``num_slots`` on, or past the file's end, are left out (a smaller slab cuts them). Every slot is
    reported as it is, older copies of a key included.
    """
    room = checked_slot_room(path, layout.block_bytes, compression, slot_bytes)
    codec_id = slab_codec_id(compression, sealed)
    slab_path = Path(path) / SLAB_NAME
    try:
        fd = open_slab_for_reading(Path(path), shared=shared_directory)
    except OSError as exc:  # DiskTierError included
        log.warning("disk tier %s cannot be read (%s); none of its blocks are kept", slab_path, exc)
        return {}
    if fd is None:
        return {}
    try:
        fields = unpack_file_header(os.pread(fd, FILE_HEADER_BYTES, 0))
        if geometry_change(fields, layout.block_bytes, PAGE + room, codec_id) is not None:
            return {}
        in_file = slots_in_file(os.fstat(fd).st_size, PAGE + room)
        digest = namespace_digest(namespace, layout)
        return {
            slot: header
            for slot, header, _ in read_slot_headers(fd, min(num_slots, in_file), PAGE + room)
            if header is not None
            and header.namespace == digest
            and header_fits(header, layout.block_bytes, codec_id, room)
        }
    except OSError as exc:
        log.warning(
            "disk tier %s: reading its slot headers failed (%s); none of its blocks are kept", slab_path, exc.strerror
        )
        return {}
    finally:
        os.close(fd)


def inspect_slab(path: str | os.PathLike, shared_directory: bool = False) -> dict:
    """What a disk tier directory holds, read without taking its lock (a running process may own it).

    Returns the geometry, blocks per namespace digest, damaged slot headers, free slots and bytes,
    the lock holder, and the filesystem's free space. ``slots`` counts the slots the file really holds
    (a header may claim more: a crash mid-shrink, or a forged one). Raises DiskTierError when there is
    no slab, or it fails the owner's checks (``files``), or its file header is not a readable
    kvtier one of this version.
    """
    directory = Path(path)
    slab_path = directory / SLAB_NAME
    fd = open_slab_for_reading(directory, shared=shared_directory)
    if fd is None:
        raise DiskTierError(f"no kvtier disk tier in {str(directory)!r}: it holds no {SLAB_NAME}")
    try:
        magic, version, block_bytes, slot_stride, claimed, codec_id = _checked_file_header(fd, slab_path)
        st = os.fstat(fd)
        num_slots = min(claimed, slots_in_file(st.st_size, slot_stride))
        namespaces: dict[str, int] = {}
        damaged = stored = 0
        for _, header, blank in read_slot_headers(fd, num_slots, slot_stride):
            if header is None:
                damaged += not blank
            else:
                digest = header.namespace.hex()
                namespaces[digest] = namespaces.get(digest, 0) + 1
                stored += header.payload
        blocks = sum(namespaces.values())
        filesystem = os.fstatvfs(fd)
        return {
            "path": str(slab_path),
            "version": version,
            "block_bytes": block_bytes,
            "slot_stride": slot_stride,
            "slot_bytes": slot_stride - PAGE,
            "compression": compression_name(codec_id),
            "encryption": sealing_name(codec_id),
            "slots": num_slots,
            "blocks": blocks,
            "block_bytes_used": blocks * block_bytes,
            "stored_bytes": stored,
            "free_slots": num_slots - blocks,
            "damaged_headers": damaged,
            "namespaces": namespaces,
            "file_bytes": st.st_size,
            "filesystem_free_bytes": filesystem.f_bavail * filesystem.f_frsize,
            "lock_holder": lock_holder(st),
        }
    except DiskTierError:
        raise
    except OSError as exc:
        raise DiskTierError(f"{str(slab_path)!r} cannot be read: {exc.strerror}") from exc
    finally:
        os.close(fd)


def _checked_file_header(fd: int, slab_path: Path) -> tuple:
    """The fields of a slab's file header, once it proves to be a kvtier header of this version whose
    slot stride is whole pages around a header page (DiskTierError otherwise)."""
    fields = unpack_file_header(os.pread(fd, FILE_HEADER_BYTES, 0))
    if fields is None or fields[0] != FILE_MAGIC:
        raise DiskTierError(f"{str(slab_path)!r} has no valid kvtier file header")
    version, slot_stride = fields[1], fields[3]
    if version != VERSION:
        raise DiskTierError(
            f"{str(slab_path)!r} has format version {version}; this kvtier reads version "
            f"{VERSION} (a disk tier opened there discards the old cache)"
        )
    if slot_stride % PAGE or slot_stride < 2 * PAGE:
        raise DiskTierError(
            f"{str(slab_path)!r} names a slot stride of {slot_stride} bytes, not whole 4 KiB "
            f"pages of at least 8 KiB: its file header is forged or damaged"
        )
    return fields
