"""Hot prefixes on a shared store: many requests of one engine wanting the same blocks at once (a system
prompt every request shares), and several engines storing the same blocks, against every store in
``helpers.stores.STORES`` for real (Redis; Mooncake where it is installed).

What it shows: eight requests of one engine looking up one prefix at once, while the store is slow to
answer (SIGSTOP), cost the store one existence question per block, and all find the whole prefix; a query
whose answer another query waits for fails both as misses within the timeout; eight requests loading one
prefix at once make one read per block (the others wait for it: staged in host memory, or fetched by the
first request's call) and all end up with bit-exact bytes; a second engine storing the prefix the first
one stored asks once per block and writes nothing (``skipped_existing``); records planted under our names
(garbage, truncated, another block's record) make a store skip them, but once a load refused them the
next store of those blocks writes them again, so a hostile record never pins a miss.

What each store is asked is counted by a wrapper around each real client kvtier opens, which counts the
records every call names and hands the call to the client (``counted``).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from helpers.stores import STORES
from kvtier import KVTier
from kvtier.core.layout import BlockLayout
from kvtier.testing.store import StoreUnderTest
from kvtier.tiers.remote.record import HEADER_BYTES, RecordFormat, namespace_digest
from kvtier.tiers.remote.tier import UNREADABLE_KEPT, RemoteStorage
from kvtier.tiers.remote.transfer import RemoteBackend

BLOCK = 64 * 1024
TOKENS = 16
BLOCKS = 8
REQUESTS = 8
TIMEOUT = 5.0
"""The tier's timeout: long enough that a store stopped for a moment (``OVERLAP_S``) still answers in time."""
OVERLAP_S = 0.5
"""How long the store stays stopped while the requests start, so every one of them asks while the first waits."""
WAIT = 60.0
"""Seconds any future or thread here may take; a test that hits it fails instead of hanging."""


@pytest.fixture(params=sorted(STORES))
def store(request, tmp_path) -> StoreUnderTest:
    """A store of each kind of the test's own (the tests stop it, and count what it is asked)."""
    with STORES[request.param](tmp_path) as running:
        yield running


def config(store: StoreUnderTest, timeout: float = TIMEOUT) -> dict:
    return {
        "block_bytes": BLOCK,
        "block_tokens": TOKENS,
        "namespace": "model-a",
        "tiers": [{"medium": "host", "capacity_blocks": 2 * BLOCKS}, store.tier(timeout=timeout, prefix="hot")],
    }


def prompt(n: int = BLOCKS, start: int = 0) -> list[int]:
    """Token ids of ``n`` full blocks; ``start`` makes another prompt."""
    return list(range(start * 1000, start * 1000 + TOKENS * n))


def data(n: int = BLOCKS, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, BLOCK), dtype=np.uint8)


def remote(kv: KVTier):
    return kv.stack.tiers[-1]


def record_names(kv: KVTier, tokens: list[int]) -> list[str]:
    return [remote(kv).records[0].name(key) for key in kv.keys(tokens)]


class Counting:
    """A real client of the store that counts the records each call names, then hands the call to it."""

    def __init__(self, client: Any, counts: collections.Counter, lock: threading.Lock) -> None:
        self._client = client
        self._counts = counts
        self._lock = lock

    def _count(self, what: str, names) -> None:
        with self._lock:
            self._counts[what] += len(names)

    def exists(self, names):
        self._count("exists", names)
        return self._client.exists(names)

    def get(self, names, records):
        self._count("read", names)
        return self._client.get(names, records)

    def fetch(self, names, size, take):
        self._count("read", names)
        return self._client.fetch(names, size, take)

    def put(self, names, records):
        self._count("put", names)
        return self._client.put(names, records)

    def __getattr__(self, name: str) -> Any:  # name, late_writes, remove, close: the client's own
        return getattr(self._client, name)


def counted(kv: KVTier) -> collections.Counter:
    """Count the records every client ``kv`` opens from now on names, per call kind (its lookups' and its
    transfers'); call it before ``kv`` asks the store anything (clients open on their first call)."""
    counts: collections.Counter = collections.Counter()
    lock = threading.Lock()
    backend = next(b for b in kv.stack.transfers.backends if isinstance(b, RemoteBackend))
    for link in (remote(kv).link, backend.link):
        connect = link.connector.connect
        link.connector = link.connector._replace(connect=lambda connect=connect: Counting(connect(), counts, lock))
    return counts


def stored(cfg: dict, tokens: list[int], blocks: np.ndarray) -> None:
    """Store ``blocks`` through an engine of their own and wait until they reached the store."""
    with KVTier.open(cfg) as kv:
        assert kv.store(tokens, blocks).result(WAIT).stored == len(blocks)
        kv.wait_idle(WAIT)
        assert kv.stats()["remote"]["committed"] == len(blocks)


def at_once(requests: int, request: Callable[[int], Any]) -> list[Any]:
    """Run ``request(i)`` for i in range(``requests``) on threads of their own, all let go together."""
    start = threading.Barrier(requests)

    def run(i: int) -> Any:
        start.wait(WAIT)
        return request(i)

    with ThreadPoolExecutor(requests) as pool:
        futures = [pool.submit(run, i) for i in range(requests)]
        return [future.result(WAIT) for future in futures]


def started_at_once(requests: int, request: Callable[[int], Any], store: StoreUnderTest) -> list[Any]:
    """``at_once`` while the store is stopped for ``OVERLAP_S``: every request is asking by the time it answers."""
    store.hang()
    timer = threading.Timer(OVERLAP_S, store.resume)
    timer.start()
    try:
        return at_once(requests, request)
    finally:
        timer.join()


# --- one engine, many requests ---------------------------------------------------------------------


def test_requests_looking_up_one_prefix_at_once_ask_the_store_once_per_block(store):
    tokens = prompt()
    stored(config(store), tokens, data())
    with KVTier.open(config(store)) as kv:
        counts = counted(kv)
        found = started_at_once(REQUESTS, lambda i: kv.lookup(tokens), store)
        assert found == [BLOCKS] * REQUESTS
        assert counts["exists"] == BLOCKS  # one question per block, however many requests wanted it
        assert [kv.lookup(tokens) for _ in range(3)] == [BLOCKS] * 3 and counts["exists"] == BLOCKS  # known
        assert remote(kv).stats.lookup_errors == 0


def test_requests_waiting_for_a_query_that_fails_get_a_miss_within_the_timeout(store):
    tokens = prompt()
    stored(config(store), tokens, data())
    with KVTier.open(config(store, timeout=1.0)) as kv:
        counts = counted(kv)
        assert kv.lookup(prompt(1, start=9)) == 0  # the lookup client connects (Mooncake's would hang below)
        counts.clear()
        store.hang()  # longer than the timeout: the query every request waits for fails
        try:
            found = at_once(REQUESTS, lambda i: kv.lookup(tokens))
        finally:
            store.resume()
        assert found == [0] * REQUESTS  # a miss for each, none waiting past the timeout (WAIT bounds the threads)
        assert counts["exists"] == BLOCKS  # the others waited for the one query, and failed with it
        assert remote(kv).stats.lookup_errors == 1


def test_requests_loading_one_prefix_at_once_read_each_block_once_and_all_get_its_bytes(store):
    """A store whose clients read into kvtier's memory (Mooncake) stages loads through host slots: the
    other requests wait for those and take the blocks from host memory. One whose clients fetch
    (Redis) loads straight into each request's memory: the others share the first one's reads."""
    tokens, blocks = prompt(), data()
    stored(config(store), tokens, blocks)
    with KVTier.open(config(store)) as kv:
        counts = counted(kv)
        staged = not remote(kv).loads_direct
        assert kv.lookup(tokens) == BLOCKS
        outs = [np.zeros((BLOCKS, BLOCK), np.uint8) for _ in range(REQUESTS)]
        store.hang()
        timer = threading.Timer(OVERLAP_S, store.resume)
        try:
            first = kv.load(tokens, outs[0])  # its reads are in flight now (staged: into host slots reserved)...
            assert kv.stack.tiers[0].leaks()["writing"] == (BLOCKS if staged else 0)
            timer.start()
            others = at_once(REQUESTS - 1, lambda i: kv.load(tokens, outs[i + 1]).result(WAIT))
        finally:
            timer.cancel()
            store.resume()  # (once more where the timer did: SIGCONT again changes nothing)
        assert first.result(WAIT).loaded == BLOCKS and np.array_equal(outs[0], blocks)
        for result in others:  # ...which the others wait for and take: no second read
            sources = {"host": BLOCKS} if staged else {"remote": BLOCKS}
            assert (result.loaded, result.failed, result.per_tier) == (BLOCKS, [], sources)
        assert all(np.array_equal(out, blocks) for out in outs)
        assert counts["read"] == BLOCKS  # each block read from the store once, for all the requests


# --- several engines --------------------------------------------------------------------------------


def test_a_second_engine_storing_the_same_prefix_asks_once_per_block_and_writes_nothing(store):
    tokens, blocks = prompt(), data()
    with KVTier.open(config(store)) as first, KVTier.open(config(store)) as second:
        firsts, seconds = counted(first), counted(second)
        for kv in (first, second):
            assert kv.store(tokens, blocks).result(WAIT).stored == BLOCKS
            kv.wait_idle(WAIT)
        assert (firsts["exists"], firsts["put"]) == (BLOCKS, BLOCKS)
        assert (seconds["exists"], seconds["put"]) == (BLOCKS, 0)
        assert [kv.stats()["remote"]["skipped_existing"] for kv in (first, second)] == [0, BLOCKS]
        assert second.stats()["remote"]["committed"] == BLOCKS  # stored, as far as the engine can tell
    with KVTier.open(config(store)) as reader:
        out = np.zeros((BLOCKS, BLOCK), np.uint8)
        assert reader.load(tokens, out).result(WAIT).loaded == BLOCKS and np.array_equal(out, blocks)


def test_a_record_planted_under_our_name_is_skipped_once_then_rewritten_after_its_load_was_refused(store):
    tokens, blocks = prompt(4), data(4)
    other, other_blocks = prompt(1, start=7), data(1, seed=7)
    stored(config(store), other, other_blocks)
    with KVTier.open(config(store)) as kv:
        names, size = record_names(kv, tokens), HEADER_BYTES + BLOCK
        genuine = store.read(record_names(kv, other)[0], size)
        assert genuine is not None
    store.write(names[0], b"\xff" * size)  # garbage of the right size
    store.write(names[1], genuine[: size // 2])  # a record cut short
    store.write(names[2], genuine)  # another block's genuine record: another key in its header
    with KVTier.open(config(store)) as engine:
        counts = counted(engine)
        assert engine.store(tokens, blocks).result(WAIT).stored == 4
        engine.wait_idle(WAIT)
        assert counts["put"] == 1  # what merely exists under our names is taken for stored...
        assert engine.stats()["remote"]["skipped_existing"] == 3
    with KVTier.open(config(store)) as engine:
        counts = counted(engine)
        out = np.zeros((4, BLOCK), np.uint8)
        result = engine.load(tokens, out).result(WAIT)
        assert (result.hits, result.failed) == (4, [0, 1, 2])  # ...until a load refuses it
        assert np.array_equal(out[3], blocks[3])
        asked = counts["exists"]
        assert engine.store(tokens, blocks).result(WAIT).stored == 3  # recomputed, and stored again
        engine.wait_idle(WAIT)
        assert (counts["exists"] - asked, counts["put"]) == (0, 3)  # written without asking whether they exist
        assert engine.stats()["remote"]["skipped_existing"] == 0
    with KVTier.open(config(store)) as reader:
        out = np.zeros((4, BLOCK), np.uint8)
        assert reader.load(tokens, out).result(WAIT).loaded == 4 and np.array_equal(out, blocks)


def test_a_storage_remembers_a_bounded_number_of_unreadable_records_the_oldest_forgotten_first():
    layout = BlockLayout((64,))
    storage = RemoteStorage(layout, RecordFormat("t", namespace_digest("m", layout), layout.block_bytes))
    keys = [i.to_bytes(8, "little") for i in range(UNREADABLE_KEPT + 2)]
    storage.loaded(keys, [False] * len(keys))
    assert storage.unreadable([keys[0], keys[1], keys[2], keys[-1]]) == [False, False, True, True]
    storage.loaded(keys[2:3], [True])  # a record that loaded is trusted again
    storage.stored(keys[3:4], skipped=0)  # and so is one this process wrote
    assert storage.unreadable(keys[2:5]) == [False, False, True]
