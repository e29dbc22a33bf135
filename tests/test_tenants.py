"""Tenants through the standalone API (``KVTier(..., tenant=)``): a tenant's keys begin with its tag and are
chained apart from every other tenant's, so the same prompt sent by two tenants never hits across them in
any tier (host, disk, node here; every shared store in tests/contracts/test_remote_stack.py); a sealing
tier seals each tenant's blocks under that tenant's own key; the same tenant in another stack (another
process, after a restart) finds its blocks again.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers.node_daemon import node_daemon
from kvtier import KVTier
from kvtier.core.keys import KEY_BYTES, TENANT_KEY_BYTES, TENANT_TAG_BYTES, chain_hashes, tenant_of, tenant_tag
from kvtier.tiers.disk.files import SLAB_NAME
from kvtier.tiers.disk.format import SEAL_AT
from kvtier.tiers.disk.slots import PAGE

BLOCK = 64 * 1024
TOKENS = 16
SECRET_ENV, SEAL_ENV = "KVTIER_TEST_KEY_SECRET", "KVTIER_TEST_TENANT_SEAL"
PLANTED = b"PLANTED-KV-BYTES-0123456789abcdef"


@pytest.fixture(autouse=True)
def secrets(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "a key-hashing secret of 32 bytes")
    monkeypatch.setenv(SEAL_ENV, "a tenant sealing secret, 32 byte")


def prompt(n: int) -> list[int]:
    return list(range(500, 500 + n * TOKENS))


def blocks(n: int, seed: int = 3) -> np.ndarray:
    data = np.random.default_rng(seed).integers(0, 256, (n, BLOCK), dtype=np.uint8)
    data[:, 100 : 100 + len(PLANTED)] = np.frombuffer(PLANTED, np.uint8)
    return data


# --- keys ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("secret", [None, b"a key-hashing secret of 32 bytes"], ids=["unkeyed", "keyed"])
def test_a_tenants_keys_begin_with_its_tag_and_chain_apart_from_others(secret):
    tokens = list(range(64))
    a, b = tenant_tag("alice", secret), tenant_tag("bob", secret)
    alice, bob, plain = (chain_hashes(tokens, 16, b"ns", secret=secret, tag=tag) for tag in (a, b, b""))
    assert len(a) == TENANT_TAG_BYTES and a != b and tenant_tag(b"alice", secret) == a
    assert all(len(k) == TENANT_KEY_BYTES and tenant_of(k) == a for k in alice)
    assert all(len(k) == KEY_BYTES and tenant_of(k) == b"" for k in plain)
    assert not set(alice) & set(bob) and not set(alice) & set(plain)
    chains = {k[TENANT_TAG_BYTES:] for k in alice}, {k[TENANT_TAG_BYTES:] for k in bob}
    assert (chains[0] == chains[1]) == (secret is None)  # keyed: each tenant's chain has a key of its own
    assert chain_hashes(tokens, 16, b"ns", secret=secret, tag=a) == alice  # the same tenant: the same keys
    continued = alice[:2] + chain_hashes(tokens[32:], 16, parent=alice[1], secret=secret, tag=a)
    assert continued == alice
    with pytest.raises(ValueError, match="same tenant"):
        chain_hashes(tokens[32:], 16, parent=alice[1], secret=secret, tag=b)
    assert tenant_tag("", secret) == b""
    with pytest.raises(ValueError, match="at most 255 bytes"):
        tenant_tag("x" * 256, secret)


def test_without_the_key_secret_no_tenants_tag_can_be_computed():
    assert tenant_tag("alice", b"a key-hashing secret of 32 bytes") != tenant_tag(
        "alice", b"another secret of 32 bytes!!!!!"
    )
    assert tenant_tag("alice", b"a key-hashing secret of 32 bytes") != tenant_tag("alice")


def test_given_keys_of_a_tenant_are_folded_behind_its_tag():
    with KVTier.open(
        {"block_tokens": TOKENS, "block_bytes": 4096, "tiers": [{"medium": "host", "capacity_blocks": 4}]}
    ) as kv:
        own = [b"engine-key-1", b"engine-key-2"]
        assert kv.keys(own) == own
        keys = kv.keys(own, tenant="alice")
        assert [tenant_of(k) for k in keys] == [tenant_tag("alice")] * 2 and keys != kv.keys(own, tenant="bob")


# --- through every local tier --------------------------------------------------------------------


def host_disk(path, capacity: int = 16) -> dict:
    return {
        "block_tokens": TOKENS,
        "block_bytes": BLOCK,
        "key_secret_env": SECRET_ENV,
        "tiers": [
            {"medium": "host", "capacity_blocks": capacity},
            {
                "medium": "disk",
                "path": str(path),
                "capacity_blocks": 16,
                "encryption": "aes-gcm",
                "encryption_key_env": SEAL_ENV,
            },
        ],
    }


def assert_only_alice_has(kv: KVTier, tier, tokens: list[int]) -> None:
    assert tier.lookup(kv.keys(tokens, tenant="alice")) == len(tokens) // TOKENS
    assert tier.lookup(kv.keys(tokens, tenant="bob")) == tier.lookup(kv.keys(tokens)) == 0


def test_two_tenants_never_hit_each_others_blocks_in_the_host_or_the_disk_tier(tmp_path):
    tokens, data = prompt(4), blocks(4)
    with KVTier.open(host_disk(tmp_path / "disk")) as kv:
        assert kv.store_now(tokens, data, tenant="alice").stored == 4
        kv.wait_idle(10)
        assert_only_alice_has(kv, kv.stack.tiers[0], tokens)
        assert kv.lookup(tokens, tenant="bob") == 0 and kv.lookup(tokens) == 0
        assert kv.stats()["misses"]["total"]["never_stored"] == 2
        out = np.zeros_like(data)
        assert kv.load_now(tokens, out, tenant="bob").hits == 0 and not out.any()
    with KVTier.open(host_disk(tmp_path / "disk")) as kv:  # a restart: the disk tier only (copied down at close)
        assert_only_alice_has(kv, kv.stack.tiers[1], tokens)
        out = np.zeros_like(data)
        result = kv.load_now(tokens, out, tenant="alice")
        assert (result.loaded, result.per_tier) == (4, {"disk": 4}) and np.array_equal(out, data)
        sealing = kv.stack.tiers[1].storage.slab.sealing
        alice_id = sealing.for_key(kv.keys(tokens, tenant="alice")[0]).key_id
    raw = (tmp_path / "disk" / SLAB_NAME).read_bytes()
    assert PLANTED not in raw
    seals = {raw[PAGE + slot * (PAGE + BLOCK) + SEAL_AT :][:4] for slot in range(16)}
    assert alice_id in seals and sealing.key_id not in seals  # sealed under alice's key, not the tenantless one


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with node_daemon(tmp_path_factory.mktemp("node"), capacity="4MiB", block_bytes="68KiB") as running:
        yield running


def test_two_tenants_never_hit_each_others_blocks_through_a_node_daemon(daemon):
    cfg = {
        "block_tokens": TOKENS,
        "block_bytes": BLOCK,
        "tiers": [daemon.tier(encryption="aes-gcm", encryption_key_env=SEAL_ENV)],
    }
    tokens, data = prompt(3), blocks(3, seed=4)
    with KVTier.open(cfg) as writer, KVTier.open(cfg) as reader:
        assert writer.store_now(tokens, data, tenant="alice").stored == 3
        writer.wait_idle(10)
        assert reader.lookup(tokens, tenant="bob") == 0 and reader.lookup(tokens) == 0
        out = np.zeros_like(data)
        assert reader.load_now(tokens, out, tenant="alice").loaded == 3 and np.array_equal(out, data)
