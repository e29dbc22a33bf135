"""What decides whether two engines share blocks, as ``kvtier doctor`` reports it: the namespace digest,
the fields behind it, and the comparison of two reports ("these two share" or "they differ in: ...").

Two engines find each other's blocks only when they give equal tokens equal keys, and, through a shared
store, when they read the same records and accept them. Keys follow from the block size, the namespace
(under vLLM: the engine's model, weights, dtypes, layout, TP size and the config's ``namespace``) and the
key secret; records from the store's address, the remote tier's ``prefix`` and its MAC secret (the
fields a medium's registry entry reports, ``Medium.sharing``: ``kvtier.tiers.remote.doctor``). Any
difference is silent: every lookup of one engine misses the other's blocks. So the report names each
field, and its digest is the key kvtier itself gives one block of token id 0 under them
(``chain_hashes``, with the namespace an engine's request without LoRA or cache salt hashes under):
equal digests mean equal keys for every prompt.

Secrets appear only as fingerprints: 4 bytes of a BLAKE2b of the key kvtier derives from the secret,
enough to tell two secrets apart; the keys any tenant of a shared store sees are derived from the same
secret already.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.connectors.vllm.namespace import request_namespace, settings_namespace
from kvtier.core.config import StackConfig, load_config
from kvtier.core.errors import ConfigError
from kvtier.core.keys import chain_hashes, key_secret
from kvtier.core.media import medium
from kvtier.core.namespaces import (
    differences as differences,  # (kvtier doctor --compare's, kept in core)
    secret_fingerprint,
    stack_fields,
)
from kvtier.core.strict_yaml import read_yaml

_VLLM_DTYPES = {
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
}


def vllm_dtype(name: str) -> str:
    """A ``--dtype`` as vLLM's config holds it once resolved (``torch.bfloat16``), which is what enters its
    namespace. ``auto`` is refused: vLLM resolves it from the model's config by rules of its own."""
    name = name.removeprefix("torch.")
    if name not in _VLLM_DTYPES:
        raise ValueError(
            f"{name!r} is not a dtype kvtier doctor knows; give the one the engine runs with "
            f"({', '.join(_VLLM_DTYPES)}), not auto"
        )
    return f"torch.{_VLLM_DTYPES[name]}"


@dataclass(frozen=True)
class VllmEngine:
    """A vLLM engine's settings that enter its blocks' namespace, as ``kvtier doctor``'s command line names
    them (``engine_namespace`` reads the same from vLLM's config). ``layout`` is the KV cache layout vLLM
    resolves from its attention backend (``LBHNC``, ...); ``revision`` the commit a Hub model resolved to."""

    model: str
    dtype: str
    layout: str
    block_size: int = 16
    tp: int = 1
    cache_dtype: str = "auto"
    revision: str | None = None
    quantization: str | None = None

    def namespace(self, config: StackConfig) -> bytes:
        """The engine's namespace under ``config`` (reads a local model folder for its weights' fingerprint)."""
        return settings_namespace(
            {
                "model": self.model,
                "revision": self.revision,
                "quantization": self.quantization,
                "dtype": vllm_dtype(self.dtype),
                "cache_dtype": self.cache_dtype,
                "layout": self.layout,
                "tp": self.tp,
                "block_size": self.block_size,
                "namespace": config.namespace,
            }
        )


def sharing(config: StackConfig, engine: VllmEngine | None = None) -> dict[str, Any]:
    """``{"digest": ..., "fields": {...}}``: what decides which engines share blocks with a stack of
    ``config`` (under ``engine``, or standalone: ``kvtier.api``). The digest is None when the key secret
    cannot be read (the ``key secret`` check says why)."""
    if engine is None:
        fields = stack_fields(config.block_tokens, config.namespace)
        chain_namespace = config.namespace.encode()
    else:
        engine_namespace = engine.namespace(config)
        fields = json.loads(engine_namespace)
        chain_namespace = request_namespace(engine_namespace)
    try:
        secret = key_secret(config.key_secret_env)
    except ConfigError:
        secret, fields["key_secret"], digest = None, "unreadable", None
    else:
        fields["key_secret"] = secret_fingerprint(secret)
        digest = chain_hashes([0] * fields["block_size"], fields["block_size"], chain_namespace, secret=secret)[0].hex()
    for tier in config.tiers:
        fields_of = medium(tier.medium).sharing
        if fields_of is not None:
            fields.update(fields_of(tier))
    return {"digest": digest, "fields": fields}


def recorded_report(path: str) -> dict[str, Any] | None:
    """The report in ``path`` when it holds a ``kvtier doctor --json`` output (JSON is YAML), else None: a
    config, or a file that cannot be read (loading it as a config then says why)."""
    try:
        data = read_yaml(Path(path), path)
    except ConfigError:
        return None
    return data if isinstance(data, dict) and {"checks", "sharing"} <= data.keys() else None


def other_sharing(path: str, engine: VllmEngine | None) -> dict[str, Any]:
    """The sharing report to compare with: from a ``kvtier doctor --json`` output in ``path`` (another
    machine's, say) as it was recorded, or from a config file, under the same ``engine``. Raises
    ConfigError when neither gives one."""
    recorded = recorded_report(path)
    if recorded is None:
        return sharing(load_config(path), engine)
    shared = recorded["sharing"]
    if not isinstance(shared, dict) or not isinstance(shared.get("fields"), dict) or "digest" not in shared:
        raise ConfigError(f"{path}: a kvtier doctor report without a namespace (its config did not load)")
    return shared


def verdict(differ: list[str]) -> str:
    """The comparison in words."""
    return "these two share" if not differ else "they differ in: " + "; ".join(differ)
