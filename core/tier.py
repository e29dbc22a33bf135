"""The block interface every tier shares: an index of keys to slots, a slot allocator, block states
with explicit reference counts, and an eviction policy.

Block life: ``FREE -> WRITING (reserve) -> READY (commit) -> pinned by readers -> evicted -> FREE``.
Readers only ever see READY blocks. A pinned block (a reader, or a job copying it out) and a WRITING
block (a job copying in) are never evicted. Misuse raises: a double free, an unpin below zero, a commit
of a key that was not reserved.

Thread safety: every public method takes the tier's lock, so a tier may be called from the engine's
thread and from transfer-completion threads at once. The policy is only called under that lock.
"""

from __future__ import annotations

import array
import enum
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvtier.core.errors import CapacityError, DoubleFreeError, FenceError, StateError
from kvtier.core.keys import check_key
from kvtier.core.metrics import TierStats
from kvtier.core.storage import BlockStorage
from kvtier.policies.base import EvictionPolicy
from kvtier.policies.watermark import Watermark


class BlockState(enum.Enum):
    FREE = "free"
    WRITING = "writing"
    READY = "ready"


class SlotAllocator:
    """The free slots of one tier. Refuses a double free and a slot out of range.

    Compact and O(1) per slot at any capacity (a disk tier of 16 M slots restores every one of them at
    start): a byte per slot says whether it is free, and a stack of free slot numbers (machine ints,
    not objects) hands them out; a slot taken by ``claim`` stays in the stack until ``allocate`` pops
    and skips it, instead of being searched for there."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free = array.array("q", range(capacity - 1, -1, -1))  # pop() hands out low slots first
        self._is_free = bytearray(b"\x01") * capacity
        self._num_free = capacity

    @property
    def num_free(self) -> int:
        return self._num_free

    def allocate(self, n: int) -> list[int] | None:
        """``n`` slots, or None (and nothing taken) when fewer are free."""
        if n > self._num_free:
            return None
        slots: list[int] = []
        while len(slots) < n:
            slot = self._free.pop()
            if self._is_free[slot]:  # (else claimed since it was pushed)
                self._is_free[slot] = 0
                slots.append(slot)
        self._num_free -= n
        return slots

    def is_free(self, slot: int) -> bool:
        """Whether ``slot`` is in range and free (False for one out of range)."""
        return 0 <= slot < self.capacity and bool(self._is_free[slot])

    def claim(self, slot: int) -> None:
        """Take one particular free slot (a tier reopening its storage puts recovered blocks back)."""
        if not self.is_free(slot):
            raise StateError(f"slot {slot} is not a free slot of [0, {self.capacity})")
        self._is_free[slot] = 0
        self._num_free -= 1

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.capacity:
            raise StateError(f"slot {slot} is outside [0, {self.capacity})")
        if self._is_free[slot]:
            raise DoubleFreeError(f"slot {slot} is already free")
        self._is_free[slot] = 1
        self._num_free += 1
        self._free.append(slot)


@dataclass(slots=True)
class _Entry:
    slot: int
    state: BlockState
    pins: int = 0
    evicting: bool = False  # chosen as a victim, waiting for its demotion copy; still readable
    refused: bool = False  # WRITING only: the storage can never hold this block (see ``Tier.refuse``)


class Usage(NamedTuple):
    """Slots in use of the tier's capacity (a named tuple: planners ask for it at every decision)."""

    used: int
    capacity: int
    evicting: int = 0  # of ``used``: victims whose copy to the tier below is in flight (their slots free when it lands)

    @property
    def free(self) -> int:
        return self.capacity - self.used

    @property
    def fraction(self) -> float:
        return self.used / self.capacity if self.capacity else 0.0


class Tier:
    """One level of the stack: ``name`` and ``medium`` ("gpu", "host", ...) over a ``storage`` of slots."""

    by_key = False
    """True for a tier whose blocks are addressed by key alone (a store shared with other engines): it
    has no slots, and copies to or from it name keys (``Endpoint.slots`` None)."""
    takes_demotions = True
    """Whether the tier above demotes its victims into this one (a remote tier placed write-through does
    not: blocks reach it from host memory as soon as they are there, by plans of their own)."""

    def __init__(
        self,
        name: str,
        medium: str,
        storage: BlockStorage,
        policy: EvictionPolicy,
        watermark: Watermark | None = None,
        is_fenced: Callable[[str, int], bool] | None = None,
        note: str = "",
    ) -> None:
        self.name = name
        self.medium = medium
        self.storage = storage
        self.policy = policy
        self.watermark = watermark
        self.note = note  # what the medium really is here, e.g. "pageable host memory (no CUDA)"
        self.stats = TierStats()
        self._is_fenced = is_fenced
        self._allocator = SlotAllocator(storage.num_slots)
        self._entries: dict[bytes, _Entry] = {}
        self._pinned: set[bytes] = set()
        self._quarantined: set[int] = set()  # slots a failed write may still land in (see ``quarantine``)
        self._evicting = 0
        self._lock = threading.RLock()

    @property
    def capacity(self) -> int:
        return self._allocator.capacity

    @property
    def block_bytes(self) -> int:
        return self.storage.layout.block_bytes

    def __repr__(self) -> str:
        u = self.usage()
        return (
            f"{type(self).__name__}(name={self.name!r}, medium={self.medium!r}, device={self.storage.device!r}, "
            f"used={u.used}/{u.capacity} blocks of {self.block_bytes} B{', ' + self.note if self.note else ''})"
        )

    # --- reading -------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are READY here. Touches nothing."""
        with self._lock:
            for i, key in enumerate(keys):
                entry = self._entries.get(key)
                if entry is None or entry.state is not BlockState.READY:
                    return i
            return len(keys)

    def query(self, keys: Sequence[bytes]) -> int:
        """How many leading keys the medium itself says it holds: for a local tier its index, ``lookup``;
        a remote tier asks its store (a network round trip, bounded by its timeout)."""
        return self.lookup(keys)

    def state(self, key: bytes) -> BlockState:
        with self._lock:
            entry = self._entries.get(key)
            return BlockState.FREE if entry is None else entry.state

    def pin(self, keys: Sequence[bytes], use: bool = True) -> list[int]:
        """Protect READY blocks from eviction while they are read; returns their slots.

        All or nothing: raises StateError (and pins none) when a key is not READY. Every pin must be
        released with ``unpin``. Counts as a use for the eviction policy, unless ``use`` is False (a
        hold that reads nothing: the read that follows counts).
        """
        with self._lock:
            entries = [self._ready_entry(key) for key in keys]
            for key, entry in zip(keys, entries, strict=True):
                entry.pins += 1
                self._pinned.add(key)
                if use and not entry.evicting:
                    self.policy.touch(key)
            return [e.slot for e in entries]

    def try_pin(self, key: bytes) -> bool:
        """Pin one block if it is READY now; False (nothing pinned) otherwise. Lookup and pin in one
        step, so a block cannot vanish between finding it and protecting it."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.state is not BlockState.READY:
                return False
            self.pin([key])
            return True

    def pin_leading(self, keys: Sequence[bytes]) -> list[int]:
        """Pin the leading run of READY keys and return their slots: ``lookup`` and ``pin`` under one
        lock, so a long run costs one call and no block of it can leave in between."""
        with self._lock:
            return self.pin(keys[: self.lookup(keys)])

    def unpin(self, keys: Iterable[bytes]) -> None:
        """Release pins taken with ``pin``; raises StateError on a key that is not pinned (and releases none)."""
        with self._lock:
            keys = list(keys)
            entries = []
            counts: dict[bytes, int] = {}
            for key in keys:
                counts[key] = counts.get(key, 0) + 1
                entry = self._entries.get(key)
                if entry is None or entry.pins < counts[key]:
                    raise StateError(f"unpin of block {key.hex()[:16]} which is not pinned")
                entries.append(entry)
            for key, entry in zip(keys, entries, strict=True):
                entry.pins -= 1
                if entry.pins == 0:
                    self._pinned.discard(key)

    def ready_keys(self) -> list[bytes]:
        """Keys of every READY block, in the order they became readable."""
        with self._lock:
            return [key for key, entry in self._entries.items() if entry.state is BlockState.READY]

    def slots(self, keys: Sequence[bytes]) -> list[int]:
        """Slots of keys that are present in any state; raises StateError on an absent key."""
        with self._lock:
            out = []
            for key in keys:
                entry = self._entries.get(key)
                if entry is None:
                    raise StateError(f"block {key.hex()[:16]} is not in tier {self.name!r}")
                out.append(entry.slot)
            return out

    # --- writing -------------------------------------------------------------------------------

    def admit(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key about to be written here, whether the policy wants it stored (``EvictionPolicy.admit``);
        counts the declined ones. Reserves nothing, so a declined block leaves no trace in the tier and a
        later store of the same key is simply asked again."""
        with self._lock:
            verdicts = [self.policy.admit(key) for key in keys]
            self.stats.declined += verdicts.count(False)
            return verdicts

    def reserve(self, keys: Sequence[bytes], allow_evict: bool = True) -> list[int] | None:
        """Claim one slot per key to write; the blocks stay invisible to readers until ``commit``.

        All or nothing. Keys must be distinct and absent from the tier (StateError otherwise). When
        too few slots are free and ``allow_evict``, READY unpinned blocks are dropped through the
        policy; pinned, writing and evicting blocks never are. Returns None (and claims nothing)
        when the room cannot be made. Raises CapacityError when ``keys`` outnumber the whole tier, and
        TypeError or ValueError (``check_key``) for a key that is not 1 to MAX_KEY_BYTES bytes: every
        store passes here, so no tier ever holds a key it could not keep whole.
        """
        for key in keys:
            check_key(key)
        if len(keys) > self.capacity:
            raise CapacityError(f"{len(keys)} blocks can never fit in tier {self.name!r} of {self.capacity} blocks")
        if len(set(keys)) != len(keys):
            raise StateError("reserve got the same key twice")
        with self._lock:
            present = [k for k in keys if k in self._entries]
            if present:
                raise StateError(f"block {present[0].hex()[:16]} is already in tier {self.name!r}")
            short = len(keys) - self._allocator.num_free
            if short > 0:
                if not allow_evict:
                    return None
                self.evict(short)
            slots = self._allocator.allocate(len(keys))
            if slots is None:
                return None
            for key, slot in zip(keys, slots, strict=True):
                self._entries[key] = _Entry(slot, BlockState.WRITING)
            return slots

    def commit(self, keys: Iterable[bytes], pin: bool = False) -> None:
        """Publish written blocks: WRITING -> READY. Raises StateError (and commits none) for a key not reserved.

        With ``pin`` the blocks are also pinned in the same step, so no eviction can slip in between
        (a staging tier whose blocks are read again at once needs that).
        """
        with self._lock:
            keys = list(keys)
            self._check_distinct(keys, "commit")
            for key in keys:
                self._writing_entry(key, "commit")
            for key in keys:
                entry = self._entries[key]
                entry.state = BlockState.READY
                self.policy.insert(key)
                if pin:
                    entry.pins += 1
                    self._pinned.add(key)
            self.stats.committed += len(keys)
            self.stats.bytes_in += len(keys) * self.block_bytes

    def abort(self, keys: Iterable[bytes]) -> list[bytes]:
        """Release reserved slots whose write failed or was cancelled: WRITING -> FREE.

        Returns the keys among them that the storage refused for good (``refuse``): writing them
        again would fail again. All or nothing: raises StateError for a key not reserved,
        FenceError when a job still uses a slot.
        """
        with self._lock:
            keys = list(keys)
            self._check_distinct(keys, "abort")
            for key in keys:
                self._check_unfenced(self._writing_entry(key, "abort"))
            refused = [key for key in keys if self._entries[key].refused]
            for key in keys:
                self._free_entry(key)
            self.stats.aborted += len(keys)
            return refused

    def quarantine(self, keys: Iterable[bytes]) -> list[int]:
        """Release reserved blocks whose write failed but may still land: a store call that outlived
        its deadline can write into their slots later. The keys leave the tier (a later load or store
        of them is not held up); the slots stay taken, out of every reader's and writer's reach, until
        ``lift_quarantine``. Returns the slots. Raises StateError (and quarantines none) for a key not reserved."""
        with self._lock:
            keys = list(keys)
            self._check_distinct(keys, "quarantine")
            slots = [self._writing_entry(key, "quarantine").slot for key in keys]
            for key in keys:
                del self._entries[key]
            self._quarantined.update(slots)
            self.stats.aborted += len(keys)
            return slots

    def lift_quarantine(self, slots: Iterable[int]) -> None:
        """Free quarantined slots: nothing can write into them any more. Raises StateError (and frees
        none) for a slot that is not quarantined."""
        with self._lock:
            slots = list(slots)
            stray = [slot for slot in slots if slot not in self._quarantined]
            if stray or len(set(slots)) != len(slots):
                raise StateError(
                    f"quarantine lift of slots {sorted(stray) or slots} of tier {self.name!r} that "
                    f"are not quarantined (once each)"
                )
            for slot in slots:
                self._quarantined.remove(slot)
                self._allocator.free(slot)

    def refuse(self, keys: Iterable[bytes]) -> None:
        """Mark reserved blocks that this tier's storage can never hold (a compressing disk tier whose
        slot is too small for their payload), as opposed to a write that failed for a passing reason
        (an I/O error, a full disk). The writer still aborts them; ``abort`` names them, so the tier
        above drops its copy instead of trying to demote it again and again. Raises StateError (and
        marks none) for a key not reserved."""
        with self._lock:
            entries = [self._writing_entry(key, "refuse") for key in keys]
            for entry in entries:
                entry.refused = True

    def restore(self, blocks: Sequence[tuple[bytes, int]]) -> None:
        """Put back READY blocks that persistent storage already holds, as (key, slot), oldest use first.

        All or nothing: the whole list is checked before anything changes, and StateError names the
        first block that cannot go back (a key already here or given twice, a slot out of range, taken
        or given twice). Restoring block by block would leave the blocks before a bad one indexed but
        unknown to the policy, so never evicted.
        """
        with self._lock:
            keys: set[bytes] = set()
            slots: set[int] = set()
            for key, slot in blocks:
                if key in self._entries or key in keys:
                    raise StateError(f"block {key.hex()[:16]} is restored twice into tier {self.name!r}")
                if slot in slots or not self._allocator.is_free(slot):
                    raise StateError(f"slot {slot} of tier {self.name!r} is not free for block {key.hex()[:16]}")
                keys.add(key)
                slots.add(slot)
            for key, slot in blocks:
                self._allocator.claim(slot)
                self._entries[key] = _Entry(slot, BlockState.READY)
            self.policy.restore(key for key, _ in blocks)

    def discard(self, keys: Iterable[bytes]) -> list[bytes]:
        """Drop READY blocks that proved unreadable (a failed checksum, an I/O error) so no reader
        tries them again; blocks pinned by other readers stay until those readers are done. Returns
        the keys dropped."""
        with self._lock:
            dropped = []
            for key in keys:
                entry = self._entries.get(key)
                if entry is None or entry.state is not BlockState.READY or entry.pins or entry.evicting:
                    continue
                if self._fenced(entry):
                    continue
                self.policy.remove(key)
                self._free_entry(key)
                dropped.append(key)
            self.stats.read_errors += len(dropped)
            return dropped

    # --- eviction ------------------------------------------------------------------------------

    def evict(self, n: int) -> list[bytes]:
        """Drop up to ``n`` READY, unpinned blocks chosen by the policy; returns the keys dropped
        (a victim whose slot a job in flight still uses is kept, see ``end_evict``)."""
        with self._lock:
            return self.end_evict([key for key, _ in self.begin_evict(n)])

    def begin_evict(self, n: int) -> list[tuple[bytes, int]]:
        """Choose up to ``n`` victims and pin them while their bytes are copied elsewhere; returns (key, slot).

        The victims stay READY and readable until ``end_evict``; the policy no longer offers them.
        """
        with self._lock:
            victims = self.policy.evict(n, self._pinned)
            out = []
            for key in victims:
                entry = self._entries[key]
                entry.evicting = True
                entry.pins += 1
                self._pinned.add(key)
                out.append((key, entry.slot))
            self._evicting += len(out)
            return out

    def end_evict(self, keys: Iterable[bytes], drop: bool = True) -> list[bytes]:
        """Finish ``begin_evict``: drop each victim, or keep it (back in the policy) when ``drop`` is
        False, a reader pinned it meanwhile, or a job in flight still uses its slot (a fence).
        Returns the keys dropped (what left the tier: eviction events name them). Raises StateError
        (and finishes none) for a key not being evicted."""
        with self._lock:
            keys = list(keys)
            self._check_distinct(keys, "end_evict")
            for key in keys:
                entry = self._entries.get(key)
                if entry is None or not entry.evicting:
                    raise StateError(f"block {key.hex()[:16]} is not being evicted from tier {self.name!r}")
            dropped = []
            for key in keys:
                entry = self._entries[key]
                entry.evicting = False
                self.unpin([key])
                if drop and entry.pins == 0 and not self._fenced(entry):
                    self._free_entry(key)
                    dropped.append(key)
                else:
                    self.policy.insert(key)
            self._evicting -= len(keys)
            self.stats.evicted += len(dropped)
            return dropped

    def end_demotion(self, ok: list[bytes], failed: list[bytes], refused: list[bytes]) -> list[bytes]:
        """Finish ``begin_evict`` for victims whose copy to the tier below has ended: those that
        landed there leave; those it refused for good (``refuse``) leave too, since kept they would
        be offered again and refused again until they filled this tier; those whose copy failed for
        a passing reason stay. Counts ``demoted`` and ``demotion_refused``. ``refused`` is a subset
        of ``failed``. Returns the keys that left this tier (a victim a reader pinned meanwhile stays)."""
        gone = set(refused)
        with self._lock:
            landed = self.end_evict(ok)
            self.end_evict([k for k in failed if k not in gone], drop=False)
            dropped = self.end_evict(refused)
            self.stats.demoted += len(ok)
            self.stats.demotion_refused += len(dropped)
            return landed + dropped

    # --- accounting ----------------------------------------------------------------------------

    def count(self, **counts: int) -> None:
        """Add to the named ``stats`` counters (for the stack, which counts hits and demotions)."""
        with self._lock:
            for name, n in counts.items():
                setattr(self.stats, name, getattr(self.stats, name) + n)

    def usage(self) -> Usage:
        with self._lock:
            return Usage(self.capacity - self._allocator.num_free, self.capacity, self._evicting)

    def excess(self) -> int:
        """Blocks to free now to honour the watermark (0 without one or below the high mark)."""
        if self.watermark is None:
            return 0
        u = self.usage()
        return self.watermark.excess(u.used, u.capacity)

    def leaks(self) -> dict[str, int]:
        """What would leak if the tier were closed now: pinned blocks, and blocks still being written
        (quarantined slots among them: a late write may still land there)."""
        with self._lock:
            return {
                "pinned": sum(1 for e in self._entries.values() if e.pins),
                "writing": sum(1 for e in self._entries.values() if e.state is BlockState.WRITING)
                + len(self._quarantined),
            }

    def check_invariants(self) -> None:
        """Raise AssertionError when the index, the allocator and the policy disagree (for tests and debugging)."""
        with self._lock:
            slots = [e.slot for e in self._entries.values()] + list(self._quarantined)
            assert len(slots) == len(set(slots)), "a slot is owned twice"
            assert len(slots) + self._allocator.num_free == self.capacity, "slots leaked or double counted"
            assert not any(self._allocator.is_free(s) for s in slots), "an owned slot is on the free list"
            assert all(e.pins >= 0 for e in self._entries.values()), "a negative pin count"
            assert self._pinned == {k for k, e in self._entries.items() if e.pins}, "pinned set out of date"
            assert self._evicting == sum(e.evicting for e in self._entries.values()), "evicting count out of date"
            tracked = {k for k, e in self._entries.items() if e.state is BlockState.READY and not e.evicting}
            assert len(self.policy) == len(tracked) and all(k in self.policy for k in tracked), (
                "the policy tracks other keys than the READY blocks"
            )

    def close(self) -> None:
        """Release the storage. Raises StateError if blocks are still pinned or being written."""
        leaks = self.leaks()
        if any(leaks.values()):
            raise StateError(f"tier {self.name!r} closed with blocks in use: {leaks}")
        self.storage.close()

    # --- helpers -------------------------------------------------------------------------------

    def _ready_entry(self, key: bytes) -> _Entry:
        entry = self._entries.get(key)
        if entry is None or entry.state is not BlockState.READY:
            state = "absent" if entry is None else entry.state.value
            raise StateError(f"block {key.hex()[:16]} is {state} in tier {self.name!r}, not ready")
        return entry

    def _writing_entry(self, key: bytes, what: str) -> _Entry:
        entry = self._entries.get(key)
        if entry is None or entry.state is not BlockState.WRITING:
            raise StateError(f"{what} of block {key.hex()[:16]} which was not reserved in tier {self.name!r}")
        return entry

    def _check_distinct(self, keys: list[bytes], what: str) -> None:
        if len(set(keys)) != len(keys):
            raise StateError(f"{what} got the same key twice")

    def _fenced(self, entry: _Entry) -> bool:
        return self._is_fenced is not None and self._is_fenced(self.name, entry.slot)

    def _check_unfenced(self, entry: _Entry) -> None:
        if self._fenced(entry):
            raise FenceError(f"slot {entry.slot} of tier {self.name!r} is still used by a job in flight")

    def _free_entry(self, key: bytes) -> None:
        self._check_unfenced(self._entries[key])
        entry = self._entries.pop(key)
        self._allocator.free(entry.slot)
