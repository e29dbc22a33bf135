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
  whoever can write to the store but lacks the secret cannot forge a record that is served;
- with ``encryption: aes-gcm`` the block is sealed (``kvtier.core.sealing``): the record holds its
  ciphertext, the MAC field its seal (key id, nonce, tag) and the header's fields are what the seal
  binds, so a record that opens is this key's block of this namespace, written by someone holding the
  secret; whoever reads the store reads no KV. GCM's tag authenticates: no checksum, no MAC besides.

A record failing any check is a miss for that block, never bytes in the engine. Records are written
whole (``StoreClient.put`` replaces a record atomically), so a reader never sees half of one.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace

import xxhash

from kvtier.core.keys import MAX_KEY_BYTES, key_secret
from kvtier.core.layout import BlockLayout
from kvtier.core.sealing import SEAL_BYTES, SealingKeys

MAGIC = b"KVTREC01"
VERSION = 1
CODEC_RAW = 0
CODEC_SEALED = 1
"""The stored bytes are the block sealed with AES-256-GCM; the MAC field holds the seal."""
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
    stored: int  # bytes after the header (as many as the block's)
    codec: int  # CODEC_RAW, or CODEC_SEALED
    checksum: int  # xxh3-64 of the stored bytes (0 where sealed: the tag checks them)
    mac: bytes = NO_MAC  # the MAC, or the seal, or zeros

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
    for, otherwise why not. With ``sealing`` keys (``encryption: aes-gcm``) every record is sealed: its
    writer gives ``header`` the memory the ciphertext goes to, and ``problem`` opens a record into
    the memory it is given (its own, by default) as it checks it.
    """

    def __init__(
        self,
        prefix: str,
        namespace: bytes,
        block_bytes: int,
        mac_key: bytes | None = None,
        rank: int | None = None,
        sealing: SealingKeys | None = None,
    ) -> None:
        if mac_key is not None and sealing is not None:
            raise ValueError("a sealed record is authenticated by its seal: no MAC key besides")
        self.prefix = prefix
        self.namespace = namespace
        self.block_bytes = block_bytes
        self.rank = rank
        self.sealing = sealing
        self._mac_key = mac_key
        self._stem = f"{prefix}/{namespace.hex()[:16]}/"
        self._suffix = "" if rank is None else f"/r{rank}"

    def name(self, key: bytes) -> str:
        return f"{self._stem}{key.hex()}{self._suffix}"

    def header(self, key: bytes, data: Sequence[memoryview], sealed_into: memoryview | None = None) -> bytes:
        """The header of ``key``'s record whose bytes are ``data`` (the pieces of one block, in order);
        where this format seals, the block is sealed into ``sealed_into`` (the record's stored bytes)."""
        if self.sealing is not None:
            if sealed_into is None:
                raise ValueError("a sealed record needs memory for its ciphertext")
            fields = RecordHeader(self.namespace, key, self.block_bytes, self.block_bytes, CODEC_SEALED, 0)
            seal = self.sealing.for_key(key).seal_into(data, sealed_into, fields.fields())
            return replace(fields, mac=seal).pack()
        header = RecordHeader(self.namespace, key, self.block_bytes, self.block_bytes, CODEC_RAW, _checksum(data))
        if self._mac_key is None:
            return header.pack()
        return replace(header, mac=self._mac(header.fields(), data)).pack()

    def problem(
        self,
        raw: bytes | memoryview,
        key: bytes,
        data: Sequence[memoryview],
        opened_into: Sequence[memoryview] | None = None,
    ) -> str | None:
        """Why the record that arrived (``raw`` header, ``data`` pieces) is not ``key``'s block of this
        format, or None when it is. Checks the header before it hashes any data. A sealed record is
        opened into ``opened_into`` (pieces as long as ``data``'s; ``data`` itself by default): its
        block is there when this says None, and nothing of it otherwise."""
        header = RecordHeader.unpack(raw)
        if header is None:
            return "the header is damaged or not a kvtier record's"
        if header.namespace != self.namespace:
            return "the record belongs to another namespace, geometry or rank"
        if header.key != key:
            return "the record holds another key"
        codec = CODEC_RAW if self.sealing is None else CODEC_SEALED
        if (header.length, header.stored, header.codec) != (self.block_bytes, self.block_bytes, codec):
            return (
                f"the record holds {header.stored} bytes of a {header.length}-byte block (codec "
                f"{header.codec}); this stack stores {self.block_bytes}-byte blocks "
                f"{'raw' if self.sealing is None else 'sealed'}"
            )
        if self.sealing is not None:
            seal = header.mac[:SEAL_BYTES]
            if not self.sealing.for_key(key).open(
                data, data if opened_into is None else opened_into, seal, header.fields()
            ):
                return "the record does not open (sealed under another secret or identity, or changed since)"
            return None
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
