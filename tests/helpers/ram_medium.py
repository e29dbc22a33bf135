"""A medium kvtier does not ship, registered by the tests: ``ram``, blocks in a plain numpy array of this
process (neither pinned nor shared). It is what a new medium takes: a config model, a standalone tier
factory, a per-rank storage factory and one ``Medium`` entry, here with a ``kvtier doctor`` check of its
own; ``registered`` adds it for a test and removes it afterwards. Nothing in kvtier names it. The worked
example of docs/extending.md: its tiers pass kvtier's tier contract (``TestRamMedium`` in
tests/contracts/test_tier.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Literal

import numpy as np

from kvtier.core.checks import Check, DoctorRequest
from kvtier.core.layout import BlockLayout
from kvtier.core.media import Medium, RankRequest, TierRequest, register_medium, unregister_medium
from kvtier.core.storage import BlockStorage, buffer_storage
from kvtier.core.tier import Tier
from kvtier.core.tier_config import SizedTierConfig
from kvtier.policies import EvictionPolicy, Watermark


class RamTierConfig(SizedTierConfig):
    """Process memory, sized like any tier kvtier allocates (``capacity`` or ``capacity_blocks``)."""

    medium: Literal["ram"]


def ram_storage(slots: int, layout: BlockLayout) -> BlockStorage:
    """``slots`` blocks in one zeroed array, addressed as a caller's buffer is (``buffer_storage``)."""
    return buffer_storage(np.zeros((slots, layout.block_bytes), np.uint8), layout, writable=True)


def ram_tier(
    name: str,
    num_slots: int,
    layout: BlockLayout,
    policy: EvictionPolicy[bytes],
    watermark: Watermark | None = None,
    is_fenced: Callable[[str, int], bool] | None = None,
) -> Tier:
    """A tier of ``num_slots`` blocks in this process's memory (what ``host_tier`` is to the host medium)."""
    return Tier(
        name, "ram", ram_storage(num_slots, layout), policy, watermark, is_fenced, "a numpy array (a test medium)"
    )


def _tier(request: TierRequest) -> Tier:
    policy, watermark = request.policy()
    return ram_tier(request.name, request.slots, request.layout, policy, watermark, request.is_fenced)


def _rank_storage(request: RankRequest) -> BlockStorage:
    return ram_storage(request.slots, request.layout)


def _doctor(request: DoctorRequest) -> list[Check]:
    """What the arrays take: one per rank under an engine."""
    name, size = f"{request.label} arrays", request.tier_bytes()
    if size is None:
        return [Check(name, True, "not checked: capacity_blocks without block_bytes")]
    need = size * (request.engine_ranks or 1)
    return [Check(name, True, f"numpy arrays of {need} bytes in all", {"need_bytes": need})]


RAM = Medium("ram", RamTierConfig, _tier, _rank_storage, event_medium="RAM", doctor=_doctor)


@contextlib.contextmanager
def registered() -> Iterator[Medium]:
    register_medium(RAM)
    try:
        yield RAM
    finally:
        unregister_medium(RAM.name)
