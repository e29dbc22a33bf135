"""``StoreClientTests``: the ``StoreClient`` contract (kvtier.tiers.remote.client), against a real store; and
``StoreUnderTest``, a store's servers behind the one interface the suites over a store use (this one and
``RemoteStackTests``).

A subclass provides the class-scoped fixture ``store_class``: a ``StoreUnderTest`` subclass, which starts
the store's servers, makes kvtier's client and a stack's tier for it, injects faults (kill, restart, hang)
and states as data what the backend may do differently (``DEAD_WITHIN_S``, ``hung_window``,
``RECONNECTS_AT_ONCE``, ``SMALL``, ``CLOSED_CALLS_RAISE``, ``FETCHES``), so the suites assert the same
behaviour with each backend's own bounds. Parametrize the fixture to run the suite over several stores.

    with MyStore(tmp_path) as store:
        client = store.client(timeout=1.0)        # kvtier's StoreClient for this backend
        store.tier(timeout=1.0, prefix="t1")      # a stack's remote tier mapping for it
        store.write(name, data); store.read(name, size); store.holds(names)  # around kvtier's client
        store.kill(); store.restart(); store.hang(); store.resume()          # faults
        store.existence_queries()                 # batched existence queries the server answered so far

What every client promises (client.py's docstrings), checked here:
- a record is the concatenation of its pieces: records of 1 to 3 pieces and of 1 byte to 1 MiB go in
  and come back bit-exact, each batch's answers in the batch's order, each record into its own pieces;
  empty batches are empty answers;
- ``put`` replaces a record of the same name whole, also one of another size, also right after a read;
- ``get`` is True only for a record of exactly the pieces' total size: a missing, shorter or longer one
  is False for itself alone, and the rest of its batch arrives;
- ``fetch`` (where the client fetches) offers each record or None and answers what ``take`` said;
- ``remove`` forgets records and ignores missing names; ``exists`` agrees with what was put and removed;
- a record outlives the client, and the process, that wrote it;
- after ``close()`` (twice is fine) a call raises the backend's error or answers False, and writes into
  no buffer; a read in flight when another thread closes the client writes nothing after close() returned;
- a dead store fails every call with StoreError within the backend's bound; a hung one within its
  window, and the same client is answered again once the store resumes;
- after a restart the store is empty and takes records again;
- a store too small for what it is given evicts, and never returns wrong bytes.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import textwrap
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from kvtier.core.errors import StoreError
from kvtier.testing.common import ContractTests

CALL_LIMIT_S = 30.0
"""No store call in a test may take longer: a test that hits it fails instead of hanging."""


def fails(call: Callable[..., Any], *args: Any) -> None:
    """``call(*args)`` (``bounded``) must raise StoreError; what it returned instead, and when, is the failure."""
    try:
        result, seconds = bounded(call, *args)
    except StoreError:
        return
    pytest.fail(f"{getattr(call, '__name__', call)} returned {result!r} after {seconds:.2f} s, not StoreError")


def bounded(call: Callable[..., Any], *args: Any, limit: float = CALL_LIMIT_S) -> tuple[Any, float]:
    """``call(*args)`` on a thread, failing the test if it is still running after ``limit`` seconds; its
    result (or its exception, raised here) and how long it took. A hung store must fail a test, never hang it."""
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


def retry(call: Callable[[], Any], until: Callable[[Any], bool] = lambda _: True, seconds: float = 10.0) -> Any:
    """``call()`` until it returns without StoreError and ``until`` its result, for ``seconds`` at most: a
    store that came back may refuse the first calls of a client that has not noticed yet."""
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


def pieces_of(array: np.ndarray) -> list[tuple[int, int]]:
    """One record's single piece: the whole of a contiguous uint8 ``array``."""
    return [(array.ctypes.data, array.nbytes)]


class StoreUnderTest(ABC):
    """One running store, as the suites over a store see it. A context manager: entering starts the
    servers (or skips the test where they cannot run), leaving kills them. A subclass starts its servers
    in ``__enter__`` on ``self._stack``, which ``__exit__`` closes."""

    name: ClassVar[str]
    DEAD_WITHIN_S: ClassVar[float]
    """A call to a store whose servers were killed raises StoreError within this many seconds."""
    RECONNECTS_AT_ONCE: ClassVar[bool]
    """Whether a client's first call after a server restart already succeeds (else it may raise for a while)."""
    SMALL: ClassVar[tuple[int, int]]
    """(records, bytes each) that overfill the store ``small()`` starts."""
    SMALL_OPTIONS: ClassVar[dict[str, Any]]
    """What the constructor takes to start a store too small for ``SMALL``."""
    CLOSED_CALLS_RAISE: ClassVar[type[Exception] | None]
    """What a call on a closed client raises; None where it answers instead (all False, writing nothing)."""
    FETCHES: ClassVar[bool]
    """Whether its clients ``fetch`` (read records into memory of their own first)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._raw: Any = None
        self._stack = contextlib.ExitStack()  # the servers ``__enter__`` starts, stopped by ``__exit__``

    @abstractmethod
    def __enter__(self) -> StoreUnderTest: ...

    def __exit__(self, *exc_info: object) -> None:
        try:
            self._close_raw()
        finally:
            self._stack.close()

    @abstractmethod
    def client(self, timeout: float = 1.0):
        """A new kvtier ``StoreClient`` of this store (the caller closes it)."""

    @abstractmethod
    def tier(self, timeout: float = 1.0, **options: Any) -> dict:
        """A stack's remote tier mapping for this store; ``options`` are further keys of the tier."""

    @abstractmethod
    def hung_window(self, timeout: float) -> tuple[float, float]:
        """Seconds within which a call to a hung store (``hang()``) raises StoreError, for a client of ``timeout``."""

    @abstractmethod
    def kill(self) -> None:
        """Kill every server of the store: it is dead."""

    @abstractmethod
    def restart(self) -> None:
        """Kill the store and start it again at the same address: it comes back empty."""

    @abstractmethod
    def hang(self) -> None:
        """Stop every server (SIGSTOP): they keep their sockets and answer nothing."""

    @abstractmethod
    def resume(self) -> None: ...

    @abstractmethod
    def existence_queries(self) -> int:
        """How many batched existence queries the store has answered so far."""

    @classmethod
    @contextlib.contextmanager
    def small(cls, directory: Path) -> Iterator[StoreUnderTest]:
        """A store of its own with too little memory for ``SMALL``: it must evict."""
        with cls(directory, **cls.SMALL_OPTIONS) as store:
            yield store

    # Around kvtier's client, through a client the store keeps for itself (opened on first use).

    def write(self, name: str, data: bytes) -> None:
        """Put ``data`` as the record ``name``, replacing any (damage, forgery, another stack's copy)."""
        array = np.frombuffer(data, np.uint8).copy()
        assert bounded(self._raw_client().put, [name], [pieces_of(array)])[0] == [True]

    def read(self, name: str, size: int) -> bytes | None:
        """The record ``name`` when it holds exactly ``size`` bytes, else None."""
        array = np.zeros(size, np.uint8)
        ok, _ = bounded(self._raw_client().get, [name], [pieces_of(array)])
        return array.tobytes() if ok[0] else None

    def holds(self, names: Sequence[str]) -> list[bool]:
        """Which of ``names`` the store holds now."""
        return bounded(self._raw_client().exists, list(names))[0]

    def _raw_client(self):
        if self._raw is None:
            self._raw = self.client(timeout=5.0)
        return self._raw

    def _close_raw(self) -> None:
        raw, self._raw = self._raw, None
        if raw is not None:
            bounded(raw.close)


class StoreSuite:
    """The fixtures of a suite over a store: ``store_class`` (the subclass provides it), ``store`` (one
    running store for the class's tests that do it no harm, each naming its records its own way) and
    ``fresh_store`` (a test's own: it may kill, stop or restart it)."""

    @pytest.fixture(scope="class")
    @classmethod
    def store_class(cls) -> type[StoreUnderTest]:
        """The kind of store under test, not started (class-scoped: ``store`` serves a whole class)."""
        raise NotImplementedError(f"{cls.__name__} provides the class-scoped fixture store_class")

    @pytest.fixture(scope="class")
    @classmethod
    def store(
        cls, store_class: type[StoreUnderTest], tmp_path_factory: pytest.TempPathFactory
    ) -> Iterator[StoreUnderTest]:
        with store_class(tmp_path_factory.mktemp(store_class.name)) as running:
            yield running

    @pytest.fixture
    def fresh_store(self, store_class: type[StoreUnderTest], tmp_path: Path) -> Iterator[StoreUnderTest]:
        with store_class(tmp_path) as running:
            yield running


TIMEOUT = 1.0
HUNG_TIMEOUT = 0.25

PIECES = {
    "one-byte": (1,),
    "header-and-slot": (40, 64 << 10),
    "three-odd-pieces": (64, 4095, 7),
    "one-mebibyte": (1 << 20,),
}
"""Record shapes: the byte counts of each record's pieces, in order."""


class Records:
    """``count`` records whose pieces have the byte counts ``sizes``, piece p of every record in an array of
    its own (as the remote tier's headers and host slots are)."""

    def __init__(self, count: int, sizes: tuple[int, ...]) -> None:
        self.arrays = [np.zeros((count, size), np.uint8) for size in sizes]

    def fill(self, rng: np.random.Generator) -> Records:
        for array in self.arrays:
            array[:] = rng.integers(0, 256, array.shape, dtype=np.uint8)
        return self

    def pieces(self, indices=None) -> list[list[tuple[int, int]]]:
        indices = range(len(self.arrays[0])) if indices is None else indices
        return [[(array[i].ctypes.data, array.shape[1]) for array in self.arrays] for i in indices]

    def record(self, i: int) -> bytes:
        """Record ``i`` as the store holds it: its pieces one after the other."""
        return b"".join(array[i].tobytes() for array in self.arrays)


def call(method, *args):
    """``method(*args)``, failing the test instead of hanging on a hung store."""
    return bounded(method, *args)[0]


WRITER = """
import json, sys
import numpy as np
from kvtier.tiers.remote.config import RemoteTierConfig
from kvtier.tiers.remote.factory import connector
tier, name = json.loads(sys.argv[1]), sys.argv[2]
client = connector(RemoteTierConfig.model_validate(tier)).connect()
data = np.random.default_rng(7).integers(0, 256, 40 + (256 << 10), dtype=np.uint8)
print(client.put([name], [[(data.ctypes.data, 40), (data.ctypes.data + 40, 256 << 10)]]))
client.close()
"""
"""A process of its own that puts one record through a client built from a tier's config, and exits."""


class StoreClientTests(StoreSuite, ContractTests):
    """The store client contract; a subclass provides ``store_class``."""

    @pytest.fixture(scope="class")
    @classmethod
    def client(cls, store: StoreUnderTest) -> Iterator[Any]:
        """One client of the class's store for the tests that do it no harm (an engine, too, makes many
        calls on one client)."""
        shared = store.client(timeout=TIMEOUT)
        yield shared
        bounded(shared.close)

    @pytest.fixture
    def names(self, request: pytest.FixtureRequest) -> Callable[..., list[str]]:
        """``names(count, tag="")``: record names unique to the test (the store is shared)."""
        return lambda count, tag="": [f"{request.node.name}/{tag}{i}" for i in range(count)]

    # --- records in, records out ---------------------------------------------------------------------

    @pytest.mark.parametrize("sizes", PIECES.values(), ids=PIECES)
    def test_records_round_trip_bit_exact_in_the_batchs_order(self, store, client, names, rng, sizes):
        source, target = Records(6, sizes).fill(rng), Records(6, sizes)
        keys = names(6)
        assert call(client.exists, keys) == [False] * 6
        assert call(client.put, keys, source.pieces()) == [True] * 6
        assert store.read(keys[2], sum(sizes)) == source.record(2)  # the pieces, concatenated
        assert call(client.exists, [*keys, names(1, "absent")[0]]) == [True] * 6 + [False]
        order = rng.permutation(6).tolist()
        assert call(client.get, [keys[i] for i in order], target.pieces(order)) == [True] * 6
        assert all(target.record(i) == source.record(i) for i in range(6))

    def test_a_record_written_in_one_piece_reads_into_several(self, store, client, names, rng):
        source, target = Records(1, (1000,)).fill(rng), Records(1, (100, 899, 1))
        key = names(1)
        assert call(client.put, key, source.pieces()) == [True]
        assert call(client.get, key, target.pieces()) == [True] and target.record(0) == source.record(0)

    def test_empty_batches_are_empty_answers(self, client):
        assert call(client.exists, []) == call(client.put, [], []) == call(client.get, [], []) == []
        assert call(client.remove, []) is None

    def test_put_replaces_a_record_whole_even_one_just_read_or_of_another_size(self, client, names, rng):
        shape = (64, 32 << 10)
        first, second, target = Records(4, shape).fill(rng), Records(4, shape).fill(rng), Records(4, shape)
        keys = names(4)
        assert call(client.put, keys, first.pieces()) == [True] * 4
        assert call(client.get, keys, target.pieces()) == [True] * 4  # Mooncake leases a record it served
        assert call(client.put, keys, second.pieces()) == [True] * 4
        assert call(client.get, keys, target.pieces()) == [True] * 4
        assert all(target.record(i) == second.record(i) for i in range(4))
        longer, into = Records(1, (64, (32 << 10) + 7)).fill(rng), Records(1, (64, (32 << 10) + 7))
        assert call(client.put, keys[:1], longer.pieces()) == [True]
        assert call(client.get, keys[:1], target.pieces([0])) == [False]  # the old size is gone
        assert call(client.get, keys[:1], into.pieces()) == [True] and into.record(0) == longer.record(0)

    def test_fetch_offers_each_record_or_none_and_answers_what_take_said(self, store, client, names, rng):
        """A client that fetches reads each record into memory of its own and offers it to ``take`` (None for a
        missing record or one of another size), answering per record what ``take`` said; one that does not
        says so."""
        size = 32 << 10
        source, other = Records(3, (size,)).fill(rng), Records(1, (size + 1,)).fill(rng)
        keys = names(4)
        assert call(client.put, keys[:3], source.pieces()) == [True] * 3
        assert call(client.put, keys[3:], other.pieces()) == [True]
        offered: dict[int, bytes | None] = {}

        def take(i: int, value: bytes | None) -> bool:
            offered[i] = value
            return i != 1 and value is not None  # (record 1 arrives too late for its caller, say)

        batch = [*keys, names(1, "absent")[0]]
        if not store.FETCHES:
            with pytest.raises(NotImplementedError):
                client.fetch(batch, size, take)
            return
        assert call(client.fetch, batch, size, take) == [True, False, True, False, False]
        assert offered == {0: source.record(0), 1: source.record(1), 2: source.record(2), 3: None, 4: None}

    def test_a_missing_shorter_or_longer_record_fails_only_itself(self, client, names, rng):
        size = 32 << 10
        source = Records(4, (size,)).fill(rng)
        keys = names(4)
        assert call(client.put, keys, source.pieces()) == [True] * 4
        shorter, longer, same = Records(1, (size - 1,)), Records(1, (size + 1,)), Records(3, (size,))
        batch = [keys[0], keys[1], names(1, "absent")[0], keys[2], keys[3]]
        pieces = [*shorter.pieces(), *longer.pieces(), *same.pieces([0]), *same.pieces([1, 2])]
        assert call(client.get, batch, pieces) == [False, False, False, True, True]
        assert same.record(1) == source.record(2) and same.record(2) == source.record(3)

    def test_remove_forgets_records_and_ignores_missing_names(self, client, names, rng):
        source, target = Records(4, (4096,)).fill(rng), Records(4, (4096,))
        keys = names(4)
        assert call(client.put, keys, source.pieces()) == [True] * 4
        assert call(client.remove, [keys[0], keys[1], names(1, "never-stored")[0]]) is None
        assert call(client.exists, keys) == [False, False, True, True]
        assert call(client.get, keys, target.pieces()) == [False, False, True, True]
        assert target.record(3) == source.record(3)

    def test_a_record_outlives_the_client_and_the_process_that_wrote_it(self, store, client, names):
        """The writer is a client the factory builds from a tier's config (a Mooncake one lending no memory:
        the record lives in the owner's segment); it puts, closes and exits."""
        key = names(1)[0]
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(WRITER), json.dumps(store.tier(timeout=2.0)), key],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0 and done.stdout.strip() == "[True]", done.stderr[-2000:]
        target = Records(1, (40 + (256 << 10),))
        assert call(client.get, [key], target.pieces()) == [True]
        expected = np.random.default_rng(7).integers(0, 256, 40 + (256 << 10), dtype=np.uint8)
        assert target.record(0) == expected.tobytes()

    def test_after_close_no_call_writes_into_a_buffer(self, store, names, rng):
        """client.py: "afterwards no call of this client writes into any buffer". A closed client refuses a call
        (with the backend's ``CLOSED_CALLS_RAISE``) or answers False; the buffers stay as they were either way."""
        closing = store.client(timeout=TIMEOUT)
        source, target = Records(2, (4096,)).fill(rng), Records(2, (4096,))
        keys = names(2)
        assert call(closing.put, keys, source.pieces()) == [True, True]
        bounded(closing.close)
        bounded(closing.close)
        target.arrays[0][:] = 0xAB
        if store.CLOSED_CALLS_RAISE is not None:
            with pytest.raises(store.CLOSED_CALLS_RAISE):
                call(closing.get, keys, target.pieces())
            for method, args in (
                (closing.exists, (keys,)),
                (closing.put, (keys, source.pieces())),
                (closing.remove, (keys,)),
            ):
                with pytest.raises(store.CLOSED_CALLS_RAISE):
                    call(method, *args)
        else:
            assert call(closing.get, keys, target.pieces()) == [False, False]
        assert (target.arrays[0] == 0xAB).all()

    def test_a_call_racing_close_finishes_before_close_returns_or_writes_nothing(self, fresh_store, rng):
        """The store hangs with a read in flight and close() comes from another thread meanwhile (the store
        resumes soon after): whatever the read then does, the buffers stay as they were when close() returned."""
        client = fresh_store.client(timeout=HUNG_TIMEOUT)
        source, target = Records(2, (4096,)).fill(rng), Records(2, (4096,))
        keys = ["race/a", "race/b"]
        assert call(client.put, keys, source.pieces()) == [True, True]
        outcome: dict[str, object] = {}

        def read() -> None:
            try:
                outcome["result"] = client.get(keys, target.pieces())
            except Exception as exc:  # a refusal (or a StoreError from the hung store) is a fine answer
                outcome["error"] = exc

        reading, closing = (
            threading.Thread(target=read, daemon=True),
            threading.Thread(target=client.close, daemon=True),
        )
        fresh_store.hang()
        try:
            reading.start()
            time.sleep(0.1)  # the read waits on the hung store
            closing.start()
            time.sleep(0.1)
        finally:
            fresh_store.resume()
        closing.join(CALL_LIMIT_S)
        assert not closing.is_alive(), f"close() of a {fresh_store.name} client did not return"
        snapshot = target.arrays[0].copy()  # what the buffers hold when close() has returned
        reading.join(CALL_LIMIT_S)
        assert not reading.is_alive() and outcome, f"a {fresh_store.name} read did not return after close()"
        assert (target.arrays[0] == snapshot).all()

    # --- a store that fails --------------------------------------------------------------------------

    def test_a_dead_store_fails_every_call_with_store_error_in_bounded_time(self, fresh_store, rng):
        client = fresh_store.client(timeout=TIMEOUT)
        records = Records(4, (64 << 10,)).fill(rng)
        keys = [f"dead/{i}" for i in range(4)]
        assert call(client.put, keys, records.pieces()) == [True] * 4
        fresh_store.kill()
        costs = []
        for method, args in (
            (client.exists, (keys,)),
            (client.get, (keys, records.pieces())),
            (client.put, (keys, records.pieces())),
        ):
            start = time.monotonic()
            fails(method, *args)
            costs.append(round(time.monotonic() - start, 2))
        assert max(costs) < fresh_store.DEAD_WITHIN_S, f"calls against a dead {fresh_store.name} took {costs} s"
        bounded(client.close)

    def test_a_hung_store_fails_calls_within_its_window_and_answers_once_it_resumes(self, fresh_store):
        client = fresh_store.client(timeout=HUNG_TIMEOUT)
        records = Records(2, (4096,))
        keys = ["hung/a", "hung/b"]
        assert call(client.exists, keys) == [False, False]  # connected before the store hangs
        low, high = fresh_store.hung_window(HUNG_TIMEOUT)
        fresh_store.hang()
        try:
            for method, args in ((client.exists, (keys,)), (client.get, (keys, records.pieces()))):
                start = time.monotonic()
                fails(method, *args)
                took = time.monotonic() - start
                assert low < took < high, f"{method.__name__} against a hung {fresh_store.name} took {took:.2f} s"
        finally:
            fresh_store.resume()
        assert retry(lambda: client.exists(keys)) == [False, False]
        bounded(client.close)

    def test_after_a_restart_the_store_is_empty_and_takes_records_again(self, fresh_store, rng):
        client = fresh_store.client(timeout=2.0)
        old, new, target = Records(4, (64 << 10,)).fill(rng), Records(4, (64 << 10,)).fill(rng), Records(4, (64 << 10,))
        olds, news = [f"old/{i}" for i in range(4)], [f"new/{i}" for i in range(4)]
        assert call(client.put, olds, old.pieces()) == [True] * 4
        fresh_store.restart()
        if fresh_store.RECONNECTS_AT_ONCE:  # the broken idle connection is replaced within the first call
            assert call(client.exists, olds) == [False] * 4
        else:
            assert retry(lambda: client.exists(olds)) == [False] * 4
        assert call(client.get, olds[:1], target.pieces([0])) == [False]
        assert retry(lambda: client.put(news, new.pieces()), until=all) == [True] * 4
        assert call(client.get, news, target.pieces()) == [True] * 4
        assert all(target.record(i) == new.record(i) for i in range(4))
        bounded(client.close)

    def test_a_store_too_small_evicts_but_never_returns_wrong_bytes(self, store_class, tmp_path, rng):
        count, size = store_class.SMALL
        with store_class.small(tmp_path) as small:
            client = small.client(timeout=2.0)
            try:
                source, target = Records(count, (size,)).fill(rng), Records(count, (size,))
                keys = [f"evict/{i}" for i in range(count)]
                stored = [
                    ok
                    for at in range(0, count, 8)
                    for ok in call(client.put, keys[at : at + 8], source.pieces(range(at, at + 8)))
                ]
                loaded = call(client.get, keys, target.pieces())
                assert 0 < sum(loaded) < count and sum(stored) >= sum(loaded)
                assert all(target.record(i) == source.record(i) for i in range(count) if loaded[i])
            finally:
                bounded(client.close)
