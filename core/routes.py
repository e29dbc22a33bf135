"""Route planning: which media a block passes through on its way from one tier to another.

A pure function of (source medium, destination medium, capabilities), so every route is unit
tested without a device. Host memory reaches every medium directly; GPU memory and disk reach each
other only through host memory unless GPUDirect Storage is available; a remote store is reached
through host memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.core.media import MEDIA


@dataclass(frozen=True)
class Capabilities:
    """What the machine can do beyond the basics."""

    gpu_direct_storage: bool = False  # disk <-> GPU without a host bounce (NVIDIA GDS)


def plan_route(src: str, dst: str, caps: Capabilities = Capabilities()) -> tuple[str, ...]:
    """The media a block passes through, ``src`` and ``dst`` included: ``("disk", "host", "gpu")``.

    Raises ValueError for an unknown medium.
    """
    for medium in (src, dst):
        if medium not in MEDIA:
            raise ValueError(f"unknown medium {medium!r}; known: {', '.join(MEDIA)}")
    if src == dst or "host" in (src, dst):
        return (src, dst)
    if {src, dst} == {"gpu", "disk"} and caps.gpu_direct_storage:
        return (src, dst)
    return (src, "host", dst)
