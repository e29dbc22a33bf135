"""The ``TransferBackend`` contract (``kvtier.testing.transfer``, whose docstring lists what it checks), run
over every backend that runs without a GPU: CPU memmove between host memory and per-layer arrays, disk
I/O to a slab file, a shared store's records (over a real Redis server), a node daemon's slab (over a
real daemon). The CUDA backend's tests stay in tests/gpu, which skip without CUDA.

To add a backend: write a ``Rig`` for it below (its backend, the storage it moves blocks to and from, how
to make a block there unreadable) and add it to ``RIGS``; every test of the suite then runs over it, and a
test fails while a backend in kvtier.transfers has no rig. The remote backend's rig runs over Redis alone:
the backend is the same over every store, each store's client is tests/contracts/test_store_client.py's
business, and a Mooncake link takes a second to close per test.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest

import kvtier.transfers as transfers
from helpers.node_daemon import node_daemon
from helpers.stack_helpers import flip
from helpers.stores import RedisStore
from kvtier.core.config import TransferConfig
from kvtier.core.layout import BlockLayout
from kvtier.core.media import media
from kvtier.core.storage import BlockStorage, StridedStorage
from kvtier.core.transfer import TransferBackend
from kvtier.testing.transfer import SLOTS, Rig, TransferBackendTests, keys_of
from kvtier.tiers.disk.slab import DiskSlab, FileStorage
from kvtier.tiers.disk.transfer import DiskBackend
from kvtier.tiers.node.client import NodeClient
from kvtier.tiers.node.protocol import Op
from kvtier.tiers.node.tier import NodeStorage
from kvtier.tiers.node.transfer import NodeBackend
from kvtier.tiers.remote.link import Connector, StoreLink
from kvtier.tiers.remote.record import RecordFormat, namespace_digest
from kvtier.tiers.remote.tier import RemoteStorage
from kvtier.tiers.remote.transfer import RemoteBackend
from kvtier.transfers.cpu import CPUBackend
from kvtier.transfers.cuda import CUDABackend


class _PoisonedCPU(CPUBackend):
    """The CPU backend; a copy that touches a poisoned byte range fails (a fault injected per block)."""

    def __init__(self) -> None:
        super().__init__(threads=2)
        self.poisoned: list[tuple[int, int]] = []

    def _copy(self, copies, lo, hi):
        for s, d, n in zip(
            copies.src[lo:hi].tolist(), copies.dst[lo:hi].tolist(), copies.size[lo:hi].tolist(), strict=True
        ):
            if any(a < end and start < a + n for start, end in self.poisoned for a in (s, d)):
                raise OSError("injected copy fault")
        super()._copy(copies, lo, hi)


class CPURig(Rig):
    """Host memory to per-layer arrays (a GPU tier's layout on CPU memory): gathers and scatters."""

    BACKEND = CPUBackend

    def __init__(self, request) -> None:
        self.backend = _PoisonedCPU()

    def far(self, layout: BlockLayout) -> BlockStorage:
        arrays = [np.zeros((SLOTS, size), np.uint8) for size in layout.fragment_bytes]
        return StridedStorage(
            layout, SLOTS, [a.ctypes.data for a in arrays], list(layout.fragment_bytes), keepalive=arrays
        )

    def make_unreadable(self, far: BlockStorage, slots: list[int]) -> None:
        for row in far.fragment_addresses(slots).tolist():
            self.backend.poisoned += [(address, address + 1) for address in row]


class DiskRig(Rig):
    """Host memory to a slab file: positioned I/O, every block's header checked on load."""

    BACKEND = DiskBackend

    def __init__(self, request) -> None:
        self.backend = DiskBackend(io_threads=2)
        self.directory = request.getfixturevalue("tmp_path")
        self.slabs: list[DiskSlab] = []

    def far(self, layout: BlockLayout) -> BlockStorage:
        slab = DiskSlab(self.directory / f"slab{len(self.slabs)}", SLOTS, layout, "contract")
        self.slabs.append(slab)
        return FileStorage(slab, layout)

    def make_unreadable(self, far: BlockStorage, slots: list[int]) -> None:
        assert isinstance(far, FileStorage)
        for offset in far.fragment_addresses(slots)[:, 0].tolist():
            flip(far.slab.path, offset + 17)  # a byte of the block's data: its checksum no longer matches

    def close(self) -> None:
        super().close()
        for slab in self.slabs:
            slab.close()


class RemoteRig(Rig):
    """Host memory to a shared store's records, through a link with the tier's deadline."""

    BACKEND = RemoteBackend

    def __init__(self, request, store: str = "redis_store") -> None:
        self.store = request.getfixturevalue(store)
        self.prefix = f"t{next(_rig_numbers)}"
        connect = functools.partial(self.store.client, timeout=2.0)
        self.backend = RemoteBackend(StoreLink(Connector(connect, 2, self.store.name), 2.0, "loads and stores"))

    def far(self, layout: BlockLayout) -> BlockStorage:
        return RemoteStorage(layout, RecordFormat(self.prefix, namespace_digest("m", layout), layout.block_bytes))

    def make_unreadable(self, far: BlockStorage, slots: list[int]) -> None:
        assert isinstance(far, RemoteStorage)
        for key in keys_of(slots):
            self.store.write(far.records.name(key), b"not a record")


class NodeRig(Rig):
    """Host memory to a node daemon's slab (a real daemon process): copies checked against the slot headers."""

    BACKEND = NodeBackend

    def __init__(self, request) -> None:
        self.daemon = request.getfixturevalue("node")
        self.backend = NodeBackend(threads=2)
        self.storages: list[NodeStorage] = []

    def far(self, layout: BlockLayout) -> BlockStorage:
        client = NodeClient(self.daemon.socket, 2.0)
        client.open()
        storage = NodeStorage(layout, client, b"contract-%d" % next(_rig_numbers))
        self.storages.append(storage)
        return storage

    def make_unreadable(self, far: BlockStorage, slots: list[int]) -> None:
        assert isinstance(far, NodeStorage)
        names = far.node_keys(keys_of(slots))
        (pinned,), epoch, view = far.client.call(Op.PIN, names, far.layout.block_bytes)
        for slot, _ in pinned:
            view.block(slot, 32)[17] ^= 0xFF  # a byte of the block: its checksum no longer matches
        far.client.post(Op.RELEASE, epoch, names)

    def close(self) -> None:
        super().close()
        for storage in self.storages:
            storage.close()


_rig_numbers = itertools.count()

RIGS = {"cpu": CPURig, "disk": DiskRig, "remote": RemoteRig, "node": NodeRig}
"""Every backend the suite runs over, by the id its tests carry."""


@pytest.fixture(scope="module")
def redis_store(tmp_path_factory):
    """The store under the remote backend's rig (its client is the store contract's business)."""
    with RedisStore(tmp_path_factory.mktemp("redis")) as store:
        yield store


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """The daemon under the node backend's rig."""
    with node_daemon(tmp_path_factory.mktemp("node"), capacity="32MiB", block_bytes="16KiB") as daemon:
        yield daemon


class TestTransferBackends(TransferBackendTests):
    @pytest.fixture(params=sorted(RIGS))
    def rig(self, request):
        made = RIGS[request.param](request)
        yield made
        made.close()


# A tier of each medium that names its own backend, for that backend to be built for (nothing connects).
BACKEND_TIERS = {
    "disk": {"medium": "disk", "path": "/nonexistent", "capacity_blocks": 1},
    "node": {"medium": "node", "socket": "/nonexistent"},
    "remote": {"medium": "remote", "backend": "redis", "redis": {"url": "redis://127.0.0.1:1"}},
}


def test_every_backend_but_cudas_has_a_rig():
    """A backend added to kvtier.transfers, or named by a medium of the registry, without a rig here would
    go untested by this suite (CUDA's are in tests/gpu)."""
    backends = {
        value
        for value in vars(transfers).values()
        if isinstance(value, type) and issubclass(value, TransferBackend) and value is not TransferBackend
    }
    for medium in media():
        if medium.backend is not None:
            backend = medium.backend(TransferConfig(), medium.config.model_validate(BACKEND_TIERS[medium.name]))
            backends.add(type(backend))
            backend.close()
    assert backends == {rig.BACKEND for rig in RIGS.values()} | {CUDABackend}
