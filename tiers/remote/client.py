"""What kvtier needs from a shared store, whatever the backend (Mooncake Store, Redis/Valkey).

A remote tier keeps each block as one record under a name (``record_name``) in a store that is not
ours: other engines write into it, it evicts or loses any record at any moment, a restart empties it.
So a ``StoreClient`` offers only batched, per-record calls whose every failure is per record, and
kvtier never trusts what comes back until the record's own header says it is the block asked for
(``kvtier.tiers.remote.record``).

Buffers are given as (address, size) pieces of host memory, so a backend that can (Mooncake's
zero-copy batch calls on the registered host slab) moves bytes without a copy; a record is the
concatenation of its pieces (a small header, then the block's bytes in a host slot).

Calls block the calling thread and may hang (a stalled server): the transfer backend runs them on
threads of its own with kvtier's deadline, and never hands a client that is stuck in a call a new
one. A backend whose abandoned reads may still write into the buffers after the call returned
(``late_writes``: Mooncake's transfer engine does) is closed and replaced before those buffers are
reused.
"""

from __future__ import annotations

import ctypes
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import numpy as np

from kvtier.core.errors import StoreError
from kvtier.core.storage import Piece

# StoreError, what every client raises, with its kin; Piece: (address, size) of a piece of host memory
__all__ = ["Piece", "Record", "StoreClient", "StoreError", "scatter"]

Record = Sequence[Piece]
"""One record's bytes: its pieces, in order."""


class StoreClient(ABC):
    """One connection to the shared store. Not shared between threads that call it at the same time."""

    name: str
    late_writes: bool = False
    """True when a read that failed or was abandoned may still write into its buffers after the call
    returned, until ``close()`` (Mooncake's TCP transfer engine). Such buffers stay fenced until then."""
    interruptible: bool = False
    """True when ``interrupt`` can end a call in progress at once: the link then lets a caller that
    waits for the call run it on its own thread, and ends it there at its deadline."""

    def fetch(self, names: Sequence[str], size: int, take: Callable[[int, bytes | None], bool]) -> list[bool]:
        """Read each named record into memory of the client's own (Redis: the reply's bytes) and hand it
        to ``take(i, value)`` as it arrives (None where the record is missing or is not ``size`` bytes
        long), which says whether it was taken; the client never writes into memory it was given, so
        ``take`` decides what is copied where, and when it no longer may. Per record, what ``take``
        said (False where no reply came). Raises StoreError when nothing could be asked. Offered where
        the store's backend says it ``fetches`` (``StoreBackend``)."""
        raise NotImplementedError(f"the {self.name} client reads only into memory it is given")

    def interrupt(self) -> None:
        """From another thread: make the call in progress (and any this client would start after it)
        fail at once; the client is dropped afterwards. Offered where ``interruptible``."""
        raise NotImplementedError(f"a call of the {self.name} client ends only by its own timeouts")

    def may_write_late(self) -> bool:
        """With ``late_writes``, after a call some of whose records failed: whether a transfer of one of
        them may still touch its buffers (the client is then closed before they are reused). True
        unless the client can tell that no failed transfer is still running (none started: a record
        that does not exist; or each ended with its call): closing a client can cost a second, and a
        full store misses all the time."""
        return True

    @abstractmethod
    def exists(self, names: Sequence[str]) -> list[bool]:
        """Which records exist now (one batched query). Raises StoreError when the store cannot say."""

    @abstractmethod
    def put(self, names: Sequence[str], records: Sequence[Record]) -> list[bool]:
        """Write each record whole under its name, replacing any record of that name (a reader never
        sees half of one); True per record that was stored. Raises StoreError when nothing could be sent."""

    @abstractmethod
    def get(self, names: Sequence[str], records: Sequence[Record]) -> list[bool]:
        """Read each named record into its pieces; True only where a record of exactly the pieces'
        total size arrived whole (a missing, shorter or longer record is False, its pieces garbage).
        Raises StoreError when nothing could be asked."""

    @abstractmethod
    def remove(self, names: Sequence[str]) -> None:
        """Remove records (those missing are ignored); for tests and ``reset``."""

    @abstractmethod
    def close(self) -> None:
        """Drop the connection; afterwards no call of this client writes into any buffer."""


def scatter(value: bytes | memoryview, record: Record) -> None:
    """Copy a record's bytes into its pieces, in order (one memmove per piece, outside the GIL)."""
    source = np.frombuffer(value, np.uint8).ctypes.data
    at = 0
    for address, size in record:
        ctypes.memmove(address, source + at, size)
        at += size
