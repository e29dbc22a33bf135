"""The node tier through kvtier's standalone API, against a real node daemon process (tests/helpers/
node_daemon.py): what one engine stores another loads bit-exact; a block is visible only once committed;
a damaged block is a miss (never wrong bytes) and is dropped for everyone; engines of different
namespaces share a daemon without finding each other's blocks; the tier's config is refused where it
cannot work.

The rules under crashes (engines and the daemon killed or stopped) are in test_node_faults.py, the
peers allowed and hostile messages in test_node_security.py.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from helpers.config_helpers import error_of
from helpers.node_blocks import TOKENS, prompt
from helpers.node_daemon import node_daemon, node_daemon_here
from kvtier import KVTier
from kvtier.core.errors import ConfigError
from kvtier.core.misses import MissReason
from kvtier.tiers.node.protocol import BUSY, HELD, Op
from kvtier.tiers.node.slab import SlabView

BLOCK = 64 * 1024


def stack(daemon, namespace: str = "", **tier) -> dict:
    return {
        "block_tokens": TOKENS,
        "block_bytes": BLOCK,
        "namespace": namespace,
        "tiers": [daemon.tier(**tier)],
    }


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with node_daemon(tmp_path_factory.mktemp("node"), capacity="4MiB", block_bytes="64KiB") as running:
        yield running


def test_blocks_stored_by_one_engine_load_bit_exact_in_another(daemon, rng):
    tokens = prompt(8, start=1000)
    blocks = rng.integers(0, 256, (8, BLOCK), dtype=np.uint8)
    before = daemon.stats()["stores"]
    with KVTier.open(stack(daemon)) as writer:
        stored = writer.store_now(tokens, blocks)
        assert (stored.stored, stored.failed) == (8, [])
    daemon.wait_stores(before + 8)
    with KVTier.open(stack(daemon)) as reader:
        assert reader.lookup(tokens) == 8
        out = np.zeros_like(blocks)
        result = reader.load_now(tokens, out)
        assert (result.loaded, result.failed, result.per_tier) == (8, [], {"node": 8})
        assert np.array_equal(out, blocks)
        again = np.zeros_like(blocks)  # (and again: the pins were released)
        assert reader.load_now(tokens, again).loaded == 8 and np.array_equal(again, blocks)
        assert reader.stats()["node"]["hits"] == 16


def test_a_block_the_daemon_holds_is_not_written_again(daemon, rng):
    tokens = prompt(4, start=2000)
    blocks = rng.integers(0, 256, (4, BLOCK), dtype=np.uint8)
    with KVTier.open(stack(daemon)) as first, KVTier.open(stack(daemon)) as second:
        before = daemon.stats()["stores"]
        assert first.store_now(tokens, blocks).stored == 4
        daemon.wait_stores(before + 4)
        assert second.store_now(tokens, rng.integers(0, 256, (4, BLOCK), dtype=np.uint8)).stored == 4
        assert second.stats()["node"]["skipped_existing"] == 4
        assert daemon.stats()["stores"] == before + 4
        out = np.zeros_like(blocks)
        assert second.load_now(tokens, out).loaded == 4 and np.array_equal(out, blocks)  # the first engine's


def test_a_block_is_invisible_until_its_writer_commits(daemon, rng):
    """A reservation of another connection: lookups miss, a second writer is told BUSY, pins find
    nothing; once committed, everyone reads the writer's bytes."""
    tokens = prompt(2, start=3000)
    blocks = rng.integers(0, 256, (2, BLOCK), dtype=np.uint8)
    with KVTier.open(stack(daemon)) as writer, KVTier.open(stack(daemon)) as other:
        node = writer.stack.tiers[0].storage
        names = node.node_keys(writer.keys(tokens))
        (given,), epoch, view = node.client.call(Op.RESERVE, names, [BLOCK, BLOCK], [b"", b""])
        assert all(isinstance(entry, list) for entry in given)
        for (slot, _), block in zip(given, blocks, strict=True):
            view.block(slot, BLOCK)[:] = block  # the bytes are there, uncommitted
        assert other.lookup(tokens) == 0
        other_node = other.stack.tiers[0].storage
        (busy,), _, _ = other_node.client.call(
            Op.RESERVE, other_node.node_keys(other.keys(tokens)), [BLOCK, BLOCK], [b"", b""]
        )
        assert busy == [BUSY, BUSY]
        (pinned,), _, _ = other_node.client.call(Op.PIN, names, BLOCK)
        assert pinned == [None, None]
        node.client.post(Op.ABORT, epoch, names)
        before = daemon.stats()["stores"]
        assert writer.store_now(tokens, blocks).stored == 2
        daemon.wait_stores(before + 2)  # (a store returns once its COMMIT is posted; the daemon reads it later)
        out = np.zeros_like(blocks)
        assert other.load_now(tokens, out).loaded == 2 and np.array_equal(out, blocks)
        (held,), _, _ = other_node.client.call(Op.RESERVE, names, [BLOCK, BLOCK], [b"", b""])
        assert [entry[2] for entry in held] == [HELD, HELD]  # (with where the blocks are)
        assert [entry[:2] for entry in held] == [
            entry[:2] for entry in other_node.client.call(Op.PIN, names, BLOCK)[0][0]
        ]


def test_once_a_writer_waited_idle_its_blocks_are_every_engines(monkeypatch, rng):
    """A store returns once its COMMIT is posted, and the daemon reads it on that connection's thread in
    its own time (slowed here): ``wait_idle`` returns only once it has, so an engine asked next finds
    the blocks (what ``kvtier replay --engines --node`` relies on)."""
    import kvtier.node_daemon as node_daemon_module

    handle = node_daemon_module.NodeDaemon.handle

    def slow_commits(self, session, op, args):
        if op is Op.COMMIT:
            time.sleep(0.3)  # (before the daemon's lock: other connections are served meanwhile)
        return handle(self, session, op, args)

    monkeypatch.setattr(node_daemon_module.NodeDaemon, "handle", slow_commits)
    tokens = prompt(2, start=4000)
    blocks = rng.integers(0, 256, (2, BLOCK), dtype=np.uint8)
    with node_daemon_here("1MiB", "64KiB", []) as daemon:
        engine = {
            "block_tokens": TOKENS,
            "block_bytes": BLOCK,
            "tiers": [{"medium": "node", "socket": daemon.settings.socket}],
        }
        with KVTier.open(engine) as writer, KVTier.open(engine) as reader:
            assert writer.store(tokens, blocks).result(10).stored == 2
            writer.wait_idle(10)
            assert reader.lookup(tokens) == 2


def damage(view: SlabView, slot: int, at: int = 100) -> None:
    view.block(slot, BLOCK)[at] ^= 0xFF


def slots_of(kv: KVTier, tokens: list[int]) -> list[int]:
    """The slots the daemon holds ``tokens``' blocks in (pinned and released again)."""
    node = kv.stack.tiers[0].storage
    names = node.node_keys(kv.keys(tokens))
    (pinned,), epoch, _ = node.client.call(Op.PIN, names, BLOCK)
    node.client.post(Op.RELEASE, epoch, names)
    return [slot for slot, _ in pinned]


def test_a_damaged_block_is_a_miss_never_wrong_bytes_and_is_dropped_for_everyone(daemon, rng):
    tokens = prompt(4, start=4000)
    blocks = rng.integers(0, 256, (4, BLOCK), dtype=np.uint8)
    with KVTier.open(stack(daemon)) as writer, KVTier.open(stack(daemon)) as reader:
        writer.store_now(tokens, blocks)
        view = writer.stack.tiers[0].storage.client._view
        damage(view, slots_of(writer, tokens)[2])
        out = np.zeros_like(blocks)
        result = reader.load_now(tokens, out)
        assert result.failed == [2]  # recompute block 2; blocks 0, 1 and 3 are good
        assert np.array_equal(out[[0, 1, 3]], blocks[[0, 1, 3]])
        assert reader.stats()["node"]["read_errors"] == 1
        assert reader.explain(tokens).reason is MissReason.DAMAGED
        assert daemon.stats()["dropped"] >= 1
    with KVTier.open(stack(daemon)) as third:
        assert third.lookup(tokens) == 2  # gone for every engine


def test_a_header_that_names_another_key_or_generation_fails_the_load(daemon, rng):
    """A slot whose header was rewritten under a reader (its generation moved: another writer got the
    slot) fails that block even though its bytes hash fine under the old generation."""
    tokens = prompt(2, start=5000)
    blocks = rng.integers(0, 256, (2, BLOCK), dtype=np.uint8)
    with KVTier.open(stack(daemon)) as writer, KVTier.open(stack(daemon)) as reader:
        writer.store_now(tokens, blocks)
        view = writer.stack.tiers[0].storage.client._view
        slot = slots_of(writer, tokens)[1]
        view.headers["gen"][slot] += 7
        out = np.zeros_like(blocks)
        assert reader.load_now(tokens, out).failed == [1]
        assert np.array_equal(out[0], blocks[0])


def test_engines_of_different_namespaces_share_a_daemon_without_seeing_each_others_blocks(daemon, rng):
    tokens = prompt(3, start=6000)
    ours = rng.integers(0, 256, (3, BLOCK), dtype=np.uint8)
    theirs = rng.integers(0, 256, (3, BLOCK), dtype=np.uint8)
    with KVTier.open(stack(daemon, "model-a")) as a, KVTier.open(stack(daemon, "model-b")) as b:
        assert a.store_now(tokens, ours).stored == 3
        assert b.lookup(tokens) == 0
        assert b.store_now(tokens, theirs).stored == 3 and b.stats()["node"]["skipped_existing"] == 0
        out = np.zeros_like(ours)
        assert a.load_now(tokens, out).loaded == 3 and np.array_equal(out, ours)
        assert b.load_now(tokens, out).loaded == 3 and np.array_equal(out, theirs)


def test_fragmented_blocks_round_trip_through_a_host_tier_above(daemon, rng):
    """A [host, node] stack of 4-fragment blocks: stores reach the daemon through the host tier (write
    through), and after the host tier's copies are gone another engine's load comes from the slab."""
    tokens = prompt(6, start=7000)
    blocks = rng.integers(0, 256, (6, BLOCK), dtype=np.uint8)
    config = {
        "block_tokens": TOKENS,
        "block_bytes": BLOCK,
        "fragments": 4,
        "tiers": [{"medium": "host", "capacity_blocks": 8}, daemon.tier()],
    }
    with KVTier.open(config) as writer:
        writer.store_now(tokens, blocks)
        writer.wait_idle()
    with KVTier.open(config) as reader:
        out = np.zeros_like(blocks)
        result = reader.load_now(tokens, out)
        assert result.loaded == 6 and set(result.sources) == {"node"}
        assert np.array_equal(out, blocks)


def test_a_full_slab_evicts_to_take_new_blocks(tmp_path, rng):
    """Eight slots, six blocks stored, then six more: the daemon's policy makes room by evicting four of
    the first six; every new block is there."""
    with node_daemon(tmp_path, capacity="512KiB", block_bytes="64KiB", max_held=1.0) as small:  # 8 slots
        with KVTier.open(stack(small)) as kv:
            old, new = prompt(6, start=0), prompt(6, start=10_000)
            kv.store_now(old, rng.integers(0, 256, (6, BLOCK), dtype=np.uint8))
            kv.store_now(new, rng.integers(0, 256, (6, BLOCK), dtype=np.uint8))
        with KVTier.open(stack(small)) as other:
            assert other.lookup(new) == 6 and other.lookup(old) < 6
            stats = small.stats()
            assert (stats["evicted"], stats["used_slots"], stats["stores"]) == (4, 8, 12)


def test_a_missing_socket_is_one_clear_error_at_start(tmp_path):
    config = {"block_bytes": BLOCK, "tiers": [{"medium": "node", "socket": str(tmp_path / "nobody.sock")}]}
    with pytest.raises(ConfigError, match="no node daemon socket at .*kvtier node serve"):
        KVTier.open(config)


def test_blocks_larger_than_the_daemons_slots_are_refused_at_start(daemon):
    with pytest.raises(ConfigError, match="do not fit the daemon's slots of 65536 bytes"):
        KVTier.open({"block_bytes": 2 * BLOCK, "tiers": [daemon.tier()]})


@pytest.mark.parametrize(
    ("tiers", "message"),
    [
        (
            [{"medium": "node", "socket": "/s"}, {"medium": "host", "capacity": "1MiB"}],
            "tiers[0].medium: a node tier may only be the last tier",
        ),
        (
            [{"medium": "node", "socket": "/s", "capacity": "1GiB"}],
            "tiers[0].capacity: a node tier has no capacity: the node daemon sizes its slab",
        ),
        (
            [{"medium": "host", "capacity": "1MiB"}, {"medium": "node", "socket": "/s", "eviction": "lru"}],
            "tiers[1].eviction: a node tier has no eviction policy",
        ),
        ([{"medium": "node", "socket": "/s", "daemon_user": "no-such-user-here"}], "no user named 'no-such-user-here'"),
        (
            [{"medium": "gpu", "capacity_blocks": 4}, {"medium": "node", "socket": "/s"}],
            "tiers[1].medium: a node tier below a gpu tier needs a host tier between them",
        ),
        ([{"medium": "node"}], "tiers[0]: missing key 'socket'"),
    ],
)
def test_a_node_tier_where_it_cannot_be_is_refused_naming_the_key(tiers, message):
    assert message in error_of({"block_bytes": BLOCK, "tiers": tiers})


def test_a_node_tier_beside_a_remote_tier_is_refused():
    tiers = [
        {"medium": "host", "capacity": "1MiB"},
        {"medium": "node", "socket": "/s"},
        {"medium": "remote", "backend": "redis", "redis": {"url": "redis://127.0.0.1:1"}},
    ]
    error = error_of({"block_bytes": BLOCK, "tiers": tiers})
    assert "tiers[1].medium: a node tier may only be the last tier" in error
    assert "a node tier cannot share a stack with a remote tier" in error
