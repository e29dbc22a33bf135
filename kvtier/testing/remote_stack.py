"""``RemoteStackTests``: a whole stack over a shared store (``KVTier``: a host tier, maybe a disk tier, then
the remote tier), against a real store, its faults injected by killing and restarting the store's servers.

A subclass provides the class-scoped fixture ``store_class``, a ``kvtier.testing.store.StoreUnderTest``
subclass, as for ``StoreClientTests``.

What it shows: blocks round-trip bit-exact between stacks (with or without a disk tier between) and
between processes through the store, and a local hit never asks the store; placed write-back, the store
gets only the host tier's victims; another namespace finds nothing, not even its name's record copied from
another namespace; a record damaged, truncated, lengthened, foreign, or (with auth on) unsigned or signed
with another secret is a miss, and the block is recomputed and stored again; a missing MAC secret opens
nothing; sealed records (``encryption: aes-gcm``) hold none of a block's bytes, round-trip, and do not
open when moved to another key, changed, read plain or under another secret (a previous secret opens them
during a rotation, and never seals); a dead store fails exactly the blocks it was to serve, within the
timeout, and local hits go on; after a restart the store is empty, then fills again; the store's own
eviction never yields wrong bytes; two tenants sending one prompt never hit each other's sealed records.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kvtier.api import KVTier
from kvtier.core.errors import ConfigError
from kvtier.testing.common import assert_clean
from kvtier.testing.store import StoreSuite
from kvtier.tiers.remote.record import HEADER_BYTES, RecordHeader

BLOCK = 64 * 1024
TOKENS = 16
TIMEOUT = 2.0
WAIT = 30.0
"""Seconds any future here may take; a test that hits it fails instead of hanging."""


def prompt(n: int, start: int = 0) -> list[int]:
    """Token ids of ``n`` full blocks; ``start`` makes another prompt."""
    return list(range(start * 1000, start * 1000 + TOKENS * n))


def data(n: int, seed: int = 0, block: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, block), dtype=np.uint8)


def stored(config: dict, tokens: list[int], blocks: np.ndarray) -> dict:
    """Store ``blocks`` through a stack of its own and wait until they reached the store; its stats."""
    with KVTier.open(config) as kv:
        assert kv.store(tokens, blocks).result(WAIT).stored == len(blocks)
        kv.wait_idle(WAIT)
        return kv.stats()


def load(kv: KVTier, tokens_or_keys: list[int] | list[bytes], n: int, block: int = BLOCK):
    out = np.zeros((n, block), np.uint8)
    return kv.load(tokens_or_keys, out).result(WAIT), out


def remote(kv: KVTier):
    return kv.stack.tiers[-1]


def record_names(kv: KVTier, tokens: list[int]) -> list[str]:
    return [remote(kv).records[0].name(key) for key in kv.keys(tokens)]


def held_runs(store, kv: KVTier, keys: list[bytes], longest: int) -> list[list[int]]:
    """The indices of the ``keys`` whose records ``store`` holds now, in runs of consecutive ones of up to
    ``longest`` (eviction leaves holes in every prefix, a load stops at the first, and stages through a
    host tier of ``longest`` blocks)."""
    held = store.holds([remote(kv).records[0].name(key) for key in keys])
    runs: list[list[int]] = []
    for i, here in enumerate(held):
        if here and runs and runs[-1][-1] == i - 1 and len(runs[-1]) < longest:
            runs[-1].append(i)
        elif here:
            runs.append([i])
    return runs


CHILD = """
import json, sys
import numpy as np
from kvtier import KVTier
config, n = json.loads(sys.argv[1]), int(sys.argv[2])
blocks = np.random.default_rng(5).integers(0, 256, (n, config["block_bytes"]), dtype=np.uint8)
with KVTier.open(config) as kv:
    result = kv.store(list(range(config["block_tokens"] * n)), blocks).result(30)
    kv.wait_idle(30)
    print(json.dumps({"stored": result.stored, "in_store": kv.stats()["remote"]["committed"]}))
"""
"""A process of its own that stores blocks through a stack of ``config`` and prints what it stored."""


class RemoteStackTests(StoreSuite):
    """A stack over a store; a subclass provides ``store_class``."""

    @pytest.fixture
    def config(self, request, tmp_path):
        """``config(store, **options)``: a stack config dict over ``store``, its records named under a prefix of
        the test's own (a store is shared by the tests that do it no harm)."""
        prefix = "t-" + "".join(c if c.isalnum() else "-" for c in request.node.name)[-80:]

        def make(
            store,
            host: int = 16,
            disk: str | None = None,
            namespace: str = "model-a",
            auth_env: str | None = None,
            placement: str = "write_through",
            block: int = BLOCK,
            seal_env: str | None = None,
            previous_seal_env: str | None = None,
        ) -> dict:
            tiers: list[dict] = [{"medium": "host", "capacity_blocks": host}]
            if disk is not None:
                tiers.append({"medium": "disk", "path": str(tmp_path / disk), "capacity_blocks": 32})
            remote = store.tier(timeout=TIMEOUT, placement=placement, prefix=prefix)
            if auth_env is not None:
                remote["auth_key_env"] = auth_env
            if seal_env is not None:
                remote.update(encryption="aes-gcm", encryption_key_env=seal_env)
            if previous_seal_env is not None:
                remote["encryption_previous_key_env"] = previous_seal_env
            return {"block_bytes": block, "block_tokens": TOKENS, "namespace": namespace, "tiers": [*tiers, remote]}

        return make

    # --- sharing -------------------------------------------------------------------------------------

    @pytest.mark.parametrize("disk", [None, "disk"], ids=["host", "host-disk"])
    def test_blocks_round_trip_between_stacks_through_the_store(self, config, store, disk):
        tokens, blocks = prompt(8), data(8)
        stats = stored(config(store, disk=None if disk is None else "writer-disk"), tokens, blocks)
        assert stats["remote"]["committed"] == 8
        with KVTier.open(config(store, disk=None if disk is None else "reader-disk")) as kv:
            assert store.holds(record_names(kv, tokens)) == [True] * 8
            assert kv.locate(tokens).tiers == ("remote",) * 8
            result, out = load(kv, tokens, 8)
            assert (result.loaded, result.failed, result.per_tier) == (8, [], {"remote": 8})
            assert np.array_equal(out, blocks)
            asked = store.existence_queries()
            if kv.stack.tiers[-1].loads_direct:  # fetched straight into the caller's host memory, which holds it
                assert kv.locate(tokens).tiers == ("remote",) * 8
            else:  # staged through host memory, kept there
                assert kv.locate(tokens).tiers == ("host",) * 8
            assert store.existence_queries() == asked  # a local hit, or one the store answered lately, asks nothing
            assert kv.stats()["remote"]["hits"] == 8
            assert_clean(kv)

    def test_placed_write_back_the_store_gets_the_host_tiers_victims_only(self, config, store):
        first, second = prompt(4), prompt(4, start=1)
        blocks = data(4)
        with KVTier.open(config(store, host=4, placement="write_back")) as kv:
            kv.store(first, blocks).result(WAIT)
            kv.wait_idle(WAIT)
            assert store.holds(record_names(kv, first)) == [False] * 4  # nothing is copied while the host keeps it
            kv.store(second, data(4, seed=1)).result(WAIT)  # pushes the first prompt out of host memory
            kv.wait_idle(WAIT)
            assert kv.stats()["host"]["demoted"] == 4 and kv.stats()["remote"]["committed"] == 4
            assert store.holds(record_names(kv, first + second)) == [True] * 4 + [False] * 4
        with KVTier.open(config(store)) as fresh:
            assert fresh.lookup(second) == 0
            result, out = load(fresh, first, 4)
            assert result.loaded == 4 and np.array_equal(out, blocks)

    def test_two_processes_with_the_same_config_share_blocks(self, config, store):
        cfg = config(store)
        child = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(cfg), "6"], capture_output=True, text=True, timeout=120
        )
        assert child.returncode == 0, child.stderr[-2000:]
        assert json.loads(child.stdout) == {"stored": 6, "in_store": 6}
        with KVTier.open(cfg) as kv:
            result, out = load(kv, prompt(6), 6)
            assert result.loaded == 6 and np.array_equal(out, data(6, seed=5))

    def test_another_namespace_finds_nothing_not_even_under_a_copied_name(self, config, store):
        tokens, blocks = prompt(4), data(4)
        stored(config(store, namespace="model-a"), tokens, blocks)
        with KVTier.open(config(store, namespace="model-a")) as a, KVTier.open(config(store, namespace="model-b")) as b:
            keys = a.keys(tokens)
            assert b.lookup(tokens) == 0 and b.lookup(keys) == 0  # its names differ, even for the same keys
            size = HEADER_BYTES + BLOCK
            ours, theirs = remote(a).records[0].name(keys[0]), remote(b).records[0].name(keys[0])
            store.write(theirs, store.read(ours, size))  # model-a's record under model-b's name
            assert b.lookup(keys) == 1
            result, _ = load(b, keys, 4)
            assert (result.hits, result.failed) == (1, [0])  # its header names another namespace: a miss
            assert b.stats()["remote"]["read_errors"] == 1
            mine = data(4, seed=9)  # model-b's own bytes for these keys, computed again and stored over it
            assert b.store(keys, mine).result(WAIT).stored == 4
            b.wait_idle(WAIT)
        with KVTier.open(config(store, namespace="model-b")) as b, KVTier.open(config(store, namespace="model-a")) as a:
            for kv, expected in ((b, mine), (a, blocks)):
                result, out = load(kv, keys, 4)
                assert result.loaded == 4 and np.array_equal(out, expected)

    # --- damaged and forged records ------------------------------------------------------------------

    def test_a_damaged_truncated_or_lengthened_record_is_a_miss_and_the_block_is_recomputed(self, config, store):
        tokens, blocks = prompt(5), data(5)
        stored(config(store), tokens, blocks)
        with KVTier.open(config(store)) as kv:
            names = record_names(kv, tokens)
            size = HEADER_BYTES + BLOCK
            whole = store.read(names[3], size)
            store.write(names[1], b"\xff" * size)  # garbage of the right size
            store.write(names[2], whole[:-1])  # truncated
            store.write(names[3], whole + b"\x00" * 4096)  # a whole record, and more after it
            result, out = load(kv, tokens, 5)
            assert result.failed == [1, 2, 3]
            assert np.array_equal(out[0], blocks[0]) and np.array_equal(out[4], blocks[4])
            assert kv.lookup(tokens) == 1  # failed loads are forgotten: a miss from block 1 on
            recomputed = kv.store(tokens, blocks).result(WAIT)  # what the engine does: compute again, store
            assert recomputed.stored == 3  # blocks 1 to 3; 0 and 4 are in host memory already
            kv.wait_idle(WAIT)
        with KVTier.open(config(store)) as fresh:
            result, out = load(fresh, tokens, 5)
            assert result.loaded == 5 and np.array_equal(out, blocks)

    def test_with_auth_on_records_without_the_secret_or_with_another_are_misses(self, config, store, monkeypatch):
        monkeypatch.setenv("KVTIER_TEST_MAC", "first-secret-0123456789")
        monkeypatch.setenv("KVTIER_TEST_OTHER_MAC", "second-secret-0123456789")
        tokens, blocks = prompt(3), data(3)
        stored(config(store), tokens, blocks)  # written without a MAC
        with KVTier.open(config(store, auth_env="KVTIER_TEST_MAC")) as signed:
            result, _ = load(signed, tokens, 3)
            assert (result.hits, result.loaded) == (3, 0)  # found, refused
            assert signed.store(tokens, blocks).result(WAIT).stored == 3  # recomputed, stored signed
            signed.wait_idle(WAIT)
        with KVTier.open(config(store, auth_env="KVTIER_TEST_OTHER_MAC")) as other:
            result, _ = load(other, tokens, 3)
            assert (result.hits, result.loaded) == (3, 0)
        with KVTier.open(config(store, auth_env="KVTIER_TEST_MAC")) as same:
            result, out = load(same, tokens, 3)
            assert result.loaded == 3 and np.array_equal(out, blocks)

    def test_a_missing_mac_secret_opens_nothing(self, config, store, monkeypatch):
        monkeypatch.delenv("KVTIER_TEST_MAC", raising=False)
        threads = threading.active_count()
        with pytest.raises(ConfigError, match="^auth_key_env: the environment variable KVTIER_TEST_MAC is unset"):
            KVTier.open(config(store, auth_env="KVTIER_TEST_MAC"))
        assert threading.active_count() <= threads  # no thread of the stack was left behind

    # --- sealed records ------------------------------------------------------------------------------

    @pytest.fixture
    def seal_secrets(self, monkeypatch):
        monkeypatch.setenv("KVTIER_TEST_SEAL", "first sealing secret, 32 bytes!")
        monkeypatch.setenv("KVTIER_TEST_OTHER_SEAL", "second sealing secret, 32 bytes")

    def test_sealed_records_hold_none_of_the_blocks_bytes_and_round_trip(self, config, store, seal_secrets):
        tokens, blocks = prompt(4), data(4)
        stats = stored(config(store, seal_env="KVTIER_TEST_SEAL"), tokens, blocks)
        assert stats["remote"]["committed"] == 4
        with KVTier.open(config(store, seal_env="KVTIER_TEST_SEAL")) as kv:
            for name, block in zip(record_names(kv, tokens), blocks, strict=True):
                raw = store.read(name, HEADER_BYTES + BLOCK)
                assert raw is not None and block[:64].tobytes() not in raw and block[-64:].tobytes() not in raw
            result, out = load(kv, tokens, 4)
            assert (result.loaded, result.failed) == (4, []) and np.array_equal(out, blocks)
            assert_clean(kv)

    @pytest.mark.parametrize("change", ["key in the header", "ciphertext byte", "seal byte"])
    def test_a_sealed_record_moved_to_another_key_or_changed_does_not_open(self, config, store, seal_secrets, change):
        """The header's own checksum is rewritten to match, so only the seal can tell: it binds the header's
        fields (namespace, key, lengths) and the bytes."""
        tokens, blocks = prompt(2), data(2)
        cfg = config(store, seal_env="KVTIER_TEST_SEAL")
        stored(cfg, tokens, blocks)
        with KVTier.open(cfg) as kv:
            keys, names = kv.keys(tokens), record_names(kv, tokens)
            raw = bytearray(store.read(names[0], HEADER_BYTES + BLOCK))
            header = RecordHeader.unpack(bytes(raw[:HEADER_BYTES]))
            assert header is not None
            if change == "key in the header":  # block 0's record, relabelled as block 1's, under block 1's name
                raw[:HEADER_BYTES] = dataclasses.replace(header, key=keys[1]).pack()
                target = names[1]
            else:
                at = {"ciphertext byte": HEADER_BYTES + 777, "seal byte": None}[change]
                if at is None:
                    raw[:HEADER_BYTES] = dataclasses.replace(
                        header, mac=header.mac[:-1] + bytes([header.mac[-1] ^ 1])
                    ).pack()
                else:
                    raw[at] ^= 0x01
                target = names[0]
            store.write(target, bytes(raw))
            broken = names.index(target)
            result, out = load(kv, tokens, 2)
            assert result.failed == [broken] and not out[broken].any()  # nothing of it reached the caller
            assert kv.stats()["remote"]["read_errors"] == 1

    def test_sealed_and_plain_records_and_another_secret_are_misses(self, config, store, seal_secrets):
        tokens, blocks = prompt(3), data(3)
        stored(config(store), tokens, blocks)  # plain records
        with KVTier.open(config(store, seal_env="KVTIER_TEST_SEAL")) as sealed:
            result, _ = load(sealed, tokens, 3)
            assert (result.hits, result.loaded) == (3, 0)  # found, refused: this tier seals
            assert sealed.store(tokens, blocks).result(WAIT).stored == 3  # recomputed, stored sealed
            sealed.wait_idle(WAIT)
        for other in (config(store), config(store, seal_env="KVTIER_TEST_OTHER_SEAL")):
            with KVTier.open(other) as kv:
                result, out = load(kv, tokens, 3)
                assert (result.hits, result.loaded) == (3, 0) and not out.any()

    def test_a_previous_secret_opens_during_a_rotation_and_new_records_take_the_current(
        self, config, store, seal_secrets
    ):
        old, new = prompt(2), prompt(2, start=1)
        stored(config(store, seal_env="KVTIER_TEST_OTHER_SEAL"), old, data(2))
        rotating = config(store, seal_env="KVTIER_TEST_SEAL", previous_seal_env="KVTIER_TEST_OTHER_SEAL")
        with KVTier.open(rotating) as kv:
            result, out = load(kv, old, 2)
            assert result.loaded == 2 and np.array_equal(out, data(2))
            assert kv.store(new, data(2, seed=1)).result(WAIT).stored == 2
            kv.wait_idle(WAIT)
        with KVTier.open(config(store, seal_env="KVTIER_TEST_SEAL")) as current:
            result, out = load(current, new, 2)
            assert result.loaded == 2 and np.array_equal(out, data(2, seed=1))
        with KVTier.open(config(store, seal_env="KVTIER_TEST_OTHER_SEAL")) as previous:
            assert load(previous, new, 2)[0].loaded == 0  # the previous secret never sealed

    def test_a_missing_sealing_secret_is_one_error_at_start(self, config, store, monkeypatch):
        monkeypatch.delenv("KVTIER_TEST_SEAL", raising=False)
        with pytest.raises(
            ConfigError, match="^encryption_key_env: the environment variable KVTIER_TEST_SEAL is unset"
        ):
            KVTier.open(config(store, seal_env="KVTIER_TEST_SEAL"))

    # --- a store that fails --------------------------------------------------------------------------

    def test_a_dead_store_fails_exactly_its_blocks_within_the_timeout_and_local_hits_go_on(self, config, fresh_store):
        tokens, blocks = prompt(8), data(8)
        stored(config(fresh_store), tokens, blocks)
        with KVTier.open(config(fresh_store)) as kv:
            assert kv.store(tokens[: 2 * TOKENS], blocks[:2]).result(WAIT).stored == 2  # blocks 0 and 1 in host memory
            assert kv.locate(tokens).tiers == ("host",) * 2 + ("remote",) * 6
            fresh_store.kill()
            started = time.monotonic()
            result, out = load(kv, tokens, 8)
            assert (result.loaded, result.failed) == (2, [2, 3, 4, 5, 6, 7])
            assert time.monotonic() - started < TIMEOUT + 1.0
            assert np.array_equal(out[:2], blocks[:2])
            started = time.monotonic()
            assert kv.lookup(tokens) == 2 and time.monotonic() - started < TIMEOUT + 1.0  # a dead store: a miss
            result, out = load(kv, tokens, 8)
            assert (result.hits, result.loaded) == (2, 2) and np.array_equal(out[:2], blocks[:2])
            assert_clean(kv)

    def test_after_a_restart_the_store_is_empty_and_new_stores_land_and_hit(self, config, fresh_store):
        before, after, blocks = prompt(4), prompt(4, start=5), data(4, seed=5)
        stored(config(fresh_store), before, data(4))
        with KVTier.open(config(fresh_store)) as kv:
            assert kv.lookup(before) == 4  # the store's answer counts for a few seconds...
            fresh_store.restart()
            result, _ = load(kv, before, 4)
            assert (result.hits, result.loaded) == (4, 0)  # ...so the load finds the store empty: all failed
            assert kv.lookup(before) == 0
            attempts, deadline = 0, time.monotonic() + WAIT
            while kv.stats()["remote"]["committed"] < 4 and time.monotonic() < deadline:
                attempts += 1  # a store that does not reconnect at once makes the first stores counted drops
                assert kv.store(after, blocks).result(WAIT).stored == 4  # in host memory, whatever the store does
                kv.wait_idle(WAIT)
                if kv.stats()["remote"]["committed"] < 4:
                    kv.stack.tiers[0].evict(4)  # so that the next store sends them again
            assert kv.stats()["remote"]["committed"] == 4
            if fresh_store.RECONNECTS_AT_ONCE:
                assert attempts == 1  # the connections that broke were made again within the first stores
        with KVTier.open(config(fresh_store)) as fresh:
            assert fresh.lookup(before) == 0
            result, out = load(fresh, after, 4)
            assert result.loaded == 4 and np.array_equal(out, blocks)

    def test_the_stores_own_eviction_never_yields_wrong_bytes(self, config, store_class, tmp_path):
        count, block = store_class.SMALL
        with store_class.small(tmp_path / "small") as small:
            cfg = config(small, host=8, block=block)
            tokens, blocks = prompt(count), data(count, block=block)
            with KVTier.open(cfg) as kv:
                keys = kv.keys(tokens)
                for at in range(0, count, 8):  # through a host tier of 8 blocks, each batch on to the store first
                    assert kv.store(keys[at : at + 8], blocks[at : at + 8]).result(WAIT).stored == 8
                    kv.wait_idle(WAIT)
                assert kv.stats()["remote"]["committed"] + kv.stats()["remote"]["aborted"] == count
            with KVTier.open(cfg) as reader:
                held = held_runs(small, reader, keys, longest=8)
                assert 0 < sum(map(len, held)) < count  # it evicted, and kept some
                loaded = 0
                for run in held:  # a run of records the store held, in one load (it may evict more meanwhile)
                    result, out = load(reader, [keys[i] for i in run], len(run), block)
                    arrived = [j for j in range(result.hits) if j not in result.failed]
                    assert all(np.array_equal(out[j], blocks[run[j]]) for j in arrived), "a block came back wrong"
                    loaded += len(arrived)
                assert loaded > 0

    # --- tenants -------------------------------------------------------------------------------------

    def test_two_tenants_sending_one_prompt_never_hit_each_others_sealed_records(self, config, store, monkeypatch):
        """Each tenant's records are its own: another tenant's lookup of the same prompt misses in the store,
        and each record is sealed under its tenant's key (the seal names it)."""
        monkeypatch.setenv("KVTIER_TEST_SEAL", "a sealing secret of 32 bytes...")
        cfg = config(store, seal_env="KVTIER_TEST_SEAL")
        tokens, blocks = prompt(4, start=7), data(4, seed=7)
        with KVTier.open(cfg) as kv:
            assert kv.store(tokens, blocks, tenant="alice").result(WAIT).stored == 4
            kv.wait_idle(WAIT)
        with KVTier.open(cfg) as kv:
            assert kv.lookup(tokens, tenant="bob") == 0 and kv.lookup(tokens) == 0
            alice = kv.keys(tokens, tenant="alice")
            assert remote(kv).query(alice) == 4 and remote(kv).query(kv.keys(tokens, tenant="bob")) == 0
            sealing = remote(kv).records[0].sealing
            raw = store.read(remote(kv).records[0].name(alice[0]), HEADER_BYTES + BLOCK)
            assert raw is not None
            header = RecordHeader.unpack(raw[:HEADER_BYTES])
            assert header is not None and header.mac[:4] == sealing.for_key(alice[0]).key_id != sealing.key_id
            assert load(kv, tokens, 4)[0].hits == 0
            out = np.zeros_like(blocks)
            assert kv.load(tokens, out, tenant="alice").result(WAIT).loaded == 4 and np.array_equal(out, blocks)
