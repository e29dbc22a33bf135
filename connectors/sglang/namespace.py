"""The key namespace under SGLang: everything besides a page's tokens that decides its KV bytes.

SGLang names a page by a SHA-256 chain over its tokens (seeded with the request's LoRA and cache salt),
which says nothing of the model, its weights, the KV dtype, the page size, the host layout or the
tensor-parallel shard. kvtier folds SGLang's key under this namespace (``core/keys.py``: ``fold_keys``,
keyed with ``key_secret_env`` when set), so a page stored under one of these settings is never served
under another, not from disk after a restart nor from a store other engines share. MLA models keep one
copy for the whole TP group (every rank holds the same bytes; SGLang lets one rank write it), so their
namespace leaves the rank out.
"""

from __future__ import annotations

import json
from typing import Any

from kvtier.connectors.model_files import weights_fingerprint
from kvtier.connectors.sglang.pages import PageGeometry
from kvtier.core.config import StackConfig
from kvtier.core.errors import ConfigError


def check_parallelism(storage_config: Any) -> None:
    """Refuse the parallel layouts whose shards kvtier's keys cannot name: context parallelism (ranks hold
    interleaved parts of a page's tokens) and heads split across heterogeneous TP sizes."""
    for size, what in (("attn_cp_size", "attention context parallelism"), ("dcp_size", "decode context parallelism")):
        if getattr(storage_config, size, 1) > 1:
            raise ConfigError(f"kvtier does not serve SGLang's {what} ({size}={getattr(storage_config, size)})")
    if getattr(storage_config, "should_split_heads", False):
        raise ConfigError("kvtier does not serve tp_lcm_size (pages split by heads across TP sizes); remove it")


def storage_namespace(
    storage_config: Any,
    host_pool: Any,
    pages: PageGeometry,
    config: StackConfig,
    model_path: str | None,
    revision: str | None = None,
) -> bytes:
    """The namespace of one rank's pages: model, revision and weights, KV dtype, page size and geometry, host layout,
    TP size and rank (none for MLA), pipeline stage, and the kvtier config's own ``namespace``. Reads
    the model folder when ``model_path`` is one: call it once per process."""
    model = model_path or storage_config.model_name or ""
    fields = {
        "engine": "sglang",
        "model": model,
        "served_as": storage_config.model_name,
        "revision": revision,
        "weights": weights_fingerprint(model) if model else None,
        "dtype": str(host_pool.dtype),
        "pool": type(host_pool).__name__,
        "layout": host_pool.layout,
        "page_tokens": pages.page_tokens,
        "page_shape": list(pages.page_shape),
        "tp": storage_config.tp_size,
        "tp_rank": None if storage_config.is_mla_model else storage_config.tp_rank,
        "pp": [storage_config.pp_rank, storage_config.pp_size],
        "namespace": config.namespace,
    }
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def server_model_path() -> tuple[str | None, str | None]:
    """The served model's path and revision from SGLang's runtime context (inside a server), else (None, None):
    SGLang hands a backend only the served model name, which need not be a path."""
    try:
        from sglang.srt.runtime_context import get_server_args

        args = get_server_args()
    except Exception:  # no server context: a backend built by hand (tests, tools)
        return None, None
    return getattr(args, "model_path", None), getattr(args, "revision", None)
