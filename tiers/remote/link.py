"""Calls on a shared store's clients with kvtier's deadline: the one place that knows a call may hang.

A store call blocks its thread and can hang far longer than any engine may wait: a stalled Redis
server holds a read until the socket times out, a stalled Mooncake segment owner holds a transfer for
60 s and may still write into its buffers after that. So every call runs on a thread of its own
(``Call``), and its caller waits at most ``timeout``; past it the call is abandoned: the caller treats
it as failed, while its thread keeps waiting for the client to return.

- A client whose call raised or was abandoned is dropped: closed once the call returned, never handed
  another call. So is a client with ``late_writes`` whose result says some records failed (``dirty``):
  its transfer engine may still write into their buffers until it is closed.
- A call has *settled* once nothing it started can touch its buffers any more: it returned and, when
  its client was dropped, that client's ``close()`` returned. Until then the caller must keep the
  buffers from being reused (``Call.when_settled``; kvtier quarantines those host slots).
- After a failure the link is down for a backoff that doubles up to ``MAX_BACKOFF_S``: calls then fail
  at once (a lookup is a miss, a store a counted drop) instead of each waiting for the deadline. The
  first call after the backoff reconnects (a new client); a success ends the backoff.

At most ``clients`` clients are open at once (a client is not shared by concurrent calls); a call
waits for a free one within its own deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, NamedTuple, TypeVar, cast

from kvtier.core.errors import ClosedError, StoreError
from kvtier.core.transfer import Latch
from kvtier.tiers.remote.client import StoreClient

log = logging.getLogger(__name__)

T = TypeVar("T")

FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 5.0


class Connector(NamedTuple):
    """How to open one client of a store (``connect``, called on a call's thread), how many may be open
    at once, and where the store is for messages (never a secret)."""

    connect: Callable[[], StoreClient]
    clients: int
    where: str


class Call(Generic[T]):
    """One client call on a thread of its own: its ``result`` or ``error`` once it returned in time,
    ``abandoned`` when its caller stopped waiting first, and whether it has ``settled``."""

    def __init__(self) -> None:
        self.result: T | None = None
        self.error: BaseException | None = None
        self.abandoned = False
        self._in_time = False
        self._returned = threading.Event()
        self._lock = threading.Lock()
        self._settled = Latch()

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

    def _wait(self, timeout: float) -> bool:
        """The caller: wait for the call at most ``timeout``; False (abandoned from then on) when it
        did not return in time."""
        self._returned.wait(timeout)
        with self._lock:
            self.abandoned = not self._in_time
            return self._in_time

    def _claim(self) -> bool:
        """The call's thread, once the call returned: True when it is in time (not abandoned yet).
        Exactly one of this and ``_wait`` decides, under the lock."""
        with self._lock:
            self._in_time = not self.abandoned
            return self._in_time

    def _settle(self) -> None:
        self._settled.fire()


class StoreLink:
    """Deadline-bound calls on up to ``connector.clients`` clients of one store, reconnecting with backoff."""

    def __init__(self, connector: Connector, timeout: float, purpose: str) -> None:
        self.connector = connector
        self.timeout = timeout
        self.purpose = purpose  # "loads and stores", "lookups": for messages
        self.failures = 0  # calls that raised or outlived the deadline
        self._idle: list[StoreClient] = []
        self._open = 0  # clients idle or in a call that is not abandoned
        self._unsettled: set[Call] = set()
        self._backoff = 0.0
        self._down_until = 0.0
        self._closed = False
        self._cond = threading.Condition()

    def run(self, fn: Callable[[StoreClient], T], dirty: Callable[[T], bool] = lambda result: False) -> Call[T]:
        """Run ``fn(client)`` on a thread of its own and wait for it at most ``timeout``; returns the
        call (``ok``, or failed: raised or abandoned). ``dirty(result)`` says whether a client with
        ``late_writes`` must be dropped after this result. Raises StoreError at once while the link
        is down after a failure, ClosedError once it is closed."""
        deadline = time.monotonic() + self.timeout
        call: Call[T] = Call()
        with self._cond:
            self._check_up()
            client = self._take_client(deadline)
            self._unsettled.add(call)
        threading.Thread(
            target=self._call, args=(call, client, fn, dirty), name="kvtier-store-call", daemon=True
        ).start()
        if not call._wait(max(0.0, deadline - time.monotonic())):
            with self._cond:
                self._open -= 1  # its client is dropped when the call returns: room for a new one
                self._cond.notify()
            self._failed(f"no answer within {self.timeout:g} s")
        elif call.error is not None:
            self._failed(str(call.error))
        else:
            self._succeeded()
        return call

    def ask(self, fn: Callable[[StoreClient], T]) -> T:
        """``run`` for a call that writes no buffer: its result, or StoreError when it failed."""
        call = self.run(fn)
        if call.error is not None:
            raise StoreError(str(call.error))
        if not call.ok:
            raise StoreError(f"no answer from {self.connector.where} within {self.timeout:g} s")
        return cast(T, call.result)

    def close(self, timeout: float | None = None) -> bool:
        """Refuse new calls, close the idle clients, and wait up to ``timeout`` for calls in flight to
        settle (their clients are closed as they return); False when some had not."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._open -= len(idle)
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

    # --- helpers (the first two under self._cond) ----------------------------------------------

    def _check_up(self) -> None:
        if self._closed:
            raise ClosedError(f"the {self.purpose} link to {self.connector.where} is closed")
        wait = self._down_until - time.monotonic()
        if wait > 0:
            raise StoreError(
                f"{self.connector.where} failed recently; the next try for {self.purpose} is in {wait:.2f} s"
            )

    def _take_client(self, deadline: float) -> StoreClient | None:
        """An idle client, or None where a new one may be opened (on the call's thread); waits for one
        to come free until ``deadline`` (StoreError past it)."""
        while not self._idle and self._open >= self.connector.clients:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreError(
                    f"no {self.connector.where} client came free for {self.purpose} within {self.timeout:g} s"
                )
            self._cond.wait(left)
        if self._idle:
            return self._idle.pop()
        self._open += 1
        return None

    def _call(
        self, call: Call[T], client: StoreClient | None, fn: Callable[[StoreClient], T], dirty: Callable[[T], bool]
    ) -> None:
        """The call's thread: connect if needed and call; then keep the client, or drop it (closed)
        when the call raised, was abandoned, or left a ``late_writes`` client dirty; and settle. A kept
        client's call settles before its caller wakes; a dropped one's after the close, so the caller
        does not wait for a slow close (Mooncake's takes most of a second)."""
        late = False  # a late_writes client whose result says it may still write into buffers
        try:
            if client is None:
                client = self.connector.connect()
            result = call.result = fn(client)
            late = client.late_writes and dirty(result) and client.may_write_late()
        except Exception as exc:
            call.error = exc
        in_time = call._claim()
        keep = client if in_time and call.error is None and not late else None
        with self._cond:
            if keep is not None and not self._closed:
                self._idle.append(keep)
            else:
                keep = None
                if in_time:
                    self._open -= 1  # an abandoned call's client was counted out when it was abandoned
            self._cond.notify()
        if keep is not None:
            call._settle()
        call._returned.set()
        if keep is None:
            if client is not None:
                _close(client)
            call._settle()
        with self._cond:
            self._unsettled.discard(call)
            self._cond.notify_all()

    def _failed(self, why: str) -> None:
        with self._cond:
            self.failures += 1
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


def _close(client: StoreClient) -> None:
    try:
        client.close()
    except Exception:  # closing is best effort: the client is dropped either way
        log.exception("closing a %s client failed", client.name)
