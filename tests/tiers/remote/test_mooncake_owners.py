"""A stack over Mooncake Store whose records lie with two standalone segment owners, one of which dies.

Where Mooncake puts a record (mooncake-transfer-engine 0.3.13): one replica (``ReplicateConfig.replica_num``
defaults to 1 and kvtier asks for no more), in a segment the master picks at random among those mounted
(``--allocation_strategy``'s default, ``random``); kvtier's clients mount none (``segment_size: 0``). So
the blocks of one store spread over both owners, and an owner that dies takes exactly its own records with
it: nothing is copied elsewhere, nothing else is lost. The master's admin API names each record's owner.

How long the master takes to notice a dead owner, measured on loopback: it drops the owner's segment,
and with it the owner's records, ``--client_ttl`` after the owner's last heartbeat: 10.6 s after a
SIGKILL with the default 10 s, 3 s with ``--client_ttl=2``. Until then ``batch_is_exist`` says "present"
for every dead record, and a store the master places on the dead segment fails (a counted drop). The
tests that need not wait that long use ``--client_ttl=4``: with 2, a live owner stopped for 3.5 s was
dropped too (its records lost; it mounts its segment again once it runs), as a loaded machine may
stop one.

A read of a dead record fails in about 10 ms (nobody listens); a read in flight when its owner dies
returns when it dies, or up to a second later (the transfer engine's reconnect attempts). A load that
failed any block ends about a second after its read returned all the same: the link drops a Mooncake
client whose read failed (it may still write into the buffers), and Mooncake's ``close()`` holds the
GIL for 0.8 to 1 s. All of it stays within the tier's timeout here (2 s).

kvtier turns every one of these into a miss: the load reports exactly the dead owner's blocks failed
(``read_errors``), the remote tier then calls them absent for ``KNOWN_FOR_S`` (5 s) and asks the store
again after that, so with the default TTL one stack fails each dead block about twice before the master
forgets it. No load returns wrong bytes, and the live owner's blocks load bit-exact throughout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from helpers.mooncake_server import MooncakeMaster, SegmentOwner, mooncake_store
from kvtier import KVTier, LoadResult
from kvtier.testing.common import assert_clean
from kvtier.testing.store import bounded
from kvtier.tiers.remote.mooncake_client import MooncakeClient
from kvtier.tiers.remote.transfer import RemoteBackend

BLOCK = 1 << 20
COUNT = 32
"""Blocks per store: each owner gets some (all on one owner: a chance of 2**-31)."""
OWNER = "128MB"
TIMEOUT = 2.0
MARGIN = 1.0
"""What a call may take beyond the tier's timeout (thread hand-offs on a loaded machine)."""
WAIT = 30.0
"""Seconds any future here may take; a test that hits it fails instead of hanging."""
TTL = 4
"""``--client_ttl`` of the masters that need only drop a dead owner soon, not as late as by default (with 2,
a live owner that a busy machine stalled for a few seconds was dropped too)."""
DEFAULT_TTL = 10
"""The master's default ``--client_ttl``."""


def config(master: MooncakeMaster) -> dict:
    return {
        "block_tokens": 4,
        "block_bytes": BLOCK,
        "fragments": 2,
        "namespace": "test-model",
        "tiers": [{"medium": "host", "capacity": "256MiB", "eviction": "lru"}, master.tier(TIMEOUT)],
    }


def in_time(call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)``'s result, which must come within the tier's timeout (and a margin)."""
    result, seconds = bounded(call, *args)
    assert seconds < TIMEOUT + MARGIN, f"{getattr(call, '__name__', call)} took {seconds:.2f} s"
    return result


def load(kv: KVTier, keys: list[bytes]) -> tuple[LoadResult, np.ndarray]:
    out = np.zeros((len(keys), BLOCK), np.uint8)
    return in_time(lambda: kv.load(keys, out).result(WAIT)), out


def assert_all_loaded(kv: KVTier, keys: list[bytes], expected: np.ndarray) -> None:
    result, out = load(kv, keys)
    assert (result.hits, result.loaded) == (len(keys), len(keys)), kv.stats()["remote"]
    assert_exact(result, out, expected)


def assert_exact(result: LoadResult, out: np.ndarray, expected: np.ndarray) -> None:
    """Every block the load did not report failed holds exactly the bytes stored."""
    for i in range(result.hits):
        if i not in result.failed:
            assert np.array_equal(out[i], expected[i]), f"block {i} came back wrong"


def assert_all_failed(kv: KVTier, keys: list[bytes]) -> int:
    """Load ``keys``, whose records are gone: the stack may still find them (then each fails), never
    loads one. Returns how many it found."""
    result, _ = load(kv, keys)
    assert result.hits in (0, len(keys)) and result.loaded == 0 and result.failed == list(range(result.hits))
    return result.hits


def read_errors(kv: KVTier) -> int:
    return kv.stats()["remote"]["read_errors"]


def record_names(kv: KVTier, keys: list[bytes]) -> list[str]:
    return [kv.stack.tiers[-1].records[0].name(key) for key in keys]


def holders(master: MooncakeMaster, owners: list[SegmentOwner], names: list[str]) -> list[SegmentOwner]:
    """The owner holding each record, which must have exactly one replica."""
    by_segment = {owner.segment: owner for owner in owners}
    replicas = master.replicas(names)
    assert all(len(replicas[name]) == 1 for name in names), replicas
    return [by_segment[replicas[name][0]] for name in names]


class Spread:
    """``COUNT`` blocks stored through a stack of their own, and the owner holding each one's record."""

    def __init__(self, master: MooncakeMaster, owners: list[SegmentOwner], rng: np.random.Generator) -> None:
        self.keys = [rng.bytes(16) for _ in range(COUNT)]
        self.data = rng.integers(0, 256, (COUNT, BLOCK), dtype=np.uint8)
        with KVTier.open(config(master)) as writer:
            assert writer.store(self.keys, self.data).result(WAIT).stored == COUNT
            writer.wait_idle(WAIT)
            self.names = record_names(writer, self.keys)
        self.holders = holders(master, owners, self.names)
        assert set(self.holders) == set(owners), "every owner holds some of the records"

    def on(self, owner: SegmentOwner) -> list[int]:
        """Indices of the blocks whose record ``owner`` holds."""
        return [i for i, holder in enumerate(self.holders) if holder is owner]


def store_and_place(
    kv: KVTier, master: MooncakeMaster, owners: list[SegmentOwner], keys: list[bytes], data: np.ndarray
) -> dict[bytes, SegmentOwner]:
    """Store ``data`` under ``keys`` through ``kv`` (write-through to the store); the owner of each record
    that landed. Those that did not are exactly the remote tier's counted drops."""
    dropped = kv.stats()["remote"]["aborted"]
    assert kv.store(keys, data).result(WAIT).stored == len(keys)
    kv.wait_idle(WAIT)
    names = record_names(kv, keys)
    placed = master.replicas(names)
    landed = [i for i, name in enumerate(names) if placed[name]]
    assert kv.stats()["remote"]["aborted"] - dropped == len(keys) - len(landed)
    owner_of = holders(master, owners, [names[i] for i in landed])
    return {keys[i]: owner for i, owner in zip(landed, owner_of, strict=True)}


def test_records_on_the_live_owner_survive_the_loss_of_the_other(rng):
    """Before the master notices, the dead owner's records may still be found, but every load of them
    fails; after, they are absent. The live owner's records load bit-exact all along."""
    with mooncake_store(2, OWNER, f"--client_ttl={TTL}") as (master, owners):
        spread = Spread(master, owners, rng)
        dead, live = owners
        lost, kept = spread.on(dead), spread.on(live)
        dead.kill()
        with KVTier.open(config(master)) as reader:
            found = assert_all_failed(reader, [spread.keys[i] for i in lost])
            assert read_errors(reader) == found
            link = next(b for b in reader.stack.transfers.backends if isinstance(b, RemoteBackend)).link
            time.sleep(max(0.0, link._down_until - time.monotonic()))  # (a load of the dead owner's records
            # that outlived the deadline takes the link down for a backoff, refusing every load in it)
            assert_all_loaded(reader, [spread.keys[i] for i in kept], spread.data[kept])
            assert_clean(reader)

        master.wait_dropped(dead.segment, TTL + 5.0)
        with KVTier.open(config(master)) as after:  # a new stack: no failed loads remembered, the store answers
            assert [in_time(after.lookup, [spread.keys[i]]) for i in lost] == [0] * len(lost)
            assert_all_loaded(after, [spread.keys[i] for i in kept], spread.data[kept])
            assert read_errors(after) == 0
            assert_clean(after)


@pytest.mark.parametrize("paused", [True, False], ids=["paused-then-killed", "killed"])
def test_an_owner_killed_mid_load_fails_only_its_blocks_and_the_stack_goes_on(rng, paused):
    """A load of blocks spread over both owners; one owner dies while it runs (``paused``: stopped before
    the load started, so that the load surely waits for it, then killed; else killed a few ms in, while
    bytes move). Only that owner's blocks fail; afterwards stores land on the live owner and load."""
    with mooncake_store(2, OWNER, f"--client_ttl={TTL}") as (master, owners):
        spread = Spread(master, owners, rng)
        dead, live = owners
        lost = set(spread.on(dead))
        with KVTier.open(config(master)) as reader:
            warm = spread.on(live)[0]
            assert load(reader, [spread.keys[warm]])[0].loaded == 1  # the reader's load client is connected
            assert in_time(reader.lookup, spread.keys) == COUNT
            if paused:
                dead.stop()
            out = np.zeros((COUNT, BLOCK), np.uint8)
            start = time.monotonic()
            future = reader.load(spread.keys, out)
            time.sleep(0.2 if paused else 0.005)
            assert not paused or not future.done(), "the load waits for the paused owner"
            dead.kill()
            result = future.result(WAIT)
            assert time.monotonic() - start < TIMEOUT + MARGIN
            assert result.hits == COUNT and result.loaded == COUNT - len(result.failed)
            assert set(result.failed) <= lost, "only the dead owner's blocks fail"
            assert not paused or set(result.failed) == lost
            assert_exact(result, out, spread.data)
            assert read_errors(reader) == len(result.failed)

            # While the master still lists the dead segment, a store it places there fails (a counted drop,
            # absent from the store); once it dropped the segment, every store lands on the live owner.
            during = [rng.bytes(16) for _ in range(COUNT)]
            landed = store_and_place(reader, master, owners, during, spread.data)
            assert set(landed.values()) <= {live}
            master.wait_dropped(dead.segment, TTL + 5.0)
            after = [rng.bytes(16) for _ in range(COUNT)]
            assert list(store_and_place(reader, master, owners, after, spread.data).values()) == [live] * COUNT
            assert_clean(reader)

        with KVTier.open(config(master)) as fresh:
            assert all(master.replicas(record_names(fresh, after)).values()), "the live owner's records are gone"
            assert_all_loaded(fresh, after, spread.data)
            arrived = [i for i, key in enumerate(during) if key in landed]
            assert_all_loaded(fresh, [during[i] for i in arrived], spread.data[arrived])
            assert_clean(fresh)


def test_lookups_find_a_dead_owners_records_until_the_master_drops_it_and_every_load_of_them_fails(rng):
    """With the master's default TTL: for as long as the store says the dead owner's records exist, a
    long-lived stack finds them now and then (whenever its memory of the last failed load expired), and
    every such load fails exactly them, in time; then they are absent for good."""
    with mooncake_store(2, OWNER) as (master, owners):
        spread = Spread(master, owners, rng)
        dead, live = owners
        lost, kept = spread.on(dead), spread.on(live)
        lost_keys, lost_names = [spread.keys[i] for i in lost], [spread.names[i] for i in lost]
        client = bounded(
            lambda: MooncakeClient(master=master.address, metadata_server=master.metadata_url, timeout=TIMEOUT)
        )[0]
        with KVTier.open(config(master)) as reader:
            dead.kill()
            killed = time.monotonic()
            said_present = found = 0
            while dead.segment in master.segments():
                assert time.monotonic() - killed < DEFAULT_TTL + 5.0, "the master never dropped the dead owner"
                said_present += any(in_time(client.exists, lost_names))
                found += assert_all_failed(reader, lost_keys) > 0
                time.sleep(0.2)
            assert said_present and found, "the store said present, and the stack found them, for a while"
            assert read_errors(reader) == found * len(lost)

            assert in_time(client.exists, lost_names) == [False] * len(lost)
            assert_all_loaded(reader, [spread.keys[i] for i in kept], spread.data[kept])
            assert_clean(reader)
        bounded(client.close)
        with KVTier.open(config(master)) as after:  # a new stack: no answers remembered, the store answers
            assert [in_time(after.lookup, [key]) for key in lost_keys] == [0] * len(lost)
