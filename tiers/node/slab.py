"""The node slab: one file of shared memory that a node daemon owns and every engine process on the
machine maps, so that one copy of a block serves them all.

Layout (little-endian); the data starts at a 2 MiB boundary (a huge page) and every slot at a page::

    superblock (4 KiB) | slot headers (SLOT_HEADER_BYTES each) | data (slot_bytes each)

The superblock names the format, the geometry and the slab's id (random, made with the file): an engine
reconnecting to a restarted daemon keeps its mapping when the id is the one it mapped.

A slot header says who may read the slot, and what a reader checks (``HEADER``):

- ``gen``: bumped by the daemon each time it hands the slot to a writer, before the writer hears of it.
  A reader that sees the generation its pin named before and after its copy copied bytes that no writer
  was given meanwhile, even across a daemon restart (a restarted daemon goes on from the slab's gens);
- ``state``: FREE, WRITING (handed to a writer) or READY (committed), set by the daemon;
- ``key`` and ``length``: the block's node key and byte count, set by the daemon with the generation;
- ``checksum``: written by the writer before it commits, over the key and the block's bytes and seeded
  with the generation (``checksum``): a torn or buggy write is a miss for every reader, never wrong
  bytes, and so is a slot that a writer whose reservation was taken back (its connection closed, the
  daemon restarted) still wrote into after the slot went to another writer: its checksum was made
  for another generation;
- ``seq``: the daemon's commit count at commit, so a restarted daemon restores blocks oldest first;
- ``writer``: the writing process's pid, for whoever reads the slab by hand.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import secrets
import stat
import struct
from typing import NamedTuple

import numpy as np
import xxhash

from kvtier.core.errors import ConfigError

PAGE = 4096
HUGE_PAGE = 2 << 20
SUPERBLOCK_BYTES = PAGE
SLOT_HEADER_BYTES = 64
MAGIC = b"KVTNODE\x00"
FORMAT_VERSION = 1
ID_BYTES = 16
_SUPER = struct.Struct(f"<8sIQQ{ID_BYTES}s")  # magic, format version, slots, slot bytes, slab id

FREE, WRITING, READY = 0, 1, 2
HEADER = np.dtype(
    [
        ("gen", "<u8"),
        ("state", "<u4"),
        ("length", "<u4"),
        ("key", "V16"),
        ("checksum", "<u8"),
        ("seq", "<u8"),
        ("writer", "<u4"),
        ("_pad", "V12"),
    ]
)
assert HEADER.itemsize == SLOT_HEADER_BYTES
KEY_OFFSET = 16  # (where ``key`` starts in a header: after gen, state and length)
assert HEADER.fields is not None and HEADER.fields["key"][1] == KEY_OFFSET
NODE_KEY_BYTES = 16


class Geometry(NamedTuple):
    """``slots`` slots of ``slot_bytes`` (a page multiple) each, and where each region starts."""

    slots: int
    slot_bytes: int

    @classmethod
    def for_blocks(cls, slots: int, block_bytes: int) -> Geometry:
        """Room for ``slots`` blocks of up to ``block_bytes``, each slot a whole number of pages."""
        return cls(slots, -(-block_bytes // PAGE) * PAGE)

    @property
    def header_offset(self) -> int:
        return SUPERBLOCK_BYTES

    @property
    def data_offset(self) -> int:
        return _round_up(SUPERBLOCK_BYTES + self.slots * SLOT_HEADER_BYTES, HUGE_PAGE)

    @property
    def nbytes(self) -> int:
        """The file's size: a whole number of huge pages (a hugetlbfs file must be)."""
        return _round_up(self.data_offset + self.slots * self.slot_bytes, HUGE_PAGE)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class SlabView:
    """A mapped slab: its headers as a structured array, its slots' addresses, its id. Holds the mapping
    for as long as it lives; copies take the view they copy with, so a mapping outlives them."""

    def __init__(self, mapping: mmap.mmap, geometry: Geometry) -> None:
        magic, version, slots, slot_bytes, slab_id = _SUPER.unpack_from(mapping, 0)
        if magic != MAGIC or version != FORMAT_VERSION or (slots, slot_bytes) != tuple(geometry):
            raise ConfigError(
                f"not a node slab of format {FORMAT_VERSION} with {geometry.slots} slots of {geometry.slot_bytes} "
                f"bytes (magic {magic!r}, format {version}, {slots} slots of {slot_bytes} bytes)"
            )
        self.mapping = mapping
        self.geometry = geometry
        self.id: bytes = slab_id
        self.headers = np.frombuffer(mapping, HEADER, geometry.slots, geometry.header_offset)
        # each field as an array of its own (a field taken from ``headers`` is a new view each time)
        self.gen, self.state, self.length = self.headers["gen"], self.headers["state"], self.headers["length"]
        self.checksum, self.seq, self.writer = self.headers["checksum"], self.headers["seq"], self.headers["writer"]
        self.keys = np.ndarray(
            (geometry.slots, NODE_KEY_BYTES),
            np.uint8,
            mapping,
            geometry.header_offset + KEY_OFFSET,
            (SLOT_HEADER_BYTES, 1),
        )
        self._memory = np.frombuffer(mapping, np.uint8, geometry.slots * geometry.slot_bytes, geometry.data_offset)
        self.base = self._memory.ctypes.data

    def address(self, slot: int) -> int:
        return self.base + slot * self.geometry.slot_bytes

    def block(self, slot: int, length: int) -> memoryview:
        """The first ``length`` bytes of ``slot``."""
        start = slot * self.geometry.slot_bytes
        return self._memory[start : start + length].data


def checksum(gen: int, key: bytes) -> xxhash.xxh3_64:
    """The hash a block's checksum is made with, fed ``key`` already: the bytes go in next, in order."""
    h = xxhash.xxh3_64(seed=gen)
    h.update(key)
    return h


def memory_view(address: int, size: int) -> memoryview:
    """``size`` bytes of this process's memory at ``address``, as bytes."""
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


# --- the daemon's side: the file ---------------------------------------------------------------------


class SlabFile:
    """The slab file a daemon owns: created (0600, exclusively) or reopened, locked against a second
    daemon, mapped. ``reused`` says whether it was found with this geometry (its blocks can be restored).

    The lock is on ``fd``, which nothing maps; the daemon and the engines map ``shared_fd``, a second
    open of the same file: a lock belongs to the open file, and a mapping keeps the file it was made from
    open, so mappings of the locked one would keep a restarted daemon from locking the slab for as long
    as any engine (or the daemon's own index) ran."""

    def __init__(self, path: str, geometry: Geometry, hugepages: bool = False) -> None:
        self.path = path
        self.geometry = geometry
        self.fd, self.reused = _open(path, geometry)
        if not self.reused and os.fstat(self.fd).st_size:  # a node slab of another geometry: made anew
            self.fd = _replace(path, self.fd)
        try:
            self._lock()
            self.shared_fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDWR | os.O_CLOEXEC)
            if not self.reused:
                os.ftruncate(self.fd, geometry.nbytes)
            mapping = mmap.mmap(self.shared_fd, geometry.nbytes, mmap.MAP_SHARED)
            if hugepages and hasattr(mmap, "MADV_HUGEPAGE"):
                mapping.madvise(mmap.MADV_HUGEPAGE)  # shmem gets them where shmem_enabled allows
            if not self.reused:
                _SUPER.pack_into(mapping, 0, MAGIC, FORMAT_VERSION, *geometry, secrets.token_bytes(ID_BYTES))
            self.view = SlabView(mapping, geometry)
        except BaseException:
            self.close()
            raise

    def _lock(self) -> None:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"{self.path} is in use by another node daemon") from None

    def close(self) -> None:
        """Unlock and close the file; the slab stays for the next daemon (a restart keeps the cache)."""
        for fd in (self.fd, getattr(self, "shared_fd", -1)):
            if fd >= 0:
                os.close(fd)


def _open(path: str, geometry: Geometry) -> tuple[int, bool]:
    """The slab's descriptor, and whether it holds a slab of ``geometry`` already. A file that exists must
    be this user's private regular file holding a node slab (of any geometry): anything else is a
    ConfigError, never truncated (a mistyped path must not destroy somebody's file, and a file another
    user planted must not become the cache)."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
        os.fchmod(fd, 0o600)  # whatever the umask
        return fd, False
    except FileExistsError:
        pass
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot open the node slab: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise ConfigError(
                f"{path} is not a private file of this user (mode {stat.filemode(st.st_mode)}, owner uid "
                f"{st.st_uid}): refusing to use it as the node slab; remove it or choose another slab path"
            )
        head = os.pread(fd, _SUPER.size, 0)
        if len(head) < _SUPER.size or head[: len(MAGIC)] != MAGIC:
            raise ConfigError(f"{path} exists and is not a node slab: refusing to overwrite it")
        _, version, slots, slot_bytes, _ = _SUPER.unpack(head)
        same = version == FORMAT_VERSION and (slots, slot_bytes) == tuple(geometry) and st.st_size == geometry.nbytes
        return fd, same
    except BaseException:
        os.close(fd)
        raise


def _replace(path: str, fd: int) -> int:
    """A new, empty file at ``path`` in place of the node slab open as ``fd`` (closed here), once no other
    daemon holds that one. Never truncated in place: engines may still map the old file, and a mapping
    of a file that shrinks kills its process (SIGBUS) at the next read."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ConfigError(f"{path} is in use by another node daemon") from None
    finally:
        os.close(fd)
    os.unlink(path)
    new, _ = _open(path, Geometry(0, PAGE))
    return new


# --- an engine's side: the descriptor the daemon sent --------------------------------------------------


def map_slab(fd: int, geometry: Geometry) -> SlabView:
    """Map the slab behind ``fd`` (sent by the daemon; closed here) after checking it is a node slab of
    ``geometry`` of the size that takes. Raises ConfigError otherwise."""
    try:
        size = os.fstat(fd).st_size
        if size != geometry.nbytes:
            raise ConfigError(f"the node slab has {size} bytes, its geometry needs {geometry.nbytes}")
        mapping = mmap.mmap(fd, geometry.nbytes, mmap.MAP_SHARED)
    finally:
        os.close(fd)
    return SlabView(mapping, geometry)
