"""kvtier's adaptive eviction policy as a ``CachePolicy`` of vLLM's CPU offloading tier.

    "eviction_policy": "KVTierAdaptive", "cache_policy_module_path": "kvtier.connectors.vllm_tiering"

Why
    vLLM's CPU tier (``CPUOffloadingManager``, also the primary tier of ``TieringOffloadingSpec``)
    ships LRU and ARC. kvtier's ``AdaptivePolicy`` (``kvtier.policies.adaptive``) keeps a request's
    chain as a usable prefix (its head outlives its tail), protects blocks read while resident
    (segmented LRU), and turns a second-sight admission filter on only where a sampled duel of
    miniature caches says it pays (one-off prompts pushing out a working set). This class lets a
    vLLM deployment use it without kvtier's own tiers.

How vLLM's calls map onto the policy
    * A request's first access of a resident, ready block (``on_request_access``: the blocks it
      loads, or offers again for storing) is a read: ``AdaptivePolicy.touch``. ``touch`` (vLLM's
      manager forwards it, its connector no longer calls it) is a read as well.
    * A block about to be stored (``on_store_miss``, before vLLM makes room) is asked
      ``AdaptivePolicy.admit``; the verdict is kept in the request's context until ``insert``.
      So the adaptive policy sees what kvtier's tiers show it: a request's reads and asks in order,
      then its inserts, which it applies as one run (deepest block first).
    * vLLM has no admission step: every offered block is stored. A declined block is stored "on
      sufferance": in a FIFO outside the adaptive order that is evicted before anything else, so a
      burst of one-off blocks only displaces other one-off blocks. If one is read while resident
      it joins the adaptive order (``insert``). That read is not shown to the policy's duel: the
      duel's filtering miniature models a declined block as not stored, so it would score a miss
      where the real tier, which stored the block anyway, hits whether the filter is on or not
      (asking ``admit`` there measured 0-3% fewer hits, bench/vllm_tiering_policy.py's workloads).
    * Blocks read by a request that has not finished are kept out of ``evict``'s choice while
      anything else can go (LRU gives them the newest rank until then): the adaptive policy
      applies a request's reads at the end of its run, so without this a request's store could
      evict the very prefix it just loaded.
    * ``evict`` is all or nothing, as vLLM's contract asks: it counts the evictable blocks
      (``ref_cnt == 0``, kept as a set by ``insert``, ``mark_evictable`` and
      ``mark_non_evictable``) outside ``protected`` first and returns None, changing nothing, when
      there are fewer than ``n``. The adaptive policy is given a container that also holds every
      block that is pinned or not yet written.

What differs from kvtier's own tiers
    A kvtier tier does not store a declined block at all; here it occupies a chunk until the next
    eviction. A kvtier tier stops storing a request's blocks at the first declined one (the rest
    could not be prefix hits); vLLM stores all of them, so the later ones go on sufferance too.
    Blocks are inserted before they are written (``ref_cnt == -1``) and may be pinned by loads, so
    the policy skips them in ``evict`` instead of the tier leaving them untracked.

Only this module imports vLLM (the package's ``__init__`` loads it on first use).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus

from kvtier.policies.adaptive import AdaptivePolicy

__all__ = ["KVTierAdaptive"]


@dataclass(slots=True)
class _Request:
    """What the policy remembers of one request, in its ``ReqContext``: the verdicts of its store
    misses until they are inserted, and the blocks it read (kept from eviction until it finishes)."""

    owner: object
    generation: int
    verdicts: dict[OffloadKey, bool] = field(default_factory=dict)
    reads: list[OffloadKey] = field(default_factory=list)


class _Shield:
    """The keys the adaptive policy must not choose: vLLM's ``protected``, every block that is pinned or
    not yet written (not evictable), and, while ``reading`` is given, the blocks of unfinished requests."""

    __slots__ = ("_protected", "_evictable", "_reading")

    def __init__(
        self, protected: Collection[OffloadKey], evictable: set[OffloadKey], reading: Mapping[OffloadKey, int]
    ) -> None:
        self._protected = protected
        self._evictable = evictable
        self._reading = reading

    def __contains__(self, key: object) -> bool:
        return key in self._protected or key not in self._evictable or key in self._reading


class KVTierAdaptive(CachePolicy):
    """``kvtier.policies.adaptive.AdaptivePolicy`` behind vLLM's ``CachePolicy`` (see the module docstring)."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._generation = 0
        self._reset()

    def _reset(self) -> None:
        """Forget every chunk and everything learned (``clear``, and a new policy)."""
        self._chunks: dict[OffloadKey, ChunkStatus] = {}
        self._evictable: set[OffloadKey] = set()  # ref_cnt == 0
        self._sufferance: OrderedDict[OffloadKey, None] = OrderedDict()  # declined but stored; oldest first
        self._reading: dict[OffloadKey, int] = {}  # read by unfinished requests: how many
        self._policy: AdaptivePolicy[OffloadKey] = AdaptivePolicy(capacity=max(1, self.cache_capacity))

    # --- requests ---

    def _request(self, req_context: ReqContext) -> _Request:
        """This policy's state of the request, new if the request is new to it or the cache was cleared since."""
        state = req_context.get_state(_Request)
        if state is None or state.owner is not self or state.generation != self._generation:
            state = _Request(self, self._generation)
            req_context.set_state(state)
        return state

    def _read(self, key: OffloadKey) -> bool:
        """A read of ``key``; whether it was a resident, ready block (only those count)."""
        chunk = self._chunks.get(key)
        if chunk is None or not chunk.is_ready:
            return False  # not stored, or still being written: nothing was read
        if key in self._sufferance:
            del self._sufferance[key]
            self._policy.insert(key)  # read, so not a one-off: it joins (see the module docstring)
        else:
            self._policy.touch(key)
        return True

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        verdicts = self._request(req_context).verdicts
        admit = self._policy.admit
        for key in keys:
            verdicts[key] = admit(key)

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        reads = None
        reading = self._reading
        for key in keys:
            if self._read(key):
                if reads is None:
                    reads = self._request(req_context).reads
                reads.append(key)
                reading[key] = reading.get(key, 0) + 1

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """A use now, outside any request's run (vLLM's connector reads through ``on_request_access``): the
        policy applies it at once, so that the next ``evict`` already sees it. ``restore`` of nothing
        does just that: it ends the policy's current run, and restores no block."""
        for key in keys:
            self._read(key)
        self._policy.restore(())

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        """The reads were applied as they came (``on_request_access``); what is left is to let the request's
        blocks be evicted like any other and to drop the verdicts of blocks it never stored."""
        del key_groups, insertion_only_keys, reused_keys
        state = req_context.get_state(_Request)
        if state is None or state.owner is not self or state.generation != self._generation:
            return
        reading = self._reading
        for key in state.reads:
            left = reading.pop(key, 1) - 1
            if left > 0:
                reading[key] = left
        state.reads.clear()
        state.verdicts.clear()

    # --- chunks ---

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self._chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        self._chunks[key] = chunk
        if chunk.ref_cnt == 0:
            self._evictable.add(key)
        if self._request(req_context).verdicts.pop(key, True):  # not asked: admitted, as with the filter off
            self._policy.insert(key)
        else:
            self._sufferance[key] = None

    def remove(self, key: OffloadKey) -> None:
        if self._chunks.pop(key, None) is None:
            return
        self._evictable.discard(key)
        if key in self._sufferance:
            del self._sufferance[key]
        else:
            self._policy.remove(key)

    def mark_evictable(self, key: OffloadKey) -> None:
        if key in self._chunks:
            self._evictable.add(key)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._evictable.discard(key)

    def clear(self) -> None:
        self._generation += 1  # requests' states from before are stale: their reads and verdicts are void
        self._reset()

    # --- eviction ---

    def _available(self, protected: Collection[OffloadKey]) -> int:
        """How many chunks ``evict`` may choose: evictable and not protected."""
        evictable = self._evictable
        if len(protected) < len(evictable):
            return len(evictable) - sum(1 for key in protected if key in evictable)
        return sum(1 for key in evictable if key not in protected)

    def _evict_sufferance(self, n: int, protected: Collection[OffloadKey]) -> list[OffloadKey]:
        """Up to ``n`` blocks stored on sufferance, oldest first, skipping pinned and protected ones."""
        evictable = self._evictable
        victims = []
        for key in self._sufferance:
            if key in evictable and key not in protected:
                victims.append(key)
                if len(victims) == n:
                    break
        for key in victims:
            del self._sufferance[key]
        return victims

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n <= 0:
            return []
        if self._available(protected) < n:
            return None  # nothing changed
        victims = self._evict_sufferance(n, protected)
        if len(victims) < n:
            victims += self._policy.evict(n - len(victims), _Shield(protected, self._evictable, self._reading))
        if len(victims) < n:  # only blocks of unfinished requests are left: they go too
            victims += self._policy.evict(n - len(victims), _Shield(protected, self._evictable, {}))
        assert len(victims) == n, f"{n} evictable chunks counted, {len(victims)} found"
        evicted = []
        for key in victims:
            self._evictable.remove(key)
            evicted.append((key, self._chunks.pop(key)))
        return evicted
