"""Block keys: chained hashes of token blocks, so equal prefixes give equal keys in any request.

A block's key covers its own tokens and, through the chain, every token before it. Two requests that
share the first ``n`` full blocks therefore share the first ``n`` keys, and a block found under a key
is valid KV for exactly that prefix. The namespace seeds the chain so that keys from different models,
dtypes, layouts or tensor-parallel ranks never collide: their bytes differ, so their keys must too.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np
import xxhash

KEY_BYTES = 16
_SEED_PREFIX = b"kvtier\0"


def _namespace_bytes(namespace: bytes | str) -> bytes:
    """Str namespaces are UTF-8 encoded so that ``"m"`` and ``b"m"`` name the same namespace."""
    if isinstance(namespace, str):
        return namespace.encode("utf-8")
    if isinstance(namespace, (bytes, bytearray, memoryview)):
        return bytes(namespace)
    raise TypeError(f"namespace must be bytes or str, got {type(namespace).__name__}")


def chain_hashes(token_ids: Sequence[int] | np.ndarray, block_size: int,
                 namespace: bytes | str = b"", parent: bytes | None = None) -> list[bytes]:
    """One 16-byte key per full block of ``block_size`` tokens; a trailing partial block gets none.

    ``key_i = xxh3_128(key_{i-1} + tokens of block i as little-endian int64)`` and
    ``key_{-1} = xxh3_128(b"kvtier\\0" + namespace)``. Partial blocks are skipped because their KV
    is still being written by the engine and would change once the block fills.

    ``parent`` continues an existing chain: the key of the block just before ``token_ids`` (the
    namespace is then already folded in). An engine whose sequences grow block by block hashes only
    the new blocks: ``keys + chain_hashes(new_tokens, block_size, parent=keys[-1])`` equals the keys
    of the whole sequence.
    """
    if parent is not None and (not isinstance(parent, bytes) or len(parent) != KEY_BYTES):
        raise ValueError(f"parent must be a {KEY_BYTES}-byte key, got {parent!r:.40}")
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size <= 0:
        raise ValueError(f"block_size must be a positive integer (tokens per block), got {block_size!r}")
    block_size = int(block_size)
    tokens = np.asarray(token_ids)
    if tokens.ndim != 1:
        raise ValueError(f"token_ids must be a flat sequence of ints, got an array of shape {tokens.shape}")
    if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
        raise TypeError(f"token_ids must be integers, got dtype {tokens.dtype}")
    n_blocks = tokens.size // block_size
    # One conversion for the whole prompt; each block is then a slice of this buffer.
    data = tokens[: n_blocks * block_size].astype("<i8", copy=False).tobytes()
    stride = block_size * 8
    digest = xxhash.xxh3_128_digest
    prev = digest(_SEED_PREFIX + _namespace_bytes(namespace)) if parent is None else parent
    keys: list[bytes] = []
    for i in range(n_blocks):
        prev = digest(prev + data[i * stride:(i + 1) * stride])
        keys.append(prev)
    return keys


@dataclass(frozen=True)
class Namespace:
    """What makes a block's bytes differ besides its tokens: model, dtype, layout, block size, TP rank.

    Blocks for the same tokens hold different bytes under another model, dtype, memory layout, block
    size or tensor-parallel shard, so these fields must enter the key; ``encode()`` is the value to pass
    as ``chain_hashes(..., namespace=)``. ``tp_rank`` stays ``None`` where every rank holds the same bytes.
    """

    model: str
    dtype: str
    layout: str = ""
    block_tokens: int = 16
    tp_rank: int | None = None

    def encode(self) -> bytes:
        """A stable, unambiguous encoding: JSON with sorted keys, so no two field sets give the same bytes."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


__all__ = ["KEY_BYTES", "Namespace", "chain_hashes"]
