"""What a stack's namespace is made of, and the namespaces other stacks recorded in a shared tier.

Two stacks find each other's blocks only when equal tokens give them equal keys: the same block size,
namespace and key secret (``kvtier doctor`` reports these fields, ``stack_fields``), and where records
carry a geometry, the same one. Any difference is silent: every lookup misses. So each stack records
its fields where its blocks live (``NamespaceBook``: a disk tier's directory, a remote store), and a
lookup that would end "never stored" asks whether the tiers hold its first missing block under one of
the other namespaces recorded there (``OtherNamespaces``): its key under their block size, namespace
and the same secret. Found: the miss is "another namespace", naming the fields that differ.

Whatever a registry holds is written by others (another tenant of a shared store, say) and is checked
here (``KnownNamespace``: field names, types and lengths; ``decode_*``: sizes, counts) before it is
used; a forged entry can only misname a miss, never change what a lookup or a load returns, and its
cost is bounded (``MAX_NAMESPACES`` entries, ``SEARCH_BLOCKS`` hashed blocks per miss).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from kvtier.core.keys import chain_hashes, hash_key

log = logging.getLogger(__name__)

MAX_NAMESPACES = 16
"""Namespaces a registry keeps (the newest) and a miss is searched under: bounds its cost."""
ENTRY_BYTES = 4096
"""The most one namespace takes as JSON; a remote registry record is exactly this long (space-padded)."""
REGISTRY_BYTES = MAX_NAMESPACES * ENTRY_BYTES
"""The most a registry file may hold: a larger one is ignored unread."""
SEARCH_BLOCKS = 8192
"""Blocks a miss's search hashes at most, over every namespace it tries (a forged entry with a block
size of 1 must not make each miss hash the whole prompt 16 times)."""
STANDALONE_FIELDS = frozenset({"block_size", "namespace", "key_secret", "block_bytes", "fragments"})
"""The fields of a stack opened through ``kvtier.api``: its keys are ``chain_hashes`` of its token
ids under ``block_size`` and ``namespace``, which a search can compute. An engine's namespace has
fields of its own (model, dtype, ...) and keys folded its own way: not searched yet."""

_FINGERPRINT_PERSON = b"kvtier-doctor-1"
_FIELD_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}\Z")
_MAX_FIELDS = 32
_MAX_VALUE_CHARS = 1024
_RECORDS = re.compile(r"[0-9a-f]{32}\Z")
_REGISTRY_VERSION = 1

Scalar = str | int | bool | None


def fingerprint(key: bytes) -> str:
    """4 bytes naming a key derived from a secret, never the secret."""
    return hashlib.blake2b(key, digest_size=4, person=_FINGERPRINT_PERSON).hexdigest()


def secret_fingerprint(secret: bytes | None) -> str | None:
    """The fingerprint of the key kvtier derives from a key secret (None without one): equal
    fingerprints, equal keys for equal tokens; the keys any tenant of a shared store sees come from
    the same secret already."""
    return None if secret is None else fingerprint(hash_key(secret))


def stack_fields(block_tokens: int, namespace: str) -> dict[str, Any]:
    """The fields of a standalone stack's namespace (``kvtier.api``) besides its key secret: its keys
    are ``chain_hashes`` under these."""
    return {"block_size": block_tokens, "namespace": namespace}


def field_differences(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{field: (ours, theirs)}`` for every field the two give different values (a field only one has
    counts, as None), by name."""
    return {
        name: (ours.get(name), theirs.get(name))
        for name in sorted(ours.keys() | theirs.keys())
        if ours.get(name) != theirs.get(name)
    }


def said(differing: Mapping[str, tuple[Any, Any]]) -> list[str]:
    """``"<field> <a> vs <b>"`` per differing field, values as JSON (a value holding a newline or a
    quote cannot forge a log line)."""
    return [f"{name} {json.dumps(a)} vs {json.dumps(b)}" for name, (a, b) in differing.items()]


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """``"<field> <a> vs <b>"`` for every field two sharing reports (``kvtier doctor``'s) give different
    values (a field only one has counts, shown as null); the digests where no field explains them."""
    differ = said(field_differences(a["fields"], b["fields"]))
    if not differ and (a["digest"] != b["digest"] or a["digest"] is None):
        differ.append(f"digest {json.dumps(a['digest'])} vs {json.dumps(b['digest'])}")
    return differ


@dataclass(frozen=True)
class KnownNamespace:
    """One namespace a registry lists: its ``fields`` (names and JSON scalars), when a stack of it last
    opened there (``written``, Unix seconds: the newest are kept) and, in a remote store, the digest
    its records are named under (``records``, 32 hex digits). Raises ValueError for anything else:
    entries are read from files and stores others write."""

    fields: dict[str, Scalar]
    written: float = 0.0
    records: str | None = None
    chain: tuple[int, str] | None = field(init=False, compare=False)
    """(block size, namespace) to hash token ids under, for a standalone stack's namespace; else None."""

    def __post_init__(self) -> None:
        if not isinstance(self.fields, dict) or len(self.fields) > _MAX_FIELDS:
            raise ValueError(f"a namespace's fields are a JSON object of at most {_MAX_FIELDS} fields")
        for name, value in self.fields.items():
            if not isinstance(name, str) or not _FIELD_NAME.match(name):
                raise ValueError(f"{json.dumps(name)[:80]} is not a namespace field's name")
            if not isinstance(value, (str, int, bool, type(None))) or len(str(value)) > _MAX_VALUE_CHARS:
                raise ValueError(f"field {name}: not a string, integer or boolean of at most {_MAX_VALUE_CHARS} chars")
        written_ok = isinstance(self.written, (int, float)) and not isinstance(self.written, bool)
        if not written_ok or not math.isfinite(self.written):
            raise ValueError("written: not a finite number")
        if self.records is not None and not (isinstance(self.records, str) and _RECORDS.match(self.records)):
            raise ValueError("records: not a digest of 32 hex digits")
        object.__setattr__(self, "chain", _chain(self.fields))

    def same(self, other: KnownNamespace) -> bool:
        """The same namespace (``written`` aside)."""
        return (self.fields, self.records) == (other.fields, other.records)

    def to_json(self) -> dict[str, Any]:
        return {"fields": self.fields, "written": self.written, "records": self.records}

    @classmethod
    def from_json(cls, obj: object) -> KnownNamespace:
        """The entry ``obj`` (parsed JSON) holds; ValueError when it is not one."""
        if not isinstance(obj, dict) or obj.keys() - {"fields", "written", "records"} or "fields" not in obj:
            raise ValueError("an entry is a JSON object of fields, written and records")
        return cls(obj["fields"], obj.get("written", 0.0), obj.get("records"))


def _chain(fields: Mapping[str, Scalar]) -> tuple[int, str] | None:
    """What token ids are hashed under in a namespace of ``fields``, when a search can compute it."""
    size, namespace = fields.get("block_size"), fields.get("namespace")
    if fields.keys() - STANDALONE_FIELDS or not isinstance(namespace, str):
        return None
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        return None
    return size, namespace


def listing(entries: Sequence[KnownNamespace], ours: KnownNamespace) -> list[KnownNamespace]:
    """What a registry holding ``entries`` holds once ``ours`` is recorded: ours instead of its older
    entry, the newest ``MAX_NAMESPACES`` kept, newest first."""
    kept = [ours, *(entry for entry in entries if not entry.same(ours))]
    return sorted(kept, key=lambda entry: -entry.written)[:MAX_NAMESPACES]


def _parsed(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"not JSON ({exc.__class__.__name__})") from None


def encode_entries(entries: Sequence[KnownNamespace]) -> bytes:
    """A registry file's bytes (a disk tier's ``namespaces.json``)."""
    doc = {"kvtier_namespaces": _REGISTRY_VERSION, "entries": [entry.to_json() for entry in entries]}
    return json.dumps(doc, indent=1, ensure_ascii=True).encode("ascii") + b"\n"


def decode_entries(raw: bytes) -> list[KnownNamespace]:
    """The entries of a registry file's bytes; ValueError naming what is wrong (too large, not JSON,
    not this version, too many or a bad entry)."""
    if len(raw) > REGISTRY_BYTES:
        raise ValueError(f"larger than {REGISTRY_BYTES} bytes")
    doc = _parsed(raw)
    if not isinstance(doc, dict) or doc.get("kvtier_namespaces") != _REGISTRY_VERSION:
        raise ValueError(f"not a kvtier namespace registry of version {_REGISTRY_VERSION}")
    entries = doc.get("entries")
    if not isinstance(entries, list) or len(entries) > MAX_NAMESPACES:
        raise ValueError(f"entries: not a list of at most {MAX_NAMESPACES}")
    return [KnownNamespace.from_json(entry) for entry in entries]


def encode_entry(entry: KnownNamespace) -> bytes:
    """One entry as a remote registry record: JSON padded with spaces to ``ENTRY_BYTES``; ValueError
    when it does not fit."""
    raw = json.dumps(entry.to_json(), ensure_ascii=True).encode("ascii")
    if len(raw) > ENTRY_BYTES:
        raise ValueError(f"the namespace takes {len(raw)} bytes as JSON, more than a record's {ENTRY_BYTES}")
    return raw.ljust(ENTRY_BYTES)


def decode_entry(raw: bytes) -> KnownNamespace:
    """The entry of a remote registry record; ValueError when it is not one."""
    if len(raw) != ENTRY_BYTES:
        raise ValueError(f"not {ENTRY_BYTES} bytes")
    return KnownNamespace.from_json(_parsed(raw))


@runtime_checkable
class NamespaceBook(Protocol):
    """A tier that keeps the namespaces of the stacks using it (a disk tier's directory, a remote store)."""

    name: str

    def record_namespace(self, ours: KnownNamespace) -> list[KnownNamespace]:
        """Record that a stack of ``ours`` uses this tier; the other namespaces recorded here, at most
        ``MAX_NAMESPACES``. Never raises: a registry that cannot be read or written is logged (one
        line) and lists none."""
        ...

    def hold_elsewhere(self, keys: Sequence[tuple[KnownNamespace, bytes]]) -> list[bool]:
        """Per (namespace, key): whether this tier holds the block of ``key`` stored under that
        namespace (listed by ``record_namespace``). At most one query of a remote store, within its
        timeout; one that fails says no."""
        ...


class OtherNamespaces:
    """The namespaces other stacks recorded in this stack's ``tiers`` (those that are a
    ``NamespaceBook``), recording ``ours`` there at once, and the search of a missed block among them.

    Only namespaces whose keys this stack can compute are kept: a standalone stack's (``chain``) with
    the same key secret (``secret``, whose fingerprint ``ours`` names); others' keys cannot be made
    without their secret."""

    def __init__(self, ours: KnownNamespace, tiers: Sequence[object], secret: bytes | None) -> None:
        self.ours = ours
        self._secret = secret
        self._books: list[tuple[NamespaceBook, list[tuple[KnownNamespace, tuple[int, str]]]]] = []
        for tier in tiers:
            if isinstance(tier, NamespaceBook):
                listed = [
                    (entry, entry.chain)
                    for entry in tier.record_namespace(ours)
                    if entry.chain is not None and entry.fields.get("key_secret") == ours.fields.get("key_secret")
                ]
                listed.sort(key=lambda pair: -pair[0].written)
                self._books.append((tier, listed[:MAX_NAMESPACES]))

    def find(self, token_ids: Sequence[int], first_token: int) -> dict[str, dict[str, tuple[Any, Any]]]:
        """The tiers that hold, under another namespace, the block that starts with token ``first_token``
        (the first this stack missed), each with the fields of the newest such namespace that differ
        from ours (``{field: (ours, theirs)}``). Empty when none does."""
        keys = self._keys(token_ids, first_token)
        found: dict[str, dict[str, tuple[Any, Any]]] = {}
        for book, listed in self._books:
            asked = [(entry, keys[chain]) for entry, chain in listed if chain in keys]
            held = book.hold_elsewhere(asked) if asked else []
            entry = next((entry for (entry, _), here in zip(asked, held, strict=True) if here), None)
            if entry is not None:
                found[book.name] = field_differences(self.ours.fields, entry.fields)
        return found

    def _keys(self, token_ids: Sequence[int], first_token: int) -> dict[tuple[int, str], bytes]:
        """Per (block size, namespace) listed, the key of the block holding token ``first_token``, where
        the prompt fills that block, newest first until ``SEARCH_BLOCKS`` blocks are hashed."""
        keys: dict[tuple[int, str], bytes] = {}
        budget = SEARCH_BLOCKS
        for size, namespace in dict.fromkeys(chain for _, listed in self._books for _, chain in listed):
            block = first_token // size
            end = (block + 1) * size
            if end <= len(token_ids) and block < budget:
                budget -= block + 1
                keys[size, namespace] = chain_hashes(token_ids[:end], size, namespace, secret=self._secret)[block]
        return keys
