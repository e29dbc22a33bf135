"""The link's rules, on real Redis clients against a real server: calls return in time or are abandoned
at the deadline; an abandoned call settles only once it has really returned (a call the link can interrupt
returns at the deadline, also one its caller runs on its own thread); a failure makes the link
refuse calls at once for a backoff, then reconnect; clients are reused, at most ``clients`` open, and a
client whose result says it may still write late (``late_writes``) is closed before its call settles; a
call goes to the worker that became idle last."""

from __future__ import annotations

import functools
import re
import threading
import time

import numpy as np
import pytest

from helpers.redis_clients import Uninterruptible
from kvtier.core.errors import ClosedError
from kvtier.tiers.remote import link as link_module
from kvtier.tiers.remote.client import StoreError
from kvtier.tiers.remote.link import Connector, StoreLink
from kvtier.tiers.remote.redis_client import CLIENT_NAME, RedisClient

TIMEOUT = 0.5


class LateWriting(RedisClient):
    """A real Redis client that declares late writes (as Mooncake's does), counting its closes."""

    late_writes = True
    closed: list[LateWriting] = []

    def close(self) -> None:
        super().close()
        LateWriting.closed.append(self)


def make_link(
    server, clients: int = 2, client_class: type[RedisClient] = RedisClient, timeout: float = TIMEOUT
) -> StoreLink:
    connect = functools.partial(client_class, server.url, timeout=timeout)
    return StoreLink(Connector(connect, clients, "redis under test"), timeout, "tests")


def connections(server) -> int:
    """kvtier's connections to the server (they carry its client name)."""
    return sum(1 for entry in server.client().client_list() if entry["name"] == CLIENT_NAME)


def test_calls_reuse_their_clients_and_open_at_most_the_limit(server):
    link = make_link(server, clients=2, timeout=10)
    for _ in range(5):
        assert link.ask(lambda c: c.exists(["a", "b"])) == [False, False]
    assert connections(server) == 1
    release = threading.Event()
    results: list[list[bool]] = []

    def held(client):
        answer = client.exists(["a"])
        release.wait(10)  # holds its client until the test lets go
        return answer

    threads = [threading.Thread(target=lambda: results.append(link.ask(held))) for _ in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while connections(server) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert connections(server) == 2  # the third call waits for a client to come free...
    release.set()
    for t in threads:
        t.join(10)
    assert results == [[False]] * 3 and connections(server) == 2  # ...and gets one within its deadline
    assert link.close(timeout=5) and connections(server) == 0
    with pytest.raises(ClosedError):
        link.ask(lambda c: c.exists(["a"]))


def test_a_call_goes_to_the_worker_idle_last(server):
    """One caller's calls in turn run on one worker thread, not on every idle worker in turn (the same
    Mooncake client's get took 2.5 ms where it took 1.6 from one thread); the other workers stay idle."""
    link = make_link(server, clients=2, timeout=10)
    release = threading.Event()
    held = [link.start(lambda c: release.wait(10), lambda call: None) for _ in range(2)]  # two workers
    time.sleep(0.1)
    release.set()
    deadline = time.monotonic() + 10
    while not all(call.settled for call in held) and time.monotonic() < deadline:
        time.sleep(0.01)
    ran_on: list[int] = []
    for _ in range(6):
        done = threading.Event()
        link.start(lambda c: ran_on.append(threading.get_ident()), lambda call, done=done: done.set())
        assert done.wait(10)
        time.sleep(0.05)  # its worker is idle again before the next call
    assert len(ran_on) == 6 and len(set(ran_on)) == 1, ran_on
    assert link.close(timeout=5)


def test_a_call_somebody_waits_for_goes_ahead_of_background_calls_in_line(server):
    """With the only client busy, background calls (write-through copies) and then a load wait in line:
    the load gets the client first, the background calls after it in their order."""
    link = make_link(server, clients=1, timeout=10)
    release = threading.Event()
    order: list[str] = []
    done = threading.Semaphore(0)

    def call(name, client):
        order.append(name)
        if name == "holding":
            release.wait(10)
        return client.exists([name])

    for name, background in (("holding", False), ("copy 1", True), ("copy 2", True), ("load", False)):
        link.start(functools.partial(call, name), lambda call: done.release(), background=background)
    release.set()
    for _ in range(4):
        assert done.acquire(timeout=10)
    assert order == ["holding", "load", "copy 1", "copy 2"]
    assert link.close(timeout=5)


def test_a_hung_call_is_abandoned_at_the_deadline_and_settles_when_it_returns(server):
    """...and its client, not interrupted and clean when the call returned, is kept (no close: Mooncake's
    would stop every thread for most of a second)."""
    Uninterruptible.closed.clear()
    link = make_link(server, client_class=Uninterruptible)
    link.ask(lambda c: c.exists(["a"]))
    server.stop()
    started = time.monotonic()
    call = link.run(lambda c: c.exists(["a"]))
    assert call.abandoned and not call.ok and TIMEOUT - 0.05 < time.monotonic() - started < TIMEOUT + 0.3
    assert not call.settled
    settled = threading.Event()
    call.when_settled(settled.set)
    with pytest.raises(StoreError, match="failed recently; the next try for tests is in"):
        link.ask(lambda c: c.exists(["a"]))  # down: refused at once
    server.cont()
    assert settled.wait(2) and call.settled
    time.sleep(link_module.FIRST_BACKOFF_S)
    assert link.ask(lambda c: c.exists(["a"])) == [False]  # up again after the backoff
    assert link.failures == 1
    assert Uninterruptible.closed == [] and connections(server) == 1  # the same client, never closed
    assert link.close(timeout=5) and len(Uninterruptible.closed) == 1


def test_a_waiting_caller_runs_the_call_itself_and_is_interrupted_at_the_deadline(server):
    link = make_link(server)
    link.ask(lambda c: c.exists(["a"]))  # one idle client
    ran_on: list[threading.Thread] = []

    def exists(client):
        ran_on.append(threading.current_thread())
        return client.exists(["a"])

    assert link.run(exists).ok and ran_on == [threading.current_thread()]
    done = threading.Event()
    call = link.start(exists, lambda call: done.set())
    if link.run_here(call):  # (unless the worker woken for it began it first)
        assert ran_on[-1] is threading.current_thread()
    assert done.wait(5) and call.ok and not link.run_here(call)  # (run once)
    assert link.ask(lambda c: c.exists(["a"])) == [False]
    server.stop()  # a hung call run here comes back at its deadline: the watchdog interrupts it
    started = time.monotonic()
    call = link.run(exists)
    assert ran_on[-1] is threading.current_thread()
    assert call.abandoned and not call.ok and TIMEOUT - 0.05 < time.monotonic() - started < TIMEOUT + 0.3
    settled = threading.Event()
    call.when_settled(settled.set)
    assert settled.wait(1) and link._open == 0  # its client was dropped (the stopped server cannot list them)
    server.cont()
    time.sleep(link_module.FIRST_BACKOFF_S)
    assert link.ask(lambda c: c.exists(["a"])) == [False]


def test_the_backoff_doubles_while_the_store_stays_down_and_ends_with_a_success(server):
    link = make_link(server)
    server.kill()
    waits = []
    for _ in range(3):
        with pytest.raises(StoreError, match="refused"):
            link.ask(lambda c: c.exists(["a"]))
        with pytest.raises(StoreError, match="the next try for tests is in") as info:
            link.ask(lambda c: c.exists(["a"]))
        waits.append(float(re.search(r"is in (\S+) s", str(info.value)).group(1)))
        time.sleep(waits[-1] + 0.01)
    assert waits[0] <= link_module.FIRST_BACKOFF_S < waits[1] < waits[2]
    server.start()
    assert link.ask(lambda c: c.exists(["a"])) == [False]
    assert link.ask(lambda c: c.exists(["a"])) == [False]  # no backoff left after a success


def test_a_background_call_past_its_deadline_fails_alone_and_leaves_the_link_up(server):
    """A write-through copy that is only slow (a large one on a busy machine) fails its records at the
    deadline, but does not refuse every load for the backoff; a load past its deadline does (above)."""
    link = make_link(server, clients=2)
    release = threading.Event()
    abandoned = threading.Event()

    def slow(client):
        release.wait(10)
        return client.exists(["a"])

    link.start(slow, lambda call: call.abandoned and abandoned.set(), background=True)
    try:
        assert abandoned.wait(2 * TIMEOUT)
        assert link.ask(lambda c: c.exists(["a"])) == [False]  # not refused: the link is up
        assert link.failures == 1
    finally:
        release.set()
        assert link.close(timeout=5)


def test_a_late_writing_client_with_failed_records_is_closed_before_its_call_settles(server):
    LateWriting.closed = []
    link = make_link(server, client_class=LateWriting)
    buffer = np.zeros(16, np.uint8)
    record = [[(buffer.ctypes.data, 16)]]
    server.client().set("present", b"x" * 16)
    call = link.run(lambda c: c.get(["present"], record), dirty=lambda ok: not all(ok))
    assert call.ok and call.result == [True] and LateWriting.closed == []  # clean: kept
    call = link.run(lambda c: c.get(["missing"], record), dirty=lambda ok: not all(ok))
    assert call.ok and call.result == [False]
    settled = threading.Event()
    call.when_settled(settled.set)
    assert settled.wait(2) and len(LateWriting.closed) == 1  # dropped: closed, then settled
    assert link.ask(lambda c: c.exists(["present"])) == [True]  # on a new client
