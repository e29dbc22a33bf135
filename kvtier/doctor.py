"""``kvtier doctor CONFIG``: what would fail when an engine starts on a config, or go wrong silently, said
before it starts.

Each check is a small function returning a ``Check`` and calls what the tiers call at start, so the
doctor and the engine cannot disagree: the config's validation (``load_config``), the key secret's
rules (``key_secret``), each tier's tenant shares, and host memory: the host tiers against
MemAvailable. What a tier of a medium needs besides (a disk tier's directories and free space, a
remote tier's secrets and store, a node tier's daemon, sealing secrets) its medium checks, in its own
package (``Medium.doctor``, ``Medium.doctor_space``: ``kvtier.tiers.disk.doctor``, ...), so that this
module names no medium but host. Nothing is created, locked or written. What decides sharing with
other engines is ``doctor_sharing``'s.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from kvtier.core.checks import Check, DoctorRequest, gib
from kvtier.core.config import StackConfig, capacity_in_blocks, load_config
from kvtier.core.devices import HOST
from kvtier.core.errors import ConfigError
from kvtier.core.keys import key_secret
from kvtier.core.media import medium
from kvtier.doctor_sharing import VllmEngine, sharing


def diagnose(path: str, engine: VllmEngine | None = None) -> dict[str, Any]:
    """The report on the config file at ``path`` (under ``engine``, or for a standalone stack): ``ok``,
    the names of the ``failed`` checks, every check, and what decides sharing (None when the config
    does not load)."""
    try:
        config = load_config(path)
    except ConfigError as exc:
        return _report(path, [Check("config", False, str(exc))], None)
    ranks = 1 if engine is None else engine.tp
    requests = [DoctorRequest(config, i, None if engine is None else engine.tp) for i in range(len(config.tiers))]
    checks = [Check("config", True, f"valid: {len(config.tiers)} tiers"), _key_secret(config)]
    for request in requests:
        own = medium(request.config.medium).doctor
        if own is not None:
            checks += own(request)
        if request.config.tenants is not None:
            checks.append(_tenants(request))
    checks.append(_host_memory(requests, ranks))
    for request in requests:
        space = medium(request.config.medium).doctor_space
        if space is not None:
            checks += space(request)
    return _report(path, checks, sharing(config, engine))


def _report(path: str, checks: list[Check], shared: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "config": path,
        "ok": all(check.ok for check in checks),
        "failed": [check.name for check in checks if not check.ok],
        "checks": [asdict(check) for check in checks],
        "sharing": shared,
    }


def _key_secret(config: StackConfig) -> Check:
    """The secret that keys block hashes: named, set and long enough (``key_secret``, as every engine reads it)."""
    try:
        secret = key_secret(config.key_secret_env)
    except ConfigError as exc:
        return Check("key secret", False, str(exc))
    if secret is None:
        return Check("key secret", True, "none named: keys are unkeyed (key_secret_env)")
    return Check("key secret", True, f"{config.key_secret_env} is set ({len(secret)} bytes)")


def _tenants(request: DoctorRequest) -> Check:
    """A tier's shares among tenants, in blocks where its size is known; whether tenants' names are hidden
    in the keys everyone sharing a tier sees (their tags are keyed hashes only with a key secret)."""
    config, tier = request.stack, request.config
    tenants = tier.tenants
    assert tenants is not None  # (asked for tiers with shares)
    sized = config.block_bytes is not None or tier.capacity is None
    blocks = capacity_in_blocks(tier, config.block_bytes, config.header_room) if sized else None
    shares = {name: round(share * blocks) if blocks else share for name, share in tenants.shares.items()}
    unit = "blocks" if blocks else "of the tier"
    named = ", ".join(f"{name} {n}" for name, n in shares.items()) or "none named"
    message = (
        f"shares ({unit}): {named}; every other tenant {tenants.default_share:g} of the tier; "
        f"{1 - sum(tenants.shares.values()):.2g} of the tier held by no named share"
    )
    if config.key_secret_env is None:
        message += "; without key_secret_env a tenant's tag is a plain hash of its id: a guessed id can be checked"
    details = {"shares": tenants.shares, "default_share": tenants.default_share, "capacity_blocks": blocks}
    return Check(f"{request.label} tenants", True, message, details)


def _host_memory(requests: list[DoctorRequest], ranks: int) -> Check:
    """Host tiers (one slab per rank) against MemAvailable: a slab larger than what is free maps fine
    and gets the process killed once the tier fills."""
    sizes = [request.tier_bytes() for request in requests if request.config.medium == HOST]
    if None in sizes:
        return Check("host memory", True, "not checked: capacity_blocks without block_bytes")
    need = sum(size or 0 for size in sizes) * ranks
    available = _mem_available()
    details = {"need_bytes": need, "available_bytes": available}
    if available is None:
        return Check("host memory", True, "not checked: /proc/meminfo has no MemAvailable", details)
    message = f"host tiers take {gib(need)} ({ranks} rank(s)), MemAvailable is {gib(available)}"
    return Check("host memory", need <= available, message, details)


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
