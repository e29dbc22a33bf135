"""The ``TransferBackend`` contract (kvtier.core.transfer), run over every backend that runs without a GPU:
CPU memmove between host memory and per-layer arrays, disk I/O to a slab file, a shared store's records
(over a real Redis server), a node daemon's slab (over a real daemon). The CUDA backend's tests stay in
tests/gpu, which skip without CUDA.

To add a backend: write a ``Rig`` for it below (its backend, the storage it moves blocks to and from, how
to make a block there unreadable) and add it to ``RIGS``; every test here then runs over it, and a test
fails while a backend in kvtier.transfers has no rig. The remote backend's rig runs over Redis alone: the
backend is the same over every store, each store's client is tests/contracts/test_store_client.py's
business, and a Mooncake link takes a second to close per test.

Each test moves blocks between host memory (numpy arrays, checked byte by byte) and the backend's far
storage (``Rig.far``), where a store leaves them and a load takes them back. What every backend promises:
- blocks stored and loaded back into other slots are bit-exact, for paged and odd fragment geometries;
  no other destination byte changes, and a store leaves its source as it was;
- ``on_complete`` runs exactly once per transfer, on a thread of the backend's, never the submitter's;
  a transfer of no blocks completes with no failures;
- a load reports exactly the blocks it could not deliver; every other block arrives bit-exact;
- a device pair it does not serve is refused at submit (TransferError) before anything moves, and
  ``can_copy`` answers exactly its ``pairs``;
- ``close()`` waits for the transfers in flight (their callbacks have run when it returns), then refuses
  new ones (ClosedError) without calling back;
- a transfer keeps its memory alive until it completes: the caller may drop its storage at once.
"""

from __future__ import annotations

import functools
import itertools
import threading

import numpy as np
import pytest

import kvtier.transfers as transfers
from helpers.node_daemon import node_daemon
from helpers.stack_helpers import flip
from helpers.stores import RedisStore
from kvtier.core.config import TransferConfig
from kvtier.core.devices import KEYED_DEVICE
from kvtier.core.errors import ClosedError, TransferError
from kvtier.core.layout import BlockLayout
from kvtier.core.media import media
from kvtier.core.storage import BlockStorage, StridedStorage, buffer_storage
from kvtier.core.transfer import Transfer, TransferBackend
from kvtier.tiers.disk.slab import DiskSlab, FileStorage
from kvtier.tiers.disk.transfer import DiskBackend
from kvtier.tiers.node.client import NodeClient
from kvtier.tiers.node.protocol import Op
from kvtier.tiers.node.tier import NODE_DEVICE, NodeStorage
from kvtier.tiers.node.transfer import NodeBackend
from kvtier.tiers.remote.link import Connector, StoreLink
from kvtier.tiers.remote.record import RecordFormat, namespace_digest
from kvtier.tiers.remote.tier import RemoteStorage
from kvtier.tiers.remote.transfer import RemoteBackend
from kvtier.transfers.cpu import CPUBackend
from kvtier.transfers.cuda import CUDABackend

LAYOUTS = {"paged": BlockLayout((4096,) * 4), "odd": BlockLayout((1000, 24, 3077))}
SLOTS = 12
DEVICES = ("cpu", "cuda", "file", KEYED_DEVICE, NODE_DEVICE)


def keys_of(slots) -> list[bytes]:
    """A block's key names the far slot it lives in (a keyed store has no slots: the key is all there is)."""
    return [b"block-%04d" % slot for slot in slots]


class Rig:
    """A backend and the far storage it moves blocks between host memory ("cpu") and."""

    BACKEND: type[TransferBackend]
    """The backend class under test."""
    backend: TransferBackend

    def far(self, layout: BlockLayout) -> BlockStorage:
        """A storage of SLOTS blocks of ``layout`` at the backend's far end."""
        raise NotImplementedError

    def make_unreadable(self, far: BlockStorage, slots: list[int]) -> None:
        """Damage the blocks in ``slots`` of ``far`` so that loading them must fail."""
        raise NotImplementedError

    def close(self) -> None:
        self.backend.close()


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


@pytest.fixture(params=sorted(RIGS))
def rig(request):
    made = RIGS[request.param](request)
    yield made
    made.close()


@pytest.fixture(params=sorted(LAYOUTS))
def layout(request) -> BlockLayout:
    return LAYOUTS[request.param]


class Memory:
    """SLOTS blocks of host memory in one array, as a writable storage."""

    def __init__(self, layout: BlockLayout, rng: np.random.Generator | None = None) -> None:
        shape = (SLOTS, layout.block_bytes)
        self.blocks = rng.integers(0, 256, shape, dtype=np.uint8) if rng is not None else np.zeros(shape, np.uint8)
        self.storage = buffer_storage(self.blocks, layout, writable=True)


def transfer(src: BlockStorage, src_slots, dst: BlockStorage, dst_slots, far_slots) -> Transfer:
    """A transfer naming the blocks by the far slots they live in; a side addressed by key gets no slots."""

    def slots(side, given):
        return () if side.by_key else list(given)

    return Transfer(src, slots(src, src_slots), dst, slots(dst, dst_slots), keys_of(far_slots))


def run(backend: TransferBackend, job: Transfer) -> set[int]:
    """Submit and wait; the failed block indices of the single completion call."""
    done = threading.Event()
    calls: list[set[int]] = []

    def on_complete(failed, quarantine=None) -> None:
        calls.append(set(failed))
        done.set()

    backend.submit(job, on_complete)
    assert done.wait(30), "the transfer never completed"
    assert len(calls) == 1
    return calls[0]


def store_and_load(rig: Rig, layout: BlockLayout, rng, far_slots: list[int]):
    """Store random blocks from memory into ``far_slots`` and load them back into other memory slots;
    (source memory, its slots, far, destination memory, its slots, the load's failures)."""
    source, target = Memory(layout, rng), Memory(layout)
    far = rig.far(layout)
    src_slots = rng.permutation(SLOTS)[: len(far_slots)].tolist()
    dst_slots = rng.permutation(SLOTS)[: len(far_slots)].tolist()
    assert run(rig.backend, transfer(source.storage, src_slots, far, far_slots, far_slots)) == set()
    failed = run(rig.backend, transfer(far, far_slots, target.storage, dst_slots, far_slots))
    return source, src_slots, far, target, dst_slots, failed


# --- bytes -------------------------------------------------------------------------------------------


def test_blocks_come_back_bit_exact_into_other_slots_and_nothing_else_changes(rig, layout, rng):
    far_slots = [7, 2, 3, 4, 11, 0, 9, 5]
    source, src_slots, _, target, dst_slots, failed = store_and_load(rig, layout, rng, far_slots)
    before = source.blocks.copy()
    assert failed == set()
    for s, d in zip(src_slots, dst_slots, strict=True):
        assert np.array_equal(target.blocks[d], source.blocks[s])
    assert not target.blocks[sorted(set(range(SLOTS)) - set(dst_slots))].any()
    assert np.array_equal(source.blocks, before)


def test_a_load_reports_exactly_the_blocks_it_could_not_deliver(rig, layout, rng):
    source, target = Memory(layout, rng), Memory(layout)
    far = rig.far(layout)
    slots = list(range(8))
    assert run(rig.backend, transfer(source.storage, slots, far, slots, slots)) == set()
    rig.make_unreadable(far, [1, 4, 6])
    assert run(rig.backend, transfer(far, slots, target.storage, slots, slots)) == {1, 4, 6}
    for i in (0, 2, 3, 5, 7):
        assert np.array_equal(target.blocks[i], source.blocks[i]), f"block {i} came back wrong"


# --- completion --------------------------------------------------------------------------------------


def test_a_transfer_of_no_blocks_completes_with_no_failures(rig, layout):
    memory, far = Memory(layout), rig.far(layout)
    assert run(rig.backend, transfer(memory.storage, [], far, [], [])) == set()
    assert run(rig.backend, transfer(far, [], memory.storage, [], [])) == set()


def test_on_complete_runs_once_per_transfer_on_a_thread_of_the_backend(rig, layout, rng):
    source, target, far = Memory(layout, rng), Memory(layout), rig.far(layout)
    calls: list[tuple[int, frozenset[int], int]] = []
    all_done = threading.Semaphore(0)

    def on_complete(job: int):
        def call(failed, quarantine=None) -> None:
            calls.append((job, frozenset(failed), threading.get_ident()))
            all_done.release()

        return call

    for slot in range(SLOTS):
        rig.backend.submit(transfer(source.storage, [slot], far, [slot], [slot]), on_complete(slot))
    for _ in range(SLOTS):
        assert all_done.acquire(timeout=30), "a transfer never completed"
    assert sorted(job for job, _, _ in calls) == list(range(SLOTS))
    assert {failed for _, failed, _ in calls} == {frozenset()}
    assert threading.get_ident() not in {thread for _, _, thread in calls}
    assert run(rig.backend, transfer(far, range(SLOTS), target.storage, range(SLOTS), range(SLOTS))) == set()
    assert np.array_equal(target.blocks, source.blocks)


def test_a_transfer_keeps_its_memory_alive_until_it_completes(rig, layout, rng):
    far, target = rig.far(layout), Memory(layout)
    expected = rng.integers(0, 256, (4, layout.block_bytes), dtype=np.uint8)
    done = threading.Event()
    failures: list[set[int]] = []
    rig.backend.submit(
        transfer(buffer_storage(expected.copy(), layout), range(4), far, range(4), range(4)),
        lambda failed, quarantine=None: (failures.append(set(failed)), done.set()),
    )
    # the caller kept no reference to the source array or its storage
    assert done.wait(30) and failures == [set()]
    assert run(rig.backend, transfer(far, range(4), target.storage, range(4), range(4))) == set()
    assert np.array_equal(target.blocks[:4], expected)


# --- refusals ----------------------------------------------------------------------------------------


def test_a_device_pair_it_does_not_serve_is_refused_before_anything_moves(rig, layout, rng):
    for src, dst in itertools.product(DEVICES, repeat=2):
        assert rig.backend.can_copy(src, dst) == ((src, dst) in rig.backend.pairs)
    assert not rig.backend.can_copy("cpu", "cuda")
    memory, elsewhere = Memory(layout, rng), np.zeros((SLOTS, layout.block_bytes), np.uint8)
    fake_gpu = StridedStorage(
        layout,
        SLOTS,
        [elsewhere.ctypes.data + offset for offset in layout.offsets.tolist()],
        [layout.block_bytes] * layout.num_fragments,
        device="cuda",
        keepalive=elsewhere,
    )
    calls: list[set[int]] = []
    with pytest.raises(TransferError, match="cuda"):
        rig.backend.submit(
            transfer(memory.storage, [0, 1], fake_gpu, [0, 1], [0, 1]),
            lambda failed, quarantine=None: calls.append(failed),
        )
    assert calls == [] and not elsewhere.any()


def test_close_waits_for_transfers_in_flight_then_refuses_new_ones(rig, layout, rng):
    source, far = Memory(layout, rng), rig.far(layout)
    calls: list[set[int]] = []
    for slot in range(SLOTS):
        rig.backend.submit(
            transfer(source.storage, [slot], far, [slot], [slot]),
            lambda failed, quarantine=None: calls.append(set(failed)),
        )
    rig.backend.close()
    assert calls == [set()] * SLOTS  # every transfer in flight completed before close returned
    with pytest.raises(ClosedError):
        rig.backend.submit(
            transfer(source.storage, [0], far, [0], [0]), lambda failed, quarantine=None: calls.append(set(failed))
        )
    assert len(calls) == SLOTS


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
