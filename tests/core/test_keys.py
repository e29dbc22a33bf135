"""Block keys: a key depends on its namespace, block size, secret, its own tokens and every token
before it, and nothing else.

The prefix property is what makes the cache shareable: requests that agree on the first n full blocks
get the same first n keys, and any difference from block i on changes every key from i on. Keys are
BLAKE2b-128, keyed with a secret when one is configured; token ids that cannot be int64 are refused,
so no two token sequences can be made to hash alike by wrapping around. Keys a caller brings are
refused when they are not 1 to MAX_KEY_BYTES bytes, at every tier's ``reserve``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, strategies as st

from kvtier.core.errors import ConfigError
from kvtier.core.keys import MAX_KEY_BYTES, Namespace, chain_hashes, fold_keys, key_secret
from kvtier.core.layout import BlockLayout
from kvtier.policies import LRUPolicy
from kvtier.tiers.host import host_tier

BS = 4
SECRET = b"0123456789abcdef-deployment-secret"


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_deterministic_and_16_bytes():
    a = chain_hashes(tokens(12), BS, b"ns")
    b = chain_hashes(tokens(12), BS, b"ns")
    assert a == b
    assert len(a) == 3
    assert all(isinstance(k, bytes) and len(k) == 16 for k in a)
    assert len(set(a)) == 3


@pytest.mark.parametrize("changed_block", [0, 1, 2, 3])
def test_change_in_block_i_changes_keys_from_i_only(changed_block):
    base = tokens(16)
    other = list(base)
    other[changed_block * BS + 1] += 1000
    ka, kb = chain_hashes(base, BS), chain_hashes(other, BS)
    assert ka[:changed_block] == kb[:changed_block]
    assert all(x != y for x, y in zip(ka[changed_block:], kb[changed_block:], strict=True))


def test_shared_prefix_gives_shared_keys():
    short, long = chain_hashes(tokens(8), BS), chain_hashes(tokens(20), BS)
    assert long[:2] == short


def test_different_namespace_gives_disjoint_keys():
    a = chain_hashes(tokens(40), BS, b"model-a")
    b = chain_hashes(tokens(40), BS, b"model-b")
    assert not set(a) & set(b)


def test_str_and_bytes_namespace_agree():
    assert chain_hashes(tokens(8), BS, "ns") == chain_hashes(tokens(8), BS, b"ns")


def test_partial_block_gets_no_key():
    assert chain_hashes(tokens(11), BS) == chain_hashes(tokens(8), BS)
    assert chain_hashes(tokens(3), BS) == []
    assert chain_hashes([], BS) == []


def test_numpy_list_and_tuple_agree():
    toks = [5, 70000, 2**40, 0, 1, 2, 3, 9]
    expected = chain_hashes(toks, BS)
    assert chain_hashes(tuple(toks), BS) == expected
    assert chain_hashes(np.array(toks, dtype=np.int64), BS) == expected
    small = [5, 7, 0, 1, 2, 3, 4, 9]
    assert chain_hashes(np.array(small, dtype=np.int32), BS) == chain_hashes(small, BS)


@pytest.mark.parametrize("secret", [None, SECRET])
def test_first_two_keys_by_hand(secret):
    """The documented format: a root over (block size, namespace length, namespace), then one link per
    block over (parent, tokens as little-endian int64), each BLAKE2b-128 with its own personalisation,
    keyed with the BLAKE2b-256 of the secret when there is one."""
    ns = b"my-namespace"
    toks = [1, 2, 3, 258, -1, 2**63 - 1, 0, -(2**63)]
    key = hashlib.blake2b(secret, digest_size=32, person=b"kvtier-secret-v2").digest() if secret else b""

    def blake(data: bytes, person: bytes) -> bytes:
        return hashlib.blake2b(data, digest_size=16, key=key, person=person).digest()

    root = blake(struct.pack("<QQ", 4, len(ns)) + ns, b"kvtier-root-v2")
    first = blake(root + struct.pack("<4q", *toks[:4]), b"kvtier-link-v2")
    second = blake(first + struct.pack("<4q", *toks[4:]), b"kvtier-link-v2")
    assert chain_hashes(toks, 4, ns, secret=secret) == [first, second]


@pytest.mark.parametrize("secret", [None, SECRET])
def test_folded_engine_keys_by_hand(secret):
    """An engine's own key folded under a namespace: BLAKE2b-128[fold] over the namespace's chain root
    (block size 0, which no chain of tokens has) and the length-prefixed engine key, keyed as the chain."""
    ns, engine_key = b"sglang-namespace", "a3f1" * 16
    key = hashlib.blake2b(secret, digest_size=32, person=b"kvtier-secret-v2").digest() if secret else b""
    root = hashlib.blake2b(
        struct.pack("<QQ", 0, len(ns)) + ns, digest_size=16, key=key, person=b"kvtier-root-v2"
    ).digest()
    raw = engine_key.encode()
    expected = hashlib.blake2b(
        root + struct.pack("<Q", len(raw)) + raw, digest_size=16, key=key, person=b"kvtier-fold-v1"
    ).digest()
    assert fold_keys([engine_key], ns, secret) == [expected]
    assert fold_keys([raw], ns.decode(), secret) == [expected]  # str and bytes fold alike


def test_folded_keys_differ_by_namespace_secret_and_key_and_refuse_other_types():
    keys = ["k1", "k2", "k1" + "k2"]
    base = fold_keys(keys, "a")
    assert len(set(base)) == 3 and all(len(k) == 16 for k in base)
    assert not set(base) & set(fold_keys(keys, "b"))
    assert not set(base) & set(fold_keys(keys, "a", SECRET))
    with pytest.raises(TypeError, match="an engine key must be str or bytes, got int"):
        fold_keys([7], "a")


def test_uint64_wraparound_cannot_forge_a_collision():
    """2**64-1 as uint64 is -1 as int64: the old keys hashed both alike, so a caller could send the
    one sequence and be served the KV of the other. Tokens outside int64 are refused now."""
    honest = [5, -1, 7, 9]
    for forged in (np.array([5, 2**64 - 1, 7, 9], dtype=np.uint64), [5, 2**64 - 1, 7, 9], [2**63, 1, 2, 3]):
        with pytest.raises(ValueError, match="outside int64"):
            chain_hashes(forged, BS)
    assert len(chain_hashes(honest, BS)) == 1
    in_range = np.array([5, 2**63 - 1, 7, 9], dtype=np.uint64)  # uint64 arrays within int64 are fine
    assert chain_hashes(in_range, BS) == chain_hashes([5, 2**63 - 1, 7, 9], BS)
    for forged in ([2**70, 1, 2, 3], [-1, 2**64 - 1, 7, 9], [-(2**63) - 1, 0, 0, 0]):  # numpy: objects, floats
        with pytest.raises(ValueError, match=r"token id -?\d+ at index [01] is outside int64"):
            chain_hashes(forged, BS)


@pytest.mark.parametrize("bad", [[True, False, True, False], np.array([True] * 4), [1.0, 2.0, 3.0, 4.0]])
def test_bools_and_floats_are_not_tokens(bad):
    with pytest.raises(TypeError, match="integers"):
        chain_hashes(bad, BS)


def test_block_size_and_namespace_cannot_stand_in_for_each_other():
    """The root takes the block size and the namespace as fixed-width fields: the same tokens under
    another block size, or a namespace that spells the other's bytes, give disjoint keys."""
    toks = tokens(32)
    by_size = {bs: chain_hashes(toks, bs, b"ns") for bs in (1, 2, 4, 8)}
    seen = [k for keys in by_size.values() for k in keys]
    assert len(seen) == len(set(seen))
    spelled = struct.pack("<Q", 4) + b"ns"  # what a concatenating root would have confused
    assert not set(chain_hashes(toks, 4, b"ns")) & set(chain_hashes(toks, 4, spelled))
    assert not set(chain_hashes(toks, 4, b"")) & set(chain_hashes(toks, 4, b"\0"))


def test_secret_gives_disjoint_keys_and_the_same_secret_the_same_keys():
    toks = tokens(40)
    plain = chain_hashes(toks, BS, b"ns")
    keyed = chain_hashes(toks, BS, b"ns", secret=SECRET)
    other = chain_hashes(toks, BS, b"ns", secret=SECRET + b"!")
    assert not set(plain) & set(keyed) and not set(keyed) & set(other) and not set(plain) & set(other)
    assert chain_hashes(toks, BS, b"ns", secret=SECRET) == keyed
    long_secret = bytes(range(256)) * 4  # longer than BLAKE2b's 64-byte key: hashed down, not cut
    assert chain_hashes(toks, BS, b"ns", secret=long_secret) != chain_hashes(toks, BS, b"ns", secret=long_secret[:64])


def test_the_same_secret_gives_the_same_keys_in_another_process():
    """Nothing per process enters a key (no random seed): two engines sharing a store agree."""
    script = (
        "import sys; from kvtier.core.keys import chain_hashes; "
        "print(b''.join(chain_hashes(list(range(16)), 4, b'ns', secret=sys.argv[1].encode())).hex())"
    )
    out = subprocess.run([sys.executable, "-c", script, SECRET.decode()], capture_output=True, text=True, check=True)
    assert bytes.fromhex(out.stdout.strip()) == b"".join(chain_hashes(tokens(16), 4, b"ns", secret=SECRET))


def test_a_known_key_does_not_give_the_next_one_without_the_secret():
    """Keys are visible to every tenant of a shared store; every link is keyed, so continuing the chain
    from a seen key without the secret (or with another) misses the real next key."""
    keyed = chain_hashes(tokens(8), BS, b"ns", secret=SECRET)
    assert chain_hashes(tokens(4, 4), BS, parent=keyed[0]) != [keyed[1]]
    assert chain_hashes(tokens(4, 4), BS, parent=keyed[0], secret=b"another secret, 16+") != [keyed[1]]
    assert chain_hashes(tokens(4, 4), BS, parent=keyed[0], secret=SECRET) == [keyed[1]]


@pytest.mark.parametrize("secret", [b"", "text", bytearray(b"0123456789abcdef")])
def test_bad_secret_raises(secret):
    with pytest.raises(ValueError, match="secret must be non-empty bytes"):
        chain_hashes(tokens(8), BS, secret=secret)


def test_key_secret_reads_the_named_variable(monkeypatch):
    assert key_secret(None) is None
    monkeypatch.setenv("KVTIER_TEST_SECRET", "s" * 16)
    assert key_secret("KVTIER_TEST_SECRET") == b"s" * 16


@pytest.mark.parametrize(
    "value, problem",
    [(None, "is unset or empty"), ("", "is unset or empty"), ("s" * 15, "holds 15 bytes, fewer than the 16")],
)
def test_key_secret_refuses_a_missing_or_short_secret(monkeypatch, value, problem):
    monkeypatch.delenv("KVTIER_TEST_SECRET", raising=False)
    if value is not None:
        monkeypatch.setenv("KVTIER_TEST_SECRET", value)
    with pytest.raises(ConfigError, match=f"KVTIER_TEST_SECRET {problem}"):
        key_secret("KVTIER_TEST_SECRET")


def make_host_tier():
    return host_tier("host", 4, BlockLayout((16,)), LRUPolicy())


@pytest.mark.parametrize(
    "bad, error, message",
    [
        (b"k" * 100, ValueError, "must be 1 to 64 bytes, got 100 bytes"),
        (b"", ValueError, "must be 1 to 64 bytes, got 0 bytes"),
        ("text-key", TypeError, "must be bytes, got str"),
        (7, TypeError, "must be bytes, got int"),
    ],
)
def test_tier_reserve_refuses_keys_no_tier_can_keep_whole(bad, error, message):
    """Every store reaches a tier through ``reserve``: a bad key is refused there, before any slot is
    taken, so direct tier and stack users get the same error as the API."""
    tier = make_host_tier()
    with pytest.raises(error, match=message):
        tier.reserve([b"good-key", bad])
    assert tier.usage().used == 0 and tier.state(b"good-key").value == "free"
    tier.check_invariants()


def test_tier_reserve_accepts_keys_up_to_the_limit():
    tier = make_host_tier()
    keys = [b"a", b"b" * 16, b"c" * MAX_KEY_BYTES]
    assert tier.reserve(keys) is not None
    tier.commit(keys)
    assert tier.lookup(keys) == 3
    assert tier.lookup([b"c" * (MAX_KEY_BYTES + 1)]) == 0  # an over-long lookup simply misses


@pytest.mark.parametrize("bad", [0, -1, 2.5, None, True])
def test_bad_block_size_raises(bad):
    with pytest.raises(ValueError, match="block_size"):
        chain_hashes(tokens(8), bad)


def test_namespace_encode_differs_per_field():
    base = Namespace(model="m", dtype="bf16", layout="nhd", block_tokens=16, tp_rank=0)
    assert base.encode() == Namespace(model="m", dtype="bf16", layout="nhd", block_tokens=16, tp_rank=0).encode()
    variants = [
        dataclasses.replace(base, model="m2"),
        dataclasses.replace(base, dtype="fp8"),
        dataclasses.replace(base, layout="hnd"),
        dataclasses.replace(base, block_tokens=32),
        dataclasses.replace(base, tp_rank=1),
        dataclasses.replace(base, tp_rank=None),
    ]
    encodings = {base.encode(), *(v.encode() for v in variants)}
    assert len(encodings) == len(variants) + 1


def test_namespace_encoding_is_unambiguous():
    # Concatenation-style encodings would make these two equal.
    assert Namespace(model="a|b", dtype="c").encode() != Namespace(model="a", dtype="b|c").encode()


def test_namespace_feeds_chain_hashes():
    a = chain_hashes(tokens(8), BS, Namespace("m", "bf16", tp_rank=0).encode())
    b = chain_hashes(tokens(8), BS, Namespace("m", "bf16", tp_rank=1).encode())
    assert not set(a) & set(b)


@given(
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=80),
    st.integers(1, 8),
    st.integers(0, 10),
    st.one_of(st.none(), st.binary(min_size=1, max_size=100)),
)
def test_parent_continues_the_chain(tokens, block_size, cut_blocks, secret):
    """Hashing a sequence in two pieces, the second continuing from the first's last key, gives the
    keys of the whole sequence (what an engine does as a request grows block by block), keyed or not."""
    whole = chain_hashes(tokens, block_size, b"ns", secret=secret)
    cut = min(cut_blocks, len(whole)) * block_size
    head = chain_hashes(tokens[:cut], block_size, b"ns", secret=secret)
    tail = (
        chain_hashes(tokens[cut:], block_size, parent=head[-1], secret=secret)
        if head
        else chain_hashes(tokens, block_size, b"ns", secret=secret)
    )
    assert head + tail == whole


def test_parent_must_be_a_key():
    with pytest.raises(ValueError, match="16-byte key"):
        chain_hashes([1, 2], 2, parent=b"short")
