"""The planner as pure data, over tiers that hold slot counts only (``SlotCount``: no bytes anywhere).

Invariants checked:
- making room drops clean victims (the tier below holds them) and the last tier's victims at once,
  naming their keys; dirty victims get one demotion plan into reserved slots below, trimmed to the
  room there (the rest dropped, or kept when room below is on its way);
- slots of demotions in flight count as room: asking again evicts nothing more, and says how much
  room is pending; a watermark relieves only what is not already leaving;
- a store reserves a prefix of the first tier, write-through hops reserve prefixes below as later
  stages; a load pins the longest held prefix, stages disk blocks through host, and stops at the
  first block it cannot bring;
- copies and fences are derived from one spec: every tier slot read or written is fenced once;
- ``finish`` commits what arrived, aborts the rest, unpins, ends demotions, drops unreadable sources,
  and returns the keys each tier stored and dropped (events come from them) and the hits per tier.
"""

from __future__ import annotations

import pytest

from kvtier.core.errors import TransferError
from kvtier.core.jobs import Fence, JobManager, WorkerReport
from kvtier.core.layout import BlockLayout
from kvtier.core.planner import ENGINE, Copy, Endpoint, Planner, SlotCount, copy_of, plan_of
from kvtier.core.tier import BlockState, Tier, Usage
from kvtier.policies import LRUPolicy, Watermark

LAYOUT = BlockLayout((64,))


def k(i: int) -> bytes:
    return b"key-%03d" % i


@pytest.fixture
def jobs():
    return JobManager()


def tiers(jobs: JobManager, *spec: tuple[str, str, int], watermark: Watermark | None = None) -> list[Tier]:
    """Tiers ``(name, medium, slots)`` over slot counts, LRU, fenced by ``jobs``."""
    return [Tier(name, medium, SlotCount(LAYOUT, n), LRUPolicy(), watermark if i == 0 else None, jobs.is_fenced)
            for i, (name, medium, n) in enumerate(spec)]


def host_disk(jobs: JobManager, host: int = 4, disk: int = 8, watermark: Watermark | None = None) -> Planner:
    return Planner(tiers(jobs, ("host", "host", host), ("disk", "disk", disk), watermark=watermark))


def fill(tier: Tier, keys: list[bytes]) -> list[int]:
    slots = tier.reserve(keys, allow_evict=False)
    assert slots is not None
    tier.commit(keys)
    return slots


def run(jobs: JobManager, plan, failed=(), first_stage_failed=(), refused=(), cancel: bool = False):
    """The plan's job, ended with one report (what an executor gets back)."""
    job = jobs.create(plan.kind, plan.num_blocks, 1, plan.fences)
    if cancel:
        jobs.cancel(job.id)
    jobs.apply(WorkerReport({job.id: 1}, {job.id: frozenset(failed)}, {job.id: frozenset(refused)},
                            {job.id: frozenset(first_stage_failed)}))
    return job


# --- making room ---------------------------------------------------------------------------------


def test_clean_victims_drop_at_once_and_dirty_ones_get_one_demotion(jobs):
    planner = host_disk(jobs)
    host, disk = planner.tiers
    host_slots = fill(host, [k(0), k(1), k(2), k(3)])
    fill(disk, [k(1)])  # k(1) is clean: the disk already holds it
    room = planner.make_room(0, 2)
    assert room.dropped == {"host": [k(1)]}
    (demotion,) = room.demotions
    disk_slot = disk.slots([k(0)])[0]
    assert demotion.kind == "demote" and demotion.keys == (k(0),)
    assert demotion.stages == ((copy_of("host", "disk", [(0, k(0), host_slots[0], disk_slot)]),),)
    assert set(demotion.fences) == {Fence("host", host_slots[0], False), Fence("disk", disk_slot, True)}
    assert host.usage() == Usage(3, 4, evicting=1) and room.pending == 1
    assert host.lookup([k(0)]) == 1  # a victim stays readable while it moves

    outcome = planner.finish(demotion, run(jobs, demotion))
    assert (outcome.stored, outcome.dropped, outcome.lost) == ({"disk": [k(0)]}, {"host": [k(0)]}, set())
    assert host.usage() == Usage(2, 4, 0) and disk.state(k(0)) is BlockState.READY
    assert (host.stats.demoted, host.stats.bytes_out) == (1, 64)  # demotions count the bytes they read out


def test_the_last_tier_drops_its_victims_and_names_them(jobs):
    planner = host_disk(jobs, disk=2)
    disk = planner.tiers[1]
    fill(disk, [k(0), k(1)])
    room = planner.make_room(1, 1)
    assert (room.dropped, room.demotions, room.pending) == ({"disk": [k(0)]}, [], 0)


def test_dirty_victims_without_room_below_are_dropped(jobs):
    planner = host_disk(jobs, host=3, disk=2)
    host, disk = planner.tiers
    fill(host, [k(0), k(1), k(2)])
    fill(disk, [k(8), k(9)])
    disk.pin([k(8)])  # the disk can make room for one block only
    room = planner.make_room(0, 2)
    assert room.dropped == {"disk": [k(9)], "host": [k(1)]}  # trimmed to the room below
    assert [plan.keys for plan in room.demotions] == [(k(0),)]
    disk.unpin([k(8)])


def test_demotions_in_flight_count_as_room_and_are_reported_pending(jobs):
    planner = host_disk(jobs)
    host = planner.tiers[0]
    fill(host, [k(0), k(1), k(2), k(3)])
    first = planner.make_room(0, 2)
    assert [p.keys for p in first.demotions] == [(k(0), k(1))] and first.pending == 2
    again = planner.make_room(0, 2)  # the executor asks again before the demotion landed
    assert (again.dropped, again.demotions, again.pending) == ({}, [], 2)
    more = planner.make_room(0, 3)  # only what is still missing is evicted
    assert [p.keys for p in more.demotions] == [(k(2),)] and more.pending == 3
    for plan in first.demotions + more.demotions:
        planner.finish(plan, run(jobs, plan))
    assert host.usage() == Usage(1, 4, 0)


def test_victims_wait_when_the_room_below_them_is_on_its_way(jobs):
    """Three tiers, the middle one full of blocks the last lacks: its room comes only when its own
    demotion lands, so the top tier's dirty victims are kept (not lost) and reported pending."""
    planner = Planner(tiers(jobs, ("gpu", "gpu", 2), ("host", "host", 2), ("disk", "disk", 8)))
    gpu, host, disk = planner.tiers
    fill(gpu, [k(0), k(1)])
    fill(host, [k(2), k(3)])
    room = planner.make_room(0, 2)
    assert [(p.stages[0][0].src.tier, p.keys) for p in room.demotions] == [("host", (k(2), k(3)))]
    assert room.dropped == {} and room.pending == 2
    assert gpu.lookup([k(0), k(1)]) == 2 and gpu.usage().evicting == 0
    planner.finish(room.demotions[0], run(jobs, room.demotions[0]))
    room = planner.make_room(0, 2)  # asked again once the room below landed: now they move down
    assert [p.keys for p in room.demotions] == [(k(0), k(1))] and disk.lookup([k(2), k(3)]) == 2


def test_a_watermark_relieves_only_what_is_not_already_leaving(jobs):
    planner = host_disk(jobs, host=10, disk=20, watermark=Watermark(high=0.8, low=0.5))
    host = planner.tiers[0]
    fill(host, [k(i) for i in range(9)])
    room = planner.relieve(0)
    assert [len(p.keys) for p in room.demotions] == [4]  # 9 used, down to 5
    assert planner.relieve(0).demotions == []  # still above the mark, but those 4 are on their way
    for plan in room.demotions:
        planner.finish(plan, run(jobs, plan))
    assert host.usage().used == 5 and planner.relieve(0).demotions == []


def test_failed_and_refused_demotions(jobs):
    planner = host_disk(jobs)
    host, disk = planner.tiers
    fill(host, [k(0), k(1), k(2), k(3)])
    (plan,) = planner.make_room(0, 3).demotions
    outcome = planner.finish(plan, run(jobs, plan, failed=[1], refused=[2]))  # a refusal is no error
    # k(0) landed and left; k(1) failed for a passing reason and stays; k(2) can never fit: dropped
    assert outcome.stored == {"disk": [k(0)]} and outcome.dropped == {"host": [k(0), k(2)]}
    assert [host.state(x) for x in (k(0), k(1), k(2))] == [BlockState.FREE, BlockState.READY, BlockState.FREE]
    assert disk.stats.incompressible == 1 and host.stats.demotion_refused == 1 and disk.usage().used == 1


# --- stores --------------------------------------------------------------------------------------


def test_a_store_takes_a_prefix_and_write_through_hops_take_prefixes_below(jobs):
    planner = host_disk(jobs, host=3, disk=2)
    host, disk = planner.tiers
    fill(disk, [k(9)])
    disk.pin([k(9)])  # one disk slot left
    planned = planner.store([k(0), k(1), k(2), k(3)], [10, 11, 12, 13], hops=1)
    plan = planned.plan
    assert plan.keys == (k(0), k(1), k(2))  # a full tier stores less
    (into_host,), (into_disk,) = plan.stages
    assert into_host.src == Endpoint(ENGINE, (10, 11, 12)) and into_host.dst.tier == "host"
    assert into_disk.src == Endpoint("host", into_host.dst.slots[:1]) and into_disk.keys == (k(0),)
    assert all(f.write for f in plan.fences) and len(plan.fences) == 4  # the hop's source is written here too

    outcome = planner.finish(plan, run(jobs, plan, failed=[0, 2], first_stage_failed=[2]))
    # block 0 failed on the disk only: its host copy landed whole and stays
    assert outcome.stored == {"host": [k(0), k(1)]} and outcome.lost == {0, 2}
    assert host.state(k(2)) is BlockState.FREE and disk.state(k(0)) is BlockState.FREE
    assert host.stats.bytes_out == 0  # a hop reads slots the plan wrote, not blocks it held
    disk.unpin([k(9)])


def test_a_cancelled_store_aborts_everything(jobs):
    planner = host_disk(jobs)
    plan = planner.store([k(0), k(1)], [0, 1], hops=1).plan
    outcome = planner.finish(plan, run(jobs, plan, cancel=True))
    assert outcome.lost == {0, 1} and outcome.stored == {}
    assert all(t.usage().used == 0 and t.stats.aborted == 2 for t in planner.tiers)


def test_copy_down_pins_its_sources_until_it_finishes(jobs):
    planner = host_disk(jobs, disk=1)
    host, disk = planner.tiers
    fill(host, [k(0), k(1)])
    plan = planner.copy_down(0, [k(0), k(1)]).plan
    assert plan.keys == (k(0),) and host.leaks()["pinned"] == 1  # the disk has room for one
    outcome = planner.finish(plan, run(jobs, plan))
    assert outcome.stored == {"disk": [k(0)]} and host.leaks()["pinned"] == 0 and host.stats.bytes_out == 64


# --- loads ---------------------------------------------------------------------------------------


def test_lookup_names_the_serving_tier_and_what_a_load_would_stage(jobs):
    planner = host_disk(jobs)
    host, disk = planner.tiers
    fill(host, [k(0), k(2)])
    fill(disk, [k(1), k(2), k(3)])
    keys = [k(0), k(1), k(2), k(3), k(4)]
    assert planner.lookup(keys) == planner.lookup(keys, "host")
    found = planner.lookup(keys, "gpu")
    assert (found.hits, found.sources, found.staging) == (4, (0, 1, 0, 1), {0: 2})
    host.reserve([k(3)], allow_evict=False)  # another load is staging k(3) into host memory
    assert planner.lookup(keys, "gpu").hits is None  # not known yet: ask again
    assert host.leaks() == {"pinned": 0, "writing": 1}  # a lookup pins nothing


def test_a_staged_load_stages_through_host_and_stops_where_it_cannot(jobs):
    planner = host_disk(jobs, host=3)
    host, disk = planner.tiers
    host_slot = fill(host, [k(0)])[0]
    disk_slots = fill(disk, [k(1), k(2), k(3)])
    planned = planner.load([k(0), k(1), k(2), k(3)], [20, 21, 22, 23], "gpu")
    plan = planned.plan
    assert plan.keys == (k(0), k(1), k(2)) and planned.sources == (0, 1, 1)  # two host slots to stage into
    (to_host,), (to_gpu,) = plan.stages
    staging = host.slots([k(1), k(2)])
    assert to_host == copy_of("disk", "host", zip((1, 2), (k(1), k(2)), disk_slots[:2], staging, strict=True))
    rows = zip((0, 1, 2), plan.keys, [host_slot, *staging], (20, 21, 22), strict=True)
    assert to_gpu == copy_of("host", ENGINE, rows)
    assert disk.leaks()["pinned"] == 2  # k(3) was let go

    outcome = planner.finish(plan, run(jobs, plan, failed=[0, 1]))
    assert outcome.hits == {"disk": 1} and outcome.lost == {0, 1}
    assert outcome.stored == {"host": [k(1), k(2)]}  # staged blocks stay cached in host memory...
    assert outcome.dropped == {"host": [k(0), k(1)]}  # ...unless reading them out failed: unreadable
    assert disk.state(k(1)) is BlockState.READY  # its disk copy was read whole: kept
    assert (host.stats.hits, disk.stats.hits, disk.stats.bytes_out) == (0, 1, 64)
    assert host.leaks() == disk.leaks() == {"pinned": 0, "writing": 0}


def test_a_block_that_fails_its_first_stage_is_dropped_from_its_source(jobs):
    planner = host_disk(jobs)
    host, disk = planner.tiers
    fill(disk, [k(0), k(1)])
    plan = planner.load([k(0), k(1)], [5, 6], "gpu").plan
    outcome = planner.finish(plan, run(jobs, plan, failed=[1], first_stage_failed=[1]))
    assert outcome.dropped == {"disk": [k(1)]} and outcome.stored == {"host": [k(0)]}
    assert host.state(k(1)) is BlockState.FREE and host.stats.aborted == 1


def test_a_load_stops_at_a_block_already_being_staged(jobs):
    planner = host_disk(jobs)
    host, disk = planner.tiers
    fill(disk, [k(0), k(1), k(2)])
    host.reserve([k(1)], allow_evict=False)
    planned = planner.load([k(0), k(1), k(2)], [0, 1, 2], "gpu")
    assert planned.plan.keys == (k(0),) and disk.leaks()["pinned"] == 1
    planner.finish(planned.plan, run(jobs, planned.plan, cancel=True))
    assert disk.leaks()["pinned"] == 0 and host.leaks()["writing"] == 1


def test_a_route_that_cannot_be_served_is_refused_before_anything_is_pinned(jobs):
    planner = Planner(tiers(jobs, ("disk", "disk", 4)))
    fill(planner.tiers[0], [k(0)])
    with pytest.raises(TransferError, match="needs a host tier to stage through"):
        planner.load([k(0)], [0], "gpu")
    assert planner.tiers[0].leaks()["pinned"] == 0


# --- the copy spec -------------------------------------------------------------------------------


def test_a_copy_keeps_only_the_blocks_asked_for_and_key_addressed_sides_have_no_fence():
    remote = copy_of("host", "remote", [(0, k(0), 4, None), (1, k(1), 5, None), (2, k(2), 6, None)])
    assert remote.dst == Endpoint("remote", None)
    part = remote.only({0, 2})
    assert part == Copy(Endpoint("host", (4, 6)), Endpoint("remote", None), (k(0), k(2)), (0, 2))
    assert remote.only({0, 1, 2}) is remote and remote.only(set()) is None
    plan = plan_of("store", [k(0), k(1), k(2)], [[remote]])
    assert plan.fences == tuple(Fence("host", s, False) for s in (4, 5, 6))
