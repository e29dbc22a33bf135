"""Record headers (no server): a record is accepted only when it is exactly the block asked for.

Round trip with and without a MAC; any damaged byte of the header or the data, another namespace,
geometry, rank, key or length, and (with auth on) a missing or foreign MAC are refused, each with
its reason; names carry the prefix, the namespace digest, the key and the rank.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.core.errors import ConfigError
from kvtier.core.layout import BlockLayout
from kvtier.tiers.remote.record import (
    HEADER_BYTES,
    NO_MAC,
    RecordFormat,
    RecordHeader,
    mac_key,
    namespace_digest,
)

LAYOUT = BlockLayout((256, 256))
KEY = bytes(range(16))
NS = namespace_digest("model-a", LAYOUT)
SECRET_ENV = "KVTIER_TEST_MAC_SECRET"


def block(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8)


def pieces(data: np.ndarray) -> list[memoryview]:
    """The block as two pieces, as a fragmented slot would hand it over."""
    return [memoryview(data[:100]), memoryview(data[100:])]


@pytest.fixture
def secret(monkeypatch) -> bytes:
    monkeypatch.setenv(SECRET_ENV, "s3cret-" * 4)
    key = mac_key(SECRET_ENV)
    assert key is not None and len(key) == 32
    return key


def formats(secret: bytes | None = None, **changes) -> RecordFormat:
    args = {"prefix": "kvtier", "namespace": NS, "block_bytes": LAYOUT.block_bytes, "mac_key": secret, **changes}
    return RecordFormat(**args)


@pytest.mark.parametrize("auth", [False, True])
def test_round_trip(auth, secret):
    fmt = formats(secret if auth else None)
    data = block()
    header = fmt.header(KEY, pieces(data))
    assert len(header) == HEADER_BYTES
    assert fmt.problem(header, KEY, pieces(data)) is None
    parsed = RecordHeader.unpack(header)
    assert (parsed.key, parsed.namespace, parsed.length, parsed.stored) == (KEY, NS, 512, 512)
    assert (parsed.mac != NO_MAC) is auth


def test_every_damaged_header_byte_is_refused():
    fmt = formats()
    data = block()
    header = bytearray(fmt.header(KEY, pieces(data)))
    for i in range(HEADER_BYTES):
        for mask in (0x01, 0x80):
            header[i] ^= mask
            assert fmt.problem(bytes(header), KEY, pieces(data)) == "the header is damaged or not a kvtier record's", i
            header[i] ^= mask
    assert fmt.problem(bytes(header), KEY, pieces(data)) is None
    for cut in (0, 1, HEADER_BYTES - 1):
        assert fmt.problem(bytes(header[:cut]), KEY, pieces(data)) is not None
    assert fmt.problem(bytes(header) + b"\0", KEY, pieces(data)) is not None


def test_damaged_data_is_refused():
    fmt = formats()
    data = block()
    header = fmt.header(KEY, pieces(data))
    for i in (0, 99, 100, 511):
        damaged = data.copy()
        damaged[i] ^= 0x40
        assert fmt.problem(header, KEY, pieces(damaged)) == "the data fails its checksum"


def test_another_namespace_geometry_rank_key_or_length_is_refused():
    data = block()
    header = formats().header(KEY, pieces(data))
    others = {
        "namespace": namespace_digest("model-b", LAYOUT),
        "geometry": namespace_digest("model-a", BlockLayout((128,) * 4)),
        "rank": namespace_digest("model-a", LAYOUT, rank=0),
    }
    assert len(set(others.values()) | {NS}) == 4
    for what, digest in others.items():
        assert (
            formats(namespace=digest).problem(header, KEY, pieces(data))
            == "the record belongs to another namespace, geometry or rank"
        ), what
    assert formats().problem(header, bytes(16), pieces(data)) == "the record holds another key"
    assert formats().problem(header, KEY[:8], pieces(data)) == "the record holds another key"
    assert formats(block_bytes=1024).problem(header, KEY, pieces(data)) == (
        "the record holds 512 bytes of a 512-byte block (codec 0); this stack stores 1024-byte blocks raw"
    )
    forged = RecordHeader.unpack(header)
    for bad in ({"stored": 256}, {"codec": 1}):
        fields = {**forged.__dict__, **bad}
        assert formats().problem(RecordHeader(**fields).pack(), KEY, pieces(data)).startswith("the record holds")


def test_with_auth_a_record_without_or_with_another_mac_is_refused(secret, monkeypatch):
    data = block()
    fmt = formats(secret)
    unsigned = formats().header(KEY, pieces(data))
    assert fmt.problem(unsigned, KEY, pieces(data)) == "the record carries no MAC and this tier requires one"
    monkeypatch.setenv(SECRET_ENV, "another-secret-" * 2)
    foreign = formats(mac_key(SECRET_ENV)).header(KEY, pieces(data))
    mismatch = "the record's MAC does not match (written without this tier's secret, or forged)"
    assert fmt.problem(foreign, KEY, pieces(data)) == mismatch
    # a forger who knows the format but not the secret: fields changed, header checksum made valid again
    signed = RecordHeader.unpack(fmt.header(KEY, pieces(data)))
    other = block(1)
    checksum = RecordHeader.unpack(formats().header(KEY, pieces(other))).checksum
    forged = RecordHeader(NS, KEY, 512, 512, 0, checksum, signed.mac)
    assert fmt.problem(forged.pack(), KEY, pieces(other)) == mismatch
    # without auth, a signed record still reads (its checksum holds): a MAC is only ever required, never trusted alone
    assert formats().problem(fmt.header(KEY, pieces(data)), KEY, pieces(data)) is None


def test_names_carry_prefix_namespace_key_and_rank():
    assert formats().name(KEY) == f"kvtier/{NS.hex()[:16]}/{KEY.hex()}"
    assert formats(prefix="team-a", rank=3).name(KEY) == f"team-a/{NS.hex()[:16]}/{KEY.hex()}/r3"


@pytest.mark.parametrize("value, problem", [(None, "is unset or empty"), ("short", "holds 5 bytes, fewer than the 16")])
def test_mac_secret_must_be_set_and_long_enough(monkeypatch, value, problem):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    if value is not None:
        monkeypatch.setenv(SECRET_ENV, value)
    with pytest.raises(ConfigError, match=f"^auth_key_env: the environment variable {SECRET_ENV} {problem}"):
        mac_key(SECRET_ENV)
    assert mac_key(None) is None


def test_a_key_too_long_for_the_header_is_refused_when_writing():
    with pytest.raises(ValueError, match="a record header holds at most 64"):
        formats().header(b"k" * 65, pieces(block()))
