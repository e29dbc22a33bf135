"""A node tier that seals its blocks (``encryption: aes-gcm``), against a real node daemon process: every
engine maps the daemon's whole slab, so sealing is what keeps one deployment's (or tenant's) blocks
from another engine on the machine.

What it shows: engines holding the secret share blocks bit-exact, and the slab (read raw, as any
process that maps it could) holds none of their bytes; an engine with another secret, or a plain one,
finds none of them and leaves them alone (they are under a namespace of the sealing key's); a slot's
bytes changed, or another block's sealed bytes copied over them, do not open: a miss, nothing in the
caller's memory, the block dropped; a daemon whose slots have no room for the seal is one error at start;
during a rotation an engine given the previous secret finds and opens what engines still on it stored,
and stores only under the new one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from helpers.node_blocks import TOKENS, prompt
from helpers.node_daemon import node_daemon
from kvtier import KVTier
from kvtier.core.errors import ConfigError
from kvtier.tiers.node.protocol import Op

BLOCK = 64 * 1024
SECRET, OTHER = "KVTIER_TEST_NODE_SEAL", "KVTIER_TEST_NODE_OTHER_SEAL"
PLANTED = b"PLANTED-KV-BYTES-0123456789abcdef"


@pytest.fixture(autouse=True)
def secrets(monkeypatch):
    monkeypatch.setenv(SECRET, "a node sealing secret of 32 byte")
    monkeypatch.setenv(OTHER, "another node sealing secret, 32b")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """A daemon whose slots hold a 64 KiB block and its seal (68 KiB)."""
    with node_daemon(tmp_path_factory.mktemp("node"), capacity="4MiB", block_bytes="68KiB") as running:
        yield running


def stack(daemon, secret: str | None = SECRET, previous: str | None = None) -> dict:
    sealing = {"encryption": "aes-gcm", "encryption_key_env": secret, "encryption_previous_key_env": previous}
    tier = daemon.tier() if secret is None else daemon.tier(**{k: v for k, v in sealing.items() if v})
    return {"block_tokens": TOKENS, "block_bytes": BLOCK, "tiers": [tier]}


def blocks(n: int, seed: int) -> np.ndarray:
    data = np.random.default_rng(seed).integers(0, 256, (n, BLOCK), dtype=np.uint8)
    data[:, 3000 : 3000 + len(PLANTED)] = np.frombuffer(PLANTED, np.uint8)
    return data


def slots_of(kv: KVTier, tokens: list[int]) -> list[int]:
    """The slots the daemon holds ``tokens``' blocks in (pinned and released again)."""
    node = kv.stack.tiers[0].storage
    names = node.node_keys(kv.keys(tokens))
    (pinned,), epoch, _ = node.client.call(Op.PIN, names, node.stored_bytes)
    node.client.post(Op.RELEASE, epoch, names)
    return [slot for slot, _ in pinned]


def test_engines_with_the_secret_share_sealed_blocks_and_the_slab_holds_none_of_their_bytes(daemon):
    tokens, data = prompt(4, start=100), blocks(4, seed=1)
    with KVTier.open(stack(daemon)) as writer, KVTier.open(stack(daemon)) as reader:
        assert writer.store_now(tokens, data).stored == 4
        writer.wait_idle(10)
        out = np.zeros_like(data)
        result = reader.load_now(tokens, out)
        assert (result.loaded, result.failed) == (4, []) and np.array_equal(out, data)
    slab = Path(daemon.slab).read_bytes()
    assert PLANTED not in slab and data[0, :64].tobytes() not in slab


@pytest.mark.parametrize("secret", [OTHER, None], ids=["another secret", "plain"])
def test_another_secret_or_a_plain_engine_finds_nothing_and_leaves_the_blocks_alone(daemon, secret):
    tokens, data = prompt(3, start=200), blocks(3, seed=2)
    with KVTier.open(stack(daemon)) as writer:
        assert writer.store_now(tokens, data).stored == 3
        writer.wait_idle(10)
        with KVTier.open(stack(daemon, secret)) as other:
            assert other.lookup(tokens) == 0
            out = np.zeros_like(data)
            assert other.load_now(tokens, out).loaded == 0 and not out.any()
        with KVTier.open(stack(daemon)) as reader:  # still there, still good
            out = np.zeros_like(data)
            assert reader.load_now(tokens, out).loaded == 3 and np.array_equal(out, data)


@pytest.mark.parametrize("change", ["a flipped byte", "another block's sealed bytes"])
def test_a_slot_changed_by_a_process_that_maps_the_slab_does_not_open(daemon, change):
    tokens, data = prompt(3, start=300), blocks(3, seed=3)
    with KVTier.open(stack(daemon)) as writer, KVTier.open(stack(daemon)) as reader:
        assert writer.store_now(tokens, data).stored == 3
        writer.wait_idle(10)
        view = writer.stack.tiers[0].storage.client._view
        slots = slots_of(writer, tokens)
        stored = writer.stack.tiers[0].storage.stored_bytes
        if change == "a flipped byte":
            view.block(slots[1], stored)[1234] ^= 0x01
        else:  # block 2's slot, seal and all, copied over block 1's: its own header still names block 1
            view.block(slots[1], stored)[:] = view.block(slots[2], stored)
        before = daemon.stats()["dropped"]
        out = np.zeros_like(data)
        result = reader.load_now(tokens, out)
        assert result.failed == [1] and not out[1].any()  # nothing of it reached the caller
        assert np.array_equal(out[0], data[0])
        assert daemon.stats()["dropped"] == before + 1  # dropped for everyone


def test_a_daemon_whose_slots_have_no_room_for_the_seal_is_one_error_at_start(tmp_path):
    with node_daemon(tmp_path, capacity="1MiB", block_bytes="64KiB") as small:
        with pytest.raises(ConfigError, match=r"65568 sealed, do not fit the daemon's slots of 65536 bytes .*65568"):
            KVTier.open(stack(small))
        with KVTier.open(stack(small, secret=None)) as plain:  # (a plain engine's blocks fit)
            assert plain.store_now(prompt(1), blocks(1, seed=4)).stored == 1


def test_during_a_rotation_blocks_under_the_previous_secret_are_found_and_new_ones_go_under_the_current(daemon):
    old_tokens, old = prompt(3, start=400), blocks(3, seed=4)
    new_tokens, new = prompt(2, start=500), blocks(2, seed=5)
    with KVTier.open(stack(daemon, OTHER)) as before, KVTier.open(stack(daemon, SECRET, previous=OTHER)) as rotating:
        assert before.store_now(old_tokens, old).stored == 3
        before.wait_idle(10)
        out = np.zeros_like(old)
        assert rotating.lookup(old_tokens) == 3
        assert rotating.load_now(old_tokens, out).loaded == 3 and np.array_equal(out, old)
        # found again by pinning, without what the lookup said: the current namespace first, then the previous
        node = rotating.stack.tiers[0].storage
        keys = rotating.keys(old_tokens)
        node.forget(keys)
        out[:] = 0
        assert rotating.load_now(old_tokens, out).loaded == 3 and np.array_equal(out, old)
        assert [node.location(key).name for key in keys] == node.node_keys(keys, node.namespaces[1])

        assert rotating.store_now(new_tokens, new).stored == 2
        rotating.wait_idle(10)
        assert before.lookup(new_tokens) == 0  # stored under the current secret only
    with KVTier.open(stack(daemon, SECRET)) as after:  # the rotation over: the new secret alone
        out = np.zeros_like(new)
        assert after.load_now(new_tokens, out).loaded == 2 and np.array_equal(out, new)
        assert after.lookup(old_tokens) == 0
