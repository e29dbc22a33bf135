"""Eviction and placement strategies, and the lookup of a policy by short name or dotted path."""

from __future__ import annotations

import importlib

from kvtier.policies.adaptive import AdaptivePolicy
from kvtier.policies.arc import ARCPolicy
from kvtier.policies.base import EvictionPolicy, PolicyError
from kvtier.policies.lru import LRUPolicy
from kvtier.policies.s3fifo import S3FIFOPolicy
from kvtier.policies.s3fifo_prefix import PrefixS3FIFOPolicy
from kvtier.policies.watermark import Watermark

# Short names usable in YAML. Every class here builds with no arguments (ARC and S3-FIFO then learn
# the tier's size from the number of blocks they track, see their modules).
EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy,
    "arc": ARCPolicy,
    "s3fifo": S3FIFOPolicy,
    "s3fifo_prefix": PrefixS3FIFOPolicy,
    "adaptive": AdaptivePolicy,
}


def check_policy_name(name: str) -> None:
    """Raise PolicyError unless ``name`` is a registered short name or has the shape of a dotted path
    (``pkg.module.Class`` or ``pkg.module:Class``). Imports nothing, so a config is validated in full
    before any code it names runs."""
    parts = name.replace(":", ".", 1).split(".")
    if name not in EVICTION_POLICIES and not (len(parts) > 1 and all(part.isidentifier() for part in parts)):
        raise PolicyError(
            f"unknown eviction policy {name!r}; use one of {sorted(EVICTION_POLICIES)} "
            f"or a dotted path such as mypkg.policies.MyPolicy"
        )


def eviction_policy_class(name: str) -> type[EvictionPolicy]:
    """The class for a short name (``lru``) or a dotted path to a user's class (``pkg.module.Class``),
    importing the user's module: that runs its code, so a dotted path is as trusted as code. Raises
    PolicyError naming what is wrong with ``name``."""
    if name in EVICTION_POLICIES:
        return EVICTION_POLICIES[name]
    check_policy_name(name)
    module_name, _, class_name = name.replace(":", ".", 1).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except Exception as exc:  # a user's module may fail on import in any way; the name is still unusable
        raise PolicyError(f"eviction policy {name!r} cannot be loaded: {type(exc).__name__}: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, EvictionPolicy)):
        raise PolicyError(f"eviction policy {name!r} is not a subclass of kvtier.policies.base.EvictionPolicy")
    return cls


__all__ = [
    "ARCPolicy",
    "AdaptivePolicy",
    "EVICTION_POLICIES",
    "EvictionPolicy",
    "LRUPolicy",
    "PolicyError",
    "PrefixS3FIFOPolicy",
    "S3FIFOPolicy",
    "Watermark",
    "check_policy_name",
    "eviction_policy_class",
]
