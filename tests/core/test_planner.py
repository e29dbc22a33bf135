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
  and returns the keys each tier stored and dropped (events come from them) and the hits per tier;
- a remote tier (addressed by key, the last tier) is never a source of victims, gives and takes no
  slots, is read only through the host tier (also for a host destination), takes demotions only when
  placed write-back, gets write-through copies from the host tier by plans of their own (never as a
  hop of a store's job); memory a quarantined block's store call may still touch (host slots a read
  may write, sources a write may read) stays out of use until the job's quarantine is lifted.
"""

from __future__ import annotations

import pytest

from kvtier.core.errors import TransferError
from kvtier.core.jobs import Fence, JobManager, WorkerReport
from kvtier.core.layout import BlockLayout
from kvtier.core.planner import ENGINE, Copy, Endpoint, Planner, Room, SlotCount, copy_of, numbered, plan_of
from kvtier.core.tier import BlockState, Tier, Usage
from kvtier.policies import LRUPolicy, Watermark
from kvtier.tiers.remote.link import Connector, StoreLink
from kvtier.tiers.remote.record import RecordFormat
from kvtier.tiers.remote.tier import RemoteTier

LAYOUT = BlockLayout((64,))


def k(i: int) -> bytes:
    return b"key-%03d" % i


@pytest.fixture
def jobs():
    return JobManager()


def tiers(jobs: JobManager, *spec: tuple[str, str, int], watermark: Watermark | None = None) -> list[Tier]:
    """Tiers ``(name, medium, slots)`` over slot counts, LRU, fenced by ``jobs``."""
    return [
        Tier(name, medium, SlotCount(LAYOUT, n), LRUPolicy(), watermark if i == 0 else None, jobs.is_fenced)
        for i, (name, medium, n) in enumerate(spec)
    ]


def host_disk(jobs: JobManager, host: int = 4, disk: int = 8, watermark: Watermark | None = None) -> Planner:
    return Planner(tiers(jobs, ("host", "host", host), ("disk", "disk", disk), watermark=watermark))


def fill(tier: Tier, keys: list[bytes]) -> list[int]:
    slots = tier.reserve(keys, allow_evict=False)
    assert slots is not None
    tier.commit(keys)
    return slots


def run(jobs: JobManager, plan, failed=(), first_stage_failed=(), refused=(), cancel: bool = False, quarantined=()):
    """The plan's job, ended with one report (what an executor gets back)."""
    job = jobs.create(plan.kind, plan.num_blocks, 1, plan.fences)
    if cancel:
        jobs.cancel(job.id)
    report = WorkerReport()
    report.add(job.id, failed, refused, first_stage_failed, quarantined)
    jobs.apply(report)
    return job


def remote_tier(placement: str = "write_through") -> RemoteTier:
    """A remote tier the planner can plan over without a store: nothing here asks it anything."""

    def unreachable():
        raise AssertionError("the planner never calls the store")

    link = StoreLink(Connector(unreachable, 1, "no store"), 1.0, "lookups")
    return RemoteTier("remote", LAYOUT, [RecordFormat("t", bytes(16), LAYOUT.block_bytes)], link, placement)


def with_remote(jobs: JobManager, *local: tuple[str, str, int], placement: str = "write_through") -> Planner:
    return Planner([*tiers(jobs, *local), remote_tier(placement)])


def known(tier: Tier, keys: list[bytes]) -> None:
    """Make the remote tier hold ``keys`` READY, as a store of this process would."""
    tier.reserve(keys)
    tier.commit(keys)


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
    assert outcome.served == {"disk": 1} and outcome.lost == {0, 1}
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


# --- a remote tier -------------------------------------------------------------------------------


def test_a_load_from_the_store_stages_through_host_even_into_host_memory(jobs):
    planner = with_remote(jobs, ("host", "host", 4))
    host, remote = planner.tiers
    host_slot = fill(host, [k(0)])[0]
    known(remote, [k(1), k(2)])
    assert planner.lookup([k(0), k(1), k(2), k(3)], "host").staging == {0: 2}
    planned = planner.load([k(0), k(1), k(2), k(3)], [7, 8, 9, 10], "host")
    plan = planned.plan
    assert plan.keys == (k(0), k(1), k(2)) and planned.sources == (0, 1, 1)
    (from_store,), (to_caller,) = plan.stages
    staging = host.slots([k(1), k(2)])
    assert from_store == copy_of("remote", "host", zip((1, 2), (k(1), k(2)), (None, None), staging, strict=True))
    rows = zip((0, 1, 2), plan.keys, [host_slot, *staging], (7, 8, 9), strict=True)
    assert to_caller == copy_of("host", ENGINE, rows)
    assert {f.tier for f in plan.fences} == {"host"}  # nothing to fence in a store addressed by key

    outcome = planner.finish(plan, run(jobs, plan, failed=[2], first_stage_failed=[2]))
    assert outcome.served == {"host": 1, "remote": 1} and outcome.stored == {"host": [k(1)]}
    assert remote.state(k(2)) is BlockState.FREE and remote.stats.read_errors == 1  # failed: not known any more
    assert remote.state(k(1)) is BlockState.READY and host.leaks() == {"pinned": 0, "writing": 0}


def test_the_store_gives_no_victims_and_takes_none_when_placed_write_through(jobs):
    planner = with_remote(jobs, ("host", "host", 2))
    host, remote = planner.tiers
    fill(host, [k(0), k(1)])
    room = planner.make_room(0, 1)
    assert (room.dropped, room.demotions, room.pending) == ({"host": [k(0)]}, [], 0)
    assert planner.make_room(1, 100) == Room()  # the store evicts by itself
    assert remote.usage() == Usage(0, 0) and remote.ready_keys() == []


def test_placed_write_back_the_store_takes_the_host_tiers_victims(jobs):
    planner = with_remote(jobs, ("host", "host", 2), placement="write_back")
    host, remote = planner.tiers
    host_slots = fill(host, [k(0), k(1)])
    known(remote, [k(1)])  # the store holds k(1): clean
    room = planner.make_room(0, 2)
    assert room.dropped == {"host": [k(1)]}
    (demotion,) = room.demotions
    assert demotion.stages == ((copy_of("host", "remote", [(0, k(0), host_slots[0], None)]),),)
    assert remote.state(k(0)) is BlockState.WRITING
    outcome = planner.finish(demotion, run(jobs, demotion))
    assert outcome.stored == {"remote": [k(0)]} and outcome.dropped == {"host": [k(0)]}
    assert remote.state(k(0)) is BlockState.READY and host.usage().used == 0


def test_write_through_hops_stop_above_the_store_and_copies_reach_it_from_host(jobs):
    planner = with_remote(jobs, ("host", "host", 4), ("disk", "disk", 4))
    host, disk, remote = planner.tiers
    plan = planner.store([k(0), k(1)], [3, 4], hops=2).plan
    assert [c.dst.tier for stage in plan.stages for c in stage] == ["host", "disk"]  # not the store
    assert planner.copy_targets(0, write_through=True) == [1, 2]
    assert planner.copy_targets(0, write_through=False) == [2]  # the store's own placement
    assert planner.copy_targets(1, write_through=True) == []  # the store is reached from host memory only
    planner.finish(plan, run(jobs, plan))
    copy = planner.copy_down(0, [k(0), k(1)], 2).plan
    rows = numbered([k(0), k(1)], host.slots([k(0), k(1)]), [None] * 2)
    assert copy.stages == ((copy_of("host", "remote", rows),),)
    assert remote.leaks()["writing"] == 2 and host.leaks()["pinned"] == 2
    outcome = planner.finish(copy, run(jobs, copy, failed=[1]))
    assert outcome.stored == {"remote": [k(0)]} and remote.stats.aborted == 1  # a counted drop
    assert planner.copy_down(0, [k(0), k(1)], 2).plan.keys == (k(1),)  # k(0) is known present: not sent again
    assert with_remote(jobs, ("host", "host", 4), placement="write_back").copy_targets(0, True) == []


def test_slots_a_late_read_may_write_are_quarantined_until_lifted(jobs):
    planner = with_remote(jobs, ("host", "host", 3))
    host, remote = planner.tiers
    known(remote, [k(0), k(1), k(2)])
    plan = planner.load([k(0), k(1), k(2)], [0, 1, 2], "gpu").plan
    staging = host.slots([k(0), k(1), k(2)])
    job = run(jobs, plan, failed=[1, 2], first_stage_failed=[1, 2], quarantined=[1, 2])
    assert job.quarantined_blocks == {1, 2} and jobs.held() == [job]
    outcome = planner.finish(plan, job)
    assert outcome.lost == {1, 2} and outcome.quarantined == {"host": staging[1:]} and outcome.holds
    # the keys left (a later load of them is not held up), the slots did not: nobody gets them
    assert host.state(k(1)) is BlockState.FREE and host.usage() == Usage(3, 3)
    assert host.leaks()["writing"] == 2 and host.reserve([k(5)], allow_evict=False) is None
    host.check_invariants()
    lifted = []
    jobs.when_lifted(job, lambda j: (planner.lift(outcome), lifted.append(j.id)))
    report = WorkerReport()
    report.lift(job.id)
    jobs.apply(report)
    assert lifted == [job.id] and jobs.held() == [] and host.usage() == Usage(1, 3)
    assert host.leaks() == {"pinned": 0, "writing": 0}
    host.check_invariants()


def test_sources_a_late_write_may_read_stay_pinned_until_lifted(jobs):
    planner = with_remote(jobs, ("host", "host", 3))
    host, remote = planner.tiers
    fill(host, [k(0), k(1)])
    plan = planner.copy_down(0, [k(0), k(1)], 1).plan
    outcome = planner.finish(plan, run(jobs, plan, failed=[0, 1], quarantined=[0, 1]))
    assert outcome.held == {"host": [k(0), k(1)]} and remote.stats.aborted == 2
    assert host.leaks()["pinned"] == 2 and planner.make_room(0, 3).dropped == {}  # pinned: not victims
    planner.lift(outcome)
    assert host.leaks()["pinned"] == 0 and planner.make_room(0, 3).dropped == {"host": [k(0), k(1)]}


def test_a_quarantined_demotion_keeps_its_victim_until_lifted(jobs):
    planner = with_remote(jobs, ("host", "host", 1), placement="write_back")
    host, remote = planner.tiers
    fill(host, [k(0)])
    (demotion,) = planner.make_room(0, 1).demotions
    outcome = planner.finish(demotion, run(jobs, demotion, failed=[0], quarantined=[0]))
    assert outcome.held == {"host": [k(0)]} and host.state(k(0)) is BlockState.READY
    assert remote.state(k(0)) is BlockState.FREE and host.leaks()["pinned"] == 1
    planner.lift(outcome)
    assert host.leaks()["pinned"] == 0 and host.usage().evicting == 0
    host.check_invariants()


# --- admission -----------------------------------------------------------------------------------


class DeclineListed(LRUPolicy):
    """LRU that does not admit the keys in ``declined`` (the planner only sees ``admit``'s answers)."""

    def __init__(self, declined: set[bytes]) -> None:
        super().__init__()
        self.declined = declined
        self.asked: list[bytes] = []

    def admit(self, key: bytes) -> bool:
        self.asked.append(key)
        return key not in self.declined


def declining_disk(jobs: JobManager, declined: set[bytes], host: int = 4, disk: int = 8) -> Planner:
    host_tier, disk_tier = tiers(jobs, ("host", "host", host), ("disk", "disk", disk))
    disk_tier.policy = DeclineListed(declined)
    return Planner([host_tier, disk_tier])


def test_a_declined_victim_leaves_at_once_and_reserves_nothing_below(jobs):
    planner = declining_disk(jobs, {k(0)})
    host, disk = planner.tiers
    fill(host, [k(0), k(1), k(2), k(3)])
    room = planner.make_room(0, 2)
    assert room.dropped == {"host": [k(0)]}  # declined below: dropped like a clean victim
    assert [p.keys for p in room.demotions] == [(k(1),)] and room.pending == 1
    assert disk.usage() == Usage(1, 8, 0) and disk.stats.declined == 1 and disk.policy.asked == [k(0), k(1)]
    planner.finish(room.demotions[0], run(jobs, room.demotions[0]))
    for tier in planner.tiers:
        tier.check_invariants()
        assert tier.leaks() == {"pinned": 0, "writing": 0}


def test_write_through_hops_stop_at_the_first_declined_block_and_a_later_store_is_asked_again(jobs):
    planner = declining_disk(jobs, {k(1)})
    host, disk = planner.tiers
    plan = planner.store([k(0), k(1), k(2)], [10, 11, 12], hops=1).plan
    (into_host,), (into_disk,) = plan.stages
    assert into_host.keys == (k(0), k(1), k(2)) and into_disk.keys == (k(0),)  # a chain: k(2) needs k(1)
    assert disk.stats.declined == 1 and disk.usage().used == 1
    outcome = planner.finish(plan, run(jobs, plan))
    assert outcome.stored == {"host": [k(0), k(1), k(2)], "disk": [k(0)]}
    for tier in planner.tiers:
        tier.check_invariants()
        assert tier.leaks() == {"pinned": 0, "writing": 0}
    disk.policy.declined.clear()  # the policy changes its mind: the same keys are simply asked again
    plan = planner.copy_down(0, [k(0), k(1), k(2)]).plan
    assert plan.keys == (k(1), k(2))
    planner.finish(plan, run(jobs, plan))
    assert disk.lookup([k(0), k(1), k(2)]) == 3 and disk.stats.declined == 1


def test_copy_down_leaves_out_what_the_target_declines(jobs):
    planner = declining_disk(jobs, {k(0)})
    host, disk = planner.tiers
    fill(host, [k(0), k(1)])
    plan = planner.copy_down(0, [k(0), k(1)]).plan
    assert plan.keys == (k(1),) and host.leaks()["pinned"] == 1  # the declined source is not even pinned
    planner.finish(plan, run(jobs, plan))
    assert disk.state(k(0)) is BlockState.FREE and disk.state(k(1)) is BlockState.READY
    assert host.leaks()["pinned"] == 0
