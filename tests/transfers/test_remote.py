"""The remote transfer backend beyond the TransferBackend contract (tests/contracts/test_transfer_backend.py
runs that over it too), against a real redis-server: a record is the same bytes whether its header travels
in the room before the host slot or apart, a record that is missing or not the block asked for fails
exactly its block (and counts as refused once it arrived whole), and a call that outlives the deadline
fails its blocks at the deadline, quarantined until the call has really returned (a hung server resumed,
or at once where the link interrupts the call: Redis's clients), while later transfers fail at once during
the backoff. Loads that ``fetch`` (Redis's) never write a bad
record or a late reply into memory, need no quarantine, and loads of the same records at once share
one read (and its failure). A caller waiting for its request's future runs the load's call on its own
thread."""

from __future__ import annotations

import functools
import sys
import threading
import time

import numpy as np
import pytest

from helpers.redis_clients import Uninterruptible
from helpers.redis_server import redis_server
from kvtier.core.caller_runs import CallerRunsFuture, offering
from kvtier.core.layout import BlockLayout
from kvtier.core.storage import block_pieces
from kvtier.core.transfer import Quarantine, Transfer
from kvtier.tiers.host import HostSlab
from kvtier.tiers.remote.config import HEADER_ROOM
from kvtier.tiers.remote.link import Connector, StoreLink
from kvtier.tiers.remote.record import RecordFormat, namespace_digest
from kvtier.tiers.remote.redis_client import RedisClient
from kvtier.tiers.remote.tier import RemoteStorage
from kvtier.tiers.remote.transfer import RemoteBackend, _Job

LAYOUT = BlockLayout((16 * 1024, 16 * 1024))
TIMEOUT = 1.0
KEYS = [bytes([i]) * 16 for i in range(6)]


@pytest.fixture
def server(tmp_path):
    with redis_server(tmp_path / "redis") as server:
        yield server


class Rig:
    """A host slab, the store's records and a backend between them."""

    def __init__(
        self, url: str, header_room: int = 0, fetches: bool = False, client_class: type[RedisClient] = RedisClient
    ) -> None:
        self.slab = HostSlab(len(KEYS), LAYOUT, header_room)
        self.records = RecordFormat("t", namespace_digest("m", LAYOUT), LAYOUT.block_bytes)
        self.remote = RemoteStorage(LAYOUT, self.records)
        connect = functools.partial(client_class, url, timeout=TIMEOUT)
        link = StoreLink(Connector(connect, 2, "redis"), TIMEOUT, "loads and stores")
        self.backend = RemoteBackend(link, fetches)
        self.data = np.random.default_rng(7).integers(0, 256, (len(KEYS), LAYOUT.block_bytes), dtype=np.uint8)

    def slots(self) -> np.ndarray:
        room = self.slab.storage.header_room
        return self.slab.array.reshape(len(KEYS), room + LAYOUT.block_bytes)[:, room:]

    def run(self, storing: bool) -> tuple[set[int], Quarantine | None, float]:
        """One transfer of every block; (failed, quarantine, seconds until it completed)."""
        slots = list(range(len(KEYS)))
        transfer = (
            Transfer(self.slab.storage, slots, self.remote, (), KEYS)
            if storing
            else Transfer(self.remote, (), self.slab.storage, slots, KEYS)
        )
        return self.wait(self.start(transfer))

    def start(self, transfer: Transfer) -> tuple[threading.Event, list, float]:
        """Submit ``transfer``; what ``wait`` needs."""
        done = threading.Event()
        calls: list[tuple[set[int], Quarantine | None]] = []

        def on_complete(failed, quarantine=None):
            calls.append((set(failed), quarantine))
            done.set()

        started = time.monotonic()
        self.backend.submit(transfer, on_complete)
        return done, calls, started

    @staticmethod
    def wait(started: tuple[threading.Event, list, float]) -> tuple[set[int], Quarantine | None, float]:
        """(failed, quarantine, seconds until it completed) of a transfer ``start`` submitted."""
        done, calls, at = started
        assert done.wait(30), "the transfer never completed"
        took = time.monotonic() - at
        assert len(calls) == 1
        return (*calls[0], took)

    def store(self) -> tuple[set[int], Quarantine | None, float]:
        self.slots()[:] = self.data
        return self.run(storing=True)

    def load(self) -> tuple[set[int], Quarantine | None, float]:
        self.slots()[:] = 0
        return self.run(storing=False)

    def close(self) -> None:
        self.backend.close()
        self.slab.close()


@pytest.fixture(params=["get", "fetch"])
def rig(server, request):
    """A rig whose loads ``get`` records into its memory (every store's clients can), or ``fetch`` them
    (Redis's: checked in the client's bytes, copied in only when good and in time)."""
    rig = Rig(server.url, fetches=request.param == "fetch")
    yield rig
    rig.close()


def settled(backend: RemoteBackend) -> None:
    """Wait until no call of the backend's link can touch memory any more (a resumed server answered)."""
    deadline = time.monotonic() + 3 * TIMEOUT
    while backend.link._unsettled:
        assert time.monotonic() < deadline, "a call never returned"
        time.sleep(0.01)


@pytest.mark.parametrize(
    ("writer_room", "reader_room"), [(HEADER_ROOM, 0), (0, HEADER_ROOM), (HEADER_ROOM, HEADER_ROOM)]
)
def test_a_record_is_the_same_whether_its_header_travels_in_the_room_before_the_slot_or_apart(
    server, writer_room, reader_room
):
    """A host slab with room before each slot (a host tier above a remote one) sends header and block
    as one piece; the record is the same bytes as from memory without room, so either reads either."""
    writer, reader = Rig(server.url, writer_room), Rig(server.url, reader_room)
    try:
        assert writer.store()[:2] == (set(), None)
        names = [writer.records.name(key) for key in KEYS]
        sent = server.client().mget(names)
        assert reader.load()[:2] == (set(), None) and np.array_equal(reader.slots(), writer.data)
        assert reader.store()[:2] == (set(), None) and server.client().mget(names) == sent
        for rig in (writer, reader):
            room = rig.slab.storage.header_room
            job = _Job(rig.remote, KEYS, block_pieces(rig.slab.storage, range(len(KEYS))), lambda *_: None, None, room)
            assert [len(pieces) for pieces in job.pieces] == [1 if room else 2] * len(KEYS)
    finally:
        writer.close()
        reader.close()


def test_a_missing_damaged_or_foreign_record_fails_exactly_its_block(rig, server):
    rig.store()
    raw = server.client()
    names = [rig.records.name(key) for key in KEYS]
    raw.delete(names[0])
    value = raw.get(names[1])
    raw.set(names[1], value[:-1])  # truncated
    raw.set(names[2], value[:100] + bytes([value[100] ^ 1]) + value[101:])  # one bit of the header flipped
    raw.set(names[3], value)  # another block's record under this name: another key in its header
    failed, quarantine, _ = rig.load()
    assert (failed, quarantine) == ({0, 1, 2, 3}, None)
    assert rig.backend.refused_records == 2  # the truncated one never arrived whole
    assert np.array_equal(rig.slots()[4:], rig.data[4:])
    if rig.backend.fetches:  # checked before it is copied: a bad record never reaches the caller's memory
        assert not rig.slots()[:4].any()


def test_a_hung_store_fails_a_fetch_at_the_deadline_and_its_late_reply_writes_nowhere(server):
    rig = Rig(server.url, fetches=True, client_class=Uninterruptible)  # (the reply still comes, late)
    try:
        rig.store()
        server.stop()
        failed, quarantine, took = rig.load()
        assert failed == set(range(len(KEYS))) and TIMEOUT - 0.05 < took < TIMEOUT + 0.5
        assert quarantine is None  # nothing to keep out of use: the memory is free at once
        rig.slots()[:] = 0xA5  # (the caller reuses it)
        server.cont()
        settled(rig.backend)
        assert (rig.slots() == 0xA5).all()  # the reply came, and was dropped with its call
    finally:
        rig.close()


def test_loads_fetching_the_same_records_at_once_share_one_read_and_its_failure(server):
    rig, other = Rig(server.url, fetches=True), HostSlab(len(KEYS), LAYOUT)
    try:
        rig.store()
        rig.slots()[:] = 0
        reads = server.client().info("commandstats").get("cmdstat_get", {}).get("calls", 0)
        server.stop()  # the first load's GETs wait; the second load asks while they do
        first = rig.start(Transfer(rig.remote, (), rig.slab.storage, range(len(KEYS)), KEYS))
        second = rig.start(Transfer(rig.remote, (), other.storage, [5, 4, 3], KEYS[2:5]))  # some of them, elsewhere
        time.sleep(0.2)
        server.cont()
        assert rig.wait(first)[:2] == (set(), None) and rig.wait(second)[:2] == (set(), None)
        assert np.array_equal(rig.slots(), rig.data)
        assert np.array_equal(other.array.reshape(len(KEYS), -1)[[5, 4, 3]], rig.data[2:5])
        assert server.client().info("commandstats")["cmdstat_get"]["calls"] - reads == len(KEYS)  # one read each
        server.stop()  # now both wait for a call that outlives its deadline
        first = rig.start(Transfer(rig.remote, (), rig.slab.storage, range(len(KEYS)), KEYS))
        second = rig.start(Transfer(rig.remote, (), other.storage, [0], KEYS[1:2]))
        assert rig.wait(first)[0] == set(range(len(KEYS))) and rig.wait(second)[0] == {0}
        assert rig.wait(second)[2] < TIMEOUT + 0.5  # failed with the call it waited for
        server.cont()
        settled(rig.backend)
    finally:
        rig.close()
        other.close()


@pytest.mark.parametrize("storing", [True, False], ids=["store", "get"])
def test_a_hung_store_fails_a_call_at_the_deadline_and_quarantines_its_memory_until_the_call_returns(server, storing):
    """A store's sources (the call may still read them) or a get's slots (it may still write them)."""
    rig = Rig(server.url, client_class=Uninterruptible)
    try:
        rig.store()
        server.stop()
        failed, quarantine, took = rig.store() if storing else rig.load()
        assert failed == set(range(len(KEYS))) and TIMEOUT - 0.05 < took < TIMEOUT + 0.5
        assert quarantine is not None and quarantine.blocks == failed
        time.sleep(0.3)
        assert not quarantine.lifted  # the call is still waiting for its replies
        lifted = threading.Event()
        quarantine.when_lifted(lifted.set)
        resumed = time.monotonic()
        server.cont()
        assert lifted.wait(TIMEOUT) and time.monotonic() - resumed < TIMEOUT  # the resumed server answered it
    finally:
        rig.close()


def test_after_a_failure_transfers_fail_at_once_until_the_backoff_ends(rig, server):
    rig.store()
    server.kill()
    failed, _, took = rig.load()
    assert failed == set(range(len(KEYS))) and took < 0.5
    failed, quarantine, took = rig.store()
    assert failed == set(range(len(KEYS))) and quarantine is None and took < 0.05  # refused by the link itself
    assert rig.backend.link.failures >= 1


@pytest.mark.parametrize("storing", [True, False], ids=["store", "get"])
def test_a_hung_call_the_link_interrupts_frees_its_memory_right_after_the_deadline(server, storing):
    rig = Rig(server.url)
    try:
        rig.store()
        server.stop()
        failed, quarantine, took = rig.store() if storing else rig.load()
        assert failed == set(range(len(KEYS))) and TIMEOUT - 0.05 < took < TIMEOUT + 0.5
        lifted = threading.Event()
        if quarantine is None:  # (the interrupted call had returned before the job reported)
            lifted.set()
        else:
            quarantine.when_lifted(lifted.set)
        assert lifted.wait(0.5)  # the server still stopped: its socket was shut down under the call
    finally:
        server.cont()
        rig.close()


class Recording(RedisClient):
    """A real Redis client that notes the thread each of its loads ran on."""

    threads: list[threading.Thread] = []

    def fetch(self, names, size, take):
        Recording.threads.append(threading.current_thread())
        return super().fetch(names, size, take)

    def get(self, names, records):
        Recording.threads.append(threading.current_thread())
        return super().get(names, records)


@pytest.mark.parametrize("fetches", [True, False], ids=["fetch", "get"])
@pytest.mark.parametrize("at_once", [False, True], ids=["load", "load_now"])
def test_a_caller_waiting_for_its_future_runs_the_load_on_its_own_thread(server, fetches, at_once):
    """``at_once`` (``load_now``): no worker is woken for the call; else one is, and the caller, asking
    for the result first, takes the call from it."""
    rig = Rig(server.url, fetches=fetches, client_class=Recording)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1.0)  # the worker woken for the call gets the GIL only once the caller waits (or runs it)
    try:
        rig.store()
        Recording.threads = []
        for timeout, here in ((None, True), (0.5 * TIMEOUT, False)):  # not where it may outlast the caller's wait
            rig.slots()[:] = 0
            future: CallerRunsFuture[set[int]] = CallerRunsFuture(here=at_once)
            with offering(future):
                rig.backend.submit(
                    Transfer(rig.remote, (), rig.slab.storage, range(len(KEYS)), KEYS),
                    lambda failed, quarantine=None, future=future: future.set_result(set(failed)),
                )
            assert future.result(timeout) == set() and np.array_equal(rig.slots(), rig.data)
            assert (Recording.threads[-1] is threading.current_thread()) is here
    finally:
        sys.setswitchinterval(switch)
        rig.close()
