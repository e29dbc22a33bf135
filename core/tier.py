"""The block interface every tier shares: an index of keys to slots, a slot allocator, block states
with explicit reference counts, and an eviction policy.

Block life: ``FREE -> WRITING (reserve) -> READY (commit) -> pinned by readers -> evicted -> FREE``;
a block found again in persistent storage at start: ``FREE -> claimed (claim) -> READY (restore_claimed)``.
Readers only ever see READY blocks. A pinned block (a reader, or a job copying it out) and a WRITING
block (a job copying in) are never evicted. Misuse raises: a double free, an unpin below zero, a commit
of a key that was not reserved.

Thread safety: every public method takes the tier's lock, so a tier may be called from the engine's
thread and from transfer-completion threads at once. The policy is only called under that lock.

A policy that raises, or evicts what it may not (a pinned, absent or unreadable block), has a bug, maybe
an out-of-tree one: the tier logs it, counts it (``policy_errors``) and goes on under an LRU order
rebuilt from its readable blocks (``_replace_policy``), finishing the call it was in. A policy's bug
then costs hit ratio, never a pin or slot left held, a caller waiting forever or an engine's crash.
"""

from __future__ import annotations

import array
import enum
import logging
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from itertools import compress
from typing import NamedTuple, Protocol

import numpy as np

from kvtier.core.errors import CapacityError, DoubleFreeError, FenceError, StateError
from kvtier.core.keys import check_key
from kvtier.core.metrics import TierStats
from kvtier.core.misses import MissReason
from kvtier.core.storage import BlockStorage
from kvtier.policies.base import EvictionPolicy
from kvtier.policies.lru import LRUPolicy
from kvtier.policies.shares import TenantShares
from kvtier.policies.watermark import Watermark

log = logging.getLogger(__name__)


class BlockState(enum.Enum):
    FREE = "free"
    WRITING = "writing"
    READY = "ready"


class SlotAllocator:
    """The free slots of one tier. Refuses a double free and a slot out of range.

    Compact and O(1) per slot at any capacity (a disk tier of 16 M slots restores every one of them at
    start): a byte per slot says whether it is free, and a stack of free slot numbers (machine ints,
    not objects) hands them out; a slot taken by ``claim_many`` stays in the stack until ``allocate`` pops
    and skips it, instead of being searched for there."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        # pop() hands out low slots first; made by numpy (16 M slots: 0.05 s, not 0.9); int32 below 2^31 slots
        self._dtype = np.int32 if capacity < 2**31 else np.int64
        self._free = array.array("i" if self._dtype is np.int32 else "q")
        self._free.frombytes(np.arange(capacity - 1, -1, -1, dtype=self._dtype).tobytes())
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

    def claim_many(self, slots: np.ndarray) -> int | None:
        """Take these particular free slots, all or none; returns None, or (taking none) the index in
        ``slots`` of the first one that is out of range, taken, or given twice. Vectorised: a tier
        reopening its storage claims millions at once."""
        if not len(slots):
            return None
        free = np.frombuffer(self._is_free, np.uint8)
        outside = (slots < 0) | (slots >= self.capacity)
        if outside.any():
            return int(np.argmax(outside))
        taken = free[slots] == 0
        if taken.any():
            return int(np.argmax(taken))
        free[slots] = 0
        claimed = self._num_free - int(np.count_nonzero(free))
        if claimed != len(slots):  # a slot given twice: the first one that repeats an earlier one
            free[slots] = 1
            order = np.argsort(slots, kind="stable")
            repeats = order[1:][slots[order[1:]] == slots[order[:-1]]]
            return int(repeats.min())
        self._num_free -= claimed
        return None

    def free_many(self, slots: np.ndarray) -> None:
        """Give back slots ``claim_many`` took (blocks whose restore was dropped). A claimed slot may
        still be in the stack of free slots, or ``allocate`` may have popped and skipped it since: they
        go on the stack again (a stale second entry is skipped like any taken one)."""
        slots = np.asarray(slots, dtype=np.int64)
        np.frombuffer(self._is_free, np.uint8)[slots] = 1
        self._num_free += len(slots)
        self._free.frombytes(slots.astype(self._dtype).tobytes())

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.capacity:
            raise StateError(f"slot {slot} is outside [0, {self.capacity})")
        if self._is_free[slot]:
            raise DoubleFreeError(f"slot {slot} is already free")
        self._is_free[slot] = 1
        self._num_free += 1
        self._free.append(slot)


# A slot's flags (``Tier._flags``, one byte per slot): its block's state and what is being done to it.
_WRITING = 1
_READY = 2
_EVICTING = 4  # chosen as a victim, waiting for its demotion copy; still readable
_REFUSED = 8  # WRITING only: the storage can never hold this block (see ``Tier.refuse``)
_RESTORING = 16  # claimed for a block that persistent storage holds and the index does not yet (``Tier.claim``)
_FRESH_BATCH = 2048  # keys a restore checks and indexes at a time (``Tier._index_fresh``)
_STATES = frozenset({_WRITING, _WRITING | _REFUSED, _READY, _READY | _EVICTING})
_READABLE = bytes(1 if flags & _READY else 0 for flags in range(256))
"""A flags byte -> 1 where its block can be read, else 0 (``bytes.translate``'s table: ``Tier.lookup``)."""


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


class TierWatcher(Protocol):
    """Told of the blocks that became readable in a tier and those that stopped being (``Tier.watcher``,
    ``core/events.py``), under the tier's lock: it only notes them down."""

    def stored(self, tier: Tier, keys: list[bytes]) -> None: ...

    def removed(self, tier: Tier, keys: list[bytes]) -> None: ...


class Tier:
    """One level of the stack: ``name`` and ``medium`` ("gpu", "host", ...) over a ``storage`` of slots."""

    by_key = False
    """True for a tier whose blocks are addressed by key alone (a store shared with other engines): it
    has no slots, and copies to or from it name keys (``Endpoint.slots`` None)."""
    takes_demotions = True
    """Whether the tier above demotes its victims into this one (a remote tier placed write-through does
    not: blocks reach it from host memory as soon as they are there, by plans of their own)."""
    loads_direct = False
    """For a tier addressed by key: whether its loads may go straight into the caller's blocks. They
    stage through a host slot otherwise: a read past its deadline may still write into its
    destination, and only a tier's slot can be kept out of use until it no longer can."""

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
        self.watcher: TierWatcher | None = None
        self._is_fenced = is_fenced
        self._allocator = SlotAllocator(storage.num_slots)
        # The index, compact because a disk tier may hold tens of millions of blocks: key -> slot, one
        # byte of flags per slot (``_WRITING`` ...), and pin counts of the pinned keys only (few: the
        # blocks being read or copied, which is also what ``evict`` must not choose).
        self._slots: dict[bytes, int] = {}
        self._flags = bytearray(storage.num_slots)
        self._pins: dict[bytes, int] = {}
        policy.bind(self._slots, storage.num_slots)
        self._deleted = 0  # keys deleted from ``_slots`` since its table was last rebuilt (``_compact``)
        self._table_bytes = sys.getsizeof(self._slots)
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

    def location(self) -> tuple[str, str | None]:
        """Where its blocks live for routers (``core/events.py``): locality ("LOCAL": this machine,
        "REMOTE") and who else may load them (None: this engine alone)."""
        return "LOCAL", None

    def _tell_watcher(self, stored: bool, keys: list[bytes]) -> None:
        """Tell the watcher, if any, that ``keys`` became readable here (``stored``) or stopped being; a
        change of no keys is not one."""
        if self.watcher is not None and keys:
            (self.watcher.stored if stored else self.watcher.removed)(self, keys)

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are READY here. Touches nothing. In C loops (the slots by ``map``, their
        flags read and tested by ``bytes.translate``): 1.5x the keys per second of a Python loop."""
        with self._lock:
            found = list(map(self._slots.get, keys))
            if None in found:
                found = found[: found.index(None)]
            readable = bytes(map(self._flags.__getitem__, found)).translate(_READABLE)  # type: ignore[arg-type]
        first_not = readable.find(0)
        return len(found) if first_not < 0 else first_not

    def query(self, keys: Sequence[bytes]) -> int:
        """How many leading keys the medium itself says it holds: for a local tier its index, ``lookup``;
        a remote tier asks its store (a network round trip, bounded by its timeout)."""
        return self.lookup(keys)

    def state(self, key: bytes) -> BlockState:
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                return BlockState.FREE
            return BlockState.READY if self._flags[slot] & _READY else BlockState.WRITING

    def pin(self, keys: Sequence[bytes], use: bool = True) -> list[int]:
        """Protect READY blocks from eviction while they are read; returns their slots.

        All or nothing: raises StateError (and pins none) when a key is not READY. Every pin must be
        released with ``unpin``. Counts as a use for the eviction policy, unless ``use`` is False (a
        hold that reads nothing: the read that follows counts).
        """
        with self._lock:
            slots = [self._ready_slot(key) for key in keys]
            pins, flags = self._pins, self._flags
            for key, slot in zip(keys, slots, strict=True):
                pins[key] = pins.get(key, 0) + 1
                if use and not flags[slot] & _EVICTING:
                    try:
                        self.policy.touch(key)
                    except Exception as exc:
                        self._replace_policy("touch", exc)
            return slots

    def try_pin(self, key: bytes) -> bool:
        """Pin one block if it is READY now; False (nothing pinned) otherwise. Lookup and pin in one
        step, so a block cannot vanish between finding it and protecting it."""
        with self._lock:
            if not self.lookup([key]):
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
            counts: dict[bytes, int] = {}
            for key in keys:
                counts[key] = counts.get(key, 0) + 1
            pins = self._pins
            for key, count in counts.items():
                if pins.get(key, 0) < count:
                    raise StateError(f"unpin of block {key.hex()[:16]} which is not pinned")
            for key, count in counts.items():
                left = pins[key] - count
                if left:
                    pins[key] = left
                else:
                    del pins[key]

    def ready_keys(self) -> list[bytes]:
        """Keys of every READY block, in the order they became readable."""
        with self._lock:
            flags = self._flags
            return [key for key, slot in self._slots.items() if flags[slot] & _READY]

    def ready_blocks(self) -> tuple[list[bytes], list[int]]:
        """Keys and slots of every READY block, in the order they became readable (what a disk tier's
        index snapshot lists): two passes over the index, no lookup per key."""
        with self._lock:
            flags = self._flags
            keys = [key for key, slot in self._slots.items() if flags[slot] & _READY]
            return keys, [slot for slot in self._slots.values() if flags[slot] & _READY]

    def slots(self, keys: Sequence[bytes]) -> list[int]:
        """Slots of keys that are present in any state; raises StateError on an absent key."""
        with self._lock:
            out = []
            for key in keys:
                slot = self._slots.get(key)
                if slot is None:
                    raise StateError(f"block {key.hex()[:16]} is not in tier {self.name!r}")
                out.append(slot)
            return out

    # --- writing -------------------------------------------------------------------------------

    def admit(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key about to be written here, whether the policy wants it stored (``EvictionPolicy.admit``);
        counts the declined ones. Reserves nothing, so a declined block leaves no trace in the tier and a
        later store of the same key is simply asked again."""
        with self._lock:
            try:
                verdicts = [self.policy.admit(key) for key in keys]
            except Exception as exc:
                self._replace_policy("admit", exc)
                verdicts = [True] * len(keys)
            self.stats.declined += verdicts.count(False)
            return verdicts

    def expect(self, keys: Sequence[bytes]) -> None:
        """Tell the policy that ``keys`` are about to be written here, before room is made for them
        (``EvictionPolicy.expect``)."""
        if self.policy.expects:
            with self._lock:
                try:
                    self.policy.expect(keys)
                except Exception as exc:
                    self._replace_policy("expect", exc)

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
            index = self._slots
            present = [k for k in keys if k in index]
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
            flags = self._flags
            for key, slot in zip(keys, slots, strict=True):
                index[key] = slot
                flags[slot] = _WRITING
            if sys.getsizeof(index) != self._table_bytes:
                self._compact()
            return slots

    def commit(self, keys: Iterable[bytes], pin: bool = False) -> None:
        """Publish written blocks: WRITING -> READY. Raises StateError (and commits none) for a key not reserved.

        With ``pin`` the blocks are also pinned in the same step, so no eviction can slip in between
        (a staging tier whose blocks are read again at once needs that).
        """
        with self._lock:
            keys = list(keys)
            self._check_distinct(keys, "commit")
            slots = [self._writing_slot(key, "commit") for key in keys]
            flags, insert, pins = self._flags, self.policy.insert, self._pins
            for key, slot in zip(keys, slots, strict=True):
                flags[slot] = _READY
                try:
                    insert(key)
                except Exception as exc:  # (the order rebuilt holds this block: it is READY)
                    self._replace_policy("insert", exc)
                    insert = self.policy.insert
                if pin:
                    pins[key] = pins.get(key, 0) + 1
            self.stats.committed += len(keys)
            self.stats.bytes_in += len(keys) * self.block_bytes
            self._tell_watcher(True, keys)

    def abort(self, keys: Iterable[bytes]) -> list[bytes]:
        """Release reserved slots whose write failed or was cancelled: WRITING -> FREE.

        Returns the keys among them that the storage refused for good (``refuse``): writing them
        again would fail again. All or nothing: raises StateError for a key not reserved,
        FenceError when a job still uses a slot.
        """
        with self._lock:
            keys = list(keys)
            self._check_distinct(keys, "abort")
            slots = [self._writing_slot(key, "abort") for key in keys]
            for slot in slots:
                self._check_unfenced(slot)
            refused = [key for key, slot in zip(keys, slots, strict=True) if self._flags[slot] & _REFUSED]
            for key in keys:
                self._free_block(key)
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
            slots = [self._writing_slot(key, "quarantine") for key in keys]
            for key, slot in zip(keys, slots, strict=True):
                del self._slots[key]
                self._flags[slot] = 0
            self._deleted += len(keys)
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
            slots = [self._writing_slot(key, "refuse") for key in keys]
            for slot in slots:
                self._flags[slot] |= _REFUSED

    def restore(self, keys: Sequence[bytes], slots: Sequence[int] | np.ndarray) -> int:
        """Put back READY blocks that persistent storage already holds: ``keys[i]`` in ``slots[i]``, oldest
        use first, in one step: ``claim`` then ``restore_claimed`` (a disk tier reopening does it chunk
        by chunk while it serves, ``core/restore.py``). Raises StateError, and restores none,
        for a slot out of range, taken or given twice; a key already here or given twice keeps the
        block that came first. Returns how many blocks went back."""
        if len(keys) != len(slots):
            raise StateError(f"restore got {len(keys)} keys for {len(slots)} slots")
        with self._lock:
            return self.restore_claimed(list(keys), self.claim(slots))

    def claim(self, slots: Sequence[int] | np.ndarray) -> np.ndarray:
        """Take the slots of blocks that persistent storage holds, before they are put back into the
        index (``restore_claimed``, which may come chunk by chunk much later): until then they are
        neither readable nor free, so no store can overwrite a block still to come back, yet they
        count as used. All or nothing: StateError names the first slot out of range, taken or given
        twice. Returns the slots as an int64 array. Vectorised: a tier reopening claims millions."""
        at = np.asarray(slots, dtype=np.int64)
        with self._lock:
            bad = self._allocator.claim_many(at)
            if bad is not None:
                raise StateError(f"slot {int(at[bad])} of tier {self.name!r} is not free for a block to restore")
            np.frombuffer(self._flags, np.uint8)[at] = _RESTORING
            return at

    def restore_claimed(
        self, keys: list[bytes], slots: np.ndarray, then: Callable[[np.ndarray], None] | None = None
    ) -> int:
        """Put back READY blocks into slots ``claim`` took, ``keys[i]`` in ``slots[i]`` (each slot once),
        oldest use first, after every block already here. A key the tier holds already (stored again
        while its block was waiting here, or named twice: only a forged snapshot does that) keeps
        what the tier holds, and the slot given for it is freed: a restore can only cause misses.
        Returns how many blocks went back; StateError (nothing changed) for a slot not claimed.
        ``then(went_in)`` (which keys went back, a bool each) runs under the tier's lock, before any
        other caller sees them: for one that announces restored blocks (the vLLM scheduler side).

        In columns: the usual case (no key here yet) is dict updates and numpy steps, no Python step
        per block; the dict updates are what most of a restore costs (15.8 M blocks, ``bench/index.py``)."""
        if len(keys) != len(slots):
            raise StateError(f"restore got {len(keys)} keys for {len(slots)} slots")
        with self._lock:
            flags = np.frombuffer(self._flags, np.uint8)
            if (flags[slots] != _RESTORING).any():
                raise StateError(f"restore into slots of tier {self.name!r} that were not claimed for it")
            kept_keys, kept = keys, slots
            new = np.ones(len(keys), np.bool_)
            fresh = self._index_fresh(keys, slots.tolist())
            if fresh < len(keys):  # a key already here, or given twice
                new[fresh:] = self._index_new(keys[fresh:], slots[fresh:])
                kept_keys, kept, dropped = list(compress(keys, new)), slots[new], slots[~new]
                flags[dropped] = 0
                self._allocator.free_many(dropped)
            flags[kept] = _READY
            try:
                self.policy.restore(kept_keys, kept)
            except Exception as exc:
                self._replace_policy("restore", exc)
            if then is not None:
                then(new)
            self._tell_watcher(True, kept_keys)
            return len(kept_keys)

    def release(self, slots: np.ndarray) -> None:
        """Free slots ``claim`` took whose blocks will not be put back (a restore that gave up).
        StateError (and frees none) for a slot not claimed."""
        with self._lock:
            flags = np.frombuffer(self._flags, np.uint8)
            if (flags[slots] != _RESTORING).any() or len(np.unique(slots)) != len(slots):
                raise StateError(f"release of slots of tier {self.name!r} that were not claimed (once each)")
            flags[slots] = 0
            self._allocator.free_many(slots)

    def holds(self, keys: Sequence[bytes]) -> np.ndarray:
        """Per key whether the index holds it, in any state (a bool array)."""
        with self._lock:
            return np.fromiter(map(self._slots.__contains__, keys), np.bool_, len(keys))

    def discard(self, keys: Iterable[bytes]) -> list[bytes]:
        """Drop READY blocks that proved unreadable (a failed checksum, an I/O error) so no reader
        tries them again; blocks pinned by other readers stay until those readers are done. Returns
        the keys dropped."""
        with self._lock:
            dropped = []
            for key in keys:
                slot = self._slots.get(key)
                if slot is None or self._flags[slot] != _READY or key in self._pins or self._fenced(slot):
                    continue
                try:
                    self.policy.remove(key)
                except Exception as exc:  # (the order rebuilt holds this block still: it is READY)
                    self._replace_policy("remove", exc)
                    self.policy.remove(key)
                self._free_block(key)
                dropped.append(key)
            self.stats.read_errors += len(dropped)
            self._tell_watcher(False, dropped)
            return dropped

    def why_absent(self, key: bytes) -> MissReason | None:
        """Why ``key`` is not readable here, as far as the tier itself knows (a remote tier: its store
        did not answer, a load of it failed); None: the planner's ghost index tells (``core/misses.py``)."""
        return None

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
            index, flags, pins = self._slots, self._flags, self._pins
            try:
                victims = self.policy.evict(n, pins)
                wrong = [k for k in victims if k in pins or k not in index or flags[index[k]] != _READY]
                if wrong or len(set(victims)) != len(victims):
                    raise StateError(f"evict chose blocks it may not: {wrong[:1] or 'one twice'} of {len(victims)}")
            except Exception as exc:  # (the order rebuilt holds what it chose: those are READY still)
                self._replace_policy("evict", exc)
                victims = self.policy.evict(n, pins)
            out = []
            for key in victims:
                slot = index[key]
                flags[slot] |= _EVICTING
                pins[key] = pins.get(key, 0) + 1
                out.append((key, slot))
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
            index, flags = self._slots, self._flags
            for key in keys:
                slot = index.get(key)
                if slot is None or not flags[slot] & _EVICTING:
                    raise StateError(f"block {key.hex()[:16]} is not being evicted from tier {self.name!r}")
            dropped = []
            for key in keys:
                slot = index[key]
                flags[slot] &= ~_EVICTING
                self.unpin([key])
                if drop and key not in self._pins and not self._fenced(slot):
                    self._free_block(key)
                    dropped.append(key)
                else:
                    try:
                        self.policy.insert(key)
                    except Exception as exc:  # (the order rebuilt holds this block: READY again)
                        self._replace_policy("insert", exc)
            self._evicting -= len(keys)
            self.stats.evicted += len(dropped)
            self._tell_watcher(False, dropped)
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

    def tenant_counts(self) -> dict[str, dict[str, int]] | None:
        """Per tenant label, blocks stored, read, evicted and held, and the bytes held, where the tier has
        ``tenants:`` shares (``TenantShares.counts``); None otherwise."""
        with self._lock:
            if not isinstance(self.policy, TenantShares):
                return None
            counts = self.policy.counts()
        return {label: {**c, "held_bytes": c["held"] * self.block_bytes} for label, c in counts.items()}

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
            return {"pinned": len(self._pins), "writing": self._flags.count(_WRITING) + len(self._quarantined)}

    def settle(self) -> None:
        """Return once what this process told the tier's owner has been taken in (``TierStack.wait_idle``):
        nothing to wait for in a tier this process owns; a tier another process owns (a node daemon,
        which reads posted commits in its own time) overrides it."""

    def check_invariants(self) -> None:
        """Raise AssertionError when the index, the allocator and the policy disagree (for tests and debugging)."""
        with self._lock:
            flags = self._flags
            restoring = [s for s, f in enumerate(flags) if f == _RESTORING]
            slots = list(self._slots.values()) + list(self._quarantined) + restoring
            assert len(slots) == len(set(slots)), "a slot is owned twice"
            assert len(slots) + self._allocator.num_free == self.capacity, "slots leaked or double counted"
            assert not any(self._allocator.is_free(s) for s in slots), "an owned slot is on the free list"
            assert all(flags[s] in _STATES for s in self._slots.values()), "a block in no state, or in two"
            assert sum(1 for f in flags if f) == len(self._slots) + len(restoring), (
                "flags of a slot that holds no block"
            )
            assert all(n > 0 and key in self._slots for key, n in self._pins.items()), "a pin of no block"
            assert self._evicting == sum(1 for s in self._slots.values() if flags[s] & _EVICTING), (
                "evicting count out of date"
            )
            tracked = {k for k, s in self._slots.items() if flags[s] == _READY}
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

    def _replace_policy(self, call: str, error: Exception) -> None:
        """The policy raised in ``call`` (or chose blocks it may not evict): log it with its cause, count
        it, and order the blocks by an LRU from now on, rebuilt from the READY blocks not being evicted
        (what a policy tracks), oldest stored first. The caller then finishes its own work."""
        log.error(
            "tier %r: eviction policy %s failed in %s (%s: %s); the tier goes on with LRU",
            self.name,
            type(self.policy).__name__,
            call,
            type(error).__name__,
            error,
            exc_info=error,
        )
        self.stats.policy_errors += 1
        flags = self._flags
        ready = [(key, slot) for key, slot in self._slots.items() if flags[slot] == _READY]
        lru: LRUPolicy[bytes] = LRUPolicy()
        lru.bind(self._slots, self.capacity)
        lru.restore([key for key, _ in ready], [slot for _, slot in ready])
        self.policy = lru

    def _ready_slot(self, key: bytes) -> int:
        slot = self._slots.get(key)
        if slot is None or not self._flags[slot] & _READY:
            state = "absent" if slot is None else "writing"
            raise StateError(f"block {key.hex()[:16]} is {state} in tier {self.name!r}, not ready")
        return slot

    def _writing_slot(self, key: bytes, what: str) -> int:
        slot = self._slots.get(key)
        if slot is None or not self._flags[slot] & _WRITING:
            raise StateError(f"{what} of block {key.hex()[:16]} which was not reserved in tier {self.name!r}")
        return slot

    def _check_distinct(self, keys: list[bytes], what: str) -> None:
        if len(set(keys)) != len(keys):
            raise StateError(f"{what} got the same key twice")

    def _fenced(self, slot: int) -> bool:
        return self._is_fenced is not None and self._is_fenced(self.name, slot)

    def _check_unfenced(self, slot: int) -> None:
        if self._fenced(slot):
            raise FenceError(f"slot {slot} of tier {self.name!r} is still used by a job in flight")

    def _index_fresh(self, keys: list[bytes], slots: list[int]) -> int:
        """Index the leading ``keys`` at their ``slots`` batch by batch, each batch checked for keys
        already here just before it goes in; returns how many, stopping at the first batch holding a
        key already here or given twice (none of it indexed). Checked in small batches, the check
        costs next to nothing: the table entries it reads are still in cache when the update writes
        them (in batches of 64 K it adds half the update's time at 15.8 M keys)."""
        index, step = self._slots, _FRESH_BATCH
        for start in range(0, len(keys), step):
            batch = keys[start : start + step]
            before = len(index)
            if not index.keys().isdisjoint(batch):
                return start
            index.update(zip(batch, slots[start : start + step], strict=True))
            if len(index) != before + len(batch):  # a key twice in the batch: none of it was here
                for key in batch:
                    index.pop(key, None)
                return start
        return len(keys)

    def _index_new(self, keys: list[bytes], slots: np.ndarray) -> np.ndarray:
        """Index each of ``keys`` that is not here yet at its slot (a key given twice: its first);
        returns which were (a bool array). A Python step per block: only for a restore that meets
        keys already here."""
        index = self._slots
        new = np.zeros(len(keys), np.bool_)
        for i, (key, slot) in enumerate(zip(keys, slots.tolist(), strict=True)):
            if key not in index:
                index[key] = slot
                new[i] = True
        return new

    def _compact(self) -> None:
        """Called when the index's table was just rebuilt by the dict itself (an insert found no room).

        Why: a dict never reuses the entries of deleted keys; it rebuilds its table when they are used
        up, at room for 3 x its keys. A tier full and serving deletes a key for every key it stores, so
        that rebuild comes again and again, and its index stays at twice the table a copy of the same
        keys needs (after churn 84 B per block instead of 42 at 1 M blocks, ``bench/index.py``). So
        when the table grew because deleted keys used it up (at least 1/8 of the keys were deleted
        since the last rebuild: a tier filling up, whose table grows for more keys, is left alone), the
        index is copied into a table of the least size, in place (the policy reads the same dict).
        That costs a copy of the index each time the least table's spare room is used up: at 1 M
        blocks 0.2 s every 400 K stores, about 0.5 us per store, for half the index's bytes."""
        index = self._slots
        if 8 * self._deleted >= len(index):
            compact = dict(index)  # (from a dict with deleted keys: a table of the least size)
            index.clear()
            index.update(compact)  # (from a dict without: its table cloned as it is)
        self._deleted = 0
        self._table_bytes = sys.getsizeof(index)

    def _free_block(self, key: bytes) -> None:
        slot = self._slots[key]
        self._check_unfenced(slot)
        del self._slots[key]
        self._deleted += 1
        self._flags[slot] = 0
        self._allocator.free(slot)
