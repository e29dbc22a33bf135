"""Fixtures every test folder shares (helper functions live in ``helpers/``).

``blockio`` reads and writes whole blocks through a storage's fragment addresses with plain ctypes,
independently of any transfer backend, so it can serve as the oracle that a backend's copies are
checked against. ``run_transfer`` submits a transfer and waits for its one completion call.
``rng`` is a numpy generator seeded from the test's id, so failures reproduce.
"""

from __future__ import annotations

import ctypes
import threading
import zlib

import numpy as np
import pytest


class BlockIO:
    """Raw block access: block bytes are the fragments in layout order, as a contiguous slot holds them."""

    @staticmethod
    def write(storage, slot: int, data: np.ndarray) -> None:
        data = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
        assert data.nbytes == storage.layout.block_bytes
        addresses = storage.fragment_addresses([slot])[0].tolist()
        layout = storage.layout
        for address, offset, size in zip(addresses, layout.offsets.tolist(), layout.fragment_bytes, strict=True):
            ctypes.memmove(address, data.ctypes.data + offset, size)

    @staticmethod
    def read(storage, slot: int) -> np.ndarray:
        addresses = storage.fragment_addresses([slot])[0].tolist()
        raw = b"".join(ctypes.string_at(a, n) for a, n in zip(addresses, storage.layout.fragment_bytes, strict=True))
        return np.frombuffer(raw, dtype=np.uint8).copy()


@pytest.fixture(autouse=True)
def gpu_tiers_on_cpu(request, monkeypatch):
    """Outside tests/gpu, GPU tiers run on CPU stand-ins even on a machine with CUDA: these tests read
    and write tier memory with plain ctypes, as the oracle for what the backends copied."""
    if "gpu" not in request.node.path.parent.parts[-1:]:
        import kvtier.tiers.gpu

        monkeypatch.setattr(kvtier.tiers.gpu, "use_cuda", lambda: False)


@pytest.fixture
def blockio() -> type[BlockIO]:
    return BlockIO


@pytest.fixture
def rng(request) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def _run_transfer(backend, transfer, timeout: float = 30.0) -> set[int]:
    """Submit and wait; returns the failed block indices of the single completion call."""
    done = threading.Event()
    calls: list[set[int]] = []

    def on_complete(failed) -> None:
        calls.append(set(failed))
        done.set()

    backend.submit(transfer, on_complete)
    assert done.wait(timeout), "the transfer never completed"
    assert len(calls) == 1
    return calls[0]


@pytest.fixture
def run_transfer():
    return _run_transfer
