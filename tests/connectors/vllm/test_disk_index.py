"""A restart under vLLM without reading every slot header (issue 29): an engine's clean shutdown leaves
the scheduler side's index of its disk tier (``<path>/index.kvt``) and, on every rank, a snapshot of
no blocks carrying the slab's sequence number (``<path>/rank<r>/index.kvt``). The next engine takes
both: its scheduler side restores every block from the index (no slot header read), its workers
take the sequence number (no scan), and the blocks load back bit-exact on every rank. A crash, or an
index that is stale (a slab written since, workers that closed after the scheduler side), damaged,
hostile or forged, means one log line and the headers read as before; an index naming the wrong
slots can only cause misses, which vLLM recomputes. The blocks go back into the scheduler side's index
chunk by chunk on a thread while the engine already serves (a block not back yet is a miss), each
announced once by a KV event as its chunk comes back; a shutdown in the middle loses none of them."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from helpers.vllm_harness import Engine
from helpers.vllm_helpers import (
    BLOCK,
    assert_loads_back,
    assert_recomputed_from,
    forget_gpu,
    held_by,
    prompt,
    step_until_scheduled,
)
from kvtier.connectors.vllm import recovery
from kvtier.core.keys import chain_hashes
from kvtier.core.restore import ChunkedRestore
from kvtier.tiers.disk import ranks
from kvtier.tiers.disk.files import SLAB_NAME, SNAPSHOT_NAME
from kvtier.tiers.disk.inspect import read_block_headers
from kvtier.tiers.disk.ranks import RankSlabs, rank_directory, rank_slabs_identity
from kvtier.tiers.disk.slab import DiskSlab
from kvtier.tiers.disk.slots import PAGE
from kvtier.tiers.disk.snapshot import write_snapshot

PREFIXES = (1, 2, 3)
TP = 2


SEAL_ENV = "KVTIER_TEST_VLLM_DISK_SEAL"


def disk_config(path, sealed: bool = False) -> dict:
    disk = {"medium": "disk", "capacity_blocks": 16, "path": str(path)}
    if sealed:
        disk.update(encryption="aes-gcm", encryption_key_env=SEAL_ENV)
    return {"placement": "write_through", "tiers": [{"medium": "host", "capacity_blocks": 4}, disk]}


class Calls:
    """Counts the calls of a function that still runs as it is: ``owner.name`` for the test's length."""

    def __init__(self, monkeypatch, owner, name: str) -> None:
        self.count = 0
        real = getattr(owner, name)

        def counted(*args, **kwargs):
            self.count += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)


@pytest.fixture
def header_reads(monkeypatch):
    """How often the scheduler side reads a rank's slot headers (``read_block_headers``)."""
    return Calls(monkeypatch, ranks, "read_block_headers")


@pytest.fixture
def scans(monkeypatch):
    """How often a worker's slab reads every slot header at open (``DiskSlab.scan``)."""
    return Calls(monkeypatch, DiskSlab, "scan")


def prefix_keys(engine, prefix: int) -> list[bytes]:
    return chain_hashes(prompt(4, 0, seed=0, prefix=prefix), BLOCK, engine.kvtier.request_namespace())


def filled(make_engine, config: dict):
    """An engine whose disk tier holds the 4 blocks of each of ``PREFIXES`` (on every rank), still open."""
    engine = make_engine(config, tp=TP)
    for p in PREFIXES:
        engine.run([engine.add(prompt(4, 5, seed=p, prefix=p), max_tokens=2)])
    assert engine.kvtier.tier("disk").usage().used == 4 * len(PREFIXES)
    engine.assert_no_leaks()
    return engine


def assert_all_back(engine) -> None:
    """Every block of ``PREFIXES`` is in the disk tier and loads back bit-exact on every rank."""
    assert engine.kvtier.tier("disk").usage().used == 4 * len(PREFIXES)
    for p in PREFIXES:
        assert held_by(engine, prefix_keys(engine, p)) == ["disk"] * 4
    for p in PREFIXES:
        assert_loads_back(engine, prompt(4, 7, seed=10 + p, prefix=p), computed=7, blocks=4)
    assert not engine.load_errors


def index_path(path) -> Path:
    return Path(path) / SNAPSHOT_NAME


def warnings_about_the_index(caplog, path) -> list[str]:
    """The warnings about the scheduler side's index (not the workers' snapshots in the rank directories)."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING
        and "index snapshot" in r.getMessage()
        and str(index_path(path)) in r.getMessage()
    ]


def test_a_clean_restart_restores_every_block_from_the_index_without_reading_a_header(
    make_engine, tmp_path, header_reads, scans, caplog
):
    path = tmp_path / "disk"
    config = disk_config(path)
    before = filled(make_engine, config)
    before.shutdown()
    assert index_path(path).is_file()
    assert all((rank_directory(path, r) / SNAPSHOT_NAME).is_file() for r in range(TP))
    header_reads.count = scans.count = 0

    caplog.set_level(logging.INFO)
    after = make_engine(config, tp=TP)
    assert (header_reads.count, scans.count) == (0, 0)  # neither side read a slot header
    assert not index_path(path).exists()  # taken: a crash from now on leaves none behind
    assert not any((rank_directory(path, r) / SNAPSHOT_NAME).exists() for r in range(TP))
    assert any("12 blocks kept from before the restart (from the index snapshot)" in m for m in caplog.messages)
    assert not warnings_about_the_index(caplog, path)
    assert_all_back(after)
    stored = {
        h for e in after.events if type(e).__name__ == "BlockStored" and e.medium == "STORAGE" for h in e.block_hashes
    }
    assert {k for p in PREFIXES for k in prefix_keys(after, p)} <= stored  # announced as the disk tier's


def test_the_index_restores_the_order_blocks_leave_in(make_engine, tmp_path, header_reads):
    """The index lists blocks oldest first, as ``Tier.restore`` takes them: a full disk tier makes room
    by dropping the oldest prefix."""
    config = disk_config(tmp_path / "disk")
    config["tiers"][1]["capacity_blocks"] = 8
    before = make_engine(config, tp=TP)
    for p in (1, 2):
        before.run([before.add(prompt(4, 5, seed=p, prefix=p), max_tokens=2)])
    before.shutdown()
    header_reads.count = 0

    after = make_engine(config, tp=TP)
    assert header_reads.count == 0 and after.kvtier.tier("disk").usage().used == 8
    after.run([after.add(prompt(4, 5, seed=3, prefix=3), max_tokens=2)])
    disk = after.kvtier.tier("disk")
    assert [disk.lookup(prefix_keys(after, p)) for p in (1, 2, 3)] == [0, 4, 4]
    assert_loads_back(after, prompt(4, 7, seed=4, prefix=2), computed=7, blocks=4)


@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "sealed"])
def test_a_crash_reads_every_ranks_headers(
    model_dir, make_engine, tmp_path, header_reads, scans, caplog, monkeypatch, sealed
):
    """Workers killed (each in a process of its own) and a scheduler side that never shut down leave
    no index and no worker snapshot: the next engine reads the headers, as before, and keeps every block
    (sealed slabs too: the scheduler side reads their headers as the workers write them)."""
    monkeypatch.setenv(SEAL_ENV, "a sealing secret for these engines")
    path = tmp_path / "disk"
    config = disk_config(path, sealed)
    crashed = Engine(model_dir, config, tp=TP, processes=True)
    for p in PREFIXES:
        crashed.run([crashed.add(prompt(4, 5, seed=p, prefix=p), max_tokens=2)])
    for worker in crashed.workers:
        os.kill(worker.process.pid, signal.SIGKILL)
        worker.process.join(30)
    assert not index_path(path).exists()
    assert not any((rank_directory(path, r) / SNAPSHOT_NAME).exists() for r in range(TP))
    header_reads.count = scans.count = 0

    caplog.set_level(logging.INFO)
    after = make_engine(config, tp=TP)
    assert (header_reads.count, scans.count) == (TP, TP)
    assert any("12 blocks kept from before the restart (from the slot headers" in m for m in caplog.messages)
    assert_all_back(after)


def rewrite_header_in_place(path, rank: int) -> None:
    """Write slot 0's header page of a rank's slab back as it is: the bytes stay, the slab's mtime moves."""
    with open(rank_directory(path, rank) / SLAB_NAME, "r+b") as f:
        f.seek(PAGE)
        page = f.read(PAGE)
        f.seek(PAGE)
        f.write(page)


def flip_a_byte(path) -> None:
    raw = bytearray(index_path(path).read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    index_path(path).write_bytes(raw)


def planted_link(path) -> None:
    """The index replaced by a link to a copy of it elsewhere: never followed."""
    elsewhere = path.parent / "elsewhere.kvt"
    os.replace(index_path(path), elsewhere)
    os.symlink(elsewhere, index_path(path))


DEFECTS = {
    "a slab written since": lambda path: rewrite_header_in_place(path, rank=1),
    "damaged": flip_a_byte,
    "writable by others": lambda path: os.chmod(index_path(path), 0o666),
    "a symbolic link": planted_link,
}


@pytest.mark.parametrize("defect", DEFECTS)
def test_an_index_that_cannot_be_used_means_one_warning_and_the_headers(
    make_engine, tmp_path, header_reads, caplog, defect
):
    path = tmp_path / "disk"
    config = disk_config(path)
    filled(make_engine, config).shutdown()
    DEFECTS[defect](path)
    header_reads.count = 0

    after = make_engine(config, tp=TP)
    assert header_reads.count == TP
    assert len(warnings_about_the_index(caplog, path)) == 1
    assert not os.path.lexists(index_path(path))  # taken, whatever it was
    assert_all_back(after)


def test_workers_closing_after_the_scheduler_side_make_its_index_stale(make_engine, tmp_path, header_reads, caplog):
    """The order vLLM does not use: the scheduler side writes its index while the workers still hold
    their slabs; their closes seal the slabs after it, so the next engine refuses the index."""
    path = tmp_path / "disk"
    config = disk_config(path)
    before = filled(make_engine, config)
    before.connector.shutdown()
    for worker in before.workers:
        worker.shutdown()
    header_reads.count = 0

    after = make_engine(config, tp=TP)
    assert header_reads.count == TP
    (warning,) = warnings_about_the_index(caplog, path)
    assert "describes another slab" in warning
    assert_all_back(after)


def engine_disk(engine) -> RankSlabs:
    """The engine's disk tier as its scheduler side restores it: its config, ranks, slots, layout, namespace."""
    side = engine.kvtier
    disk_cfg = next(t for t in side.config.tiers if t.medium == "disk")
    return RankSlabs(disk_cfg, TP, 16, engine.workers[0].connector.worker_side.layout, side.namespace.hex())


def forge_index(slabs: RankSlabs, keys: list[bytes], slots: list[int]) -> None:
    """Replace the index by one naming ``keys`` at ``slots``, valid in every other way (identity,
    checksum): what someone who can write the directory could leave."""
    identity = rank_slabs_identity(slabs.config, slabs.ranks, slabs.slots, slabs.layout, slabs.namespace)
    dir_fd = os.open(slabs.config.path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        write_snapshot(dir_fd, shared=False, identity=identity, keys=keys, slots=slots, sequence=0)
    finally:
        os.close(dir_fd)


def test_two_keys_slots_swapped_in_the_index_fail_their_loads_and_are_recomputed(make_engine, tmp_path, header_reads):
    """An index is a hint about where blocks are: one naming two blocks at each other's slots (valid in
    every other way) restores them there, and loading them fails the slot header's key check on every
    rank; vLLM recomputes them, never reads the other block's KV."""
    path = tmp_path / "disk"
    config = disk_config(path)
    before = filled(make_engine, config)
    keys = prefix_keys(before, 1)
    slots = dict(zip(*before.kvtier.tier("disk").ready_blocks(), strict=True))
    slabs = engine_disk(before)
    before.shutdown()
    slots[keys[1]], slots[keys[2]] = slots[keys[2]], slots[keys[1]]
    forge_index(slabs, list(slots), list(slots.values()))
    header_reads.count = 0

    after = make_engine(config, tp=TP)
    assert header_reads.count == 0
    assert held_by(after, keys) == ["disk"] * 4
    again = assert_recomputed_from(after, prompt(4, 7, seed=2, prefix=1), damaged=1, blocks=4, computed=3 * BLOCK + 7)
    (block_ids,) = after.scheduler.kv_cache_manager.get_block_ids(again.request_id)
    assert {block_ids[1], block_ids[2]} <= after.load_errors  # both, and KV right (blocks_match) once recomputed
    after.run([again])
    assert sum(s["failed_load_blocks"] for s in after.stats) == 2
    assert after.kvtier.tier("disk").stats.read_errors == 2
    after.assert_no_leaks()
    assert_loads_back(after, prompt(4, 3, seed=3, prefix=2), computed=3, blocks=4)  # the others are intact


def test_an_index_naming_a_key_twice_never_gives_wrong_kv(make_engine, tmp_path):
    """A forged index naming block 0 of prefix 1 again at the slot of prefix 3's last block: whatever the
    restore keeps of it, every prefix then reaches vLLM's blocks with the right KV, loaded or recomputed."""
    path = tmp_path / "disk"
    config = disk_config(path)
    before = filled(make_engine, config)
    keys, slots = before.kvtier.tier("disk").ready_blocks()
    slabs = engine_disk(before)
    before.shutdown()
    forge_index(slabs, [*keys[:-1], keys[0]], slots)

    after = make_engine(config, tp=TP)
    assert not os.path.lexists(index_path(path))
    for p in PREFIXES:
        forget_gpu(after)
        again = after.add(prompt(4, 7, seed=10 + p, prefix=p), max_tokens=2)
        step_until_scheduled(after, again)
        assert after.blocks_match(again, range(4))
        after.run([again])
    after.assert_no_leaks()


def test_a_worker_takes_its_sequence_from_its_snapshot_and_stores_after_it(make_engine, tmp_path, scans):
    """No scan at a clean restart, yet the next stores' headers carry higher sequence numbers than every
    old one (what the scheduler side's header read picks the newest copy of a block by)."""
    path = tmp_path / "disk"
    config = disk_config(path)
    before = filled(make_engine, config)
    newest = before.workers[0].connector.worker_side.storages["disk"].slab.sequence
    slabs = engine_disk(before)
    before.shutdown()
    scans.count = 0

    after = make_engine(config, tp=TP)
    assert scans.count == 0
    for worker in after.workers:
        assert worker.connector.worker_side.storages["disk"].slab.sequence == newest
    after.run([after.add(prompt(4, 5, seed=4, prefix=4), max_tokens=2)])
    new = set(prefix_keys(after, 4))
    for rank in range(TP):
        headers = read_block_headers(rank_directory(path, rank), 16, slabs.layout, slabs.namespace)
        old = [h.sequence for h in headers.values() if h.key not in new]
        fresh = [h.sequence for h in headers.values() if h.key in new]
        assert len(old) == 12 and len(fresh) == 4
        assert min(fresh) > max(old) == newest


def wait_until(condition) -> None:
    """Wait for the restore's thread to have done what ``condition`` checks (30 s at most: it failed)."""
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, "the restore never got there"
        time.sleep(0.001)


class Paced:
    """The scheduler side's restores at the test's pace: one prefix (4 blocks) per chunk, each chunk put
    back once ``release`` lets it (the restore's thread waits for that, as a slow one would)."""

    def __init__(self, monkeypatch) -> None:
        self._allowed = threading.Semaphore(0)
        self.restore: recovery.ChunksBack | None = None  # (seen at its first step)
        real = recovery.ChunksBack.step

        def step(restore):
            if restore.thread is not None:  # (one of a chunk or less runs at once, at the engine's start: not paced)
                self.restore = restore
                self._allowed.acquire(timeout=30)
            return real(restore)

        monkeypatch.setattr(ChunkedRestore, "chunk", 4)
        monkeypatch.setattr(recovery.ChunksBack, "step", step)

    def release(self, engine, prefix: int) -> None:
        """Let one more chunk go back, and wait until it is: the blocks of ``prefix`` (restored oldest first)."""
        self._allowed.release()
        wait_until(lambda: engine.kvtier.tier("disk").lookup(prefix_keys(engine, prefix)) == 4)

    def release_all(self) -> None:
        self._allowed.release(100)

    def finish(self, engine) -> None:
        """Let every chunk go back, wait until the restore has ended, and step: its last events go out."""
        self.release_all()
        wait_until(lambda: self.restore is not None and self.restore.done.is_set())
        engine.step()


@pytest.fixture
def paced(monkeypatch):
    paced = Paced(monkeypatch)
    yield paced
    paced.release_all()  # (a restore still waiting ends)


def announced(engine) -> Counter:
    """How often a BlockStored event of the engine's disk tier named each key."""
    return Counter(
        h for e in engine.events if type(e).__name__ == "BlockStored" and e.medium == "STORAGE" for h in e.block_hashes
    )


def test_a_restart_serves_at_once_and_takes_its_blocks_back_chunk_by_chunk(make_engine, tmp_path, paced):
    """The engine starts with no block back: prefix 3's request misses and is recomputed right (and stored
    again, which wins over its old copy), prefix 1 loads from disk once its chunk is back while prefix 2's
    is still a miss; every block is announced once, as its chunk comes back or by its new store."""
    config = disk_config(tmp_path / "disk")
    filled(make_engine, config).shutdown()

    after = make_engine(config, tp=TP)
    disk = after.kvtier.tier("disk")
    assert disk.usage().used == 12  # every slot claimed, no block back yet
    assert all(held_by(after, prefix_keys(after, p)) == [None] * 4 for p in PREFIXES)
    missed = after.add(prompt(4, 7, seed=20, prefix=3), max_tokens=2)
    out = step_until_scheduled(after, missed)
    assert out.num_scheduled_tokens[missed.request_id] == 4 * BLOCK + 7  # all recomputed
    assert after.blocks_match(missed, range(4))
    after.run([missed])

    paced.release(after, prefix=1)
    after.step()  # (its events go out with a step)
    assert set(announced(after)) == {*prefix_keys(after, 1), *prefix_keys(after, 3)}  # 3: by its store
    assert held_by(after, prefix_keys(after, 2)) == [None] * 4
    assert_loads_back(after, prompt(4, 7, seed=21, prefix=1), computed=7, blocks=4)

    paced.release(after, prefix=2)
    paced.release_all()  # prefix 3's chunk: its blocks are held already, so their old slots are freed
    wait_until(lambda: disk.usage().used == 12)
    after.step()
    counted = announced(after)
    assert set(counted) == {k for p in PREFIXES for k in prefix_keys(after, p)}
    assert set(counted.values()) == {1}  # once each
    for p in (2, 3):
        assert_loads_back(after, prompt(4, 7, seed=22 + p, prefix=p), computed=7, blocks=4)


def test_a_shutdown_in_the_middle_of_the_restore_keeps_every_block(make_engine, tmp_path, paced, header_reads):
    """The index a shutdown leaves lists the blocks back and those not back yet: the next start has them all."""
    config = disk_config(tmp_path / "disk")
    filled(make_engine, config).shutdown()
    halfway = make_engine(config, tp=TP)
    paced.release(halfway, prefix=1)
    halfway.shutdown()  # prefixes 2 and 3 not back
    assert index_path(tmp_path / "disk").is_file()
    header_reads.count = 0

    paced.release_all()
    after = make_engine(config, tp=TP)
    assert header_reads.count == 0
    wait_until(lambda: after.kvtier.tier("disk").lookup(prefix_keys(after, 3)) == 4)  # the last chunk
    assert_all_back(after)


# --- the restore's thread against vLLM's: every interleaving gives vLLM the tier as it is --------------
# Each test runs vLLM's work at one exact point of the restore (a chunk about to go back, a drop not yet
# told): the restore's thread waits there until vLLM's work is done, so no timing decides the order.


def restarted(make_engine, tmp_path):
    """An engine restarted over a disk tier holding ``PREFIXES`` (one chunk each, none back yet)."""
    config = disk_config(tmp_path / "disk")
    filled(make_engine, config).shutdown()
    return make_engine(config, tp=TP)


def store(engine, prefix: int) -> None:
    """vLLM's thread stores the blocks of ``prefix`` anew (not back yet: a miss, recomputed and stored)."""
    engine.run([engine.add(prompt(4, 7, seed=30 + prefix, prefix=prefix), max_tokens=2)])


def before_put_back(monkeypatch, engine, prefix: int, work) -> None:
    """Run ``work`` (vLLM's) when the restore's thread is about to put the chunk of ``prefix`` back
    into the disk tier's index, past every check it makes before: it waits there, running it."""
    disk, first = engine.kvtier.tier("disk"), prefix_keys(engine, prefix)[0]
    real = disk.restore_claimed

    def put_back(keys, slots, then=None):
        if keys[0] == first:
            work()
        return real(keys, slots, then)

    monkeypatch.setattr(disk, "restore_claimed", put_back)


def told(events) -> set[bytes]:
    """The disk tier's blocks as vLLM's KV events tell them, in order; a BlockStored of a block they
    hold already (two without a BlockRemoved between them) fails."""
    held: set[bytes] = set()
    for event in events:
        if event.medium != "STORAGE":
            continue
        if type(event).__name__ == "BlockStored":
            twice = held.intersection(event.block_hashes)
            assert not twice, f"{len(twice)} blocks announced twice without a removal between"
            held.update(event.block_hashes)
        else:
            held.difference_update(event.block_hashes)
    return held


def assert_told_as_held(engine, paced) -> None:
    """Once the restore has ended and its events are out: they name exactly the blocks the tier holds,
    none twice, and those load back."""
    paced.finish(engine)
    disk = engine.kvtier.tier("disk")
    assert told(engine.events) == set(disk.ready_keys())
    engine.assert_no_leaks()
    for p in PREFIXES:
        if held_by(engine, prefix_keys(engine, p)) == ["disk"] * 4:
            assert_loads_back(engine, prompt(4, 7, seed=40 + p, prefix=p), computed=7, blocks=4)


def test_a_store_landing_just_before_its_chunk_goes_back_is_announced_once(make_engine, tmp_path, paced, monkeypatch):
    """Prefix 3 is stored (its own BlockStored) after the restore looked at its chunk, before the chunk
    goes in: the tier keeps the stored blocks, and the chunk announces none of them again."""
    engine = restarted(make_engine, tmp_path)
    before_put_back(monkeypatch, engine, 3, lambda: store(engine, 3))
    assert_told_as_held(engine, paced)
    assert Counter(told(engine.events)) == Counter(k for p in PREFIXES for k in prefix_keys(engine, p))


def test_a_stored_block_dropped_just_before_its_chunk_goes_back_is_announced_back(
    make_engine, tmp_path, paced, monkeypatch
):
    """Prefix 3 stored anew, then dropped (BlockRemoved) after the restore looked at its chunk, before the
    chunk goes in: the chunk's blocks go in, and vLLM hears of them."""
    engine = restarted(make_engine, tmp_path)
    store(engine, 3)
    before_put_back(monkeypatch, engine, 3, engine.connector.reset_cache)
    assert_told_as_held(engine, paced)
    assert engine.kvtier.tier("disk").lookup(prefix_keys(engine, 3)) == 4  # the old blocks, back


def test_a_stored_block_dropped_before_its_chunk_comes_back_is_announced_back(make_engine, tmp_path, paced):
    """Prefix 3 stored anew and dropped (BlockRemoved) while its chunk waits: the chunk brings the old
    blocks back, and vLLM hears of them."""
    engine = restarted(make_engine, tmp_path)
    store(engine, 3)
    engine.connector.reset_cache()
    assert_told_as_held(engine, paced)
    assert engine.kvtier.tier("disk").lookup(prefix_keys(engine, 3)) == 4  # the old blocks, back


def test_a_chunk_going_back_between_a_drop_and_its_event_is_announced(make_engine, tmp_path, paced, monkeypatch):
    """Prefix 3 stored anew; vLLM's thread drops it, and before it tells the drop, every chunk goes back:
    the old blocks are in the tier after the BlockRemoved, so vLLM must hear of them after it."""
    engine = restarted(make_engine, tmp_path)
    store(engine, 3)
    disk = engine.kvtier.tier("disk")
    real = disk.evict

    def evict(n):
        dropped = real(n)
        for p in PREFIXES:
            paced.release(engine, p)
        return dropped

    monkeypatch.setattr(disk, "evict", evict)
    engine.connector.reset_cache()
    assert_told_as_held(engine, paced)
    assert engine.kvtier.tier("disk").lookup(prefix_keys(engine, 3)) == 4  # the old blocks, back


def test_a_block_dropped_after_it_went_back_and_before_its_event_is_not_announced(make_engine, tmp_path, paced):
    """Prefix 1 goes back, then vLLM drops it (BlockRemoved) before any step announced it, then stores it
    again (BlockStored): the restore's announcement of the dropped blocks never comes."""
    engine = restarted(make_engine, tmp_path)
    paced.release(engine, prefix=1)
    engine.connector.reset_cache()
    store(engine, 1)
    assert_told_as_held(engine, paced)
