"""Block keys: a key depends on its namespace, its own tokens and every token before it, and nothing else.

The prefix property is what makes the cache shareable: requests that agree on the first n full blocks
get the same first n keys, and any difference from block i on changes every key from i on.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvtier.core.keys import Namespace, chain_hashes

BS = 4


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
    assert all(x != y for x, y in zip(ka[changed_block:], kb[changed_block:]))


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


def test_first_key_by_hand():
    ns = b"my-namespace"
    toks = [1, 2, 3, 258]
    seed = xxhash.xxh3_128_digest(b"kvtier\0" + ns)
    block = b"".join(t.to_bytes(8, "little", signed=True) for t in toks)
    assert chain_hashes(toks, 4, ns)[0] == xxhash.xxh3_128_digest(seed + block)


@pytest.mark.parametrize("bad", [0, -1, 2.5, None, True])
def test_bad_block_size_raises(bad):
    with pytest.raises(ValueError, match="block_size"):
        chain_hashes(tokens(8), bad)


def test_non_integer_tokens_rejected():
    with pytest.raises(TypeError):
        chain_hashes([1.5, 2.0, 3.0, 4.0], 4)


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


@given(st.lists(st.integers(0, 2**31), max_size=80), st.integers(1, 8), st.integers(0, 10))
def test_parent_continues_the_chain(tokens, block_size, cut_blocks):
    """Hashing a sequence in two pieces, the second continuing from the first's last key, gives the
    keys of the whole sequence (what an engine does as a request grows block by block)."""
    whole = chain_hashes(tokens, block_size, b"ns")
    cut = min(cut_blocks, len(whole)) * block_size
    head = chain_hashes(tokens[:cut], block_size, b"ns")
    tail = chain_hashes(tokens[cut:], block_size, parent=head[-1]) if head else chain_hashes(tokens, block_size, b"ns")
    assert head + tail == whole


def test_parent_must_be_a_key():
    with pytest.raises(ValueError, match="16-byte key"):
        chain_hashes([1, 2], 2, parent=b"short")
