"""Exceptions kvtier raises. Each names what was wrong so the caller can act on it."""

from __future__ import annotations

from typing import Any


def shown(value: Any, limit: int = 80) -> str:
    """A value as the user would recognise it in a message: its repr, shortened if long."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class KvtierError(Exception):
    """Base of every error kvtier raises on purpose."""


class ConfigError(KvtierError, ValueError):
    """A configuration file or dict is invalid; the message names the key, the value and what is allowed."""


class ArgumentError(KvtierError, ValueError):
    """A call's arguments do not fit together or the object they build (keys and slots of different
    lengths, a stack of tiers that disagree on the block size)."""


class StoreError(KvtierError):
    """A shared store could not be asked at all (unreachable, timed out, refused): no per-record answer."""


class StateError(KvtierError, RuntimeError):
    """An operation does not fit a block's or a job's current state (commit without reserve, unpin below zero)."""


class DoubleFreeError(StateError):
    """A slot was freed that is already free."""


class CapacityError(KvtierError, ValueError):
    """A request can never fit: more blocks than the whole tier holds."""


class FenceError(StateError):
    """A slot was reused, freed or overwritten while a job still reads or writes it."""


class ClosedError(KvtierError, RuntimeError):
    """The stack, tier or backend was used after close()."""


class TransferError(KvtierError, RuntimeError):
    """A transfer could not be set up (incompatible storages, bad slot ids)."""
