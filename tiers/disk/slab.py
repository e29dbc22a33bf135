"""The slab file and its directory, as one process owns them: opened, fitted to a geometry, recovered,
closed.

Opening (``files``): the directory and slab must be the running user's and writable by nobody else
(unless ``shared_directory``), the slab is never reached through a symbolic link, and a lock on the
slab itself keeps a second process out. A file under the slab's name that is not a kvtier slab is
never overwritten unless ``reinitialise`` says so. A slab of the same geometry is kept, also at
another capacity; one of another geometry is discarded with a warning saying why.

Recovering: the blocks come back from the index snapshot the last clean close left (``snapshot``),
taken and removed at the open before anything writes to the slab, or by a scan of every slot header
where there is none. Closing flushes the slab and, where the tier lists its blocks, leaves the next
snapshot. ``FileStorage`` is the slab as block storage: what the transfer backend (``transfer``,
``io``) reads and writes.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from kvtier.core.devices import FILE_DEVICE
from kvtier.core.errors import ClosedError, ConfigError, StateError
from kvtier.core.layout import BlockLayout
from kvtier.core.restore import ChunkedRestore
from kvtier.core.sealing import SealingKeys
from kvtier.core.storage import BlockStorage
from kvtier.tiers.disk.compression import codec
from kvtier.tiers.disk.config import DiskTierConfig
from kvtier.tiers.disk.files import SLAB_NAME, DiskTierError, open_directory, open_slab, remove_slab, reopen_slab
from kvtier.tiers.disk.format import (
    FILE_MAGIC,
    VERSION,
    SlotHeader,
    checked_slot_room,
    geometry_change,
    header_fits,
    namespace_digest,
    pack_file_header,
    read_slot_headers,
    slab_codec_id,
    slots_in_file,
    unpack_file_header,
)
from kvtier.tiers.disk.slots import PAGE
from kvtier.tiers.disk.snapshot import SlabIdentity, Snapshot, take_snapshot, write_snapshot

log = logging.getLogger(__name__)

FOREIGN_KEPT = 65536
"""Keys of other namespaces' blocks a disk tier's scan remembers at most (``DiskSlab.foreign``)."""


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
    ``disk_tier``): its blocks going back into the index after the open (``restore``).
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
        self.sequence = 0  # the newest slot header's (``next_sequences``)
        self._sequence_lock = threading.Lock()
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

    @property
    def data_fd(self) -> int:
        """The descriptor blocks are read and written through: the O_DIRECT one where there is one."""
        return self.direct_fd if self.direct_fd is not None else self.open_fd

    def slot_offset(self, slot: int) -> int:
        return PAGE + slot * self.slot_stride

    def next_sequences(self, n: int) -> int:
        """The first of ``n`` new sequence numbers for slot headers, one after the other."""
        with self._sequence_lock:
            self.sequence += n
            return self.sequence - n + 1

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
        header = pack_file_header(self.block_bytes, self.slot_stride, self.num_slots, self.codec_id)
        kept = os.pread(fd, len(header), 0) == header
        identity = self._identity(os.fstat(fd)) if kept else None
        return take_snapshot(dir_fd, self.dir, shared=self.shared, identity=identity)

    def _prepare_file(self, reinitialise: bool) -> None:
        """Keep a file of the same geometry, also at another capacity; start a fresh one, saying why,
        otherwise (``_discard``). Preallocate the whole size.

        Slot offsets do not depend on the slot count, so a larger capacity keeps every block and a
        smaller one keeps those in the slots that remain (the file is cut first, then the header
        rewritten: a crash in between leaves a header whose geometry still describes the file)."""
        header = pack_file_header(self.block_bytes, self.slot_stride, self.num_slots, self.codec_id)
        fd = self.open_fd
        first_page = os.pread(fd, PAGE, 0)
        rewrite = first_page[: len(header)] != header
        if rewrite:
            old = unpack_file_header(first_page)
            change = geometry_change(old, self.block_bytes, self.slot_stride, self.codec_id)
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
            in_file = slots_in_file(os.fstat(fd).st_size, self.slot_stride)  # a crash may have cut it already
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
