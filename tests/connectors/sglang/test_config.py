"""What stops SGLang at start: the extra config and the kvtier YAML it names, checked when SGLang's storage
factory creates the backend, each mistake one ConfigError line naming the key, never a backend that
silently stores nothing. And SGLang's own fault injector over kvtier's backend: random failures and
delays on every call, and still never a wrong byte or an exception.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageFailureInjector
from sglang.srt.mem_cache.storage import StorageBackendFactory

from helpers.sglang_pools import (
    extra_config,
    fill,
    indices,
    keys,
    mha_host_pool,
    open_backend,
    page_bytes,
    storage_config,
    zero_pages,
)
from kvtier.connectors.sglang.settings import backend_settings, stack_config
from kvtier.core.errors import ConfigError


def create(config, host_pool=None, **extra):
    pool = host_pool or mha_host_pool()
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra_config(config, **extra), pool), pool)
    backend.register_mem_pool_host(pool)
    return backend


def disk(tmp_path) -> dict:
    return {"medium": "disk", "path": str(tmp_path / "kv"), "capacity": "4MiB"}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"prefetch_thresold": 4}, r"unknown key 'prefetch_thresold'; allowed: backend_name, module_path"),
        ({"interface_v1": "0"}, r"^hicache-storage-backend-extra-config: interface_v1: "),
    ],
)
def test_a_mistake_in_the_extra_config_names_the_key(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        create({"tiers": [disk(tmp_path)]}, **extra)


def test_an_extra_config_without_kvtiers_config_says_what_to_add():
    pool = mha_host_pool()
    extra = extra_config({})
    del extra["config"]
    with pytest.raises(ConfigError, match=r'needs "config": the path of a kvtier YAML file'):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra, pool), pool)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"tiers": [{"medium": "disk", "path": "/tmp/x", "capacity": "lots"}]},
            r"tiers\[0\]\.capacity: 'lots' is not a size",
        ),
        (
            {"tiers": [{"medium": "gpu"}, {"medium": "host", "capacity": "1GiB"}]},
            r"tiers\[0\]\.medium: gpu: SGLang keeps GPU",
        ),
        (
            {"tiers": [{"medium": "host", "capacity": "1GiB"}]},
            r"tiers\[0\]\.medium: host: under SGLang a host tier only",
        ),
        (
            {"block_bytes": "64KiB", "tiers": [{"medium": "disk", "path": "/tmp/x", "capacity": "1GiB"}]},
            r"^block_bytes: under SGLang a block is one page",
        ),
        (
            {"tiers": [{"medium": "remote", "backend": "redis", "redis": {"url": "redis://127.0.0.1:1"}}]},
            r"tiers\[0\]\.medium: a remote tier needs a host tier above it",
        ),
    ],
)
def test_a_tier_sglang_cannot_feed_or_a_yaml_that_does_not_validate_is_refused(config, message):
    with pytest.raises(ConfigError, match=message):
        create(config)


def test_a_yaml_file_is_read_and_its_mistakes_named_with_the_file(tmp_path):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(f"tiers:\n  - medium: disk\n    path: {tmp_path / 'kv'}\n    capacity: 4MiB\n")
    bad.write_text(f"tiers:\n  - medium: disk\n    path: {tmp_path / 'kv'}\n    capacty: 4MiB\n")
    backend = create(str(good))
    assert backend.stack.tiers[0].medium == "disk"
    backend.close()
    with pytest.raises(ConfigError, match=rf"^{bad}: tiers\[0\]\.capacty: unknown key 'capacty'"):
        create(str(bad))


def test_an_unset_key_secret_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("KVTIER_TEST_SECRET", raising=False)
    with pytest.raises(ConfigError, match=r"^key_secret_env: the environment variable KVTIER_TEST_SECRET is unset"):
        create({"key_secret_env": "KVTIER_TEST_SECRET", "tiers": [disk(tmp_path)]})


def test_a_disk_tier_for_an_mla_model_on_several_ranks_is_refused(tmp_path):
    pool = mha_host_pool()
    extra = extra_config({"tiers": [disk(tmp_path)]})
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.medium: disk: an MLA model keeps one copy"):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra, pool, mla=True, tp_size=2), pool)


def test_pages_stored_under_one_key_secret_are_not_found_under_another(tmp_path, monkeypatch):
    config = {"key_secret_env": "KVTIER_TEST_SECRET", "tiers": [disk(tmp_path)]}
    pool = mha_host_pool()
    fill(pool, 1)
    for secret, hits in (("a" * 32, None), ("b" * 32, 0), ("a" * 32, 4)):
        monkeypatch.setenv("KVTIER_TEST_SECRET", secret)
        backend = open_backend(pool, config)
        try:
            if hits is None:
                assert backend.batch_set_v1(keys(4), indices(range(4))) == [True] * 4
            else:
                assert backend.batch_exists(keys(4)) == hits
        finally:
            backend.close()


def test_sglangs_fault_injector_never_yields_a_wrong_byte(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.01")
    pool = mha_host_pool()
    backend = create({"tiers": [disk(tmp_path)]}, host_pool=pool)
    assert isinstance(backend, HiCacheStorageFailureInjector)
    try:
        fill(pool, 2)
        truth = {name: page_bytes(pool, p) for name, p in zip(keys(32), range(32), strict=True)}
        outcomes = {"stored": 0, "refused": 0, "loaded": 0, "failed": 0}
        for start in range(0, 32, 4):  # as SGLang's backup would be, each batch retried until it lands
            for _ in range(20):
                stored = all(backend.batch_set_v1(keys(32)[start : start + 4], indices(range(start, start + 4))))
                outcomes["stored" if stored else "refused"] += 1
                if stored:
                    break
        for _ in range(20):
            zero_pages(pool, range(64, 72))
            names = keys(32)[:8]
            hits = backend.batch_exists(names)
            loaded = backend.batch_get_v1(names[: max(hits, 1)], indices(range(64, 64 + max(hits, 1))))
            for i, ok in enumerate(loaded):
                if ok:
                    assert torch.equal(page_bytes(pool, 64 + i), truth[names[i]])
            outcomes["loaded" if any(loaded) else "failed"] += 1
        # ~50 calls at 30%: some failed (1 - 0.7^50) and some loads went through (1 - 0.51^20)
        assert outcomes["refused"] + outcomes["failed"] and outcomes["loaded"], outcomes
    finally:
        backend.close()


@pytest.mark.parametrize("name", ["disk.yaml", "shared.yaml"])
def test_the_examples_are_configurations_sglang_accepts(name):
    example = Path(__file__).resolve().parents[3] / "examples" / "sglang" / name
    config = stack_config(backend_settings(extra_config(str(example))))
    assert config.tiers[-1].medium == ("disk" if name == "disk.yaml" else "remote")


def test_a_hybrid_models_second_pool_is_refused_at_start_naming_it(tmp_path):
    """SGLang's hybrid controller registers every pool of a hybrid model (v2); kvtier takes the KV pool it already
    holds and refuses any other rather than store KV without the state that goes with it."""
    pool = mha_host_pool()
    backend = open_backend(pool, {"tiers": [disk(tmp_path)]})
    try:
        backend.register_mem_host_pool_v2(pool, "kv")  # the KV pool itself: accepted
        with pytest.raises(ConfigError, match=r"this model also has the host pool 'swa' \(MHATokenToKVPoolHost\)"):
            backend.register_mem_host_pool_v2(mha_host_pool(), "swa")
    finally:
        backend.close()


def test_a_first_tier_smaller_than_one_of_sglangs_batches_is_refused(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"^tiers\[0\]\.capacity_blocks: holds 80 of SGLang's pages \(768B each\), "
        r"fewer than the 128 SGLang stores in one call; give at least 1MiB",
    ):
        create({"tiers": [{"medium": "disk", "path": str(tmp_path / "kv"), "capacity_blocks": 80}]})
