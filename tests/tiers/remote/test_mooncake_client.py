"""What the Mooncake client does beyond the StoreClient contract (tests/contracts/test_store_client.py runs
that against Mooncake too), against a real Mooncake Store (a master and a standalone segment owner on loopback).

Its set-up: a missing master fails at once, a dead or hung one never stops the engine's other threads, a
stalled one fails within the timeout, a missing wheel names the install line (that a closed client refuses
calls with ClosedError is the contract suite's ``CLOSED_CALLS_RAISE``). Its transfers: records are a small
header piece and a block slot from two registered arrays, as the remote tier stores them; a segment owner
killed under a read fails exactly the blocks not yet moved, and ``close()`` waits for a read stuck on a
stopped owner, after which nothing lands in its buffers (``late_writes``); a call that failed before
Mooncake's transfer limit (a stopped or dead owner, a put refused for room) leaves nothing running and
keeps its client. Every call runs under
``bounded()``, so a hung server fails the test instead of hanging it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from helpers.mooncake_server import MooncakeMaster, SegmentOwner, require_mooncake
from helpers.ports import free_port
from kvtier.core.errors import ConfigError
from kvtier.testing.store import bounded
from kvtier.tiers.remote import mooncake_client
from kvtier.tiers.remote.client import StoreError
from kvtier.tiers.remote.link import Connector, StoreLink
from kvtier.tiers.remote.mooncake_client import MooncakeClient

HEADER = 64
CALL_LIMIT = 30.0
"""No call here may take longer; a test that hits it fails instead of hanging."""


def in_background(call: Callable[..., Any], *args: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """``bounded(call, *args)`` started on a thread; its (result, seconds) appear under "returned"."""
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(returned=bounded(call, *args)), daemon=True)
    thread.start()
    return thread, result


def make_client(master: MooncakeMaster, timeout: float = 2.0) -> MooncakeClient:
    client, _ = bounded(
        lambda: MooncakeClient(master=master.address, metadata_server=master.metadata_url, timeout=timeout)
    )
    return client


class Records:
    """``count`` records of a HEADER-byte header and a ``block``-byte slot, in two arrays registered
    with ``client`` (as the remote tier's header area and the host slab are)."""

    def __init__(self, client, count: int, block: int) -> None:
        self.count, self.block = count, block
        self.headers = np.zeros(count * HEADER, dtype=np.uint8)
        self.slots = np.zeros(count * block, dtype=np.uint8)
        client.register(self.headers.ctypes.data, self.headers.nbytes)
        client.register(self.slots.ctypes.data, self.slots.nbytes)

    def pieces(self, indices=None) -> list[list[tuple[int, int]]]:
        indices = range(self.count) if indices is None else indices
        return [
            [(self.headers.ctypes.data + i * HEADER, HEADER), (self.slots.ctypes.data + i * self.block, self.block)]
            for i in indices
        ]

    def fill(self, rng: np.random.Generator) -> None:
        self.headers[:] = rng.integers(0, 256, self.headers.size, dtype=np.uint8)
        self.slots[:] = rng.integers(0, 256, self.slots.size, dtype=np.uint8)

    def record(self, i: int) -> bytes:
        header = self.headers[i * HEADER : (i + 1) * HEADER]
        return header.tobytes() + self.slots[i * self.block : (i + 1) * self.block].tobytes()


def counting_link(master: MooncakeMaster, timeout: float) -> tuple[StoreLink, list[MooncakeClient]]:
    """A link of one client at a time to ``master``, and every client it opened, in order."""
    opened: list[MooncakeClient] = []

    def connect() -> MooncakeClient:
        opened.append(make_client(master))
        return opened[-1]

    return StoreLink(Connector(connect, 1, "test"), timeout, "loads and stores"), opened


@contextmanager
def four_records(
    rng: np.random.Generator,
) -> Iterator[tuple[SegmentOwner, MooncakeClient, list[str], Records, Records]]:
    """An owner holding four 64 KiB records stored through a client (1 s timeout), and a target to read
    them into."""
    with MooncakeMaster() as master, SegmentOwner(master) as owner:
        client = make_client(master, timeout=1.0)
        source, target = Records(client, 4, 64 << 10), Records(client, 4, 64 << 10)
        source.fill(rng)
        keys = [f"k{i}" for i in range(4)]
        assert bounded(client.put, keys, source.pieces())[0] == [True] * 4
        yield owner, client, keys, source, target


@contextmanager
def stopped(owner: SegmentOwner, target: Records) -> Iterator[None]:
    """``owner`` stopped while the block runs (whose reads into ``target`` must have returned by its
    end); then ``target`` is overwritten, the owner resumed, and 2 s later nothing may have landed."""
    owner.stop()
    try:
        yield
        target.headers[:] = 0xAB
        target.slots[:] = 0xAB
    finally:
        owner.cont()
    time.sleep(2.0)
    assert (target.headers == 0xAB).all() and (target.slots == 0xAB).all()


def test_setup_against_no_master_fails_at_once():
    require_mooncake()
    nowhere = {"master": f"127.0.0.1:{free_port()}", "metadata_server": f"http://127.0.0.1:{free_port()}/m"}
    start = time.monotonic()
    with pytest.raises(StoreError, match="does not accept connections"):
        bounded(lambda: MooncakeClient(**nowhere, timeout=1.0))
    assert time.monotonic() - start < 0.5  # Mooncake's own setup takes 4.4 s to give up


def test_setup_against_a_dead_or_hung_master_leaves_other_threads_running():
    """Mooncake's setup() holds the GIL while it waits for a master (the first one in a process 4.4 s
    against a dead master, any one the RPC timeout against a hung one); the client asks the master's
    ports first, so the engine's other threads never stop. A fresh process: the first setup is the case."""
    with MooncakeMaster() as hung:
        hung.stop()
        try:
            child = textwrap.dedent(f"""
                import threading, time
                from kvtier.tiers.remote.client import StoreError
                from kvtier.tiers.remote.mooncake_client import MooncakeClient

                def longest_pause(master, metadata):
                    def connect():
                        try:
                            MooncakeClient(master=master, metadata_server=metadata, timeout=1.0)
                        except StoreError:
                            pass
                    thread = threading.Thread(target=connect)
                    thread.start()
                    longest, last = 0.0, time.monotonic()
                    while thread.is_alive():
                        time.sleep(0.005)
                        longest, last = max(longest, time.monotonic() - last), time.monotonic()
                    return longest

                print(longest_pause("127.0.0.1:{free_port()}", "http://127.0.0.1:{free_port()}/metadata"),
                      longest_pause({hung.address!r}, {hung.metadata_url!r}))
            """)
            done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=CALL_LIMIT)
        finally:
            hung.cont()
    assert done.returncode == 0, done.stderr[-2000:]
    dead, stalled = map(float, done.stdout.split())
    assert dead < 0.5 and stalled < 0.5, f"other threads stopped for {dead:.2f} s (dead), {stalled:.2f} s (hung)"


def test_a_missing_wheel_names_the_install_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # what import finds when the wheel is absent
    with pytest.raises(ConfigError, match=r"pip install 'kvtier\[remote\]'"):
        MooncakeClient(master="127.0.0.1:1", metadata_server="http://127.0.0.1:2/m", timeout=1.0)


# Faults: each test has servers of its own.


def test_setup_against_a_stalled_master_fails_within_the_timeout():
    with MooncakeMaster() as master, SegmentOwner(master):
        master.stop()
        try:
            with pytest.raises(StoreError):
                bounded(
                    lambda: MooncakeClient(master=master.address, metadata_server=master.metadata_url, timeout=1.0),
                    limit=2.5,
                )
        finally:
            master.cont()


def test_killed_owner_fails_exactly_the_blocks_not_yet_moved(rng):
    """The owner is killed once a few blocks of a large get have landed: the get reports the rest
    failed within a second or so, and every block it reports is bit-exact."""
    count, block = 64, 2 << 20
    with MooncakeMaster() as master, SegmentOwner(master, "256MB") as owner:
        client = make_client(master)
        source, target = Records(client, count, block), Records(client, count, block)
        source.fill(rng)
        keys = [f"k{i}" for i in range(count)]
        assert bounded(client.put, keys, source.pieces())[0] == [True] * count
        target.slots[:] = ~source.slots
        reader, result = in_background(client.get, keys, target.pieces())
        deadline = time.monotonic() + CALL_LIMIT
        landed = 4 * block - 1  # the last byte of the fourth block: some blocks are whole, most are not
        while target.slots[landed] != source.slots[landed] and reader.is_alive() and time.monotonic() < deadline:
            pass
        owner.kill()
        reader.join(CALL_LIMIT)
        loaded, seconds = result["returned"]
        assert 0 < sum(loaded) < count, f"the kill landed outside the get: {sum(loaded)} of {count} loaded"
        assert seconds < 5.0
        assert not client.may_write_late()  # its transfers failed well before Mooncake's limit: none runs on
        assert all(target.record(i) == source.record(i) for i in range(count) if loaded[i])
        # later reads of the dead owner's records fail fast too (until the master drops its segment)
        assert bounded(client.get, keys[:4], target.pieces(range(4)), limit=5.0)[0] == [False] * 4
        bounded(client.close)


def test_a_read_of_records_that_do_not_exist_keeps_the_client(rng):
    """A miss started no transfer: the link keeps the client (no close, which stops every thread of the
    engine for most of a second) and the call settles at once; a hit among misses changes nothing."""
    with MooncakeMaster() as master, SegmentOwner(master, "64MB"):
        link, opened = counting_link(master, 2.0)
        records = Records(make_client(master), 2, 4096)
        records.fill(rng)
        assert link.ask(lambda c: c.put(["here"], records.pieces([0]))) == [True]
        call = link.run(lambda c: c.get(["here", "absent"], records.pieces()), dirty=lambda ok: not all(ok))
        assert call.ok and call.result == [True, False] and call.settled
        assert not opened[0].may_write_late()
        assert link.ask(lambda c: c.exists(["here"])) == [True]
        assert len(opened) == 1, "the client was dropped after a miss"
        assert link.close(timeout=10)


def test_a_get_failed_on_a_stopped_owner_leaves_nothing_running(rng, monkeypatch):
    """A stopped owner sends no status frame: the get fails within seconds, before Mooncake's transfer
    limit, so the client may be kept (``may_write_late`` False): once the owner resumes nothing lands in
    the buffers, and the same client then reads the records bit-exact. A call that lasted as long as
    the limit would count as maybe still running."""
    with four_records(rng) as (owner, client, keys, source, target):
        with stopped(owner, target):
            loaded, seconds = bounded(client.get, keys, target.pieces(), limit=10.0)
            assert loaded == [False] * 4 and seconds < 10.0
            assert not client.may_write_late()
            monkeypatch.setattr(mooncake_client, "LATE_AFTER_S", seconds / 2)
            assert client.may_write_late()
            monkeypatch.undo()
        # the client still reads (the lanes the stall broke may fail the first tries while they reconnect)
        assert any(bounded(client.get, keys, target.pieces())[0] == [True] * 4 for _ in range(5))
        assert all(target.record(i) == source.record(i) for i in range(4))
        bounded(client.close)


def test_a_put_refused_for_room_keeps_the_client(rng):
    """A full store refuses puts (no room) all the time: that started no transfer, so the link keeps
    the client rather than closing it (which stops every thread of the engine for most of a second)."""
    with MooncakeMaster() as master, SegmentOwner(master, "16MB"):
        link, opened = counting_link(master, 5.0)
        records = Records(make_client(master), 32, 1 << 20)
        records.fill(rng)
        keys = [f"k{i}" for i in range(32)]
        call = link.run(lambda c: c.put(keys, records.pieces()), dirty=lambda ok: not all(ok))
        assert call.ok and not all(call.result), "a 16 MB owner took 32 MB"
        assert not opened[0].may_write_late()
        assert link.ask(lambda c: c.exists(keys[:1])) in ([True], [False])
        assert len(opened) == 1, "the client was dropped after a put refused for room"
        assert link.close(timeout=10)


def test_close_waits_for_a_call_stuck_on_a_stopped_owner_and_nothing_lands_afterwards(rng):
    """A stopped owner holds a get (here about the 1 s status timeout per round of blocks; up to
    Mooncake's 60 s for a transfer stopped mid-payload). close() under it would crash the process, so it
    waits for the call; once it returned, a resumed owner writes nothing into the buffers."""
    with four_records(rng) as (owner, client, keys, _, target), stopped(owner, target):
        reader, result = in_background(client.get, keys, target.pieces())
        time.sleep(0.3)
        assert reader.is_alive()
        _, closing = bounded(client.close)
        reader.join(1.0)
        loaded, seconds = result["returned"]
        assert loaded == [False] * 4 and seconds < 10.0 and closing >= seconds - 0.3, (loaded, seconds, closing)
