"""The remote tier's YAML: a valid one loads with its defaults, and every mistake raises one ConfigError
that names the key, the value and the fix (the rules of tiers/remote/config.py's RemoteTierConfig)."""

from __future__ import annotations

import copy
import sys

import pytest

from helpers.config_helpers import error_of
from kvtier.core.config import capacity_in_blocks, load_config
from kvtier.core.errors import ConfigError
from kvtier.tiers.remote.config import HEADER_ROOM, RemoteTierConfig
from kvtier.tiers.remote.mooncake_settings import MooncakeConfig
from kvtier.tiers.remote.redis_settings import RedisConfig

REDIS = {"medium": "remote", "backend": "redis", "redis": {"url": "redis://127.0.0.1:6379/0"}}
MOONCAKE = {
    "medium": "remote",
    "backend": "mooncake",
    "mooncake": {"master": "127.0.0.1:50051", "metadata_server": "http://127.0.0.1:8080/metadata"},
}
HOST = {"medium": "host", "capacity": "8MiB"}
DISK = {"medium": "disk", "path": "/tmp/kvtier-config-test", "capacity": "8MiB"}


def stack(*tiers: dict, **top) -> dict:
    return {"block_bytes": "1MiB", "tiers": [copy.deepcopy(t) for t in tiers], **top}


def remote(base: dict = REDIS, **changes) -> dict:
    tier = copy.deepcopy(base)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(tier.get(key), dict):
            tier[key].update(value)
        else:
            tier[key] = value
    return tier


def test_redis_tier_loads_with_its_defaults():
    cfg = load_config(stack(HOST, REDIS, placement="write_back"))
    tier = cfg.tiers[1]
    assert isinstance(tier, RemoteTierConfig)
    assert (tier.timeout, tier.prefix, tier.auth_key_env, tier.placement) == (2.0, "kvtier", None, "write_through")
    assert tier.settings == RedisConfig(url="redis://127.0.0.1:6379/0", password_env=None, pool_size=4, ca_file=None)
    assert "mooncake" not in tier.model_extra and tier.capacity is None and tier.eviction is None
    # the last tier kvtier evicts from is the host tier: it gets the last tier's default policy
    assert cfg.tier_eviction(0) == "adaptive" and cfg.last_local_tier == 0
    with pytest.raises(ConfigError, match="tiers\\[1\\] is a remote tier"):
        cfg.tier_eviction(1)


def test_mooncake_tier_loads_and_round_trips():
    cfg = load_config(
        stack(
            HOST,
            DISK,
            remote(MOONCAKE, mooncake={"segment_size": "512MB"}, timeout=1, auth_key_env="KVTIER_MAC", prefix="team-a"),
        )
    )
    tier = cfg.tiers[2]
    assert tier.settings == MooncakeConfig(
        master="127.0.0.1:50051",
        metadata_server="http://127.0.0.1:8080/metadata",
        segment_size=512_000_000,
        protocol="tcp",
        local_hostname="127.0.0.1",
    )
    assert (tier.timeout, tier.auth_key_env, tier.prefix) == (1.0, "KVTIER_MAC", "team-a")
    assert cfg.tier_eviction(1) == "adaptive" and cfg.tier_eviction(0) == "lru"
    assert load_config(cfg.model_dump(exclude_none=True)) == cfg
    assert load_config(stack(HOST, remote(MOONCAKE, mooncake={"segment_size": 0}))).tiers[1].settings.segment_size == 0


@pytest.mark.parametrize(
    "key, value, what",
    [
        ("capacity", "1GiB", "capacity"),
        ("capacity_blocks", 8, "capacity"),
        ("eviction", "lru", "eviction policy"),
        ("watermark", {"high": 0.9, "low": 0.5}, "watermark"),
    ],
)
def test_the_store_owns_its_memory(key, value, what):
    assert error_of(stack(HOST, remote(**{key: value}))) == (
        f"config: tiers[1].{key}: a remote tier has no {what}: the store manages its own memory and evicts by "
        f"itself (size it on the server); remove {key}"
    )


def test_the_chosen_backend_needs_its_settings_and_only_those():
    tier = remote()
    del tier["redis"]
    assert error_of(stack(HOST, tier)) == (
        "config: tiers[1]: missing key 'redis': the redis backend's settings (url, password_env, pool_size, ca_file, "
        "cluster, seeds)"
    )
    assert error_of(stack(HOST, remote(mooncake=MOONCAKE["mooncake"]))) == (
        "config: tiers[1].mooncake: settings for mooncake but the backend is redis; remove them or set backend: "
        "mooncake"
    )
    assert error_of(stack(HOST, remote(backend="memcached"))) == (
        "config: tiers[1].backend: 'memcached' is not allowed; allowed: mooncake, redis"
    )


def test_a_remote_tier_is_last_and_below_a_host_tier():
    assert error_of(stack(REDIS, HOST)) == (
        "config: tiers[0].medium: a remote tier may only be the last tier: the store evicts and loses blocks by "
        "itself, so no tier of kvtier's can sit below it"
    )
    assert error_of(stack(REDIS)) == (
        "config: tiers[0].medium: a remote tier needs a host tier above it: blocks reach the store from host "
        "memory and come back through it"
    )
    assert error_of(stack(HOST, remote(), remote(name="second"))).startswith(
        "config: tiers[1].medium: a remote tier may only be the last tier"
    )


def test_write_back_needs_the_host_tier_directly_above():
    assert load_config(stack(HOST, remote(placement="write_back"))).tiers[1].placement == "write_back"
    assert error_of(stack(HOST, DISK, remote(placement="write_back"))) == (
        "config: tiers[2].placement: write_back needs the host tier directly above the remote tier (tiers[1] is "
        "disk): its victims would need a copy through host memory to reach the store; use write_through"
    )


def test_timeout_must_be_positive():
    assert (
        error_of(stack(HOST, remote(timeout=0))) == "config: tiers[1].timeout: 0 is too small; must be greater than 0.0"
    )


def test_secrets_only_through_environment_variable_names():
    assert error_of(stack(HOST, remote(auth_key_env="my secret"))) == (
        "config: tiers[1].auth_key_env: 'my secret' is not the name of an environment variable, e.g. "
        "KVTIER_REMOTE_MAC_KEY"
    )
    assert error_of(stack(HOST, remote(redis={"password_env": "hunter2!"}))) == (
        "config: tiers[1].redis.password_env: 'hunter2!' is not the name of an environment variable, e.g. "
        "KVTIER_REDIS_PASSWORD"
    )
    message = error_of(stack(HOST, remote(redis={"url": "redis://:hunter2@127.0.0.1:6379/0"})))
    assert message == (
        "config: tiers[1].redis.url: the URL carries a password; remove it and name an environment "
        "variable holding it in password_env (a secret never belongs in a config file)"
    )


def test_backend_settings_are_checked():
    assert error_of(stack(HOST, remote(redis={"url": "http://127.0.0.1:6379"}))) == (
        "config: tiers[1].redis.url: 'http://127.0.0.1:6379' is not a redis:// or rediss:// URL, e.g. "
        "redis://127.0.0.1:6379/0"
    )
    assert error_of(stack(HOST, remote(redis={"ca_file": "/etc/ca.pem"}))) == (
        "config: tiers[1].redis: ca_file applies to TLS connections only; use a rediss:// URL or remove ca_file"
    )
    assert error_of(stack(HOST, remote(redis={"pool_size": 0}))) == (
        "config: tiers[1].redis.pool_size: 0 is too small; must be at least 1"
    )
    assert error_of(stack(HOST, remote(MOONCAKE, mooncake={"master": "127.0.0.1"}))) == (
        "config: tiers[1].mooncake.master: '127.0.0.1' is not host:port (the Mooncake master's RPC address, e.g. "
        "127.0.0.1:50051)"
    )
    assert error_of(stack(HOST, remote(MOONCAKE, mooncake={"protocol": "udp"}))) == (
        "config: tiers[1].mooncake.protocol: 'udp' is not allowed; allowed: tcp, rdma"
    )
    assert error_of(stack(HOST, remote(MOONCAKE, mooncake={"segments": 1}))) == (
        "config: tiers[1].mooncake.segments: unknown key 'segments'; allowed: master, metadata_server, segment_size, "
        "pool_size, protocol, local_hostname, fetch_buffer"
    )
    assert error_of(stack(HOST, remote(MOONCAKE, mooncake={"pool_size": 4, "segment_size": "1GiB"}))) == (
        "config: tiers[1].mooncake: pool_size above 1 needs segment_size 0: a process that lends memory to the "
        "store keeps one client, whose segment lives and dies with it (lend memory from a standalone "
        "mooncake_client instead, or set pool_size: 1)"
    )
    assert RemoteTierConfig.model_validate(remote(MOONCAKE, mooncake={"pool_size": 4})).settings.pool_size == 4


def test_host_capacity_counts_the_header_room_a_remote_tier_adds_before_each_slot():
    """With a remote tier each host slot keeps a page for its record's header (one piece to the store):
    the capacity the YAML gives is what the slab takes, room included; without one, nothing changes."""
    with_remote, local = load_config(stack(HOST, REDIS)), load_config(stack(HOST))
    assert (with_remote.header_room, local.header_room) == (HEADER_ROOM, 0)
    block = with_remote.block_bytes
    assert capacity_in_blocks(with_remote.tiers[0], block, with_remote.header_room) == 8 * 2**20 // (block + 4096) == 7
    assert capacity_in_blocks(local.tiers[0], block, local.header_room) == 8
    disk = load_config(stack(HOST, DISK, REDIS))
    assert capacity_in_blocks(disk.tiers[1], block, disk.header_room) == capacity_in_blocks(disk.tiers[1], block)


def test_a_missing_mooncake_package_fails_the_start_not_every_later_lookup(monkeypatch, tmp_path):
    """Clients connect later, on their calls' threads; the package they need is checked when the stack is built."""
    from kvtier import KVTier

    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # import mooncake.store raises ImportError
    with pytest.raises(
        ConfigError,
        match=r"backend: mooncake needs the mooncake-transfer-engine-non-cuda package.*"
        r"pip install 'kvtier\[remote\]'",
    ):
        KVTier.open(stack(HOST, MOONCAKE))


def test_a_sealed_tier_loads_with_its_secrets_variables():
    tier = load_config(
        stack(HOST, remote(encryption="aes-gcm", encryption_key_env="KVTIER_SEAL", encryption_previous_key_env="OLD"))
    ).tiers[1]
    assert isinstance(tier, RemoteTierConfig)
    assert (tier.encryption, tier.encryption_key_env, tier.encryption_previous_key_env) == (
        "aes-gcm",
        "KVTIER_SEAL",
        "OLD",
    )
    assert load_config(stack(HOST, REDIS)).tiers[1].encryption == "none"


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"encryption": "aes-gcm"},
            "tiers[1].encryption_key_env: encryption: aes-gcm needs encryption_key_env, its secret's variable",
        ),
        (
            {"encryption": "aes-gcm", "encryption_key_env": "KVTIER_SEAL", "auth_key_env": "KVTIER_MAC"},
            "tiers[1].auth_key_env: a sealed record is authenticated by its seal (encryption: aes-gcm): remove "
            "auth_key_env",
        ),
        (
            {"encryption_key_env": "KVTIER_SEAL"},
            "tiers[1].encryption_key_env: encryption_key_env is set but encryption is none; set encryption: aes-gcm",
        ),
        ({"encryption": "aes-256"}, "tiers[1].encryption: "),
    ],
    ids=["no secret", "and a MAC", "secret without encryption", "unknown cipher"],
)
def test_a_sealing_mistake_is_one_error_naming_the_fix(changes, message):
    assert message in error_of(stack(HOST, remote(**changes)))
