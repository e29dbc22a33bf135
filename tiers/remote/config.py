"""The remote tier's YAML schema, and the registry of the stores it can use: each backend (Mooncake
Store in ``mooncake_settings``, Redis/Valkey in ``redis_settings``) is one ``StoreBackend`` entry with
its settings model and how to open its clients, so kvtier's core knows no store and a new store is its
client module, its settings module and one ``register_store_backend`` call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from kvtier.core.config_messages import Problems, explain
from kvtier.core.devices import HOST
from kvtier.core.errors import shown
from kvtier.core.sealing import SealingSettings
from kvtier.core.tier_config import ConfigModel, EnvName, ProblemList, StackShape, TierConfigBase, env_name_hint
from kvtier.tiers.keyed import sized_by_owner
from kvtier.tiers.remote.link import Connector

INSTALL = "pip install 'kvtier[remote]'"
"""The install line a missing client package's error names."""


@dataclass(frozen=True)
class StoreBackend:
    """One store a remote tier can use (``backend: <name>``): its settings, given under the tier's key of
    the backend's name, and how to open its clients (``connector(settings, timeout, lends_memory)``;
    a client that does not lend memory only asks: lookups)."""

    name: str
    settings: type[ConfigModel]
    connector: Callable[[Any, float, bool], Connector]
    reads_anywhere: bool = True
    """Its clients read into any memory (Redis's); False where they read only into memory registered
    with them (Mooncake's transfer engine): such a store keeps no namespace registry (``RemoteTier``)."""
    fetches: bool | Callable[[Any], bool] = False
    """Whether its clients ``fetch`` records into memory of their own (``StoreClient.fetch``): a load then
    never writes into memory it was given after its deadline, so it may go straight into the caller's
    blocks (no staging through a host slot that a late write could reach). A callable decides from the
    backend's settings (Mooncake's ``fetch_buffer``); ``fetches_with`` answers either way."""

    def fetches_with(self, settings: Any) -> bool:
        """Whether clients opened with ``settings`` fetch."""
        return self.fetches(settings) if callable(self.fetches) else self.fetches


_BACKENDS: dict[str, StoreBackend] = {}


def register_store_backend(backend: StoreBackend) -> None:
    """Add a store: remote tiers can name it as their ``backend`` from now on."""
    known = _BACKENDS.get(backend.name)
    if known is not None and known != backend:
        raise ValueError(f"a store backend named {backend.name!r} is registered already")
    _BACKENDS[backend.name] = backend


def unregister_store_backend(name: str) -> None:
    """Remove a store a program registered (a test's, a plugin being unloaded)."""
    _BACKENDS.pop(name, None)


def store_backend(name: str) -> StoreBackend:
    return _BACKENDS[name]


def store_backends() -> tuple[str, ...]:
    """The registered backends' names, in the order registered."""
    return tuple(_BACKENDS)


HEADER_ROOM = 4096
"""Bytes before each host slot of a stack with a remote tier, for a record's header, so header and block
move to and from the store as one piece (a separate header piece cost Mooncake's transfers 4-9 ms per
64 x 2 MiB batch); a page, so slots stay page-aligned."""


class RemoteTierConfig(SealingSettings, TierConfigBase):
    """A store shared with other engines (Mooncake Store, Redis/Valkey): always the last tier.

    It has no capacity, eviction policy or watermark: the store manages its own memory and evicts by
    itself. ``placement`` is its own, whatever the stack's: ``write_through`` (default) copies every
    block to the store as soon as it is in host memory; ``write_back`` sends only the host tier's
    victims. Secrets come from environment variables named here (``auth_key_env``, the backend's
    ``password_env``), never from the file.
    """

    model_config = ConfigDict(extra="allow", strict=True)  # the backend's settings, under its name (checked below)
    keyed: ClassVar[bool] = True
    header_room_above: ClassVar[int] = HEADER_ROOM

    medium: Literal["remote"]
    backend: str
    timeout: float = Field(2.0, gt=0)  # seconds any call to the store may take; then it is a miss or a drop
    prefix: str = Field(
        "kvtier",
        pattern=r"^\S+$",  # record names start with it
        description="a name without spaces, e.g. kvtier",
    )
    # a MAC secret: records without a valid MAC are misses
    auth_key_env: EnvName | None = Field(None, description=env_name_hint("KVTIER_REMOTE_MAC_KEY"))
    placement: Literal["write_through", "write_back"] = "write_through"
    _settings: ConfigModel | None = PrivateAttr(None)

    @property
    def fetches(self) -> bool:
        return store_backend(self.backend).fetches_with(self.settings)

    @classmethod
    def yaml_keys(cls) -> list[str]:
        return [*super().yaml_keys(), *store_backends()]

    @property
    def settings(self) -> ConfigModel:
        """The backend's settings, validated by its own model."""
        assert self._settings is not None  # (set by validation)
        return self._settings

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        if value not in _BACKENDS:
            raise ValueError(f"{shown(value)} is not allowed; allowed: {', '.join(_BACKENDS)}")
        return value

    @model_validator(mode="after")
    def _store_owns_its_memory(self) -> RemoteTierConfig:
        problems = sized_by_owner(
            self, "a remote tier", "the store manages its own memory and evicts by itself (size it on the server)"
        )
        problems.extend(self._backend_problems())
        problems.extend(self._sealing_problems())
        if problems:
            raise Problems(problems)
        return self

    def _sealing_problems(self) -> ProblemList:
        """``SealingSettings``' own, and a MAC beside a seal: a sealed record's tag authenticates it."""
        problems = self.sealing_problems()
        if self.encryption != "none" and self.auth_key_env is not None:
            problems.append(
                (
                    ("auth_key_env",),
                    "a sealed record is authenticated by its seal (encryption: aes-gcm): remove auth_key_env",
                )
            )
        return problems

    def _backend_problems(self) -> ProblemList:
        """The chosen backend's settings, validated by its model (kept in ``settings``); settings of
        another backend or a key nobody knows are mistakes."""
        problems: ProblemList = []
        given = self.model_extra or {}
        for key in given:
            if key in _BACKENDS and key != self.backend:
                problems.append(
                    ((key,), f"settings for {key} but the backend is {self.backend}; remove them or set backend: {key}")
                )
            elif key not in _BACKENDS:
                problems.append(((key,), f"unknown key {key!r}; allowed: {', '.join(self.yaml_keys())}"))
        chosen = _BACKENDS[self.backend]
        if self.backend not in given:
            fields = ", ".join(chosen.settings.model_fields)
            return [((), f"missing key {self.backend!r}: the {self.backend} backend's settings ({fields})"), *problems]
        try:
            self._settings = chosen.settings.model_validate(given[self.backend])
        except ValidationError as exc:
            problems.extend(
                ((self.backend, path) if path else (self.backend,), msg)
                for path, msg in explain(exc, chosen.settings, {})
            )
        return problems

    def stack_problems(self, stack: StackShape, i: int) -> ProblemList:
        """Where a remote tier may sit: last (nothing of ours lies below a store others evict from), with
        a host tier above it (blocks reach the store from host memory and come back through it), and
        with ``write_back`` directly below the host tier (a disk tier's victims would need a copy
        through host memory to reach the store)."""
        problems: ProblemList = []
        if i != len(stack.tiers) - 1:
            problems.append(
                (
                    ("medium",),
                    "a remote tier may only be the last tier: the store evicts and loses blocks by itself, so no "
                    "tier of kvtier's can sit below it",
                )
            )
        if not any(t.medium == HOST for t in stack.tiers):
            problems.append(
                (
                    ("medium",),
                    "a remote tier needs a host tier above it: blocks reach the store from host memory and come "
                    "back through it",
                )
            )
        elif self.placement == "write_back" and i > 0 and stack.tiers[i - 1].medium != HOST:
            problems.append(
                (
                    ("placement",),
                    f"write_back needs the host tier directly above the remote tier (tiers[{i - 1}] is "
                    f"{stack.tiers[i - 1].medium}): its victims would need a copy through host memory to reach "
                    f"the store; use write_through",
                )
            )
        return problems
