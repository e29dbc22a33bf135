"""Putting a tier's kept blocks back into its index while the tier already serves: a reopened disk slab's
(``kvtier.tiers.disk``), or those an engine's scheduler side finds after a restart
(``Medium.kept_blocks``, ``connectors/vllm/recovery.py``).

Why: the index is a Python dict, and 15.8 M inserts (a 1 TiB slab of 64 KiB blocks) take seconds
that no engine should wait for. So ``start`` claims the slots of every block at once (``Tier.claim``:
no store can take a slot whose block is still to come back, and they count as used), and a thread
puts the blocks back chunk by chunk, oldest first (``Tier.restore_claimed``), each chunk under the
tier's lock for a few milliseconds. A snapshot of one chunk or less is put back before ``start``
returns, with no thread.

While it runs:
- a block whose chunk has not come yet is a miss, never an error or wrong data;
- a store of such a key wins: when the chunk comes, the tier keeps the stored block and frees the
  old slot (a key the snapshot names twice, which only a forged one does, keeps its first slot the
  same way: a snapshot can only cause misses);
- eviction only ever sees blocks already back; a tier that needs room meanwhile evicts among those
  or finds none, and the blocks still to come are never cut (they are the tier's oldest, but most of
  them come back within seconds);
- a chunk restored after new stores sits after them in the eviction order;
- which blocks of a chunk went in (``_chunk_in``) and how far the restore is (``passed``) are known
  under the tier's lock in the same step as the chunk goes in: no store or drop comes between, so a
  subclass announcing the blocks (the vLLM scheduler side's KV events) tells neither twice nor wrong.

``held_blocks`` is what the slab's close lists in its next snapshot: it stops the restore, then lists
the blocks the index holds and after them those still to come (less any key stored again
meanwhile), so a close in the middle loses nothing a finished restore would have kept. If the thread
fails, it logs why and frees the slots still claimed (those blocks are lost: misses), never a hang.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from itertools import compress

import numpy as np

from kvtier.core.errors import StateError
from kvtier.core.tier import Tier

log = logging.getLogger(__name__)


class ChunkedRestore:
    """Blocks put back into ``tier`` chunk by chunk on a thread of their own (see the module)."""

    chunk = 65536
    """Blocks per step: some 35 ms under the tier's lock at 15.8 M blocks (2-core VM, ``bench/index.py``)."""

    def __init__(self, tier: Tier, name: str) -> None:
        self._tier = tier
        self._name = name  # for the log lines: the slab's path
        self._keys: Sequence[bytes] = []
        self._slots = np.empty(0, np.int64)
        self._next = 0  # the first block not put back yet (advanced under _lock)
        self._restored = 0
        self._stopped = False
        self._started: float | None = None
        self._lock = threading.Lock()  # taken before the tier's, never after it
        self.thread: threading.Thread | None = None
        self.done = threading.Event()  # set once every block is back, or the restore stopped or failed

    def start(self, keys: Sequence[bytes], slots: Sequence[int] | np.ndarray) -> None:
        """Claim the slots of ``keys[i]`` at ``slots[i]`` (oldest first) and put the blocks back: now
        when they fit in one chunk, on a thread otherwise. StateError (nothing claimed, the restore
        not started) for a slot out of range, taken or given twice: ``DiskSlab.recover`` then scans."""
        if self._started is not None:
            raise RuntimeError("a restore starts once")
        if len(keys) != len(slots):
            raise StateError(f"restore got {len(keys)} keys for {len(slots)} slots")
        self._slots = self._tier.claim(slots)
        self._keys, self._started = keys, time.perf_counter()
        if len(keys) <= self.chunk:
            self._run()
        else:
            self.thread = threading.Thread(target=self._run, name=f"kvtier-restore {self._name}", daemon=True)
            self.thread.start()

    @property
    def passed(self) -> int:
        """How many blocks, oldest first, the restore is past: each chunk's count grows under the tier's
        lock in the same step as the chunk goes in, so a caller that sees the tier after a chunk went
        in (a drop of one of its blocks, say) then reads a count past that chunk."""
        return self._next

    def step(self) -> bool:
        """Put back the next chunk; whether blocks are left to put back (False once stopped)."""
        start = self._next
        stop = min(start + self.chunk, len(self._slots))
        keys = list(self._keys[start:stop])  # (the key objects are made outside every lock)
        slots = self._slots[start:stop]

        def went(went_in: np.ndarray) -> None:  # (under the tier's lock, as the blocks go in)
            self._next = stop
            self._chunk_in(start, went_in)

        with self._lock:
            if self._stopped:
                return False
            self._restored += self._tier.restore_claimed(keys, slots, went)
            return stop < len(self._slots)

    def _chunk_in(self, first: int, went_in: np.ndarray) -> None:
        """Called as each chunk goes in, under the tier's lock (cheap work only): which of its blocks,
        from ``keys[first]`` on, went in (False: a key the tier held already, stored meanwhile or named
        twice). For a subclass that reports them."""

    def stop(self) -> tuple[list[bytes], np.ndarray]:
        """Put back no more blocks from now on; returns the keys and slots of those not back, whose
        slots stay claimed."""
        with self._lock:
            self._stopped = True
            left = self._next
        self.done.set()
        return list(self._keys[left:]), self._slots[left:]

    def held_blocks(self) -> tuple[list[bytes], list[int]]:
        """What a snapshot of the tier lists, oldest first: its READY blocks, then those this restore
        had not put back yet, less any key the tier holds meanwhile (``DiskSlab.held_blocks``). Stops
        the restore."""
        keys, slots = self.stop()
        held_keys, held_slots = self._tier.ready_blocks()
        if keys:
            wanted = ~self._tier.holds(keys)
            held_keys += compress(keys, wanted)
            held_slots += slots[wanted].tolist()
        return held_keys, held_slots

    def _run(self) -> None:
        try:
            while self.step():
                pass
        except Exception:
            log.exception("disk tier %s: restoring its index failed; the blocks not back yet are dropped", self._name)
            with self._lock:
                if not self._stopped:
                    self._stopped = True
                    self._tier.release(self._slots[self._next :])
                    self._next = len(self._slots)  # (so no snapshot lists them)
        finally:
            self._finish()

    def _finish(self) -> None:
        """Log how it went; let go of the snapshot's columns (hundreds of MB at 15.8 M blocks)."""
        with self._lock:
            given, left = len(self._slots), len(self._slots) - self._next
            if not self._stopped:
                self._keys, self._slots = [], self._slots[:0]
        assert self._started is not None
        log.info(
            "disk tier %s: %d of %d blocks back in its index in %.2f s%s",
            self._name,
            self._restored,
            given,
            time.perf_counter() - self._started,
            f" ({left} left when it stopped)" if left else "",
        )
        self.done.set()
