"""Blocks sealed at rest (``kvtier.core.sealing``): real AES-256-GCM from the ``cryptography`` package over
real bytes. A sealed block opens bit-exact under its own tenant's key and identity only; its ciphertext
holds none of its bytes; any changed byte, another key, namespace or tenant, a secret of another
deployment fail to open and leave nothing unauthenticated behind; a previous secret opens during a
rotation and never seals."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvtier.core.errors import ConfigError
from kvtier.core.keys import TENANT_TAG_BYTES, chain_hashes, tenant_tag
from kvtier.core.sealing import SEAL_BYTES, TAG_BYTES, SealingKeys

SECRET = b"a deployment secret of 32 bytes!"
OTHER_SECRET = b"another deployment's secret, 32b"
TAG_A, TAG_B = tenant_tag("tenant-a", SECRET), tenant_tag("tenant-b", SECRET)
IDENTITY = b"namespace digest" + b"block key 16 byt"
PLANTED = b"PLANTED-KV-BYTES-0123456789abcdef"


def block(rng, size: int = 64 * 1024) -> np.ndarray:
    data = rng.integers(0, 256, size, dtype=np.uint8)
    data[1000 : 1000 + len(PLANTED)] = np.frombuffer(PLANTED, np.uint8)
    return data


def seal(keys: SealingKeys, data: np.ndarray, tenant: bytes = b"", identity: bytes = IDENTITY):
    sealed = np.empty_like(data)
    return sealed, keys.sealer(tenant).seal([data], [sealed], identity)


def opens(keys: SealingKeys, sealed: np.ndarray, seal_: bytes, tenant: bytes = b"", identity: bytes = IDENTITY):
    out = np.full_like(sealed, 0xAB)
    return keys.sealer(tenant).open([sealed], [out], seal_, identity), out


def test_a_sealed_block_opens_bit_exact_and_its_ciphertext_holds_none_of_its_bytes(rng):
    keys = SealingKeys(SECRET)
    data = block(rng)
    sealed, seal_ = seal(keys, data)
    assert len(seal_) == SEAL_BYTES
    assert PLANTED not in sealed.tobytes() and not np.array_equal(sealed, data)
    ok, out = opens(keys, sealed, seal_)
    assert ok and np.array_equal(out, data)


def test_every_seal_takes_a_fresh_nonce(rng):
    keys = SealingKeys(SECRET)
    data = block(rng)
    (first, seal1), (second, seal2) = seal(keys, data), seal(keys, data)
    assert seal1 != seal2 and not np.array_equal(first, second)


@pytest.mark.parametrize(
    "change",
    ["identity", "tenant", "secret", "ciphertext byte", "tag byte", "nonce byte", "key id", "short seal"],
)
def test_a_block_moved_or_changed_fails_to_open_and_leaves_nothing_behind(rng, change):
    keys = SealingKeys(SECRET)
    data = block(rng)
    sealed, seal_ = seal(keys, data, tenant=TAG_A)
    tenant, identity, opener = TAG_A, IDENTITY, keys
    if change == "identity":  # (copied to another key, or another namespace)
        identity = IDENTITY[:-1] + b"\x00"
    elif change == "tenant":
        tenant = TAG_B
    elif change == "secret":
        opener = SealingKeys(OTHER_SECRET)
    elif change == "ciphertext byte":
        sealed[12345] ^= 0x01
    else:
        at = {"tag byte": SEAL_BYTES - 1, "nonce byte": 5, "key id": 0}.get(change)
        seal_ = seal_[:-1] if at is None else seal_[:at] + bytes([seal_[at] ^ 0x80]) + seal_[at + 1 :]
    ok, out = opens(opener, sealed, seal_, tenant, identity)
    assert not ok
    assert not out.any()  # zeroed: nothing unauthenticated stays where the block was expected
    assert PLANTED not in out.tobytes()


def test_a_previous_secret_opens_during_a_rotation_and_never_seals(rng):
    data = block(rng)
    old_sealed, old_seal = seal(SealingKeys(OTHER_SECRET), data)
    rotating = SealingKeys(SECRET, previous=OTHER_SECRET)
    ok, out = opens(rotating, old_sealed, old_seal)
    assert ok and np.array_equal(out, data)
    new_sealed, new_seal = seal(rotating, data)
    assert opens(SealingKeys(SECRET), new_sealed, new_seal)[0]  # sealed under the current secret
    assert not opens(SealingKeys(OTHER_SECRET), new_sealed, new_seal)[0]
    assert not opens(SealingKeys(SECRET), old_sealed, old_seal)[0]  # the rotation over: old blocks are misses


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(1, 4095), max_size=6), in_place=st.booleans())
def test_pieces_seal_and_open_as_one_block_wherever_they_are_cut(cuts, in_place):
    data = np.random.default_rng(len(cuts)).integers(0, 256, 4096, dtype=np.uint8)
    bounds = [0, *sorted(set(cuts)), 4096]
    pieces = [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    keys = SealingKeys(SECRET)
    whole, seal_ = seal(keys, data)
    assert opens(keys, whole, seal_)[0]
    sealed = whole.copy()
    sealed_pieces = [sealed[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    out = sealed if in_place else np.zeros_like(data)
    out_pieces = [out[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert keys.sealer().open(sealed_pieces, out_pieces, seal_, IDENTITY)
    assert np.array_equal(out, data)
    resealed = np.empty_like(data)
    seal2 = keys.sealer().seal(pieces, [resealed[a:b] for a, b in zip(bounds, bounds[1:], strict=False)], IDENTITY)
    assert opens(keys, resealed, seal2)[0]
    into = np.empty_like(data)
    seal3 = keys.sealer().seal_into(pieces, into, IDENTITY)  # the pieces into one contiguous target
    assert opens(keys, into, seal3)[0]


@pytest.mark.parametrize("pieces", [1, 3])
def test_a_target_with_room_for_the_tag_seals_alike_and_keeps_the_block_within_its_length(rng, pieces):
    """One piece with a tag's room after it seals in one call of the cipher, several stream: either way
    the block opens, and nothing past the block's length and the tag's room is touched."""
    data = block(rng, 8192)
    cut = np.array_split(data, pieces)
    keys = SealingKeys(SECRET)
    target = np.full(8192 + TAG_BYTES + 100, 0xCD, np.uint8)
    seal_ = keys.sealer().seal_into(cut, target[: 8192 + TAG_BYTES], IDENTITY)
    assert (target[8192 + TAG_BYTES :] == 0xCD).all()
    assert PLANTED not in target.tobytes()
    ok, out = opens(keys, target[:8192].copy(), seal_)
    assert ok and np.array_equal(out, data)
    assert not opens(keys, target[:8192].copy(), seal_, identity=IDENTITY[::-1])[0]


def test_pieces_of_unequal_lengths_are_refused(rng):
    data = block(rng, 4096)
    with pytest.raises(ValueError, match="as long as its source"):
        SealingKeys(SECRET).sealer().seal([data], [np.empty(4095, np.uint8)], IDENTITY)
    with pytest.raises(ValueError, match="sealing 4096 bytes into 4097"):
        SealingKeys(SECRET).sealer().seal_into([data[:1000], data[1000:]], np.empty(4097, np.uint8), IDENTITY)
    with pytest.raises(ValueError, match=f"sealing 4096 bytes into {4096 + TAG_BYTES + 1}"):
        SealingKeys(SECRET).sealer().seal_into([data], np.empty(4096 + TAG_BYTES + 1, np.uint8), IDENTITY)


@pytest.mark.parametrize(("value", "message"), [(None, "unset or empty"), ("short", "fewer than the 16")])
def test_a_missing_or_short_secret_is_one_clear_error(monkeypatch, value, message):
    monkeypatch.delenv("KVTIER_TEST_SEAL", raising=False)
    if value is not None:
        monkeypatch.setenv("KVTIER_TEST_SEAL", value)
    with pytest.raises(ConfigError, match=f"encryption_key_env: .*{message}"):
        SealingKeys.from_env("KVTIER_TEST_SEAL")
    monkeypatch.setenv("KVTIER_TEST_SEAL", SECRET.decode())
    with pytest.raises(ConfigError, match="encryption_previous_key_env: the environment variable KVTIER_NONE"):
        SealingKeys.from_env("KVTIER_TEST_SEAL", "KVTIER_NONE")
    assert SealingKeys.from_env("KVTIER_TEST_SEAL").current == SECRET


@pytest.mark.parametrize("installed", ["none", "before 47"])
def test_a_cryptography_package_missing_or_too_old_is_one_clear_error(monkeypatch, installed):
    """The one-call seal needs ``AESGCM.encrypt_into`` (cryptography 47): an older package is refused at
    start, not found out at the first store."""
    monkeypatch.setenv("KVTIER_TEST_SEAL", SECRET.decode())
    old = types.ModuleType("cryptography.hazmat.primitives.ciphers.aead")
    old.AESGCM = type("AESGCM", (), {"encrypt": lambda self, *a: b""})  # type: ignore[attr-defined]
    monkeypatch.setitem(
        sys.modules, "cryptography.hazmat.primitives.ciphers.aead", None if installed == "none" else old
    )
    with pytest.raises(ConfigError, match="needs the cryptography package, 47 or later"):
        SealingKeys.from_env("KVTIER_TEST_SEAL")


def test_tenants_get_keys_of_their_own_derived_once_and_named_by_their_block_keys():
    keys = SealingKeys(SECRET)
    assert keys.sealer(TAG_A) is keys.sealer(TAG_A)
    assert keys.sealer(TAG_A).key_id != keys.sealer(TAG_B).key_id != keys.key_id
    with pytest.raises(ValueError, match="a tenant tag is 8 bytes, got 1"):
        keys.sealer(b"a")
    tenant_key = chain_hashes(list(range(16)), 16, b"ns", secret=SECRET, tag=TAG_A)[0]
    assert keys.for_key(tenant_key) is keys.sealer(TAG_A)
    assert keys.for_key(tenant_key[TENANT_TAG_BYTES:]) is keys.sealer()  # a 16-byte key: no tenant's


def test_the_tenants_sealers_kept_are_bounded_and_derived_again_alike(monkeypatch):
    monkeypatch.setattr("kvtier.core.sealing.MAX_SEALERS", 4)
    keys = SealingKeys(SECRET)
    data = np.arange(4096, dtype=np.uint8)
    sealed, seal_ = seal(keys, data, TAG_A)
    for i in range(10):
        keys.sealer(i.to_bytes(TENANT_TAG_BYTES, "little"))
    assert len(keys._sealers) <= 4
    ok, out = opens(keys, sealed, seal_, TAG_A)
    assert ok and np.array_equal(out, data)
