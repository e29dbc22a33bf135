"""SGLang's real host pools on CPU and kvtier's storage backend over them, built as SGLang builds them.

A host pool comes from a real device pool (``MHATokenToKVPool`` / ``MLATokenToKVPool`` on ``cpu``) through
the function SGLang's own pool assembler uses, pinned memory off (no CUDA here). The backend comes from
SGLang's ``StorageBackendFactory.create_backend("dynamic", ...)`` with the extra config a user passes on the
command line, and gets the pool through ``register_mem_pool_host``, as SGLang's cache controller does.
Only the SGLang venv can import this module.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _mha_host_inputs
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory

PAGE = 4
"""Tokens per page, as in the server tests."""
MODULE = "kvtier.connectors.sglang.backend"
CLASS = "KVTierStorage"


def mha_host_pool(
    layout: str = "layer_first",
    layers: int = 3,
    heads: int = 2,
    head_dim: int = 8,
    dtype: torch.dtype = torch.bfloat16,
    page: int = PAGE,
    device_pages: int = 64,
) -> Any:
    """An MHA host pool of twice the device pool's pages."""
    device = MHATokenToKVPool(
        size=device_pages * page,
        page_size=page,
        dtype=dtype,
        head_num=heads,
        head_dim=head_dim,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )
    cls, info, kwargs = _mha_host_inputs(device)
    return cls(info, 2.0, 0, page, layout, pin_memory=False, **kwargs)


def mla_host_pool(layout: str = "layer_first", layers: int = 3) -> Any:
    """An MLA host pool (latent 16 + rope 8 per token and layer) of twice the device pool's 64 pages."""
    device = MLATokenToKVPool(
        size=64 * PAGE,
        page_size=PAGE,
        dtype=torch.bfloat16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )
    return MLATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        2.0,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device_capacity_tokens=device.size,
        start_layer=device.start_layer,
        end_layer=device.end_layer,
        target_layer_num=device.layer_num,
        override_kv_cache_dim=device.kv_cache_dim,
    )


def extra_config(config: dict | str, interface_v1: int = 1, **more: Any) -> dict:
    """The extra config a user gives ``--hicache-storage-backend-extra-config`` to load kvtier."""
    return {
        "backend_name": "kvtier",
        "module_path": MODULE,
        "class_name": CLASS,
        "interface_v1": interface_v1,
        "config": config,
        **more,
    }


def storage_config(
    extra: dict, host_pool: Any, tp_rank: int = 0, tp_size: int = 1, mla: bool = False, model: str = "tiny-model"
) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=True,
        is_page_first_layout=host_pool.layout == "page_first",
        model_name=model,
        extra_config=extra,
    )


def open_backend(host_pool: Any, config: dict | str, interface_v1: int = 1, **options: Any) -> Any:
    """kvtier's backend as SGLang creates and wires it; ``options`` go to ``storage_config``."""
    backend = StorageBackendFactory.create_backend(
        "dynamic", storage_config(extra_config(config, interface_v1), host_pool, **options), host_pool
    )
    backend.register_mem_pool_host(host_pool)
    return backend


def fill(host_pool: Any, seed: int) -> None:
    """Random bytes in the whole host pool."""
    raw = host_pool.kv_buffer.view(torch.uint8)
    generator = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))


def indices(pages: range | list[int], page: int = PAGE) -> torch.Tensor:
    """SGLang's token indices of whole pages of ``page`` tokens (what its controller passes a v1 call)."""
    return torch.cat([torch.arange(p * page, (p + 1) * page) for p in pages])


def page_bytes(host_pool: Any, page: int) -> torch.Tensor:
    """A copy of one page's bytes in flat-page order (SGLang's ``get_data_page(flat=True)``)."""
    return host_pool.get_data_page(page * host_pool.page_size, flat=True).view(torch.uint8).clone()


def publish(backend: Any, host_pool: Any, names: list[str], pages: range, seed: int, within: float = 30.0) -> list:
    """Store random pages under ``names`` and wait until every copy below the first tier has landed (a
    shared tier's, written through); the pages' bytes."""
    fill(host_pool, seed)
    before = [page_bytes(host_pool, p) for p in pages]
    assert backend.batch_set_v1(names, indices(pages)) == [True] * len(names)
    backend.stack.wait_idle(within)
    return before


def zero_pages(host_pool: Any, pages: range | list[int]) -> None:
    """Zeros in the given pages (poison before a load into them)."""
    zeros = torch.zeros_like(host_pool.get_dummy_flat_data_page())
    for page in pages:
        host_pool.set_from_flat_data_page(page * host_pool.page_size, zeros)


def keys(n: int, prefix: str = "k") -> list[str]:
    """SGLang-like page keys: 64 hex digits each."""
    return [f"{prefix}{i:x}".rjust(64, "0") for i in range(n)]
