"""Block keys under vLLM: the namespace covers what decides a block's KV bytes and is encoded without
ambiguity, new weights under the same local model folder make blocks on disk unreachable after a
restart, and ``key_secret_env`` keys the scheduler side's chains (a missing secret stops both roles).

Every test here runs on a model folder of its own (``model_dir`` below), with a weights file the
tests rewrite."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from huggingface_hub import ResolvedRevision
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from helpers.vllm_helpers import BLOCK, assert_loads_back, forget_gpu, prompt
from kvtier.connectors.vllm.namespace import engine_namespace, request_tenant
from kvtier.core.config import load_config
from kvtier.core.errors import ConfigError
from kvtier.core.keys import chain_hashes, tenant_of, tenant_tag

SECRET_ENV = "KVTIER_TEST_KEY_SECRET"
WEIGHTS = "pytorch_model.bin"  # a name vLLM does not parse while it reads the config


@pytest.fixture
def model_dir(model_dir, tmp_path):
    """A copy of the test model's folder with a weights file, owned by this test (it rewrites it)."""
    path = tmp_path / "model"
    path.mkdir()
    shutil.copy(model_dir / "config.json", path)
    (path / WEIGHTS).write_bytes(b"weights, first version" * 64)
    return path


def disk_config(path, **fields) -> dict:
    return {
        "placement": "write_through",
        **fields,
        "tiers": [
            {"medium": "host", "capacity_blocks": 4},
            {"medium": "disk", "capacity_blocks": 16, "path": str(path)},
        ],
    }


def fill_and_restart(make_engine, config: dict, between=lambda: None):
    """Store a 4-block prompt on disk, shut down, call ``between``, start a new engine on the same
    directory; returns (that engine, the prompt's tokens)."""
    tokens = prompt(4, 5, seed=1, prefix=1)
    before = make_engine(config)
    before.run([before.add(tokens, max_tokens=2)])
    assert before.kvtier.tier("disk").usage().used == 4
    before.shutdown()
    between()
    after = make_engine(config)
    forget_gpu(after)
    return after, tokens


def matched_blocks(engine, tokens: list[int]) -> int:
    matched, _ = engine.connector.get_num_new_matched_tokens(engine.add(tokens, max_tokens=2), 0)
    return matched // BLOCK


def test_lora_and_salt_cannot_spell_each_other(make_engine):
    """A name-and-separator encoding made these two requests share a namespace, so one tenant's salted
    blocks were served to another; each field is length-prefixed now."""
    sched = make_engine({"tiers": [{"medium": "host", "capacity_blocks": 4}]}).kvtier
    lora_spelling, salt_spelling = sched.request_namespace("x\0salt=y", "z"), sched.request_namespace("x", "y\0salt=z")
    assert lora_spelling != salt_spelling
    keys = [chain_hashes(prompt(2, 0, seed=0), BLOCK, ns) for ns in (lora_spelling, salt_spelling)]
    assert not set(keys[0]) & set(keys[1])
    others = [
        sched.request_namespace("x", "y", lora_path="/a"),
        sched.request_namespace("x", "y", lora_path="/b"),
        sched.request_namespace("", "s"),
        sched.request_namespace("s", ""),
        sched.request_namespace(),
    ]
    assert len({lora_spelling, salt_spelling, *others}) == 2 + len(others)


@pytest.mark.parametrize(
    "change",
    [
        lambda m: setattr(m, "revision", "v2"),
        lambda m: setattr(m, "revision", ResolvedRevision("b" * 40, initial="main")),  # main moved on
        lambda m: setattr(m, "quantization", "fp8"),
        lambda m: setattr(m, "dtype", "bfloat16"),
        lambda m: setattr(m, "model", m.model + "-other"),
    ],
    ids=["revision", "resolved revision", "quantization", "dtype", "model"],
)
def test_model_revision_and_quantization_change_the_namespace(make_config, kv_config, change):
    config = load_config({"tiers": [{"medium": "host", "capacity_blocks": 4}]})
    vllm_config = make_config({})
    vllm_config.model_config.revision = ResolvedRevision("a" * 40, initial="main")
    base = engine_namespace(vllm_config, kv_config(32), config)
    assert engine_namespace(vllm_config, kv_config(32), config) == base  # stable while nothing changes
    change(vllm_config.model_config)
    assert engine_namespace(vllm_config, kv_config(32), config) != base


def test_the_same_weights_are_found_after_a_restart(make_engine, tmp_path):
    after, tokens = fill_and_restart(make_engine, disk_config(tmp_path / "disk"))
    assert after.kvtier.tier("disk").usage().used == 4
    assert_loads_back(after, tokens, computed=5, blocks=4)


@pytest.mark.parametrize("rewrite", ["other size", "same size, other bytes and mtime"])
def test_new_weights_under_the_same_path_give_no_hit_after_a_restart(make_engine, model_dir, tmp_path, rewrite):
    """The model folder is the same path with other weights in it: blocks the old weights computed
    must never be served, so the new engine takes none of them back and computes every token."""
    weights = model_dir / WEIGHTS

    def new_weights():
        old = weights.stat()
        if rewrite == "other size":
            weights.write_bytes(b"weights, second version" * 80)
        else:
            weights.write_bytes(b"W" * old.st_size)
            os.utime(weights, ns=(old.st_atime_ns, old.st_mtime_ns + 1_000_000_000))

    after, tokens = fill_and_restart(make_engine, disk_config(tmp_path / "disk"), new_weights)
    assert after.kvtier.tier("disk").usage().used == 0
    assert matched_blocks(after, tokens) == 0


def test_keys_are_keyed_with_the_secret_and_only_it_finds_them(make_engine, tmp_path, monkeypatch):
    """The scheduler side keys its chains with the secret; a restart with the same secret finds the
    blocks, one with another secret finds none (documented: changing the secret empties the cache)."""
    monkeypatch.setenv(SECRET_ENV, "first deployment secret")
    config = disk_config(tmp_path / "disk", key_secret_env=SECRET_ENV)
    after, tokens = fill_and_restart(make_engine, config)
    namespace = after.kvtier.request_namespace()
    keyed = chain_hashes(tokens, BLOCK, namespace, secret=b"first deployment secret")
    assert [after.kvtier.tier("disk").state(k).value for k in keyed] == ["ready"] * 4
    assert not any(after.kvtier.tier("disk").state(k).value == "ready" for k in chain_hashes(tokens, BLOCK, namespace))
    assert matched_blocks(after, tokens) == 4
    after.shutdown()

    monkeypatch.setenv(SECRET_ENV, "another deployment secret")
    other = make_engine(config)
    assert matched_blocks(other, tokens) == 0


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_a_missing_secret_stops_both_roles(make_config, kv_config, monkeypatch, role):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    vllm_config = make_config({"key_secret_env": SECRET_ENV, "tiers": [{"medium": "host", "capacity_blocks": 4}]})
    with pytest.raises(ConfigError, match=f"environment variable {SECRET_ENV} is unset"):
        KVConnectorFactory.create_connector(vllm_config, role, kv_config(32))


def test_the_namespace_is_json_naming_every_field(make_config, kv_config, model_dir):
    """Readable for an operator (``kvtier inspect`` shows its digest), and complete."""
    vllm_config = make_config({})
    fields = json.loads(
        engine_namespace(
            vllm_config,
            kv_config(32),
            load_config({"namespace": "prod", "tiers": [{"medium": "host", "capacity_blocks": 4}]}),
        )
    )
    assert set(fields) == {
        "model",
        "revision",
        "weights",
        "quantization",
        "dtype",
        "cache_dtype",
        "layout",
        "tp",
        "block_size",
        "namespace",
    }
    assert fields["model"] == str(model_dir) and fields["namespace"] == "prod" and len(fields["weights"]) == 32


def test_a_cache_salt_is_a_tenant_whose_blocks_no_other_salt_finds(make_engine, monkeypatch):
    """vLLM's ``cache_salt`` names the tenant: its keys begin with the salt's tag (sealed under its key
    where a tier seals), and the same prompt with another salt, or none, finds none of its blocks."""
    monkeypatch.setenv(SECRET_ENV, "a key-hashing secret of 32 bytes")
    engine = make_engine(
        {
            "placement": "write_through",
            "key_secret_env": SECRET_ENV,
            "tiers": [{"medium": "host", "capacity_blocks": 8}],
        }
    )
    tokens = prompt(4, 7, seed=3, prefix=1)
    engine.run([engine.add(tokens, max_tokens=2, cache_salt="alice")])
    forget_gpu(engine)
    held = engine.kvtier.tier("host").ready_keys()
    assert held and {tenant_of(key) for key in held} == {tenant_tag("alice", b"a key-hashing secret of 32 bytes")}
    for salt in ("bob", None):
        request = engine.add(tokens, max_tokens=2, cache_salt=salt)
        assert engine.connector.get_num_new_matched_tokens(request, 0)[0] == 0
    request = engine.add(tokens, max_tokens=2, cache_salt="alice")
    assert engine.connector.get_num_new_matched_tokens(request, 0)[0] == 4 * BLOCK
    assert request_tenant("adapter", "") == "lora:adapter" and request_tenant("adapter", "s") == "s"
    assert request_tenant() == ""
