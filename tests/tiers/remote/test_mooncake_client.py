"""MooncakeClient against a real Mooncake Store (a master and a standalone segment owner on loopback).

Records are a small header piece and a block slot from two registered arrays, as the remote tier
stores them. Every call a test makes runs under ``bounded()``, so a hung server fails the test instead
of hanging it; the fault tests kill or stop the servers and assert what each call returns and how long
it takes (the bounds below are what the client guarantees; kvtier's own deadline is the transfer
backend's).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from helpers.mooncake_server import MooncakeMaster, SegmentOwner, free_port, require_mooncake
from kvtier.core.errors import ClosedError, ConfigError
from kvtier.tiers.remote.client import StoreError
from kvtier.tiers.remote.mooncake_client import MooncakeClient

HEADER = 64
CALL_LIMIT = 30.0
"""No call here may take longer; a test that hits it fails instead of hanging."""
KILLED_MASTER_COST = 7.0
"""A call against a killed master returns after about 4.3 s whatever the timeout (measured 4.27 to 4.50)."""


def bounded(call: Callable[..., Any], *args: Any, limit: float = CALL_LIMIT) -> tuple[Any, float]:
    """``call(*args)`` on a thread, failing the test if it is still running after ``limit`` seconds;
    returns its result (or raises its exception) and how long it took."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        start = time.monotonic()
        try:
            outcome["result"] = call(*args)
        except BaseException as exc:  # handed to the test's thread below
            outcome["error"] = exc
        outcome["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    assert not thread.is_alive(), f"{getattr(call, '__name__', call)} still running after {limit} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"], outcome["seconds"]


def in_background(call: Callable[..., Any], *args: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """``bounded(call, *args)`` started on a thread; its (result, seconds) appear under "returned"."""
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(returned=bounded(call, *args)), daemon=True)
    thread.start()
    return thread, result


def make_client(master: MooncakeMaster, timeout: float = 2.0) -> MooncakeClient:
    client, _ = bounded(lambda: MooncakeClient(master=master.address, metadata_server=master.metadata_url,
                                               timeout=timeout))
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
        return [[(self.headers.ctypes.data + i * HEADER, HEADER), (self.slots.ctypes.data + i * self.block, self.block)]
                for i in indices]

    def fill(self, rng: np.random.Generator) -> None:
        self.headers[:] = rng.integers(0, 256, self.headers.size, dtype=np.uint8)
        self.slots[:] = rng.integers(0, 256, self.slots.size, dtype=np.uint8)

    def record(self, i: int) -> bytes:
        header = self.headers[i * HEADER:(i + 1) * HEADER]
        return header.tobytes() + self.slots[i * self.block:(i + 1) * self.block].tobytes()


@pytest.fixture(scope="module")
def store():
    """One master and a 256 MB owner for the tests that do not harm them."""
    with MooncakeMaster() as master, SegmentOwner(master, "256MB"):
        yield master


@pytest.fixture
def client(store):
    """A client per test: Mooncake refuses to register memory overlapping a registered range, and each
    test's arrays are registered until its client closes."""
    client = make_client(store)
    yield client
    bounded(client.close)


@pytest.fixture
def names(request):
    """Record names unique to the test (the module's store is shared)."""
    return lambda count, tag="": [f"{request.node.name}/{tag}{i}" for i in range(count)]


def test_round_trip_is_bit_exact_and_exists_answers(client, names, rng):
    source, target = Records(client, 16, 64 << 10), Records(client, 16, 64 << 10)
    source.fill(rng)
    keys = names(16)
    assert bounded(client.exists, keys)[0] == [False] * 16
    assert bounded(client.put, keys, source.pieces())[0] == [True] * 16
    assert bounded(client.exists, [*keys, "absent"])[0] == [True] * 16 + [False]
    assert bounded(client.get, keys, target.pieces())[0] == [True] * 16
    assert all(target.record(i) == source.record(i) for i in range(16))
    assert client.exists([]) == client.put([], []) == client.get([], []) == []


def test_put_replaces_a_record_even_while_it_is_leased(client, names, rng):
    first, second, target = (Records(client, 4, 32 << 10) for _ in range(3))
    first.fill(rng)
    second.fill(rng)
    keys = names(4)
    assert bounded(client.put, keys, first.pieces())[0] == [True] * 4
    # a read grants the records a 10 s lease, which a plain remove would respect
    assert bounded(client.get, keys, target.pieces())[0] == [True] * 4
    assert bounded(client.put, keys, second.pieces())[0] == [True] * 4
    assert bounded(client.get, keys, target.pieces())[0] == [True] * 4
    assert all(target.record(i) == second.record(i) for i in range(4))


def test_missing_and_wrong_size_records_are_false(client, names, rng):
    source = Records(client, 2, 32 << 10)
    source.fill(rng)
    keys = names(2)
    assert bounded(client.put, keys, source.pieces())[0] == [True, True]
    shorter, longer = Records(client, 1, (32 << 10) - 1), Records(client, 1, (32 << 10) + 1)
    assert bounded(client.get, [keys[0]], shorter.pieces())[0] == [False]
    assert bounded(client.get, [keys[1]], longer.pieces())[0] == [False]
    assert bounded(client.get, names(1, "absent"), source.pieces([0]))[0] == [False]
    bounded(client.remove, [*keys, "never-stored"])
    assert bounded(client.exists, keys)[0] == [False, False]


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


def test_a_closed_client_refuses_calls(store):
    client = make_client(store)
    bounded(client.close)
    bounded(client.close)
    with pytest.raises(ClosedError):
        client.exists(["x"])


def test_a_record_outlives_the_process_that_wrote_it(store, client, names):
    """A writer contributing no memory puts and exits; the record lives in the owner's segment."""
    key = names(1)[0]
    writer = textwrap.dedent(f"""
        import numpy as np
        from kvtier.tiers.remote.mooncake_client import MooncakeClient
        client = MooncakeClient(master={store.address!r}, metadata_server={store.metadata_url!r}, timeout=2.0)
        data = np.random.default_rng(7).integers(0, 256, {HEADER} + (256 << 10), dtype=np.uint8)
        client.register(data.ctypes.data, data.nbytes)
        ok = client.put([{key!r}], [[(data.ctypes.data, {HEADER}), (data.ctypes.data + {HEADER}, 256 << 10)]])
        client.close()
        print(ok)
    """)
    done = subprocess.run([sys.executable, "-c", writer], capture_output=True, text=True, timeout=CALL_LIMIT)
    assert done.returncode == 0 and done.stdout.strip() == "[True]", done.stderr[-2000:]
    target = Records(client, 1, 256 << 10)
    assert bounded(client.get, [key], target.pieces())[0] == [True]
    expected = np.random.default_rng(7).integers(0, 256, HEADER + (256 << 10), dtype=np.uint8)
    assert target.record(0) == expected.tobytes()


def test_small_segment_evicts_but_never_returns_wrong_bytes(rng):
    with MooncakeMaster() as master, SegmentOwner(master, "32MB"):
        client = make_client(master)
        try:
            source, target = Records(client, 64, 1 << 20), Records(client, 64, 1 << 20)
            source.fill(rng)
            keys = [f"evict/{i}" for i in range(64)]
            stored = [ok for start in range(0, 64, 8)
                      for ok in bounded(client.put, keys[start:start + 8], source.pieces(range(start, start + 8)))[0]]
            loaded, _ = bounded(client.get, keys, target.pieces())
            assert 0 < sum(loaded) < 64 and sum(stored) >= sum(loaded)
            assert all(target.record(i) == source.record(i) for i in range(64) if loaded[i])
        finally:
            bounded(client.close)


# Faults: each test has servers of its own.


def test_killed_master_fails_every_call_in_bounded_time(rng):
    with MooncakeMaster() as master, SegmentOwner(master):
        client = make_client(master, timeout=1.0)
        records = Records(client, 4, 64 << 10)
        records.fill(rng)
        keys = [f"k{i}" for i in range(4)]
        assert bounded(client.put, keys, records.pieces())[0] == [True] * 4
        master.kill()
        costs = []
        for call, args in ((client.exists, (keys,)), (client.get, (keys, records.pieces())),
                           (client.put, (keys, records.pieces()))):
            start = time.monotonic()
            with pytest.raises(StoreError):
                bounded(call, *args)
            costs.append(round(time.monotonic() - start, 2))
        assert max(costs) < KILLED_MASTER_COST, f"calls against a killed master took {costs} s"
        bounded(client.close)


def test_stalled_master_answers_store_error_after_the_timeout(rng):
    with MooncakeMaster() as master, SegmentOwner(master):
        client = make_client(master, timeout=1.0)
        records = Records(client, 2, 4096)
        keys = ["a", "b"]
        master.stop()
        try:
            for call, args in ((client.exists, (keys,)), (client.get, (keys, records.pieces()))):
                start = time.monotonic()
                with pytest.raises(StoreError):
                    bounded(call, *args)
                assert 0.9 < time.monotonic() - start < 2.5
            with pytest.raises(StoreError):
                bounded(lambda: MooncakeClient(master=master.address, metadata_server=master.metadata_url,
                                               timeout=1.0), limit=2.5)
        finally:
            master.cont()
        assert bounded(client.exists, keys)[0] == [False, False]
        bounded(client.close)


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
        assert all(target.record(i) == source.record(i) for i in range(count) if loaded[i])
        # later reads of the dead owner's records fail fast too (until the master drops its segment)
        assert bounded(client.get, keys[:4], target.pieces(range(4)), limit=5.0)[0] == [False] * 4
        bounded(client.close)


def test_close_waits_for_a_call_stuck_on_a_stopped_owner_and_nothing_lands_afterwards(rng):
    """A stopped owner holds a get (here about the 1 s status timeout per round of blocks; up to
    Mooncake's 60 s for a transfer stopped mid-payload). close() under it would crash the process, so it
    waits for the call; once it returned, a resumed owner writes nothing into the buffers."""
    with MooncakeMaster() as master, SegmentOwner(master) as owner:
        client = make_client(master, timeout=1.0)
        source, target = Records(client, 4, 64 << 10), Records(client, 4, 64 << 10)
        source.fill(rng)
        keys = [f"k{i}" for i in range(4)]
        assert bounded(client.put, keys, source.pieces())[0] == [True] * 4
        owner.stop()
        try:
            reader, result = in_background(client.get, keys, target.pieces())
            time.sleep(0.3)
            assert reader.is_alive()
            _, closing = bounded(client.close)
            reader.join(1.0)
            loaded, seconds = result["returned"]
            assert loaded == [False] * 4 and seconds < 10.0 and closing >= seconds - 0.3, (loaded, seconds, closing)
            target.headers[:] = 0xAB
            target.slots[:] = 0xAB
        finally:
            owner.cont()
        time.sleep(2.0)
        assert (target.headers == 0xAB).all() and (target.slots == 0xAB).all()


def test_master_restart_empties_the_store_and_new_records_land(rng):
    with MooncakeMaster() as master, SegmentOwner(master):
        client = make_client(master)
        old, new, target = (Records(client, 4, 64 << 10) for _ in range(3))
        old.fill(rng)
        new.fill(rng)
        assert bounded(client.put, ["old0", "old1", "old2", "old3"], old.pieces())[0] == [True] * 4
        master.restart()
        master.wait_segments(1)
        # the client reconnects by itself; the store it finds is empty
        assert retry(lambda: client.exists(["old0", "old1", "old2", "old3"])) == [False] * 4
        assert bounded(client.get, ["old0"], target.pieces([0]))[0] == [False]
        keys = ["new0", "new1", "new2", "new3"]
        assert retry(lambda: client.put(keys, new.pieces()), until=all) == [True] * 4
        assert bounded(client.get, keys, target.pieces())[0] == [True] * 4
        assert all(target.record(i) == new.record(i) for i in range(4))
        bounded(client.close)


def retry(call: Callable[[], Any], until: Callable[[Any], bool] = lambda _: True, seconds: float = 10.0) -> Any:
    """``call()`` until it returns without StoreError and ``until`` its result, for ``seconds`` at most."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            result, _ = bounded(call)
            if until(result) or time.monotonic() > deadline:
                return result
        except StoreError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)
