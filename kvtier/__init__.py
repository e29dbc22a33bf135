"""kvtier: a tiered KV-cache block store for LLM inference (GPU -> host memory -> disk behind one block interface).

The public API: ``KVTier`` for engines that call kvtier directly, ``TierStack`` and friends for
building stacks by hand, ``load_config`` for the YAML schema, ``chain_hashes`` for block keys.
"""

from kvtier.api import KVTier
from kvtier.builder import build_stack
from kvtier.core.config import StackConfig, load_config
from kvtier.core.errors import (
    ArgumentError,
    CapacityError,
    ClosedError,
    ConfigError,
    DoubleFreeError,
    FenceError,
    KvtierError,
    StateError,
    StoreError,
    TransferError,
)
from kvtier.core.keys import Namespace, chain_hashes
from kvtier.core.layout import BlockLayout
from kvtier.core.stack import LoadResult, StackLookup, StoreResult, TierStack

__all__ = [
    "ArgumentError",
    "BlockLayout",
    "CapacityError",
    "ClosedError",
    "ConfigError",
    "DoubleFreeError",
    "FenceError",
    "KVTier",
    "KvtierError",
    "LoadResult",
    "Namespace",
    "StackConfig",
    "StackLookup",
    "StateError",
    "StoreError",
    "StoreResult",
    "TierStack",
    "TransferError",
    "build_stack",
    "chain_hashes",
    "load_config",
]
