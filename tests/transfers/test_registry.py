"""Which transfer backend moves which copy, decided without any device.

Invariants checked:
- every backend names the (source device, destination device) pairs it serves: CPU memmove cpu -> cpu,
  CUDA between cuda and cpu (and cuda -> cuda), disk I/O between cpu and file; none reaches a slab file
  from GPU memory, which is why a disk -> GPU load is staged through host memory;
- a registry hands each pair to the backend serving it (the first listed where two do), starts a
  transfer on that backend only, and closes every backend it holds;
- a pair no backend serves is one TransferError naming the pair, the backends there are and what the
  copy is for;
- ``backends_for`` picks the backends a set of storage devices needs: CPU always, CUDA first where a
  storage is on CUDA, and disk where a tier is a disk tier (its medium's own, ``Medium.backend``), each
  configured from ``transfer``.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvtier.transfers
from kvtier.core.config import TransferConfig
from kvtier.core.errors import TransferError
from kvtier.core.layout import BlockLayout
from kvtier.core.storage import buffer_storage
from kvtier.core.transfer import Transfer, TransferBackend, TransferRegistry
from kvtier.tiers.disk.config import DiskTierConfig
from kvtier.tiers.disk.transfer import DiskBackend
from kvtier.transfers import backends_for
from kvtier.transfers.cpu import CPUBackend
from kvtier.transfers.cuda import CUDABackend

LAYOUT = BlockLayout.contiguous(64)
DISK_TIER = DiskTierConfig.model_validate({"medium": "disk", "path": "unused", "capacity_blocks": 1})
"""A disk tier's settings: the tier whose slab files ("file") need the disk backend (never opened here)."""


class Recording(TransferBackend):
    """A backend that copies nothing: it records what it was given and whether it was closed."""

    def __init__(self, name: str, *pairs: tuple[str, str]) -> None:
        self.name = name
        self.pairs = frozenset(pairs)
        self.submitted: list[Transfer] = []
        self.closed = False

    def submit(self, transfer, on_complete) -> None:
        self.submitted.append(transfer)
        on_complete(set())

    def close(self) -> None:
        self.closed = True


class FakeCUDA(Recording):
    """Stands in for CUDABackend where there is no GPU: the real backend's pairs, its constructor's argument."""

    def __init__(self, mode: str) -> None:
        super().__init__("cuda", *CUDABackend.pairs)
        self.mode = mode


def test_each_backend_names_the_device_pairs_it_copies():
    assert CPUBackend.pairs == {("cpu", "cpu")}
    assert CUDABackend.pairs == {("cuda", "cpu"), ("cpu", "cuda"), ("cuda", "cuda")}
    assert DiskBackend.pairs == {("cpu", "file"), ("file", "cpu")}
    backend = CPUBackend(1)
    assert backend.can_copy("cpu", "cpu") and not backend.can_copy("cpu", "file")
    backend.close()


def test_a_registry_hands_each_pair_to_the_backend_that_serves_it():
    cpu, disk, cuda = (
        Recording("cpu", ("cpu", "cpu")),
        Recording("disk", ("cpu", "file"), ("file", "cpu")),
        Recording("cuda", ("cuda", "cpu"), ("cpu", "cuda")),
    )
    registry = TransferRegistry([cuda, cpu, disk])
    assert registry.backends == [cuda, cpu, disk]
    assert registry.backend("cpu", "cpu") is cpu
    assert registry.backend("cpu", "file") is disk and registry.backend("file", "cpu") is disk
    assert registry.backend("cuda", "cpu") is cuda and registry.backend("cpu", "cuda") is cuda


def test_a_pair_two_backends_serve_goes_to_the_first_listed():
    first, second = Recording("first", ("cpu", "cpu")), Recording("second", ("cpu", "cpu"), ("cpu", "file"))
    registry = TransferRegistry([first, second])
    assert registry.backend("cpu", "cpu") is first
    assert registry.backend("cpu", "file") is second


@pytest.mark.parametrize("pair", [("file", "cuda"), ("cuda", "file"), ("file", "file"), ("cpu", "xpu")])
def test_a_pair_no_backend_serves_is_an_error_naming_it(pair):
    registry = TransferRegistry([Recording("cpu", ("cpu", "cpu")), Recording("disk", ("cpu", "file"))])
    with pytest.raises(TransferError, match=f"no transfer backend \\(cpu, disk\\) can copy {pair[0]} -> {pair[1]}$"):
        registry.backend(*pair)
    with pytest.raises(TransferError, match=f"can copy {pair[0]} -> {pair[1]} from tier 'disk'$"):
        registry.backend(*pair, "from tier 'disk'")


def test_an_empty_registry_serves_nothing():
    with pytest.raises(TransferError, match=r"no transfer backend \(\) can copy cpu -> cpu"):
        TransferRegistry([]).backend("cpu", "cpu")


def test_submit_starts_the_transfer_on_its_pairs_backend_only():
    cpu, other = Recording("cpu", ("cpu", "cpu")), Recording("other", ("cuda", "cpu"))
    registry = TransferRegistry([other, cpu])
    storage = buffer_storage(np.zeros((2, LAYOUT.block_bytes), np.uint8), LAYOUT, writable=True)
    transfer = Transfer(storage, [0], storage, [1])
    reports = []
    registry.submit(transfer, reports.append)
    assert cpu.submitted == [transfer] and other.submitted == [] and reports == [set()]


def test_close_closes_every_backend():
    backends = [Recording("a", ("cpu", "cpu")), Recording("b", ("cpu", "file"))]
    TransferRegistry(backends).close()
    assert all(b.closed for b in backends)


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(kvtier.transfers, "CUDABackend", FakeCUDA)


@pytest.mark.parametrize(
    "devices, names",
    [
        ({"cpu"}, ["cpu"]),
        ({"cpu", "file"}, ["cpu", "disk"]),
        ({"cuda", "cpu"}, ["cuda", "cpu"]),
        ({"cuda", "cpu", "file"}, ["cuda", "cpu", "disk"]),
        ({"file"}, ["cpu", "disk"]),
    ],
)
def test_backends_for_builds_what_the_devices_need_cuda_first(fake_cuda, devices, names):
    tiers = [DISK_TIER] if "file" in devices else []
    backends = backends_for(TransferConfig(threads=3, io_threads=2, cuda_copy="kernel"), devices, tiers)
    try:
        assert [b.name for b in backends] == names
        cpu = next(b for b in backends if b.name == "cpu")
        assert cpu.threads == 3
        if "cuda" in names:
            assert backends[0].mode == "kernel"
    finally:
        TransferRegistry(backends).close()


def test_the_backends_a_stack_needs_reach_disk_only_from_host_memory(fake_cuda):
    registry = TransferRegistry(backends_for(TransferConfig(), {"cuda", "cpu", "file"}, [DISK_TIER]))
    try:
        for pair in [("cuda", "cpu"), ("cpu", "cuda"), ("cpu", "cpu"), ("cpu", "file"), ("file", "cpu")]:
            registry.backend(*pair)
        for pair in [("cuda", "file"), ("file", "cuda")]:
            with pytest.raises(TransferError):
                registry.backend(*pair)
    finally:
        registry.close()
