"""vLLM's offloading events for one of kvtier's secondary tiers, both ways: a chunk is announced stored when
it enters the tier's stack (any tier of it) and removed when it leaves the last tier of the stack that
held it (evicted, dropped as unreadable, gone from a shared store as far as this engine can tell).

They come from the stack's tiers' own changes (``core/events.py``), in the order those happened, so a
subscriber's view ends as the stack is. vLLM names a chunk by its ``OffloadKey``, which kvtier folds into
its own key one way: the key of every chunk vLLM asks the tier to store is remembered until the chunk
leaves the stack. A chunk taken back from disk at start has no vLLM key here and is never announced
(its removal neither); nor is what changed while nobody took the events for so long that kvtier forgot
it (logged, counted as ``lost``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent, OffloadKey

from kvtier.core.events import BlockEvents
from kvtier.core.stack import TierStack

log = logging.getLogger(__name__)


class ChunkEvents:
    """The events of a stack's chunks, as ``medium`` and ``locality`` (the secondary tier's)."""

    def __init__(self, stack: TierStack, medium: Medium, locality: Locality) -> None:
        self.medium = medium
        self.locality = locality
        self.lost = 0
        self._changes = BlockEvents()
        self._changes.watch(stack.tiers)
        self._lock = threading.Lock()
        self._vllm_keys: dict[bytes, OffloadKey] = {}  # kvtier key -> vLLM's, for chunks asked to be stored
        self._held: dict[bytes, int] = {}  # kvtier key -> how many tiers of the stack hold it

    def storing(self, kv_keys: Sequence[bytes], keys: Sequence[OffloadKey]) -> None:
        """vLLM asks for these chunks to be stored (before the store runs)."""
        with self._lock:
            self._vllm_keys.update(zip(kv_keys, keys, strict=True))

    def not_stored(self, kv_keys: Sequence[bytes]) -> None:
        """A store ended without these chunks in the stack (dropped, failed): their vLLM keys are let go."""
        with self._lock:
            for key in kv_keys:
                if key not in self._held:
                    self._vllm_keys.pop(key, None)

    def take(self) -> list[OffloadingEvent]:
        """What entered and left the stack since the last call, as runs of stored and removed chunks."""
        batch = self._changes.take()
        if batch.lost:
            self.lost += batch.lost
            log.warning("kvtier secondary tier: %d chunk changes were never announced (events not taken)", batch.lost)
        turns: list[tuple[bool, OffloadKey]] = []  # (removed, key), in the order they happened
        with self._lock:
            for run in batch.runs:
                for key in run.keys:
                    turn = self._count(key, 1 if run.stored else -1)
                    if turn is not None:
                        turns.append(turn)
        events: list[OffloadingEvent] = []
        for removed, key in turns:
            if events and events[-1].removed == removed:
                events[-1].keys.append(key)
            else:
                events.append(OffloadingEvent(keys=[key], medium=self.medium, removed=removed, locality=self.locality))
        return events

    def _count(self, key: bytes, change: int) -> tuple[bool, OffloadKey] | None:
        """Count a tier taking or dropping ``key``; the turn to announce when it entered or left the stack."""
        held = self._held.get(key, 0)
        if held + change < 0 or key not in self._vllm_keys:  # (restored at start, or stored before it was asked)
            return None
        if held + change == 0:
            del self._held[key]
            return True, self._vllm_keys.pop(key)
        self._held[key] = held + change
        return (False, self._vllm_keys[key]) if held == 0 else None
