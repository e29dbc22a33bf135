"""How bytes move between tiers: one transfer backend per kind of copy.

- ``cpu``: memmove on a thread pool, host memory to host memory (and CPU tensors standing in for a GPU);
- ``cuda`` (with ``cuda_driver``): GPU <-> host copies on CUDA streams, batched or by a copy kernel.

Every backend implements ``kvtier.core.transfer.TransferBackend`` and names the device pairs it
serves; a ``TransferRegistry`` over them picks the one for each copy. ``backends_for`` is the one place
that decides which backends a set of storages needs, for a standalone stack and a vLLM worker alike.
The disk, node and remote media run their own backends (``kvtier.tiers.disk.transfer``,
``kvtier.tiers.node.transfer``, ``kvtier.tiers.remote.transfer``: a slab file's, the node daemon's
slab's, a shared store's records), named by their registry entries (``Medium.backend``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvtier.core.config import TransferConfig
from kvtier.core.devices import CUDA_DEVICE
from kvtier.core.media import medium
from kvtier.core.tier_config import TierConfigBase
from kvtier.core.transfer import TransferBackend
from kvtier.transfers.cpu import CPUBackend
from kvtier.transfers.cuda import CUDABackend


def backends_for(
    transfer: TransferConfig, devices: Collection[str], tiers: Sequence[TierConfigBase] = ()
) -> list[TransferBackend]:
    """The backends that copies between storages on ``devices`` ("cpu", "cuda", "file", ...) need,
    configured by ``transfer``: the CUDA backend where a storage is on a CUDA device, the CPU backend
    always (host memory is every route's middle), and the backend each medium of ``tiers`` (the tiers
    whose storages these are) names for itself, built for its tier (``Medium.backend``: the disk
    tier's for its slab files, the node tier's, the remote tier's with a link of its own to the store).

    The CUDA backend is built first: it is the one that can fail (no CuPy, no device), and then no
    other backend has started threads that would have to be stopped again.
    """
    backends: list[TransferBackend] = []
    if CUDA_DEVICE in devices:
        backends.append(CUDABackend(transfer.cuda_copy))
    backends.append(CPUBackend(transfer.threads))
    for tier in tiers:  # (one tier per medium: StackConfig)
        own = medium(tier.medium).backend
        if own is not None:
            backends.append(own(transfer, tier))
    return backends
