"""Where a block's bytes hit the disk and come back: the write and read paths of a slab's slots.

A store writes each slot, header page and block bytes, in one call (a run of consecutive slots in one
``pwritev``): no fdatasync and no separate header write. The header holds the checksum of the bytes
it describes and every load verifies key, namespace, length and checksum, so a slot torn by a crash
(new header over old bytes, old header over new bytes, half a block) fails its load and is dropped:
a miss, never wrong data. A load reads header and bytes in one ``preadv``; a block that fails is
reported failed, the stack drops it from the tier, and its slot header is zeroed so a restart does
not find it again (a store that fails zeroes its headers likewise).

I/O goes straight between the caller's memory and the file: with O_DIRECT when the buffers are
4 KiB-aligned (the host tier's slots are), through an aligned bounce buffer when they are not, and
with plain buffered I/O where the filesystem refuses O_DIRECT. Errors (ENOSPC, EIO, short transfers)
fail exactly the blocks they hit; so does a key longer than a slot header holds (``MAX_KEY_BYTES``),
before anything of its block is written.

A sealing slab (``slab.sealing``) seals each block of a run into this thread's staging memory and
writes the run from there, each seal in its header page (``SEAL_AT``); a load reads a run straight
into the caller's memory, as a plain one does, and opens each block in place: the seal's tag, not a
checksum, says it is the block (one that does not open is zeroed there and fails).

A compressing slab (``slab.codec``) moves each block on its own through an aligned bounce buffer: a
store compresses (a payload larger than the slot fails the block, counts it ``incompressible`` and
tells the tier it is refused for good, so the tier above drops it rather than offering it again),
seals the payload where the slab seals, and writes it padded to 4 KiB; a load reads the whole slot,
checks the header, opens and decompresses it and verifies it (the seal's tag, or the checksum of the
raw bytes) before anything reaches the caller's memory.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

import numpy as np
import xxhash

from kvtier.core.jobs import mark_kvtier_thread
from kvtier.core.keys import MAX_KEY_BYTES
from kvtier.core.sealing import SEAL_BYTES, TAG_BYTES
from kvtier.tiers.disk.compression import CorruptPayload
from kvtier.tiers.disk.format import SEAL_AT, SlotHeader, header_fields, pack_slot_header
from kvtier.tiers.disk.slab import DiskSlab
from kvtier.tiers.disk.slots import PAGE, round_up_to_page


@dataclass(slots=True)  # not frozen: a job builds thousands, and a frozen dataclass is slower to build
class BlockIO:
    """One block's bytes: memory pieces (address, size) that fill one contiguous file range."""

    index: int
    slot: int
    key: bytes
    file_offset: int
    pieces: tuple[tuple[int, int], ...]
    nbytes: int  # the pieces' sizes added up
    aligned: bool  # every piece starts and ends on a page boundary (what O_DIRECT needs)

    def views(self) -> list[memoryview]:
        return [memoryview((ctypes.c_char * size).from_address(addr)).cast("B") for addr, size in self.pieces]

    def gather(self) -> np.ndarray:
        """The block's bytes as one array (the caller's memory itself when it is one piece)."""
        arrays = [np.frombuffer(view, np.uint8) for view in self.views()]
        return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)

    def scatter(self, raw: np.ndarray) -> None:
        at = 0
        for view in self.views():
            view[:] = raw[at : at + len(view)].data
            at += len(view)


def _checksum(views: list[memoryview]) -> int:
    h = xxhash.xxh3_64()
    for view in views:
        h.update(view)
    return h.intdigest()


_HUGE_PAGE = 2 << 20


def private_buffer(size: int) -> memoryview:
    """``size`` bytes of private anonymous memory, page-aligned, advised to use huge pages before first
    touch. A buffer of half a huge page or more is mapped in whole huge pages (the kernel gives one
    only to a whole aligned 2 MiB of a mapping), the rest stays unused; smaller ones are not worth it."""
    mapped = -(-size // _HUGE_PAGE) * _HUGE_PAGE if size >= _HUGE_PAGE // 2 else max(size, 1)
    memory = mmap.mmap(-1, mapped, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    return memoryview(memory)[:size]


class SlabIO:
    """Stores and loads blocks of slabs on a pool of I/O threads, each thread with its own aligned
    scratch buffers: ``store`` and ``load`` return the indices of the blocks that failed. The disk
    transfer backend (``transfer.DiskBackend``) is one, running each copy it is given as a job here."""

    def __init__(self, io_threads: int) -> None:
        self._threads = io_threads
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="kvtier-disk-io", initializer=mark_kvtier_thread)
        self._bounce = threading.local()

    # --- store ---------------------------------------------------------------------------------

    def store(self, slab: DiskSlab, blocks: list[BlockIO]) -> set[int]:
        failed = self._refuse_long_keys(slab, blocks)
        todo = [b for b in blocks if b.index not in failed]
        if slab.codec is None:
            runs = _runs(slab, todo, self._threads, staged=slab.sealing is not None)
            futures = [self._io.submit(self._store_run, slab, run) for run in runs]
        else:
            futures = [self._io.submit(self._store_packed, slab, b) for b in todo]
        return failed.union(*(f.result() for f in futures))

    def _store_run(self, slab: DiskSlab, run: list[BlockIO]) -> set[int]:
        """Blocks in consecutive slots: every header made from its block's bytes (on this I/O thread,
        while the others write), then all of them written in one call; when that fails, block by
        block, to find the ones the fault hits (and zero their headers)."""
        views = [b.views() for b in run]
        if slab.sealing is None:
            pages = self._header_pages(slab, run, [_checksum(v) for v in views], [b.nbytes for b in run])
        else:  # (sealed into this thread's staging memory, written from there; the tag checks the bytes)
            pages = self._header_pages(slab, run, [0] * len(run), [b.nbytes for b in run])
            staging = self._scratch("sealed", _staged_run(slab) * slab.room)
            sealed, at = [], 0
            for b, v, page in zip(run, views, pages, strict=True):  # (in order: see _seal)
                sealed.append([staging[at : at + b.nbytes]])
                self._seal(slab, b.key, page, v, staging, at, b.nbytes)
                at += round_up_to_page(b.nbytes)
            views = sealed
        if len(run) > 1:
            try:
                self._write_slots(slab, run[0].file_offset - PAGE, list(zip(pages, views, strict=True)))
                return set()
            except OSError:
                pass
        failed = set()
        for b, page, v in zip(run, pages, views, strict=True):
            try:
                self._write_block(slab, b, page, v)
            except OSError:
                failed.add(b.index)
        self._clear_headers(slab, [b for b in run if b.index in failed])
        return failed

    def _store_packed(self, slab: DiskSlab, b: BlockIO) -> set[int]:
        """Compress one block (and seal it, where the slab seals) and write it, zero-padded to whole pages,
        through this thread's aligned buffer. A payload larger than the slot fails the block and is
        refused for good. A sealed slot's checksum is 0: the seal's tag checks its bytes."""
        assert slab.codec is not None
        raw = b.gather()
        payload = memoryview(slab.codec.compress(raw))
        size = len(payload)
        if size > slab.room:  # can never fit its slot: not stored, now or later
            slab.count(incompressible=1)
            slab.refuse([b.key])
            return {b.index}
        padded = round_up_to_page(size)
        bounce = self._scratch("packed", slab.room)
        checksum = 0 if slab.sealing is not None else xxhash.xxh3_64_intdigest(raw.data)
        page = self._header_pages(slab, [b], [checksum], [size])[0]
        if slab.sealing is None:
            bounce[:size] = payload
        else:
            self._seal(slab, b.key, page, [payload], bounce, 0, size)
        bounce[size:padded] = bytes(padded - size)
        try:
            self._write_slots(slab, b.file_offset - PAGE, [(page, [bounce[:padded]])])
            return set()
        except OSError:
            self._clear_headers(slab, [b])
            return {b.index}

    @staticmethod
    def _seal(
        slab: DiskSlab, key: bytes, page: memoryview, pieces: list[memoryview], into: memoryview, at: int, size: int
    ) -> None:
        """Seal block ``key``'s ``pieces`` (``size`` bytes) into ``into`` from ``at`` under its tenant's
        key, binding its header ``page``'s fields, and put the seal into that page. Where ``into`` has
        ``TAG_BYTES`` to spare after them, the target takes them (``Sealer.seal_into``: one piece then
        seals in one call) and they are scratch: the next block of a run, sealed after this one, or the
        slot's padding overwrites them."""
        assert slab.sealing is not None
        end = at + size + (TAG_BYTES if at + size + TAG_BYTES <= len(into) else 0)
        seal = slab.sealing.for_key(key).seal_into(pieces, into[at:end], header_fields(page))
        page[SEAL_AT : SEAL_AT + len(seal)] = seal

    def _header_pages(
        self, slab: DiskSlab, blocks: list[BlockIO], checksums: list[int], payloads: list[int]
    ) -> list[memoryview]:
        """The blocks' header pages, built in place in one buffer, with consecutive sequence numbers."""
        buffer = bytearray(len(blocks) * PAGE)
        first = slab.next_sequences(len(blocks))
        for i, (b, checksum, payload) in enumerate(zip(blocks, checksums, payloads, strict=True)):
            pack_slot_header(
                buffer, i * PAGE, b.key, slab.namespace, b.nbytes, checksum, first + i, payload, slab.codec_id
            )
        view = memoryview(buffer)
        return [view[i * PAGE : (i + 1) * PAGE] for i in range(len(blocks))]

    @staticmethod
    def _refuse_long_keys(slab: DiskSlab, blocks: list[BlockIO]) -> set[int]:
        """Blocks whose key a slot header cannot hold whole (longer than MAX_KEY_BYTES): failed before
        anything of theirs is written, and refused for good (``slab.refuse``), like a payload that can
        never fit. The rest of the job goes on."""
        long = [b for b in blocks if len(b.key) > MAX_KEY_BYTES]
        if long:
            slab.refuse([b.key for b in long])
        return {b.index for b in long}

    def _write_block(self, slab: DiskSlab, b: BlockIO, page: memoryview, views: list[memoryview]) -> None:
        if slab.direct_fd is not None and not b.aligned:  # O_DIRECT needs aligned memory: bounce
            padded = round_up_to_page(b.nbytes)
            bounce = self._scratch("write", padded)
            at = 0
            for view in views:
                bounce[at : at + len(view)] = view
                at += len(view)
            views = [bounce[:padded]]
        self._write_slots(slab, b.file_offset - PAGE, [(page, views)])

    def _write_slots(self, slab: DiskSlab, offset: int, slots: list[tuple[memoryview, list]]) -> None:
        """Consecutive slots from file ``offset``, each a header page and the buffers of its bytes.

        With O_DIRECT they go in one call: the kernel finishes a direct write it has started even when
        the process is killed, so a crash of the process leaves each slot old or new, never mixed.
        Buffered I/O can stop part way through a call when the process is killed, so there the
        headers are written as zeros together with the bytes, and then one by one: a slot cut short
        has no header. A power loss can tear either; see the module's docstring for why that is a
        miss."""
        headers = self._scratch("headers-out", _max_run(slab) * PAGE)
        zero = self._scratch("zero", PAGE)  # never written to: stays zero
        direct = slab.direct_fd is not None
        buffers: list = []
        for i, (page, data) in enumerate(slots):
            headers[i * PAGE : (i + 1) * PAGE] = page
            buffers += [headers[i * PAGE : (i + 1) * PAGE] if direct else zero, *data]
        self._write(slab, buffers, offset)
        if not direct:
            for i in range(len(slots)):
                self._write(slab, [headers[i * PAGE : (i + 1) * PAGE]], offset + i * slab.slot_stride)

    def _clear_headers(self, slab: DiskSlab, blocks: list[BlockIO]) -> None:
        """Zero the slot headers of blocks that failed to store or load, best effort: a restart must not
        find them. A header that cannot be zeroed may describe bytes it does not match; every load
        checks them, so such a block fails its load once and is dropped."""
        zero = self._scratch("zero", PAGE)
        for b in blocks:
            try:
                self._write(slab, [zero], b.file_offset - PAGE)
            except OSError:
                pass

    def _write(self, slab: DiskSlab, buffers, offset: int) -> None:
        expected = sum(len(memoryview(buf)) for buf in buffers)
        written = self._pwritev(slab.data_fd, buffers, offset)
        if written != expected:
            raise OSError(errno.EIO, f"short write: {written} of {expected} bytes")

    # --- load ----------------------------------------------------------------------------------

    def load(self, slab: DiskSlab, blocks: list[BlockIO]) -> set[int]:
        def read_run(run: list[BlockIO]) -> tuple[set[int], list[tuple[BlockIO, bytes]]]:
            """(blocks whose read failed, [(block, its header page)] read and still to verify)."""
            if len(run) > 1:
                try:
                    return set(), self._read_run(slab, run)
                except OSError:
                    pass  # find out which blocks are hit: read them one by one
            failed, read = set(), []
            for b in run:
                try:
                    read.append((b, self._read_block(slab, b)))
                except OSError:
                    failed.add(b.index)
            return failed, read

        def read_packed(b: BlockIO) -> set[int]:
            try:
                return set() if self._read_packed(slab, b) else {b.index}
            except OSError:
                return {b.index}

        failed: set[int] = set()
        if slab.codec is None:
            # Verified here as reads come back, while the I/O threads go on reading: a thread that
            # hashed after each read would leave the device idle meanwhile.
            for future in as_completed([self._io.submit(read_run, run) for run in _runs(slab, blocks, self._threads)]):
                unread, read = future.result()
                failed |= unread
                failed |= {b.index for b, page in read if not self._verify(slab, b, page, b.views())}
        else:
            failed = set().union(*(f.result() for f in [self._io.submit(read_packed, b) for b in blocks]))
        self._clear_headers(slab, [b for b in blocks if b.index in failed])
        return failed

    def _read_run(self, slab: DiskSlab, run: list[BlockIO]) -> list[tuple[BlockIO, bytes]]:
        """Blocks in consecutive slots in one preadv (headers into scratch pages, bytes into place);
        returns each block with its header page, to verify."""
        headers = self._scratch("headers", _max_run(slab) * PAGE)
        buffers = []
        for i, b in enumerate(run):
            buffers += [headers[i * PAGE : (i + 1) * PAGE], *b.views()]
        expected = len(run) * slab.slot_stride
        got = self._preadv(slab.data_fd, buffers, run[0].file_offset - PAGE)
        if got != expected:
            raise OSError(errno.EIO, f"short read: {got} of {expected} bytes")
        return [(b, bytes(headers[i * PAGE : (i + 1) * PAGE])) for i, b in enumerate(run)]

    def _read_block(self, slab: DiskSlab, b: BlockIO) -> bytes:
        """Read one block into its memory pieces; returns its header page, to verify."""
        views = b.views()
        if slab.direct_fd is None or b.aligned:
            header_page = self._scratch("page", PAGE)
            got = self._preadv(slab.data_fd, [header_page, *views], b.file_offset - PAGE)
            page = bytes(header_page)
        else:  # O_DIRECT needs aligned memory: read through a bounce buffer
            bounce = self._scratch("read", PAGE + round_up_to_page(b.nbytes))
            got = min(self._preadv(slab.direct_fd, [bounce], b.file_offset - PAGE), PAGE + b.nbytes)
            page = bytes(bounce[:PAGE])
            at = PAGE
            for view in views:
                view[:] = bounce[at : at + len(view)]
                at += len(view)
        if got < PAGE + b.nbytes:
            raise OSError(errno.EIO, f"short read: {got} of {PAGE + b.nbytes} bytes")
        return page

    def _read_packed(self, slab: DiskSlab, b: BlockIO) -> bool:
        """Read a whole slot, check its header, open (sealed) and decompress (compressed) it and verify
        the raw bytes (the seal's tag, else the checksum); only then copy them into the block's memory.
        False when the block fails any check."""
        bounce = self._scratch("slot", slab.slot_stride)
        got = self._preadv(slab.data_fd, [bounce], b.file_offset - PAGE)
        page = bytes(bounce[:PAGE])
        header = SlotHeader.unpack(page) if got >= PAGE else None
        if header is None or not self._header_matches(slab, b, header):
            return False
        if got < PAGE + header.payload:
            raise OSError(errno.EIO, f"short read: {got} of {PAGE + header.payload} bytes")
        payload = bounce[PAGE : PAGE + header.payload]
        if slab.sealing is not None:
            seal = page[SEAL_AT : SEAL_AT + SEAL_BYTES]
            if not slab.sealing.for_key(b.key).open([payload], [payload], seal, header_fields(page)):
                return False
        if slab.codec is None:
            raw = np.frombuffer(payload, np.uint8)
        else:
            try:
                raw = slab.codec.decompress(payload, b.nbytes)
            except CorruptPayload:
                return False
        if slab.sealing is None and xxhash.xxh3_64_intdigest(raw.data) != header.checksum:
            return False
        b.scatter(raw)
        return True

    @staticmethod
    def _header_matches(slab: DiskSlab, b: BlockIO, header: SlotHeader) -> bool:
        return (
            header.key == b.key
            and header.namespace == slab.namespace
            and header.length == b.nbytes
            and slab.fits(header)
        )

    @classmethod
    def _verify(cls, slab: DiskSlab, b: BlockIO, page: bytes, views: list[memoryview]) -> bool:
        """Whether the block read into ``views`` is ``b``'s: its header, then its checksum, or where the
        slab seals, its seal (opened in place: zeroed when it does not open)."""
        header = SlotHeader.unpack(page)
        if header is None or not cls._header_matches(slab, b, header):
            return False
        if slab.sealing is not None:
            seal = page[SEAL_AT : SEAL_AT + SEAL_BYTES]
            return slab.sealing.for_key(b.key).open(views, views, seal, header_fields(page))
        return header.checksum == _checksum(views)

    # --- helpers -------------------------------------------------------------------------------

    def _scratch(self, name: str, size: int) -> memoryview:
        """This thread's page-aligned scratch buffer ``name``, exactly ``size`` bytes (a multiple of PAGE).

        Private anonymous memory advised to use huge pages (``private_buffer``): Python's default
        anonymous map is shmem, which gets none, and an O_DIRECT request from 4 KiB pages is cut into
        many (this VM's disk: sealed stores of 2 MiB blocks, written from staging, 3.3 -> 5.3-7.1 GB/s)."""
        buffers = self._bounce.__dict__
        if name not in buffers or len(buffers[name]) != size:
            buffers[name] = private_buffer(size)
        return buffers[name]

    # The system calls, one place each, so fault-injection tests can override them.
    def _pwritev(self, fd: int, buffers, offset: int) -> int:
        return os.pwritev(fd, buffers, offset)

    def _preadv(self, fd: int, buffers, offset: int) -> int:
        return os.preadv(fd, buffers, offset)


_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024
_RUN_BYTES = 2 << 20
"""A run holds the consecutive slots that fill this much: measured, runs of 64 KiB slots gained nothing
from 8 or 16 MiB (stores into fresh slots lost), and larger runs spread a job over fewer threads."""
_RUN_SLOTS = 8
"""Where fewer slots than this fill ``_RUN_BYTES``, a run holds up to this many, as long as the job still
gives every I/O thread a run: 2 MiB blocks, a call each before, stored and loaded 3-5% faster in runs
of 7-8 (bench/disk.py, five pairs of runs)."""


def _max_run(slab: DiskSlab) -> int:
    """The most slots a run holds (what the header scratch buffers are sized for)."""
    return max(_RUN_SLOTS, _RUN_BYTES // slab.slot_stride)


def _staged_run(slab: DiskSlab) -> int:
    """The most slots a run of sealed stores holds: those that fill ``_RUN_BYTES`` (at least one). Its
    blocks are sealed into staging memory first, which then stays in cache until the write reads it;
    runs of 4 x 2 MiB were no faster (bench/disk.py) and take four times the staging per thread."""
    return max(1, _RUN_BYTES // slab.slot_stride)


def _runs(slab: DiskSlab, blocks: list[BlockIO], threads: int, staged: bool = False) -> list[list[BlockIO]]:
    """Group blocks that sit in consecutive slots into runs that one vectored call can move.

    A block joins a run only when it fills its slot exactly (no padding to skip) and, with O_DIRECT,
    its memory is aligned; others travel alone (and may need a bounce buffer). A run holds the slots
    that fill ``_RUN_BYTES``, or more, up to ``_RUN_SLOTS``, while the job still makes a run for each
    of the ``threads``; ``staged`` runs (sealed stores) hold at most ``_staged_run``.
    """
    limit = max(1, _RUN_BYTES // slab.slot_stride, min(_RUN_SLOTS, -(-len(blocks) // threads)))
    if staged:
        limit = _staged_run(slab)
    runs: list[list[BlockIO]] = []
    iovecs = 0
    open_run = False  # whether the last run may be extended
    for b in sorted(blocks, key=lambda b: b.file_offset):
        joinable = b.nbytes == slab.slot_stride - PAGE and (slab.direct_fd is None or b.aligned)
        if (
            joinable
            and open_run
            and runs[-1][-1].file_offset + slab.slot_stride == b.file_offset
            and len(runs[-1]) < limit
            and iovecs + 1 + len(b.pieces) <= _IOV_MAX
        ):
            runs[-1].append(b)
            iovecs += 1 + len(b.pieces)
        else:
            runs.append([b])
            iovecs = 1 + len(b.pieces)
            open_run = joinable
    return runs
