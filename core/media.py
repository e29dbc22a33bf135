"""The media kvtier keeps blocks in, each one registry entry.

A medium is what configuration, routes, eviction and an engine's counters speak of: ``gpu``, ``host``,
``disk``, ``remote``, ``node``, and any medium a program registers. Everything the rest of kvtier asks
of a medium is in its ``Medium`` entry (its YAML schema, how to build its tier alone and under an
engine, which media it copies to without staging, its labels, its transfer backend where
``kvtier.transfers`` has none for it, what ``kvtier doctor`` checks of it, what it keeps across an
engine's restart), so a new medium is its tier module and one ``register_medium`` call: no module of
kvtier branches on a medium's name, except on ``host``, the medium every route passes through (and
``gpu``, an engine's own blocks: ``kvtier.core.devices``).

The names of devices and of those two media are ``kvtier.core.devices``', which imports nothing of
kvtier: the entries here name the schema, storage and tier types, and those modules use the names.
The schema learns the registered media from here (``use_tier_configs``), not the other way round.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kvtier.core.checks import Check, DoctorRequest
from kvtier.core.config import StackConfig, TransferConfig, use_tier_configs
from kvtier.core.devices import Capabilities
from kvtier.core.layout import BlockLayout
from kvtier.core.storage import BlockStorage
from kvtier.core.tier import Tier
from kvtier.core.tier_config import TierConfigBase
from kvtier.core.transfer import TransferBackend
from kvtier.policies import EvictionPolicy, Watermark


@dataclass(frozen=True)
class TierRequest:
    """What a standalone stack gives a medium's factory to build its tier ``stack.tiers[index]``: the
    number of slots its capacity holds (0 for a keyed store, which has none)."""

    index: int
    stack: StackConfig
    layout: BlockLayout
    slots: int
    is_fenced: Callable[[str, int], bool]

    @property
    def name(self) -> str:
        return self.stack.tier_name(self.index)

    @property
    def config(self) -> TierConfigBase:
        return self.stack.tiers[self.index]

    def policy(self) -> tuple[EvictionPolicy, Watermark | None]:
        """A new eviction policy for the tier and its watermark (``StackConfig.tier_policy``)."""
        return self.stack.tier_policy(self.index)


@dataclass(frozen=True)
class RankRequest:
    """What an engine's worker (one process per GPU, ``rank`` of ``ranks``) gives a medium's factory to
    open that rank's storage of a tier: the slots its scheduler side indexes, the namespace its blocks
    are written under, and how the ranks share it."""

    config: TierConfigBase
    slots: int
    layout: BlockLayout
    namespace: str
    rank: int
    ranks: int
    replicated: bool  # every rank holds the same KV (MLA): one copy of each block serves them all
    header_room: int  # bytes a host slot keeps before each block (StackConfig.header_room)
    shared_name: str | None  # the ranks' shared host slab, where one copy serves every rank
    refuse: Callable[[list[bytes]], None]  # for blocks this storage can never hold (``BlockStorage.refuse``)
    # where the storage counts what its tier would (``Tier.count``: ``skipped_existing=n``), for the engine's stats
    count: Callable[..., None] = lambda **counts: None


@dataclass(frozen=True)
class EngineTierRequest:
    """What an engine's scheduler side gives a medium addressed by key to open its tier there: the tier's
    ``name`` and ``config``, the blocks' ``layout``, the ``namespace`` the workers write under, and the
    ranks whose copies a block needs (``[None]``: one copy serves every rank)."""

    name: str
    config: TierConfigBase
    layout: BlockLayout
    namespace: str
    ranks: Sequence[int | None]


@dataclass(frozen=True)
class RestartRequest:
    """What an engine's scheduler side gives a medium whose blocks outlive the engine, to find those a
    previous engine left in a tier: its ``config``, the ``ranks`` holding a copy of their own of each
    block (one where they share it), the tier's ``slots`` (the same on every rank), and the ``layout``
    and ``namespace`` the workers write blocks with."""

    config: TierConfigBase
    ranks: int
    slots: int
    layout: BlockLayout
    namespace: str


class KeptBlocks(Protocol):
    """A tier's blocks kept across an engine's restart (``Medium.kept_blocks``): taken back at the
    engine's start, left for the next start at its clean shutdown."""

    @property
    def where(self) -> str:
        """What log lines name the tier's storage by (a disk tier's path)."""
        ...

    def recover(self, restore: Callable[[Sequence[bytes], Sequence[int] | np.ndarray], object]) -> str:
        """Hand the blocks kept, as keys and slots oldest first, to ``restore`` (``ChunkedRestore.start``);
        returns where they were found, in words."""
        ...

    def save(self, keys: list[bytes], slots: list[int]) -> None:
        """Leave the READY blocks ``keys`` at ``slots`` (oldest first) for the next start, once the
        workers closed their storages; logged, never raised, when that fails."""
        ...


@dataclass(frozen=True)
class Medium:
    """One medium's registry entry: everything kvtier needs to configure, build, route to and count it."""

    name: str
    config: type[TierConfigBase]  # its YAML schema: ``medium: Literal[name]`` and its own keys
    tier: Callable[[TierRequest], Tier]  # its tier in a standalone stack
    # one rank's storage of the tier under an engine's worker; None where the engine owns the medium (gpu)
    rank_storage: Callable[[RankRequest], BlockStorage] | None
    # whether a copy between this medium and another (named) needs no staging through host memory
    direct: Callable[[str, Capabilities], bool] = lambda other, caps: False
    event_medium: str | None = None  # the medium vLLM's KV events name ("CPU", "STORAGE"); None: no events
    hit_source: str | None = None  # vLLM's CacheHitSource for its hits ("HOST", "DISK"); None: external
    counts_hits: bool = True  # the adapters count the blocks loaded from it (``hit_blocks_<name>``)
    one_copy_for_ranks: bool = False  # under an engine, ranks with the same KV share one copy (shared memory)
    survives_restart: bool = False  # its blocks outlive the process: a closing stack copies everything down to it
    # a copy to or from it can outlive its job (a store's call past its deadline keeps running): memory at
    # its other end must stay out of use until the call returned, as a host tier of kvtier's keeps its
    # slots (quarantined); memory an engine hands on as soon as the job failed never may be
    copies_outlive_jobs: bool = False
    # under an engine, the blocks its tier keeps across the engine's restart, which the scheduler side
    # (holding the index of every rank's copies) takes back at start and leaves for the next at shutdown
    kept_blocks: Callable[[RestartRequest], KeptBlocks] | None = None
    # the key of its config naming the directory its storage lives in, one process's alone (disk:
    # ``path``): where several processes open one config (SGLang's ranks) each gets a directory of its
    # own inside it, and each run of ``kvtier replay`` a fresh one, so that none finds another's blocks
    directory_key: str | None = None
    # the transfer backend that copies to and from its storage, built for a tier of it (configured by the
    # stack's ``transfer``), where kvtier.transfers has none for it
    backend: Callable[[TransferConfig, TierConfigBase], TransferBackend] | None = None
    # for a medium addressed by key (its index is its owner's): its tier on an engine's scheduler side
    engine_tier: Callable[[EngineTierRequest], Tier] | None = None
    # ``kvtier doctor``'s checks of its tier: what the tier's start would refuse or meet (its directories,
    # its secrets, its store or daemon asked), reported in the tier's place among the checks
    doctor: Callable[[DoctorRequest], list[Check]] | None = None
    # the doctor's checks of its tier's size against the room the machine has (a filesystem's free
    # space), reported after the host memory check, which every stack gets
    doctor_space: Callable[[DoctorRequest], list[Check]] | None = None
    # what decides, besides the keys, whether two engines share its blocks (a store's address, its
    # records' prefix, their keys' fingerprints): the doctor's sharing fields
    sharing: Callable[[TierConfigBase], dict[str, Any]] | None = None


_MEDIA: dict[str, Medium] = {}
_watchers: list[Callable[[], None]] = []


def register_medium(medium: Medium) -> None:
    """Add a medium: its tiers can be configured, built and routed to from now on. Registering a name
    twice is an error unless it is the same entry (a module imported again)."""
    known = _MEDIA.get(medium.name)
    if known is not None and known != medium:
        raise ValueError(f"a medium named {medium.name!r} is registered already")
    _MEDIA[medium.name] = medium
    _changed()


def unregister_medium(name: str) -> None:
    """Remove a medium a program registered (a test's, a plugin being unloaded)."""
    _MEDIA.pop(name, None)
    _changed()


def watch_media(callback: Callable[[], None]) -> None:
    """Call ``callback`` now and whenever the registry changes (the config schema rebuilds its tier union,
    the adapters' counters name every medium)."""
    _watchers.append(callback)
    callback()


def _changed() -> None:
    for callback in _watchers:
        callback()


def media() -> tuple[Medium, ...]:
    """Every registered medium, in the order registered (the built-in ones fastest first)."""
    return tuple(_MEDIA.values())


def medium(name: str) -> Medium:
    """The registered medium ``name``; raises ValueError naming the known ones otherwise."""
    found = _MEDIA.get(name)
    if found is None:
        raise ValueError(f"unknown medium {name!r}; known: {', '.join(_MEDIA)}")
    return found


# The schema's tier union is built from the registry: rebuilt whenever it changes.
watch_media(lambda: use_tier_configs({m.name: m.config for m in media()}))
