"""kvtier's two vocabularies in one place: media (where a tier keeps blocks) and devices (what a copy
reads and writes).

A medium is what configuration, routes and eviction speak of: ``gpu``, ``host``, ``disk``, ``remote``.
A device is a storage's own, what a transfer backend serves: ``cuda`` memory, ``cpu`` memory, a
``file``, or a store whose records are named by key (``remote``). They differ where it matters: a GPU
tier on CPU tensors (a machine without CUDA) is a ``gpu`` medium on a ``cpu`` device, and its copies
are memmoves; an engine's own blocks have a device but no tier, and count as the medium
``caller_medium`` says when a route is planned to them.
"""

from __future__ import annotations

MEDIA = ("gpu", "host", "disk", "remote")
"""Every tier medium, fastest first."""

CUDA_DEVICE = "cuda"
HOST_DEVICE = "cpu"
FILE_DEVICE = "file"
KEYED_DEVICE = "remote"
"""The device of a store addressed by key: its storage has no addresses, a copy names keys."""


def caller_medium(device: str) -> str:
    """The medium a caller's blocks on ``device`` count as: GPU memory on CUDA, host memory otherwise."""
    return "gpu" if device == CUDA_DEVICE else "host"
