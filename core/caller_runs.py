"""Work a waiting caller runs on its own thread: a future whose ``result()`` first runs its store calls
(and, with ``here``, its memmoves: ``CopiesOffered``).

A load from a remote store is one client call. Run on a link worker, it costs two hand-offs between
threads: the worker's wake-up, then the caller's once the worker completed the future. On an idle machine
each is some microseconds; with engines beside each other on few cores each waits for a core, and
the fleet's loads took 1.5x the raw client's time on the same batches (bench/fleet.py). So a request's
transfers *offer* their calls while the request is being set up (``offering``), and the future it
returns (``CallerRunsFuture``) runs the ones no worker has begun when the caller asks for its result.
A caller that never asks (asyncio, ``concurrent.futures.wait``, callbacks) loses nothing: the workers
run the calls as before. That still wakes a worker per call, which finds it taken; a caller that asks
at once (``TierStack.load_now``, ``store_now``) says so (``here``), and no worker is woken unless the
call cannot run on the caller's thread; its copies from or into its own memory that a copy thread
would run (a memmove) wait for it too, and run on its thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")

Offer = Callable[[float], bool]
"""``offer(until)``: run a call on this thread if it is still waiting and ends (at the latest at its
deadline) before ``until``, a ``time.monotonic()`` time; whether it ran here."""

_collecting = threading.local()


class CallerRunsFuture(Future[T]):
    """A ``concurrent.futures.Future`` whose ``result()`` and ``exception()`` first run, on the caller's
    thread, the calls offered while its request was set up (each at most once, and only where it ends
    within the ``timeout`` given). ``here``: its caller asks for the result as soon as the request is
    set up, so the calls need no worker woken for them."""

    def __init__(self, here: bool = False) -> None:
        super().__init__()
        self.here = here
        self._offers: list[Offer] = []

    def result(self, timeout: float | None = None) -> T:
        self._run_offers(timeout)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._run_offers(timeout)
        return super().exception(timeout)

    def release(self) -> None:
        """Leave the calls offered to workers (the caller will not ask for the result)."""
        self._run_offers(-1.0)

    def _run_offers(self, timeout: float | None) -> None:
        until = float("inf") if timeout is None else time.monotonic() + timeout
        offers, self._offers = self._offers, []
        for run in offers:  # (every one, also once done: one left to this caller goes to a worker if not run)
            run(until)


@contextmanager
def offering(future: Future[Any]) -> Iterator[None]:
    """While the block runs on this thread, calls ``offer``ed on it go to ``future`` (when it is a
    ``CallerRunsFuture``; otherwise they are not kept)."""
    before = getattr(_collecting, "future", None)
    _collecting.future = future
    try:
        yield
    finally:
        _collecting.future = before


def offer(run: Offer) -> None:
    """Offer ``run`` to the caller whose request is being set up on this thread, if any."""
    future = getattr(_collecting, "future", None)
    if isinstance(future, CallerRunsFuture):
        future._offers.append(run)


def wait_here(set_up: Callable[[CallerRunsFuture[T]], None], timeout: float | None) -> T:
    """Set a request up with a ``here`` future (``set_up(future)``) and wait on this thread for its result,
    running what it offered; where setting up raised, what it offered before goes to workers."""
    future: CallerRunsFuture[T] = CallerRunsFuture(here=True)
    try:
        set_up(future)
    except BaseException:
        future.release()
        raise
    return future.result(timeout)


def caller_runs_here() -> bool:
    """Whether the caller whose request is being set up on this thread runs its calls at once (``here``)."""
    future = getattr(_collecting, "future", None)
    return isinstance(future, CallerRunsFuture) and future.here
