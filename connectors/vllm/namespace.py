"""The key namespace under vLLM: everything besides the token ids that decides a block's KV bytes.

Two blocks of the same tokens hold different KV under another model, weights, quantization, dtype,
cache dtype, memory layout, TP size or block size, and under another LoRA adapter; a cache salt keeps
tenants' blocks apart on purpose. All of these enter the chain's root (``core/keys.py``), so a block
stored under one setting is never served under another, not even from disk after a restart.

Both encodings are unambiguous: the engine's fields are JSON with sorted keys, a request's fields are
length-prefixed, so no choice of names, salts or paths can spell another combination's namespace.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from kvtier.connectors.model_files import weights_fingerprint
from kvtier.core.config import StackConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def engine_namespace(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: StackConfig) -> bytes:
    """The namespace of one engine's blocks (one rank's share of them): model and its revision, a
    fingerprint of the weights of a local model folder, quantization, dtypes, layout, TP size, block
    size and the kvtier config's own ``namespace``. Reads the model folder: call it once per process."""
    model = vllm_config.model_config
    settings: dict[str, Any] = {
        "model": model.model,
        "revision": model.revision,
        "quantization": model.quantization,
        "dtype": model.dtype,
        "cache_dtype": vllm_config.cache_config.cache_dtype,
        "layout": kv_cache_config.kv_cache_layout,
        "tp": vllm_config.parallel_config.tensor_parallel_size,
        "block_size": vllm_config.cache_config.block_size,
        "namespace": config.namespace,
    }
    groups = kv_cache_config.kv_cache_groups
    if len(groups) > 1:  # hybrid: which layers each group holds, and how (single-group namespaces stay as they were)
        settings["groups"] = [
            [
                type(g.kv_cache_spec).__name__,
                getattr(g.kv_cache_spec, "block_size", None),
                getattr(g.kv_cache_spec, "sliding_window", None),
                list(g.layer_names),
            ]
            for g in groups
        ]
    return settings_namespace(settings)


def settings_namespace(settings: dict[str, Any]) -> bytes:
    """The namespace of an engine's ``settings``, a plain dict of what ``engine_namespace`` reads from
    vLLM's config (``model``, ``revision``, ``quantization``, ``dtype``, ``cache_dtype``, ``layout``,
    ``tp``, ``block_size``, ``namespace``, ``groups`` for a hybrid model), with the fingerprint of a
    local model folder's weights added. Apart so that ``kvtier doctor`` computes an engine's namespace
    from its command line with the very same rules, without importing vLLM."""
    fields = {
        **settings,
        "revision": _revision(settings["revision"]),
        "weights": weights_fingerprint(settings["model"]),
        **{name: _text(settings[name]) for name in ("quantization", "dtype", "cache_dtype")},
    }
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def request_namespace(engine: bytes, lora_name: str = "", lora_path: str = "", salt: str = "") -> bytes:
    """A request's namespace: the engine's, its LoRA adapter (name and path, as vLLM's own prefix
    cache keys them) and its cache salt, each length-prefixed."""
    fields = (engine, lora_name.encode(), lora_path.encode(), salt.encode())
    return b"".join(len(f).to_bytes(8, "little") + f for f in fields)


def request_tenant(lora_name: str = "", salt: str = "") -> str:
    """Whose a request's blocks are (``KVTier``'s ``tenant``): its cache salt, the way vLLM users already
    keep tenants' prefixes apart; a request without one but with a LoRA adapter belongs to the adapter
    (``lora:<name>``); "" (no tenant) otherwise."""
    if salt:
        return salt
    return f"lora:{lora_name}" if lora_name else ""


def _revision(revision: Any) -> str | None:
    """The commit a Hub revision resolved to (vLLM resolves ``main`` to a commit at start), else the
    revision as given."""
    return _text(getattr(revision, "resolved", None) or revision)


def _text(value: Any) -> str | None:
    return None if value is None else str(value)
