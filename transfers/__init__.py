"""How bytes move between tiers: one transfer backend per kind of copy.

- ``cpu``: memmove on a thread pool, host memory to host memory (and CPU tensors standing in for a GPU);
- ``cuda`` (with ``cuda_driver``): GPU <-> host copies on CUDA streams, batched or by a copy kernel;
- ``remote``: records of a shared store (Mooncake Store, Redis/Valkey) to and from host memory.

Every backend implements ``kvtier.core.transfer.TransferBackend`` and names the device pairs it
serves; a ``TransferRegistry`` over them picks the one for each copy. ``backends_for`` is the one place
that decides which backends a set of storages needs, for a standalone stack and a vLLM worker alike.
The disk and node media run their own backends (``kvtier.tiers.disk.transfer``,
``kvtier.tiers.node.transfer``), named by their registry entries (``Medium.backend``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvtier.core.config import TransferConfig
from kvtier.core.devices import CUDA_DEVICE, KEYED_DEVICE
from kvtier.core.media import medium
from kvtier.core.tier_config import TierConfigBase
from kvtier.core.transfer import TransferBackend
from kvtier.tiers.remote.config import RemoteTierConfig
from kvtier.tiers.remote.factory import connector
from kvtier.tiers.remote.link import StoreLink
from kvtier.transfers.cpu import CPUBackend
from kvtier.transfers.cuda import CUDABackend
from kvtier.transfers.remote import RemoteBackend


def backends_for(
    transfer: TransferConfig, devices: Collection[str], tiers: Sequence[TierConfigBase] = ()
) -> list[TransferBackend]:
    """The backends that copies between storages on ``devices`` ("cpu", "cuda", "remote", ...) need,
    configured by ``transfer``: the CUDA backend where a storage is on a CUDA device, the CPU backend
    always (host memory is every route's middle), the remote backend, with a link of its own to the
    store that the remote tier among ``tiers`` configures, where one is a store's records, and the
    backend each medium of ``tiers`` names for itself (``Medium.backend``: the disk tier's, for its
    slab files, and the node tier's).

    The CUDA backend is built first: it is the one that can fail (no CuPy, no device), and then no
    other backend has started threads that would have to be stopped again.
    """
    backends: list[TransferBackend] = []
    if CUDA_DEVICE in devices:
        backends.append(CUDABackend(transfer.cuda_copy))
    backends.append(CPUBackend(transfer.threads))
    if KEYED_DEVICE in devices:
        remote = next((tier for tier in tiers if isinstance(tier, RemoteTierConfig)), None)
        if remote is None:
            raise ValueError("a remote store's records need the remote tier's configuration")
        link = StoreLink(connector(remote), remote.timeout, "loads and stores")
        backends.append(RemoteBackend(link, remote.fetches))
    for name in dict.fromkeys(tier.medium for tier in tiers):
        own = medium(name).backend
        if own is not None:
            backends.append(own(transfer))
    return backends
