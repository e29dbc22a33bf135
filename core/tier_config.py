"""The schema every tier's model builds on: the strict base of kvtier's config models, the keys every
tier has (``TierConfigBase``: name, capacity, eviction, watermark, tenants' shares) and the rules a
medium's own model may add; a tier kvtier allocates itself (``SizedTierConfig``).

Apart from the stack's schema (``kvtier.core.config``), which is the union of the registered media's
models: a medium's model lives beside its tier (``kvtier.tiers.*``), and what it builds on is here,
below both, with the settings other schemas share (sealing's, ``kvtier.core.sealing``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Annotated, ClassVar, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvtier.core.keys import tenant_of, tenant_tag
from kvtier.core.sizes import Size, format_size
from kvtier.policies import EvictionPolicy, check_policy_name
from kvtier.policies.shares import TenantShares

EnvName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
"""The name of an environment variable: secrets enter kvtier only that way, never as values in a config."""


def env_name_hint(example: str) -> str:
    """What a field naming an environment variable expects, for the message when it gets something else."""
    return f"the name of an environment variable, e.g. {example}"


class ConfigModel(BaseModel):
    """Strict and closed: unknown keys and type coercions are errors, so typos never pass silently."""

    model_config = ConfigDict(extra="forbid", strict=True)


class WatermarkConfig(ConfigModel):
    """High and low marks as fractions of a tier's capacity (see kvtier.policies.watermark)."""

    high: float = 0.95
    low: float = 0.85

    @model_validator(mode="after")
    def _ordered(self) -> WatermarkConfig:
        if not 0.0 < self.low < self.high <= 1.0:
            raise ValueError(f"needs 0 < low < high <= 1, got high={self.high!r} low={self.low!r}")
        return self


OTHER_TENANTS, NO_TENANT = "other", "none"
"""The labels per-tenant counts use besides the tenants shares name (``tenant_labels``)."""


class TenantSharesConfig(ConfigModel):
    """A tier's shares among tenants (``policies/shares.py``), as fractions of its capacity: ``shares``
    names tenants (their ids, as the engine gives them: vLLM's ``cache_salt``, the API's ``tenant=``),
    ``default_share`` is every other tenant's (blocks of no tenant too). The default 0 guarantees an
    unnamed tenant nothing, and the tenant holding most gives first: the tenants present even out."""

    default_share: float = Field(0.0, ge=0.0, le=1.0)
    shares: dict[Annotated[str, Field(min_length=1, max_length=255)], Annotated[float, Field(gt=0.0, le=1.0)]] = {}

    @model_validator(mode="after")
    def _at_most_the_whole(self) -> TenantSharesConfig:
        taken = sorted({OTHER_TENANTS, NO_TENANT} & set(self.shares))
        if taken:
            raise ValueError(
                f"{taken[0]!r} is the label of the tenants the shares do not name (other) or of blocks of no "
                f"tenant (none); a tenant of that id cannot be named here"
            )
        if sum(self.shares.values()) > 1.0 + 1e-9:
            raise ValueError(
                f"the named shares add up to {sum(self.shares.values()):.3g}, more than the whole tier (1): "
                f"a share is a guarantee, and no tier can guarantee more than it holds"
            )
        return self

    def policy(
        self,
        make: Callable[[], EvictionPolicy],
        key_secret: bytes | None,
        tag_of: Callable[[bytes], bytes] = tenant_of,
    ) -> TenantShares:
        """``make``'s policy shared out: each named tenant known by its tag under ``key_secret``, and
        counted under its label (``tenant_labels``); a block's tenant is ``tag_of(key)`` (by default the
        tag its key begins with)."""
        shares = {tenant_tag(name, key_secret): share for name, share in self.shares.items()}
        label_of = tenant_labels(self.shares, key_secret)
        return TenantShares(make, tag_of, shares, self.default_share, label_of=label_of)


def tenant_labels(names: Iterable[str], key_secret: bytes | None) -> Callable[[bytes], str]:
    """The label a tenant's counts go under, from its tag: its name where ``names`` (a config's named
    tenants) hold it, ``other`` for every other tenant, ``none`` for blocks of no tenant: as few labels
    as the config names tenants, however many come."""
    by_tag = {tenant_tag(name, key_secret): name for name in names}
    return lambda tag: by_tag.get(tag) or (OTHER_TENANTS if tag else NO_TENANT)


class TierConfigBase(ConfigModel):
    """Fields every tier shares, and the rules a medium's schema may add: each medium's model (its
    registry entry's ``config``, ``kvtier.core.media``) fixes ``medium`` and its capacity rule."""

    keyed: ClassVar[bool] = False
    """A store addressed by key that manages its own memory: no capacity, slots or policy of kvtier's."""
    header_room_above: ClassVar[int] = 0
    """Bytes each host slot of a stack with this tier keeps before its block (``StackConfig.header_room``)."""

    @property
    def fetches(self) -> bool:
        """A keyed store whose reads land in memory of their own first, so that a read past its deadline
        writes nowhere: a load from it may go straight into memory nothing keeps out of use afterwards."""
        return False

    medium: str
    name: str | None = Field(None, min_length=1)
    capacity: Size | None = None
    capacity_blocks: int | None = Field(None, gt=0)
    eviction: str | None = None  # None: the measured default for the tier's place (StackConfig)
    watermark: WatermarkConfig | None = None
    tenants: TenantSharesConfig | None = None  # shares of its capacity among tenants (None: one pool)

    @field_validator("eviction")
    @classmethod
    def _known_policy(cls, value: str | None) -> str | None:
        """A registered name or the shape of a dotted path; nothing is imported until the whole config
        validated (``load_config``), so a config that is refused never runs the code it names."""
        if value is None:
            return value
        check_policy_name(value)  # its PolicyError is a ValueError: pydantic names the key
        return value

    def _both_capacities(self) -> None:
        if self.capacity is not None and self.capacity_blocks is not None:
            raise ValueError(
                f"give capacity or capacity_blocks, not both (capacity={format_size(self.capacity)}, "
                f"capacity_blocks={self.capacity_blocks})"
            )

    @classmethod
    def yaml_keys(cls) -> list[str]:
        """The keys a tier of this medium takes in YAML."""
        return list(cls.model_fields)

    def footprint(self, block_bytes: int, header_room: int = 0) -> int:
        """Bytes of the tier's ``capacity`` one block takes (with the stack's ``header_room`` for host slots)."""
        return block_bytes

    def stack_problems(self, stack: StackShape, i: int) -> ProblemList:
        """What is wrong with this tier being ``stack.tiers[i]`` (its place, its size against the block)."""
        return []


ProblemList = list[tuple[tuple[str | int, ...], str]]
"""Problems at key paths below the validated model (``Problems``' items)."""


class SizedTierConfig(TierConfigBase):
    """A tier kvtier allocates itself, so its size must be given (bytes or blocks)."""

    @model_validator(mode="after")
    def _capacity(self) -> SizedTierConfig:
        self._both_capacities()
        if self.capacity is None and self.capacity_blocks is None:
            raise ValueError("missing key 'capacity' or 'capacity_blocks'")
        return self


class StackShape(Protocol):
    """What a tier's own rules may ask of the stack around it (``StackConfig`` is one): the tiers, and
    the block size where the stack gives one."""

    @property
    def tiers(self) -> Sequence[TierConfigBase]: ...

    @property
    def block_bytes(self) -> int | None: ...
