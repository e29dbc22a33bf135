"""The host and GPU tiers, as built without CUDA.

Invariants checked:
- a host tier is one page-aligned slab of ``num_slots * block_bytes``, slot s at ``base + s *
  block_bytes``, private memory marked for huge pages; without CUDA it says it is pageable memory,
  and close() releases the slab;
- a GPU tier keeps one tensor per fragment (layer-outer, as vLLM keeps KV); without CUDA it runs on
  CPU tensors and says so; device_storage addresses engine tensors (also views into one shared
  buffer) and refuses tensors that do not match the layout;
- a round trip GPU tier -> host tier -> GPU tier through the CPU backend, with the tiers' own
  reserve / pin / commit and the job manager's fences, is bit-exact for random slots.
"""

from __future__ import annotations

import mmap
import os
import threading

import numpy as np
import pytest
import torch

from kvtier.core.errors import FenceError, TransferError
from kvtier.core.jobs import Fence, JobManager, JobState
from kvtier.core.layout import BlockLayout
from kvtier.core.tier import BlockState
from kvtier.core.transfer import Transfer
from kvtier.policies import LRUPolicy, Watermark
from kvtier.tiers.gpu import device_storage, gpu_tier
from kvtier.tiers.host import HostSlab, host_tier
from kvtier.transfers.cpu import CPUBackend

LAYOUT = BlockLayout.per_layer(4, 64, kv_split=True)  # 8 fragments, 512-byte blocks
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU stand-in")


def _has_cupy_gpu() -> bool:
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:
        return False


# --- host tier ---------------------------------------------------------------------------------


@pytest.mark.skipif(_has_cupy_gpu(), reason="checks the pageable fallback")
def test_host_tier_without_cuda_is_pageable_and_says_so():
    tier = host_tier("host", 6, LAYOUT, LRUPolicy(), Watermark(0.9, 0.5))
    assert tier.medium == "host" and tier.storage.device == "cpu"
    assert tier.note == "pageable host memory (no CUDA)"
    assert "pageable host memory (no CUDA)" in repr(tier)
    assert tier.capacity == 6 and tier.block_bytes == 512
    assert tier.watermark == Watermark(0.9, 0.5)
    tier.close()


def test_host_slab_is_one_page_aligned_run_of_slots():
    slab = HostSlab(5, LAYOUT)
    assert slab.nbytes == 5 * 512
    assert slab.address % mmap.PAGESIZE == 0
    addresses = slab.storage.fragment_addresses(range(5))
    assert addresses[:, 0].tolist() == [slab.address + 512 * s for s in range(5)]
    assert (addresses - addresses[:, :1]).tolist() == [LAYOUT.offsets.tolist()] * 5
    slab.storage.close()
    slab.close()  # a second close is harmless
    with pytest.raises(TransferError):
        slab.storage.fragment_addresses([0])


def _vm_flags(address: int) -> set[str]:
    """The kernel's VmFlags of the mapping holding ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(part, 16) for part in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps") or not hasattr(mmap, "MADV_HUGEPAGE"), reason="Linux only")
def test_a_host_slab_is_private_memory_marked_for_huge_pages():
    # A shared anonymous map (Python's default) is shmem, which gets no huge pages unless shmem_enabled
    # says so ("never" by default): the slab's madvise did nothing, and O_DIRECT reads into it ran at
    # about half the speed (bench/disk.py). "hg": MADV_HUGEPAGE; "sh": a shared mapping.
    slab = HostSlab(5, LAYOUT)
    try:
        flags = _vm_flags(slab.address)
        assert "hg" in flags and "sh" not in flags
    finally:
        slab.close()


def test_host_tier_close_releases_the_slab(blockio, rng):
    tier = host_tier("host", 3, LAYOUT, LRUPolicy())
    slots = tier.reserve([b"a"])
    data = rng.integers(0, 256, 512, dtype=np.uint8)
    blockio.write(tier.storage, slots[0], data)
    tier.commit([b"a"])
    assert np.array_equal(blockio.read(tier.storage, slots[0]), data)
    tier.close()
    with pytest.raises(TransferError):
        tier.storage.fragment_addresses([0])


def test_an_empty_host_tier_is_valid():
    tier = host_tier("host", 0, LAYOUT, LRUPolicy())
    assert tier.capacity == 0 and tier.usage().fraction == 0.0
    assert tier.reserve([]) == []
    tier.close()


# --- GPU tier ----------------------------------------------------------------------------------


@no_cuda
def test_gpu_tier_without_cuda_runs_on_cpu_tensors_and_says_so():
    tier = gpu_tier("gpu", 4, LAYOUT, LRUPolicy())
    assert tier.medium == "gpu" and tier.storage.device == "cpu"
    assert tier.note == "CPU tensors standing in for a GPU (no CUDA)"
    assert "CPU tensors standing in for a GPU" in repr(tier)
    assert tier.capacity == 4 and tier.block_bytes == 512
    tier.close()


def test_gpu_tier_keeps_one_tensor_per_fragment():
    tier = gpu_tier("gpu", 4, LAYOUT, LRUPolicy())
    addresses = tier.storage.fragment_addresses(range(4))
    assert addresses.shape == (4, 8)
    for f in range(8):  # fragment f of consecutive slots: one tensor with a 64-byte block stride
        assert (np.diff(addresses[:, f]) == 64).all()
    assert len(set(addresses[0].tolist())) == 8
    tier.close()


def test_device_storage_addresses_engine_tensors(rng):
    layers = [torch.from_numpy(rng.integers(0, 256, (6, 4, 8), dtype=np.uint8)) for _ in range(2)]
    layout = BlockLayout.per_layer(2, 32)
    storage = device_storage(layers, layout)
    assert storage.num_slots == 6 and storage.device == "cpu"
    row = storage.fragment_addresses([5])[0]
    assert row.tolist() == [layers[0].data_ptr() + 5 * 32, layers[1].data_ptr() + 5 * 32]


def test_device_storage_over_views_into_one_shared_buffer(blockio, rng):
    # One allocation shaped (layers, K/V, blocks, bytes) as some engines hand out; each view is one fragment.
    shared = torch.from_numpy(rng.integers(0, 256, (3, 2, 5, 16), dtype=np.uint8))
    views = [shared[layer, kv] for layer in range(3) for kv in range(2)]
    layout = BlockLayout.per_layer(3, 16, kv_split=True)
    storage = device_storage(views, layout)
    assert storage.num_slots == 5
    for slot in range(5):
        expected = shared[:, :, slot, :].reshape(-1).numpy()
        assert np.array_equal(blockio.read(storage, slot), expected)


def test_device_storage_with_block_stride_larger_than_the_fragment(blockio, rng):
    # Blocks along dim 0 with K and V interleaved per block: the K view has a 2x stride.
    kv = torch.from_numpy(rng.integers(0, 256, (4, 2, 8), dtype=np.uint8))
    storage = device_storage([kv[:, 0], kv[:, 1]], BlockLayout((8, 8)))
    for slot in range(4):
        assert np.array_equal(blockio.read(storage, slot), kv[slot].reshape(-1).numpy())


def test_device_storage_with_wider_dtypes():
    layers = [torch.zeros((3, 16), dtype=torch.float16) for _ in range(2)]
    storage = device_storage(layers, BlockLayout.per_layer(2, 32))
    assert storage.num_slots == 3
    with pytest.raises(TransferError):
        device_storage(layers, BlockLayout.per_layer(2, 16))


def test_device_storage_uses_the_smallest_block_count():
    storage = device_storage(
        [torch.zeros((5, 8), dtype=torch.uint8), torch.zeros((3, 8), dtype=torch.uint8)], BlockLayout.per_layer(2, 8)
    )
    assert storage.num_slots == 3
    with pytest.raises(TransferError):
        storage.fragment_addresses([3])


def test_device_storage_refuses_mismatched_tensors():
    layout = BlockLayout.per_layer(2, 16)
    with pytest.raises(TransferError, match="2 fragments"):
        device_storage([torch.zeros((4, 16), dtype=torch.uint8)], layout)
    with pytest.raises(TransferError, match="16 bytes"):
        device_storage([torch.zeros((4, 16), dtype=torch.uint8), torch.zeros((4, 12), dtype=torch.uint8)], layout)
    strided = torch.zeros((4, 32), dtype=torch.uint8)[:, ::2]  # 16 elements per block, not contiguous
    with pytest.raises(TransferError, match="contiguous"):
        device_storage([strided, strided], layout)


# --- round trip --------------------------------------------------------------------------------


def _copy(jobs: JobManager, backend: CPUBackend, src, src_slots, dst, dst_slots) -> set[int]:
    """One job per transfer, fenced on both tiers' slots, as the stack does; returns the failed blocks."""
    job = jobs.create(
        "copy",
        len(src_slots),
        fences=[*(Fence(src.name, s, False) for s in src_slots), *(Fence(dst.name, s, True) for s in dst_slots)],
    )
    jobs.start(job.id)
    backend.submit(Transfer(src.storage, src_slots, dst.storage, dst_slots), lambda failed: jobs.report(job.id, failed))
    jobs.wait(job, timeout=30)
    assert job.state is JobState.DONE
    return job.failed_blocks


def _fill_scattered(tier, keys, blockio, rng) -> dict[bytes, np.ndarray]:
    """Commit random blocks under ``keys``, then read a random few so that eviction leaves holes."""
    slots = tier.reserve(keys)
    data = {key: rng.integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8) for key in keys}
    for key, slot in zip(keys, slots, strict=True):
        blockio.write(tier.storage, slot, data[key])
    tier.commit(keys)
    for key in rng.permutation(keys)[:4].tolist():
        tier.pin([key])
        tier.unpin([key])
    return data


@pytest.mark.parametrize("threads", [1, 3])
def test_round_trip_gpu_host_gpu_is_bit_exact(threads, blockio, rng):
    jobs = JobManager()
    backend = CPUBackend(threads)
    gpu = gpu_tier("gpu", 16, LAYOUT, LRUPolicy(), is_fenced=jobs.is_fenced)
    host = host_tier("host", 24, LAYOUT, LRUPolicy(), is_fenced=jobs.is_fenced)
    keys = [b"block-%02d" % i for i in range(12)]

    _fill_scattered(gpu, [b"filler-%02d" % i for i in range(16)], blockio, rng)
    assert len(gpu.evict(12)) == 12  # four fillers stay, scattered
    gpu_slots = gpu.reserve(keys)
    data = rng.integers(0, 256, (12, LAYOUT.block_bytes), dtype=np.uint8)
    for slot, row in zip(gpu_slots, data, strict=True):
        blockio.write(gpu.storage, slot, row)
    gpu.commit(keys)

    # store: GPU (per-layer fragments) -> host (contiguous slots)
    src_slots = gpu.pin(keys)
    host_slots = host.reserve(keys)
    assert _copy(jobs, backend, gpu, src_slots, host, host_slots) == set()
    host.commit(keys)
    gpu.unpin(keys)
    for slot, row in zip(host.slots(keys), data, strict=True):
        assert np.array_equal(blockio.read(host.storage, slot), row)

    # the GPU copies go; other blocks take some of their slots
    assert len(gpu.evict(16)) == 16
    others = _fill_scattered(gpu, [b"other-%02d" % i for i in range(16)], blockio, rng)
    assert len(gpu.evict(12)) == 12
    kept = {key: gpu.slots([key])[0] for key in others if gpu.state(key) is BlockState.READY}
    assert len(kept) == 4

    # load: host -> GPU, in another order, into whatever slots are free now
    order = rng.permutation(12).tolist()
    back = [keys[i] for i in order]
    src_slots = host.pin(back)
    dst_slots = gpu.reserve(back)
    assert not set(dst_slots) & set(kept.values())
    assert _copy(jobs, backend, host, src_slots, gpu, dst_slots) == set()
    gpu.commit(back)
    host.unpin(back)
    for slot, i in zip(dst_slots, order, strict=True):
        assert np.array_equal(blockio.read(gpu.storage, slot), data[i])
    for key, slot in kept.items():  # blocks beside the loaded ones are untouched
        assert np.array_equal(blockio.read(gpu.storage, slot), others[key])

    for tier in (gpu, host):
        tier.check_invariants()
        assert tier.leaks() == {"pinned": 0, "writing": 0}
        tier.close()
    assert jobs.in_flight() == []
    backend.close()


def test_a_slot_in_flight_cannot_be_aborted_until_its_job_ends(rng):
    jobs = JobManager()
    backend = CPUBackend(1)
    gpu = gpu_tier("gpu", 4, LAYOUT, LRUPolicy(), is_fenced=jobs.is_fenced)
    host = host_tier("host", 4, LAYOUT, LRUPolicy(), is_fenced=jobs.is_fenced)
    gpu_slots = gpu.reserve([b"a"])
    gpu.commit([b"a"])
    host_slots = host.reserve([b"a"])
    job = jobs.create("store", 1, fences=[Fence("gpu", gpu_slots[0], False), Fence("host", host_slots[0], True)])
    with pytest.raises(FenceError):
        host.abort([b"a"])
    assert host.state(b"a") is BlockState.WRITING
    landed = threading.Event()
    backend.submit(
        Transfer(gpu.storage, gpu_slots, host.storage, host_slots),
        lambda failed: (jobs.report(job.id, failed), landed.set()),
    )
    assert landed.wait(30)
    host.abort([b"a"])
    assert host.state(b"a") is BlockState.FREE
    backend.close()
    gpu.close()
    host.close()
