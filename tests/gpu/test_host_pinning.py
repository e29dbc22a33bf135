"""A host slab pinned in chunks on a real GPU: every chunk is page-locked, and jobs of consecutive slots
on both sides through chunk boundaries arrive bit-exact with every copy method, both ways: their
copies end at the boundaries (``BlockStorage.breaks``); one DMA copy across two registrations is
refused (cuMemcpyBatchAsync: CUresult 1, seen on an H200) or fails. Skipped without CuPy, torch with
CUDA and a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.core.layout import BlockLayout
from kvtier.core.transfer import Transfer
from kvtier.tiers import host_pinning
from kvtier.tiers.gpu import device_storage
from kvtier.tiers.host import HostSlab
from kvtier.transfers.cuda import CUDABackend, cuda_available

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(
    not (cuda_available() and torch.cuda.is_available()), reason="needs CuPy, torch with CUDA and a GPU"
)

SLOTS, BLOCK = 64, 64 * 1024


@pytest.mark.parametrize("method", ["batch", "kernel", "loop"])
def test_copies_across_chunk_boundaries_are_bit_exact(monkeypatch, method):
    import cupy

    monkeypatch.setattr(host_pinning, "CHUNK_BYTES", 16 * BLOCK)  # 4 chunks of 16 slots
    layout = BlockLayout.contiguous(BLOCK)
    slab = HostSlab(SLOTS, layout)
    assert slab.pinned and len(slab.pinned_chunks) == 4
    assert slab.storage.breaks.tolist() == [address for address, _ in slab.pinned_chunks[1:]]
    for address, length in slab.pinned_chunks:
        for inside in (address, address + length - 1):
            assert cupy.cuda.runtime.pointerGetAttributes(inside).type != 0  # page-locked, not pageable
    gpu = [torch.randint(0, 256, (SLOTS, BLOCK), dtype=torch.uint8, device="cuda")]
    storage = device_storage(gpu, layout)
    backend = CUDABackend(method)
    try:
        crossing = list(range(12, 36))  # slots 12..35: through the boundaries at 16 and 32
        done = []
        backend.submit(Transfer(storage, crossing, slab.storage, crossing), done.append)
        backend.synchronize()
        for slot in crossing:
            assert np.array_equal(slab.array[slot * BLOCK : (slot + 1) * BLOCK], gpu[0][slot].cpu().numpy())
        gpu[0].zero_()
        backend.submit(Transfer(slab.storage, crossing, storage, crossing), done.append)
        backend.synchronize()
        for slot in crossing:
            assert np.array_equal(gpu[0][slot].cpu().numpy(), slab.array[slot * BLOCK : (slot + 1) * BLOCK])
        assert not gpu[0][:12].any() and not gpu[0][36:].any()
        assert backend.jobs_by_method[method] >= 2 and not backend.jobs_by_method["batch_refused"]
    finally:
        backend.close()  # (runs the completion callbacks still due)
        slab.close()
    assert done == [set(), set()] and not slab.pinned
