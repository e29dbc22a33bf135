"""The node daemon (``kvtier node serve CONFIG``): one cache per machine. It owns the slab (shared memory
every engine process on the machine maps, ``kvtier.tiers.node.slab``), the index of the blocks in it and
its eviction policy, and answers engines' control messages on a Unix socket (``kvtier.tiers.node.protocol``);
engines copy the bytes themselves.

What it guarantees, whatever engines do:

- a block is visible (LOOKUP, PIN) only once its writer committed it, and a slot goes to a new writer only
  with a new generation in its header (before the writer hears of it), so a reader that checks the
  generation never takes another writer's bytes for its block;
- pins and reservations belong to a connection: when it closes (the engine exited, was killed, or its
  call timed out) they are given back, and a connection that holds one longer than ``lease`` seconds (a
  stopped engine) is closed; one connection holds at most ``max_held`` of the slots;
- only processes of allowed users connect (the kernel's peer credentials); a malformed, oversized or
  unknown message closes that connection with one log line and touches nothing else;
- a restarted daemon finds its slab (same path and geometry) and restores the index from the slot
  headers, newest copy of a key first: a restart keeps the cache warm.

One thread per connection; every change to the index and the headers happens under one lock (each is a
few microseconds of work: the bytes never pass through the daemon). Tiers below the slab (a disk cache,
a store shared with other machines) get a copy of every committed block; a block only they hold is
brought up into the slab for the engine that pins it, read once however many engines want it; a store
below is asked about blocks found nowhere else, never under the lock.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import pwd
import socket
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from kvtier.builder import build_stack
from kvtier.core.devices import HOST, HOST_DEVICE
from kvtier.core.errors import ConfigError, StateError
from kvtier.core.jobs import JobManager
from kvtier.core.layout import BlockLayout
from kvtier.core.stack import TierStack
from kvtier.core.storage import contiguous_storage
from kvtier.core.tier import BlockState, Tier
from kvtier.node_config import NodeConfig
from kvtier.tiers.keyed import KeyedTier
from kvtier.tiers.node.protocol import (
    BUSY,
    DECLINED,
    ERROR,
    FULL,
    HELD,
    MAX_KEYS,
    OK,
    POSTED,
    VERSION,
    Op,
    ProtocolError,
    frame,
    peer_credentials,
    read_frame,
    request,
)
from kvtier.tiers.node.slab import FREE, READY, WRITING, Geometry, SlabFile, checksum

log = logging.getLogger("kvtier.node")

PROMOTE_TIMEOUT_S = 10.0
"""How long bringing blocks up from a tier below the slab may take (a disk read, a store's): past it, a miss
(the slots the read may still write stay reserved until it ends: ``_bring_up``)."""

ASKING_THREADS = 4
"""Queries to a store below the slab at once (each asks for many keys; concurrent askers share one)."""

QUERIES_WAITING = 64
"""Queries to the store below the slab that may wait for an asking thread: while the store hangs, more
lookups are misses at once rather than a queue that grows with every engine's step."""

ACCEPT_POLL_S = 0.2
"""How often the accepting thread looks up from ``accept`` to end leases past due and to stop."""

DAEMON_COUNTS = ("connections", "refused", "revoked", "protocol_errors", "promoted", "store_late")
"""What the daemon counts on its own (``NodeDaemon.stats``)."""

SESSION_COUNTS = (
    *("lookups", "found", "hits", "misses", "stores", "skipped", "busy", "full", "declined", "aborted", "dropped"),
)
"""What is counted per connection, and summed over all of them for the daemon (``NodeDaemon.stats``)."""


class Session:
    """One engine connection: its peer, what it holds (pins, reservations, each since when), its counts."""

    def __init__(self, daemon: NodeDaemon, sock: socket.socket, pid: int, uid: int) -> None:
        self.daemon = daemon
        self.sock = sock
        self.pid = pid
        self.uid = uid
        self.name = f"pid {pid} (uid {uid})"
        self.pins: dict[bytes, tuple[int, float]] = {}  # node key -> (pin count, since)
        self.reserved: dict[bytes, tuple[int, int, float]] = {}  # node key -> (slot, generation, since)
        self.counts: Counter[str] = Counter()
        self.revoked = False
        self.thread = threading.Thread(target=self.run, name=f"kvtier-node-{pid}", daemon=True)

    @property
    def held(self) -> int:
        return len(self.pins) + len(self.reserved)

    def oldest_hold(self) -> float | None:
        """When the oldest pin or reservation this connection holds was taken (None: it holds none)."""
        times = [since for _, since in self.pins.values()] + [since for _, _, since in self.reserved.values()]
        return min(times, default=None)

    def run(self) -> None:
        try:
            self._hello()
            while True:
                op, args = request(read_frame(self.sock))
                reply = self.daemon.handle(self, op, args)
                if op not in POSTED:
                    self.sock.sendall(frame([OK, *reply]))
        except EOFError:
            pass
        except ProtocolError as exc:
            self.daemon.count("protocol_errors")
            log.warning("node: closed the connection of %s: %s", self.name, exc)
        except OSError as exc:
            if not self.revoked:
                log.info("node: the connection of %s ended: %s", self.name, exc)
        finally:
            self.daemon.end(self)

    def _hello(self) -> None:
        op, args = request(read_frame(self.sock))
        if op is not Op.HELLO:
            raise ProtocolError(f"the first message must be HELLO, got {op.name}")
        version, pid = args
        if version != VERSION:
            self.sock.sendall(frame([ERROR, f"protocol version {version}, this daemon speaks {VERSION}"]))
            raise ProtocolError(f"protocol version {version}, this daemon speaks {VERSION}")
        slab = self.daemon.slab
        hello = [OK, VERSION, *slab.geometry, slab.view.id, self.daemon.node_id]
        socket.send_fds(self.sock, [frame(hello)], [slab.shared_fd])
        self.name = f"pid {self.pid} (uid {self.uid})"


class NodeDaemon:
    """The daemon ``config`` describes, serving from construction on (``serve`` accepts connections)."""

    def __init__(self, config: NodeConfig, node_id: str | None = None) -> None:
        self.config = config
        self.settings = config.node
        self.node_id = node_id or socket.gethostname()
        tier_cfg = config.stack.tiers[0]
        geometry = Geometry.for_blocks(1, config.block_bytes)
        slots = tier_cfg.capacity_blocks or (tier_cfg.capacity or 0) // geometry.slot_bytes
        if slots < 1:
            raise ConfigError(f"tiers[0]: the slab holds no slot of {geometry.slot_bytes} bytes; raise its capacity")
        self.slab = SlabFile(self.settings.slab, Geometry(slots, geometry.slot_bytes), self.settings.hugepages)
        self.stack: TierStack | None = None
        # node key -> the tenant tag its writer gave (RESERVE), for the slab's shares: set while the key is
        # not in the slab, kept while it is (so a block's tenant never changes under the policy)
        self._tags: dict[bytes, bytes] = {}
        try:
            view = self.slab.view
            layout = BlockLayout((geometry.slot_bytes,))

            def slab_tier(jobs: JobManager) -> Tier:
                storage = contiguous_storage(view.base, slots, layout, HOST_DEVICE, view)
                policy, watermark = config.stack.tier_policy(0, tag_of=lambda key: self._tags.get(key, b""))
                name = config.stack.tier_name(0)
                return Tier(name, HOST, storage, policy, watermark, jobs.is_fenced, note=self.settings.slab)

            self.stack = build_stack(config.stack, layout, first=slab_tier)
            self.tier = self.stack.tiers[0]
            self.below = self.stack.tiers[1:]  # the machine's tiers under the slab (a disk cache, a store)
            self.store = next((tier for tier in self.below if isinstance(tier, KeyedTier)), None)
            self._asking = concurrent.futures.ThreadPoolExecutor(ASKING_THREADS, "kvtier-node-store")
            self._queries = threading.BoundedSemaphore(ASKING_THREADS + QUERIES_WAITING)
            self.headers = view.headers
            self.view = view
            self._lock = threading.Lock()
            self._seq = int(view.seq.max())
            self.restored = self._restore()
            self._counts: Counter[str] = Counter()
            self._sessions: set[Session] = set()
            self._stopping = threading.Event()
            self._promotions: dict[bytes, threading.Event] = {}  # key -> set once its trip up into the slab ended
            self.listener = _listen(self.settings.socket, self.settings.others_allowed)
        except BaseException:
            if self.stack is not None:
                self.stack.close()
            self.slab.close()
            raise
        log.info(
            "node: serving %d slots of %d bytes from %s on %s (%d blocks restored)",
            slots,
            geometry.slot_bytes,
            self.settings.slab,
            self.settings.socket,
            self.restored,
        )

    # --- the slab's index at start -------------------------------------------------------------

    def _restore(self) -> int:
        """Index the READY blocks the slab's headers name, newest copy of each key (by commit count) only,
        oldest first; an older copy's slot is freed. Returns how many blocks came back."""
        h = self.headers
        ready = np.flatnonzero(
            (h["state"] == READY) & (h["length"] > 0) & (h["length"] <= self.slab.geometry.slot_bytes)
        )
        newest_first = ready[np.argsort(h["seq"][ready], kind="stable")[::-1]]
        seen: set[bytes] = set()
        keep = []
        for slot in newest_first.tolist():
            key = bytes(h["key"][slot])
            if key in seen:
                h["state"][slot] = FREE
            else:
                seen.add(key)
                keep.append(slot)
        keep.reverse()
        return self.tier.restore([bytes(h["key"][slot]) for slot in keep], keep)

    # --- serving -------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Make ``serve`` return (from a signal handler: it only sets a flag)."""
        self._stopping.set()

    def serve(self) -> None:
        """Accept connections until ``request_stop`` or ``stop``; ends leases past due between accepts."""
        self.listener.settimeout(ACCEPT_POLL_S)
        while not self._stopping.is_set():
            try:
                sock, _ = self.listener.accept()
            except TimeoutError:
                self._end_overdue_leases()
                continue
            except OSError:
                if self._stopping.is_set():
                    break
                raise
            self._admit(sock)
            self._end_overdue_leases()

    def _admit(self, sock: socket.socket) -> None:
        """Start a session for an allowed peer; refuse (one log line) a user not allowed or one too many."""
        pid, uid, gid = peer_credentials(sock)
        if not self._allowed(uid, gid):
            self.count("refused")
            log.warning("node: refused a connection of pid %d: uid %d is not allowed (node.allow_users)", pid, uid)
            sock.close()
            return
        with self._lock:
            full = len(self._sessions) >= self.settings.max_connections
            if not full:
                session = Session(self, sock, pid, uid)
                self._sessions.add(session)
        if full:
            self.count("refused")
            log.warning("node: refused a connection of pid %d: %d connections already", pid, len(self._sessions))
            sock.close()
            return
        sock.settimeout(None)
        self.count("connections")
        session.thread.start()

    def _allowed(self, uid: int, gid: int) -> bool:
        if uid in self.settings.allowed_uids:
            return True
        groups = self.settings.allowed_gids
        if not groups:
            return False
        try:
            member_of = set(os.getgrouplist(pwd.getpwuid(uid).pw_name, gid))
        except KeyError:
            member_of = {gid}
        return not groups.isdisjoint(member_of)

    def _end_overdue_leases(self) -> None:
        """Close the connections holding a pin or a reservation longer than the lease (a stopped engine):
        what they hold is given back as their threads end."""
        limit = time.monotonic() - self.settings.lease
        with self._lock:
            overdue = [s for s in self._sessions if not s.revoked and (s.oldest_hold() or limit + 1) < limit]
            for session in overdue:
                session.revoked = True
        for session in overdue:
            self.count("revoked")
            log.warning(
                "node: closed the connection of %s: it held blocks over the %g s lease",
                session.name,
                self.settings.lease,
            )
            _shut(session.sock)

    def end(self, session: Session) -> None:
        """A connection is over: give back what it held."""
        with self._lock:
            for key, (slot, _, _) in session.reserved.items():
                self.view.state[slot] = FREE
                self.tier.abort([key])
            for key, (count, _) in session.pins.items():
                self.tier.unpin([key] * count)
            session.reserved.clear()
            session.pins.clear()
            self._sessions.discard(session)
            self._counts.update(session.counts)
        session.sock.close()

    def stop(self) -> None:
        """Stop accepting, close every connection (their holds are given back), close the slab (it stays,
        for the next daemon) and remove the socket."""
        self._stopping.set()
        self.listener.close()
        with self._lock:
            sessions = list(self._sessions)
        for session in sessions:
            _shut(session.sock)
        for session in sessions:
            session.thread.join(timeout=5)
        try:
            os.unlink(self.settings.socket)
        except FileNotFoundError:
            pass
        self._asking.shutdown(wait=False, cancel_futures=True)  # (a query ends by the store's timeout)
        assert self.stack is not None
        self.stack.close()  # (its copies down to a disk tier or a store end first)
        self.slab.close()

    # --- requests ------------------------------------------------------------------------------

    def handle(self, session: Session, op: Op, args: list[Any]) -> list[Any]:
        """Answer one request of ``session`` (checked by ``protocol.request``); the reply's results."""
        if op is Op.PIN:  # (takes the lock itself: a block from a tier below comes up without it)
            return [self._pin(session, *args)]
        if op is Op.LOOKUP:  # (the same: a store below is asked without it)
            return [self._lookup(session, *args)]
        with self._lock:
            if op is Op.RESERVE:
                return [self._reserve(session, *args)]
            if op is Op.STATS:
                return [self._stats_of(session)]
            posted: dict[Op, Callable[..., None]] = {
                Op.RELEASE: self._release,
                Op.TOUCH: self._touch,
                Op.COMMIT: self._commit,
                Op.ABORT: self._abort,
                Op.DROP: self._drop,
            }
            handler = posted.get(op)
            if handler is None:
                raise ProtocolError(f"{op.name} is not a request after HELLO")
            handler(session, *args)
            return []

    def _lookup(self, session: Session, keys: list[bytes]) -> list[list[int] | None]:
        """Where each READY key is now: [slot, generation] in the slab (an engine may read it there,
        checking the header), [] in a tier below (a pin brings it up), or None. Keys found nowhere are
        asked of the store below the slab, if any, without the lock (``_ask_store``)."""
        with self._lock:
            out = [self._where(key) if self.tier.state(key) is BlockState.READY else self._below(key) for key in keys]
        unknown = [key for key, where in zip(keys, out, strict=True) if where is None]
        answered = bool(unknown) and self._ask_store(unknown)
        with self._lock:
            if answered:
                out = [where if where is not None else self._below(key) for key, where in zip(keys, out, strict=True)]
            session.counts["lookups"] += len(keys)
            session.counts["found"] += len(keys) - out.count(None)
        return out

    def _ask_store(self, keys: list[bytes]) -> bool:
        """Ask the store below the slab which of ``keys`` it holds (one batched query; a key another
        connection is asking about is not asked twice), waiting at most ``below_wait``: an answer that
        comes later is kept for the next lookup (a few seconds), this one calls them misses, so that a
        slow store never makes an engine's call to the daemon time out. Whether it answered in time."""
        if self.store is None:
            return False
        if self._queries.acquire(blocking=False):
            asked = self._asking.submit(self.store.query, keys)
            asked.add_done_callback(lambda _: self._queries.release())
            try:
                asked.result(self.settings.below_wait)
                return True
            except concurrent.futures.TimeoutError:
                pass
        with self._lock:
            self._counts["store_late"] += 1
        return False

    def _where(self, key: bytes) -> list[int]:
        """[slot, generation] of a block the slab holds."""
        slot = self.tier.slots([key])[0]
        return [slot, int(self.view.gen[slot])]

    def _below(self, key: bytes) -> list[int] | None:
        """[] where a tier below the slab holds ``key``, else None."""
        return [] if any(tier.state(key) is BlockState.READY for tier in self.below) else None

    def _touch(self, session: Session, keys: list[bytes]) -> None:
        """Blocks an engine read where a lookup said they were: a use for the policy (the leading READY run)."""
        tier = self.tier
        tier.unpin(keys[: len(tier.pin_leading(keys))])
        session.counts["hits"] += len(keys)

    def _pin(self, session: Session, keys: list[bytes], length: int) -> list[list[int] | None]:
        """Pin what the slab holds READY, after bringing up what only a tier below holds (``_promote``),
        at most the connection's room; per key its [slot, generation], or None."""
        self._promote(keys, length)
        with self._lock:
            room = self._room(session)
            slots: list[int | None] = list(self.tier.pin_leading(keys[:room]))
            for key in keys[len(slots) : room]:
                slots.append(self._try_pin(key))
            pins, now, gen = session.pins, time.monotonic(), self.view.gen
            out: list[list[int] | None] = []
            for key, slot in zip(keys, slots, strict=False):
                if slot is None:
                    out.append(None)
                    continue
                count, since = pins.get(key, (0, now))
                pins[key] = (count + 1, since)
                out.append([slot, int(gen[slot])])
            out += [None] * (len(keys) - len(out))
            hits = len(keys) - out.count(None)
            session.counts["hits"] += hits
            session.counts["misses"] += len(keys) - hits
            return out

    def _promote(self, keys: list[bytes], length: int) -> None:
        """Bring the blocks of ``keys`` that only a tier below the slab holds up into it: a slot each, handed
        out as to a writer (a new generation), the block read into it by the stack (its own copies), the
        header's checksum the daemon's, then READY. A block another connection is bringing up already is
        waited for, not read again: however many engines want it at once, it is read once. Without the
        lock while blocks move; bounded by PROMOTE_TIMEOUT_S (what does not come is a miss)."""
        if not self.below or length > self.slab.geometry.slot_bytes:
            return
        with self._lock:
            waits = [self._promotions[key] for key in keys if key in self._promotions]
            up = [
                key
                for key in dict.fromkeys(keys)
                if key not in self._promotions
                and self.tier.state(key) is BlockState.FREE
                and self._below(key) is not None
            ]
            slots = self.tier.reserve(up) if up else []
            if slots is None:  # (no room for all: none come up; the pins find what the slab has)
                up, slots = [], []
            if up:
                gens = self._hand_out(np.array(slots), up, [length] * len(up), os.getpid())
                done = threading.Event()
                self._promotions.update(dict.fromkeys(up, done))
        if up:
            self._bring_up(up, slots, gens, length, done)
        for wait in waits:
            wait.wait(PROMOTE_TIMEOUT_S)

    def _bring_up(
        self, keys: list[bytes], slots: list[int], gens: list[int], length: int, done: threading.Event
    ) -> None:
        """Read ``keys`` from the tiers below into their reserved slab ``slots``; publish those that came.
        A read still running at PROMOTE_TIMEOUT_S is given up (the engines waiting for it get misses),
        but its slots stay reserved, and its keys promoted, until it ends: it may still write there."""
        assert self.stack is not None
        arrived = 0
        loading = self.stack.load(keys, self.tier.storage, slots, HOST)
        try:
            result = loading.result(PROMOTE_TIMEOUT_S)
            arrived = result.hits
            failed = set(result.failed)
        except concurrent.futures.TimeoutError:
            log.warning(
                "node: %d blocks of a tier below the slab took over %s s to come up", len(keys), PROMOTE_TIMEOUT_S
            )
            done.set()
            loading.add_done_callback(lambda _: self._brought_up(keys, slots, gens, length, done, []))
            return
        except Exception:
            log.exception("node: blocks of a tier below the slab did not come up")
            failed = set()
        self._brought_up(keys, slots, gens, length, done, [i for i in range(arrived) if i not in failed])

    def _brought_up(
        self, keys: list[bytes], slots: list[int], gens: list[int], length: int, done: threading.Event, good: list[int]
    ) -> None:
        """Publish blocks ``good`` (indexes in ``keys``) read into their slots, with the daemon's checksum;
        give the other slots back; the keys are no longer being promoted."""
        with self._lock:
            view = self.view
            for i in good:
                h = checksum(gens[i], keys[i])
                h.update(view.block(slots[i], length))
                view.checksum[slots[i]] = h.intdigest()
            if good:
                self._publish([keys[i] for i in good], [slots[i] for i in good])
            kept = set(good)
            lost = [i for i in range(len(keys)) if i not in kept]
            if lost:
                view.state[[slots[i] for i in lost]] = FREE
                self.tier.abort([keys[i] for i in lost])
            for key in keys:
                del self._promotions[key]
            self._counts["promoted"] += len(good)
        done.set()

    def _try_pin(self, key: bytes) -> int | None:
        try:
            return self.tier.pin([key])[0]
        except StateError:
            return None

    def _release(self, session: Session, keys: list[bytes]) -> None:
        pins = session.pins
        mine = [key for key in keys if key in pins]  # (others are not this connection's: nothing to give back)
        self.tier.unpin(mine)
        for key in mine:
            count, since = pins[key]
            if count > 1:
                pins[key] = (count - 1, since)
            else:
                del pins[key]

    def _reserve(self, session: Session, keys: list[bytes], lengths: list[int], tags: list[bytes]) -> list[Any]:
        """A slot per key that no writer has yet, that the slab's policy admits and that fits, at most
        the connection's room (evicting through the policy, all at once where room allows); per key
        [slot, generation] or why not. The slots' generations move before anyone hears of them. Each
        key not in the slab takes the tenant ``tags`` gives it (``_note_tags``)."""
        tier, fits = self.tier, self.slab.geometry.slot_bytes
        states = [tier.state(key) for key in keys]
        fresh = [i for i, state in enumerate(states) if state is BlockState.FREE]
        self._note_tags([keys[i] for i in fresh], [tags[i] for i in fresh])
        admitted = tier.admit([keys[i] for i in fresh])
        out: list[Any] = [
            [*self._where(key), HELD] if state is BlockState.READY else BUSY
            for key, state in zip(keys, states, strict=True)
        ]
        wanted = []
        for i, ok in zip(fresh, admitted, strict=True):
            if self._below(keys[i]) is not None:
                out[i] = [HELD]  # (in a tier below: a pin brings it up)
            else:
                out[i] = FULL if ok and lengths[i] > fits else DECLINED if not ok else None
            if out[i] is None:
                wanted.append(i)
        for i in wanted[self._room(session) :]:
            out[i] = FULL
        wanted = wanted[: self._room(session)]
        if wanted:
            tier.expect([keys[i] for i in wanted])
        slots = tier.reserve([keys[i] for i in wanted]) if wanted else []
        if slots is None:  # (no room for all: as many as it has, one by one)
            slots = []
            for i in wanted:
                got = tier.reserve([keys[i]])
                if got is None:
                    break
                slots += got
        granted = wanted[: len(slots)]
        for i in wanted[len(slots) :]:
            out[i] = FULL
        if granted:
            gens = self._hand_out(
                np.array(slots), [keys[i] for i in granted], [lengths[i] for i in granted], session.pid
            )
            now = time.monotonic()
            for i, slot, gen in zip(granted, slots, gens, strict=True):
                session.reserved[keys[i]] = (slot, gen, now)
                out[i] = [slot, gen]
        session.counts["skipped"] += sum(isinstance(entry, list) and entry[-1:] == [HELD] for entry in out)
        for outcome, name in ((BUSY, "busy"), (FULL, "full"), (DECLINED, "declined")):
            session.counts[name] += out.count(outcome)
        return out

    def _note_tags(self, keys: list[bytes], tags: list[bytes]) -> None:
        """Note the tenants of blocks not in the slab. Tags of blocks no longer in it are forgotten first,
        once they outnumber its slots twice (a block brought up from a tier below after that is nobody's:
        counted ``none``)."""
        if len(self._tags) > 2 * self.tier.capacity + MAX_KEYS:
            self._tags = {k: t for k, t in self._tags.items() if self.tier.state(k) is not BlockState.FREE}
        for key, tag in zip(keys, tags, strict=True):
            if tag:
                self._tags[key] = tag
            else:
                self._tags.pop(key, None)

    def _hand_out(self, slots: np.ndarray, keys: list[bytes], lengths: list[int], writer: int) -> list[int]:
        """Write the headers of slots given to a writer: the generation first (a reader of what the slot
        held before fails its check from then on), then WRITING, the key and length; their generations."""
        view = self.view
        view.gen[slots] += 1
        view.state[slots] = WRITING
        view.length[slots] = lengths
        view.keys[slots] = np.frombuffer(b"".join(keys), np.uint8).reshape(len(keys), -1)
        view.checksum[slots] = 0
        view.seq[slots] = 0
        view.writer[slots] = writer
        return view.gen[slots].tolist()

    def _commit(self, session: Session, keys: list[bytes]) -> None:
        """Publish this connection's reservations among ``keys`` (others are not its own: ignored)."""
        view = self.view
        mine = [(key, session.reserved.pop(key)) for key in keys if key in session.reserved]
        good = [(key, slot) for key, (slot, gen, _) in mine if int(view.gen[slot]) == gen]
        if len(good) < len(mine):  # (somebody wrote into a header: the slot is not the writer's)
            log.warning("node: %s committed blocks whose slot headers were overwritten; dropped", session.name)
            self.tier.abort([key for key, (slot, gen, _) in mine if int(view.gen[slot]) != gen])
        if good:
            self._publish([key for key, _ in good], [slot for _, slot in good])
        session.counts["stores"] += len(good)

    def _publish(self, keys: list[bytes], slots: list[int]) -> None:
        """Make blocks written into their slots READY: the headers say so (with their commit count), the
        index too; the stack copies them down (write-through) and keeps the slab to its watermark."""
        view, at = self.view, np.array(slots)
        view.seq[at] = np.arange(self._seq + 1, self._seq + 1 + len(keys))
        self._seq += len(keys)
        view.state[at] = READY
        assert self.stack is not None
        self.tier.commit(keys, pin=self.stack.copies_on(0))
        self.stack.committed(0, keys)

    def _abort(self, session: Session, keys: list[bytes]) -> None:
        """Give back this connection's reservations among ``keys`` (others are not its own: ignored)."""
        mine = [(key, session.reserved.pop(key)) for key in keys if key in session.reserved]
        if mine:
            self.view.state[[slot for _, (slot, _, _) in mine]] = FREE
            self.tier.abort([key for key, _ in mine])
            session.counts["aborted"] += len(mine)

    def _drop(self, session: Session, pairs: list[tuple[bytes, int]]) -> None:
        """Blocks a load found damaged: unreadable for everyone from now on (unless pinned by another
        reader, or stored anew since: its generation moved)."""
        for key, gen in pairs:
            if self.tier.state(key) is not BlockState.READY:
                continue
            slot = self.tier.slots([key])[0]
            if int(self.view.gen[slot]) == gen and self.tier.discard([key]):
                self.view.state[slot] = FREE
                session.counts["dropped"] += 1

    def _room(self, session: Session) -> int:
        """How many more blocks ``session`` may pin or reserve (``max_held`` of the slots)."""
        return max(0, int(self.settings.max_held * self.tier.capacity) - session.held)

    # --- counts --------------------------------------------------------------------------------

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def stats(self) -> dict[str, Any]:
        """The daemon's counts (every connection's, ended ones too), the slab's use, and per connection
        its counts (``engines``)."""
        with self._lock:
            return {**self._totals(), "engines": {s.name: dict(s.counts, held=s.held) for s in self._sessions}}

    def _stats_of(self, session: Session) -> dict[str, Any]:
        """What STATS answers (under the lock): the daemon's numbers and this connection's own."""
        return {**self._totals(), "this_connection": dict(session.counts, held=session.held)}

    def _totals(self) -> dict[str, Any]:
        """The daemon's counts, the slab's use and its tenants' (under the lock)."""
        totals = Counter(self._counts)
        for session in self._sessions:
            totals.update(session.counts)
        usage = self.tier.usage()
        return {
            **{name: totals[name] for name in (*SESSION_COUNTS, *DAEMON_COUNTS)},
            "evicted": self.tier.stats.evicted,
            "copied_down": sum(tier.stats.committed for tier in self.below),
            "used_slots": usage.used,
            "slots": usage.capacity,
            "slot_bytes": self.slab.geometry.slot_bytes,
            "connected": len(self._sessions),
            "held": sum(session.held for session in self._sessions),
            "tenants": self.tier.tenant_counts() or {},  # per tenant label, where the slab has shares
        }


def _listen(path: str, others_allowed: bool) -> socket.socket:
    """A listening socket at ``path``, 0600 (0666 where other users are allowed: their peer credentials
    decide). A stale socket there (nobody answers) is replaced; a live one or anything else is an error."""
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise ConfigError(f"node.socket: {path} exists and is not a socket: refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
            raise ConfigError(f"node.socket: another daemon listens at {path}")
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    umask = os.umask(0o177)
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"node.socket: cannot listen at {path}: {exc.strerror}") from None
    finally:
        os.umask(umask)
    if others_allowed:
        os.chmod(path, 0o666)
    sock.listen(128)
    return sock


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
