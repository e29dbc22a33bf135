"""What a stack's tiers tell their watcher (``core/events.py``): replayed in order, the runs of a
``BlockEvents`` say exactly which blocks each tier holds, whatever stores, loads, evictions, demotions and
damaged blocks happened; a watcher nobody empties forgets and says how much. A block's tokens are kept
while this engine's own tiers hold it, and no longer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from helpers.disk_helpers import get, open_stack, put
from helpers.stack_helpers import key
from kvtier.core.events import Batch, BlockEvents, BlockTokens, HeldTokens, Where
from kvtier.core.stack import TierStack


def replay(batches: list[Batch], view: dict[str, set[bytes]] | None = None) -> dict[str, set[bytes]]:
    """A subscriber's view: per tier, the blocks the runs say it holds."""
    view = {} if view is None else view
    for batch in batches:
        assert batch.lost == 0
        for run in batch.runs:
            held = view.setdefault(run.tier, set())
            if run.stored:
                held.update(run.keys)
            else:
                held.difference_update(run.keys)
    return view


def truth(stack: TierStack) -> dict[str, set[bytes]]:
    return {tier.name: set(tier.ready_keys()) for tier in stack.tiers}


@contextlib.contextmanager
def watched(tmp_path, max_keys: int = 1 << 20, **tiers: int) -> Iterator[tuple[TierStack, BlockEvents]]:
    """A host tier of 4 blocks over a disk tier of 16 (LRU both; ``tiers`` sizes others) and a watcher of them."""
    stack = open_stack(tmp_path / "disk", **{"host": 4, "disk": 16, **tiers})
    events = BlockEvents(max_keys)
    events.watch(stack.tiers)
    try:
        yield stack, events
    finally:
        stack.close()


def test_replayed_runs_say_exactly_what_each_tier_holds(tmp_path, rng):
    """Random stores and loads over a host tier of 4 blocks and a disk tier of 16 (LRU both): blocks
    demoted, promoted back on loads, evicted for good from the disk; after each step the view built
    from the runs equals what each tier holds."""
    view: dict[str, set[bytes]] = {}
    with watched(tmp_path) as (stack, events):
        for _ in range(60):
            keys = [key(int(i)) for i in rng.choice(40, size=int(rng.integers(1, 4)), replace=False)]
            if rng.random() < 0.5:
                put(stack, keys)
            else:
                get(stack, keys)
            stack.wait_idle()
            replay([events.take()], view)
            assert {name: view.get(name, set()) for name in truth(stack)} == truth(stack)
        assert view["host"] and view["disk"], "both tiers held blocks at the end"


def test_runs_name_the_medium_and_where_blocks_live_and_a_burst_is_one_run(tmp_path):
    with watched(tmp_path) as (stack, events):
        put(stack, [key(i) for i in range(4)])
        stack.wait_idle()
        events.take()
        host = stack.tiers[0]
        dropped = host.evict(4)  # (a cache reset: every block at once)
        runs = events.take().runs
        assert [(run.stored, run.tier, run.where, run.keys) for run in runs] == [
            (False, "host", Where("CPU", "LOCAL", None), dropped)
        ]
        assert sorted(dropped) == sorted(key(i) for i in range(4))


def test_an_unreadable_block_dropped_from_a_tier_is_removed(tmp_path):
    with watched(tmp_path) as (stack, events):
        put(stack, [key(i) for i in range(8)])  # the first four are demoted to the disk
        stack.wait_idle()
        disk = stack.tiers[1]
        held = sorted(disk.ready_keys())
        events.take()
        assert disk.discard(held[:2]) == held[:2]
        (run,) = events.take().runs
        assert (run.stored, run.tier, run.where.medium, sorted(run.keys)) == (False, "disk", "STORAGE", held[:2])


def test_a_watcher_nobody_empties_forgets_what_waits_and_counts_it(tmp_path):
    with watched(tmp_path, max_keys=6) as (stack, events):
        put(stack, [key(i) for i in range(4)])
        stack.wait_idle()
        put(stack, [key(i) for i in range(4, 8)])  # 4 demoted + 4 evicted + 4 stored: more than 6 waiting
        stack.wait_idle()
        batch = events.take()
        assert batch.lost > 0 and sum(len(run.keys) for run in batch.runs) <= 6
        assert events.take() == Batch([], 0)  # (told once)
        host = stack.tiers[0]
        host.evict(1)
        batch = events.take()
        assert batch.lost == 0 and [len(run.keys) for run in batch.runs] == [1]


def test_every_tier_of_a_standalone_stack_is_watched_and_named_by_its_medium(tmp_path):
    with watched(tmp_path, gpu=2) as (stack, events):
        assert [tier.watcher is events for tier in stack.tiers] == [True, True, True]
        put(stack, [key(i) for i in range(4)], batch=2)  # (the GPU tier of 2 demotes to host)
        stack.wait_idle()
        media = {(run.tier, run.where) for run in events.take().runs}
        assert media == {("gpu", Where("GPU", "LOCAL", None)), ("host", Where("CPU", "LOCAL", None))}


def test_a_blocks_tokens_are_kept_while_an_own_tier_holds_it_and_noted_ones_are_bounded():
    own, shared = Where("CPU", "LOCAL", None), Where("STORAGE", "REMOTE", "redis at x")
    tokens = HeldTokens(max_noted=2)
    a, b = BlockTokens((1, 2), None), BlockTokens((3, 4), b"a")
    tokens.note([b"a"], [a])
    assert tokens.stored("host", own, [b"a"]) == [a]  # as noted
    assert tokens.stored("disk", own, [b"a"]) == [a] and tokens.stored("store", shared, [b"a"]) == [a]  # copies
    tokens.removed("host", [b"a"])
    assert tokens.stored("store", shared, [b"a"]) == [a]  # the disk tier holds it still
    tokens.removed("disk", [b"a"])
    assert len(tokens) == 0 and tokens.stored("store", shared, [b"a"]) == [None]  # no own tier: let go
    assert tokens.stored("store", shared, [b"b"], [b]) == [b] and len(tokens) == 0  # a shared store's: not kept
    tokens.note([bytes([n]) for n in range(3)], [b] * 3)  # stores noted, never taken: the oldest forgotten
    assert len(tokens) == 2 and tokens.stored("host", own, [bytes([0])]) == [None]
