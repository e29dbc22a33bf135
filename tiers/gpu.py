"""The GPU tier: blocks in device tensors, one tensor per fragment (a layer-outer layout, as vLLM keeps).

Under vLLM the tensors belong to the engine and only ``device_storage`` is used, to address them.
Standalone, the tier allocates its own tensors. Without CUDA it runs on CPU memory, so everything
above it works and is tested on any machine, and it says so in its description.

The medium's YAML schema (``GpuTierConfig``) and registry entry (``MEDIUM``) are here too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from pydantic import model_validator

from kvtier.core.devices import CUDA_DEVICE, HOST_DEVICE, Capabilities
from kvtier.core.errors import TransferError
from kvtier.core.layout import BlockLayout
from kvtier.core.media import Medium, TierRequest
from kvtier.core.storage import StridedStorage
from kvtier.core.tier import Tier
from kvtier.core.tier_config import ProblemList, StackShape, TierConfigBase
from kvtier.policies.base import EvictionPolicy
from kvtier.policies.watermark import Watermark
from kvtier.tiers.host import refuse_more_than_memory


def device_storage(tensors: Sequence[Any], layout: BlockLayout) -> StridedStorage:
    """Address engine tensors: tensor f holds fragment f of every block, blocks along dimension 0.

    Geometry comes from each tensor's data pointer and block stride, not from its shape, so views
    into one shared buffer (as vLLM 0.33 hands out) work as well as separate tensors.
    """
    if len(tensors) != layout.num_fragments:
        raise TransferError(f"{len(tensors)} tensors for a layout of {layout.num_fragments} fragments")
    devices = {t.device.type for t in tensors}
    if len(devices) != 1:
        raise TransferError(f"tensors live on several devices: {sorted(devices)}")
    num_blocks = min(t.shape[0] for t in tensors)
    if num_blocks < 1:
        raise TransferError("device tensors hold no block")
    for t, nbytes in zip(tensors, layout.fragment_bytes, strict=True):
        if t[0].numel() * t.element_size() != nbytes or not t[0].is_contiguous():
            raise TransferError(f"a tensor's block is not one contiguous run of {nbytes} bytes")
    return StridedStorage(
        layout,
        num_blocks,
        [t.data_ptr() for t in tensors],
        [t.stride(0) * t.element_size() for t in tensors],
        devices.pop(),
        list(tensors),
    )


def use_cuda() -> bool:
    """Whether a standalone GPU tier allocates on CUDA (torch sees a device) or on CPU stand-ins."""
    import torch

    return torch.cuda.is_available()


def gpu_tier(
    name: str,
    num_slots: int,
    layout: BlockLayout,
    policy: EvictionPolicy[bytes],
    watermark: Watermark | None = None,
    is_fenced=None,
) -> Tier:
    """A tier over its own memory: torch tensors on the current CUDA device, or CPU stand-ins without
    CUDA (torch tensors, or numpy arrays where torch is not installed)."""
    try:
        import torch
    except ImportError:
        refuse_more_than_memory(num_slots * layout.block_bytes)
        arrays = [np.empty((num_slots, nbytes), dtype=np.uint8) for nbytes in layout.fragment_bytes]
        storage = StridedStorage(
            layout, num_slots, [a.ctypes.data for a in arrays], list(layout.fragment_bytes), HOST_DEVICE, arrays
        )
        return Tier(name, "gpu", storage, policy, watermark, is_fenced, "numpy arrays standing in for a GPU (no torch)")
    device = CUDA_DEVICE if use_cuda() else HOST_DEVICE
    if device == HOST_DEVICE:
        refuse_more_than_memory(num_slots * layout.block_bytes)
    try:
        tensors = [
            torch.empty((num_slots, nbytes), dtype=torch.uint8, device=device) for nbytes in layout.fragment_bytes
        ]
    except RuntimeError as exc:
        # torch says it cannot allocate with OutOfMemoryError on CUDA and a plain RuntimeError on CPU (with
        # valid shapes nothing else fails there); a MemoryError is what the stack builder names the tier for.
        if device == CUDA_DEVICE and not isinstance(exc, torch.cuda.OutOfMemoryError):
            raise
        raise MemoryError(str(exc)) from exc
    if device == CUDA_DEVICE:
        note = f"CUDA device {torch.cuda.current_device()}"
    else:
        note = "CPU tensors standing in for a GPU (no CUDA)"
    return Tier(name, "gpu", device_storage(tensors, layout), policy, watermark, is_fenced, note)


class GpuTierConfig(TierConfigBase):
    """GPU memory. Capacity may be left out where the engine owns GPU memory (under vLLM)."""

    medium: Literal["gpu"]

    @model_validator(mode="after")
    def _capacity(self) -> GpuTierConfig:
        self._both_capacities()
        return self

    def stack_problems(self, stack: StackShape, i: int) -> ProblemList:
        if i == 0:
            return []
        return [
            (("medium",), "a gpu tier may only be the first tier (tiers[0]), since the engine reads KV from GPU memory")
        ]


def _tier(request: TierRequest) -> Tier:
    return gpu_tier(request.name, request.slots, request.layout, *request.policy(), request.is_fenced)


def _direct(other: str, caps: Capabilities) -> bool:
    """GPU memory and a disk slab copy without host staging where GPUDirect Storage is available."""
    return other == "disk" and caps.gpu_direct_storage


# Under an engine the GPU is the engine's own memory: no storage of kvtier's, no hits counted from it.
MEDIUM = Medium("gpu", GpuTierConfig, _tier, None, direct=_direct, event_medium="GPU", counts_hits=False)
