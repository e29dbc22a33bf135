"""The scheduler side's lookup: how many leading blocks past vLLM's own prefix hit the tiers hold for
every served group, and why a lookup ended where it did.

A part of its own because a hit is more than the first tier's run of keys: it needs every
full-attention group's blocks from its start and a sliding-window group's only within the window
before its end, it ends on every group's block boundary (``geometry.GroupKeys``), and it must never
make vLLM's hook wait. A last tier addressed by key (a store shared with other engines, or the
machine's node daemon) is asked only for the blocks past the local (host, disk) hit, in one batched
query on a thread of its own; until it has answered (at most the tier's timeout; an owner that is down
is a miss) the lookup says "ask again". Each rank's shard of a block is a copy of its own, so a block
is a hit there only when every rank's copy exists (MLA: one copy for all ranks).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

from kvtier.connectors.vllm.geometry import GroupKeys
from kvtier.connectors.vllm.request_state import RequestState, StoreQuery
from kvtier.core.devices import GPU
from kvtier.core.jobs import mark_kvtier_thread
from kvtier.core.misses import Misses
from kvtier.core.planner import Lookup, Planner
from kvtier.tiers.keyed import KeyedTier

log = logging.getLogger(__name__)


class HitLookup:
    """Hits over the ``planner``'s tiers, the ``keyed`` one (if any) asked off vLLM's thread; the
    requests whose lookup ended early are counted in ``misses``."""

    def __init__(self, planner: Planner, geometry: GroupKeys, keyed: KeyedTier | None) -> None:
        self.planner = planner
        self.geometry = geometry
        self.keyed = keyed
        tiers = planner.tiers
        self.misses = Misses([t.name for t in tiers], planner.ghost, [t.why_absent for t in tiers])
        self._queries: ThreadPoolExecutor | None = None
        if keyed is not None:
            self._queries = ThreadPoolExecutor(1, thread_name_prefix="kvtier-lookup", initializer=mark_kvtier_thread)

    def find(self, state: RequestState, start: int, limit: int) -> tuple[int | None, Lookup]:
        """The end of the longest hit of the request from key ``start`` (at most ``limit``; its keys
        hashed that far, ``Requests.keys``), and the planner's lookup of the blocks a load to there
        needs. None while one of them is being staged, or while the keyed store has not answered for
        the blocks past the local hit."""
        end, found = self._hit(state.keys, start, limit)
        if end is not None and end < limit and self.keyed is not None:
            if not self._store_answered(state, end, limit):
                return None, found
            end, found = self._hit(state.keys, start, limit)  # now with the store's answers
        return end, found

    def count_miss(self, keys: list[bytes], start: int, end: int, limit: int, partial: bool) -> None:
        """Count a request's lookup in ``misses`` when it ended early: a hit from ``start`` (past vLLM's own
        prefix hit) to ``end`` short of ``limit``, the most vLLM can take (the prompt's full blocks, less
        the one holding its last token when no partial block follows them), or up to it with a
        ``partial`` block after it (vLLM computes that one itself: ``partial_block``). Explained on the
        blocks of the first full-attention group, which every hit needs."""
        group = self.geometry.full_groups[0] if self.geometry.full_groups else 0
        looked_up = self.geometry.group_keys(keys, start, limit, [group])
        hits = len(self.geometry.group_keys(keys, start, end, [group]))
        self.misses.count(self.misses.explain(looked_up, hits, partial))

    def shutdown(self) -> None:
        """Stop asking the keyed store (a query in flight ends by its deadline, unread)."""
        if self._queries is not None:
            self._queries.shutdown(wait=False, cancel_futures=True)

    def _hit(self, keys: list[bytes], start: int, limit: int) -> tuple[int | None, Lookup]:
        """The end of the longest hit from key ``start`` (at most ``limit``), and the planner's lookup
        of the blocks a load to there needs; None while one of them is being staged. Full-attention
        groups need every block from ``start``, a sliding-window group those within its window."""
        geometry = self.geometry
        if geometry.full_groups:
            found = self.planner.lookup(geometry.group_keys(keys, start, limit, geometry.full_groups), GPU)
            if found.hits is None:
                return None, found
            if geometry.uniform:
                end = start + found.hits // len(geometry.full_groups)
            else:  # up to the start of the first block missing
                ends = geometry.ends(start, limit, geometry.full_groups)
                end = limit
                if found.hits < len(ends):
                    i, p = ends[found.hits]
                    end = i + 1 - geometry.keys_per_block[p]
        else:
            end = limit
        end -= end % geometry.hit_keys  # on every group's block boundary
        if not geometry.windowed and geometry.uniform:
            return end, found
        end = self._window_end(keys, start, end)
        found = self.planner.lookup(geometry.needed(keys, start, end), GPU)
        return (end if found.hits is not None else None), found

    def _window_end(self, keys: list[bytes], start: int, end: int) -> int:
        """The largest hit end at most ``end`` for which every sliding-window group holds the blocks of
        its window before it. The first block of a window missing at ``b`` lies in the window of every
        end past it up to ``end``, so the next candidate is where ``b`` starts (on every group's block
        boundary); repeated until every group agrees."""
        geometry = self.geometry
        settled = False
        while not settled and end > start:
            settled = True
            for p, group in enumerate(geometry.groups):
                if group.window_blocks is not None:
                    m = geometry.keys_per_block[p]
                    first = max(start // m, end // m - group.window_blocks)
                    window = [geometry.group_key(keys[(b + 1) * m - 1], p) for b in range(first, end // m)]
                    held = self.planner.lookup(window).hits or 0
                    if held < len(window):
                        end, settled = (first + held) * m, False
                        end -= end % geometry.hit_keys
        return end

    def _store_answered(self, state: RequestState, first: int, end: int) -> bool:
        """Whether the keyed store answered recently which of the request's blocks ``first`` to ``end``
        it holds (its answers are then the keyed tier's READY keys); else asks it, one batched query
        on the lookup thread, and says False until the answer is in."""
        assert self.keyed is not None and self._queries is not None
        query = state.store_query
        if query is None or query.first > first or query.end < end or query.expires <= time.monotonic():
            keys = self.geometry.group_keys(state.keys, first, end, range(len(self.geometry.groups)))
            future = self._queries.submit(self.keyed.query, keys)
            future.add_done_callback(_log_failure)
            query = state.store_query = StoreQuery(first, end, time.monotonic() + self.keyed.known_for, future)
        return query.future.done()


def _log_failure(query: Future[int]) -> None:
    """A store query that raised (not a store failure, which is a miss: a bug) is logged, never lost."""
    if not query.cancelled() and query.exception() is not None:
        log.error("kvtier remote lookup failed", exc_info=query.exception())
