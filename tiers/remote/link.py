"""Calls on a shared store's clients with kvtier's deadline: the one place that knows a call may hang.

A store call blocks its thread and can hang far longer than any engine may wait: a stalled Redis
server holds a read until the socket times out, a stalled Mooncake segment owner holds a transfer for
60 s and may still write into its buffers after that. So calls run on the link's worker threads
(``start``), each with a deadline of ``timeout``: a call that returns in time is completed by the
worker that ran it (``on_done`` runs there, with no further hand-off between threads: under a busy
interpreter every hand-off waits for the GIL); past its deadline the link's watchdog abandons it: its
``on_done`` runs at once, as failed, and the call is interrupted where its client can be (Redis's: it
returns at once), else its worker keeps waiting for the client to return (the link starts another
worker for the calls that follow). ``run`` is ``start`` for a caller that waits.

A caller that waits for a call may run it on its own thread instead (``run_here``; ``run`` does): a call
on a worker costs two hand-offs between threads, the worker's wake-up and then the caller's, and under
CPU contention (engines beside each other on few cores) each waits for a core. That is offered only for
a client that is idle and ``interruptible``: at the deadline the watchdog interrupts the call, so the
caller is back by then, as it would be from a worker.

- A client whose call raised or was abandoned is dropped: closed once the call returned, never handed
  another call. So is a client with ``late_writes`` whose result says some records failed (``dirty``):
  its transfer engine may still write into their buffers until it is closed. But an abandoned call's
  client that was not interrupted (Mooncake's) and returned cleanly after all (the call was only slow,
  on a busy machine) is kept while the link has room for it: Mooncake's ``close()`` stops every thread
  of the process for most of a second.
- A call has *settled* once nothing it started can touch its buffers any more: it returned and, when
  its client was dropped, that client's ``close()`` returned. Until then the caller must keep the
  buffers from being reused (``Call.when_settled``; kvtier quarantines those host slots).
- After a failure (other than a background call's missed deadline: ``_failed``) the link is down for a
  backoff that doubles up to ``MAX_BACKOFF_S``: calls then fail at once (a lookup is a miss, a store a
  counted drop) instead of each waiting for the deadline. The first call after the backoff reconnects
  (a new client); a success ends the backoff.

At most ``clients`` clients are open at once (a client is not shared by concurrent calls); a call
waits in line for a free one within its own deadline. A ``background`` call (a write-through copy
into the store, which no engine call waits for) waits behind every other: a burst of copies on a busy
machine must not hold a load some request waits for (nor make it miss its deadline in line).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, NamedTuple, TypeVar, cast

from kvtier.core.errors import ClosedError, StoreError
from kvtier.core.jobs import mark_kvtier_thread
from kvtier.core.transfer import Latch
from kvtier.tiers.remote.client import StoreClient

log = logging.getLogger(__name__)

T = TypeVar("T")

FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 5.0
WORKER_IDLE_S = 30.0  # a worker with nothing to do for this long ends


class Connector(NamedTuple):
    """How to open one client of a store (``connect``, called on a worker), how many may be open at
    once, and where the store is for messages (never a secret)."""

    connect: Callable[[], StoreClient]
    clients: int
    where: str


class Call(Generic[T]):
    """One client call: its ``result`` or ``error`` once it returned in time (``error`` also when the
    link refused it at once), ``abandoned`` when its deadline passed first, and whether it has
    ``settled``. The link decides each call exactly once (returned in time, or not), under its lock."""

    def __init__(
        self,
        fn: Callable[[StoreClient], T],
        dirty: Callable[[T], bool],
        on_done: Callable[[Call[T]], None],
        deadline: float,
    ) -> None:
        self.result: T | None = None
        self.error: BaseException | None = None
        self.abandoned = False
        self.deadline = deadline
        self._fn = fn
        self._dirty = dirty
        self._on_done = on_done
        self._client: StoreClient | None = None  # the client it was given or connected, None: connect a new one
        self._running = False  # it has a client (else it waits in line for one)
        self._taken = False  # a thread has begun it: a worker, or its caller (run_here)
        self._here = False  # its caller runs it (run): no worker is woken for it while a client is idle
        self._background = False  # nobody waits for it: in line behind every other call
        self._decided = False
        self._in_time = False
        self._settled = Latch()

    @staticmethod
    def failed(error: BaseException) -> Call[Any]:
        """A call that never ran, failed with ``error`` (settled: it touches nothing)."""
        call: Call[Any] = Call(lambda client: None, lambda result: False, lambda call: None, 0.0)
        call.error, call._decided = error, True
        call._settled.fire()
        return call

    @property
    def ok(self) -> bool:
        """The call returned in time without raising: ``result`` is its answer."""
        return self._in_time and self.error is None

    @property
    def settled(self) -> bool:
        return self._settled.fired

    def when_settled(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once nothing this call started can touch its buffers (at once if that is so)."""
        self._settled.when_fired(callback)

    def _done(self) -> None:
        try:
            self._on_done(self)
        except Exception:  # the caller's completion must not take the link's thread down
            log.exception("a kvtier store call's completion failed")


class StoreLink:
    """Deadline-bound calls on up to ``connector.clients`` clients of one store, reconnecting with backoff."""

    def __init__(self, connector: Connector, timeout: float, purpose: str) -> None:
        self.connector = connector
        self.timeout = timeout
        self.purpose = purpose  # "loads and stores", "lookups": for messages
        self.failures = 0  # calls that raised or outlived the deadline
        self._idle: list[StoreClient] = []
        self._open = 0  # clients idle or in a call that is not abandoned
        self._in_line: deque[Call] = deque()  # calls waiting for a client, somebody waiting for them
        self._behind: deque[Call] = deque()  # background calls waiting for a client, after those
        self._by_deadline: deque[Call] = deque()  # undecided calls (and some decided), oldest first
        self._refused: deque[Call] = deque()  # calls refused at once, for the watchdog to complete
        self._unsettled: set[Call] = set()
        # Idle workers' mailboxes, the most recently idle last: a call goes to that one (``_to_worker``).
        # Mooncake's get took 2.5 ms where the same client's took 1.6 from one thread, when two workers
        # took a lone caller's calls in turn (16 x 256 KiB records); the others end after WORKER_IDLE_S.
        self._idle_workers: list[queue.SimpleQueue[Call | None]] = []
        self._watchdog: threading.Thread | None = None
        self._watching_until = float("inf")  # when the watchdog wakes next
        self._backoff = 0.0
        self._down_until = 0.0
        self._closed = False
        lock = threading.RLock()
        self._cond = threading.Condition(lock)  # calls settling, for close()
        self._watch_cond = threading.Condition(lock)  # for the watchdog alone: settling does not wake it

    def start(
        self,
        fn: Callable[[StoreClient], T],
        on_done: Callable[[Call[T]], None],
        dirty: Callable[[T], bool] = lambda result: False,
        here: bool = False,
        background: bool = False,
    ) -> Call[T]:
        """Run ``fn(client)`` on a worker within ``timeout``; ``on_done(call)`` runs exactly once, on
        another thread: on the worker once the call returned in time, on the watchdog when it did not
        (abandoned), or at once when the link refused it (down after a failure, or closed: ``error``
        says which); on the caller's own when it ran the call (``run_here``). ``dirty(result)`` says
        whether a client with ``late_writes`` must be dropped after this result. With ``here`` the
        caller promises to call ``run_here`` next: no worker is woken for the call unless it cannot
        run there. A ``background`` call waits in line behind every other (see the module's docstring)."""
        call: Call[T] = Call(fn, dirty, on_done, time.monotonic() + self.timeout)
        call._here, call._background = here, background
        with self._cond:
            try:
                self._check_up()
            except (StoreError, ClosedError) as exc:
                call.error = exc
                call._decided = True
                call._settled.fire()  # nothing started
                self._refused.append(call)
                self._wake_watchdog(0.0)
            else:
                self._unsettled.add(call)
                (self._behind if background else self._in_line).append(call)
                self._by_deadline.append(call)
                self._wake_watchdog(call.deadline)
                self._dispatch()
        return call

    def run(self, fn: Callable[[StoreClient], T], dirty: Callable[[T], bool] = lambda result: False) -> Call[T]:
        """``start`` and wait for the call (at most ``timeout``); returns it, ``ok`` or failed. Raises
        StoreError at once while the link is down after a failure, ClosedError once it is closed."""
        with self._cond:
            self._check_up()
        done = threading.Event()
        call = self.start(fn, lambda call: done.set(), dirty, here=True)
        self.run_here(call)
        done.wait()  # (an abandoned call's on_done runs on the watchdog)
        return call

    def run_here(self, call: Call, until: float = float("inf")) -> bool:
        """Run ``call`` on this thread unless a thread has begun it already, it has no idle client, the
        client is not ``interruptible``, or its deadline comes after ``until`` (a ``monotonic`` time the
        caller must be back by); True when it ran here (completed, or abandoned at its deadline)."""
        with self._cond:
            client = call._client
            interruptible = client is not None and client.interruptible
            left_here = call._here and call._running and interruptible  # _dispatch woke no worker for it
            call._here = False  # (one still in line for a client goes to a worker once one comes free)
            if call._taken or call._decided or not interruptible or call.deadline > until:
                if left_here and not call._taken:
                    self._to_worker(call)  # (abandoned meanwhile: the worker drops its client and settles it)
                return False
            call._taken = True
        self._execute(call)
        return True

    def ask(self, fn: Callable[[StoreClient], T]) -> T:
        """``run`` for a call that writes no buffer: its result, or StoreError when it failed."""
        call = self.run(fn)
        if isinstance(call.error, (StoreError, ClosedError)):
            raise call.error
        if call.error is not None:
            raise StoreError(str(call.error))
        if not call.ok:
            raise StoreError(f"no answer from {self.connector.where} within {self.timeout:g} s")
        return cast(T, call.result)

    def close(self, timeout: float | None = None) -> bool:
        """Refuse new calls, close the idle clients, and wait up to ``timeout`` for calls in flight to
        settle (their clients are closed as they return); False when some had not. Calls still in line
        for a client fail at once."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._open -= len(idle)
            while self._in_line or self._behind:
                call = (self._in_line or self._behind).popleft()
                call.error = ClosedError(f"the {self.purpose} link to {self.connector.where} is closed")
                call._decided = True
                call._settled.fire()  # nothing started
                self._unsettled.discard(call)
                self._refused.append(call)
            for mailbox in self._idle_workers:
                mailbox.put(None)
            self._idle_workers = []
            self._wake_watchdog(0.0)
        for client in idle:
            _close(client)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._unsettled:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    # --- under self._cond ------------------------------------------------------------------------

    def _check_up(self) -> None:
        if self._closed:
            raise ClosedError(f"the {self.purpose} link to {self.connector.where} is closed")
        wait = self._down_until - time.monotonic()
        if wait > 0:
            raise StoreError(
                f"{self.connector.where} failed recently; the next try for {self.purpose} is in {wait:.2f} s"
            )

    def _dispatch(self) -> None:
        """Hand calls in line to workers while there is a client for them: an idle one, or room to open one."""
        while (self._in_line or self._behind) and (self._idle or self._open < self.connector.clients):
            call = (self._in_line or self._behind).popleft()
            if self._idle:
                call._client = self._idle.pop()
            else:
                self._open += 1
            call._running = True
            if not (call._here and call._client is not None and call._client.interruptible):
                self._to_worker(call)  # (else its caller runs it: run_here)

    def _to_worker(self, call: Call) -> None:
        if self._idle_workers:
            self._idle_workers.pop().put(call)
        else:
            threading.Thread(target=self._worker, args=(call,), name="kvtier-store-call", daemon=True).start()

    def _wake_watchdog(self, at: float) -> None:
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="kvtier-store-deadlines", daemon=True)
            self._watchdog.start()
        elif at < self._watching_until:
            self._watch_cond.notify()

    # --- the workers ---------------------------------------------------------------------------

    def _worker(self, call: Call | None) -> None:
        mark_kvtier_thread()
        mailbox: queue.SimpleQueue[Call | None] = queue.SimpleQueue()
        while call is not None:
            with self._cond:
                taken, call._taken = call._taken, True
            if not taken:  # (else its caller runs it)
                self._execute(call)
            with self._cond:
                self._idle_workers.append(mailbox)
            try:
                call = mailbox.get(timeout=WORKER_IDLE_S)
            except queue.Empty:
                with self._cond:
                    if mailbox in self._idle_workers:  # no call was put there for this worker: end it
                        self._idle_workers.remove(mailbox)
                        return
                call = mailbox.get()

    def _execute(self, call: Call) -> None:
        """Connect if needed and call; then keep the client, or drop it (closed) when the call raised,
        was abandoned, or left a ``late_writes`` client dirty; complete the call if it was in time, and
        settle it. A kept client's call settles before it completes; a dropped one's after the close,
        so the caller does not wait for a slow close (Mooncake's takes most of a second)."""
        client = call._client
        late = False  # a late_writes client whose result says it may still write into buffers
        try:
            if client is None:
                client = call._client = self.connector.connect()
            call.result = call._fn(client)
            late = client.late_writes and call._dirty(call.result) and client.may_write_late()
        except Exception as exc:
            call.error = exc
        with self._cond:
            in_time = call._in_time = not call._decided
            call._decided = True
            keep = None
            if client is not None and call.error is None and not late and not self._closed:
                if in_time:
                    keep = client
                elif not client.interruptible and self._open < self.connector.clients:
                    keep = client
                    self._open += 1  # (counted out when its call was abandoned)
            if keep is not None:
                self._idle.append(keep)
            elif in_time:
                self._open -= 1  # an abandoned call's client was counted out when it was abandoned
            self._dispatch()
        if in_time:
            if call.error is None:
                self._succeeded()
            else:
                self._failed(str(call.error))
        if keep is not None:
            self._settle(call)
        if in_time:
            call._done()
        if keep is None:
            if client is not None:
                _close(client)
            self._settle(call)

    def _settle(self, call: Call) -> None:
        call._settled.fire()
        with self._cond:
            self._unsettled.discard(call)
            self._cond.notify_all()

    # --- the watchdog --------------------------------------------------------------------------

    def _watch(self) -> None:
        """Complete refused calls, and abandon calls at their deadline; ends once the link is closed and
        nothing is left to watch."""
        mark_kvtier_thread()
        while True:
            with self._cond:
                refused, self._refused = self._refused, deque()
                late: list[Call] = []
                now = time.monotonic()
                while self._by_deadline and (self._by_deadline[0]._decided or self._by_deadline[0].deadline <= now):
                    call = self._by_deadline.popleft()
                    if not call._decided:
                        self._abandon(call)
                        late.append(call)
                if not refused and not late:
                    if self._closed and not self._by_deadline:
                        self._watchdog = None
                        return
                    self._watching_until = self._by_deadline[0].deadline if self._by_deadline else float("inf")
                    self._watch_cond.wait(None if not self._by_deadline else self._watching_until - now)
                    self._watching_until = 0.0
                    continue
            for call in late:
                if call._running:
                    _interrupt(call._client)
                    self._failed(f"no answer within {self.timeout:g} s", down=not call._background)
                else:
                    self._settle(call)
                call._done()
            for call in refused:
                call._done()

    def _abandon(self, call: Call) -> None:
        """Under the lock: ``call`` missed its deadline, running (its client is counted out: room for a
        new one) or still in line for a client."""
        call._decided = call.abandoned = True
        if call._running:
            self._open -= 1
            self._dispatch()
        else:
            (self._behind if call._background else self._in_line).remove(call)
            call.error = StoreError(
                f"no {self.connector.where} client came free for {self.purpose} within {self.timeout:g} s"
            )

    # --- backoff -------------------------------------------------------------------------------

    def _failed(self, why: str, down: bool = True) -> None:
        """Count a failed call and, when ``down``, take the link down for the backoff. A background call
        past its deadline does not: nobody waits for it, and on a busy machine a large copy may just be
        slow, where refusing every load for the backoff would cost hits (a store that really hangs makes
        the loads miss their deadlines too, and they take the link down)."""
        with self._cond:
            self.failures += 1
            if not down:
                return
            first = self._backoff == 0.0
            self._backoff = min(MAX_BACKOFF_S, self._backoff * 2 or FIRST_BACKOFF_S)
            self._down_until = time.monotonic() + self._backoff
        if first:
            log.warning(
                "kvtier's remote store (%s) failed for %s: %s; trying again with backoff",
                self.connector.where,
                self.purpose,
                why,
            )

    def _succeeded(self) -> None:
        with self._cond:
            if self._backoff:
                log.info("kvtier's remote store (%s) answers %s again", self.connector.where, self.purpose)
            self._backoff = 0.0
            self._down_until = 0.0


def _interrupt(client: StoreClient | None) -> None:
    """End an abandoned call at once where its client can: its thread (the caller's, with ``run_here``)
    is back at the deadline, not after the socket's timeout."""
    if client is None or not client.interruptible:
        return
    try:
        client.interrupt()
    except Exception:  # best effort: the call still ends by its own timeouts
        log.exception("interrupting a %s call failed", client.name)


def _close(client: StoreClient) -> None:
    try:
        client.close()
    except Exception:  # closing is best effort: the client is dropped either way
        log.exception("closing a %s client failed", client.name)
