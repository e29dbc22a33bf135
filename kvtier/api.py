"""The plain Python API for engines other than vLLM: store, look up and load KV blocks by token ids or keys.

    with KVTier.open("kvtier.yaml") as kv:
        kv.store(token_ids, blocks).result()       # blocks: one array of n blocks, or a list of n arrays
        kv.store_now(token_ids, blocks)            # the same, copying on this thread (quicker)
        n = kv.lookup(token_ids)                   # leading blocks present in some tier
        kv.load(token_ids, out).result()           # fills out[:n], bit-exact
        kv.load_now(token_ids, out)                # the same, waiting on this thread (quicker from a store)

Token ids are hashed into chained block keys (only full blocks get one); callers that already have
keys pass a list of ``bytes`` instead. Every data call returns a ``concurrent.futures.Future``; the
``a``-prefixed methods are the asyncio flavour of the same calls. A lookup that ends early is counted
with its reason (``stats()["misses"]``, ``core/misses.py``); ``explain`` names it for one prompt. A
stack records its namespace in its disk and remote tiers when it opens, so a prompt whose blocks a
stack of another block size or namespace stored there misses as ``other_namespace``, naming the
fields that differ (``core/namespaces.py``).

Every call takes ``tenant=`` (a str or bytes id, whoever the request belongs to): a tenant's blocks are
keyed apart from everyone else's (no hit across tenants), sealed under its own key where a tier seals,
and held against its share where a tier has ``tenants:`` settings (``core/keys.py``: ``tenant_tag``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeGuard

from kvtier.builder import build_stack, config_layout
from kvtier.core.config import StackConfig, default_config_path, load_config
from kvtier.core.errors import ArgumentError
from kvtier.core.keys import KeyFolder, chain_hashes, check_key, key_secret, tenant_tag
from kvtier.core.misses import Miss, MissReason, in_other_namespace
from kvtier.core.namespaces import KnownNamespace, OtherNamespaces, secret_fingerprint, stack_fields
from kvtier.core.stack import LoadResult, StackLookup, StoreResult, TierStack
from kvtier.core.storage import BlockStorage, buffer_storage
from kvtier.event_publisher import EventPublisher

log = logging.getLogger(__name__)

Blocks = Any  # a numpy array or torch tensor of n blocks, or a list of n such arrays
TokensOrKeys = Sequence[int] | Sequence[bytes]
Tenant = str | bytes | None


def _are_token_ids(tokens_or_keys: TokensOrKeys) -> TypeGuard[Sequence[int]]:
    """Token ids rather than block keys, as the first element tells (none: no block either way)."""
    return not (len(tokens_or_keys) and isinstance(tokens_or_keys[0], (bytes, bytearray)))


class KVTier:
    """A tier stack opened from a configuration, addressed by token ids or block keys."""

    def __init__(self, config: StackConfig) -> None:
        self.key_secret = key_secret(config.key_secret_env)  # first: an unset secret opens nothing
        self.config = config
        self.layout = config_layout(config)
        self.stack: TierStack = build_stack(config, self.layout)
        self._fold = KeyFolder(config.namespace, self.key_secret)
        ours = _namespace(config, self.key_secret)
        self.publisher: EventPublisher | None = None
        try:
            self.namespaces = None if ours is None else OtherNamespaces(ours, self.stack.tiers, self.key_secret)
            if config.events is not None:
                self.publisher = EventPublisher(config.events, self.stack.tiers, config.block_tokens)
        except BaseException:
            self.stack.close()
            raise

    @classmethod
    def open(cls, config: str | Path | dict | StackConfig | None = None) -> KVTier:
        """Open a stack from a YAML path, a dict, a parsed config, or (None) the embedded default."""
        if not isinstance(config, StackConfig):
            config = load_config(default_config_path() if config is None else config)
        return cls(config)

    # --- keys ----------------------------------------------------------------------------------

    def keys(self, tokens_or_keys: TokensOrKeys, tenant: Tenant = None) -> list[bytes]:
        """Block keys: token ids hashed per full block with this stack's namespace (keyed with the secret
        of ``key_secret_env`` when set), given keys as they are. Given keys must be 1 to MAX_KEY_BYTES
        bytes each (TypeError or ValueError otherwise), the most a tier keeps whole. A ``tenant``'s keys
        begin with its tag (given keys are then folded to 16 bytes behind it)."""
        tag = b"" if tenant is None else tenant_tag(tenant, self.key_secret)
        if _are_token_ids(tokens_or_keys):
            return chain_hashes(
                tokens_or_keys, self.config.block_tokens, self.config.namespace, secret=self.key_secret, tag=tag
            )
        keys = [check_key(bytes(k) if isinstance(k, (bytes, bytearray)) else k) for k in tokens_or_keys]
        return [tag + key for key in self._fold(keys)] if tag else keys

    # --- blocking calls returning futures ------------------------------------------------------

    def lookup(self, tokens_or_keys: TokensOrKeys, tenant: Tenant = None) -> int:
        """Number of leading blocks present in some tier (loadable now). A lookup that ends before the
        prompt's end (token ids: its partial last block too) is counted in ``stats()["misses"]``."""
        return self.locate(tokens_or_keys, tenant).hits

    def locate(self, tokens_or_keys: TokensOrKeys, tenant: Tenant = None) -> StackLookup:
        """Like ``lookup``, also naming the tier that holds each block."""
        keys = self.keys(tokens_or_keys, tenant)
        found = self.stack.lookup(keys, count=False)
        self.stack.misses.count(self._miss(tokens_or_keys, keys, found.hits, tenant))
        return found

    def explain(self, tokens_or_keys: TokensOrKeys, tenant: Tenant = None) -> Miss | None:
        """Why a lookup of this prompt ends early now, in total and per tier (None: it does not);
        counts nothing. Asks a remote tier, like a lookup."""
        keys = self.keys(tokens_or_keys, tenant)
        return self._miss(tokens_or_keys, keys, self.stack.lookup(keys, count=False).hits, tenant)

    def _miss(self, tokens_or_keys: TokensOrKeys, keys: list[bytes], hits: int, tenant: Tenant) -> Miss | None:
        """The miss of a lookup of ``keys`` that found ``hits``; token ids say whether a partial block
        follows, and whether a block never stored here is stored under another namespace (searched for
        blocks of no tenant: a tenant's are keyed apart from every namespace's)."""
        partial = _are_token_ids(tokens_or_keys) and len(tokens_or_keys) % self.config.block_tokens != 0
        miss = self.stack.misses.explain(keys, hits, partial)
        if miss is None or miss.reason is not MissReason.NEVER_STORED or self.namespaces is None:
            return miss
        if not _are_token_ids(tokens_or_keys) or tenant is not None:
            return miss
        found = self.namespaces.find(tokens_or_keys, hits * self.config.block_tokens)
        return in_other_namespace(miss, found) if found else miss

    def store(self, tokens_or_keys: TokensOrKeys, blocks: Blocks, tenant: Tenant = None):
        """Copy the caller's blocks into the stack; one block per key, in order.

        The future resolves to a StoreResult once ``blocks`` may be reused.
        """
        keys, storage = self._source(tokens_or_keys, blocks, tenant)
        return self.stack.store(keys, storage, range(len(keys)))

    def store_now(
        self, tokens_or_keys: TokensOrKeys, blocks: Blocks, timeout: float | None = None, tenant: Tenant = None
    ) -> StoreResult:
        """``store(...).result(timeout)``, quicker: the copy into the first tier runs on this thread,
        where ``store`` wakes a copy thread for it (see ``TierStack.store_now``)."""
        keys, storage = self._source(tokens_or_keys, blocks, tenant)
        return self.stack.store_now(keys, storage, range(len(keys)), timeout=timeout)

    def _source(self, tokens_or_keys: TokensOrKeys, blocks: Blocks, tenant: Tenant) -> tuple[list[bytes], BlockStorage]:
        """The keys and blocks of a store; the blocks' tokens told to the publisher (their events carry them)."""
        keys = self.keys(tokens_or_keys, tenant)
        storage = buffer_storage(blocks, self.layout)
        if storage.num_slots < len(keys):
            raise ArgumentError(f"{len(keys)} keys but only {storage.num_slots} blocks given")
        if self.publisher is not None and _are_token_ids(tokens_or_keys):
            self.publisher.note(keys, list(tokens_or_keys))
        return keys, storage

    def load(self, tokens_or_keys: TokensOrKeys, out: Blocks, tenant: Tenant = None):
        """Copy the longest present prefix of blocks into ``out`` (block i into out's block i).

        The future resolves to a LoadResult: ``hits`` blocks were found, ``failed`` lists those that
        could not be read (treat them, and everything after the first of them, as a miss).
        """
        keys, storage = self._destination(tokens_or_keys, out, tenant)
        return self.stack.load(keys, storage, range(len(keys)))

    def load_now(
        self, tokens_or_keys: TokensOrKeys, out: Blocks, timeout: float | None = None, tenant: Tenant = None
    ) -> LoadResult:
        """``load(...).result(timeout)``, quicker from a shared store: its calls run on this thread,
        where ``load`` wakes a worker for each (see ``TierStack.load_now``)."""
        keys, storage = self._destination(tokens_or_keys, out, tenant)
        return self.stack.load_now(keys, storage, range(len(keys)), timeout=timeout)

    def _destination(
        self, tokens_or_keys: TokensOrKeys, out: Blocks, tenant: Tenant
    ) -> tuple[list[bytes], BlockStorage]:
        keys = self.keys(tokens_or_keys, tenant)
        storage = buffer_storage(out, self.layout, writable=True)
        if storage.num_slots < len(keys):
            raise ArgumentError(f"{len(keys)} keys but room for only {storage.num_slots} blocks in out")
        return keys, storage

    # --- asyncio -------------------------------------------------------------------------------

    async def astore(self, tokens_or_keys: TokensOrKeys, blocks: Blocks, tenant: Tenant = None) -> StoreResult:
        return await asyncio.wrap_future(self.store(tokens_or_keys, blocks, tenant))

    async def aload(self, tokens_or_keys: TokensOrKeys, out: Blocks, tenant: Tenant = None) -> LoadResult:
        return await asyncio.wrap_future(self.load(tokens_or_keys, out, tenant))

    async def alookup(self, tokens_or_keys: TokensOrKeys, tenant: Tenant = None) -> int:
        return self.lookup(tokens_or_keys, tenant)  # metadata only: cheap, no thread hop needed

    # --- lifecycle -----------------------------------------------------------------------------

    def describe(self) -> str:
        return self.stack.describe()

    def stats(self) -> dict[str, dict]:
        """Per tier its counters and usage (``TierStack.stats``), and ``"misses"``: lookups that ended
        early by reason, ``{"total": {reason: n}, "by_tier": {tier: {reason: n}}}``."""
        events = {} if self.publisher is None else {"events": self.publisher.stats()}
        return {**self.stack.stats(), "misses": self.stack.misses.stats(), **events}

    def wait_idle(self, timeout: float | None = 60.0) -> None:
        self.stack.wait_idle(timeout)

    def close(self) -> None:
        """Wait for every transfer in flight, copy blocks only memory tiers hold down to a disk tier,
        then release all tiers, threads and files.

        From a future's done-callback (kvtier's own thread) it returns at once and the release follows
        as soon as the callback has returned; new calls raise ClosedError from the moment it is called.
        A KVTier dropped without close() is released when collected, with a ResourceWarning, but
        without the copy to disk.
        """
        try:
            self.stack.close()
        finally:
            if self.publisher is not None:
                self.publisher.close()  # (after the stack: what its close moved goes out too)

    def __enter__(self) -> KVTier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _namespace(config: StackConfig, secret: bytes | None) -> KnownNamespace | None:
    """What a stack of ``config`` records as its namespace where its blocks live (``core/namespaces.py``):
    what its keys are hashed under, and the geometry its records carry. None (logged) for a namespace
    too long to record (over 1,024 characters): that stack then neither records it nor searches."""
    fields = {
        **stack_fields(config.block_tokens, config.namespace),
        "key_secret": secret_fingerprint(secret),
        "block_bytes": config.block_bytes,
        "fragments": config.fragments,
    }
    try:
        return KnownNamespace(fields, time.time())
    except ValueError as exc:
        log.warning("kvtier: this stack's namespace is not recorded, and its misses not searched in others: %s", exc)
        return None
