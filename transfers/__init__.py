"""How bytes move between tiers: one transfer backend per kind of copy.

- ``cpu``: memmove on a thread pool, host memory to host memory (and CPU tensors standing in for a GPU);
- ``cuda`` (with ``cuda_driver``): GPU <-> host copies on CUDA streams, batched or by a copy kernel;
- ``disk``: positioned reads and writes between host memory and a disk tier's slab file.

Every backend implements ``kvtier.core.transfer.TransferBackend`` and names the device pairs it
serves; a ``TransferRegistry`` over them picks the one for each copy. ``backends_for`` is the one place
that decides which backends a set of storages needs, for a standalone stack and a vLLM worker alike.
"""

from __future__ import annotations

from collections.abc import Collection

from kvtier.core.config import TransferConfig
from kvtier.core.transfer import TransferBackend
from kvtier.transfers.cpu import CPUBackend
from kvtier.transfers.cuda import CUDABackend
from kvtier.transfers.disk import DiskBackend


def backends_for(transfer: TransferConfig, devices: Collection[str]) -> list[TransferBackend]:
    """The backends that copies between storages on ``devices`` ("cpu", "cuda", "file") need, configured
    by ``transfer``: the CUDA backend where a storage is on a CUDA device, the CPU backend always (host
    memory is every route's middle), the disk backend where one is a slab file.

    The CUDA backend is built first: it is the one that can fail (no CuPy, no device), and then no
    other backend has started threads that would have to be stopped again.
    """
    backends: list[TransferBackend] = []
    if "cuda" in devices:
        backends.append(CUDABackend(transfer.cuda_copy))
    backends.append(CPUBackend(transfer.threads))
    if "file" in devices:
        backends.append(DiskBackend(transfer.io_threads))
    return backends
