"""Route planning: which media a block passes through on its way from one tier to another.

A pure function of (source medium, destination medium, capabilities) and the media's registry entries,
so every route is unit tested without a device. Host memory reaches every medium directly; two other
media reach each other directly only where one's entry says so (GPU memory and disk, with GPUDirect
Storage); every other route stages through host memory.
"""

from __future__ import annotations

from kvtier.core.devices import BASIC, HOST, Capabilities
from kvtier.core.media import medium


def plan_route(src: str, dst: str, caps: Capabilities = BASIC) -> tuple[str, ...]:
    """The media a block passes through, ``src`` and ``dst`` included: ``("disk", "host", "gpu")``.

    Raises ValueError for an unknown medium.
    """
    ends = medium(src), medium(dst)
    if src == dst or HOST in (src, dst) or ends[0].direct(dst, caps) or ends[1].direct(src, caps):
        return (src, dst)
    return (src, HOST, dst)
