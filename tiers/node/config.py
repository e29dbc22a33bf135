"""The node tier's YAML schema (``medium: node``): where the machine's node daemon listens, how long a call
to it may take, and which user it may run as besides this process's own and root."""

from __future__ import annotations

import pwd
from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from kvtier.core.config_messages import Problems
from kvtier.core.devices import HOST
from kvtier.core.sealing import SealingSettings
from kvtier.core.tier_config import ProblemList, StackShape, TierConfigBase
from kvtier.tiers.keyed import sized_by_owner


class NodeTierConfig(SealingSettings, TierConfigBase):
    """The slab of the machine's node daemon (``kvtier node serve``), shared by every engine process on the
    machine: always the last tier. The daemon sizes the slab and evicts from it, so the tier has no
    capacity, eviction policy or watermark; blocks reach it from the engine's memory (or from the host
    tier above it, as soon as they are there) and load straight into the caller's memory. With
    ``encryption: aes-gcm`` the engine seals every block it writes into the slab (every engine maps the
    whole slab: only those holding the secret read these blocks)."""

    keyed: ClassVar[bool] = True

    medium: Literal["node"]
    socket: str = Field(min_length=1, description="the daemon's Unix socket, e.g. /run/kvtier/node.sock")
    timeout: float = Field(1.0, gt=0)  # seconds any call to the daemon may take; then it is a miss or a drop
    daemon_user: str | int | None = None  # a user (name or uid) the daemon may run as, besides ours and root

    @field_validator("daemon_user")
    @classmethod
    def _known_user(cls, value: str | int | None) -> str | int | None:
        if isinstance(value, str):
            try:
                pwd.getpwnam(value)
            except KeyError:
                raise ValueError(f"no user named {value!r} on this machine") from None
        elif isinstance(value, int) and value < 0:
            raise ValueError(f"a uid is not negative, got {value}")
        return value

    @property
    def daemon_uid(self) -> int | None:
        """The uid of ``daemon_user``, if one is given."""
        if isinstance(self.daemon_user, str):
            return pwd.getpwnam(self.daemon_user).pw_uid
        return self.daemon_user

    @model_validator(mode="after")
    def _daemon_owns_the_slab(self) -> NodeTierConfig:
        problems = sized_by_owner(
            self, "a node tier", "the node daemon sizes its slab and evicts by itself (size it in the daemon's YAML)"
        )
        problems += self.sealing_problems()
        if problems:
            raise Problems(problems)
        return self

    def stack_problems(self, stack: StackShape, i: int) -> ProblemList:
        """Where a node tier may sit: last (the daemon evicts by itself, so nothing of kvtier's can sit
        below it), under a host tier where there is a gpu tier, and in a stack with no other tier
        addressed by key (``TierStack`` asks one)."""
        problems: ProblemList = []
        if i != len(stack.tiers) - 1:
            problems.append(
                (
                    ("medium",),
                    "a node tier may only be the last tier: its daemon evicts by itself, so no tier of kvtier's "
                    "can sit below it",
                )
            )
        media = {t.medium for t in stack.tiers}
        if "gpu" in media and HOST not in media:
            problems.append(
                (
                    ("medium",),
                    "a node tier below a gpu tier needs a host tier between them: blocks move between GPU "
                    "memory and the slab through host memory (the slab is not registered with CUDA)",
                )
            )
        others = [t.medium for j, t in enumerate(stack.tiers) if j != i and t.keyed]
        if others:
            problems.append(
                (
                    ("medium",),
                    f"a node tier cannot share a stack with a {others[0]} tier: a stack has at most one tier "
                    f"addressed by key",
                )
            )
        return problems
