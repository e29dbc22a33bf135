"""KVTierAdaptive as vLLM's CPU tier's eviction policy: vLLM's ``CachePolicy`` contract, vLLM's managers, admission.

The contract tests run against vLLM's own "lru" and "arc" as well: what they assert is what vLLM's
policies do, so a failure of ours alone is ours. Every policy is loaded the way vLLM loads it, by name
through ``CachePolicyFactory`` (ours from its module path, as a user configures it).
"""

from __future__ import annotations

import hashlib
import itertools
import mmap
import random
import uuid
from collections.abc import Iterator, Sequence

import pytest
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus
from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager, TieringOffloadingManager

from helpers.vllm_tiering import serve

MODULE = "kvtier.connectors.vllm_tiering"
POLICIES = {"lru": None, "arc": None, "KVTierAdaptive": MODULE}


def key(i: int) -> OffloadKey:
    """Block ``i``'s key as vLLM makes one: a digest (vLLM's block hashes are) and the KV cache group."""
    return make_offload_key(hashlib.sha256(i.to_bytes(8, "little")).digest(), 0)


def keys(*ids: int) -> list[OffloadKey]:
    return [key(i) for i in ids]


def context(req_id: str, chain: Sequence[OffloadKey] = ()) -> ReqContext:
    """A request's context with its keys' end tokens set, as vLLM's scheduler sets them."""
    ctx = ReqContext(req_id=req_id)
    for index, k in enumerate(chain):
        ctx.set_offload_key_position(k, (index + 1) * 16)
    return ctx


@pytest.fixture(params=list(POLICIES))
def name(request) -> str:
    return request.param


@pytest.fixture
def make(name):
    """``make(capacity)``: a fresh policy of the parametrised kind, loaded through vLLM's factory."""
    cls = CachePolicyFactory.get_cache_policy_cls(name, POLICIES[name])
    return lambda capacity=8: cls(cache_capacity=capacity)


class Chunks:
    """Drives a bare policy as vLLM's manager does: chunk ids, insert not ready, then ready or pinned."""

    def __init__(self, policy: CachePolicy) -> None:
        self.policy = policy
        self.ids = itertools.count()
        self.chunks: dict[OffloadKey, ChunkStatus] = {}

    def begin(self, ks: list[OffloadKey], ctx: ReqContext | None = None) -> None:
        """``prepare_store``: the misses are told, then inserted not ready (ref_cnt -1)."""
        ctx = ctx or context("store", ks)
        self.policy.on_store_miss(ks, ctx)
        self.policy.on_request_access(ks, ctx)
        for k in ks:
            self.chunks[k] = ChunkStatus(next(self.ids))
            self.policy.insert(k, self.chunks[k], ctx)

    def ready(self, ks: list[OffloadKey]) -> None:
        """``complete_store``: ref_cnt -1 -> 0."""
        for k in ks:
            self.chunks[k].ref_cnt = 0
            self.policy.mark_evictable(k)

    def store(self, ks: list[OffloadKey], ctx: ReqContext | None = None) -> None:
        self.begin(ks, ctx)
        self.ready(ks)

    def pin(self, k: OffloadKey) -> None:
        """``prepare_load``: one more reader; the policy hears of the first."""
        if self.chunks[k].ref_cnt == 0:
            self.policy.mark_non_evictable(k)
        self.chunks[k].ref_cnt += 1

    def unpin(self, k: OffloadKey) -> None:
        """``complete_load``: one reader less; the policy hears of the last."""
        self.chunks[k].ref_cnt -= 1
        if self.chunks[k].ref_cnt == 0:
            self.policy.mark_evictable(k)

    def resident(self, ks: list[OffloadKey]) -> list[OffloadKey]:
        return [k for k in ks if self.policy.get(k) is not None]


# --- the CachePolicy contract, as vLLM's own policies keep it ---


def test_loaded_by_name_as_users_configure_it():
    cls = CachePolicyFactory.get_cache_policy_cls("KVTierAdaptive", MODULE)
    assert issubclass(cls, CachePolicy) and cls.__name__ == "KVTierAdaptive"
    manager = CPUOffloadingManager(4, cache_policy="KVTierAdaptive", cache_policy_module_path=MODULE)
    assert type(manager._policy) is cls and manager._policy.cache_capacity == 4


def test_get_returns_the_inserted_chunk(make):
    chunks = Chunks(make())
    assert chunks.policy.get(key(0)) is None
    chunks.store(keys(0, 1))
    assert chunks.policy.get(key(0)) is chunks.chunks[key(0)]
    assert chunks.policy.get(key(1)).chunk_id == chunks.chunks[key(1)].chunk_id


def test_evict_returns_exactly_n_and_forgets_them(make):
    chunks = Chunks(make())
    chunks.store(keys(0, 1, 2, 3))
    evicted = chunks.policy.evict(2, set())
    assert evicted is not None and len(evicted) == 2
    assert len({k for k, _ in evicted}) == 2
    for k, chunk in evicted:
        assert chunk is chunks.chunks[k]
        assert chunks.policy.get(k) is None
    assert len(chunks.resident(keys(0, 1, 2, 3))) == 2
    assert chunks.policy.evict(0, set()) == []


def test_evict_is_all_or_nothing(make):
    chunks = Chunks(make())
    chunks.store(keys(0, 1, 2, 3))
    assert chunks.policy.evict(5, set()) is None
    assert chunks.policy.evict(3, set(keys(0, 1))) is None
    assert chunks.resident(keys(0, 1, 2, 3)) == keys(0, 1, 2, 3)
    # The failed calls left everything evictable: all four can still go at once.
    evicted = chunks.policy.evict(4, set())
    assert evicted is not None and {k for k, _ in evicted} == set(keys(0, 1, 2, 3))


@pytest.mark.parametrize("kept", [(0, 1), (2, 3), (0, 3), (1, 2)])
def test_protected_chunks_are_never_evicted(make, kept):
    chunks = Chunks(make())
    chunks.store(keys(0, 1, 2, 3))
    evicted = chunks.policy.evict(2, set(keys(*kept)))
    assert evicted is not None and {k for k, _ in evicted} == set(keys(0, 1, 2, 3)) - set(keys(*kept))
    assert chunks.resident(keys(*kept)) == keys(*kept)


def test_chunks_not_yet_written_are_never_evicted(make):
    chunks = Chunks(make())
    chunks.store(keys(0, 1))
    chunks.begin(keys(2, 3))  # inserted, ref_cnt -1
    assert chunks.policy.evict(3, set()) is None
    evicted = chunks.policy.evict(2, set())
    assert evicted is not None and {k for k, _ in evicted} == set(keys(0, 1))
    assert chunks.policy.evict(1, set()) is None
    chunks.ready(keys(2))
    assert [k for k, _ in chunks.policy.evict(1, set())] == keys(2)


def test_pinned_chunks_are_never_evicted_until_released(make):
    chunks = Chunks(make())
    chunks.store(keys(0, 1, 2, 3))
    chunks.pin(key(1))
    chunks.pin(key(2))
    assert chunks.policy.evict(3, set()) is None
    evicted = chunks.policy.evict(2, set())
    assert evicted is not None and {k for k, _ in evicted} == set(keys(0, 3))
    chunks.unpin(key(2))
    assert chunks.policy.evict(2, set()) is None
    assert [k for k, _ in chunks.policy.evict(1, set())] == keys(2)
    chunks.unpin(key(1))
    assert [k for k, _ in chunks.policy.evict(1, set())] == keys(1)


def test_remove_forgets_a_chunk(make):
    chunks = Chunks(make())
    chunks.store(keys(0, 1))
    chunks.begin(keys(2))
    chunks.policy.remove(key(2))  # a failed store
    chunks.policy.remove(key(0))
    assert chunks.resident(keys(0, 1, 2)) == keys(1)
    assert chunks.policy.evict(2, set()) is None
    assert [k for k, _ in chunks.policy.evict(1, set())] == keys(1)


def test_clear_forgets_everything(make):
    chunks = Chunks(make())
    chunks.store(keys(0, 1))
    chunks.begin(keys(2))
    chunks.policy.clear()
    assert chunks.resident(keys(0, 1, 2)) == []
    assert chunks.policy.evict(1, set()) is None
    chunks.store(keys(0, 5))
    assert {k for k, _ in chunks.policy.evict(2, set())} == set(keys(0, 5))


def test_unknown_and_unready_keys_are_harmless(make):
    chunks = Chunks(make())
    chunks.store(keys(0))
    chunks.begin(keys(1))
    ctx = context("unknown", keys(7, 8, 1))
    chunks.policy.touch(keys(7, 8, 1), ctx)
    chunks.policy.on_request_access(keys(7, 8), ctx)
    chunks.policy.on_request_finished((tuple(keys(7, 8, 1)),), set(keys(7)), set(keys(8)), ctx)
    assert chunks.resident(keys(0, 1, 7, 8)) == keys(0, 1)
    assert [k for k, _ in chunks.policy.evict(1, set())] == keys(0)
    assert chunks.policy.evict(1, set()) is None  # key 1 is still being written


def test_touched_chunks_outlive_untouched_ones(make):
    chunks = Chunks(make())
    for i in range(4):  # one request per block, oldest first
        chunks.store(keys(i), context(f"r{i}", keys(i)))
    chunks.policy.touch(keys(0), context("reader", keys(0)))
    evicted = chunks.policy.evict(3, set())
    assert evicted is not None and key(0) not in {k for k, _ in evicted}
    assert chunks.resident(keys(0, 1, 2, 3)) == keys(0)


def test_mark_evictable_bookkeeping_follows_the_manager(make):
    chunks = Chunks(make(capacity=4))
    chunks.store(keys(0, 1, 2, 3))
    for k in keys(0, 1, 2, 3):
        chunks.pin(k)
    assert chunks.policy.evict(1, set()) is None
    for k in keys(0, 1, 2, 3):
        chunks.pin(k)  # a second load: ref_cnt 2, no second mark
        chunks.unpin(k)  # the first load completes: still pinned
    assert chunks.policy.evict(1, set()) is None
    chunks.unpin(key(3))
    assert [k for k, _ in chunks.policy.evict(1, set())] == keys(3)


# --- vLLM's managers driving the policy ---


def cpu_manager(name: str, capacity: int) -> CPUOffloadingManager:
    return CPUOffloadingManager(capacity, cache_policy=name, cache_policy_module_path=POLICIES[name])


def test_manager_store_load_and_evict(name):
    manager = cpu_manager(name, 4)
    ctx = context("a", keys(0, 1, 2, 3))
    manager.on_new_request(ctx)
    out = manager.prepare_store(keys(0, 1, 2, 3), ctx)
    assert out is not None and out.keys_to_store == keys(0, 1, 2, 3) and out.evicted_keys == []
    assert manager.lookup(key(0), ctx) is LookupResult.HIT_PENDING
    # Full, and nothing written yet: a store has no room.
    other = context("b", keys(4))
    manager.on_new_request(other)
    assert manager.prepare_store(keys(4), other) is None
    manager.complete_store(keys(0, 1, 2, 3), ctx)
    assert [manager.lookup(k, ctx) for k in keys(0, 1, 2, 3)] == [LookupResult.HIT] * 4
    manager.on_request_finished(ctx)

    reader = context("c", keys(0, 1, 2, 3))
    manager.on_new_request(reader)
    manager.prepare_load(keys(0, 1, 2, 3), reader)
    manager.touch(keys(0, 1), reader)
    assert manager.prepare_store(keys(4), other) is None  # every chunk is pinned by the load
    manager.complete_load(keys(0, 1, 2, 3), reader)
    out = manager.prepare_store(keys(4, 5), other)
    assert out is not None and out.keys_to_store == keys(4, 5)
    assert sorted(out.evicted_keys) == sorted(keys(2, 3))  # not the touched ones
    for k in out.evicted_keys:
        assert manager.lookup(k, other) is LookupResult.MISS
    manager.complete_store(keys(4, 5), other)
    manager.on_request_finished(reader)
    manager.on_request_finished(other)
    assert [manager.lookup(k, other) for k in keys(4, 5)] == [LookupResult.HIT] * 2


@pytest.mark.parametrize("name", ["lru", "KVTierAdaptive"])
def test_manager_keeps_the_prefix_a_request_loaded_while_it_stores(name):
    """A request that loads its prefix, then stores its new blocks into a full tier, evicts other requests'
    blocks, not the prefix it just read (it is the most recent use). LRU ranks it so at first access; the
    adaptive policy applies a request's reads at the end of its run, so it keeps them out of eviction's
    choice until the request finishes. (ARC is left out: it counts accesses when a request finishes, and
    does evict part of that prefix here.)"""
    manager = cpu_manager(name, 8)
    prefix = keys(0, 1, 2, 3)
    assert serve(manager, "a", prefix) == 0
    assert serve(manager, "b", keys(10, 11, 12, 13)) == 0
    assert serve(manager, "c", prefix + keys(4, 5)) == 4
    assert [manager.lookup(k, context("x")) for k in prefix] == [LookupResult.HIT] * 4
    assert serve(manager, "d", prefix + keys(4, 5)) == 6


def test_manager_failed_store_frees_the_chunks(name):
    manager = cpu_manager(name, 2)
    ctx = context("a", keys(0, 1))
    manager.on_new_request(ctx)
    manager.prepare_store(keys(0, 1), ctx)
    manager.complete_store(keys(0, 1), ctx, success=False)
    assert [manager.lookup(k, ctx) for k in keys(0, 1)] == [LookupResult.MISS] * 2
    out = manager.prepare_store(keys(2, 3), ctx)
    assert out is not None and out.evicted_keys == []
    manager.complete_store(keys(2, 3), ctx)
    manager.on_request_finished(ctx)
    assert serve(manager, "b", keys(2, 3)) == 2


def test_manager_reset_cache(name):
    manager = cpu_manager(name, 4)
    serve(manager, "a", keys(0, 1, 2))
    manager.reset_cache()
    assert serve(manager, "b", keys(0, 1, 2)) == 0
    assert serve(manager, "c", keys(0, 1, 2)) == 3


def test_manager_random_traffic_keeps_the_contract(name):
    """Requests of shared prefixes, with loads held across requests, stores that fail or complete late,
    through vLLM's manager (its own assertions check the policy's counts): the policy evicts exactly n
    evictable, unprotected chunks whenever there are n and only then, and a chunk it reports is the one
    the manager stored."""
    rng = random.Random(7)
    manager = cpu_manager(name, 24)
    pinned: list[tuple[list[OffloadKey], ReqContext]] = []
    writing: list[tuple[list[OffloadKey], ReqContext]] = []
    live: dict[OffloadKey, ChunkStatus] = {}
    evicted = refused = 0
    evict = manager._policy.evict

    def checked_evict(n: int, protected: set[OffloadKey]):
        candidates = {k for k, chunk in live.items() if chunk.ref_cnt == 0 and k not in protected}
        victims = evict(n, protected)
        assert (victims is None) == (len(candidates) < n)
        assert victims is None or (len(victims) == n and {k for k, _ in victims} <= candidates)
        return victims

    manager._policy.evict = checked_evict
    for step in range(600):
        chain = keys(*[rng.randrange(6) * 100 + i for i in range(rng.randint(1, 10))])
        ctx = context(f"r{step}", chain)
        manager.on_new_request(ctx)
        hits = 0
        while hits < len(chain) and manager.lookup(chain[hits], ctx) is LookupResult.HIT:
            hits += 1
        if hits:
            manager.prepare_load(chain[:hits], ctx)
            pinned.append((chain[:hits], ctx))
        held = {k for ks, _ in pinned + writing for k in ks}
        out = manager.prepare_store(chain[hits:], ctx)
        refused += out is None
        if out is not None:
            evicted += len(out.evicted_keys)
            assert not set(out.evicted_keys) & (held | set(chain))
            for k in out.evicted_keys:
                assert live.pop(k).ref_cnt == 0
            for k in out.keys_to_store:
                live[k] = manager._policy.get(k)
            writing.append((out.keys_to_store, ctx))
        for queue in (pinned, writing):
            while queue and rng.random() < 0.5:
                ks, c = queue.pop(rng.randrange(len(queue)))
                if queue is pinned:
                    manager.complete_load(ks, c)
                else:
                    manager.complete_store(ks, c, success=rng.random() < 0.9)
                    for k in ks:
                        if manager._policy.get(k) is None:
                            del live[k]
        manager.on_request_finished(ctx)
        assert all(manager._policy.get(k) is chunk for k, chunk in live.items())
    assert evicted > 300 and refused > 10  # the traffic did put eviction to work, and to failure
    for ks, c in pinned:
        manager.complete_load(ks, c)
    for ks, c in writing:
        manager.complete_store(ks, c)
    serve(manager, "end", keys(0, 1, 2))
    assert serve(manager, "end again", keys(0, 1, 2)) == 3


@pytest.fixture
def region() -> Iterator[SharedOffloadRegion]:
    """The smallest shared region a primary tier can map (one page a chunk), removed afterwards."""
    made = SharedOffloadRegion(
        engine_id=f"kvtier-test-{uuid.uuid4().hex}",
        num_chunks=8,
        rank=None,
        kv_bytes_per_chunk=mmap.PAGESIZE,
        cpu_page_size=mmap.PAGESIZE,
    )
    yield made
    made.cleanup()


def test_primary_tier_of_vllm_tiering(region):
    """vLLM's tiering (no secondary tier) over a primary tier that runs the policy: requests, and the
    secondary-facing reads (``prepare_read``: a pin that is no request access)."""
    primary = CPUPrimaryTierOffloadingManager(8, region, cache_policy="KVTierAdaptive", cache_policy_module_path=MODULE)
    assert type(primary._policy).__name__ == "KVTierAdaptive"
    manager = TieringOffloadingManager(primary, [], tier_poll_interval_s=0)
    try:
        assert serve(manager, "a", keys(0, 1, 2, 3)) == 0
        assert serve(manager, "b", keys(0, 1, 2, 3, 4, 5)) == 4
        ctx = context("cascade", keys(0, 1))
        with manager.lock:
            primary.prepare_read(keys(0, 1), ctx)  # pinned for a secondary tier
            out = primary.prepare_write(keys(10, 11, 12, 13, 14, 15), ctx)
            assert out is not None and not set(out.evicted_keys) & set(keys(0, 1))
            assert primary.prepare_write(keys(20, 21), ctx) is None  # all else pinned or being written
            primary.complete_write(out.keys_to_store, ctx)
            primary.complete_read(keys(0, 1), ctx)
            out = primary.prepare_write(keys(20, 21), ctx)
            assert out is not None and len(out.evicted_keys) == 2
            primary.complete_write(keys(20, 21), ctx)
        assert serve(manager, "c", keys(20, 21)) == 2
    finally:
        manager.shutdown()


# --- the admission mapping ---


def scan_stream(chains: int, chain_len: int, scan_blocks: int, rounds: int) -> list[tuple[bool, list[OffloadKey]]]:
    """Rounds of a working set (``chains`` chains, each read once a round) then a scan of one-off chains:
    (whether the request is of the working set, its keys)."""
    ids = itertools.count()
    work = [keys(*[next(ids) for _ in range(chain_len)]) for _ in range(chains)]
    stream = []
    for _ in range(rounds):
        stream += [(True, chain) for chain in work]
        stream += [(False, keys(*[next(ids) for _ in range(chain_len)])) for _ in range(scan_blocks // chain_len)]
    return stream


def working_set_hits(name: str, capacity: int, stream: list[tuple[bool, list[OffloadKey]]]) -> list[int]:
    """The working set's prefix hits in each round."""
    manager = cpu_manager(name, capacity)
    rounds: list[int] = []
    for index, (work, chain) in enumerate(stream):
        hits = serve(manager, str(index), chain)
        if work:
            if index == 0 or not stream[index - 1][0]:
                rounds.append(0)
            rounds[-1] += hits
    return rounds


def test_a_scan_does_not_push_out_a_reused_working_set():
    """A working set of 62% of the tier read once a round, then a scan of 1.25 x the tier's one-off blocks:
    LRU and ARC lose the whole working set every round; with the filter on, the scan's blocks are stored on
    sufferance and evicted before the working set, which then hits (it is read with the filter off only at
    first, until the duel of the miniature caches has seen the scans)."""
    stream = scan_stream(chains=20, chain_len=8, scan_blocks=320, rounds=12)
    for vllm_policy in ("lru", "arc"):
        assert sum(working_set_hits(vllm_policy, 256, stream)) == 0
    rounds = working_set_hits("KVTierAdaptive", 256, stream)
    assert rounds[:3] == [0, 0, 0]  # the filter needs evidence first
    assert all(hits >= 0.9 * 160 for hits in rounds[4:]), rounds
    assert rounds[-1] == 160, rounds


def filtering() -> tuple[CPUOffloadingManager, list[OffloadKey]]:
    """A manager whose adaptive policy declines first-seen blocks, reached by the traffic alone (the scans
    above), and a chain of the working set."""
    manager = cpu_manager("KVTierAdaptive", 256)
    stream = scan_stream(chains=20, chain_len=8, scan_blocks=320, rounds=6)
    for index, (_, chain) in enumerate(stream):
        serve(manager, str(index), chain)
    assert manager._policy._policy.filtering
    return manager, stream[0][1]


def store(manager: CPUOffloadingManager, req_id: str, chain: list[OffloadKey], complete: bool = True):
    """One request that only stores ``chain`` (all of it new); its PrepareStoreOutput."""
    ctx = context(req_id, chain)
    manager.on_new_request(ctx)
    out = manager.prepare_store(chain, ctx)
    assert out is not None and out.keys_to_store == chain
    if complete:
        manager.complete_store(chain, ctx)
        manager.on_request_finished(ctx)
    return out


def test_declined_blocks_are_stored_and_evicted_first_unless_read():
    """Once the filter is on, a one-off block is still stored (vLLM stores what it is offered), but it is
    the first to go; read while resident, it joins the adaptive order and outlives later one-offs."""
    manager, work = filtering()
    one_off = keys(*range(10**6, 10**6 + 4))
    store(manager, "one-off", one_off)
    assert [manager.lookup(k, context("x")) for k in one_off] == [LookupResult.HIT] * 4
    assert serve(manager, "read", one_off[:2]) == 2  # its head is read while resident: it joins
    later = keys(*range(2 * 10**6, 2 * 10**6 + 4))
    store(manager, "later", later)
    out = store(manager, "more", keys(*range(3 * 10**6, 3 * 10**6 + 6)))
    # The unread one-offs go first, oldest first; the read head stays, and so does the working set.
    assert out.evicted_keys == one_off[2:] + later
    assert [manager.lookup(k, context("y")) for k in one_off[:2]] == [LookupResult.HIT] * 2
    assert serve(manager, "work", work) == 8


def test_blocks_on_sufferance_keep_the_contract():
    """Blocks stored on sufferance are evicted first, oldest first, but never while being written or
    protected (asked of the policy itself: through the manager, a protected resident block is read first)."""
    manager, work = filtering()
    policy = manager._policy
    writing = keys(*range(10**6, 10**6 + 2))
    store(manager, "writing", writing, complete=False)
    one_off = keys(*range(2 * 10**6, 2 * 10**6 + 4))
    store(manager, "one-off", one_off)
    protected = set(one_off[:2])
    victims = []
    while not victims or victims[-1] not in one_off:  # older one-offs of the scans go first
        evicted = policy.evict(1, protected)
        assert evicted is not None and len(victims) < 256
        victims.append(evicted[0][0])
    victims.append(policy.evict(1, protected)[0][0])
    assert victims[-2:] == one_off[2:]
    assert not set(victims) & set(writing + work)
    assert all(policy.get(k) is not None for k in writing + one_off[:2] + work)
