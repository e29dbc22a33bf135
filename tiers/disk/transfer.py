"""The disk transfer backend: copies between host memory and a slab file, each run as a job of ``io``.

A copy's blocks are planned here (each block's memory pieces and the file offset of its slot) and
stored or loaded by ``io.SlabIO``, which the backend is: on the registry's side it is a
``TransferBackend`` (``submit``, ``close``), on the disk's side the I/O threads and system calls
(which fault-injection tests override on a subclass).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from kvtier.core.devices import FILE_DEVICE, HOST_DEVICE
from kvtier.core.errors import ClosedError, TransferError
from kvtier.core.jobs import mark_kvtier_thread
from kvtier.core.transfer import OnComplete, Transfer, TransferBackend
from kvtier.tiers.disk.io import BlockIO, SlabIO
from kvtier.tiers.disk.slab import DiskSlab, FileStorage
from kvtier.tiers.disk.slots import PAGE


class DiskBackend(SlabIO, TransferBackend):
    """Moves blocks between host memory ("cpu") and slab files ("file") on a pool of I/O threads."""

    name = "disk"
    pairs = frozenset({(HOST_DEVICE, FILE_DEVICE), (FILE_DEVICE, HOST_DEVICE)})

    def __init__(self, io_threads: int = 8) -> None:
        if io_threads < 1:
            raise ValueError("the disk backend needs at least one I/O thread")
        super().__init__(io_threads)
        self._jobs = ThreadPoolExecutor(2, thread_name_prefix="kvtier-disk-job", initializer=mark_kvtier_thread)
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, transfer: Transfer, on_complete: OnComplete) -> None:
        if not self.can_copy(transfer.src.device, transfer.dst.device):
            raise TransferError(f"the disk backend cannot copy {transfer.src.device} -> {transfer.dst.device}")
        if transfer.keys is None:
            raise TransferError("disk transfers need the blocks' keys (they are written into slot headers)")
        writing = transfer.dst.device == FILE_DEVICE
        storage = transfer.dst if writing else transfer.src
        assert isinstance(storage, FileStorage)
        blocks = self._blocks(transfer, transfer.keys, writing)
        run = self.store if writing else self.load
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
    def _blocks(transfer: Transfer, keys: Sequence[bytes], writing: bool) -> list[BlockIO]:
        """Each block's memory pieces, in the order they fill its slot (fragments that follow on in
        memory merged), and the file offset of its bytes. Planned block by block, never merged across
        blocks: a compressed slot may be exactly as long as a block, and then the next slot's bytes
        start where this block's raw bytes would end (``io._runs`` groups whole slots instead)."""
        memory, memory_slots = (transfer.src, transfer.src_slots) if writing else (transfer.dst, transfer.dst_slots)
        file, file_slots = (transfer.dst, transfer.dst_slots) if writing else (transfer.src, transfer.src_slots)
        addresses = memory.fragment_addresses(memory_slots)
        offsets = file.fragment_addresses(file_slots)[:, 0].tolist()
        slots = [int(s) for s in file_slots]
        layout = memory.layout
        size = layout.block_bytes
        if (addresses[:, 1:] == addresses[:, :-1] + layout.sizes[None, :-1]).all():  # each block one piece
            page_aligned = (addresses[:, 0] % PAGE == 0) & (size % PAGE == 0)
            starts = addresses[:, 0].tolist()
            return [
                BlockIO(i, slot, key, offset, ((address, size),), size, a)
                for i, (slot, key, offset, address, a) in enumerate(
                    zip(slots, keys, offsets, starts, page_aligned.tolist(), strict=True)
                )
            ]
        out = []
        for i, (row, offset) in enumerate(zip(addresses.tolist(), offsets, strict=True)):
            pieces: list[tuple[int, int]] = []
            for address, n in zip(row, layout.fragment_bytes, strict=True):
                if pieces and sum(pieces[-1]) == address:
                    pieces[-1] = (pieces[-1][0], pieces[-1][1] + n)
                else:
                    pieces.append((address, n))
            aligned = all(address % PAGE == 0 and n % PAGE == 0 for address, n in pieces)
            out.append(BlockIO(i, slots[i], keys[i], offset, tuple(pieces), size, aligned))
        return out

    def _finish(self, run, slab: DiskSlab, blocks: list[BlockIO], on_complete: OnComplete, keep: Transfer) -> None:
        # ``keep`` holds the transfer (and the memory it points into) until the I/O is over.
        try:
            failed = run(slab, blocks)
        except Exception:  # a bug must fail the job, not lose its completion
            failed = {b.index for b in blocks}
        on_complete(failed)
