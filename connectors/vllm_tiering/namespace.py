"""The namespace of the chunks vLLM's tiered offloading hands a kvtier tier: everything besides the tokens
that decides a chunk's bytes.

A secondary tier sees vLLM's CPU tier on the scheduler side, where one chunk (a row of the CPU tier)
holds ``blocks_per_chunk`` blocks of every worker (every TP rank's shard, side by side, and padding
up to an alignment). vLLM's ``OffloadKey`` names the tokens and the KV cache group only, so two
engines of another model, dtype, layout, block or chunk geometry or parallel layout give the same key
to other bytes. Every field of vLLM's ``OffloadingConfig`` that shapes a chunk's bytes enters the
namespace, with a fingerprint of a local model folder's weights and the kvtier config's own
``namespace``; ``fold_keys`` (core/keys.py) then folds each OffloadKey under it. JSON with sorted keys:
no choice of names can spell another combination's namespace.

What ``OffloadingConfig`` does not carry cannot enter: the model's Hub revision and its quantization.
A Hub model updated in place under the same name needs ``namespace`` set in the entry (or the disk
tier's directory changed); a local model folder is covered by its weights fingerprint.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from kvtier.connectors.model_files import weights_fingerprint

if TYPE_CHECKING:
    from vllm.v1.kv_offload.config import OffloadingConfig


def chunk_namespace(config: OffloadingConfig, chunk_bytes: int, namespace: str) -> str:
    """The namespace of chunks of ``chunk_bytes`` (a CPU tier row) under ``config``, with the kvtier
    config's ``namespace``. Reads the model folder: call it once per tier."""
    parallel = config.parallel
    fields: dict[str, Any] = {
        "model": config.model.name,
        "weights": weights_fingerprint(config.model.name),
        "dtype": config.model.dtype,
        "groups": [[g.tokens_per_block, list(g.layer_names), g.sliding_window_size_in_chunks] for g in config.groups],
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "worker_block_bytes": config.worker_kv_bytes_per_block,
        "chunk_bytes": chunk_bytes,
        "parallel": [parallel.world_size, parallel.tp_size, parallel.pp_size, parallel.pcp_size, parallel.dcp_size],
        "replicated": config.replicated_layout,
        "canonical": config.canonical_layout,
        "layout": config.kv_cache_layout,
        "namespace": namespace,
    }
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
