"""Pinning a large host slab with CUDA: registered in chunks, its pages populated in parallel first.

Why not one ``cudaHostRegister`` of the whole slab: one registration of 512 GiB or more fails whatever
memory is free (vLLM issue 51080), and some hosts refuse far smaller ones; chunks of at most
``CHUNK_BYTES`` never meet that ceiling. Registering also faults in and zeroes every page on the
calling thread (64 GiB: 15 s on an H200 machine), so the pages are first populated with
``MADV_POPULATE_WRITE`` from several threads (ctypes releases the GIL around the call, ``POPULATE_THREADS``) and
the chunks registered from several threads (``REGISTER_THREADS``); ``bench/host_pool.py`` measures
each way against one registration.

Chunks end on slot boundaries that are also page boundaries, so the driver's rounding to pages never
makes two registrations overlap, and no block straddles two of them. A DMA copy must not span two
registrations (the driver refuses or fails it): the slab's storage names the boundaries
(``BlockStorage.breaks``), and copies of consecutive slots are not merged across them.
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
POPULATE_THREADS = min(16, os.cpu_count() or 1)
"""Threads populating the chunks' pages before any is registered (0: none, registration faults them in)."""
REGISTER_THREADS = POPULATE_THREADS
"""Threads registering chunks at once (1: one chunk after the other). Measured on an H200 machine (16
cores, ``bench/host_pool.py``), 16 GiB pools: one registration 4.55 s; chunks one after the other 3.57 s,
by 16 threads 3.29 s; pages populated by 16 threads first, then chunks one after the other 2.91 s, by
16 threads 2.51 s (these defaults). 64 GiB: 9.97 s against 15.09 s for one registration."""
_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, whichever thread registers


def chunks(nbytes: int, slot_bytes: int, limit: int) -> list[tuple[int, int]]:
    """(offset, length) pieces covering ``nbytes``, each at most ``limit`` long where possible and each
    ending on a boundary that is both a slot and a page boundary (a unit of lcm(slot, page) bytes is never
    cut, even where it exceeds ``limit``)."""
    unit = math.lcm(max(slot_bytes, 1), PAGE)
    step = max(unit, limit // unit * unit)
    return [(offset, min(step, nbytes - offset)) for offset in range(0, nbytes, step)]


def pin(address: int, nbytes: int, slot_bytes: int) -> list[tuple[int, int]]:
    """Register ``address .. +nbytes`` with CUDA in chunks (see the module for how); returns the
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

    def register(piece: tuple[int, int]) -> tuple[int, int]:
        cupy.cuda.runtime.setDevice(device)  # this thread's context: the caller's device
        cupy.cuda.runtime.hostRegister(piece[0], piece[1], _REGISTER_PORTABLE)
        return piece

    registered: list[tuple[int, int]] = []
    errors: list[Exception] = []
    if POPULATE_THREADS > 0:
        with ThreadPoolExecutor(min(POPULATE_THREADS, len(pieces)), thread_name_prefix="kvtier-touch") as pool:
            list(pool.map(lambda piece: populate(*piece), pieces))
    with ThreadPoolExecutor(min(max(REGISTER_THREADS, 1), len(pieces)), thread_name_prefix="kvtier-pin") as pool:
        for future in [pool.submit(register, piece) for piece in pieces]:
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


def populate(address: int, length: int) -> None:
    """Fault in every page of the range now, on this thread, rather than one page at a time inside the
    driver's registration. The bytes are left as they are (a rank joining a shared slab may find data in
    it). Where the kernel lacks MADV_POPULATE_WRITE nothing is done here: registration faults them in."""
    _libc.madvise(address, length, MADV_POPULATE_WRITE)
