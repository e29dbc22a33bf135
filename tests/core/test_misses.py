"""Why a prefix missed (core/misses.py): each reason provoked for real in a stack, and counted exactly
once per lookup, in total and per tier; the ghost index stays within its budget and forgets the oldest."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from helpers.admission import AdmitOnSecondAsk
from helpers.disk_helpers import get, open_stack, put
from helpers.stack_helpers import LAYOUT, assert_no_leaks, flip, key, make_stack, store
from kvtier.core.jobs import JobManager
from kvtier.core.misses import TOTAL, GhostIndex, MissCounter, Misses, MissReason
from kvtier.core.namespaces import (
    ENTRY_BYTES,
    MAX_NAMESPACES,
    REGISTRY_BYTES,
    KnownNamespace,
    decode_entries,
    decode_entry,
    encode_entries,
    encode_entry,
    listing,
)
from kvtier.core.stack import TierStack
from kvtier.policies import LRUPolicy
from kvtier.tiers.disk.files import SLAB_NAME
from kvtier.tiers.disk.slots import PAGE
from kvtier.tiers.gpu import gpu_tier
from kvtier.tiers.host import host_tier
from kvtier.transfers.cpu import CPUBackend

E, N, DC, DR, DM = (
    MissReason.EVICTED,
    MissReason.NEVER_STORED,
    MissReason.DECLINED,
    MissReason.DROPPED,
    MissReason.DAMAGED,
)


def counted(stack, reason: MissReason, **by_tier: MissReason) -> None:
    """The stack counted exactly one miss: ``reason`` in total, ``by_tier`` per tier."""
    expected = {(reason, TOTAL): 1, **{(why, tier): 1 for tier, why in by_tier.items()}}
    assert stack.misses.take() == expected


# --- the ghost index and the counter -------------------------------------------------------------


def test_the_ghost_keeps_one_reason_per_tier_and_forgets_a_tier_on_request():
    ghost = GhostIndex(3, entries=8)
    ghost.record(0, [b"a"], E)
    ghost.record(2, [b"a"], DC)
    assert ghost.reasons(b"a") == [E, None, DC]
    ghost.record(0, [b"a"], DM)  # a later reason replaces the tier's earlier one
    ghost.forget(2, [b"a"])
    assert ghost.reasons(b"a") == [DM, None, None]
    assert ghost.reasons(b"b") == [None, None, None]


def test_the_ghost_stays_within_its_budget_and_the_oldest_entries_fall_out():
    entries = 1000
    ghost = GhostIndex(2, entries)
    misses = Misses(["host", "disk"], ghost, [lambda key: None] * 2)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(10 * entries):
        ghost.record(1, [key(i)], E)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(ghost) <= entries
    assert used < entries * 200, f"{used / entries:.0f} bytes per entry"
    newest, oldest = key(10 * entries - 1), key(0)
    assert misses.explain([newest], 0).reason is E
    old = misses.explain([oldest], 0)
    assert (old.reason, old.tier, old.by_tier) == (N, None, {"host": N, "disk": N})


def test_the_counter_counts_in_total_and_per_tier_and_take_gives_the_delta():
    counter = MissCounter(["host", "disk"])
    misses = Misses(["host", "disk"], GhostIndex(2), [lambda key: None] * 2)
    misses.ghost.record(0, [b"k"], E)
    miss = misses.explain([b"k"], 0)
    counter.add(miss)
    counter.add(miss)
    assert counter.take() == {(E, TOTAL): 2, (E, "host"): 2, (N, "disk"): 2}
    assert counter.take() == {}
    counter.add(miss)
    assert counter.take() == {(E, TOTAL): 1, (E, "host"): 1, (N, "disk"): 1}
    assert counter.counts()[(E, TOTAL)] == 3
    stats = counter.stats()
    assert stats["total"]["evicted"] == 3 and stats["total"]["partial_block"] == 0
    assert stats["by_tier"] == {
        "host": {r.value: 3 if r is E else 0 for r in MissReason},
        "disk": {r.value: 3 if r is N else 0 for r in MissReason},
    }


# --- each reason, provoked in a real stack ---------------------------------------------------------


def test_a_full_hit_counts_nothing_and_a_partial_last_block_counts_once():
    stack = make_stack()
    keys = [key(i) for i in range(3)]
    store(stack, keys)
    assert stack.lookup(keys).hits == 3 and stack.misses.take() == {}
    assert stack.lookup(keys, partial=True).hits == 3
    counted(stack, MissReason.PARTIAL_BLOCK, gpu=MissReason.PARTIAL_BLOCK, host=MissReason.PARTIAL_BLOCK)
    stack.close()


def test_a_block_never_stored_is_never_stored_everywhere():
    stack = make_stack()
    keys = [key(i) for i in range(3)]
    store(stack, keys[:1])
    assert stack.lookup(keys).hits == 1
    counted(stack, N, gpu=N, host=N)
    stack.close()


def test_a_tier_filled_until_it_evicts():
    stack = make_stack(gpu=2, host=4)
    keys = [key(i) for i in range(8)]
    for i in range(0, 8, 2):
        store(stack, keys[i : i + 2])
    stack.wait_idle()
    assert stack.lookup(keys).hits == 0  # the oldest blocks left host (the last tier) through its policy
    counted(stack, E, gpu=E, host=E)
    assert stack.lookup(keys[6:]).hits == 2 and stack.misses.take() == {}
    assert_no_leaks(stack)
    stack.close()


def test_an_admission_decline_names_the_tier_that_declined():
    jobs = JobManager()
    tiers = [
        gpu_tier("gpu", 2, LAYOUT, LRUPolicy(), None, jobs.is_fenced),
        host_tier("host", 8, LAYOUT, AdmitOnSecondAsk(), None, jobs.is_fenced),
    ]
    stack = TierStack(tiers, [CPUBackend(2)], jobs, "write_back")
    keys = [key(i) for i in range(4)]
    store(stack, keys[:2])
    store(stack, keys[2:])  # gpu's victims, keys 0 and 1, are offered to host once: declined
    stack.wait_idle()
    assert tiers[1].stats.declined == 2
    assert stack.lookup(keys).hits == 0
    counted(stack, DC, gpu=E, host=DC)
    stack.close()


def test_a_store_that_finds_no_room_is_dropped():
    stack = make_stack(gpu=2, host=4)
    held = [key(i) for i in range(2)]
    store(stack, held)
    stack.tiers[0].pin(held)  # readers hold the whole first tier: no victim
    new = [key(10), key(11)]
    assert store(stack, new).dropped == 2
    stack.tiers[0].unpin(held)
    assert stack.lookup(new).hits == 0
    counted(stack, DR, gpu=DR, host=N)
    stack.close()


def test_a_block_evicted_from_host_but_on_disk_is_a_hit_and_a_flipped_byte_is_damaged(tmp_path):
    stack = open_stack(tmp_path, host=4, disk=16)
    host, disk = stack.tiers
    keys = [key(i) for i in range(12)]
    put(stack, keys)
    stack.wait_idle()
    assert host.stats.demoted > 0 and stack.lookup(keys).hits == 12
    assert stack.misses.take() == {}, "evicted from host but on disk is a hit"
    victim = 2
    slab = disk.storage.slab
    flip(tmp_path / SLAB_NAME, slab.slot_offset(disk.slots([keys[victim]])[0]) + PAGE + 5)
    loaded, _ = get(stack, keys)
    assert loaded.failed == [victim] and stack.misses.take() == {}  # loads count nothing
    assert stack.lookup(keys).hits == victim
    counted(stack, DM, host=E, disk=DM)
    stack.close()


# --- the namespace registry (core/namespaces.py): what other stacks recorded, checked ------------


def namespace(block_size: int, written: float = 0.0, **fields) -> KnownNamespace:
    return KnownNamespace({"block_size": block_size, "namespace": "", **fields}, written)


def test_a_registry_keeps_the_newest_namespaces_and_ours_once():
    older = [namespace(size, written=size) for size in range(1, 21)]
    ours = namespace(7, written=100.0)
    kept = listing(older, ours)
    assert len(kept) == MAX_NAMESPACES and kept[0] is ours
    newest_others = [size for size in range(20, 0, -1) if size != 7][: MAX_NAMESPACES - 1]
    assert [entry.fields["block_size"] for entry in kept[1:]] == newest_others, "ours replaced its older entry"
    assert decode_entries(encode_entries(kept)) == kept
    assert decode_entry(encode_entry(ours)) == ours and len(encode_entry(ours)) == ENTRY_BYTES
    assert ours.chain == (7, "") and namespace(7, model="m").chain is None  # an engine's keys: not made here


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\x00\xff",
        b"[]",
        b'{"kvtier_namespaces": 2, "entries": []}',
        b"[" * 30000 + b"]" * 30000,
        json.dumps({"kvtier_namespaces": 1, "entries": [{"fields": {}}] * (MAX_NAMESPACES + 1)}).encode(),
        json.dumps({"kvtier_namespaces": 1, "entries": [], "pad": " " * REGISTRY_BYTES}).encode(),
    ],
    ids=["empty", "binary", "a list", "another version", "deep", "too many", "too large"],
)
def test_a_registry_file_that_is_not_one_is_refused(raw):
    with pytest.raises(ValueError):
        decode_entries(raw)


@pytest.mark.parametrize(
    "entry",
    [
        {"fields": {"Block Size": 16}},
        {"fields": {"namespace": "x" * 2000}},
        {"fields": {"namespace": {"nested": 1}}},
        {"fields": {f"f{i}": i for i in range(64)}},
        {"fields": {}, "written": float("nan")},
        {"fields": {}, "records": "../../etc"},
        {"fields": {}, "more": 1},
        {"written": 1.0},
    ],
    ids=["field name", "long value", "nested value", "too many fields", "nan", "records", "unknown key", "no fields"],
)
def test_an_entry_that_is_not_a_namespace_is_refused(entry):
    with pytest.raises(ValueError):
        KnownNamespace.from_json(entry)
    with pytest.raises(ValueError):
        decode_entry(json.dumps(entry).encode().ljust(ENTRY_BYTES))
