"""kvtier as SGLang's HiCache storage backend: ``kvtier.connectors.sglang.backend.KVTierStorage``, loaded by
SGLang's ``dynamic`` storage backend (docs/sglang.md). Only ``backend`` imports SGLang; the other
modules (settings, pages, namespace, metrics) import without it.
"""
