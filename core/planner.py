"""The planner: the one place that decides which blocks go where in a stack of tiers.

It works over the ordered tiers (fastest first; under vLLM the tiers below vLLM's own GPU blocks) and
answers each request with plain data:

- ``make_room(i, n)``: victims of tier i chosen by its policy; clean ones (the tier below holds them)
  and those of the last tier are dropped at once, dirty ones get a demotion into the tier below,
  trimmed to the room there. Returns the keys dropped per tier (eviction events come from them), the
  demotion plans to run, and how many slots are still on their way (``Room.pending``).
- ``store(keys, src_slots, hops)``: reserve the first tier for the caller's blocks (a prefix when room
  runs out: a full tier stores less), and with ``hops`` the tiers below too, as later stages.
- ``load(keys, dst_slots, dst_medium)``: pin the longest prefix some tier holds, staging through an
  intermediate tier where the route (``core/routes.py``) says so.
- ``copy_down(i, keys, target)``: copy blocks of tier i the target tier (the next by default) lacks
  into it; ``copy_targets(i, write_through)`` says which tiers get such copies after a write to i.
- ``lookup(keys, dst_medium)``: which tier serves each leading key, and what a load would stage.
- ``finish(plan, job)``: once the plan's job is final, commit what arrived, abort the rest, release
  the sources, end demotions; returns what each tier stored and dropped (``Outcome``), and the
  memory a store call past its deadline may still touch, kept out of use until ``lift``.

A remote tier (``Tier.by_key``: a store shared with other engines, the last tier) has no slots and
evicts by itself. Its copies name keys; loads from it stage through the host tier, never into the
caller's blocks, because a read that outlived its deadline may still write into its destination and
only a tier's slot can be kept out of use until it no longer can, unless the tier ``loads_direct``
(its clients fetch into memory of their own: Redis in a stack); it never gives up victims, and
takes demotions only when placed write-back (``Tier.takes_demotions``). Placed write-through, blocks
reach it from the host tier by a plan of their own once they are there (``copy_targets``): a store's
job never waits on the network.

A plan is one job: stages of ``Copy`` specs run one after the other (a block lost in one stage is left
out of the later ones), with the fences that keep its slots from being reused meanwhile. The planner
changes the tiers' index as planning must (reserve, pin, evict) but holds no bytes, starts no thread
and never waits: where room is on its way (victims whose demotion is in flight) it says so and each
executor decides. ``TierStack`` waits and asks again; the vLLM scheduler side, which cannot wait
inside a hook, asks again at the next step.

A copy's endpoint is a tier's slots or the caller's own blocks (``ENGINE``: vLLM's GPU blocks, a
stack caller's buffer); its slots may be absent, for a store that is not ours and is addressed by key.

Why a block is not in a tier, for the miss attribution (``core/misses.py``), is recorded here too, in
the planner's ``ghost`` index, where it happens: victims evicted, blocks the admission policy declined,
stores that did not land (no room, refused, failed, quarantined), loads that failed (damaged).

Thread safety: every tier call takes that tier's lock. An executor plans from one thread at a time
(the stack under its lock); ``finish`` may run meanwhile on a completion thread: it only commits,
aborts, unpins, discards and ends evictions, each under the tier's lock.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvtier.core.devices import HOST, Capabilities
from kvtier.core.errors import TransferError
from kvtier.core.jobs import Fence, Job, JobState
from kvtier.core.layout import BlockLayout
from kvtier.core.misses import GhostIndex, MissReason
from kvtier.core.routes import plan_route
from kvtier.core.storage import BlockStorage
from kvtier.core.tier import BlockState, Tier

ENGINE: None = None
"""The endpoint name of the caller's own blocks (vLLM's GPU blocks, a stack caller's buffer): no tier."""

Row = tuple[int, bytes, int | None, int | None]
"""One block of a copy: (its index in the plan, its key, source slot, destination slot; None for a side
addressed by key)."""
Slots = Sequence[int | None]


class Endpoint(NamedTuple):
    """One side of a copy: ``slots`` of tier ``tier`` (``ENGINE``: the caller's own blocks). ``slots``
    None addresses the blocks by key alone, as a store that is not ours must. (The plan types are
    named tuples: the vLLM scheduler side builds and pickles them every step.)"""

    tier: str | None
    slots: tuple[int, ...] | None

    def pick(self, keep: Sequence[int]) -> Endpoint:
        return Endpoint(self.tier, None if self.slots is None else tuple(self.slots[i] for i in keep))


class Copy(NamedTuple):
    """Blocks from ``src`` to ``dst``: block i has key ``keys[i]`` (a disk slot records it) and index
    ``blocks[i]`` in its plan (a failure is reported against that index)."""

    src: Endpoint
    dst: Endpoint
    keys: tuple[bytes, ...]
    blocks: tuple[int, ...]

    def keys_in(self, blocks: set[int]) -> list[bytes]:
        """Keys of the blocks this copy moves that are among ``blocks``."""
        if not blocks:
            return []
        return [key for key, b in zip(self.keys, self.blocks, strict=True) if b in blocks]

    def keys_not_in(self, blocks: set[int]) -> list[bytes]:
        """Keys of the blocks this copy moves that are not among ``blocks`` (all of them, at once, for none)."""
        if not blocks:
            return list(self.keys)
        return [key for key, b in zip(self.keys, self.blocks, strict=True) if b not in blocks]

    def only(self, blocks: Collection[int]) -> Copy | None:
        """The part of this copy that moves the given plan blocks (None when nothing is left)."""
        keep = [i for i, b in enumerate(self.blocks) if b in blocks]
        if len(keep) == len(self.blocks):
            return self
        if not keep:
            return None
        return Copy(
            self.src.pick(keep),
            self.dst.pick(keep),
            tuple(self.keys[i] for i in keep),
            tuple(self.blocks[i] for i in keep),
        )


def copy_of(src: str | None, dst: str | None, rows: Iterable[Row]) -> Copy:
    """The one place a ``Copy`` is built, from its rows (plan block, key, source slot, destination slot)."""
    blocks, keys, src_slots, dst_slots = zip(*rows, strict=True)
    return Copy(Endpoint(src, _slots(src_slots)), Endpoint(dst, _slots(dst_slots)), keys, blocks)


def numbered(keys: Sequence[bytes], src_slots: Slots, dst_slots: Slots) -> list[Row]:
    """Rows for plan blocks 0, 1, ... as far as all three go (a prefix: a full tier stores less)."""
    return list(zip(range(len(keys)), keys, src_slots, dst_slots, strict=False))


def _slots(slots: tuple[int | None, ...]) -> tuple[int, ...] | None:
    """A side's slots, or None when the side has none (addressed by key)."""
    return None if None in slots else slots  # type: ignore[return-value]


class Plan(NamedTuple):
    """One job: ``kind`` ("store", "load" or "demote"), block i's key, the stages of copies, and the
    fences on every tier slot it reads or writes."""

    kind: str
    keys: tuple[bytes, ...]
    stages: tuple[tuple[Copy, ...], ...]
    fences: tuple[Fence, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.keys)


def plan_of(kind: str, keys: Sequence[bytes], stages: Sequence[Sequence[Copy]]) -> Plan:
    """A plan with the fences its copies need: a tier slot a copy writes is fenced for writing, one
    it only reads for reading; the caller's blocks and slots addressed by key have no fence here."""
    copies = [c for stage in stages for c in stage]
    written: dict[str, set[int]] = {}
    fences: list[Fence] = []
    for copy in copies:
        tier, slots = copy.dst
        if tier is not None and slots is not None:
            fences.extend([Fence(tier, slot, True) for slot in slots])
            written.setdefault(tier, set()).update(slots)
    for copy in copies:
        tier, slots = copy.src
        if tier is not None and slots is not None:
            also = written.get(tier, ())
            fences.extend([Fence(tier, slot, False) for slot in slots if slot not in also])
    return Plan(kind, tuple(keys), tuple(tuple(stage) for stage in stages), tuple(fences))


@dataclass
class Room:
    """What making room did: ``dropped`` keys per tier (they left it now), ``demotions`` to run (their
    victims leave when the copies land), and ``pending``: slots of the tier asked for that are on
    their way (victims being demoted, or kept until room below them lands)."""

    dropped: dict[str, list[bytes]] = field(default_factory=dict)
    demotions: list[Plan] = field(default_factory=list)
    pending: int = 0

    def drop(self, tier: Tier, keys: list[bytes]) -> None:
        if keys:
            self.dropped.setdefault(tier.name, []).extend(keys)


@dataclass
class Planned:
    """A request's answer: its ``plan`` (no blocks when nothing could be planned), the ``room`` made
    for it, for a load the tier index each planned block is read from, and for a store how many
    trailing keys the first tier's policy ``declined`` (``Tier.admit``). A caller must not offer those
    again for the same use: a policy takes a key asked about twice as a block seen twice."""

    plan: Plan
    room: Room
    sources: tuple[int, ...] = ()
    declined: int = 0


@dataclass(frozen=True)
class Lookup:
    """The leading keys some tier holds: the index of the tier serving each (the fastest holding it
    READY), and per staging tier how many of them a load would stage through it. ``hits`` None means
    "not known yet, ask again": a block of the prefix is being written into its staging tier."""

    hits: int | None
    sources: tuple[int, ...]
    staging: dict[int, int]


@dataclass
class Outcome:
    """What a finished plan did: the plan blocks ``lost`` (the caller recomputes them), the keys each
    tier ``stored`` and ``dropped``, and the blocks each tier served a load (``served``).

    Blocks the job quarantined (a remote store's call past its deadline may still touch their memory)
    are lost too, and their memory stays out of use until ``Planner.lift(outcome)``: the slots a read
    may still write into (``quarantined``, per tier: taken, holding no key) and the source blocks a
    write may still read (``held``, per tier: kept pinned)."""

    lost: set[int]
    stored: dict[str, list[bytes]] = field(default_factory=dict)
    dropped: dict[str, list[bytes]] = field(default_factory=dict)
    served: dict[str, int] = field(default_factory=dict)
    quarantined: dict[str, list[int]] = field(default_factory=dict)
    held: dict[str, list[bytes]] = field(default_factory=dict)

    @property
    def holds(self) -> bool:
        """Whether memory stays out of use until ``Planner.lift``."""
        return bool(self.quarantined or self.held)


class SlotCount(BlockStorage):
    """The slots of a tier whose bytes live elsewhere (the vLLM scheduler side's tiers: the workers
    hold the bytes): only the count and the geometry; asking for an address is a bug and raises."""

    def __init__(self, layout: BlockLayout, num_slots: int) -> None:
        super().__init__(layout, num_slots, "elsewhere")

    def _addresses(self, slots):
        raise TransferError("this storage holds no KV bytes; whoever holds them addresses the slots")


class Planner:
    """The brain over ``tiers`` (fastest first); ``route`` and ``capabilities`` decide which loads stage."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        route: Callable[[str, str, Capabilities], tuple[str, ...]] = plan_route,
        capabilities: Capabilities | None = None,
        ghost: GhostIndex | None = None,
    ) -> None:
        self.tiers = list(tiers)
        self._by_name = {tier.name: tier for tier in self.tiers}
        self._index = {tier.name: i for i, tier in enumerate(self.tiers)}
        self.ghost = ghost or GhostIndex(len(self.tiers))
        self._route = route
        self._capabilities = capabilities or Capabilities()
        self._staging: dict[str, tuple[int | None, ...]] = {}

    def tier(self, name: str) -> Tier:
        return self._by_name[name]

    # --- what is where -------------------------------------------------------------------------

    def is_new(self, key: bytes) -> bool:
        """No tier holds the block or is writing it: a store of it would add something."""
        for tier in self.tiers:
            if tier.state(key) is not BlockState.FREE:
                return False
        return True

    def lookup(self, keys: Sequence[bytes], dst_medium: str | None = None) -> Lookup:
        """The leading keys some tier holds READY (touching nothing), and with ``dst_medium`` what a
        load there would stage, per staging tier. The first tier's run is found in one call."""
        stage_of = self.staging(dst_medium) if dst_medium is not None else (None,) * len(self.tiers)
        sources = [0] * (self.tiers[0].lookup(keys) if stage_of[0] is None else 0)
        staging: dict[int, int] = {}
        for key in keys[len(sources) :]:
            index = self._ready_in(key)
            if index is None:
                break
            stage = stage_of[index]
            if stage is not None:
                if self.tiers[stage].state(key) is BlockState.WRITING:
                    return Lookup(None, tuple(sources), staging)
                staging[stage] = staging.get(stage, 0) + 1
            sources.append(index)
        return Lookup(len(sources), tuple(sources), staging)

    def _ready_in(self, key: bytes) -> int | None:
        """The index of the fastest tier holding ``key`` READY, or None."""
        for index, tier in enumerate(self.tiers):
            if tier.state(key) is BlockState.READY:
                return index
        return None

    def staging(self, dst_medium: str) -> tuple[int | None, ...]:
        """Per tier, the index of the tier a load into ``dst_medium`` stages through (None: it copies
        there directly). Raises TransferError for a route with more than one staging hop or through
        a medium no tier has, before anything is pinned."""
        stage_of = self._staging.get(dst_medium)
        if stage_of is None:
            stage_of = self._staging[dst_medium] = tuple(self._stage_for(t, dst_medium) for t in self.tiers)
        return stage_of

    def _stage_for(self, tier: Tier, dst_medium: str) -> int | None:
        route = self._route(tier.medium, dst_medium, self._capabilities)
        if len(route) > 3:
            raise TransferError(f"route {' -> '.join(route)} has more than one staging hop")
        if len(route) == 2 and tier.by_key and not tier.loads_direct:
            route = (route[0], HOST, route[1])  # into a slot kvtier can keep out of use, never the caller's
        if len(route) == 2:
            return None
        index = next((i for i, t in enumerate(self.tiers) if t.medium == route[1]), None)
        if index is None:
            raise TransferError(f"the route needs a {route[1]} tier to stage through, and the stack has none")
        return index

    # --- room ----------------------------------------------------------------------------------

    def make_room(self, index: int, n: int) -> Room:
        """Make ``n`` slots of tier ``index`` free, counting slots whose demotion is in flight as
        free (a retry before they land evicts nothing more). See ``_make_room``."""
        room = Room()
        room.pending = self._make_room(index, n, room)
        return room

    def relieve(self, index: int) -> Room:
        """Bring tier ``index`` from above its watermark's high mark down to the low mark: the
        excess, less the victims already being demoted (they leave when their copies land)."""
        tier = self.tiers[index]
        excess = tier.excess()
        return self.make_room(index, tier.usage().free + excess) if excess > 0 else Room()

    def _make_room(self, index: int, n: int, room: Room) -> int:
        """Evict what ``n`` free slots of tier ``index`` still lack, into ``room``; returns the slots
        of the tier on their way.

        Victims come from the tier's policy. Those the next tier holds (clean) or its policy does not
        admit, and those of the last tier or of one whose next tier takes no demotions, are dropped at
        once; the others (dirty) get slots below (making room there the same way) and a demotion plan,
        trimmed to those slots.
        Dirty victims that found no slot are kept when room below is on its way (write-back loses
        nothing a lower tier could take), dropped otherwise ("a full tier stores less").
        """
        tier = self.tiers[index]
        if tier.by_key:
            return 0  # a store evicts by itself
        usage = tier.usage()
        short = n - usage.free - usage.evicting
        if short <= 0:
            return usage.evicting
        if index + 1 == len(self.tiers) or not self.tiers[index + 1].takes_demotions:
            self._evicted(index, tier.evict(short), room)
            return tier.usage().evicting
        lower = self.tiers[index + 1]
        victims = [key for key, _ in tier.begin_evict(short)]
        dirty = [key for key in victims if lower.state(key) is BlockState.FREE]
        clean = [key for key in victims if lower.state(key) is not BlockState.FREE]
        admitted = self._admits(index + 1, dirty)
        clean += [key for key, ok in zip(dirty, admitted, strict=True) if not ok]
        dirty = [key for key, ok in zip(dirty, admitted, strict=True) if ok]
        self._evicted(index, tier.end_evict(clean), room)
        slots, below_pending = self._reserve(index + 1, dirty, room)
        rest = dirty[len(slots) :]
        if rest and below_pending:
            tier.end_evict(rest, drop=False)
        else:
            lost = tier.end_evict(rest)
            self._evicted(index, lost, room)
            self.ghost.record(index + 1, lost, MissReason.DROPPED)  # no room below for them
        if slots:
            room.demotions.append(self._demotion(index, dirty[: len(slots)], slots))
        return tier.usage().evicting + (len(rest) if below_pending else 0)

    def _evicted(self, index: int, keys: list[bytes], room: Room) -> None:
        """Victims of tier ``index``'s policy that left it now."""
        room.drop(self.tiers[index], keys)
        self.ghost.record(index, keys, MissReason.EVICTED)

    def _reserve(self, index: int, keys: Sequence[bytes], room: Room) -> tuple[list[int | None], int]:
        """Slots of tier ``index`` for a prefix of ``keys`` (room made first; as many as are free
        then), and the slots of the tier still on their way."""
        if not keys:
            return [], 0
        if not self.tiers[index].by_key:
            self.tiers[index].expect(keys)
        pending = self._make_room(index, len(keys), room)
        return self._take_free(index, keys), pending

    def _reserve_or_drop(self, index: int, keys: Sequence[bytes], room: Room) -> list[int | None]:
        """``_reserve`` for a store into tier ``index``: the keys past the room it found are dropped."""
        slots, _ = self._reserve(index, keys, room)
        self.ghost.record(index, keys[len(slots) :], MissReason.DROPPED)
        return slots

    def _admits(self, index: int, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether tier ``index``'s policy admits it (``Tier.admit``). A tier addressed by key
        has no policy of ours: it takes everything."""
        if not keys or self.tiers[index].by_key:
            return [True] * len(keys)
        verdicts = self.tiers[index].admit(keys)
        self.ghost.record(index, [k for k, ok in zip(keys, verdicts, strict=True) if not ok], MissReason.DECLINED)
        return verdicts

    def _admitted_prefix(self, index: int, keys: Sequence[bytes]) -> Sequence[bytes]:
        """The leading keys tier ``index``'s policy admits: a store is a prefix of a chain, and a block
        after a declined one could never be a hit there without it."""
        admitted = self._admits(index, keys)
        return keys[: admitted.index(False)] if False in admitted else keys

    def _take_free(self, index: int, keys: Sequence[bytes]) -> list[int | None]:
        """Reserve free slots of tier ``index`` for the leading keys that fit, evicting nothing (all of
        them in a tier addressed by key: it has no slots, its store makes room by itself)."""
        tier = self.tiers[index]
        if tier.by_key:
            return [None] * len(keys) if keys and tier.reserve(keys) is not None else []
        fit = min(len(keys), tier.usage().free)
        return list(tier.reserve(keys[:fit], allow_evict=False) or []) if fit else []

    def _slots_of(self, tier: Tier, keys: Sequence[bytes]) -> Slots:
        """The slots of blocks present in ``tier`` (None each in a tier addressed by key)."""
        return [None] * len(keys) if tier.by_key else tier.slots(keys)

    def _demotion(self, index: int, keys: list[bytes], dst_slots: Slots) -> Plan:
        """Copy victims of tier ``index`` (kept readable while they move) into reserved slots below."""
        tier, lower = self.tiers[index], self.tiers[index + 1]
        return plan_of("demote", keys, [[copy_of(tier.name, lower.name, numbered(keys, tier.slots(keys), dst_slots))]])

    # --- requests ------------------------------------------------------------------------------

    def store(self, keys: Sequence[bytes], src_slots: Sequence[int], hops: int = 0) -> Planned:
        """Copy the caller's blocks ``src_slots`` into the first tier under ``keys``, which no tier
        may hold (``is_new``), and on into the next ``hops`` tiers as later stages (write-through in
        one job). A full tier stores less: the plan covers the prefix the first tier has room for and
        its policy admits (``Tier.admit``), each hop the prefix of that which the tier below has room
        for and admits. Hops end above a tier addressed by key: a remote store gets its copies by plans
        of their own (``copy_targets``)."""
        room = Room()
        admitted = self._admitted_prefix(0, keys)
        declined = len(keys) - len(admitted)
        slots = self._reserve_or_drop(0, admitted, room)
        keys = keys[: len(slots)]
        stages = [[copy_of(ENGINE, self.tiers[0].name, numbered(keys, src_slots, slots))]] if slots else []
        for index in range(1, min(hops, len(self.tiers) - 1) + 1):
            if self.tiers[index].by_key:
                break
            below = self._reserve_or_drop(index, self._admitted_prefix(index, keys[: len(slots)]), room)
            if not below:
                break
            stages.append([copy_of(self.tiers[index - 1].name, self.tiers[index].name, numbered(keys, slots, below))])
            slots = below
        return Planned(plan_of("store", keys, stages), room, declined=declined)

    def copy_targets(self, index: int, write_through: bool) -> list[int]:
        """The tiers that blocks just written into tier ``index`` are copied on to, each by a plan of its
        own (``copy_down``): under ``write_through`` the next tier, unless it is addressed by key; and
        a remote tier that takes no demotions (placed write-through) from the host tier, so blocks
        reach the shared store as soon as they are in host memory, whatever the stack's placement."""
        targets = []
        below = index + 1
        if write_through and below < len(self.tiers) and not self.tiers[below].by_key:
            targets.append(below)
        if self.tiers[index].medium == HOST:
            targets += [i for i, t in enumerate(self.tiers) if t.by_key and not t.takes_demotions and i > index]
        return targets

    def lacking(self, index: int, keys: Sequence[bytes], target: int) -> list[bytes]:
        """The keys READY in tier ``index`` that tier ``target`` does not hold (what a copy down moves)."""
        tier, lower = self.tiers[index], self.tiers[target]
        return [k for k in keys if tier.state(k) is BlockState.READY and lower.state(k) is BlockState.FREE]

    def copy_down(self, index: int, keys: Sequence[bytes], target: int | None = None) -> Planned:
        """Copy the READY blocks of tier ``index`` that tier ``target`` (the next one by default) lacks
        into it (a write-through hop of its own, and the copy to disk at close); they stay pinned
        until the plan finishes. Blocks the target's policy does not admit are left out (``Tier.admit``),
        and the target takes a prefix of the rest when its room runs out."""
        target = index + 1 if target is None else target
        tier, lower = self.tiers[index], self.tiers[target]
        keys = self.lacking(index, keys, target)
        keys = [k for k, ok in zip(keys, self._admits(target, keys), strict=True) if ok]
        room = Room()
        if not keys:
            return Planned(plan_of("store", [], []), room)
        src_slots = tier.pin(keys)
        slots = self._reserve_or_drop(target, keys, room)
        tier.unpin(keys[len(slots) :])
        keys = keys[: len(slots)]
        stages = [[copy_of(tier.name, lower.name, numbered(keys, src_slots, slots))]] if keys else []
        return Planned(plan_of("store", keys, stages), room)

    def load(self, keys: Sequence[bytes], dst_slots: Sequence[int], dst_medium: str) -> Planned:
        """Bring the longest prefix of ``keys`` some tier holds into the caller's blocks ``dst_slots``
        (of medium ``dst_medium``).

        Each source is pinned in the fastest tier holding it. A block whose route stages through
        another tier gets a slot there (committed when it arrives, so it stays cached there), and
        the plan has two stages: into the staging tiers, then everything into ``dst_slots``. The plan
        stops at the first block it cannot bring: absent everywhere, already being written into its
        staging tier, or left without a staging slot; the caller recomputes from there.
        """
        stage_of = self.staging(dst_medium)
        run, sources, slots = self._pin_prefix(keys)
        stop = len(sources)
        wanted: dict[int, list[int]] = {}  # staging tier -> plan blocks staged through it
        for i in range(0 if stage_of[0] is not None else run, len(sources)):
            stage = stage_of[sources[i]]
            if stage is not None:
                if self.tiers[stage].state(keys[i]) is not BlockState.FREE:
                    stop = i
                    break
                wanted.setdefault(stage, []).append(i)
        room = Room()
        staged: dict[int, dict[int, int | None]] = {}  # staging tier -> plan block -> its slot there
        for stage, blocks in wanted.items():
            blocks = [b for b in blocks if b < stop]
            got, _ = self._reserve(stage, [keys[b] for b in blocks], room)
            staged[stage] = dict(zip(blocks, got, strict=False))  # the blocks that got a slot
            if len(got) < len(blocks):
                stop = blocks[len(got)]
        self._release_past(keys, sources, staged, stop)
        sources, slots = sources[:stop], slots[:stop]
        stages = self._load_stages(keys, dst_slots, sources, slots, min(run, stop), stage_of, staged)
        return Planned(plan_of("load", keys[:stop], stages), room, tuple(sources))

    def _pin_prefix(self, keys: Sequence[bytes]) -> tuple[int, list[int], list[int | None]]:
        """Pin the longest prefix of ``keys`` held READY somewhere, each block in the fastest tier that
        holds it (found and pinned in one step: completions may evict meanwhile). Returns how many
        lead from the first tier (pinned in one call), and each block's tier index and slot there."""
        slots: list[int | None] = list(self.tiers[0].pin_leading(keys))
        run = len(slots)
        sources = [0] * run
        for key in keys[run:]:
            index = next((i for i, tier in enumerate(self.tiers) if tier.try_pin(key)), None)
            if index is None:
                break
            sources.append(index)
            slots.append(self._slots_of(self.tiers[index], [key])[0])
        return run, sources, slots

    def _release_past(
        self, keys: Sequence[bytes], sources: list[int], staged: dict[int, dict[int, int | None]], stop: int
    ) -> None:
        """Unpin the sources, and abort the staging slots, of the blocks from ``stop`` on (not loaded)."""
        for stage, slots in staged.items():
            past = [b for b in slots if b >= stop]
            self.tiers[stage].abort([keys[b] for b in past])
            for b in past:
                del slots[b]
        for i in range(stop, len(sources)):
            self.tiers[sources[i]].unpin([keys[i]])

    def _load_stages(
        self,
        keys: Sequence[bytes],
        dst_slots: Sequence[int],
        sources: list[int],
        slots: Slots,
        run: int,
        stage_of: tuple[int | None, ...],
        staged: dict[int, dict[int, int | None]],
    ) -> list[list[Copy]]:
        """A load's copies: first into the staging tiers (per source and staging tier), then from the
        tier each block ends up in (its source or its staging tier) into the caller's blocks. The
        first ``run`` blocks come from the first tier, in one piece unless that tier stages."""
        into_stage: dict[tuple[int, int], list[Row]] = {}
        out: dict[int, list[Row]] = {}
        if run and stage_of[0] is None:
            out[0] = numbered(keys, slots[:run], dst_slots)
        else:
            run = 0
        for i in range(run, len(sources)):
            index, slot = sources[i], slots[i]
            stage = stage_of[index]
            if stage is None:
                out.setdefault(index, []).append((i, keys[i], slot, dst_slots[i]))
            else:
                into_stage.setdefault((index, stage), []).append((i, keys[i], slot, staged[stage][i]))
                out.setdefault(stage, []).append((i, keys[i], staged[stage][i], dst_slots[i]))
        first = [copy_of(self.tiers[src].name, self.tiers[dst].name, rows) for (src, dst), rows in into_stage.items()]
        last = [copy_of(self.tiers[src].name, ENGINE, rows) for src, rows in out.items()]
        return [stage for stage in (first, last) if stage]

    # --- outcomes ------------------------------------------------------------------------------

    def finish(self, plan: Plan, job: Job, pin_stored: Collection[str] = ()) -> Outcome:
        """Apply a final job's result to the tiers and say what changed.

        Every tier a copy wrote commits the blocks that arrived there and aborts the others (naming
        first those the job reports refused for good, see ``Tier.refuse``). In the tiers named in
        ``pin_stored`` they are committed pinned, in the same step: a caller that copies them on later
        (``copy_targets``, from another thread) keeps them from being evicted before that copy is
        planned, and unpins them then. Then the tiers the plan read from let go: sources pinned for
        a store or a load are unpinned, a demotion's victims end (``Tier.end_demotion``), and a load
        drops, from each tier it read, the blocks whose copy out of it failed (unreadable: a miss now
        and later). Bytes read out of a source for blocks that reached the end count as
        ``bytes_out``; for a load, also as ``hits``.

        A block arrived at stage k unless it was lost by then: the job's first-stage failures tell
        the first stage of a staged job apart; later stages count every failure (exact for the two
        stages of every route and write-through hop today, conservative beyond).
        """
        lost = job.lost_blocks
        last = len(plan.stages) - 1
        lost_by_stage = [lost] if last <= 0 else [job.lost_in_first_stage] + [lost - job.lost_in_first_stage] * last
        refused = set() if job.state is JobState.CANCELLED else job.refused_blocks
        outcome = Outcome(lost)
        named: set[bytes] = set()  # keys a destination refused for good
        written: dict[str, set[int]] = {}  # tier -> plan blocks a copy of this plan wrote there
        for k, stage in enumerate(plan.stages):
            gone = lost_by_stage[0] if k == 0 else lost
            for copy in stage:
                if copy.dst.tier is not None:
                    held = self._held_by(copy, copy.src.tier, job)
                    tier = self.tier(copy.dst.tier)
                    named |= self._land(tier, copy, gone, refused, held, outcome, tier.name in pin_stored)
                    self._note_landed(plan.kind, copy, gone)
                    written.setdefault(copy.dst.tier, set()).update(copy.blocks)
        for k, stage in enumerate(plan.stages):
            for copy in stage:
                if copy.src.tier is not None:
                    held = self._held_by(copy, copy.dst.tier, job)
                    self._let_go(
                        self.tier(copy.src.tier),
                        plan.kind,
                        copy,
                        written.get(copy.src.tier, set()),
                        lost,
                        lost_by_stage[k],
                        named,
                        held,
                        outcome,
                    )
        return outcome

    def lift(self, outcome: Outcome) -> None:
        """Put back into use the memory a finished plan's quarantine kept out of it (``Outcome``): once
        the store calls that might have touched it have really returned."""
        for name, slots in outcome.quarantined.items():
            self.tier(name).lift_quarantine(slots)
        for name, keys in outcome.held.items():
            self.tier(name).unpin(keys)

    def _held_by(self, copy: Copy, other: str | None, job: Job) -> set[int]:
        """The blocks of ``copy`` whose memory on this side stays out of use: those the job quarantined,
        when the other side is a store addressed by key (its call may still touch them)."""
        if not job.quarantined_blocks or other is None or not self.tier(other).by_key:
            return set()
        return job.quarantined_blocks & set(copy.blocks)

    def _note_landed(self, kind: str, copy: Copy, gone: set[int]) -> None:
        """Ghost entries of a copy into a tier: what arrived is there now; a store's or a demotion's
        blocks that did not arrive were dropped (a load's staging copy drops nothing: the block
        stays where it was read from)."""
        index = self._index[copy.dst.tier]  # type: ignore[index]
        self.ghost.forget(index, copy.keys_not_in(gone))
        if kind != "load":
            self.ghost.record(index, copy.keys_in(gone), MissReason.DROPPED)

    @staticmethod
    def _land(
        tier: Tier, copy: Copy, gone: set[int], refused: set[int], held: set[int], outcome: Outcome, pin: bool
    ) -> set[bytes]:
        """Commit the blocks of ``copy`` that arrived in its destination ``tier`` (pinned with ``pin``),
        quarantine the slots of those a read may still write into (``held``), abort the others; returns
        the aborted keys the tier can never hold."""
        arrived, failed, never = copy.keys_not_in(gone), copy.keys_in(gone - held), copy.keys_in(gone & refused)
        if never:
            tier.refuse(never)
            tier.count(incompressible=len(never))
        tier.commit(arrived, pin)
        _add(outcome.stored, tier.name, arrived)
        if held:
            outcome.quarantined.setdefault(tier.name, []).extend(tier.quarantine(copy.keys_in(held)))
        return set(tier.abort(failed)) if failed else set()

    def _let_go(
        self,
        tier: Tier,
        kind: str,
        copy: Copy,
        wrote: set[int],
        lost: set[int],
        lost_here: set[int],
        refused: set[bytes],
        held: set[int],
        outcome: Outcome,
    ) -> None:
        """Release the sources ``copy`` read in ``tier``: those the plan held (pinned or being
        evicted), not the blocks an earlier stage of it wrote there (``wrote``), and not those a write
        may still read (``held``: they stay pinned until ``lift``); a load also drops what failed to
        copy out. Ghost entries: a demotion's victims that leave were evicted; a load's blocks that
        failed are unreadable here (why: what the tier knows once it dropped them, else damaged)."""
        index = self._index[tier.name]
        served = copy.keys_not_in(wrote | lost)
        kept = copy.keys_in(held - wrote)
        _add(outcome.held, tier.name, kept)
        if kind == "demote":
            tier.pin(kept)  # a victim whose copy failed stays; this pin keeps it in place until ``lift``
            failed = copy.keys_in(lost - wrote)
            left = tier.end_demotion(served, failed, [k for k in failed if k in refused])
            self.ghost.record(index, left, MissReason.EVICTED)
            _add(outcome.dropped, tier.name, left)
        else:
            tier.unpin(copy.keys_not_in(wrote | held))
        counts = {"bytes_out": len(served) * tier.block_bytes}
        if kind == "load":
            if lost_here:
                unreadable = copy.keys_in(lost_here)
                _add(outcome.dropped, tier.name, tier.discard(unreadable))
                for key in unreadable:
                    self.ghost.record(index, [key], tier.why_absent(key) or MissReason.DAMAGED)
            if served:
                outcome.served[tier.name] = outcome.served.get(tier.name, 0) + len(served)
            counts["hits"] = len(served)
        tier.count(**counts)


def _add(per_tier: dict[str, list[bytes]], name: str, keys: list[bytes]) -> None:
    if keys:
        per_tier.setdefault(name, []).extend(keys)
