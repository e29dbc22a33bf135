"""``TransferBackendTests``: the ``TransferBackend`` contract (kvtier.core.transfer), for any backend.

A subclass provides the fixture ``rig``: a ``Rig`` around the backend under test, which knows the far
storage the backend moves blocks to and from and how to make a block there unreadable; the fixture
closes it at the end of the test. Parametrize the fixture to run the suite over several backends.

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

import itertools
import threading
from collections.abc import Iterable, Sequence

import numpy as np
import pytest

from kvtier.core.devices import CUDA_DEVICE, FILE_DEVICE, HOST_DEVICE, KEYED_DEVICE
from kvtier.core.errors import ClosedError, TransferError
from kvtier.core.layout import BlockLayout
from kvtier.core.storage import BlockStorage, StridedStorage, buffer_storage
from kvtier.core.transfer import Transfer, TransferBackend
from kvtier.testing.common import ContractTests
from kvtier.tiers.node.tier import NODE_DEVICE

LAYOUTS = {"paged": BlockLayout((4096,) * 4), "odd": BlockLayout((1000, 24, 3077))}
SLOTS = 12
DEVICES = (HOST_DEVICE, CUDA_DEVICE, FILE_DEVICE, KEYED_DEVICE, NODE_DEVICE)
"""Devices ``can_copy`` is asked about (besides those its ``pairs`` name): kvtier's."""


def keys_of(slots: Iterable[int]) -> list[bytes]:
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


class Memory:
    """SLOTS blocks of host memory in one array, as a writable storage."""

    def __init__(self, layout: BlockLayout, rng: np.random.Generator | None = None) -> None:
        shape = (SLOTS, layout.block_bytes)
        self.blocks = rng.integers(0, 256, shape, dtype=np.uint8) if rng is not None else np.zeros(shape, np.uint8)
        self.storage = buffer_storage(self.blocks, layout, writable=True)


def transfer(
    src: BlockStorage, src_slots: Iterable[int], dst: BlockStorage, dst_slots: Iterable[int], far_slots: Iterable[int]
) -> Transfer:
    """A transfer naming the blocks by the far slots they live in; a side addressed by key gets no slots."""

    def slots(side: BlockStorage, given: Iterable[int]) -> Sequence[int]:
        return () if side.by_key else list(given)

    return Transfer(src, slots(src, src_slots), dst, slots(dst, dst_slots), keys_of(far_slots))


def run(backend: TransferBackend, job: Transfer, timeout: float = 30.0) -> set[int]:
    """Submit and wait; the failed block indices of the single completion call."""
    done = threading.Event()
    calls: list[set[int]] = []

    def on_complete(failed, quarantine=None) -> None:
        calls.append(set(failed))
        done.set()

    backend.submit(job, on_complete)
    assert done.wait(timeout), "the transfer never completed"
    assert len(calls) == 1
    return calls[0]


def store_and_load(rig: Rig, layout: BlockLayout, rng: np.random.Generator, far_slots: list[int]):
    """Store random blocks from memory into ``far_slots`` and load them back into other memory slots;
    (source memory, its slots, far, destination memory, its slots, the load's failures)."""
    source, target = Memory(layout, rng), Memory(layout)
    far = rig.far(layout)
    src_slots = rng.permutation(SLOTS)[: len(far_slots)].tolist()
    dst_slots = rng.permutation(SLOTS)[: len(far_slots)].tolist()
    assert run(rig.backend, transfer(source.storage, src_slots, far, far_slots, far_slots)) == set()
    failed = run(rig.backend, transfer(far, far_slots, target.storage, dst_slots, far_slots))
    return source, src_slots, far, target, dst_slots, failed


class TransferBackendTests(ContractTests):
    """The transfer backend contract; a subclass provides ``rig``. For a backend that does not copy host
    memory to CUDA memory: a test asks it for that pair and expects a refusal (kvtier's CUDA backend has
    tests of its own, in tests/gpu)."""

    @pytest.fixture
    def rig(self) -> Rig:
        """A rig around the backend under test, closed at the end of the test."""
        raise NotImplementedError(f"{type(self).__name__} provides the fixture rig")

    @pytest.fixture(params=sorted(LAYOUTS))
    def layout(self, request: pytest.FixtureRequest) -> BlockLayout:
        return LAYOUTS[request.param]

    # --- bytes -------------------------------------------------------------------------------------------

    def test_blocks_come_back_bit_exact_into_other_slots_and_nothing_else_changes(self, rig, layout, rng):
        far_slots = [7, 2, 3, 4, 11, 0, 9, 5]
        source, src_slots, _, target, dst_slots, failed = store_and_load(rig, layout, rng, far_slots)
        before = source.blocks.copy()
        assert failed == set()
        for s, d in zip(src_slots, dst_slots, strict=True):
            assert np.array_equal(target.blocks[d], source.blocks[s])
        assert not target.blocks[sorted(set(range(SLOTS)) - set(dst_slots))].any()
        assert np.array_equal(source.blocks, before)

    def test_a_load_reports_exactly_the_blocks_it_could_not_deliver(self, rig, layout, rng):
        source, target = Memory(layout, rng), Memory(layout)
        far = rig.far(layout)
        slots = list(range(8))
        assert run(rig.backend, transfer(source.storage, slots, far, slots, slots)) == set()
        rig.make_unreadable(far, [1, 4, 6])
        assert run(rig.backend, transfer(far, slots, target.storage, slots, slots)) == {1, 4, 6}
        for i in (0, 2, 3, 5, 7):
            assert np.array_equal(target.blocks[i], source.blocks[i]), f"block {i} came back wrong"

    # --- completion --------------------------------------------------------------------------------------

    def test_a_transfer_of_no_blocks_completes_with_no_failures(self, rig, layout):
        memory, far = Memory(layout), rig.far(layout)
        assert run(rig.backend, transfer(memory.storage, [], far, [], [])) == set()
        assert run(rig.backend, transfer(far, [], memory.storage, [], [])) == set()

    def test_on_complete_runs_once_per_transfer_on_a_thread_of_the_backend(self, rig, layout, rng):
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

    def test_a_transfer_keeps_its_memory_alive_until_it_completes(self, rig, layout, rng):
        far, target = rig.far(layout), Memory(layout)
        expected = rng.integers(0, 256, (4, layout.block_bytes), dtype=np.uint8)
        done = threading.Event()
        failures: list[set[int]] = []

        def on_complete(failed, quarantine=None) -> None:
            failures.append(set(failed))
            done.set()

        rig.backend.submit(
            transfer(buffer_storage(expected.copy(), layout), range(4), far, range(4), range(4)), on_complete
        )
        # the caller kept no reference to the source array or its storage
        assert done.wait(30) and failures == [set()]
        assert run(rig.backend, transfer(far, range(4), target.storage, range(4), range(4))) == set()
        assert np.array_equal(target.blocks[:4], expected)

    # --- refusals ----------------------------------------------------------------------------------------

    def test_a_device_pair_it_does_not_serve_is_refused_before_anything_moves(self, rig, layout, rng):
        devices = {*DEVICES, *itertools.chain.from_iterable(rig.backend.pairs)}
        for src, dst in itertools.product(devices, repeat=2):
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

    def test_close_waits_for_transfers_in_flight_then_refuses_new_ones(self, rig, layout, rng):
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
