"""Why a prefix missed, through the Python API: ``KVTier.stats()["misses"]``, ``KVTier.explain`` and the
``kvtier.misses`` debug line; the partial last block of token ids; a remote store killed (a remote error)
and a damaged record in it (damaged, remote), on a real redis-server."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from helpers.redis_server import redis_server
from kvtier import KVTier
from kvtier.core.misses import TOTAL, MissReason
from kvtier.core.namespaces import ENTRY_BYTES, REGISTRY_BYTES, decode_entry
from kvtier.tiers.disk.namespaces import NAMESPACES_NAME
from kvtier.tiers.remote.record import HEADER_BYTES

BLOCK = 4096
TOKENS = 16
WAIT = 30.0


def prompt(n: int, extra: int = 0) -> list[int]:
    """Token ids of ``n`` full blocks and ``extra`` tokens of a partial one."""
    return list(range(TOKENS * n + extra))


def data(n: int) -> np.ndarray:
    return np.random.default_rng(n).integers(0, 256, (n, BLOCK), dtype=np.uint8)


def host_only() -> dict:
    return {"block_bytes": BLOCK, "block_tokens": TOKENS, "tiers": [{"medium": "host", "capacity_blocks": 8}]}


@pytest.fixture
def server(tmp_path):
    with redis_server(tmp_path / "redis") as server:
        yield server


def over(server) -> dict:
    remote = {"medium": "remote", "backend": "redis", "timeout": 1.0, "redis": {"url": server.url}}
    return {**host_only(), "tiers": [{"medium": "host", "capacity_blocks": 8}, remote]}


def test_stats_count_a_partial_last_block_and_explain_counts_nothing(caplog):
    with KVTier.open(host_only()) as kv:
        kv.store(prompt(2), data(2)).result(WAIT)
        assert kv.lookup(prompt(2)) == 2 and kv.stats()["misses"]["total"]["partial_block"] == 0
        miss = kv.explain(prompt(2, extra=5))
        assert (miss.reason, miss.hits, miss.blocks) == (MissReason.PARTIAL_BLOCK, 2, 2)
        assert kv.explain(prompt(2)) is None
        with caplog.at_level(logging.DEBUG, logger="kvtier.misses"):
            assert kv.lookup(prompt(2, extra=5)) == 2
            assert kv.lookup(prompt(3)) == 2
        stats = kv.stats()
        assert stats["host"]["committed"] == 2, "the tiers' counters stay as they were"
        assert stats["misses"]["total"] == {
            r.value: int(r in (MissReason.PARTIAL_BLOCK, MissReason.NEVER_STORED)) for r in MissReason
        }
        assert stats["misses"]["by_tier"]["host"] == stats["misses"]["total"]
        lines = [r.getMessage() for r in caplog.records if r.name == "kvtier.misses"]
        assert lines == [
            "lookup hit 2/2 full blocks; miss: partial_block; per tier: host=partial_block",
            "lookup hit 2/3 full blocks; miss: never_stored; per tier: host=never_stored",
        ]
        kv.lookup(prompt(2, extra=5))  # keys instead of tokens never count a partial block:
        assert kv.lookup(kv.keys(prompt(2, extra=5))) == 2
        assert kv.stack.misses.take() == {
            (MissReason.PARTIAL_BLOCK, TOTAL): 2,
            (MissReason.PARTIAL_BLOCK, "host"): 2,
            (MissReason.NEVER_STORED, TOTAL): 1,
            (MissReason.NEVER_STORED, "host"): 1,
        }


def test_a_killed_store_is_a_remote_error(server):
    with KVTier.open(over(server)) as writer:
        writer.store(prompt(3), data(3)).result(WAIT)
        writer.wait_idle(WAIT)
    with KVTier.open(over(server)) as reader:
        server.kill()
        assert reader.lookup(prompt(3)) == 0  # the store holds them, but cannot say so
        miss = reader.explain(prompt(3))
        assert (miss.reason, miss.tier) == (MissReason.REMOTE_ERROR, "remote")
        assert reader.stats()["misses"] == {
            "total": {r.value: int(r is MissReason.REMOTE_ERROR) for r in MissReason},
            "by_tier": {
                "host": {r.value: int(r is MissReason.NEVER_STORED) for r in MissReason},
                "remote": {r.value: int(r is MissReason.REMOTE_ERROR) for r in MissReason},
            },
        }


def test_a_damaged_record_is_damaged_in_the_remote_tier(server):
    with KVTier.open(over(server)) as writer:
        writer.store(prompt(3), data(3)).result(WAIT)
        writer.wait_idle(WAIT)
    with KVTier.open(over(server)) as reader:
        remote = reader.stack.tiers[-1]
        name = remote.records[0].name(reader.keys(prompt(3))[1])
        server.client().set(name, b"\xff" * (HEADER_BYTES + BLOCK))
        out = np.zeros((3, BLOCK), np.uint8)
        assert reader.load(prompt(3), out).result(WAIT).failed == [1]
        assert reader.lookup(prompt(3)) == 1
        assert reader.stack.misses.take() == {
            (MissReason.DAMAGED, TOTAL): 1,
            (MissReason.NEVER_STORED, "host"): 1,
            (MissReason.DAMAGED, "remote"): 1,
        }


# --- another namespace: stacks of another block size or namespace before this one ---------------


def on_disk(path, block_tokens: int = TOKENS, namespace: str = "") -> dict:
    disk = {"medium": "disk", "path": str(path), "capacity_blocks": 16}
    tiers = [{"medium": "host", "capacity_blocks": 8}, disk]
    return {**host_only(), "block_tokens": block_tokens, "namespace": namespace, "tiers": tiers}


def stored_by_another(path) -> list[int]:
    """A prompt of 4 blocks of 16 tokens that a stack of the default namespace stored in ``path``'s disk
    tier and closed; then this test's stack opens there with ``config``."""
    tokens = prompt(4)
    with KVTier.open(on_disk(path)) as kv:
        kv.store(tokens, data(4)).result(WAIT)
    return tokens


def debug_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvtier.misses"]


def missed_as_other_namespace(kv, tokens, caplog, tier: str) -> str:
    """Look ``tokens`` up: nothing found, counted once as other_namespace in total and in ``tier``
    (never_stored in the host tier above it); returns the lookup's one DEBUG line."""
    with caplog.at_level(logging.DEBUG, logger="kvtier.misses"):
        assert kv.lookup(tokens) == 0
    assert kv.stack.misses.take() == {
        (MissReason.OTHER_NAMESPACE, TOTAL): 1,
        (MissReason.NEVER_STORED, "host"): 1,
        (MissReason.OTHER_NAMESPACE, tier): 1,
    }
    (line,) = debug_lines(caplog)
    return line


@pytest.mark.parametrize(
    ("config", "differing", "said"),
    [
        ({"block_tokens": 32}, {"block_size": (32, 16)}, "block_size 32 vs 16"),
        ({"namespace": "other"}, {"namespace": ("other", "")}, 'namespace "other" vs ""'),
    ],
    ids=["block_tokens", "namespace"],
)
def test_a_block_the_disk_holds_under_another_namespace_is_other_namespace(tmp_path, caplog, config, differing, said):
    tokens = stored_by_another(tmp_path)
    with KVTier.open(on_disk(tmp_path, **config)) as kv:
        line = missed_as_other_namespace(kv, tokens, caplog, "disk")
        assert line.endswith(f"disk=other_namespace; namespace differs (here vs there) in: {said}")
        miss = kv.explain(tokens)
        assert (miss.reason, miss.tier, miss.differing) == (MissReason.OTHER_NAMESPACE, "disk", differing)
        assert kv.stack.misses.take() == {}, "explain counts nothing"
        assert kv.lookup(tokens[::-1]) == 0  # another prompt: never stored anywhere
        assert kv.stack.misses.take()[MissReason.NEVER_STORED, TOTAL] == 1


def test_without_another_namespace_a_miss_stays_never_stored(tmp_path):
    tokens = stored_by_another(tmp_path)
    with KVTier.open(on_disk(tmp_path)) as kv:  # the same namespace: its blocks are hits
        assert kv.lookup(tokens) == 4 and kv.lookup(prompt(5)) == 4
        assert kv.stack.misses.take() == {
            (MissReason.NEVER_STORED, TOTAL): 1,
            (MissReason.NEVER_STORED, "host"): 1,
            (MissReason.NEVER_STORED, "disk"): 1,
        }
    with KVTier.open(on_disk(tmp_path / "fresh", block_tokens=32)) as kv:  # nobody else used this directory
        assert kv.lookup(tokens) == 0
        assert kv.stack.misses.take()[MissReason.NEVER_STORED, "disk"] == 1


def plant(path, how: str, tmp_path) -> None:
    """Put a hostile ``namespaces.json`` in the disk tier's directory ``path``, in place of the real one."""
    registry = path / NAMESPACES_NAME
    if how == "garbage":
        registry.write_bytes(b"\x00{not json" * 100)
    elif how == "huge":  # valid JSON, too large to read
        registry.write_text(json.dumps({"kvtier_namespaces": 1, "entries": [], "pad": "x" * REGISTRY_BYTES}))
    elif how == "symlink":  # to a copy of the real one, elsewhere: it must not be followed
        target = tmp_path / "elsewhere.json"
        target.write_bytes(registry.read_bytes())
        registry.unlink()
        registry.symlink_to(target)
    elif how == "world-writable":
        registry.chmod(0o666)


@pytest.mark.parametrize("how", ["garbage", "huge", "symlink", "world-writable"])
def test_a_hostile_namespaces_json_is_ignored_with_one_log_line(tmp_path, caplog, how):
    path = tmp_path / "disk"
    tokens = stored_by_another(path)
    plant(path, how, tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk.namespaces"):
        kv = KVTier.open(on_disk(path, block_tokens=32))
    with kv:
        (warning,) = [r.getMessage() for r in caplog.records if r.name == "kvtier.tiers.disk.namespaces"]
        assert f"{NAMESPACES_NAME} ignored" in warning
        assert kv.lookup(tokens) == 0
        assert kv.stack.misses.take()[MissReason.NEVER_STORED, "disk"] == 1, "the other namespace is not known"
    registry = path / NAMESPACES_NAME
    assert registry.is_file() and not registry.is_symlink() and registry.stat().st_mode & 0o777 == 0o600
    (entry,) = json.loads(registry.read_text())["entries"]  # replaced by this stack's own
    assert entry["fields"]["block_size"] == 32
    if how == "symlink":
        assert "entries" in json.loads((tmp_path / "elsewhere.json").read_text()), "its target is left alone"


def test_a_block_the_remote_store_holds_under_another_block_size_is_other_namespace(server, caplog):
    tokens = prompt(4)
    with KVTier.open(over(server)) as writer:
        writer.store(tokens, data(4)).result(WAIT)
        writer.wait_idle(WAIT)
    with KVTier.open({**over(server), "block_tokens": 32}) as reader:
        line = missed_as_other_namespace(reader, tokens, caplog, "remote")
        assert line.endswith("remote=other_namespace; namespace differs (here vs there) in: block_size 32 vs 16")
        assert reader.explain(tokens).differing == {"block_size": (32, 16)}
        server.kill()  # the search's query fails: a remote error, as the lookup's own
        assert reader.explain(tokens).reason is MissReason.REMOTE_ERROR


def test_hostile_registry_records_in_the_store_are_ignored_with_one_log_line(server, caplog):
    tokens = prompt(4)
    with KVTier.open(over(server)) as writer:
        writer.store(tokens, data(4)).result(WAIT)
        writer.wait_idle(WAIT)
    client = server.client()
    assert decode_entry(client.get("kvtier/namespaces/0")).fields["block_size"] == TOKENS  # the writer's
    client.set("kvtier/namespaces/1", b"\xff{" * (ENTRY_BYTES // 2))  # garbage of the right size
    client.set("kvtier/namespaces/2", b" " * (64 * ENTRY_BYTES))  # huge
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.remote.tier"):
        reader = KVTier.open({**over(server), "block_tokens": 32})
    with reader:
        (warning,) = [r.getMessage() for r in caplog.records if r.name == "kvtier.tiers.remote.tier"]
        assert warning.endswith("kvtier/namespaces/1, kvtier/namespaces/2")
        assert reader.lookup(tokens) == 0
        assert reader.stack.misses.take()[MissReason.OTHER_NAMESPACE, "remote"] == 1, "the writer's entry still counts"
        client.delete("kvtier/namespaces/0")
    with KVTier.open({**over(server), "block_tokens": 64}) as third:  # lists the second stack's only
        assert third.lookup(tokens) == 0
        assert third.stack.misses.take()[MissReason.NEVER_STORED, TOTAL] == 1, "no other namespace's key is held"
    mine = decode_entry(client.get("kvtier/namespaces/1"))  # the second's: the first record free or unreadable
    assert mine.fields["block_size"] == 32 and mine.records is not None
    assert len(client.get("kvtier/namespaces/2")) == 64 * ENTRY_BYTES
