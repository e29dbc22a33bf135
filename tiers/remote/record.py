"""Records in a shared store: their names, the header that makes each one self-describing, the MAC.

A block is stored as one record: a fixed-size header, then the block's bytes (the host slot itself,
sent and received without a staging copy where the client allows). The store is not ours, so
nothing in a record is trusted until its header says it is the block asked for:

- the header carries its own checksum, a magic and a version (garbage, a truncated or a foreign
  record fails here);
- the namespace digest (the stack's namespace, the block geometry, the tensor-parallel rank), the
  whole key and the byte counts must be this reader's (another model, layout or rank is a miss even
  under a colliding name);
- the checksum of the data (xxh3-64) must match the bytes that arrived;
- with ``auth_key_env`` set, a keyed BLAKE2b MAC over the header fields and the data must match:
  whoever can write to the store but lacks the secret cannot forge a record that is served.

A record failing any check is a miss for that block, never bytes in the engine. Records are written
whole (``StoreClient.put`` replaces a record atomically), so a reader never sees half of one.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from kvtier.core.keys import MAX_KEY_BYTES, key_secret
from kvtier.core.layout import BlockLayout

MAGIC = b"KVTREC01"
VERSION = 1
CODEC_RAW = 0
MAC_BYTES = 32
# magic, version, namespace digest, key length, key (kept whole), raw block bytes, stored bytes, codec id,
# checksum of the stored bytes, MAC over these fields and the stored bytes; then the checksum of all of it.
_FIELDS = struct.Struct(f"<8sH16sH{MAX_KEY_BYTES}sQQBQ")
_MAC_AT = _FIELDS.size
_CHECK = struct.Struct("<Q")
HEADER_BYTES = _FIELDS.size + MAC_BYTES + _CHECK.size
NO_MAC = bytes(MAC_BYTES)
_MAC_PERSON = b"kvtier-rec-mac1"
_MAC_KEY_PERSON = b"kvtier-mac-key1"
_NAMESPACE_PERSON = b"kvtier-rec-ns1"


def namespace_digest(namespace: str | bytes, layout: BlockLayout, rank: int | None = None) -> bytes:
    """16 bytes naming whose blocks a record holds: the stack's namespace (model, dtype, ...), the
    block's fragment geometry and, under tensor parallelism, the rank whose shard it is. Length-prefixed
    fields: no two (namespace, geometry, rank) give the same bytes to hash."""
    ns = namespace.encode("utf-8") if isinstance(namespace, str) else namespace
    sizes = layout.fragment_bytes
    h = hashlib.blake2b(digest_size=16, person=_NAMESPACE_PERSON)
    h.update(struct.pack("<Q", len(ns)) + ns)
    h.update(struct.pack(f"<qQ{len(sizes)}Q", -1 if rank is None else rank, len(sizes), *sizes))
    return h.digest()


def mac_key(env_name: str | None) -> bytes | None:
    """The MAC key from the secret in ``env_name`` (a remote tier's ``auth_key_env``), or None without
    one. Derived with its own personalisation, so the same secret used as ``key_secret_env`` too gives
    unrelated keys. Raises ConfigError when the variable is unset or shorter than 16 bytes."""
    secret = key_secret(env_name, "auth_key_env")
    return None if secret is None else hashlib.blake2b(secret, digest_size=32, person=_MAC_KEY_PERSON).digest()


@dataclass(frozen=True)
class RecordHeader:
    """The fields of a record's header; ``mac`` is all zeros when the writer had no MAC key."""

    namespace: bytes
    key: bytes
    length: int  # the block's raw bytes
    stored: int  # bytes after the header (the raw bytes: no codec yet)
    codec: int
    checksum: int  # xxh3-64 of the stored bytes
    mac: bytes = NO_MAC

    def fields(self) -> bytes:
        """The header's fields without the MAC and the header checksum: what the MAC covers."""
        if len(self.key) > MAX_KEY_BYTES:
            raise ValueError(
                f"key {self.key[:16].hex()}... is {len(self.key)} bytes; a record header holds at most {MAX_KEY_BYTES}"
            )
        return _FIELDS.pack(
            MAGIC, VERSION, self.namespace, len(self.key), self.key, self.length, self.stored, self.codec, self.checksum
        )

    def pack(self) -> bytes:
        body = self.fields() + self.mac
        return body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> RecordHeader | None:
        """The header in ``raw``, or None when it is short, damaged or not a kvtier record of this version."""
        if len(raw) != HEADER_BYTES:
            return None
        body = bytes(raw[: _MAC_AT + MAC_BYTES])
        if xxhash.xxh3_64_intdigest(body) != _CHECK.unpack_from(raw, len(body))[0]:
            return None
        magic, version, namespace, key_len, key, length, stored, codec, checksum = _FIELDS.unpack_from(body)
        if magic != MAGIC or version != VERSION or key_len > MAX_KEY_BYTES:
            return None
        return cls(namespace, key[:key_len], length, stored, codec, checksum, body[_MAC_AT:])


class RecordFormat:
    """How one stack (one rank of one) names, writes and checks its records.

    ``name(key)``: ``{prefix}/{namespace digest, 16 hex digits}/{key hex}``, plus ``/r{rank}`` under
    tensor parallelism (each rank's shard is its own record). ``header(key, data)`` for a record about
    to be written; ``problem(header, key, data)`` for one that arrived: None when it is the block asked
    for, otherwise why not.
    """

    def __init__(
        self, prefix: str, namespace: bytes, block_bytes: int, mac_key: bytes | None = None, rank: int | None = None
    ) -> None:
        self.prefix = prefix
        self.namespace = namespace
        self.block_bytes = block_bytes
        self.rank = rank
        self._mac_key = mac_key
        self._stem = f"{prefix}/{namespace.hex()[:16]}/"
        self._suffix = "" if rank is None else f"/r{rank}"

    @property
    def authenticated(self) -> bool:
        return self._mac_key is not None

    def name(self, key: bytes) -> str:
        return f"{self._stem}{key.hex()}{self._suffix}"

    def header(self, key: bytes, data: Sequence[memoryview]) -> bytes:
        """The header of ``key``'s record whose bytes are ``data`` (the pieces of one block, in order)."""
        header = RecordHeader(self.namespace, key, self.block_bytes, self.block_bytes, CODEC_RAW, _checksum(data))
        if self._mac_key is None:
            return header.pack()
        mac = self._mac(header.fields(), data)
        return RecordHeader(
            header.namespace, key, header.length, header.stored, header.codec, header.checksum, mac
        ).pack()

    def problem(self, raw: bytes | memoryview, key: bytes, data: Sequence[memoryview]) -> str | None:
        """Why the record that arrived (``raw`` header, ``data`` pieces) is not ``key``'s block of this
        format, or None when it is. Checks the header before it hashes any data."""
        header = RecordHeader.unpack(raw)
        if header is None:
            return "the header is damaged or not a kvtier record's"
        if header.namespace != self.namespace:
            return "the record belongs to another namespace, geometry or rank"
        if header.key != key:
            return "the record holds another key"
        if (header.length, header.stored, header.codec) != (self.block_bytes, self.block_bytes, CODEC_RAW):
            return (
                f"the record holds {header.stored} bytes of a {header.length}-byte block (codec "
                f"{header.codec}); this stack stores {self.block_bytes}-byte blocks raw"
            )
        if _checksum(data) != header.checksum:
            return "the data fails its checksum"
        if self._mac_key is not None:
            if header.mac == NO_MAC:
                return "the record carries no MAC and this tier requires one"
            if not hmac.compare_digest(header.mac, self._mac(header.fields(), data)):
                return "the record's MAC does not match (written without this tier's secret, or forged)"
        return None

    def _mac(self, fields: bytes, data: Sequence[memoryview]) -> bytes:
        assert self._mac_key is not None
        h = hashlib.blake2b(key=self._mac_key, digest_size=MAC_BYTES, person=_MAC_PERSON)
        h.update(fields)
        for piece in data:
            h.update(piece)
        return h.digest()


def _checksum(data: Sequence[memoryview]) -> int:
    h = xxhash.xxh3_64()
    for piece in data:
        h.update(piece)
    return h.intdigest()
