"""The disk transfer backend: positioned reads and writes between host memory and a slab file.

A store job runs in three ordered phases so that a crash at any instant leaves only complete blocks
behind valid headers: (1) zero the old headers of reused slots and fdatasync; (2) write the blocks'
bytes and fdatasync; (3) write the new headers. A load reads header and bytes in one ``preadv`` and
checks the header (key, namespace, length) and the data checksum; a block that fails is reported
failed, and the stack drops it from the tier; its slot header is zeroed, so a restart does not find
it again.

I/O goes straight between the caller's memory and the file: with O_DIRECT when the buffers are
4 KiB-aligned (the host tier's slots are), through an aligned bounce buffer when they are not, and
with plain buffered I/O where the filesystem refuses O_DIRECT. Errors (ENOSPC, EIO, short transfers)
fail exactly the blocks they hit; so does a key longer than a slot header holds (``MAX_KEY_BYTES``),
before anything of its block is written.

A compressing slab (``slab.codec``) moves each block on its own through an aligned bounce buffer:
a store gathers, compresses and writes the payload padded to 4 KiB (a payload larger than the slot
fails the block, counts it ``incompressible`` and tells the tier it is refused for good, so the
tier above drops it rather than offering it again); a load reads the whole slot, checks the header,
decompresses and verifies the checksum of the raw bytes before anything reaches the caller's memory.
The three store phases are the same.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

import numpy as np
import xxhash

from kvtier.core.errors import ClosedError, TransferError
from kvtier.core.jobs import mark_kvtier_thread
from kvtier.core.keys import MAX_KEY_BYTES
from kvtier.core.slots import PAGE, round_up_to_page
from kvtier.core.transfer import OnComplete, Transfer, TransferBackend
from kvtier.tiers.compression import Codec, CorruptPayload
from kvtier.tiers.disk import DiskSlab, FileStorage, SlotHeader

_ZERO_PAGE = bytes(PAGE)


@dataclass(frozen=True)
class _BlockIO:
    """One block's bytes: memory pieces (address, size) that fill one contiguous file range."""

    index: int
    slot: int
    key: bytes
    file_offset: int
    pieces: tuple[tuple[int, int], ...]

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.pieces)

    def views(self) -> list[memoryview]:
        return [memoryview((ctypes.c_char * size).from_address(addr)).cast("B") for addr, size in self.pieces]

    def aligned(self) -> bool:
        return all(addr % PAGE == 0 and size % PAGE == 0 for addr, size in self.pieces)

    def gather(self) -> np.ndarray:
        """The block's bytes as one array (the caller's memory itself when it is one piece)."""
        arrays = [np.frombuffer(view, np.uint8) for view in self.views()]
        return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)

    def scatter(self, raw: np.ndarray) -> None:
        at = 0
        for view in self.views():
            view[:] = raw[at:at + len(view)].data
            at += len(view)


def _checksum(views: list[memoryview]) -> int:
    h = xxhash.xxh3_64()
    for view in views:
        h.update(view)
    return h.intdigest()


class DiskBackend(TransferBackend):
    """Moves blocks between host memory ("cpu") and slab files ("file") on a pool of I/O threads."""

    name = "disk"
    pairs = frozenset({("cpu", "file"), ("file", "cpu")})

    def __init__(self, io_threads: int = 4) -> None:
        if io_threads < 1:
            raise ValueError("the disk backend needs at least one I/O thread")
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="kvtier-disk-io", initializer=mark_kvtier_thread)
        self._jobs = ThreadPoolExecutor(2, thread_name_prefix="kvtier-disk-job", initializer=mark_kvtier_thread)
        self._bounce = threading.local()
        self._sequence_lock = threading.Lock()
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, transfer: Transfer, on_complete: OnComplete) -> None:
        if not self.can_copy(transfer.src.device, transfer.dst.device):
            raise TransferError(f"the disk backend cannot copy {transfer.src.device} -> {transfer.dst.device}")
        if transfer.keys is None:
            raise TransferError("disk transfers need the blocks' keys (they are written into slot headers)")
        writing = transfer.dst.device == "file"
        storage = transfer.dst if writing else transfer.src
        assert isinstance(storage, FileStorage)
        blocks = self._blocks(transfer, transfer.keys, writing)
        run = self._store if writing else self._load
        with self._lock:
            if self._closed:
                raise ClosedError("the disk backend is closed")
            try:
                self._jobs.submit(self._finish, run, storage.slab, blocks, on_complete, transfer)
            except RuntimeError as exc:  # concurrent.futures stops every pool when the interpreter exits
                raise ClosedError(f"the disk transfer backend takes no more copies: {exc}") from None

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._jobs.shutdown(wait=True)
        self._io.shutdown(wait=True)

    # --- planning ------------------------------------------------------------------------------

    @staticmethod
    def _blocks(transfer: Transfer, keys: Sequence[bytes], writing: bool) -> list[_BlockIO]:
        """Each block's memory pieces, in the order they fill its slot (fragments that follow on in
        memory merged), and the file offset of its bytes. Planned block by block, never merged across
        blocks: a compressed slot may be exactly as long as a block, and then the next slot's bytes
        start where this block's raw bytes would end (``_runs`` groups whole slots instead)."""
        memory, memory_slots = (transfer.src, transfer.src_slots) if writing else (transfer.dst, transfer.dst_slots)
        file, file_slots = (transfer.dst, transfer.dst_slots) if writing else (transfer.src, transfer.src_slots)
        addresses = memory.fragment_addresses(memory_slots).tolist()
        offsets = file.fragment_addresses(file_slots)[:, 0].tolist()
        sizes = memory.layout.fragment_bytes
        out = []
        for i, (row, offset) in enumerate(zip(addresses, offsets, strict=True)):
            pieces: list[tuple[int, int]] = []
            for address, size in zip(row, sizes, strict=True):
                if pieces and sum(pieces[-1]) == address:
                    pieces[-1] = (pieces[-1][0], pieces[-1][1] + size)
                else:
                    pieces.append((address, size))
            out.append(_BlockIO(i, int(file_slots[i]), keys[i], offset, tuple(pieces)))
        return out

    def _finish(self, run, slab: DiskSlab, blocks: list[_BlockIO], on_complete: OnComplete, keep: Transfer) -> None:
        # ``keep`` holds the transfer (and the memory it points into) until the I/O is over.
        try:
            failed = run(slab, blocks)
        except Exception:  # a bug must fail the job, not lose its completion
            failed = {b.index for b in blocks}
        on_complete(failed)

    # --- store ---------------------------------------------------------------------------------

    def _store(self, slab: DiskSlab, blocks: list[_BlockIO]) -> set[int]:
        failed = self._refuse_long_keys(slab, blocks)
        blocks = [b for b in blocks if b.index not in failed]
        stale = [b for b in blocks if slab.valid_header[b.slot]]
        if stale:
            failed |= self._each_in_turn(stale, lambda b: self._write_header(slab, _ZERO_PAGE, b.file_offset - PAGE))
            failed |= self._sync(slab, stale)
            for b in stale:
                if b.index not in failed:
                    slab.valid_header[b.slot] = 0
        todo = [b for b in blocks if b.index not in failed]
        checksums: dict[int, int] = {}
        payloads: dict[int, int] = {}  # stored bytes of compressed blocks

        def write_run(run: list[_BlockIO]) -> set[int]:
            if len(run) > 1:
                try:
                    self._write_run(slab, run)
                    return set()
                except OSError:
                    pass  # find out which blocks are hit: write them one by one
            failed = set()
            for b in run:
                try:
                    self._write_block(slab, b)
                except OSError:
                    failed.add(b.index)
            return failed

        def write_packed(b: _BlockIO, codec: Codec) -> set[int]:
            raw = b.gather()
            checksums[b.index] = xxhash.xxh3_64_intdigest(raw.data)
            payload = codec.compress(raw)
            if len(payload) > slab.room:  # can never fit its slot: not stored, now or later
                slab.record(incompressible=1)
                slab.refuse([b.key])
                return {b.index}
            payloads[b.index] = len(payload)
            try:
                self._write_packed(slab, b, payload)
                return set()
            except OSError:
                return {b.index}

        if slab.codec is None:
            futures = [self._io.submit(write_run, run) for run in _runs(slab, todo)]
            # Hashed here while the I/O threads write: a thread that hashed before each write would
            # leave the device idle meanwhile (measured: a fifth of the store bandwidth of 2 MiB blocks).
            checksums.update((b.index, _checksum(b.views())) for b in todo)
        else:
            futures = [self._io.submit(write_packed, b, slab.codec) for b in todo]
        failed |= set().union(*(f.result() for f in futures))
        todo = [b for b in todo if b.index not in failed]
        failed |= self._sync(slab, todo)
        todo = [b for b in todo if b.index not in failed]

        def write_header(b: _BlockIO) -> None:
            header = SlotHeader(b.key, slab.namespace, b.nbytes, checksums[b.index], self._next_sequence(slab),
                                payloads.get(b.index, b.nbytes), slab.codec_id)
            # Marked before the write: a write that fails (or comes back short) may still have left a
            # valid header on disk, and the slot's next use must clear it before new bytes land.
            slab.valid_header[b.slot] = 1
            self._write_header(slab, header.pack(), b.file_offset - PAGE)

        failed |= self._each_in_turn(todo, write_header)
        return failed

    @staticmethod
    def _refuse_long_keys(slab: DiskSlab, blocks: list[_BlockIO]) -> set[int]:
        """Blocks whose key a slot header cannot hold whole (longer than MAX_KEY_BYTES): failed before
        anything of theirs is written, and refused for good (``slab.refuse``), like a payload that can
        never fit. The rest of the job goes on."""
        long = [b for b in blocks if len(b.key) > MAX_KEY_BYTES]
        if long:
            slab.refuse([b.key for b in long])
        return {b.index for b in long}

    def _write_run(self, slab: DiskSlab, run: list[_BlockIO]) -> None:
        """Blocks in consecutive slots in one pwritev; the header pages between them are written as
        zeros (they belong to slots of this job, whose real headers come after the data is durable)."""
        zero = self._scratch("zero", PAGE)  # never written to: stays zero
        buffers: list[memoryview | mmap.mmap] = [*run[0].views()]
        for b in run[1:]:
            buffers += [zero, *b.views()]
        self._write(slab, buffers, run[0].file_offset)

    def _write_block(self, slab: DiskSlab, b: _BlockIO) -> None:
        views = b.views()
        if slab.direct_fd is not None and not b.aligned():  # O_DIRECT needs aligned memory: bounce
            padded = round_up_to_page(b.nbytes)
            bounce = self._scratch("write", padded)
            at = 0
            for view in views:
                bounce[at:at + len(view)] = view
                at += len(view)
            views = [memoryview(bounce)[:padded]]
        self._write(slab, views, b.file_offset)

    def _write_packed(self, slab: DiskSlab, b: _BlockIO, payload: bytes) -> None:
        """A compressed payload, zero-padded to whole pages, through this thread's aligned buffer."""
        padded = round_up_to_page(len(payload))
        bounce = self._scratch("packed", slab.room)
        bounce[:len(payload)] = payload
        bounce[len(payload):padded] = bytes(padded - len(payload))
        self._write(slab, [memoryview(bounce)[:padded]], b.file_offset)

    def _write_header(self, slab: DiskSlab, page: bytes, offset: int) -> None:
        """Slot headers go through the page cache: one small O_DIRECT write each costs far more, and
        the fdatasync that follows a zeroing (or the kernel, for a new header) makes them durable. A
        later O_DIRECT read of the slot flushes the cached page first, so reads stay coherent."""
        self._write(slab, [page], offset, slab.open_fd)

    def _write(self, slab: DiskSlab, buffers, offset: int, fd: int | None = None) -> None:
        expected = sum(len(memoryview(buf)) for buf in buffers)
        written = self._pwritev(_data_fd(slab) if fd is None else fd, buffers, offset)
        if written != expected:
            raise OSError(errno.EIO, f"short write: {written} of {expected} bytes")

    # --- load ----------------------------------------------------------------------------------

    def _load(self, slab: DiskSlab, blocks: list[_BlockIO]) -> set[int]:
        def read_run(run: list[_BlockIO]) -> tuple[set[int], list[tuple[_BlockIO, bytes]]]:
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

        def read_packed(b: _BlockIO, codec: Codec) -> set[int]:
            try:
                return set() if self._read_packed(slab, codec, b) else {b.index}
            except OSError:
                return {b.index}

        failed: set[int] = set()
        if slab.codec is None:
            # Verified here as reads come back, while the I/O threads go on reading: a thread that
            # hashed after each read would leave the device idle meanwhile.
            for future in as_completed([self._io.submit(read_run, run) for run in _runs(slab, blocks)]):
                unread, read = future.result()
                failed |= unread
                failed |= {b.index for b, page in read if not self._verify(slab, b, page, b.views())}
        else:
            failed = set().union(*(f.result() for f in [self._io.submit(read_packed, b, slab.codec) for b in blocks]))
        self._forget(slab, [b for b in blocks if b.index in failed])
        return failed

    def _forget(self, slab: DiskSlab, blocks: list[_BlockIO]) -> None:
        """Zero the slot headers of blocks that failed to load: the stack drops them from the tier, and
        a restart must not find them again. Best effort, through the page cache like every header
        write (``close`` makes it durable; a crash before that may bring back a header, whose block
        then fails its checks again). A header that cannot be zeroed stays marked valid, so the
        slot's next store clears it first."""
        for b in blocks:
            try:
                self._write_header(slab, _ZERO_PAGE, b.file_offset - PAGE)
                slab.valid_header[b.slot] = 0
            except OSError:
                pass

    def _read_run(self, slab: DiskSlab, run: list[_BlockIO]) -> list[tuple[_BlockIO, bytes]]:
        """Blocks in consecutive slots in one preadv (headers into scratch pages, bytes into place);
        returns each block with its header page, to verify."""
        headers = memoryview(self._scratch("headers", _max_run(slab) * PAGE))
        buffers = []
        for i, b in enumerate(run):
            buffers += [headers[i * PAGE:(i + 1) * PAGE], *b.views()]
        expected = len(run) * slab.slot_stride
        got = self._preadv(_data_fd(slab), buffers, run[0].file_offset - PAGE)
        if got != expected:
            raise OSError(errno.EIO, f"short read: {got} of {expected} bytes")
        return [(b, bytes(headers[i * PAGE:(i + 1) * PAGE])) for i, b in enumerate(run)]

    def _read_block(self, slab: DiskSlab, b: _BlockIO) -> bytes:
        """Read one block into its memory pieces; returns its header page, to verify."""
        views = b.views()
        if slab.direct_fd is None or b.aligned():
            header_page = self._scratch("page", PAGE)
            got = self._preadv(_data_fd(slab), [header_page, *views], b.file_offset - PAGE)
            page = bytes(header_page)
        else:  # O_DIRECT needs aligned memory: read through a bounce buffer
            bounce = self._scratch("read", PAGE + round_up_to_page(b.nbytes))
            got = min(self._preadv(slab.direct_fd, [bounce], b.file_offset - PAGE), PAGE + b.nbytes)
            page = bytes(bounce[:PAGE])
            at = PAGE
            for view in views:
                view[:] = bounce[at:at + len(view)]
                at += len(view)
        if got < PAGE + b.nbytes:
            raise OSError(errno.EIO, f"short read: {got} of {PAGE + b.nbytes} bytes")
        return page

    def _read_packed(self, slab: DiskSlab, codec: Codec, b: _BlockIO) -> bool:
        """Read a whole slot, check its header, decompress and verify the raw bytes; only then copy
        them into the block's memory. False when the block fails any check."""
        bounce = self._scratch("slot", slab.slot_stride)
        got = self._preadv(_data_fd(slab), [bounce], b.file_offset - PAGE)
        header = SlotHeader.unpack(bytes(bounce[:PAGE])) if got >= PAGE else None
        if header is None or not self._header_matches(slab, b, header):
            return False
        if got < PAGE + header.payload:
            raise OSError(errno.EIO, f"short read: {got} of {PAGE + header.payload} bytes")
        try:
            raw = codec.decompress(memoryview(bounce)[PAGE:PAGE + header.payload], b.nbytes)
        except CorruptPayload:
            return False
        if xxhash.xxh3_64_intdigest(raw.data) != header.checksum:
            return False
        b.scatter(raw)
        return True

    @staticmethod
    def _header_matches(slab: DiskSlab, b: _BlockIO, header: SlotHeader) -> bool:
        return (header.key == b.key and header.namespace == slab.namespace
                and header.length == b.nbytes and slab.fits(header))

    @classmethod
    def _verify(cls, slab: DiskSlab, b: _BlockIO, page: bytes, views: list[memoryview]) -> bool:
        header = SlotHeader.unpack(page)
        return header is not None and cls._header_matches(slab, b, header) and header.checksum == _checksum(views)

    # --- helpers -------------------------------------------------------------------------------

    @staticmethod
    def _each_in_turn(blocks: list[_BlockIO], work) -> set[int]:
        """Run ``work(block)`` on this thread (small buffered writes: a pool hop costs more than they do)."""
        failed = set()
        for b in blocks:
            try:
                work(b)
            except OSError:
                failed.add(b.index)
        return failed

    def _sync(self, slab: DiskSlab, blocks: list[_BlockIO]) -> set[int]:
        """fdatasync; when it fails, none of ``blocks`` can be trusted to be durable."""
        if not blocks:
            return set()
        try:
            self._fdatasync(slab.open_fd)
            return set()
        except OSError:
            return {b.index for b in blocks}

    def _next_sequence(self, slab: DiskSlab) -> int:
        with self._sequence_lock:
            slab.sequence += 1
            return slab.sequence

    def _scratch(self, name: str, size: int) -> mmap.mmap:
        """This thread's page-aligned scratch buffer ``name``, exactly ``size`` bytes (a multiple of PAGE)."""
        buffers = self._bounce.__dict__
        if name not in buffers or len(buffers[name]) != size:
            buffers[name] = mmap.mmap(-1, size)
        return buffers[name]

    # The system calls, one place each, so fault-injection tests can override them.
    def _pwritev(self, fd: int, buffers, offset: int) -> int:
        return os.pwritev(fd, buffers, offset)

    def _preadv(self, fd: int, buffers, offset: int) -> int:
        return os.preadv(fd, buffers, offset)

    def _fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)


def _data_fd(slab: DiskSlab) -> int:
    return slab.direct_fd if slab.direct_fd is not None else slab.open_fd


_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024
_RUN_BYTES = 2 << 20  # measured: larger runs gain nothing and spread a job over fewer threads


def _max_run(slab: DiskSlab) -> int:
    return max(1, _RUN_BYTES // slab.slot_stride)


def _runs(slab: DiskSlab, blocks: list[_BlockIO]) -> list[list[_BlockIO]]:
    """Group blocks that sit in consecutive slots into runs that one vectored call can move.

    A block joins a run only when it fills its slot exactly (no padding to skip) and, with O_DIRECT,
    its memory is aligned; others travel alone (and may need a bounce buffer).
    """
    runs: list[list[_BlockIO]] = []
    iovecs = 0
    open_run = False  # whether the last run may be extended
    for b in sorted(blocks, key=lambda b: b.file_offset):
        joinable = b.nbytes == slab.slot_stride - PAGE and (slab.direct_fd is None or b.aligned())
        if (joinable and open_run and runs[-1][-1].file_offset + slab.slot_stride == b.file_offset
                and len(runs[-1]) < _max_run(slab) and iovecs + 1 + len(b.pieces) <= _IOV_MAX):
            runs[-1].append(b)
            iovecs += 1 + len(b.pieces)
        else:
            runs.append([b])
            iovecs = 1 + len(b.pieces)
            open_run = joinable
    return runs
