"""CPU stand-ins for the CUDA-only pieces of SGLang 0.5.23's hierarchical cache (HiCache): test environment only.

SGLang runs a real server on a CPU without AMX (``--device cpu``, SGLANG_USE_CPU_ENGINE=1, torch_native attention),
but HiCache assumes a GPU in two places: it pins its host pools (cudaHostRegister), and its ``direct`` IO backend
copies pages between the device pool and the host pool with sgl_kernel's CUDA ops, which SGLang's host pool modules
import only on CUDA, ROCm or XPU. ``apply`` is registered in SGLang's plugin entry-point group
``sglang.srt.plugins``; ``sglang.srt.plugins.load_plugins()`` runs it early in every SGLang process (the server's
main process, and the scheduler and detokenizer processes it spawns, which is where the pools live). On a machine
with CUDA it changes nothing. The third stand-in is the module ``common_ops`` next to this one.

None of this belongs in kvtier: it only lets kvtier's tests run SGLang where there is no GPU.
"""

from __future__ import annotations

import functools
import importlib

# The host pool modules that call the direct copies: MHA models (the tests' Llama) and MLA models.
HOST_POOL_MODULES = ("sglang.srt.mem_cache.pool_host.mha", "sglang.srt.mem_cache.pool_host.mla")


def apply() -> None:
    """SGLang's plugin hook: install the stand-ins when torch sees no CUDA device (SGLang's own test for CUDA)."""
    import torch

    if torch.cuda.is_available():
        return
    _unpin_host_pools()
    copies = {
        "transfer_kv_direct": transfer_kv_direct,
        "transfer_kv_per_layer_direct_pf_lf": transfer_kv_per_layer_direct_pf_lf,
        "transfer_kv_all_layer_direct_lf_pf": transfer_kv_all_layer_direct_lf_pf,
    }
    for name in HOST_POOL_MODULES:
        module = importlib.import_module(name)
        for op, standin in copies.items():
            if not hasattr(module, op):  # imported there only on CUDA, ROCm or XPU
                setattr(module, op, standin)


def _unpin_host_pools() -> None:
    """Stand-in for pinned host pools: every HiCache host pool is built with ``pin_memory=False``.

    SGLang pins them by default (``pin_memory=True`` in ``MHATokenToKVPoolHost`` and ``MLATokenToKVPoolHost``) so a
    GPU's copy engines can reach them; pinning calls cudaHostRegister, which fails without an NVIDIA driver ("Found
    no NVIDIA driver"). On CPU there is no GPU to reach them. Every host pool passes ``pin_memory`` on to
    ``HostKVCache.__init__`` by keyword, so forcing it there covers them all.
    """
    from sglang.srt.mem_cache.pool_host.base import HostKVCache

    pinned_init = HostKVCache.__init__

    @functools.wraps(pinned_init)
    def unpinned_init(self, *args, **kwargs):
        kwargs["pin_memory"] = False
        pinned_init(self, *args, **kwargs)

    HostKVCache.__init__ = unpinned_init


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size: int) -> None:
    """Stand-in for ``sgl_kernel.kvcacheio.transfer_kv_direct`` (a CUDA op), for ``--hicache-io-backend direct
    --hicache-mem-layout layer_first``: copies the tokens ``src_indices`` of each source layer to the tokens
    ``dst_indices`` of the destination layer at the same position (device <-> host, one tensor a layer and
    component, tokens first). ``page_size`` only lets the CUDA op copy whole pages at a time; an indexed copy of
    the same tokens needs no runs."""
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_indices] = src[src_indices]


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id: int, page_size: int
) -> None:
    """Stand-in for ``sgl_kernel.kvcacheio.transfer_kv_per_layer_direct_pf_lf`` (a CUDA op): loads layer
    ``layer_id`` of the host tokens ``src_indices`` into the device tokens ``dst_indices``. The host buffers
    (``src_ptrs``, one a component: K and V, or MLA's one) are page_first_direct, [pages, layers, page_size, ...],
    so host token t sits at page t // page_size, offset t % page_size; the device buffers (``dst_ptrs``) are that
    layer's [tokens, ...]. SGLang turns ``--hicache-mem-layout page_first`` into ``page_first_direct`` for the
    direct IO backend."""
    pages, offsets = src_indices // page_size, src_indices % page_size
    for src, dst in zip(src_ptrs, dst_ptrs, strict=True):
        dst[dst_indices] = src[pages, layer_id, offsets]


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size: int) -> None:
    """Stand-in for ``sgl_kernel.kvcacheio.transfer_kv_all_layer_direct_lf_pf`` (a CUDA op): backs up the device
    tokens ``src_indices`` of every layer into the host tokens ``dst_indices`` of page_first_direct host buffers.
    ``src_ptrs`` holds each component's layers in turn (K layers, then V layers; MLA has one component) and
    ``dst_ptrs`` one host buffer a component, [pages, layers, page_size, ...]."""
    pages, offsets = dst_indices // page_size, dst_indices % page_size
    layers = len(src_ptrs) // len(dst_ptrs)
    for component, dst in enumerate(dst_ptrs):
        for layer in range(layers):
            dst[pages, layer, offsets] = src_ptrs[component * layers + layer][src_indices]
