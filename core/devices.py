"""The names every part of kvtier shares about where blocks are: the devices storages are on, the two
media every route knows, and what the machine can do. A leaf: it imports nothing of kvtier, so the
registry (``kvtier.core.media``, whose entries name the schema, the storage and the tier types) and
everything those types are built from can all use these names without an import circle.

A device is a storage's own, what a transfer backend serves: ``cuda`` memory, ``cpu`` memory, a
``file``, or a store whose records are named by key (``remote``). A medium is what configuration,
routes, eviction and an engine's counters speak of, each one registry entry. They differ where it
matters: a GPU tier on CPU tensors (a machine without CUDA) is a ``gpu`` medium on a ``cpu`` device,
and its copies are memmoves; an engine's own blocks have a device but no tier, and count as the medium
``caller_medium`` says when a route is planned to them.
"""

from __future__ import annotations

from dataclasses import dataclass

HOST = "host"
"""The medium every other reaches directly: routes stage through it, and engines' loads land via it."""

GPU = "gpu"
"""The medium of an engine's own KV blocks (GPU memory): where its loads end and its stores begin. A
stack's gpu tier is those blocks, held by kvtier itself."""

CUDA_DEVICE = "cuda"
HOST_DEVICE = "cpu"
FILE_DEVICE = "file"
KEYED_DEVICE = "remote"
"""The device of a store addressed by key: its storage has no addresses, a copy names keys."""


@dataclass(frozen=True)
class Capabilities:
    """What the machine can do beyond the basics."""

    gpu_direct_storage: bool = False  # disk <-> GPU without a host bounce (NVIDIA GDS)
    gpu_in_host_memory: bool = False  # the engine's own KV blocks ("gpu") are host memory: an engine built for CPU


BASIC = Capabilities()
"""A machine with none of them."""


def caller_medium(device: str) -> str:
    """The medium a caller's blocks on ``device`` count as: GPU memory on CUDA, host memory otherwise."""
    return GPU if device == CUDA_DEVICE else HOST
