"""The plain Python API as another engine uses it: open from YAML, a dict or the default; store,
look up and load by token ids or by keys; the asyncio flavour; bad buffers and a closed stack raise
clear errors; blocks come back bit-exact and the caller may drop its buffers right after store()."""

import asyncio
import gc
import subprocess
import sys

import numpy as np
import pytest
import torch

import kvtier
from kvtier import ClosedError, ConfigError, KVTier, TransferError, chain_hashes
from kvtier.core.storage import buffer_storage
from kvtier.transfers.cuda import cuda_available

CONFIG = {
    "block_tokens": 4,
    "block_bytes": "4KiB",
    "fragments": 2,
    "namespace": "test-model",
    "tiers": [
        {"medium": "gpu", "capacity_blocks": 4, "eviction": "lru"},
        {"medium": "host", "capacity": "64KiB", "eviction": "lru", "watermark": {"high": 0.9, "low": 0.5}},
    ],
}


def blocks(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, 4096), dtype=np.uint8)


def test_store_lookup_load_by_token_ids():
    tokens = list(range(10))  # two full blocks of 4 tokens; the last two tokens get no key
    data = blocks(2)
    with KVTier.open(CONFIG) as kv:
        assert kv.lookup(tokens) == 0
        result = kv.store(tokens, data).result(10)
        assert result.stored == 2
        assert kv.lookup(tokens) == 2
        assert kv.lookup(tokens[:4] + [99, 98, 97, 96]) == 1, "only the shared prefix block matches"
        out = np.zeros_like(data)
        loaded = kv.load(tokens, out).result(10)
        assert (loaded.hits, loaded.loaded, loaded.failed) == (2, 2, [])
        assert np.array_equal(out, data)


def test_keys_use_the_configured_block_size_and_namespace():
    with KVTier.open(CONFIG) as kv:
        assert kv.keys(list(range(8))) == chain_hashes(list(range(8)), 4, "test-model")
        given = [b"k" * 16, b"j" * 16]
        assert kv.keys(given) == given


def test_keys_are_keyed_with_the_secret_of_key_secret_env(monkeypatch):
    monkeypatch.setenv("KVTIER_TEST_SECRET", "a-deployment-secret-of-32-bytes!")
    tokens, data = list(range(8)), blocks(2, seed=4)
    with KVTier.open(dict(CONFIG, key_secret_env="KVTIER_TEST_SECRET")) as kv:
        keys = kv.keys(tokens)
        assert keys == chain_hashes(tokens, 4, "test-model", secret=b"a-deployment-secret-of-32-bytes!")
        assert not set(keys) & set(chain_hashes(tokens, 4, "test-model"))  # unguessable without the secret
        kv.store(tokens, data).result(10)
        out = np.zeros_like(data)
        assert kv.load(tokens, out).result(10).loaded == 2 and np.array_equal(out, data)


@pytest.mark.parametrize("value", [None, "", "short"])
def test_open_refuses_a_missing_or_short_key_secret(monkeypatch, value):
    monkeypatch.delenv("KVTIER_TEST_SECRET", raising=False)
    if value is not None:
        monkeypatch.setenv("KVTIER_TEST_SECRET", value)
    with pytest.raises(ConfigError, match="environment variable KVTIER_TEST_SECRET"):
        KVTier.open(dict(CONFIG, key_secret_env="KVTIER_TEST_SECRET"))


@pytest.mark.parametrize(
    "bad, error, message",
    [
        (b"k" * 100, ValueError, "must be 1 to 64 bytes, got 100 bytes"),
        (b"", ValueError, "must be 1 to 64 bytes, got 0 bytes"),
        ("not-bytes", TypeError, "must be bytes, got str"),
    ],
)
def test_caller_keys_no_tier_keeps_whole_are_refused(bad, error, message):
    """A key longer than MAX_KEY_BYTES used to be stored, shown as a hit and never loadable; such keys,
    empty ones and non-bytes are refused by every call, and nothing is stored."""
    with KVTier.open(CONFIG) as kv:
        for call in (
            lambda keys: kv.store(keys, blocks(2)),
            kv.lookup,
            lambda keys: kv.load(keys, np.zeros((2, 4096), np.uint8)),
        ):
            with pytest.raises(error, match=message):
                call([b"k" * 16, bad])
        assert kv.stats()["gpu"]["used"] == 0


def test_64_byte_keys_round_trip():
    keys, data = [b"a" * 64, b"b" * 64], blocks(2, seed=5)
    with KVTier.open(CONFIG) as kv:
        assert kv.store(keys, data).result(10).stored == 2
        assert kv.lookup(keys) == 2
        out = np.zeros_like(data)
        assert kv.load(keys, out).result(10).loaded == 2 and np.array_equal(out, data)


def test_a_stack_used_directly_refuses_long_keys_and_misses_on_lookup():
    """Direct TierStack users get the same refusal from the tier (``Tier.reserve``); a lookup of a key
    no tier can hold simply misses."""
    with KVTier.open(CONFIG) as kv:
        with pytest.raises(ValueError, match="got 100 bytes"):
            kv.stack.store([b"k" * 100], buffer_storage(blocks(1), kv.layout), [0])
        assert kv.stack.lookup([b"k" * 100]).hits == 0
        assert kv.stats()["gpu"]["used"] == 0


def test_caller_may_drop_its_buffer_right_after_store():
    data = blocks(3, seed=1)
    expected = data.copy()
    with KVTier.open(CONFIG) as kv:
        future = kv.store(list(range(12)), data.copy())  # the only reference is inside kvtier
        gc.collect()
        future.result(10)
        out = np.zeros_like(expected)
        kv.load(list(range(12)), out).result(10)
        assert np.array_equal(out, expected)


def test_torch_tensors_and_lists_of_arrays_work_as_blocks():
    data = blocks(2, seed=2)
    with KVTier.open(CONFIG) as kv:
        kv.store(list(range(8)), [torch.from_numpy(data[0].copy()), data[1].copy()]).result(10)
        out = torch.zeros((2, 4096), dtype=torch.uint8)
        kv.load(list(range(8)), out).result(10)
        assert np.array_equal(out.numpy(), data)


def test_eviction_and_demotion_through_the_api():
    with KVTier.open(CONFIG) as kv:
        seqs = [[1000 * s + t for t in range(8)] for s in range(6)]  # 12 blocks > 4 GPU slots
        for s, tokens in enumerate(seqs):
            kv.store(tokens, blocks(2, seed=10 + s)).result(10)
        kv.wait_idle()
        stats = kv.stats()
        assert stats["gpu"]["demoted"] > 0 and stats["gpu"]["used"] <= 4
        for s, tokens in enumerate(seqs):
            out = np.zeros((2, 4096), np.uint8)
            loaded = kv.load(tokens, out).result(10)
            assert loaded.loaded == 2 and np.array_equal(out, blocks(2, seed=10 + s))


def test_asyncio_flavour():
    async def main(kv):
        data = blocks(1, seed=3)
        await kv.astore(list(range(4)), data)
        assert await kv.alookup(list(range(4))) == 1
        out = np.zeros_like(data)
        loaded = await kv.aload(list(range(4)), out)
        return loaded, out, data

    with KVTier.open(CONFIG) as kv:
        loaded, out, data = asyncio.run(main(kv))
    assert loaded.loaded == 1 and np.array_equal(out, data)


def test_bad_buffers_raise_clear_errors():
    with KVTier.open(CONFIG) as kv:
        with pytest.raises(TransferError, match="not a whole number of 4096-byte blocks"):
            kv.store(list(range(4)), np.zeros(100, np.uint8))
        with pytest.raises(ValueError, match="2 keys but only 1 blocks given"):
            kv.store(list(range(8)), blocks(1))
        read_only = blocks(1)
        read_only.flags.writeable = False
        kv.store(list(range(4)), blocks(1)).result(10)
        with pytest.raises(TransferError, match="read-only"):
            kv.load(list(range(4)), read_only)
        with pytest.raises(TransferError, match="C-contiguous"):
            kv.load(list(range(4)), np.zeros((4096, 2), np.uint8)[:, 0])


def test_closed_stack_raises():
    kv = KVTier.open(CONFIG)
    kv.close()
    with pytest.raises(ClosedError):
        kv.store(list(range(4)), blocks(1))
    with pytest.raises(ClosedError):
        kv.lookup(list(range(4)))


def test_default_config_opens_and_describes_its_tiers():
    with KVTier.open() as kv:
        text = kv.describe()
    assert "CPU tensors standing in for a GPU (no CUDA)" in text  # tests outside tests/gpu keep GPU tiers on CPU
    assert ("pinned host memory" if cuda_available() else "pageable host memory (no CUDA)") in text


def test_standalone_stack_needs_gpu_capacity():
    config = dict(CONFIG, tiers=[{"medium": "gpu"}, CONFIG["tiers"][1]])
    with pytest.raises(ConfigError, match="give capacity or capacity_blocks"):
        KVTier.open(config)


def test_installed_package_exposes_kvtier_only(tmp_path):
    """From outside the repository, kvtier's modules import and no generic top-level name does."""
    script = (
        "import importlib.util, kvtier.core.tier, kvtier.tiers.host, kvtier.policies.lru, kvtier.api\n"
        "import kvtier.connectors.extra_config\n"
        "print([n for n in ('core', 'tiers', 'policies', 'connectors') if importlib.util.find_spec(n)])\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert kvtier.KVTier is KVTier
