"""The local disk tier: one preallocated slab file of fixed-size slots that survives restarts.

File layout: a 4 KiB file header (magic, geometry, codec), then ``num_slots`` slots of ``slot_stride``
bytes. Each slot is a 4 KiB slot header followed by room for the block's bytes, so the data stays
4 KiB-aligned for O_DIRECT. The slot header names the block (key, namespace digest, raw and stored
lengths, codec, checksum of the raw bytes) and carries its own checksum.

Compression (``compression: lz4 | zstd``) buys capacity, not speed (the codecs run slower than a
local SSD): each slot gets only ``slot_bytes`` of room, so the same file holds more slots, and a block
whose compressed payload does not fit that room is not stored (counted in ``incompressible``) and is
refused for good (``Tier.refuse``): the tier above drops it rather than offering it again and again.

Why it is crash-safe without a separate index: a slot header is written only after the block's bytes
are durable (written, then fdatasync), and a slot about to be reused has its old header zeroed and
made durable before new bytes land in it. So after any crash a valid header always describes complete
bytes, and reopening the directory rebuilds the index by scanning slot headers. Every read checks the
header and the data checksum; a mismatch is a miss, never wrong data.

A lock file keeps a second process from opening the same directory.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import math
import mmap
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvtier.core.errors import ConfigError, KvtierError
from kvtier.core.layout import BlockLayout
from kvtier.core.storage import BlockStorage
from kvtier.core.tier import Tier
from kvtier.policies.base import EvictionPolicy
from kvtier.policies.watermark import Watermark
from kvtier.tiers.compression import CODEC_IDS, CODEC_NAMES, codec

log = logging.getLogger(__name__)

PAGE = 4096
SLAB_NAME = "slab.kvt"
LOCK_NAME = "kvtier.lock"
FILE_MAGIC = b"KVTSLAB1"
SLOT_MAGIC = b"KVTBLK01"
# file header: magic, version, block_bytes, slot_stride, num_slots, codec id, checksum of the preceding fields
_FILE_HEADER = struct.Struct("<8sIQQQB")
# slot header: magic, namespace digest, key length, key (up to 32 bytes), raw block bytes, checksum of the
# raw bytes, sequence, stored payload bytes, codec id
_SLOT_HEADER = struct.Struct("<8s16sH32sQQQQB")
_CHECKSUM = struct.Struct("<Q")
VERSION = 2
# Room per block when compression is on and slot_bytes is not given, as a fraction of block_bytes:
# what bf16 KV blocks compress to with some margin (zstd-1 0.69, lz4 0.85 of 256 KiB blocks, bench/disk.py).
DEFAULT_SLOT_FRACTION = {"zstd": 0.75, "lz4": 0.875}


class DiskTierError(KvtierError, OSError):
    """The disk tier's directory cannot be used (locked by another process, no space, bad path)."""


def _round_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


def slot_problem(block_bytes: int, compression: str, slot_bytes: int | None) -> str | None:
    """Why ``slot_bytes`` cannot work for this block size and codec, or None when it can."""
    if slot_bytes is None:
        return None
    if slot_bytes > block_bytes:
        return f"slot_bytes {slot_bytes} is larger than block_bytes {block_bytes}; at most block_bytes"
    if slot_bytes < PAGE:
        return f"slot_bytes {slot_bytes} is less than {PAGE} (4KiB), the smallest slot"
    if compression == "none" and slot_bytes != block_bytes:
        return (f"slot_bytes {slot_bytes} is smaller than block_bytes {block_bytes}, which only fits with "
                f"compression: lz4 or zstd")
    return None


def slot_room(block_bytes: int, compression: str = "none", slot_bytes: int | None = None) -> int:
    """Bytes of block data one slot holds on disk: ``slot_bytes`` (by default all of ``block_bytes``
    uncompressed, a codec-dependent fraction compressed) rounded up to 4 KiB for O_DIRECT."""
    if slot_bytes is None:
        fraction = DEFAULT_SLOT_FRACTION.get(compression, 1.0)
        slot_bytes = min(block_bytes, math.ceil(block_bytes * fraction))
    return _round_up(slot_bytes)


def slot_stride(block_bytes: int, compression: str = "none", slot_bytes: int | None = None) -> int:
    """Bytes of file per block (slot header and room): what a disk ``capacity`` in bytes is divided by."""
    return PAGE + slot_room(block_bytes, compression, slot_bytes)


def namespace_digest(namespace: str, layout: BlockLayout) -> bytes:
    """16 bytes naming whose blocks a slot holds: the stack's namespace (model, dtype, rank) and the
    block's fragment geometry. A block written under another digest is never read."""
    return xxhash.xxh3_128_digest(f"{namespace}\0{layout.fragment_bytes}".encode())


@dataclass(frozen=True)
class SlotHeader:
    key: bytes
    namespace: bytes
    length: int    # the block's raw bytes
    checksum: int  # of the raw bytes: what a reader gets back, whatever the codec
    sequence: int
    payload: int   # bytes stored after the header: ``length`` uncompressed, the compressed size otherwise
    codec: int     # CODEC_IDS

    def pack(self) -> bytes:
        body = _SLOT_HEADER.pack(SLOT_MAGIC, self.namespace, len(self.key), self.key.ljust(32, b"\0"),
                                 self.length, self.checksum, self.sequence, self.payload, self.codec)
        return (body + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))).ljust(PAGE, b"\0")

    @classmethod
    def unpack(cls, page: bytes) -> "SlotHeader | None":
        """The header in a slot's first page, or None when the page is empty, torn or garbage."""
        body = page[:_SLOT_HEADER.size]
        (stored,) = _CHECKSUM.unpack_from(page, _SLOT_HEADER.size)
        if xxhash.xxh3_64_intdigest(body) != stored:
            return None
        magic, namespace, key_len, key, length, checksum, sequence, payload, codec_id = _SLOT_HEADER.unpack(body)
        if magic != SLOT_MAGIC or key_len > 32:
            return None
        return cls(key[:key_len], namespace, length, checksum, sequence, payload, codec_id)


def _pack_file_header(block_bytes: int, slot_stride: int, num_slots: int, codec_id: int) -> bytes:
    fields = _FILE_HEADER.pack(FILE_MAGIC, VERSION, block_bytes, slot_stride, num_slots, codec_id)
    return fields + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(fields))


def _unpack_file_header(raw: bytes) -> tuple | None:
    """(magic, version, block_bytes, slot_stride, num_slots, codec id), or None when ``raw`` is short or
    fails its checksum."""
    if len(raw) < _FILE_HEADER.size + _CHECKSUM.size:
        return None
    if xxhash.xxh3_64_intdigest(raw[:_FILE_HEADER.size]) != _CHECKSUM.unpack_from(raw, _FILE_HEADER.size)[0]:
        return None
    return _FILE_HEADER.unpack_from(raw)


def _geometry_change(old: tuple | None, block_bytes: int, slot_stride: int, codec_id: int) -> str | None:
    """Why a slab with file header ``old`` cannot serve this geometry, or None when it can (the slot
    count may differ)."""
    if old is None or old[0] != FILE_MAGIC:
        return "the file header is damaged or not a kvtier slab's"
    _, version, old_block, old_stride, _, old_codec = old
    if version != VERSION:
        return f"the file has format version {version}, this kvtier writes version {VERSION}"
    if old_block != block_bytes:
        return f"the block size changed from {old_block} to {block_bytes} bytes"
    if old_codec != codec_id:
        return (f"compression changed from {CODEC_NAMES.get(old_codec, old_codec)} "
                f"to {CODEC_NAMES[codec_id]}")
    if old_stride != slot_stride:
        return f"the slot size changed from {old_stride - PAGE} to {slot_stride - PAGE} bytes (slot_bytes)"
    return None


def _is_blank(page: bytes) -> bool:
    return not any(page)


def read_slot_headers(fd: int, num_slots: int, slot_stride: int, start: int = 0):
    """Yield (slot, header or None, blank) for slots ``start`` .. ``num_slots - 1`` of a slab file; a short
    page counts as damaged."""
    for slot in range(start, num_slots):
        page = os.pread(fd, PAGE, PAGE + slot * slot_stride)
        header = SlotHeader.unpack(page) if len(page) == PAGE else None
        yield slot, header, len(page) == PAGE and _is_blank(page)


def checked_slot_room(path: str | os.PathLike, block_bytes: int, compression: str, slot_bytes: int | None) -> int:
    """``slot_room``, once a slot size that cannot work is refused (ConfigError naming the tier's path)."""
    problem = slot_problem(block_bytes, compression, slot_bytes)
    if problem is not None:
        raise ConfigError(f"disk tier {str(path)!r}: {problem}")
    return slot_room(block_bytes, compression, slot_bytes)


def header_fits(header: SlotHeader, block_bytes: int, codec_id: int, room: int) -> bool:
    """Whether a header describes a block a slab of this geometry holds: its size, its codec, a payload
    that fits the slot's ``room`` (exactly the block when uncompressed)."""
    if header.length != block_bytes or header.codec != codec_id:
        return False
    if codec_id == CODEC_IDS["none"]:
        return header.payload == block_bytes
    return 0 < header.payload <= room


def read_block_headers(path: str | os.PathLike, num_slots: int, layout: BlockLayout, namespace: str,
                       compression: str = "none", slot_bytes: int | None = None) -> dict[int, SlotHeader]:
    """The valid headers of this namespace's blocks in the slab in directory ``path``, by slot: what a
    ``DiskSlab`` opened there with the same arguments would recover, found without taking the lock and
    without writing (the process that owns the directory may be opening or using it meanwhile).

    Empty when there is no slab or its file header is damaged or names another geometry (its owner
    discards such a file when it opens it). Slots from ``num_slots`` on are left out (a smaller slab
    cuts them). Every slot is reported as it is, older copies of a key included.
    """
    room = checked_slot_room(path, layout.block_bytes, compression, slot_bytes)
    codec_id = CODEC_IDS[compression]
    slab_path = Path(path) / SLAB_NAME
    try:
        fd = os.open(slab_path, os.O_RDONLY)
    except FileNotFoundError:
        return {}
    except OSError as exc:  # the owner reports what is wrong with its directory when it opens it
        log.warning("disk tier %s cannot be read (%s); none of its blocks are kept", slab_path, exc.strerror)
        return {}
    try:
        fields = _unpack_file_header(os.pread(fd, _FILE_HEADER.size + _CHECKSUM.size, 0))
        if _geometry_change(fields, layout.block_bytes, PAGE + room, codec_id) is not None:
            return {}
        in_file = max(0, os.fstat(fd).st_size - PAGE) // (PAGE + room)
        digest = namespace_digest(namespace, layout)
        return {slot: header for slot, header, _ in read_slot_headers(fd, min(num_slots, in_file), PAGE + room)
                if header is not None and header.namespace == digest
                and header_fits(header, layout.block_bytes, codec_id, room)}
    except OSError as exc:
        log.warning("disk tier %s: reading its slot headers failed (%s); none of its blocks are kept",
                    slab_path, exc.strerror)
        return {}
    finally:
        os.close(fd)


def inspect_slab(path: str | os.PathLike) -> dict:
    """What a disk tier directory holds, read without taking its lock (a running process may own it).

    Returns the geometry, blocks per namespace digest, damaged slot headers, free slots and bytes,
    the lock holder, and the filesystem's free space. Raises DiskTierError when there is no slab.
    """
    directory = Path(path)
    slab_path = directory / SLAB_NAME
    try:
        fd = os.open(slab_path, os.O_RDONLY)
    except OSError as exc:
        raise DiskTierError(f"no kvtier disk tier in {str(directory)!r}: {exc.strerror}") from exc
    try:
        fields = _unpack_file_header(os.pread(fd, _FILE_HEADER.size + _CHECKSUM.size, 0))
        if fields is None:
            raise DiskTierError(f"{str(slab_path)!r} has no valid kvtier file header")
        magic, version, block_bytes, slot_stride, num_slots, codec_id = fields
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
        lock = directory / LOCK_NAME
        return {
            "path": str(slab_path), "version": version, "block_bytes": block_bytes, "slot_stride": slot_stride,
            "slot_bytes": slot_stride - PAGE, "compression": CODEC_NAMES.get(codec_id, f"unknown ({codec_id})"),
            "slots": num_slots, "blocks": blocks, "block_bytes_used": blocks * block_bytes, "stored_bytes": stored,
            "free_slots": num_slots - blocks, "damaged_headers": damaged, "namespaces": namespaces,
            "file_bytes": os.fstat(fd).st_size, "filesystem_free_bytes": shutil.disk_usage(directory).free,
            "lock_holder": _lock_holder(lock),
        }
    finally:
        os.close(fd)


def _lock_holder(lock: Path) -> str | None:
    """Who holds the directory lock now, or None when nobody does."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except BlockingIOError:
        return os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
    finally:
        os.close(fd)


class DiskSlab:
    """The slab file and its directory: geometry, file descriptors, lock, and which slots have headers.

    Thread safety: positioned I/O on the descriptors is safe from any thread; ``valid_header`` is
    only changed by the backend for slots a job owns (a WRITING slot belongs to exactly one job),
    and cleared for a READY slot whose load failed (its loads may race, all clearing it).
    ``record`` and ``refuse`` (the tier's, set by ``disk_tier``) take the tier's lock.
    """

    def __init__(self, path: str | os.PathLike, num_slots: int, layout: BlockLayout, namespace: str,
                 o_direct: str = "auto", compression: str = "none", slot_bytes: int | None = None) -> None:
        self.codec = codec(compression)  # first: a missing package must not leave a file behind
        self.codec_id = CODEC_IDS[compression]
        self.dir = Path(path)
        self.num_slots = num_slots
        self.block_bytes = block_bytes = layout.block_bytes
        self.room = checked_slot_room(self.dir, block_bytes, compression, slot_bytes)  # payload bytes a slot holds
        self.slot_stride = PAGE + self.room
        self.namespace = namespace_digest(namespace, layout)
        self.record = lambda **counts: None  # where the backend counts incompressible blocks
        self.refuse = lambda keys: None  # where the backend names blocks that can never fit (Tier.refuse)
        self.file_bytes = PAGE + num_slots * self.slot_stride
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DiskTierError(f"disk tier directory {str(self.dir)!r} cannot be created: {exc.strerror}") from exc
        self._lock_fd = self._take_lock()
        try:
            self.path = self.dir / SLAB_NAME
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            self._prepare_file()
            self.direct_fd = self._open_direct(o_direct)
        except BaseException:
            self.close()
            raise
        self.valid_header = bytearray(num_slots)
        self.sequence = 0

    @property
    def o_direct(self) -> bool:
        return self.direct_fd is not None

    def slot_offset(self, slot: int) -> int:
        return PAGE + slot * self.slot_stride

    # --- opening -------------------------------------------------------------------------------

    def _take_lock(self) -> int:
        try:
            fd = os.open(self.dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise DiskTierError(f"disk tier lock {str(self.dir / LOCK_NAME)!r} cannot be opened: {exc.strerror}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise DiskTierError(f"disk tier directory {str(self.dir)!r} is in use by {holder}; "
                                f"two kvtier processes cannot share one directory") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"kvtier pid {os.getpid()}\n".encode(), 0)
        return fd

    def _prepare_file(self) -> None:
        """Keep a file of the same geometry, also at another capacity; start a fresh one, saying why,
        otherwise. Preallocate the whole size.

        Slot offsets do not depend on the slot count, so a larger capacity keeps every block and a
        smaller one keeps those in the slots that remain (the file is cut first, then the header
        rewritten: a crash in between leaves a header whose geometry still describes the file)."""
        header = _pack_file_header(self.block_bytes, self.slot_stride, self.num_slots, self.codec_id)
        existing = os.pread(self.fd, len(header), 0)
        if existing != header:
            old = _unpack_file_header(existing)
            change = _geometry_change(old, self.block_bytes, self.slot_stride, self.codec_id)
            if change is None:
                self._resize(old[4])
            else:
                if any(existing):
                    log.warning("disk tier %s: %s; discarding the old cache", self.path, change)
                os.ftruncate(self.fd, 0)
        try:
            os.posix_fallocate(self.fd, 0, self.file_bytes)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                free = shutil.disk_usage(self.dir).free
                raise DiskTierError(f"disk tier {str(self.dir)!r} needs {self.file_bytes} bytes and the "
                                    f"filesystem has {free} free; lower its capacity") from exc
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(self.fd, max(self.file_bytes, os.fstat(self.fd).st_size))  # sparse, where unsupported
        if existing != header:
            os.pwrite(self.fd, header.ljust(PAGE, b"\0"), 0)
            os.fdatasync(self.fd)

    def _resize(self, old_slots: int) -> None:
        """Keep the blocks of a slab written with ``old_slots`` slots: cut the slots past the new end."""
        if old_slots > self.num_slots:
            in_file = (os.fstat(self.fd).st_size - PAGE) // self.slot_stride  # a crash may have cut it already
            cut = [slot for slot, header, _ in read_slot_headers(self.fd, min(old_slots, in_file), self.slot_stride,
                                                                 start=self.num_slots) if header is not None]
            log.warning("disk tier %s: capacity shrank from %d to %d slots; dropping the %d block(s) stored "
                        "past the new end, keeping the rest", self.path, old_slots, self.num_slots, len(cut))
            os.ftruncate(self.fd, self.file_bytes)
        else:
            log.info("disk tier %s: capacity grew from %d to %d slots; keeping every block",
                     self.path, old_slots, self.num_slots)

    def _open_direct(self, mode: str) -> int | None:
        """An O_DIRECT descriptor when the filesystem takes aligned direct I/O; None (buffered) otherwise."""
        if mode == "off" or not hasattr(os, "O_DIRECT"):
            return None
        probe = mmap.mmap(-1, PAGE)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_DIRECT)
        except OSError as exc:
            return self._no_direct(mode, exc)
        try:
            os.preadv(fd, [probe], 0)  # the file header page: aligned buffer, offset and length
            return fd
        except OSError as exc:
            os.close(fd)
            return self._no_direct(mode, exc)
        finally:
            probe.close()

    def _no_direct(self, mode: str, exc: OSError) -> None:
        if mode == "on":
            raise DiskTierError(f"O_DIRECT was asked for but {str(self.dir)!r} refuses it: {exc.strerror}") from exc
        log.info("disk tier %s: the filesystem refuses O_DIRECT (%s); using buffered I/O", self.dir, exc.strerror)
        return None

    # --- recovery ------------------------------------------------------------------------------

    def scan(self) -> tuple[list[tuple[int, bytes, int]], int]:
        """Read every slot header: ([(sequence, key, slot)] of valid blocks of this namespace, damaged count).

        A slot holding the same key as a newer slot is left out (an older copy). Damaged headers
        (not blank, failing their checksum or geometry) are counted; their slots are free.
        """
        found: dict[bytes, tuple[int, bytes, int]] = {}
        damaged = 0
        for slot, header, blank in read_slot_headers(self.fd, self.num_slots, self.slot_stride):
            if header is None:
                damaged += not blank
                continue
            self.valid_header[slot] = 1  # any valid header, foreign or not, is zeroed before reuse
            if header.namespace != self.namespace:
                continue
            if not self.fits(header):
                damaged += 1
                continue
            self.sequence = max(self.sequence, header.sequence)
            older = found.get(header.key)
            if older is None or older[0] < header.sequence:
                found[header.key] = (header.sequence, header.key, slot)
        return sorted(found.values()), damaged

    def fits(self, header: SlotHeader) -> bool:
        """Whether a header describes a block this slab can hold (``header_fits``)."""
        return header_fits(header, self.block_bytes, self.codec_id, self.room)

    def close(self) -> None:
        """Flush, close the descriptors and release the directory lock."""
        try:
            for name in ("direct_fd", "fd"):
                fd = getattr(self, name, None)
                if fd is not None:
                    setattr(self, name, None)
                    try:
                        if name == "fd":
                            os.fsync(fd)
                    finally:
                        os.close(fd)
        finally:
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # closing drops the flock, also when the fsync above failed
                self._lock_fd = None


class FileStorage(BlockStorage):
    """A slab file as block storage: "addresses" are file offsets of each slot's data (after its header)."""

    def __init__(self, slab: DiskSlab, layout: BlockLayout) -> None:
        super().__init__(BlockLayout.contiguous(layout.block_bytes), slab.num_slots, "file", slab, slab.close)
        self.slab = slab

    def _addresses(self, slots):
        return (PAGE + slots * self.slab.slot_stride + PAGE)[:, None]


def disk_tier(name: str, num_slots: int, layout: BlockLayout, policy: EvictionPolicy,
              watermark: Watermark | None = None, is_fenced=None, *, path: str | os.PathLike,
              namespace: str = "", o_direct: str = "auto", compression: str = "none",
              slot_bytes: int | None = None) -> Tier:
    """A tier over the slab in ``path``, holding again every block a previous process committed there
    under the same namespace, block size and slot geometry (codec and slot size).

    ``compression`` ("none", "lz4", "zstd") and ``slot_bytes`` (room per block on disk, see
    ``slot_room``) set the geometry; ``num_slots`` is the block count (``slot_stride`` turns a byte
    budget into one). Raises ConfigError for a bad combination or a codec whose package is missing.
    """
    if o_direct not in ("auto", "on", "off"):
        raise ConfigError(f"o_direct must be auto, on or off, got {o_direct!r}")
    slab = DiskSlab(path, num_slots, layout, namespace, o_direct, compression, slot_bytes)
    try:
        recovered, damaged = slab.scan()
        io = "O_DIRECT" if slab.o_direct else "buffered I/O"
        packing = "" if slab.codec is None else f", {compression} into {slab.room} B slots"
        tier = Tier(name, "disk", FileStorage(slab, layout), policy, watermark, is_fenced,
                    f"{slab.path}, {io}{packing}, {len(recovered)} blocks recovered")
        tier.restore([(key, slot) for _, key, slot in recovered])
        tier.record(damaged=damaged)
        slab.record, slab.refuse = tier.record, tier.refuse
        return tier
    except BaseException:
        slab.close()
        raise
