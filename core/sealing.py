"""Blocks sealed at rest: AES-256-GCM, so that whoever reads a shared store, a disk or a backup reads no
KV (a block is a readable trace of the prompt that made it), and nobody without the key can write a
block that opens.

- The cipher is the ``cryptography`` package's (OpenSSL underneath): nothing here is cryptography of
  its own, only how keys are derived and what is bound to a block.
- Each tenant has its own key, derived (HKDF-SHA256) from the deployment's secret and the tenant's tag
  (``core/keys.py``: the first bytes of its block keys, a keyed hash of its id): a tenant's blocks
  neither open nor can be forged under another's key, and a tier finds the key from the block's key.
- Every seal takes a fresh random 96-bit nonce, and the block's identity (the caller's associated data:
  its namespace digest and key) is authenticated with it: a sealed block copied to another key,
  namespace or tenant fails to open, as does one with a flipped byte. GCM's tag authenticates the
  bytes, so a sealed block needs no MAC besides.
- Rotation: a previous secret may be given beside the current one; blocks sealed under it still open,
  new ones are sealed under the current one only. A seal names its key (a 4-byte id, a hash of the key)
  so that opening tries the right one first.

A seal is ``SEAL_BYTES``: key id, nonce, tag. The ciphertext is as long as the block.
"""

from __future__ import annotations

import hashlib
import importlib
import os
from collections.abc import Sequence
from typing import Literal

from pydantic import Field

from kvtier.core.errors import ConfigError
from kvtier.core.keys import TENANT_TAG_BYTES, key_secret, tenant_of
from kvtier.core.tier_config import ConfigModel, EnvName, ProblemList, env_name_hint

NONCE_BYTES = 12
TAG_BYTES = 16
KEY_ID_BYTES = 4
SEAL_BYTES = KEY_ID_BYTES + NONCE_BYTES + TAG_BYTES
"""A seal's bytes: the key's id, the nonce, the tag (32: a record header's MAC field holds one)."""
MAX_SEALERS = 4096
"""Tenants' sealers kept derived at once (one HKDF each, about 20 us): a store of many tenants derives
some again, never holds keys for every tenant that ever came."""
_KEY_INFO = b"kvtier-seal-key-v1"
_ID_PERSON = b"kvtier-seal-id1"

Buffer = memoryview | bytes | bytearray


class TenantKey:
    """One tenant's AES-256 key under one secret (``tenant``: its tag, b"" for blocks of no tenant), and its id."""

    def __init__(self, secret: bytes, tenant: bytes) -> None:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        info = _KEY_INFO + len(tenant).to_bytes(1, "little") + tenant
        self.key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)
        self.id = hashlib.blake2b(self.key, digest_size=KEY_ID_BYTES, person=_ID_PERSON).digest()
        self.aead = AESGCM(self.key)


class SealingKeys:
    """The deployment's secret (``current``: seals and opens) and, during a rotation, the one before it
    (``previous``: opens only). ``for_key(key)`` gives the sealer of the tenant whose block ``key`` names."""

    def __init__(self, current: bytes, previous: bytes | None = None) -> None:
        self.current = current
        self.previous = None if previous == current else previous
        self._sealers: dict[bytes, Sealer] = {}

    @classmethod
    def from_env(cls, env_name: str, previous_env: str | None = None) -> SealingKeys:
        """The secrets in the environment variables a tier's config names (``encryption_key_env``, and
        ``encryption_previous_key_env`` during a rotation); one ConfigError naming the setting when a
        variable is unset or short (``keys.key_secret``)."""
        current = key_secret(env_name, "encryption_key_env")
        assert current is not None
        previous = key_secret(previous_env, "encryption_previous_key_env")
        try:
            aead = importlib.import_module("cryptography.hazmat.primitives.ciphers.aead")
        except ImportError:
            aead = None
        if not hasattr(getattr(aead, "AESGCM", None), "encrypt_into"):  # (the one-call seal: cryptography 47)
            raise ConfigError(
                "encryption: aes-gcm needs the cryptography package, 47 or later: pip install 'kvtier[encryption]'"
            )
        return cls(current, previous)

    @property
    def key_id(self) -> bytes:
        """The id of the key blocks of no tenant are sealed with: names the secret (doctor compares them)."""
        return self.sealer().key_id

    @property
    def key_ids(self) -> list[bytes]:
        """``key_id``, then during a rotation the previous secret's (a node tier files blocks under each)."""
        return self.sealer().key_ids

    def for_key(self, key: bytes) -> Sealer:
        """The sealer of the tenant whose block ``key`` names (``keys.tenant_of``)."""
        return self.sealer(tenant_of(key))

    def sealer(self, tag: bytes = b"") -> Sealer:
        """The sealer of the tenant tagged ``tag`` (b"": blocks of no tenant), derived once while kept."""
        sealer = self._sealers.get(tag)
        if sealer is None:
            if len(tag) not in (0, TENANT_TAG_BYTES):
                raise ValueError(f"a tenant tag is {TENANT_TAG_BYTES} bytes, got {len(tag)}")
            if len(self._sealers) >= MAX_SEALERS:
                self._sealers.clear()
            secrets = [self.current] if self.previous is None else [self.current, self.previous]
            sealer = self._sealers.setdefault(tag, Sealer([TenantKey(secret, tag) for secret in secrets]))
        return sealer


class Sealer:
    """Seals with the first of ``keys`` and opens with whichever of them a seal names."""

    def __init__(self, keys: Sequence[TenantKey]) -> None:
        self._keys = {key.id: key.key for key in keys}
        self._sealing = keys[0]

    @property
    def key_id(self) -> bytes:
        """The id of the key it seals with (a hash of the key, never the key: doctor compares them)."""
        return self._sealing.id

    @property
    def key_ids(self) -> list[bytes]:
        """The ids of the keys it opens with, the one it seals with first."""
        return list(self._keys)

    def seal(self, plain: Sequence[Buffer], out: Sequence[Buffer], associated: bytes) -> bytes:
        """Encrypt the pieces ``plain`` into ``out`` (piece for piece, of equal lengths), binding
        ``associated``; returns the seal to keep beside the ciphertext."""
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        nonce = os.urandom(NONCE_BYTES)
        encryptor = Cipher(algorithms.AES(self._sealing.key), modes.GCM(nonce)).encryptor()
        encryptor.authenticate_additional_data(associated)
        for source, target in _pairs(plain, out):
            encryptor.update_into(source, target)
        encryptor.finalize()
        return self._sealing.id + nonce + encryptor.tag

    def seal_into(self, plain: Sequence[Buffer], out: Buffer, associated: bytes) -> bytes:
        """``seal`` into one piece of memory ``out``, as long as the pieces ``plain`` together (a record's
        or a slot's stored bytes), or ``TAG_BYTES`` longer: then one piece is sealed in one call of the
        cipher (``AESGCM.encrypt_into``, which leaves the tag in those last bytes), holding Python's lock
        for one call instead of a cipher object's several (64 KiB blocks sealed on 8 threads of 2 cores:
        4.2 -> 27 GB/s)."""
        target = memoryview(out).cast("B")
        size = sum(memoryview(piece).nbytes for piece in plain)
        if len(plain) == 1 and len(target) == size + TAG_BYTES:
            nonce = os.urandom(NONCE_BYTES)
            self._sealing.aead.encrypt_into(nonce, plain[0], associated, target)
            return self._sealing.id + nonce + bytes(target[size:])
        if len(target) not in (size, size + TAG_BYTES):
            raise ValueError(f"sealing {size} bytes into {len(target)}: the target must be as long, or a tag longer")
        pieces, at = [], 0
        for piece in plain:
            length = memoryview(piece).nbytes
            pieces.append(target[at : at + length])
            at += length
        return self.seal(plain, pieces, associated)

    def open(self, sealed: Sequence[Buffer], out: Sequence[Buffer], seal: bytes, associated: bytes) -> bool:
        """Decrypt the pieces ``sealed`` into ``out`` (piece for piece, of equal lengths; a piece may be
        its own target) and check them against ``seal`` and ``associated``. False when they do not
        open: another key or identity, a changed byte, a seal of no key held here; ``out`` is then
        zeroed, so that nothing unauthenticated (nor the ciphertext, opened in place) stays where a
        block was expected."""
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        pairs = _pairs(sealed, out)
        key = self._keys.get(bytes(seal[:KEY_ID_BYTES])) if len(seal) == SEAL_BYTES else None
        if key is None:
            _zero(pairs)
            return False
        nonce, tag = seal[KEY_ID_BYTES : KEY_ID_BYTES + NONCE_BYTES], seal[KEY_ID_BYTES + NONCE_BYTES :]
        decryptor = Cipher(algorithms.AES(key), modes.GCM(bytes(nonce), bytes(tag))).decryptor()
        decryptor.authenticate_additional_data(associated)
        for source, target in pairs:
            decryptor.update_into(source, target)
        try:
            decryptor.finalize()
            return True
        except InvalidTag:
            _zero(pairs)
            return False


def _zero(pairs: list[tuple[memoryview, memoryview]]) -> None:
    for _, target in pairs:
        target[:] = bytes(len(target))


def _pairs(sources: Sequence[Buffer], targets: Sequence[Buffer]) -> list[tuple[memoryview, memoryview]]:
    """Pieces of equal lengths, as byte views; ValueError otherwise."""
    views = [(memoryview(s).cast("B"), memoryview(t).cast("B")) for s, t in zip(sources, targets, strict=True)]
    if any(len(s) != len(t) for s, t in views):
        raise ValueError("sealing copies piece for piece: each target must be as long as its source")
    return views


class SealingSettings(ConfigModel):
    """Blocks sealed at rest, as a tier's config asks: ``encryption: aes-gcm`` seals every block the tier
    writes under a key derived from the secret in ``encryption_key_env``; during a rotation, blocks
    sealed under the secret in ``encryption_previous_key_env`` still open (new ones never use it)."""

    encryption: Literal["none", "aes-gcm"] = "none"
    encryption_key_env: EnvName | None = Field(None, description=env_name_hint("KVTIER_SEAL_KEY"))
    encryption_previous_key_env: EnvName | None = Field(None, description=env_name_hint("KVTIER_SEAL_KEY_OLD"))

    def sealing_problems(self) -> ProblemList:
        """A secret named without ``encryption``, or ``encryption`` without its secret."""
        if self.encryption == "none":
            named = [key for key in ("encryption_key_env", "encryption_previous_key_env") if getattr(self, key)]
            return [((key,), f"{key} is set but encryption is none; set encryption: aes-gcm") for key in named]
        if self.encryption_key_env is None:
            return [(("encryption_key_env",), "encryption: aes-gcm needs encryption_key_env, its secret's variable")]
        return []

    def sealing(self) -> SealingKeys | None:
        """The keys the tier's blocks are sealed with (each tenant's sealer derived from them), or None
        where it does not seal; ConfigError for a secret that is unset or short, or a missing
        ``cryptography`` package."""
        if self.encryption == "none":
            return None
        assert self.encryption_key_env is not None  # (sealing_problems)
        return SealingKeys.from_env(self.encryption_key_env, self.encryption_previous_key_env)
