"""Disk blocks kept across a restart under vLLM, put back into the scheduler side's index.

Which blocks a tier kept across the restart is its medium's to say (``Medium.kept_blocks``: a disk
tier's, ``kvtier.tiers.disk.ranks.RankSlabs``, from the index its last clean shutdown left or else from
every rank's slot headers). They go back into the tier's index in the background (``ChunksBack``, a
``ChunkedRestore`` that reports each chunk it put back, for the KV events): the scheduler side serves
at once, a block not back yet being a miss that vLLM recomputes.
"""

from __future__ import annotations

import itertools
import queue
from collections.abc import Sequence

import numpy as np

from kvtier.core.restore import ChunkedRestore
from kvtier.core.tier import Tier


class ChunksBack(ChunkedRestore):
    """A disk tier's blocks put back in the background (``ChunkedRestore``), each chunk reported once it
    is in, for the scheduler side's KV events (``events.KVEvents.take``, on vLLM's thread, which
    alone stores and drops blocks): the restore's thread puts ``(first, went_in)`` into ``back`` in the
    same step under the tier's lock as the chunk goes in, ``first`` the index of its first block in
    ``keys`` and ``went_in`` which of its blocks went in (a key stored meanwhile keeps the stored block,
    whose store has its own event). vLLM's thread tells each drop of the tier (``dropped``), so that a
    block dropped after it went in is not announced after its BlockRemoved (``announce``)."""

    def __init__(self, tier: Tier, name: str) -> None:
        super().__init__(tier, name)
        self.tier = tier
        self.keys: Sequence[bytes] = []  # the blocks being put back, oldest first (a snapshot's lazy column)
        self.back: queue.SimpleQueue[tuple[int, np.ndarray]] = queue.SimpleQueue()
        self.left: dict[bytes, int] = {}  # (vLLM's thread only) key dropped -> ``passed`` when it was

    def start(self, keys: Sequence[bytes], slots: Sequence[int] | np.ndarray) -> None:
        self.keys = keys
        super().start(keys, slots)

    def _chunk_in(self, first: int, went_in: np.ndarray) -> None:
        self.back.put((first, went_in))

    def dropped(self, keys: Sequence[bytes]) -> None:
        """vLLM's thread, once the tier dropped ``keys`` and before it stores any of them again: note
        those whose restored block may be what left. ``passed`` is read first: a key the tier holds
        after that went in after its drop (its block is in the tier, to be announced); any other is
        noted with it, and a chunk counted in it went in before the drop (``announce`` leaves its
        block out). A chunk not counted goes in after the drop and is announced."""
        passed = self.passed
        for key in itertools.compress(keys, ~self.tier.holds(keys)):
            self.left[key] = passed

    def announce(self, first: int, went_in: np.ndarray) -> list[bytes]:
        """The keys to announce of a chunk reported in ``back``: those that went in, less those the tier
        dropped since (noted by ``dropped`` with a ``passed`` past ``first``: this chunk was in then)."""
        keys = itertools.compress(self.keys[first : first + len(went_in)], went_in)
        left = self.left
        return [key for key in keys if left.get(key, first) <= first] if left else list(keys)
