"""The host-memory tier: one page-aligned slab, registered with CUDA (pinned, ``host_pinning``) when CUDA is present.

Pinned memory is what lets a GPU copy engine read and write the slab asynchronously at full PCIe
speed. Without CUDA the slab is ordinary pageable memory and the tier says so in its description.

A slab may be shared by the processes of one engine (``SharedName``): the tensor-parallel workers of
a model whose KV is the same on every rank (MLA) then keep one copy in memory instead of one each.
The first rank creates a file in /dev/shm (exclusively, mode 0600), the others open it once it has
its size and check it is the running user's and private; each counts itself in the file's first page
(under a lock) and the last to arrive removes the name, so the memory goes with the last process to
exit. Until every rank has arrived the name stays; any rank's close removes it (a rank that never came).

The medium's YAML schema (``HostTierConfig``) and registry entry (``MEDIUM``) are here too.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
import struct
import time
from typing import Literal, NamedTuple

import numpy as np

from kvtier.core.devices import HOST, HOST_DEVICE
from kvtier.core.errors import ConfigError
from kvtier.core.layout import BlockLayout
from kvtier.core.media import Medium, RankRequest, TierRequest
from kvtier.core.storage import BlockStorage, contiguous_storage
from kvtier.core.tier import Tier
from kvtier.core.tier_config import SizedTierConfig
from kvtier.policies.base import EvictionPolicy
from kvtier.policies.watermark import Watermark
from kvtier.tiers.host_pinning import pin, unpin

SHARED_DIR = "/dev/shm"
PAGE = 4096
JOIN_TIMEOUT_S = 60.0
"""How long a rank waits for the first rank to create a shared slab (workers start at about the same time)."""


class SharedName(NamedTuple):
    """A slab shared by ``ranks`` processes under ``name`` (in /dev/shm); ``rank`` 0 creates it."""

    name: str
    rank: int
    ranks: int


class HostSlab:
    """``num_slots`` blocks of page-aligned memory, pinned when CUDA allows; each slot after
    ``header_room`` bytes of its own (``contiguous_storage``; a page-multiple keeps slots aligned).
    Anonymous memory of this process, or with ``shared`` a file in /dev/shm the ranks share."""

    def __init__(
        self, num_slots: int, layout: BlockLayout, header_room: int = 0, shared: SharedName | None = None
    ) -> None:
        self.nbytes = num_slots * (layout.block_bytes + header_room)
        refuse_more_than_memory(self.nbytes)
        self._shared_path: str | None = None
        if shared is None:
            # Private: Python's default anonymous map is shared, i.e. shmem, which gets huge pages only
            # where /sys/kernel/mm/transparent_hugepage/shmem_enabled allows them ("never" by default).
            # Anonymous maps are page-aligned.
            self._map = mmap.mmap(-1, max(self.nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            offset = 0
        else:
            self._map, self._shared_path = _map_shared(shared, PAGE + self.nbytes)
            offset = PAGE  # the first page counts the ranks that arrived
        if hasattr(mmap, "MADV_HUGEPAGE"):
            # Before first touch: 2 MiB pages mean far fewer pages to pin for an O_DIRECT request
            # (bench/disk.py here: loads of 2 MiB blocks 1.5 -> 2.4 GB/s, of 64 KiB blocks 0.95 -> 1.9).
            # A shared slab is shmem, which gets them only where shmem_enabled allows.
            self._map.madvise(mmap.MADV_HUGEPAGE)
        self.array = np.frombuffer(self._map, dtype=np.uint8, count=self.nbytes, offset=offset)
        self.address = self.array.ctypes.data
        self.pinned_chunks = pin(self.address, self.nbytes, layout.block_bytes + header_room)
        self.storage = contiguous_storage(self.address, num_slots, layout, HOST_DEVICE, self, self.close, header_room)
        self.storage.breaks = np.array([address for address, _ in self.pinned_chunks[1:]], dtype=np.int64)

    @property
    def pinned(self) -> bool:
        """Whether the slab is registered with CUDA (``pinned_chunks``: (address, length) per registration)."""
        return bool(self.pinned_chunks)

    def close(self) -> None:
        if self._map.closed:
            return
        unpin(self.pinned_chunks)
        self.pinned_chunks = []
        del self.array
        self._map.close()
        if self._shared_path is not None:  # (gone already once every rank arrived)
            _unlink(self._shared_path)


def _map_shared(shared: SharedName, nbytes: int) -> tuple[mmap.mmap, str]:
    """Create (rank 0) or open the shared file, map it, count this rank in; the last rank in removes
    the name. Raises ConfigError for a file that is not this user's private regular file of that size,
    or that rank 0 does not create within JOIN_TIMEOUT_S."""
    if not os.path.isdir(SHARED_DIR):
        raise ConfigError(f"a host slab shared by the ranks needs {SHARED_DIR}, which this system lacks")
    path = os.path.join(SHARED_DIR, shared.name)
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    if shared.rank == 0:
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise ConfigError(
                f"{path} exists already: another engine (or a crashed one) uses that name; remove it if no engine does"
            ) from None
        os.fchmod(fd, 0o600)  # whatever the umask
        os.ftruncate(fd, nbytes)
    else:
        fd = _open_when_ready(path, flags, nbytes)
    try:
        shm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            arrived = struct.unpack_from("<I", shm, 0)[0] + 1
            struct.pack_into("<I", shm, 0, arrived)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    except BaseException:
        if shared.rank == 0:  # a slab its creator could not map is nobody's: no name left behind
            _unlink(path)
        raise
    finally:
        os.close(fd)
    if arrived >= shared.ranks:
        _unlink(path)
    return shm, path


def _open_when_ready(path: str, flags: int, nbytes: int) -> int:
    """Open the file rank 0 creates once it has its full size; it must be this user's and private."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while True:
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            fd = -1
        if fd >= 0:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                os.close(fd)
                raise ConfigError(
                    f"{path} is not a private file of this user (mode {stat.filemode(st.st_mode)}, "
                    f"owner uid {st.st_uid}): refusing to share host memory through it"
                )
            if st.st_size == nbytes:
                return fd
            os.close(fd)
        if time.monotonic() > deadline:
            raise ConfigError(
                f"the first rank did not create the shared host slab {path} of {nbytes} bytes "
                f"within {JOIN_TIMEOUT_S:g} s"
            )
        time.sleep(0.01)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def physical_memory() -> int | None:
    """Bytes of RAM in this machine, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def refuse_more_than_memory(nbytes: int) -> None:
    """Raise MemoryError when ``nbytes`` of host memory exceed the machine's RAM.

    Anonymous memory is handed out lazily, so a slab larger than RAM is often mapped without complaint
    and the process is killed much later, when the tier fills; refused here, the mistake is named at start.
    """
    total = physical_memory()
    if total is not None and nbytes > total:
        raise MemoryError(f"more than the {total / 2**30:.1f} GiB of memory this machine has")


def host_tier(
    name: str,
    num_slots: int,
    layout: BlockLayout,
    policy: EvictionPolicy[bytes],
    watermark: Watermark | None = None,
    is_fenced=None,
    header_room: int = 0,
) -> Tier:
    """A tier over a fresh host slab of ``num_slots`` blocks (``HostSlab``)."""
    slab = HostSlab(num_slots, layout, header_room)
    note = "pinned host memory" if slab.pinned else "pageable host memory (no CUDA)"
    return Tier(name, "host", slab.storage, policy, watermark, is_fenced, note)


class HostTierConfig(SizedTierConfig):
    """Pinned host memory."""

    medium: Literal["host"]

    def footprint(self, block_bytes: int, header_room: int = 0) -> int:
        return block_bytes + header_room


def _tier(request: TierRequest) -> Tier:
    return host_tier(
        request.name, request.slots, request.layout, *request.policy(), request.is_fenced, request.stack.header_room
    )


def _rank_storage(request: RankRequest) -> BlockStorage:
    """One rank's slab, or the ranks' one shared slab where their KV is the same."""
    shared = None if request.shared_name is None else SharedName(request.shared_name, request.rank, request.ranks)
    return HostSlab(request.slots, request.layout, request.header_room, shared).storage


MEDIUM = Medium(
    HOST,
    HostTierConfig,
    _tier,
    _rank_storage,
    direct=lambda other, caps: True,
    event_medium="CPU",
    hit_source="HOST",
    one_copy_for_ranks=True,
)
