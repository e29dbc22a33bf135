"""The ``Tier`` contract (``kvtier.testing.tier``, whose docstring lists what it checks), run over every kind of
tier: host memory, a GPU tier on CPU tensors, a disk tier's slab file (``TierTests``, tiers with slots);
and, for the block life they share, the tiers addressed by key, whose index is their owner's answers: a
shared store's, a node daemon's (``KeyedTierTests``, asking no store or daemon). Also over the medium the
tests register (tests/helpers/ram_medium.py), as a medium of another package would run it
(docs/extending.md).

To add a kind of tier: add a ``TierKind`` to ``LOCAL_TIERS`` (a tier with slots; give it ``slots`` to read
and write its slots' bytes when they are not in this process's memory) or to ``KEYED_TIERS`` (addressed by
key); every test of the suite then runs over it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from helpers.ram_medium import ram_tier
from kvtier.core.storage import BlockStorage
from kvtier.core.tier import Tier
from kvtier.testing.tier import KeyedTierTests, TierKind, TierSpec, TierTests
from kvtier.tiers.disk.config import DiskTierConfig
from kvtier.tiers.disk.slab import FileStorage
from kvtier.tiers.disk.tier import disk_tier
from kvtier.tiers.gpu import gpu_tier
from kvtier.tiers.host import host_tier
from kvtier.tiers.node.client import NodeClient
from kvtier.tiers.node.tier import NodeStorage, NodeTier
from kvtier.tiers.remote.link import Connector, StoreLink
from kvtier.tiers.remote.record import RecordFormat, namespace_digest
from kvtier.tiers.remote.tier import RemoteTier


class FileSlots:
    """A slot's bytes in a slab file: its "address" is the file offset of the block's bytes."""

    @staticmethod
    def write(storage: BlockStorage, slot: int, data: np.ndarray) -> None:
        assert isinstance(storage, FileStorage)
        offset = int(storage.fragment_addresses([slot])[0, 0])
        assert os.pwrite(storage.slab.open_fd, data.tobytes(), offset) == data.nbytes

    @staticmethod
    def read(storage: BlockStorage, slot: int) -> np.ndarray:
        assert isinstance(storage, FileStorage)
        offset = int(storage.fragment_addresses([slot])[0, 0])
        return np.frombuffer(os.pread(storage.slab.open_fd, storage.layout.block_bytes, offset), np.uint8).copy()


def _disk(spec: TierSpec) -> Tier:
    config = DiskTierConfig.model_validate(
        {"medium": "disk", "path": str(spec.directory), "capacity_blocks": spec.capacity}
    )
    return disk_tier(
        spec.name,
        spec.capacity,
        spec.layout,
        spec.policy,
        spec.watermark,
        spec.is_fenced,
        config=config,
        namespace="contract",
    )


def _memory(factory):
    """A tier kvtier allocates in memory: ``factory(name, capacity, layout, policy, watermark, is_fenced)``."""
    return lambda spec: factory(spec.name, spec.capacity, spec.layout, spec.policy, spec.watermark, spec.is_fenced)


LOCAL_TIERS = {
    "host": TierKind("host", _memory(host_tier), machine_examples=150),  # (the runs it always had)
    "gpu": TierKind("gpu", _memory(gpu_tier)),
    "disk": TierKind("disk", _disk, slots=FileSlots),
}
"""Tiers with slots. The state machine runs the host tier 150 times, the others 50: they share Tier's logic
and differ in where the bytes live, which fewer runs exercise."""


def _no_store():
    raise AssertionError("the tier asked its store: this suite tests only what a tier decides by itself")


def _remote(spec: TierSpec) -> Tier:
    records = RecordFormat("contract", namespace_digest("contract", spec.layout), spec.layout.block_bytes)
    return RemoteTier(spec.name, spec.layout, [records], StoreLink(Connector(_no_store, 1, "no store"), 1.0, "lookups"))


def _node(spec: TierSpec) -> Tier:
    client = NodeClient("/nonexistent/node.sock", 1.0)  # (never connected: the suite asks no daemon)
    return NodeTier(spec.name, NodeStorage(spec.layout, client, namespace_digest("contract", spec.layout)))


KEYED_TIERS = {"remote": TierKind("remote", _remote), "node": TierKind("node", _node)}
"""Tiers addressed by key alone."""


class TestTiersWithSlots(TierTests):
    @pytest.fixture(params=sorted(LOCAL_TIERS))
    def tier_kind(self, request) -> TierKind:
        return LOCAL_TIERS[request.param]


class TestTiersByKey(KeyedTierTests):
    @pytest.fixture(params=sorted(KEYED_TIERS))
    def tier_kind(self, request) -> TierKind:
        return KEYED_TIERS[request.param]


class TestRamMedium(TierTests):
    """The subclass docs/extending.md shows for a medium of one's own."""

    @pytest.fixture
    def tier_kind(self) -> TierKind:
        return TierKind("ram", lambda s: ram_tier(s.name, s.capacity, s.layout, s.policy, s.watermark, s.is_fenced))
