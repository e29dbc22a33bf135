"""Tier stack behaviour: what is stored comes back bit-exact from whichever tier holds it; lookup
reports the longest present prefix and the tier of each block; write-back demotes instead of losing
blocks, write-through copies every block down; watermarks bring usage back to the low mark; a full
or failing tier stores less or reports exactly which blocks failed; misuse raises; nothing leaks."""

import threading

import numpy as np
import pytest

from helpers.stack_helpers import (
    LAYOUT,
    assert_loaded_exact,
    assert_no_leaks,
    blocks_for,
    content,
    key,
    load,
    make_stack,
    store,
)
from kvtier.core.caller_runs import CallerRunsFuture, offering
from kvtier.core.errors import CapacityError, ClosedError, TransferError
from kvtier.core.routes import plan_route
from kvtier.core.storage import buffer_storage
from kvtier.core.tier import BlockState
from kvtier.core.transfer import CopiesHere, CopiesOffered, Transfer, TransferRegistry
from kvtier.policies import Watermark
from kvtier.transfers.cpu import CPUBackend


class FailingBackend(CPUBackend):
    """A real CPU backend whose copies touching chosen source or destination addresses raise."""

    def __init__(self, bad_addresses: set[int]):
        super().__init__(threads=1)
        self.bad = bad_addresses

    def _copy(self, copies, lo, hi):
        if any(a in self.bad for a in copies.src[lo:hi].tolist() + copies.dst[lo:hi].tolist()):
            raise OSError("injected copy failure")
        super()._copy(copies, lo, hi)


def test_store_then_load_is_bit_exact_and_lookup_names_the_tier():
    stack = make_stack()
    keys = [key(i) for i in range(5)]
    result = store(stack, keys)
    assert (result.stored, result.present, result.dropped, result.failed) == (5, 0, 0, [])
    found = stack.lookup(keys + [key(99)])
    assert found.hits == 5 and found.tiers == ("gpu",) * 5
    loaded, out = load(stack, keys)
    assert (loaded.hits, loaded.loaded, loaded.failed, loaded.per_tier) == (5, 5, [], {"gpu": 5})
    assert_loaded_exact(keys, loaded, out)
    assert_no_leaks(stack)
    stack.close()


def test_storing_present_keys_skips_them():
    stack = make_stack()
    keys = [key(i) for i in range(4)]
    store(stack, keys[:2])
    result = store(stack, keys)
    assert (result.stored, result.present) == (2, 2)
    assert stack.tiers[0].stats.committed == 4
    stack.close()


def test_lookup_and_load_stop_at_the_first_missing_block():
    stack = make_stack()
    keys = [key(i) for i in range(6)]
    store(stack, keys[:2] + keys[3:])
    assert stack.lookup(keys).hits == 2
    loaded, out = load(stack, keys)
    assert (loaded.hits, loaded.loaded) == (2, 2)
    assert_loaded_exact(keys, loaded, out)
    assert not out[2:].any(), "nothing beyond the prefix may be written"
    stack.close()


def test_write_back_demotes_instead_of_losing_blocks():
    stack = make_stack(gpu=8, host=32)
    keys = [key(i) for i in range(30)]
    for i in range(0, 30, 5):
        store(stack, keys[i : i + 5])
    stack.wait_idle()
    gpu, host = stack.tiers
    assert gpu.usage().used == 8 and host.usage().used == 22
    assert gpu.stats.demoted == 22 and host.stats.committed == 22
    found = stack.lookup(keys)
    assert found.hits == 30
    assert found.tiers == ("host",) * 22 + ("gpu",) * 8  # LRU: the oldest went down
    loaded, out = load(stack, keys)
    assert loaded.loaded == 30 and loaded.per_tier == {"host": 22, "gpu": 8}
    assert_loaded_exact(keys, loaded, out)
    assert_no_leaks(stack)
    stack.close()


def test_write_through_copies_every_block_down_and_evicts_without_demotion():
    stack = make_stack(gpu=4, host=32, placement="write_through")
    keys = [key(i) for i in range(12)]
    for i in range(0, 12, 4):
        store(stack, keys[i : i + 4])
        stack.wait_idle()  # the eager copies land before the next store evicts
    gpu, host = stack.tiers
    assert host.lookup(keys) == 12
    assert gpu.stats.demoted == 0 and gpu.stats.evicted == 8
    loaded, out = load(stack, keys)
    assert loaded.per_tier == {"host": 8, "gpu": 4}
    assert_loaded_exact(keys, loaded, out)
    assert_no_leaks(stack)
    stack.close()


def test_write_through_loses_nothing_when_eviction_overtakes_the_eager_copy():
    stack = make_stack(gpu=4, host=32, placement="write_through")
    keys = [key(i) for i in range(16)]
    for i in range(0, 16, 4):
        store(stack, keys[i : i + 4])  # no waiting: a victim may not have been copied down yet
    stack.wait_idle()
    assert stack.tiers[1].lookup(keys) == 16
    loaded, out = load(stack, keys)
    assert loaded.loaded == 16
    assert_loaded_exact(keys, loaded, out)
    assert_no_leaks(stack)
    stack.close()


def test_watermark_brings_usage_down_to_the_low_mark_in_the_background():
    stack = make_stack(gpu=10, host=40, gpu_watermark=Watermark(high=0.8, low=0.5))
    keys = [key(i) for i in range(9)]
    store(stack, keys)
    stack.wait_idle()
    gpu, host = stack.tiers
    assert gpu.usage().used == 5, "9 > 0.8 * 10, so down to 0.5 * 10"
    assert gpu.stats.demoted == 4 and host.usage().used == 4
    loaded, out = load(stack, keys)
    assert loaded.loaded == 9
    assert_loaded_exact(keys, loaded, out)
    stack.close()


def test_last_tier_drops_when_full():
    stack = make_stack(gpu=2, host=4)
    keys = [key(i) for i in range(10)]
    for k in keys:
        store(stack, [k])
    stack.wait_idle()
    assert stack.tiers[1].stats.evicted == 4
    found = stack.lookup(keys[::-1])  # the newest six are still there
    assert found.hits == 6
    assert_no_leaks(stack)
    stack.close()


def test_a_store_larger_than_the_first_tier_raises_and_changes_nothing():
    stack = make_stack(gpu=4)
    with pytest.raises(CapacityError, match="can never fit"):
        store(stack, [key(i) for i in range(5)])
    assert stack.tiers[0].usage().used == 0
    assert_no_leaks(stack)
    stack.close()


def test_a_full_tier_of_pinned_blocks_stores_less_and_does_not_crash():
    stack = make_stack(gpu=4, host=4)
    pinned = [key(i) for i in range(4)]
    store(stack, pinned)
    stack.tiers[0].pin(pinned)
    result = store(stack, [key(10), key(11)])
    assert (result.stored, result.dropped) == (0, 2)
    stack.tiers[0].unpin(pinned)
    result = store(stack, [key(10), key(11)])
    assert result.stored == 2
    assert_no_leaks(stack)
    stack.close()


@pytest.mark.parametrize("now", [False, True], ids=["store", "store_now"])
def test_failed_store_copies_commit_only_what_landed(now):
    keys = [key(i) for i in range(4)]
    src = blocks_for(keys)
    bad = {int(buffer_storage(src, LAYOUT).fragment_addresses([2])[0, 0])}
    stack = make_stack(gpu=8, backend=FailingBackend(bad))
    source = buffer_storage(src, LAYOUT)
    result = stack.store_now(keys, source, range(4), 10) if now else stack.store(keys, source, range(4)).result(10)
    assert result.stored == 3 and result.failed == [keys[2]]
    gpu = stack.tiers[0]
    assert gpu.state(keys[2]) is BlockState.FREE and gpu.stats.aborted == 1
    assert stack.lookup(keys).hits == 2
    assert_no_leaks(stack)
    stack.close()


class RecordingBackend(CPUBackend):
    """A real CPU backend that records the names of the threads its copies ran on."""

    def __init__(self):
        super().__init__(threads=2)
        self.ran_on: set[str] = set()

    def _copy(self, copies, lo, hi):
        self.ran_on.add(threading.current_thread().name)
        super()._copy(copies, lo, hi)


def test_store_now_and_load_now_copy_on_the_calling_thread():
    """A caller that waits anyway runs the first tier's memmoves itself; ``store().result()`` and
    ``load().result()`` leave them to the copy threads."""
    backend = RecordingBackend()
    stack = make_stack(gpu=8, backend=backend)
    keys = [key(i) for i in range(6)]
    result = stack.store_now(keys[:3], buffer_storage(blocks_for(keys[:3]), LAYOUT), range(3), timeout=30)
    assert (result.stored, result.present, result.failed) == (3, 0, [])
    here = threading.current_thread().name
    assert backend.ran_on == {here}
    out = np.zeros((3, LAYOUT.block_bytes), np.uint8)
    loaded = stack.load_now(keys[:3], buffer_storage(out, LAYOUT, writable=True), range(3), timeout=30)
    assert (loaded.hits, loaded.loaded, loaded.failed) == (3, 3, [])
    assert_loaded_exact(keys, loaded, out)
    assert backend.ran_on == {here}
    backend.ran_on.clear()
    store(stack, keys[3:])
    load(stack, keys[3:])
    assert backend.ran_on and here not in backend.ran_on, (
        "store().result() and load().result() leave them to copy threads"
    )
    assert_no_leaks(stack)
    stack.close()


def test_a_copy_offered_to_a_caller_that_lets_go_runs_on_the_copy_threads():
    """``CopiesOffered``: a memmove offered to a waiting caller runs when it asks for the result, and on
    a copy thread once its future is released instead; where nobody collects offers, at once."""
    backend = RecordingBackend()
    transfers = TransferRegistry([backend])
    offered = CopiesOffered(CopiesHere(transfers))
    src = blocks_for([key(1), key(2)])
    done: list[set[int]] = []
    landed = threading.Event()

    def copy_into(dst):
        transfer = Transfer(buffer_storage(src, LAYOUT), [0, 1], buffer_storage(dst, LAYOUT, writable=True), [0, 1])
        offered.submit(transfer, lambda failed, quarantine=None: (done.append(failed), landed.set()))

    future = CallerRunsFuture(here=True)
    dst = np.zeros_like(src)
    with offering(future):
        copy_into(dst)
    assert not dst.any() and not done, "offered, not copied yet"
    future.release()
    assert landed.wait(10) and done == [set()] and np.array_equal(dst, src)
    assert backend.ran_on and threading.current_thread().name not in backend.ran_on
    landed.clear()
    backend.ran_on.clear()
    dst = np.zeros_like(src)
    copy_into(dst)  # (no future collects offers: straight to the backend)
    assert landed.wait(10) and np.array_equal(dst, src)
    assert backend.ran_on and threading.current_thread().name not in backend.ran_on
    backend.close()


def test_failed_load_reports_exactly_the_failed_blocks_and_releases_pins():
    failing = FailingBackend(set())  # copies fail once ``failing.bad`` names an address
    stack = make_stack(gpu=8, backend=failing)
    keys = [key(i) for i in range(4)]
    store(stack, keys)
    gpu = stack.tiers[0]
    bad_slot = gpu.slots([keys[1]])[0]
    failing.bad.update(int(a) for a in gpu.storage.fragment_addresses([bad_slot])[0])
    loaded, out = load(stack, keys)
    assert loaded.failed == [1] and loaded.loaded == 3
    assert_loaded_exact(keys, loaded, out)
    assert gpu.stats.hits == 3 and gpu.stats.read_errors == 1  # a hit is a block that arrived
    assert_no_leaks(stack)
    stack.close()


def test_a_load_staged_through_another_tier_caches_it_there():
    """Force host -> caller through the GPU tier, the shape a disk -> host -> GPU load takes."""

    def route_via_gpu(src, dst, caps):
        return ("host", "gpu", "host") if src == "host" else plan_route(src, dst, caps)

    stack = make_stack(gpu=4, host=16, route=route_via_gpu)
    keys = [key(i) for i in range(8)]
    store(stack, keys[:4])
    store(stack, keys[4:])  # pushes the first four down to the host tier
    stack.wait_idle()
    assert stack.lookup(keys).tiers == ("host",) * 4 + ("gpu",) * 4
    loaded, out = load(stack, keys[:4])
    assert loaded.loaded == 4 and loaded.failed == []
    assert_loaded_exact(keys[:4], loaded, out)
    assert stack.tiers[0].lookup(keys[:4]) == 4, "the staged blocks are cached in the GPU tier"
    assert_no_leaks(stack)
    stack.close()


def test_a_write_through_of_staged_blocks_the_lower_tier_holds_evicts_nothing_there():
    """Blocks staged through the GPU tier on their way from the host tier are copied down again by
    write-through: the host tier holds them already, so no room is made there (nothing evicted)."""

    def route_via_gpu(src, dst, caps):
        return ("host", "gpu", "host") if src == "host" else plan_route(src, dst, caps)

    stack = make_stack(gpu=2, host=4, placement="write_through", route=route_via_gpu)
    keys = [key(i) for i in range(4)]
    store(stack, keys[:2])
    store(stack, keys[2:])  # the host tier is full: all four there, the last two in the GPU tier too
    stack.wait_idle()
    assert stack.tiers[1].lookup(keys) == 4
    loaded, out = load(stack, keys[:2])  # staged through the GPU tier, then copied down by write-through
    stack.wait_idle()
    assert loaded.loaded == 2
    assert_loaded_exact(keys[:2], loaded, out)
    assert stack.tiers[1].lookup(keys) == 4 and stack.tiers[1].stats.evicted == 0
    assert_no_leaks(stack)
    stack.close()


def test_concurrent_stores_and_loads_stay_bit_exact():
    stack = make_stack(gpu=16, host=64, gpu_watermark=Watermark(0.9, 0.6))
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(40):
                start = int(rng.integers(0, 60))
                keys = [key(i) for i in range(start, start + int(rng.integers(1, 8)))]
                if rng.random() < 0.5:
                    store(stack, keys)
                else:
                    loaded, out = load(stack, keys)
                    assert_loaded_exact(keys, loaded, out)
        except Exception as exc:  # reported to the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert_no_leaks(stack)
    stack.close()


def test_a_closed_stack_refuses_everything():
    stack = make_stack()
    store(stack, [key(0)])
    stack.close()
    stack.close()  # idempotent
    with pytest.raises(ClosedError):
        stack.lookup([key(0)])
    with pytest.raises(ClosedError):
        store(stack, [key(1)])
    with pytest.raises(ClosedError):
        load(stack, [key(0)])


def test_a_backend_that_cannot_reach_a_tier_is_refused_at_build():
    class HostOnly(CPUBackend):
        pairs = frozenset()

    with pytest.raises(TransferError, match="can copy cpu -> cpu between tier 'gpu' and tier 'host'"):
        make_stack(backend=HostOnly())


def test_mismatched_key_and_slot_counts_raise():
    stack = make_stack()
    with pytest.raises(ValueError, match="2 keys but 1 source slots"):
        stack.store([key(0), key(1)], buffer_storage(blocks_for([key(0)]), LAYOUT), [0])
    stack.close()


def test_stats_count_bytes_and_hits():
    stack = make_stack(gpu=8)
    keys = [key(i) for i in range(3)]
    store(stack, keys)
    load(stack, keys)
    s = stack.stats()["gpu"]
    assert s["bytes_in"] == 3 * LAYOUT.block_bytes and s["bytes_out"] == 3 * LAYOUT.block_bytes
    assert s["hits"] == 3 and s["used"] == 3 and s["capacity"] == 8
    assert content(keys[0]).nbytes == LAYOUT.block_bytes
    stack.close()


def test_storing_keys_a_lower_tier_holds_copies_nothing():
    stack = make_stack(gpu=4, host=16)
    keys = [key(i) for i in range(8)]
    store(stack, keys[:4])
    store(stack, keys[4:])  # the first four are demoted to host memory
    stack.wait_idle()
    committed = stack.tiers[0].stats.committed
    result = store(stack, keys)
    assert (result.stored, result.present) == (0, 8)
    assert stack.tiers[0].stats.committed == committed
    stack.close()


def test_a_store_waits_for_room_on_its_way_from_demotions_further_down(tmp_path):
    """Stores back to back into a full GPU tier over a full host tier over a disk tier with room: each
    store's room comes from demotions host -> disk still in flight, and the store waits for them
    rather than dropping its blocks (found by tests/gpu/test_cuda_stack.py on an H200)."""
    from kvtier import KVTier

    block = 64 * 1024
    config = {
        "block_tokens": 16,
        "block_bytes": block,
        "fragments": 8,
        "tiers": [
            {"medium": "gpu", "capacity_blocks": 32, "watermark": {"high": 0.9, "low": 0.6}},
            {"medium": "host", "capacity_blocks": 64},
            {"medium": "disk", "path": str(tmp_path / "disk"), "capacity_blocks": 256},
        ],
    }
    rng = np.random.default_rng(3)
    prompts = [list(range(p * 10_000, p * 10_000 + 16 * 8)) for p in range(24)]
    data = [rng.integers(0, 256, (8, block), dtype=np.uint8) for _ in prompts]
    with KVTier.open(config) as kv:
        for tokens, blocks in zip(prompts, data, strict=True):
            assert kv.store(tokens, blocks).result(60).stored == 8  # no waiting in between
        kv.wait_idle()
        for tokens, blocks in zip(prompts, data, strict=True):
            out = np.zeros_like(blocks)
            assert kv.load(tokens, out).result(60).loaded == 8
            assert np.array_equal(out, blocks)
