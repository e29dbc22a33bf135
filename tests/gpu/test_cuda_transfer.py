"""The CUDA backend on a real GPU: bit-exact round trips for every device layout and fragment size,
each copy method, concurrency, ordering with the compute stream, and exact failure reports.

Skipped where CuPy, torch with CUDA or a GPU is missing (CI and CPU machines).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvtier.core.layout import BlockLayout
from kvtier.core.transfer import Transfer
from kvtier.tiers.gpu import device_storage
from kvtier.tiers.host import HostSlab
from kvtier.transfers.cuda import CUDABackend, cuda_available

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(
    not (cuda_available() and torch.cuda.is_available()), reason="needs CuPy, torch with CUDA and a GPU"
)

LAYERS = 2
FRAGMENT_SIZES = [1000, 4096, 16384, 65536, 262144, 2 * 1024 * 1024]
LAYOUTS = ["kv_split", "packed", "vllm_views", "block_outer", "block_contiguous"]
METHODS = ["batch", "kernel", "loop", "auto"]


def device_blocks(kind: str, num_blocks: int, fragment: int) -> tuple[BlockLayout, list]:
    """Engine-style KV tensors on the GPU in one of the layouts an engine uses; random bytes."""
    cuda = torch.device("cuda")
    if kind == "kv_split":  # separate K and V tensors per layer
        layout = BlockLayout.per_layer(LAYERS, fragment, kv_split=True)
        tensors = [torch.empty((num_blocks, fragment), dtype=torch.uint8, device=cuda) for _ in range(2 * LAYERS)]
    elif kind == "packed":  # one tensor per layer, K and V packed in a block
        layout = BlockLayout.per_layer(LAYERS, fragment)
        tensors = [torch.empty((num_blocks, fragment), dtype=torch.uint8, device=cuda) for _ in range(LAYERS)]
    elif kind == "vllm_views":  # vLLM 0.33: per-layer (2, blocks, ...) views of one flat buffer
        layout = BlockLayout.per_layer(LAYERS, fragment, kv_split=True)
        flat = torch.empty((LAYERS, 2, num_blocks, fragment), dtype=torch.uint8, device=cuda)
        tensors = [flat[layer, kv] for layer in range(LAYERS) for kv in range(2)]
    elif kind == "block_outer":  # block-outer buffer addressed per layer: fragments strided by a whole block
        layout = BlockLayout.per_layer(LAYERS, fragment, kv_split=True)
        flat = torch.empty((num_blocks, LAYERS, 2, fragment), dtype=torch.uint8, device=cuda)
        tensors = [flat[:, layer, kv] for layer in range(LAYERS) for kv in range(2)]
    else:  # block-outer, a whole block one contiguous fragment
        layout = BlockLayout.contiguous(2 * LAYERS * fragment)
        tensors = [torch.empty((num_blocks, 2 * LAYERS * fragment), dtype=torch.uint8, device=cuda)]
    for t in tensors:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, device=cuda))
    return layout, tensors


def run(backend: CUDABackend, transfer: Transfer) -> set[int]:
    """Submit and wait for the completion callback; returns the failed block indices."""
    done = threading.Event()
    result: list[set[int]] = []
    backend.submit(transfer, lambda failed: (result.append(set(failed)), done.set()))
    assert done.wait(60), "the completion callback never ran"
    return result[0]


def host_block(slab: HostSlab, slot: int, layout: BlockLayout) -> np.ndarray:
    return slab.array[slot * layout.block_bytes : (slot + 1) * layout.block_bytes]


def device_block(tensors: list, block: int) -> np.ndarray:
    """A block's bytes in host-slot order (fragments back to back), read back through torch."""
    return np.concatenate([t[block].reshape(-1).cpu().numpy() for t in tensors])


@pytest.fixture
def backend(request):
    backend = CUDABackend(getattr(request, "param", "auto"))
    yield backend
    backend.close()


@pytest.mark.parametrize("backend", METHODS, indirect=True)
@pytest.mark.parametrize("fragment", FRAGMENT_SIZES)
@pytest.mark.parametrize("kind", LAYOUTS)
def test_store_then_load_into_other_blocks_is_bit_exact(backend, kind, fragment):
    rng = np.random.default_rng(fragment)
    num_blocks = 24 if fragment < 262144 else 6
    layout, gpu = device_blocks(kind, num_blocks, fragment)
    slab = HostSlab(num_blocks, layout)
    assert slab.pinned
    storage = device_storage(gpu, layout)
    blocks = rng.permutation(num_blocks)[: num_blocks // 2].tolist()
    slots = rng.permutation(num_blocks)[: len(blocks)].tolist()
    expected = [device_block(gpu, b) for b in blocks]

    assert run(backend, Transfer(storage, blocks, slab.storage, slots)) == set()
    for slot, want in zip(slots, expected, strict=True):
        assert np.array_equal(host_block(slab, slot, layout), want)

    targets = [b for b in rng.permutation(num_blocks).tolist() if b not in blocks][: len(blocks)]
    for t in gpu:
        t[targets] = 0
    assert run(backend, Transfer(slab.storage, slots, storage, targets)) == set()
    for target, want in zip(targets, expected, strict=True):
        assert np.array_equal(device_block(gpu, target), want)
    if backend.mode != "auto":
        assert set(backend.jobs_by_method) == {backend.mode}
    slab.close()


def test_auto_sends_small_fragments_to_the_kernel_and_large_ones_to_dma(backend):
    small_layout, small = device_blocks("kv_split", 8, 16384)
    large_layout, large = device_blocks("block_contiguous", 8, 2 * 1024 * 1024)
    small_slab, large_slab = HostSlab(8, small_layout), HostSlab(8, large_layout)
    scattered = [7, 1, 5, 3]
    small_job = Transfer(device_storage(small, small_layout), scattered, small_slab.storage, [0, 2, 4, 6])
    large_job = Transfer(device_storage(large, large_layout), scattered, large_slab.storage, [0, 2, 4, 6])
    assert backend.method_for(small_job, small_job.copies()) == "kernel"
    assert backend.method_for(large_job, large_job.copies()) == "batch"
    small_slab.close()
    large_slab.close()


def test_pageable_host_memory_goes_one_copy_at_a_time_and_arrives(backend):
    layout, gpu = device_blocks("packed", 4, 65536)
    pageable = np.zeros((4, layout.block_bytes), dtype=np.uint8)
    from kvtier.core.storage import buffer_storage

    host = buffer_storage(pageable, layout, writable=True)
    assert run(backend, Transfer(device_storage(gpu, layout), [3, 0], host, [0, 1])) == set()
    assert np.array_equal(pageable[0], device_block(gpu, 3)) and np.array_equal(pageable[1], device_block(gpu, 0))
    assert backend.jobs_by_method["loop"] == 1


def test_concurrent_loads_and_stores_on_different_blocks(backend):
    layout, gpu = device_blocks("vllm_views", 256, 16384)
    storage = device_storage(gpu, layout)
    slab = HostSlab(256, layout)
    slab.array[:] = np.random.default_rng(1).integers(0, 256, slab.nbytes, dtype=np.uint8)
    loads_from = list(range(0, 128))  # host slots 0..127 -> GPU blocks 128..255
    stores_from = list(range(0, 128))  # GPU blocks 0..127 -> host slots 128..255
    want_host = [device_block(gpu, b) for b in stores_from]
    want_gpu = [host_block(slab, s, layout).copy() for s in loads_from]
    errors: list[set[int]] = []

    def worker(direction: str) -> None:
        for lo in range(0, 128, 16):
            part = list(range(lo, lo + 16))
            if direction == "load":
                errors.append(run(backend, Transfer(slab.storage, part, storage, [128 + i for i in part])))
            else:
                errors.append(run(backend, Transfer(storage, part, slab.storage, [128 + i for i in part])))

    threads = [threading.Thread(target=worker, args=(d,)) for d in ("load", "store")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [set()] * 16
    for i in range(128):
        assert np.array_equal(host_block(slab, 128 + i, layout), want_host[i])
        assert np.array_equal(device_block(gpu, 128 + i), want_gpu[i])
    slab.close()


@pytest.mark.parametrize("backend", ["batch", "kernel"], indirect=True)
def test_a_store_right_after_a_kernel_copies_what_the_kernel_wrote(backend):
    layout, gpu = device_blocks("kv_split", 16, 65536)
    slab = HostSlab(16, layout)
    torch.cuda._sleep(200_000_000)  # keeps the compute stream busy for a while (~0.1 s)
    for t in gpu:
        t[[2, 9]] = 0xA5  # queued behind the sleep on the compute stream
    assert run(backend, Transfer(device_storage(gpu, layout), [2, 9], slab.storage, [0, 1])) == set()
    assert (slab.array[: 2 * layout.block_bytes] == 0xA5).all()
    slab.close()


@pytest.mark.parametrize("backend", ["batch", "kernel"], indirect=True)
def test_a_load_reports_completion_only_once_its_bytes_are_on_the_gpu(backend):
    layout, gpu = device_blocks("packed", 16, 262144)
    slab = HostSlab(16, layout)
    slab.array[:] = 0x3C
    done = threading.Event()
    torch.cuda._sleep(400_000_000)  # the load waits for the compute stream, so it cannot finish before this
    backend.submit(Transfer(slab.storage, [0, 1, 2], device_storage(gpu, layout), [5, 6, 7]), lambda f: done.set())
    assert not done.is_set()
    assert done.wait(60)
    reader = torch.cuda.Stream()  # a stream that knows nothing of the load but its reported completion
    with torch.cuda.stream(reader):
        seen = [t[[5, 6, 7]].clone() for t in gpu]
    reader.synchronize()
    assert all((s == 0x3C).all() for s in seen)
    slab.close()


def test_a_refused_batch_falls_back_to_single_copies(backend, monkeypatch):
    layout, gpu = device_blocks("kv_split", 8, 262144)
    slab = HostSlab(8, layout)

    class RefusingBatch:  # the driver call as it answers an invalid argument
        available = True

        def __call__(self, *args):
            return 1  # CUDA_ERROR_INVALID_VALUE

    monkeypatch.setattr(backend, "_batch", RefusingBatch())
    assert run(backend, Transfer(device_storage(gpu, layout), [4, 2], slab.storage, [0, 1])) == set()
    assert np.array_equal(host_block(slab, 0, layout), device_block(gpu, 4))
    assert backend.jobs_by_method["batch_refused"] == 1 and backend.jobs_by_method["loop"] == 1
    slab.close()


@pytest.mark.parametrize("backend", ["loop"], indirect=True)
def test_copies_the_runtime_refuses_fail_exactly_their_blocks(backend, monkeypatch):
    import cupy

    layout, gpu = device_blocks("kv_split", 8, 65536)
    slab = HostSlab(8, layout)
    bad = slab.storage.fragment_addresses([1])[0, 2]  # one fragment of the second block
    real = cupy.cuda.runtime.memcpyAsync

    def refusing(dst, src, size, kind, stream):
        if dst <= bad < dst + size:
            raise cupy.cuda.runtime.CUDARuntimeError(1)
        return real(dst, src, size, kind, stream)

    monkeypatch.setattr(cupy.cuda.runtime, "memcpyAsync", refusing)
    assert run(backend, Transfer(device_storage(gpu, layout), [3, 5, 7], slab.storage, [0, 1, 2])) == {1}
    assert np.array_equal(host_block(slab, 0, layout), device_block(gpu, 3))
    assert np.array_equal(host_block(slab, 2, layout), device_block(gpu, 7))
    slab.close()


def test_closed_backend_refuses_and_pending_callbacks_ran():
    backend = CUDABackend()
    layout, gpu = device_blocks("packed", 4, 4096)
    slab = HostSlab(4, layout)
    calls: list[set[int]] = []
    backend.submit(Transfer(device_storage(gpu, layout), [0, 1], slab.storage, [0, 1]), calls.append)
    backend.close()
    assert calls == [set()]
    from kvtier.core.errors import ClosedError

    with pytest.raises(ClosedError):
        backend.submit(Transfer(device_storage(gpu, layout), [0], slab.storage, [0]), calls.append)
    slab.close()


def test_a_piece_that_cannot_be_enqueued_fails_with_the_rest_once_earlier_pieces_landed(backend, monkeypatch):
    import kvtier.transfers.cuda as cuda_transfer

    layout, gpu = device_blocks("kv_split", 8, 65536)
    monkeypatch.setattr(cuda_transfer, "SLICE_BYTES", 2 * layout.block_bytes)  # pieces of two blocks
    slab = HostSlab(8, layout)
    real, pieces = backend._enqueue, []

    def second_piece_refused(part, copies, stream):
        pieces.append(part.num_blocks)
        if len(pieces) == 2:
            raise RuntimeError("injected")
        return real(part, copies, stream)

    monkeypatch.setattr(backend, "_enqueue", second_piece_refused)
    failed = run(backend, Transfer(device_storage(gpu, layout), [7, 6, 5, 4, 3, 2], slab.storage, [0, 1, 2, 3, 4, 5]))
    assert pieces == [2, 2] and failed == {2, 3, 4, 5}
    assert np.array_equal(host_block(slab, 0, layout), device_block(gpu, 7))
    assert np.array_equal(host_block(slab, 1, layout), device_block(gpu, 6))
    slab.close()
