"""Pinning a large host slab with CUDA: pages first touched in parallel, then registered in chunks.

Why not one ``cudaHostRegister`` of the whole slab:

- one registration of 512 GiB or more fails whatever memory is free (vLLM issue 51080), and some hosts
  refuse far smaller ones; chunks of at most ``CHUNK_BYTES`` never meet that ceiling;
- registering makes the kernel fault in and zero every page on the one calling thread: 64 GiB took
  seconds of start-up. Populating the pages first with ``MADV_POPULATE_WRITE`` from several threads
  (ctypes releases the GIL around the call) spreads that work over the cores, and the chunks are then
  registered from those threads too.

Chunks end on slot boundaries that are also page boundaries, so the driver's rounding to pages never
makes two registrations overlap. A copy may still cross a chunk boundary (the CUDA backend merges the
fragments of consecutive slots into one copy); ``bench/host_pool.py`` checks such copies bit for bit.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger(__name__)

CHUNK_BYTES = 4 * 2**30
"""The most one registration covers: far below the 512 GiB ceiling, many chunks for the threads."""
PAGE = 4096
MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels answer EINVAL
_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, whichever thread registers


def chunks(nbytes: int, slot_bytes: int, limit: int) -> list[tuple[int, int]]:
    """(offset, length) pieces covering ``nbytes``, each at most ``limit`` long where possible and each
    ending on a boundary that is both a slot and a page boundary (a unit of lcm(slot, page) bytes is never
    cut, even where it exceeds ``limit``)."""
    unit = math.lcm(max(slot_bytes, 1), PAGE)
    step = max(unit, limit // unit * unit)
    return [(offset, min(step, nbytes - offset)) for offset in range(0, nbytes, step)]


def pin(address: int, nbytes: int, slot_bytes: int, threads: int | None = None) -> list[tuple[int, int]]:
    """Touch the pages of ``address .. +nbytes`` and register them with CUDA in chunks; returns the
    (address, length) chunks registered, or [] where CUDA is missing or refuses (the slab then stays
    pageable: slower, still correct). A refusal part way unregisters the chunks registered before it."""
    try:
        import cupy

        if not cupy.cuda.is_available():
            return []
        device = cupy.cuda.runtime.getDevice()
    except Exception:
        return []
    pieces = [(address + offset, length) for offset, length in chunks(nbytes, slot_bytes, CHUNK_BYTES)]
    if not pieces:
        return []
    workers = threads or min(16, os.cpu_count() or 1, len(pieces))

    def pin_piece(piece: tuple[int, int]) -> tuple[int, int]:
        _populate(*piece)
        cupy.cuda.runtime.setDevice(device)  # this thread's context: the caller's device
        cupy.cuda.runtime.hostRegister(piece[0], piece[1], _REGISTER_PORTABLE)
        return piece

    registered: list[tuple[int, int]] = []
    with ThreadPoolExecutor(workers, thread_name_prefix="kvtier-pin") as pool:
        futures = [pool.submit(pin_piece, piece) for piece in pieces]
        errors = []
        for future in futures:
            try:
                registered.append(future.result())
            except Exception as exc:
                errors.append(exc)
    if errors:
        log.warning("could not pin %d bytes of host memory with CUDA, using pageable memory: %s", nbytes, errors[0])
        unpin(registered)
        return []
    return registered


def unpin(registered: list[tuple[int, int]]) -> None:
    """Unregister the chunks ``pin`` returned."""
    if not registered:
        return
    import cupy

    for chunk_address, _ in registered:
        cupy.cuda.runtime.hostUnregister(chunk_address)


_libc = ctypes.CDLL(None)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def _populate(address: int, length: int) -> None:
    """Fault in every page of the range now, on this thread, rather than one page at a time inside the
    driver's registration. The bytes are left as they are (a rank joining a shared slab may find data in
    it). Where the kernel lacks MADV_POPULATE_WRITE nothing is done here: registration faults them in."""
    _libc.madvise(address, length, MADV_POPULATE_WRITE)
