"""Eviction and placement strategies, and the lookup of a policy by short name or dotted path."""

from __future__ import annotations

import importlib

from kvtier.core.errors import ConfigError
from kvtier.policies.arc import ARCPolicy
from kvtier.policies.base import EvictionPolicy
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
}


def eviction_policy_class(name: str) -> type[EvictionPolicy]:
    """The class for a short name (``lru``) or a dotted path to a user's class (``pkg.module.Class``)."""
    if name in EVICTION_POLICIES:
        return EVICTION_POLICIES[name]
    module_name, _, class_name = name.replace(":", ".").rpartition(".")
    if not module_name:
        raise ConfigError(f"unknown eviction policy {name!r}; use one of {sorted(EVICTION_POLICIES)} "
                          f"or a dotted path such as mypkg.policies.MyPolicy")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"eviction policy {name!r} cannot be loaded: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, EvictionPolicy)):
        raise ConfigError(f"eviction policy {name!r} is not a subclass of kvtier.policies.base.EvictionPolicy")
    return cls


__all__ = ["ARCPolicy", "EVICTION_POLICIES", "EvictionPolicy", "LRUPolicy", "PrefixS3FIFOPolicy", "S3FIFOPolicy",
           "Watermark", "eviction_policy_class"]
