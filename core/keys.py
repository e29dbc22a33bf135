"""Block keys: chained hashes of token blocks, so equal prefixes give equal keys in any request.

A block's key covers its own tokens and, through the chain, every token before it. Two requests that
share the first ``n`` full blocks therefore share the first ``n`` keys, and a block found under a key
is valid KV for exactly that prefix. The namespace seeds the chain so that keys from different models,
dtypes, layouts or tensor-parallel ranks never collide: their bytes differ, so their keys must too.

Keys are BLAKE2b with a 16-byte digest: finding two token sequences with one key costs about 2^64
hashes, so one caller cannot forge another prompt's keys and be served its KV. Keys are visible to
everyone who shares a store (disk slot headers, KV events); with a per-deployment secret every hash
of the chain is keyed, so nobody without the secret can compute a prompt's keys, not even the next
key from a known one.

A tenant's keys (a tenant: whoever an engine says a request belongs to, vLLM's ``cache_salt``, the API's
``tenant=``) begin with its 8-byte tag (``tenant_tag``): a keyed hash of the tenant's id, so a store
names no tenant, yet every tier reads whose a block is from its key alone (``tenant_of``: the seal it is
encrypted under, the share it counts against). With a secret, each tenant's chain is keyed with a key
of its own (derived from the secret and the tag), so equal tokens give unrelated chains in two tenants;
without one the tag alone keeps their keys apart.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from kvtier.core.errors import ConfigError

KEY_BYTES = 16
MAX_KEY_BYTES = 64
"""The longest key a tier accepts (a disk slot header keeps it whole); callers with their own keys
(the standalone API takes any ``bytes``) get a clear error above this, never a truncated key."""
MIN_SECRET_BYTES = 16
# BLAKE2b personalisations: the chain's root and its links are hashes of different things, so they
# must never be confusable, whatever bytes a namespace or a block holds.
_ROOT_PERSON = b"kvtier-root-v2"
_LINK_PERSON = b"kvtier-link-v2"
_SECRET_PERSON = b"kvtier-secret-v2"
_FOLD_PERSON = b"kvtier-fold-v1"
_TAG_PERSON = b"kvtier-tenant-v1"
_TENANT_KEY_PERSON = b"kvtier-tchain-v1"
TENANT_TAG_BYTES = 8
TENANT_KEY_BYTES = TENANT_TAG_BYTES + KEY_BYTES
"""A tenant's key: its tag, then the block's chained hash. A key of any other length is no tenant's."""
MAX_TENANT_BYTES = 255
_INT64_MAX = np.iinfo(np.int64).max


def _namespace_bytes(namespace: bytes | str) -> bytes:
    """Str namespaces are UTF-8 encoded so that ``"m"`` and ``b"m"`` name the same namespace."""
    if isinstance(namespace, str):
        return namespace.encode("utf-8")
    if isinstance(namespace, (bytes, bytearray, memoryview)):
        return bytes(namespace)
    raise TypeError(f"namespace must be bytes or str, got {type(namespace).__name__}")


def hash_key(secret: bytes) -> bytes:
    """The 32-byte BLAKE2b key for a secret of any length: BLAKE2b-256 of the secret, personalised
    ``kvtier-secret-v2``. BLAKE2b takes keys of at most 64 bytes; hashing every secret (short ones
    too) is one rule for all lengths."""
    return hashlib.blake2b(secret, digest_size=32, person=_SECRET_PERSON).digest()


def tenant_tag(tenant: str | bytes, secret: bytes | None = None) -> bytes:
    """The 8-byte tag that begins a tenant's keys: BLAKE2b-64 of the tenant's id (str: UTF-8), keyed
    with the key secret when there is one (then nobody without it can tell which tenant a key is
    whose, nor compute a tenant's tag). b"" (no tenant) for an empty id."""
    raw = _namespace_bytes(tenant)
    if len(raw) > MAX_TENANT_BYTES:
        raise ValueError(f"a tenant id is at most {MAX_TENANT_BYTES} bytes, got {len(raw)}")
    if not raw:
        return b""
    key = hash_key(secret) if secret is not None else b""
    return hashlib.blake2b(raw, digest_size=TENANT_TAG_BYTES, key=key, person=_TAG_PERSON).digest()


def tenant_of(key: bytes) -> bytes:
    """The tag of the tenant whose block ``key`` names (b"": none, every key not TENANT_KEY_BYTES long)."""
    return key[:TENANT_TAG_BYTES] if len(key) == TENANT_KEY_BYTES else b""


@functools.lru_cache(maxsize=256)
def _hashers(secret: bytes | None, tag: bytes = b"") -> tuple[hashlib.blake2b, hashlib.blake2b]:
    """Root and link hashers, keyed with the secret when there is one (a tenant's: with a key derived
    from the secret and its tag), copied for every hash: a copy skips BLAKE2b's parameter setup, a
    good part of the cost of hashing one small block."""
    key = hash_key(secret) if secret is not None else b""
    if key and tag:
        key = hashlib.blake2b(tag, digest_size=32, key=key, person=_TENANT_KEY_PERSON).digest()
    return (
        hashlib.blake2b(digest_size=KEY_BYTES, key=key, person=_ROOT_PERSON),
        hashlib.blake2b(digest_size=KEY_BYTES, key=key, person=_LINK_PERSON),
    )


def _token_bytes(token_ids: Sequence[int] | np.ndarray) -> tuple[bytes, int]:
    """The tokens as little-endian int64 bytes, converted once for the whole prompt, and their count.

    Token ids outside int64 are refused: a uint64 2**64-1 would wrap to -1 and hash like token -1,
    a collision anyone could build. Bools and floats are not token ids either.
    """
    tokens = np.asarray(token_ids)
    if tokens.ndim != 1:
        raise ValueError(f"token_ids must be a flat sequence of ints, got an array of shape {tokens.shape}")
    if tokens.size and (
        not np.issubdtype(tokens.dtype, np.integer) or tokens.dtype == np.uint64 and tokens.max() > _INT64_MAX
    ):
        _refuse(tokens if isinstance(token_ids, np.ndarray) else token_ids)
    return tokens.astype("<i8", copy=False).tobytes(), tokens.size


def _refuse(token_ids: Sequence[int] | np.ndarray) -> None:
    """Raise for the first token id that is not an integer within int64, naming it and its index
    (numpy turns a list mixing such ids into floats or objects, so the dtype alone would mislead)."""
    for i, token in enumerate(token_ids):
        if isinstance(token, (bool, np.bool_)) or not isinstance(token, (int, np.integer)):
            raise TypeError(f"token_ids must be integers, got {token!r} ({type(token).__name__}) at index {i}")
        if not -_INT64_MAX - 1 <= int(token) <= _INT64_MAX:
            raise ValueError(
                f"token id {int(token)} at index {i} is outside int64; token ids must fit in a signed 64-bit integer"
            )
    raise TypeError(f"token_ids must be integers within int64, got dtype {np.asarray(token_ids).dtype}")


def chain_hashes(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    namespace: bytes | str = b"",
    parent: bytes | None = None,
    secret: bytes | None = None,
    tag: bytes = b"",
) -> list[bytes]:
    """One 16-byte key per full block of ``block_size`` tokens; a trailing partial block gets none.

    ``key_i = BLAKE2b-128[link](key_{i-1} + tokens of block i as little-endian int64)`` and
    ``key_{-1} = BLAKE2b-128[root](block_size as 8 bytes + len(namespace) as 8 bytes + namespace)``,
    where [root] and [link] are distinct BLAKE2b personalisations. The fixed-width fields make the
    root unambiguous: no two (block size, namespace) pairs feed it the same bytes. Partial blocks are skipped
    because their KV is still being written by the engine and would change once the block fills.

    ``secret`` keys every hash of the chain (``hash_key`` derives the BLAKE2b key from it): the same
    tokens under another secret give unrelated keys, and without the secret no key can be computed.

    ``parent`` continues an existing chain: the key of the block just before ``token_ids`` (the
    namespace is then already folded in; the secret must be the same). An engine whose sequences
    grow block by block hashes only the new blocks:
    ``keys + chain_hashes(new_tokens, block_size, parent=keys[-1])`` equals the keys of the whole sequence.

    ``tag`` (``tenant_tag``) makes them a tenant's keys: each begins with the tag, and with a secret
    the chain is keyed with the tenant's own key. ``parent`` is then one of that tenant's keys.
    """
    if tag and len(tag) != TENANT_TAG_BYTES:
        raise ValueError(f"tag must be a {TENANT_TAG_BYTES}-byte tenant tag (tenant_tag), got {len(tag)} bytes")
    if parent is not None:
        if not isinstance(parent, bytes) or len(parent) != len(tag) + KEY_BYTES or not parent.startswith(tag):
            raise ValueError(f"parent must be a {len(tag) + KEY_BYTES}-byte key of the same tenant, got {parent!r:.40}")
        parent = parent[len(tag) :]
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size <= 0:
        raise ValueError(f"block_size must be a positive integer (tokens per block), got {block_size!r}")
    if secret is not None and (not isinstance(secret, bytes) or not secret):
        raise ValueError("secret must be non-empty bytes (or None for unkeyed keys)")
    block_size = int(block_size)
    data, n_tokens = _token_bytes(token_ids)
    root, link = _hashers(secret, tag)
    if parent is None:
        ns = _namespace_bytes(namespace)
        h = root.copy()
        h.update(struct.pack("<QQ", block_size, len(ns)) + ns)
        parent = h.digest()
    stride = block_size * 8
    keys: list[bytes] = []
    for i in range(n_tokens // block_size):
        h = link.copy()
        h.update(parent)
        h.update(data[i * stride : (i + 1) * stride])
        parent = h.digest()
        keys.append(tag + parent)
    return keys


def fold_keys(engine_keys: Sequence[str | bytes], namespace: bytes | str, secret: bytes | None = None) -> list[bytes]:
    """kvtier keys for keys an engine made itself (SGLang's page hashes, vLLM's offload keys): one 16-byte
    key per engine key, ``BLAKE2b-128[fold](root + len(key) as 8 bytes + key)`` with ``root`` the
    chain root of ``namespace`` (``chain_hashes``'s, block size 0: no chain of tokens has it).

    An engine key names a prefix but not the model, rank or layout that decide its bytes; folding it
    under the namespace gives another key wherever those differ. Keyed with ``secret`` (as the chain
    is), nobody without the secret can compute a key, so an engine's plain, guessable hash (SGLang's
    SHA-256 of token ids) never becomes a store's record name. Str keys are UTF-8 encoded: ``"k"``
    and ``b"k"`` fold alike. A caller folding keys of one namespace again and again keeps a
    ``KeyFolder`` instead (the namespace's root is then hashed once).
    """
    return KeyFolder(namespace, secret)(engine_keys)


class KeyFolder:
    """``fold_keys`` for one namespace and secret, the root hashed once: folding then costs one BLAKE2b
    of the engine key (about 0.4 us), which matters where an engine asks key by key (vLLM's lookups)."""

    def __init__(self, namespace: bytes | str, secret: bytes | None = None) -> None:
        if secret is not None and (not isinstance(secret, bytes) or not secret):
            raise ValueError("secret must be non-empty bytes (or None for unkeyed keys)")
        root_hasher, _ = _hashers(secret)
        ns = _namespace_bytes(namespace)
        root = root_hasher.copy()
        root.update(struct.pack("<QQ", 0, len(ns)) + ns)
        self._fold = hashlib.blake2b(
            digest_size=KEY_BYTES, key=hash_key(secret) if secret is not None else b"", person=_FOLD_PERSON
        )
        self._fold.update(root.digest())

    def __call__(self, engine_keys: Sequence[str | bytes]) -> list[bytes]:
        keys = []
        for engine_key in engine_keys:
            if isinstance(engine_key, str):
                raw = engine_key.encode("utf-8")
            elif isinstance(engine_key, bytes):
                raw = engine_key
            else:
                raise TypeError(f"an engine key must be str or bytes, got {type(engine_key).__name__}")
            h = self._fold.copy()
            h.update(len(raw).to_bytes(8, "little") + raw)
            keys.append(h.digest())
        return keys


def key_secret(env_name: str | None, setting: str = "key_secret_env") -> bytes | None:
    """The secret in the environment variable ``env_name`` (the config's ``setting`` names it: the key
    secret's ``key_secret_env``, a remote tier's ``auth_key_env``), or None when no variable is named.

    A named variable that is unset, empty or shorter than 16 bytes is a ConfigError rather than a
    silent fall-back to unkeyed keys (or unauthenticated records). Keys depend on the secret: a secret
    that changes between restarts leaves every block on disk unreachable (they are never served under
    the new keys).
    """
    if env_name is None:
        return None
    value = os.environb.get(os.fsencode(env_name), b"")
    if not value:
        raise ConfigError(
            f"{setting}: the environment variable {env_name} is unset or empty; set it to a secret "
            f"of at least {MIN_SECRET_BYTES} bytes (e.g. the output of `openssl rand -hex 32`), the "
            f"same in every process that shares the cache, or remove {setting}"
        )
    if len(value) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"{setting}: the environment variable {env_name} holds {len(value)} bytes, fewer "
            f"than the {MIN_SECRET_BYTES} a secret needs; set it to a longer random value "
            f"(e.g. the output of `openssl rand -hex 32`)"
        )
    return value


def check_key(key: object) -> bytes:
    """Refuse what cannot be a block key: not ``bytes``, empty, or longer than MAX_KEY_BYTES (a disk
    slot header keeps at most that many; a longer key would be stored and then never found). Returns
    the key, now known to be one."""
    if not isinstance(key, bytes):
        raise TypeError(f"a block key must be bytes, got {type(key).__name__}")
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(
            f"a block key must be 1 to {MAX_KEY_BYTES} bytes, got {len(key)} bytes "
            f"(key {key[:16].hex()}...); hash longer identifiers down to {KEY_BYTES} bytes"
        )
    return key


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


__all__ = [
    "KEY_BYTES",
    "MAX_KEY_BYTES",
    "TENANT_KEY_BYTES",
    "TENANT_TAG_BYTES",
    "KeyFolder",
    "Namespace",
    "chain_hashes",
    "check_key",
    "fold_keys",
    "hash_key",
    "key_secret",
    "tenant_of",
    "tenant_tag",
]
