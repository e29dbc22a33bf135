"""The local disk tier: one preallocated slab file of fixed-size slots that survives restarts.

File layout: a 4 KiB file header (magic, geometry, codec), then ``num_slots`` slots of ``slot_stride``
bytes. Each slot is a 4 KiB slot header followed by room for the block's bytes, so the data stays
4 KiB-aligned for O_DIRECT. The slot header names the block (key, namespace digest, raw and stored
lengths, codec, checksum of the raw bytes) and carries its own checksum.

Sealing (``encryption: aes-gcm``, ``kvtier.core.sealing``): each slot's bytes are the block (or its
compressed payload) sealed with AES-256-GCM, its seal in the slot's header page after the header, the
header's fields bound to it; whoever reads the disk, an image or a backup of it reads no KV, and a slot
that does not open (another secret, moved to another slot's key, changed) is a miss. A sealed slab's
codec id carries ``SEALED``: a slab is never read sealed by a plain tier, nor plain by a sealing one.

Compression (``compression: lz4 | zstd``) buys capacity, not speed (the codecs run slower than a
local SSD): each slot gets only ``slot_bytes`` of room, so the same file holds more slots, and a block
whose compressed payload does not fit that room is not stored (counted in ``incompressible``) and is
refused for good (``Tier.refuse``): the tier above drops it rather than offering it again and again.

Why it is crash-safe without a separate index or a sync per store: a slot's header holds the checksum
of the bytes it describes, and every read checks header and checksum, so a slot that a crash tore
(new header over old bytes, old header over new bytes, half a block) is a miss, never wrong data.
Each slot is written header and bytes in one call (``kvtier.transfers.disk``); a process killed
mid-store leaves each slot old or new. Reopening the directory rebuilds the index by scanning slot
headers; a torn slot found there fails its first load and is dropped.

Restart in seconds: a scan reads one header page per slot, minutes for a slab of millions of slots.
So a clean close leaves an index snapshot of the tier's blocks beside the slab (``disk_snapshot``),
and the next open restores from it instead, after checking that it describes the slab exactly as that
close left it; the tier serves as soon as the blocks' slots are claimed, the blocks going back into
its index in chunks meanwhile (``disk_restore``). The open removes it before anything writes to the
slab: after a crash there is none, and the scan above recovers everything. A snapshot can only cause
misses (every load checks its slot's header), never wrong data.

Opening (``disk_files``): the directory and slab must be the running user's and writable by nobody
else (unless ``shared_directory``), the slab is never reached through a symbolic link, and a lock on
the slab itself keeps a second process out. A file under the slab's name that is not a kvtier slab
is never overwritten unless ``reinitialise`` says so.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import xxhash

from kvtier.core.config import DiskTierConfig
from kvtier.core.errors import ClosedError, ConfigError, StateError
from kvtier.core.keys import MAX_KEY_BYTES
from kvtier.core.layout import BlockLayout
from kvtier.core.media import FILE_DEVICE, Capabilities, Medium, RankRequest, TierRequest
from kvtier.core.namespaces import KnownNamespace
from kvtier.core.sealing import SealingKeys
from kvtier.core.slots import PAGE, slot_problem, slot_room
from kvtier.core.storage import BlockStorage
from kvtier.core.tier import BlockState, Tier
from kvtier.policies.base import EvictionPolicy
from kvtier.policies.watermark import Watermark
from kvtier.tiers.compression import CODEC_IDS, CODEC_NAMES, codec
from kvtier.tiers.disk_files import (
    SLAB_NAME,
    DiskTierError,
    lock_holder,
    open_directory,
    open_slab,
    open_slab_for_reading,
    remove_slab,
    reopen_slab,
)
from kvtier.tiers.disk_namespaces import record
from kvtier.tiers.disk_restore import ChunkedRestore
from kvtier.tiers.disk_snapshot import SlabIdentity, Snapshot, take_snapshot, write_snapshot

log = logging.getLogger(__name__)

FILE_MAGIC = b"KVTSLAB1"
SLOT_MAGIC = b"KVTBLK01"
# file header: magic, version, block_bytes, slot_stride, num_slots, codec id, checksum of the preceding fields
_FILE_HEADER = struct.Struct("<8sIQQQB")
# slot header: magic, namespace digest, key length, key (up to MAX_KEY_BYTES, kept whole), raw block bytes,
# checksum of the raw bytes, sequence, stored payload bytes, codec id
_SLOT_HEADER = struct.Struct(f"<8s16sH{MAX_KEY_BYTES}sQQQQB")
_CHECKSUM = struct.Struct("<Q")
VERSION = 3  # 3: keys up to 64 bytes (2 held 32)
SEALED = 0x80
"""In a codec id (file and slot headers): the slot's bytes are sealed (``encryption: aes-gcm``)."""
SEAL_AT = 512
"""Where a sealed slot's seal lies in its header page (after the header and its checksum; the seal binds
the header's fields, so it needs no checksum of its own)."""
FOREIGN_KEPT = 65536
"""Keys of other namespaces' blocks a disk tier's scan remembers at most (``DiskSlab.foreign``)."""


def namespace_digest(namespace: str, layout: BlockLayout) -> bytes:
    """16 bytes naming whose blocks a slot holds: the stack's namespace (model, dtype, rank) and the
    block's fragment geometry. A block written under another digest is never read."""
    return xxhash.xxh3_128_digest(f"{namespace}\0{layout.fragment_bytes}".encode())


@dataclass(frozen=True)
class SlotHeader:
    key: bytes
    namespace: bytes
    length: int  # the block's raw bytes
    checksum: int  # of the raw bytes: what a reader gets back, whatever the codec
    sequence: int
    payload: int  # bytes stored after the header: ``length`` uncompressed, the compressed size otherwise
    codec: int  # CODEC_IDS

    def pack(self) -> bytes:
        """The slot's header page (see ``pack_slot_header``)."""
        page = bytearray(PAGE)
        pack_slot_header(
            page, 0, self.key, self.namespace, self.length, self.checksum, self.sequence, self.payload, self.codec
        )
        return bytes(page)

    @classmethod
    def unpack(cls, page: bytes) -> SlotHeader | None:
        """The header in a slot's first page, or None when the page is empty, torn or garbage."""
        body = page[: _SLOT_HEADER.size]
        (stored,) = _CHECKSUM.unpack_from(page, _SLOT_HEADER.size)
        if xxhash.xxh3_64_intdigest(body) != stored:
            return None
        magic, namespace, key_len, key, length, checksum, sequence, payload, codec_id = _SLOT_HEADER.unpack(body)
        if magic != SLOT_MAGIC or key_len > MAX_KEY_BYTES:
            return None
        return cls(key[:key_len], namespace, length, checksum, sequence, payload, codec_id)


def pack_slot_header(
    buffer: bytearray,
    offset: int,
    key: bytes,
    namespace: bytes,
    length: int,
    checksum: int,
    sequence: int,
    payload: int,
    codec_id: int,
) -> None:
    """Write a slot header into ``buffer`` at ``offset``, the start of a page whose bytes past the header
    are zero: in place, as a store builds one per block (0.55 us against 4.3 for a ``SlotHeader`` built
    and packed). Raises ValueError for a key longer than MAX_KEY_BYTES: a header keeps its key whole,
    never cut (a cut key would store fine and never load)."""
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(
            f"key {key[:16].hex()}... is {len(key)} bytes long; a disk slot header holds at most {MAX_KEY_BYTES}"
        )
    _SLOT_HEADER.pack_into(
        buffer, offset, SLOT_MAGIC, namespace, len(key), key, length, checksum, sequence, payload, codec_id
    )
    body = memoryview(buffer)[offset : offset + _SLOT_HEADER.size]
    _CHECKSUM.pack_into(buffer, offset + _SLOT_HEADER.size, xxhash.xxh3_64_intdigest(body))


def _pack_file_header(block_bytes: int, slot_stride: int, num_slots: int, codec_id: int) -> bytes:
    fields = _FILE_HEADER.pack(FILE_MAGIC, VERSION, block_bytes, slot_stride, num_slots, codec_id)
    return fields + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(fields))


def _unpack_file_header(raw: bytes) -> tuple | None:
    """(magic, version, block_bytes, slot_stride, num_slots, codec id), or None when ``raw`` is short or
    fails its checksum."""
    if len(raw) < _FILE_HEADER.size + _CHECKSUM.size:
        return None
    if xxhash.xxh3_64_intdigest(raw[: _FILE_HEADER.size]) != _CHECKSUM.unpack_from(raw, _FILE_HEADER.size)[0]:
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
    if old_codec & SEALED != codec_id & SEALED:
        return f"encryption changed from {_sealing_name(old_codec)} to {_sealing_name(codec_id)}"
    if old_codec != codec_id:
        return f"compression changed from {_compression_name(old_codec)} to {_compression_name(codec_id)}"
    if old_stride != slot_stride:
        return f"the slot size changed from {old_stride - PAGE} to {slot_stride - PAGE} bytes (slot_bytes)"
    return None


_BLANK_PAGE = bytes(PAGE)
"""A slot header page never written (compared whole: 250x faster than looking for a non-zero byte)."""


def read_slot_headers(fd: int, num_slots: int, slot_stride: int, start: int = 0):
    """Yield (slot, header or None, blank) for slots ``start`` .. ``num_slots - 1`` of a slab file; a short
    page counts as damaged."""
    for slot in range(start, num_slots):
        page = os.pread(fd, PAGE, PAGE + slot * slot_stride)
        header = SlotHeader.unpack(page) if len(page) == PAGE else None
        yield slot, header, page == _BLANK_PAGE


def checked_slot_room(path: str | os.PathLike, block_bytes: int, compression: str, slot_bytes: int | None) -> int:
    """``slot_room``, once a slot size that cannot work is refused (ConfigError naming the tier's path)."""
    problem = slot_problem(block_bytes, compression, slot_bytes)
    if problem is not None:
        raise ConfigError(f"disk tier {str(path)!r}: {problem}")
    return slot_room(block_bytes, compression, slot_bytes)


def _compression_name(codec_id: int) -> str:
    return CODEC_NAMES.get(codec_id & ~SEALED, f"unknown ({codec_id})")


def _sealing_name(codec_id: int) -> str:
    return "aes-gcm" if codec_id & SEALED else "none"


def slab_codec_id(compression: str, sealed: bool) -> int:
    """The codec id of a slab's file and slot headers: its compression, and whether it seals."""
    return CODEC_IDS[compression] | (SEALED if sealed else 0)


def header_fields(page: bytes | memoryview) -> bytes:
    """The fields of a slot header page that a seal binds (the header without its checksum)."""
    return bytes(page[: _SLOT_HEADER.size])


def header_fits(header: SlotHeader, block_bytes: int, codec_id: int, room: int) -> bool:
    """Whether a header describes a block a slab of this geometry holds: its size, its codec, a payload
    that fits the slot's ``room`` (exactly the block when uncompressed)."""
    if header.length != block_bytes or header.codec != codec_id:
        return False
    if codec_id & ~SEALED == CODEC_IDS["none"]:
        return header.payload == block_bytes
    return 0 < header.payload <= room


def _slots_in_file(file_bytes: int, slot_stride: int) -> int:
    """Whole slots a slab file of ``file_bytes`` holds after its file header page: what any scan is
    bounded by, whatever a header claims."""
    return max(0, file_bytes - PAGE) // slot_stride


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
    slab fails the owner's checks (``disk_files``: the same ownership, mode and file-type rules,
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
        fields = _unpack_file_header(os.pread(fd, _FILE_HEADER.size + _CHECKSUM.size, 0))
        if _geometry_change(fields, layout.block_bytes, PAGE + room, codec_id) is not None:
            return {}
        in_file = _slots_in_file(os.fstat(fd).st_size, PAGE + room)
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
    no slab, or it fails the owner's checks (``disk_files``), or its file header is not a readable
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
        num_slots = min(claimed, _slots_in_file(st.st_size, slot_stride))
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
            "compression": _compression_name(codec_id),
            "encryption": _sealing_name(codec_id),
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
    fields = _unpack_file_header(os.pread(fd, _FILE_HEADER.size + _CHECKSUM.size, 0))
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


HeldBlocks = Callable[[], tuple[list[bytes], list[int]]]
"""What lists a tier's READY blocks, as (keys, slots) oldest first, for its slab's index snapshot."""


class Recovered(NamedTuple):
    """What reopening a slab found (``DiskSlab.recover``)."""

    blocks: int
    damaged: int  # slot headers not blank yet failing their checks (a scan counts them; a snapshot knows none)
    source: str  # "index snapshot" or "scan"


class DiskSlab:
    """The slab file and its directory: geometry, file descriptors (the main one holds the lock; the
    directory's is kept for the index snapshot), and the newest header sequence number.

    Thread safety: positioned I/O on the descriptors is safe from any thread. ``count`` and
    ``refuse`` (the tier's, set by ``disk_tier``) take the tier's lock. ``held_blocks`` (also set by
    ``disk_tier``) lists the tier's blocks, as (keys, slots) oldest first, for the snapshot the
    close writes; without it the close writes none. ``restoring`` (a disk tier's, set by
    ``disk_tier``): its blocks going back into the index after the open (``disk_restore``).
    """

    @classmethod
    def from_config(
        cls,
        tier_cfg: DiskTierConfig,
        num_slots: int,
        layout: BlockLayout,
        namespace: str,
        path: str | os.PathLike | None = None,
    ) -> DiskSlab:
        """The slab a disk tier's settings describe, in ``path`` instead of theirs where given (a vLLM
        worker's directory of its rank): the one place that turns those settings into a slab."""
        return cls(
            tier_cfg.path if path is None else path,
            num_slots,
            layout,
            namespace,
            tier_cfg.o_direct,
            tier_cfg.compression,
            tier_cfg.slot_bytes,
            shared_directory=tier_cfg.shared_directory,
            reinitialise=tier_cfg.reinitialise,
            sealing=tier_cfg.sealing(),
        )

    def __init__(
        self,
        path: str | os.PathLike,
        num_slots: int,
        layout: BlockLayout,
        namespace: str,
        o_direct: str = "auto",
        compression: str = "none",
        slot_bytes: int | None = None,
        *,
        shared_directory: bool = False,
        reinitialise: bool = False,
        sealing: SealingKeys | None = None,
    ) -> None:
        if o_direct not in ("auto", "on", "off"):  # before anything: a slab must not half-open on a typo
            raise ConfigError(f"o_direct must be auto, on or off, got {o_direct!r}")
        self.codec = codec(compression)  # first: a missing package must not leave a file behind
        self.sealing = sealing  # seals every slot's bytes (``encryption: aes-gcm``), or None
        self.codec_id = slab_codec_id(compression, sealing is not None)
        self.dir = Path(path)
        self.path = self.dir / SLAB_NAME
        self.num_slots = num_slots
        self.block_bytes = block_bytes = layout.block_bytes
        self.room = checked_slot_room(self.dir, block_bytes, compression, slot_bytes)  # payload bytes a slot holds
        self.slot_stride = PAGE + self.room
        self.namespace = namespace_digest(namespace, layout)
        self.count = lambda **counts: None  # where the backend counts incompressible blocks
        self.refuse = lambda keys: None  # where the backend names blocks that can never fit (Tier.refuse)
        self.held_blocks: HeldBlocks | None = None
        self.restoring: ChunkedRestore | None = None  # a disk tier's, putting its blocks back (``disk_tier``)
        self.shared = shared_directory
        self.file_bytes = PAGE + num_slots * self.slot_stride
        self.fd: int | None = None  # the main descriptor, holding the lock; None once closed
        self.direct_fd: int | None = None
        self._snapshot: Snapshot | None = None  # taken at open, until ``recover``
        # keys of blocks of other namespaces a scan found (a disk tier's: ``DiskTier.hold_elsewhere``)
        self.foreign: set[bytes] | None = None
        self.sequence = 0
        self.dir_fd: int | None = open_directory(self.dir, shared=shared_directory, create=True)
        try:
            self._open(self.dir_fd, shared_directory, reinitialise, o_direct)
        except BaseException:
            self.close()
            raise

    @property
    def o_direct(self) -> bool:
        return self.direct_fd is not None

    @property
    def open_fd(self) -> int:
        """The main descriptor, for I/O while the slab is open."""
        if self.fd is None:
            raise ClosedError(f"disk tier slab {str(self.path)!r} is closed")
        return self.fd

    def slot_offset(self, slot: int) -> int:
        return PAGE + slot * self.slot_stride

    # --- opening -------------------------------------------------------------------------------

    def _open(self, dir_fd: int, shared_directory: bool, reinitialise: bool, o_direct: str) -> None:
        """Open and lock the slab in ``dir_fd`` and make it fit this geometry. On any error nothing stays
        open, and a slab this call created is removed again (no empty slab is left behind)."""
        fd, created = open_slab(dir_fd, self.dir, shared=shared_directory)
        self.fd = fd
        try:
            try:
                self._snapshot = self._take_snapshot(dir_fd)
                self._prepare_file(reinitialise)
                self.direct_fd = self._open_direct(o_direct, dir_fd)
            except DiskTierError:
                raise
            except OSError as exc:
                raise DiskTierError(f"disk tier slab {str(self.path)!r} cannot be set up: {exc.strerror}") from exc
        except BaseException:
            if created:
                remove_slab(dir_fd, fd)
            self.close()
            raise

    def _identity(self, st: os.stat_result) -> SlabIdentity:
        """What an index snapshot names to describe this slab, the file ``st`` describes."""
        return SlabIdentity(
            VERSION,
            self.block_bytes,
            self.slot_stride,
            self.num_slots,
            self.codec_id,
            self.namespace,
            st.st_ino,
            st.st_size,
            st.st_mtime_ns,
        )

    def _take_snapshot(self, dir_fd: int) -> Snapshot | None:
        """The blocks of the index snapshot the last clean close left, when it describes this slab as it
        is and this open keeps its geometry (``take_snapshot``); the snapshot is removed either way,
        and this runs before anything writes to the slab."""
        fd = self.open_fd
        header = _pack_file_header(self.block_bytes, self.slot_stride, self.num_slots, self.codec_id)
        kept = os.pread(fd, len(header), 0) == header
        identity = self._identity(os.fstat(fd)) if kept else None
        return take_snapshot(dir_fd, self.dir, shared=self.shared, identity=identity)

    def _prepare_file(self, reinitialise: bool) -> None:
        """Keep a file of the same geometry, also at another capacity; start a fresh one, saying why,
        otherwise (``_discard``). Preallocate the whole size.

        Slot offsets do not depend on the slot count, so a larger capacity keeps every block and a
        smaller one keeps those in the slots that remain (the file is cut first, then the header
        rewritten: a crash in between leaves a header whose geometry still describes the file)."""
        header = _pack_file_header(self.block_bytes, self.slot_stride, self.num_slots, self.codec_id)
        fd = self.open_fd
        first_page = os.pread(fd, PAGE, 0)
        rewrite = first_page[: len(header)] != header
        if rewrite:
            old = _unpack_file_header(first_page)
            change = _geometry_change(old, self.block_bytes, self.slot_stride, self.codec_id)
            if change is not None:
                self._discard(first_page, change, reinitialise)
            elif old is not None:  # always, when nothing changed: a valid header, of another slot count
                self._resize(old[4])
        self._preallocate()
        if rewrite:
            os.pwrite(fd, header.ljust(PAGE, b"\0"), 0)
            os.fdatasync(fd)

    def _discard(self, first_page: bytes, change: str, reinitialise: bool) -> None:
        """Empty a file that cannot serve this geometry. A kvtier slab (its magic first, also with a
        damaged header) goes with a warning saying why; a file without the magic is someone else's and
        is overwritten only with ``reinitialise`` (a mistyped path must not destroy data). An empty file,
        or one whose first page is zeros (a crash right after its creation), is fresh already."""
        if first_page.startswith(FILE_MAGIC):
            log.warning("disk tier %s: %s; discarding the old cache", self.path, change)
        elif any(first_page):
            if not reinitialise:
                raise DiskTierError(
                    f"{str(self.path)!r} is not a kvtier slab (it does not start with "
                    f"{FILE_MAGIC.decode()}); kvtier never overwrites a file it did not write. "
                    f"Move the file away, point the tier at another directory, or set "
                    f"reinitialise: true to overwrite it"
                )
            log.warning("disk tier %s: the file is not a kvtier slab; overwriting it (reinitialise: true)", self.path)
        os.ftruncate(self.open_fd, 0)

    def _preallocate(self) -> None:
        """Reserve the whole file now, so that a full filesystem shows at open rather than as failed
        stores later; sparse where the filesystem cannot preallocate. A size the filesystem or the
        platform cannot hold at all is refused, naming the tier."""
        fd = self.open_fd
        st = os.fstat(fd)
        if st.st_size == self.file_bytes and st.st_blocks * 512 >= self.file_bytes:
            return  # reserved by an earlier open: walking every extent again costs seconds at 16 M slots
        vfs = os.fstatvfs(fd)  # before: a failed fallocate may hold the space it got until the file goes
        free = vfs.f_bavail * vfs.f_frsize
        try:
            try:
                os.posix_fallocate(fd, 0, self.file_bytes)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(fd, max(self.file_bytes, os.fstat(fd).st_size))  # sparse, where unsupported
        except OverflowError:  # more than an off_t holds
            raise self._too_large() from None
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise DiskTierError(
                    f"disk tier {str(self.dir)!r} needs {self.file_bytes} bytes and the "
                    f"filesystem has {free} free; lower its capacity"
                ) from exc
            if exc.errno in (errno.EFBIG, errno.EINVAL):
                raise self._too_large() from exc
            raise

    def _too_large(self) -> DiskTierError:
        return DiskTierError(
            f"disk tier {str(self.dir)!r}: {self.num_slots} slots need a file of {self.file_bytes} "
            f"bytes, more than this filesystem or platform can hold; lower its capacity"
        )

    def _resize(self, old_slots: int) -> None:
        """Keep the blocks of a slab written with ``old_slots`` slots: cut the slots past the new end."""
        if old_slots > self.num_slots:
            fd = self.open_fd
            in_file = _slots_in_file(os.fstat(fd).st_size, self.slot_stride)  # a crash may have cut it already
            cut = [
                slot
                for slot, header, _ in read_slot_headers(
                    fd, min(old_slots, in_file), self.slot_stride, start=self.num_slots
                )
                if header is not None
            ]
            log.warning(
                "disk tier %s: capacity shrank from %d to %d slots; dropping the %d block(s) stored "
                "past the new end, keeping the rest",
                self.path,
                old_slots,
                self.num_slots,
                len(cut),
            )
            os.ftruncate(fd, self.file_bytes)
        else:
            log.info(
                "disk tier %s: capacity grew from %d to %d slots; keeping every block",
                self.path,
                old_slots,
                self.num_slots,
            )

    def _open_direct(self, mode: str, dir_fd: int) -> int | None:
        """An O_DIRECT descriptor when the filesystem takes aligned direct I/O; None (buffered) otherwise."""
        if mode == "off" or not hasattr(os, "O_DIRECT"):
            return None
        probe = mmap.mmap(-1, PAGE)
        try:
            fd = reopen_slab(dir_fd, self.dir, self.open_fd, os.O_RDWR | os.O_DIRECT)
        except DiskTierError:
            raise
        except OSError as exc:
            self._no_direct(mode, exc)
            return None
        try:
            os.preadv(fd, [probe], 0)  # the file header page: aligned buffer, offset and length
            return fd
        except OSError as exc:
            os.close(fd)
            self._no_direct(mode, exc)
            return None
        finally:
            probe.close()

    def _no_direct(self, mode: str, exc: OSError) -> None:
        if mode == "on":
            raise DiskTierError(f"O_DIRECT was asked for but {str(self.dir)!r} refuses it: {exc.strerror}") from exc
        log.info("disk tier %s: the filesystem refuses O_DIRECT (%s); using buffered I/O", self.dir, exc.strerror)

    # --- recovery ------------------------------------------------------------------------------

    def recover(self, restore: Callable[[Sequence[bytes], Sequence[int] | np.ndarray], object]) -> Recovered:
        """Hand the blocks this slab holds, as keys and slots oldest first, to ``restore`` (``Tier.restore``,
        or ``ChunkedRestore.start``, which puts them back while the tier serves) and take up their
        newest sequence number: from the index snapshot the open took, when there was a valid one and
        ``restore`` accepts it, by a ``scan`` otherwise. ``restore`` claims every slot or none, and
        raises StateError for one it cannot take; a key named twice, which only a forged snapshot
        holds, is the restore's to drop (the snapshot's own checks leave that one out: a set of 15.8 M
        keys costs seconds, and the tier notices anyway, its index growing by fewer keys than it
        was given)."""
        snapshot, self._snapshot = self._snapshot, None
        if snapshot is not None:
            try:
                restore(snapshot.keys, snapshot.slots)
            except StateError as exc:
                log.warning("disk tier %s: index snapshot not used (%s); scanning every slot header", self.path, exc)
            else:
                self.sequence = max(self.sequence, snapshot.sequence)
                return Recovered(len(snapshot), 0, "index snapshot")
        found, damaged = self.scan()
        restore([key for _, key, _ in found], [slot for _, _, slot in found])
        return Recovered(len(found), damaged, "scan")

    def scan(self) -> tuple[list[tuple[int, bytes, int]], int]:
        """Read every slot header: ([(sequence, key, slot)] of valid blocks of this namespace, damaged count).

        A slot holding the same key as a newer slot is left out (an older copy). Damaged headers
        (not blank, failing their checksum or geometry) are counted; their slots are free. Keys of
        other namespaces' blocks go into ``foreign`` where it is a set (their slots are free too).
        """
        found: dict[bytes, tuple[int, bytes, int]] = {}
        damaged = 0
        for slot, header, blank in read_slot_headers(self.open_fd, self.num_slots, self.slot_stride):
            if header is None:
                damaged += not blank
                continue
            if header.namespace != self.namespace:
                if self.foreign is not None and len(self.foreign) < FOREIGN_KEPT:
                    self.foreign.add(header.key)
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
        """Flush the slab, leave the index snapshot of ``held_blocks`` beside it (when set), and close the
        descriptors; closing the main one releases the lock, also when the fsync fails. The snapshot
        is written after the slab's final fsync, holding the lock."""
        held, self.held_blocks = self.held_blocks, None
        self._snapshot = None
        fd, dir_fd = self.fd, self.dir_fd
        descriptors = (self.direct_fd, fd, dir_fd)
        self.direct_fd = self.fd = self.dir_fd = None
        try:
            if fd is not None:
                if held is not None and dir_fd is not None and self._seal(fd):
                    os.fsync(fd)
                    self._write_snapshot(fd, dir_fd, held)
                else:
                    os.fsync(fd)
        finally:
            for each in descriptors:
                if each is not None:
                    os.close(each)

    def _seal(self, fd: int) -> bool:
        """Ready the slab for a snapshot: set its mtime just below its last write's, a time no later write
        can give it (a write sets the clock's current time, which is at least the last one), so that a
        snapshot naming the mtime is stale after any write, even one within the clock's tick. False
        (logged) when the mtime cannot be set (another user's slab in a shared directory): no
        snapshot may then describe the slab."""
        try:
            st = os.fstat(fd)
            os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns - 1))
            return True
        except OSError as exc:
            self._no_snapshot(exc)
            return False

    def _write_snapshot(self, fd: int, dir_fd: int, held: HeldBlocks) -> None:
        """Write the index snapshot of the blocks ``held`` lists, for the slab as it is now (sealed and
        synced). A snapshot that cannot be written is logged, not raised: the next open scans."""
        keys, slots = held()
        identity = self._identity(os.fstat(fd))
        try:
            write_snapshot(
                dir_fd, shared=self.shared, identity=identity, keys=keys, slots=slots, sequence=self.sequence
            )
        except OSError as exc:
            self._no_snapshot(exc)

    def _no_snapshot(self, why: object) -> None:
        log.warning(
            "disk tier %s: index snapshot not written (%s); the next open scans every slot header", self.path, why
        )


class FileStorage(BlockStorage):
    """A slab file as block storage: "addresses" are file offsets of each slot's data (after its header)."""

    def __init__(self, slab: DiskSlab, layout: BlockLayout) -> None:
        super().__init__(BlockLayout.contiguous(layout.block_bytes), slab.num_slots, FILE_DEVICE, slab, slab.close)
        self.slab = slab

    def _addresses(self, slots):
        return (PAGE + slots * self.slab.slot_stride + PAGE)[:, None]


class DiskTier(Tier):
    """A tier over a slab that keeps the namespaces of the stacks that used its directory
    (``namespaces.json``, ``disk_namespaces``): a ``NamespaceBook`` (``core/namespaces.py``)."""

    def __init__(
        self,
        name: str,
        storage: FileStorage,
        policy: EvictionPolicy[bytes],
        watermark: Watermark | None,
        is_fenced: Callable[[str, int], bool] | None,
        note: str,
    ) -> None:
        super().__init__(name, "disk", storage, policy, watermark, is_fenced, note)
        self.slab = storage.slab

    def record_namespace(self, ours: KnownNamespace) -> list[KnownNamespace]:
        """Record ``ours`` in the directory's ``namespaces.json``; the others it lists (none once closed)."""
        if self.slab.dir_fd is None:
            return []
        return record(self.slab.dir_fd, self.slab.dir, ours, shared=self.slab.shared)

    def hold_elsewhere(self, keys: Sequence[tuple[KnownNamespace, bytes]]) -> list[bool]:
        """Whether the slab holds each key: in this tier's index (a namespace whose blocks have this
        tier's digest, such as another block size), or among the other digests' blocks the open found
        (they stay until their slots are reused: a statistic, which may be stale)."""
        foreign = self.slab.foreign or set()
        return [self.state(key) is BlockState.READY or key in foreign for _, key in keys]


def disk_tier(
    name: str,
    num_slots: int,
    layout: BlockLayout,
    policy: EvictionPolicy[bytes],
    watermark: Watermark | None = None,
    is_fenced=None,
    *,
    config: DiskTierConfig,
    namespace: str = "",
) -> DiskTier:
    """A tier of ``num_slots`` blocks over the slab its ``config`` describes, holding again every block a
    previous process committed there under the same namespace, block size and slot geometry (codec and
    slot size): their slots are taken at once, and the blocks come back into the index in chunks
    while the tier already serves (``disk_restore``; until then each is a miss). Raises ConfigError
    for a bad combination or a codec whose package is missing.
    """
    slab = DiskSlab.from_config(config, num_slots, layout, namespace)
    slab.foreign = set()
    try:
        io = "O_DIRECT" if slab.o_direct else "buffered I/O"
        packing = "" if slab.codec is None else f", {config.compression} into {slab.room} B slots"
        packing += ", sealed (aes-gcm)" if slab.sealing is not None else ""
        tier = DiskTier(name, FileStorage(slab, layout), policy, watermark, is_fenced, f"{slab.path}, {io}{packing}")
        slab.restoring = ChunkedRestore(tier, str(slab.path))
        recovered = slab.recover(slab.restoring.start)
        # (the close runs once no job is left: nothing changes while it lists the blocks)
        slab.held_blocks = slab.restoring.held_blocks
        tier.note += f", {recovered.blocks} blocks recovered ({recovered.source})"
        tier.count(damaged=recovered.damaged)
        slab.count, slab.refuse = tier.count, tier.refuse
        return tier
    except BaseException:
        if slab.restoring is not None:
            slab.restoring.stop()
        slab.close()
        raise


def rank_directory(path: str | os.PathLike, rank: int) -> Path:
    """The directory of one rank's slab under a disk tier's ``path`` (each rank holds its own shard of
    every block)."""
    return Path(path) / f"rank{rank}"


def _tier(request: TierRequest) -> Tier:
    assert isinstance(request.config, DiskTierConfig)
    policy, watermark = request.policy()
    return disk_tier(
        request.name,
        request.slots,
        request.layout,
        policy,
        watermark,
        request.is_fenced,
        config=request.config,
        namespace=request.stack.namespace,
    )


def _rank_storage(request: RankRequest) -> BlockStorage:
    """One rank's slab. Recovering takes up the newest sequence number and leaves every old header
    as it is: the blocks an engine's scheduler side took back (``connectors/vllm/recovery.py``) stay
    readable, and any slot is cleared before new bytes land in it. A worker holds no index (the
    scheduler side does), so its clean close leaves a snapshot of no blocks (``_no_blocks``): it
    carries the sequence number, and the next open takes it from there instead of reading every
    slot header; after a crash it reads them."""
    assert isinstance(request.config, DiskTierConfig)
    path = rank_directory(request.config.path, request.rank)
    slab = DiskSlab.from_config(request.config, request.slots, request.layout, request.namespace, path)
    try:
        slab.recover(lambda keys, slots: None)
    except BaseException:
        slab.close()
        raise
    slab.refuse = request.refuse
    slab.held_blocks = _no_blocks
    return FileStorage(slab, request.layout)


def _direct(other: str, caps: Capabilities) -> bool:
    """A disk slab and GPU memory copy without host staging where GPUDirect Storage is available."""
    return other == "gpu" and caps.gpu_direct_storage


MEDIUM = Medium(
    "disk",
    DiskTierConfig,
    _tier,
    _rank_storage,
    direct=_direct,
    event_medium="STORAGE",
    hit_source="DISK",
    survives_restart=True,
)


def _no_blocks() -> tuple[list[bytes], list[int]]:
    """What an engine's worker lists for its slab's snapshot: no block (the scheduler side indexes them)."""
    return [], []


_RANK_FILE = struct.Struct("<QQq")
"""One rank's slab file in ``rank_slabs_identity``'s digest: inode, size, mtime (ns)."""


def rank_slabs_identity(
    config: DiskTierConfig, ranks: int, num_slots: int, layout: BlockLayout, namespace: str
) -> SlabIdentity | None:
    """What an index of the blocks held by an engine's ``ranks`` slabs (``rank_directory``, each of
    ``num_slots`` slots) names to describe them (``disk_snapshot``): the geometry and namespace the
    configuration gives, and every rank's slab file as it is now. A worker's clean close seals its
    slab's mtime (``DiskSlab.close``) and any later write changes it, so an index written after the
    workers closed describes the slabs only until one of them is written again. None when a rank
    has no slab; raises OSError (DiskTierError included) when one fails the owner's checks
    (``disk_files``, ``shared_directory`` as configured) or cannot be read."""
    room = checked_slot_room(config.path, layout.block_bytes, config.compression, config.slot_bytes)
    files = []
    for rank in range(ranks):
        fd = open_slab_for_reading(rank_directory(config.path, rank), shared=config.shared_directory)
        if fd is None:
            return None
        try:
            files.append(os.fstat(fd))
        finally:
            os.close(fd)
    first, others = files[0], files[1:]
    others_digest = xxhash.xxh3_128_digest(
        b"".join(_RANK_FILE.pack(st.st_ino, st.st_size, st.st_mtime_ns) for st in others)
    )
    return SlabIdentity(
        VERSION,
        layout.block_bytes,
        PAGE + room,
        num_slots,
        CODEC_IDS[config.compression],
        namespace_digest(namespace, layout),
        first.st_ino,
        first.st_size,
        first.st_mtime_ns,
        ranks,
        others_digest if others else bytes(16),
    )
