"""A medium kvtier does not ship, registered by the tests: ``ram``, blocks in plain numpy arrays of this
process (neither pinned nor shared). It is what a new medium takes: a config model, a standalone tier
factory, a per-rank storage factory and one ``Medium`` entry; ``registered`` adds it for a test and
removes it afterwards. Nothing in kvtier names it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

import numpy as np

from kvtier.core.config import SizedTierConfig
from kvtier.core.layout import BlockLayout
from kvtier.core.media import HOST_DEVICE, Medium, RankRequest, TierRequest, register_medium, unregister_medium
from kvtier.core.storage import StridedStorage
from kvtier.core.tier import Tier


class RamTierConfig(SizedTierConfig):
    """Process memory, sized like any tier kvtier allocates (``capacity`` or ``capacity_blocks``)."""

    medium: Literal["ram"]


def ram_storage(slots: int, layout: BlockLayout) -> StridedStorage:
    """``slots`` blocks in one zeroed array per fragment."""
    arrays = [np.zeros((slots, nbytes), np.uint8) for nbytes in layout.fragment_bytes]
    bases = [a.ctypes.data for a in arrays]
    return StridedStorage(layout, slots, bases, list(layout.fragment_bytes), HOST_DEVICE, arrays)


def _tier(request: TierRequest) -> Tier:
    policy, watermark = request.policy()
    storage = ram_storage(request.slots, request.layout)
    return Tier(request.name, "ram", storage, policy, watermark, request.is_fenced, "numpy arrays (a test medium)")


def _rank_storage(request: RankRequest) -> StridedStorage:
    return ram_storage(request.slots, request.layout)


RAM = Medium("ram", RamTierConfig, _tier, _rank_storage, event_medium="RAM")


@contextlib.contextmanager
def registered() -> Iterator[Medium]:
    register_medium(RAM)
    try:
        yield RAM
    finally:
        unregister_medium(RAM.name)
