"""Fixtures every test folder shares (helper functions live in ``helpers/``; these come from kvtier.testing,
whose suites use them too).

``blockio`` reads and writes whole blocks through a storage's fragment addresses with plain ctypes,
independently of any transfer backend, so it can serve as the oracle that a backend's copies are
checked against. ``run_transfer`` submits a transfer and waits for its one completion call.
``rng`` is a numpy generator seeded from the test's id, so failures reproduce.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.testing.common import seeded_rng
from kvtier.testing.tier import MemorySlots
from kvtier.testing.transfer import run


@pytest.fixture(autouse=True)
def gpu_tiers_on_cpu(request, monkeypatch):
    """Outside tests/gpu, GPU tiers run on CPU stand-ins even on a machine with CUDA: these tests read
    and write tier memory with plain ctypes, as the oracle for what the backends copied."""
    if "gpu" not in request.node.path.parent.parts[-1:]:
        import kvtier.tiers.gpu

        monkeypatch.setattr(kvtier.tiers.gpu, "use_cuda", lambda: False)


@pytest.fixture
def blockio() -> type[MemorySlots]:
    return MemorySlots


@pytest.fixture
def rng(request) -> np.random.Generator:
    return seeded_rng(request)


@pytest.fixture
def run_transfer():
    return run
