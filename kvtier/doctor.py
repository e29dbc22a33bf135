"""``kvtier doctor CONFIG``: what would fail when an engine starts on a config, or go wrong silently, said
before it starts.

Each check is a small function returning a ``Check`` and calls what the tiers call at start, so the
doctor and the engine cannot disagree: the config's validation (``load_config``), the secrets' rules
(``key_secret``, ``mac_key``, the store backend's own connector, which reads its password), the disk
tier's trust rules (``open_slab_for_reading``: owner, mode, links of the directory and its slab), and a
real client of the remote store opened the way the tier opens one (``StoreLink`` over the factory's
connector), asked one existence query within the tier's timeout; a node tier's daemon reached as the
tier reaches it (``NodeClient``) and asked for its numbers. Capacity is what the tiers would take
against what the machine has now: host tiers against MemAvailable, disk tiers against the free space of
their filesystem (a slab already there counts as usable: its space is the tier's). Nothing is created,
locked or written. What decides sharing with other engines is ``doctor_sharing``'s.
"""

from __future__ import annotations

import os
import secrets
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtier.core.config import StackConfig, capacity_in_blocks, load_config
from kvtier.core.devices import HOST
from kvtier.core.errors import ConfigError, KvtierError
from kvtier.core.keys import key_secret
from kvtier.core.sealing import SEAL_BYTES
from kvtier.doctor_sharing import VllmEngine, sharing
from kvtier.tiers.disk.config import DiskTierConfig
from kvtier.tiers.disk.files import SLAB_NAME, DiskTierError, lock_holder, open_slab_for_reading
from kvtier.tiers.disk.ranks import rank_directory
from kvtier.tiers.node.client import NodeClient
from kvtier.tiers.node.config import NodeTierConfig
from kvtier.tiers.node.protocol import VERSION, Op
from kvtier.tiers.remote.config import RemoteTierConfig
from kvtier.tiers.remote.factory import connector
from kvtier.tiers.remote.link import Connector, StoreLink
from kvtier.tiers.remote.record import mac_key


@dataclass(frozen=True)
class Check:
    """One thing the doctor looked at: whether it would work, in words, and the figures behind that."""

    name: str
    ok: bool
    message: str
    details: dict[str, Any] = field(default_factory=dict)


def diagnose(path: str, engine: VllmEngine | None = None) -> dict[str, Any]:
    """The report on the config file at ``path`` (under ``engine``, or for a standalone stack): ``ok``,
    the names of the ``failed`` checks, every check, and what decides sharing (None when the config
    does not load)."""
    try:
        config = load_config(path)
    except ConfigError as exc:
        return _report(path, [Check("config", False, str(exc))], None)
    ranks = 1 if engine is None else engine.tp
    checks = [Check("config", True, f"valid: {len(config.tiers)} tiers"), _key_secret(config)]
    for i, tier in enumerate(config.tiers):
        if isinstance(tier, DiskTierConfig):
            checks += [_directory(config, i, directory) for directory in _directories(tier, engine)]
        elif isinstance(tier, RemoteTierConfig):
            checks += _remote(config, i)
        elif isinstance(tier, NodeTierConfig):
            checks.append(_node(config, i))
        if isinstance(tier, DiskTierConfig | NodeTierConfig) and tier.encryption != "none":
            checks.append(_sealing_secrets(config, i))
        if tier.tenants is not None:
            checks.append(_tenants(config, i))
    checks.append(_host_memory(config, ranks))
    checks += [_disk_space(config, i, engine) for i, t in enumerate(config.tiers) if isinstance(t, DiskTierConfig)]
    return _report(path, checks, sharing(config, engine))


def _report(path: str, checks: list[Check], shared: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "config": path,
        "ok": all(check.ok for check in checks),
        "failed": [check.name for check in checks if not check.ok],
        "checks": [asdict(check) for check in checks],
        "sharing": shared,
    }


def _tier_label(config: StackConfig, i: int) -> str:
    return f"tiers[{i}] ({config.tier_name(i)})"


def _key_secret(config: StackConfig) -> Check:
    """The secret that keys block hashes: named, set and long enough (``key_secret``, as every engine reads it)."""
    try:
        secret = key_secret(config.key_secret_env)
    except ConfigError as exc:
        return Check("key secret", False, str(exc))
    if secret is None:
        return Check("key secret", True, "none named: keys are unkeyed (key_secret_env)")
    return Check("key secret", True, f"{config.key_secret_env} is set ({len(secret)} bytes)")


def _sealing_secrets(config: StackConfig, i: int) -> Check:
    """A sealing disk or node tier's secrets: set and long enough, the ``cryptography`` package there."""
    tier = config.tiers[i]
    assert isinstance(tier, DiskTierConfig | NodeTierConfig)
    name = f"{_tier_label(config, i)} secrets"
    try:
        tier.sealing()
    except ConfigError as exc:
        return Check(name, False, str(exc))
    return Check(name, True, f"{tier.encryption_key_env} is set: blocks are sealed (aes-gcm)")


def _tenants(config: StackConfig, i: int) -> Check:
    """A tier's shares among tenants, in blocks where its size is known; whether tenants' names are hidden
    in the keys everyone sharing a tier sees (their tags are keyed hashes only with a key secret)."""
    tier = config.tiers[i]
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
    return Check(f"{_tier_label(config, i)} tenants", True, message, details)


def _directories(tier: DiskTierConfig, engine: VllmEngine | None) -> list[Path]:
    """The directories a disk tier opens: its ``path``, or under vLLM each rank's directory in it."""
    if engine is None:
        return [Path(tier.path)]
    return [rank_directory(tier.path, rank) for rank in range(engine.tp)]


def _directory(config: StackConfig, i: int, directory: Path) -> Check:
    """Whether the disk tier would open ``directory``: the trust rules of its start (directory and slab),
    or, for a directory yet to be made, whether the running user can make it; and whether another
    process holds its slab (two processes cannot use one)."""
    tier = config.tiers[i]
    assert isinstance(tier, DiskTierConfig)
    name = f"{_tier_label(config, i)} directory {directory}"
    if not os.path.lexists(directory):
        parent = _existing_parent(directory)
        if not os.access(parent, os.W_OK | os.X_OK):
            return Check(name, False, f"does not exist, and uid {os.geteuid()} cannot create it in {parent}")
        return Check(name, True, "does not exist yet: created 0700 at start")
    try:
        fd = open_slab_for_reading(directory, shared=tier.shared_directory)
    except DiskTierError as exc:
        return Check(name, False, str(exc))
    if fd is None:
        return Check(name, True, "trusted, no slab yet")
    try:
        holder = lock_holder(os.fstat(fd))
    finally:
        os.close(fd)
    if holder is not None:
        return Check(
            name, False, f"its slab is in use by {holder}: a second process cannot open it", {"holder": holder}
        )
    return Check(name, True, "trusted, with its slab")


def _existing_parent(path: Path) -> Path:
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def _remote(config: StackConfig, i: int) -> list[Check]:
    """The remote tier's secrets (its MAC key or its sealing secrets, and whatever its backend's connector
    reads: a password, the client package), then one round trip to the store when a client can be set up at all."""
    tier = config.tiers[i]
    assert isinstance(tier, RemoteTierConfig)
    label = _tier_label(config, i)
    problems = []
    for read_secret in (lambda: mac_key(tier.auth_key_env), tier.sealing):
        try:
            read_secret()
        except ConfigError as exc:
            problems.append(str(exc))
    try:
        wired = connector(tier, lends_memory=False)
    except ConfigError as exc:
        problems.append(str(exc))
        return [Check(f"{label} secrets", False, "; ".join(problems))]
    secrets_check = Check(f"{label} secrets", not problems, "; ".join(problems) or "present")
    return [secrets_check, _round_trip(f"{label} store", wired, tier)]


def _round_trip(name: str, wired: Connector, tier: RemoteTierConfig) -> Check:
    """One existence query of a random record name through a real client, opened as the tier opens its
    lookup client (TLS and credentials as configured), within the tier's timeout; the error as the
    client words it (it never holds a secret: passwords come from the environment, not URLs)."""
    link = StoreLink(Connector(wired.connect, 1, wired.where), tier.timeout, "kvtier doctor")
    probe = f"{tier.prefix}doctor-{secrets.token_hex(8)}"
    try:
        link.ask(lambda client: client.exists([probe]))
    except KvtierError as exc:
        return Check(name, False, f"{wired.where} failed an existence query (timeout {tier.timeout:g} s): {exc}")
    finally:
        link.close(tier.timeout)  # an abandoned call's client is closed when it returns, not waited for
    return Check(name, True, f"{wired.where} answers")


def _node(config: StackConfig, i: int) -> Check:
    """A node tier's daemon, reached as the tier reaches it at start (its socket, its user checked, the
    protocol version agreed, its slab mapped), asked for its numbers; and whether the config's blocks fit
    its slots. The connection is closed at once: it held nothing."""
    tier = config.tiers[i]
    assert isinstance(tier, NodeTierConfig)
    name = f"{_tier_label(config, i)} daemon"
    client = NodeClient(tier.socket, tier.timeout, [] if tier.daemon_uid is None else [tier.daemon_uid])
    try:
        client.open()
        (stats,), _, _ = client.call(Op.STATS)
    except KvtierError as exc:
        return Check(name, False, str(exc))
    finally:
        client.close()
    assert client.geometry is not None
    slots, slot_bytes = client.geometry
    details = {"node": client.node_id, "slots": slots, "slot_bytes": slot_bytes, "used_slots": stats["used_slots"]}
    block = config.block_bytes
    if block is not None and block + (0 if tier.encryption == "none" else SEAL_BYTES) > slot_bytes:
        sealed = "" if tier.encryption == "none" else f" ({block + SEAL_BYTES} sealed)"
        return Check(name, False, f"blocks of {block} bytes{sealed} do not fit its slots of {slot_bytes}", details)
    message = (
        f"{tier.socket} answers (node {client.node_id}, protocol {VERSION}): {slots} slots of {slot_bytes} bytes, "
        f"{stats['used_slots']} in use, {stats['connected'] - 1} other connection(s)"
    )
    return Check(name, True, message, details)


def _tier_bytes(config: StackConfig, i: int) -> int | None:
    """Bytes tier ``i`` takes: its blocks times what one takes there; where the block size is the
    engine's (no ``block_bytes``), its byte ``capacity`` (at most that); None for ``capacity_blocks``
    without ``block_bytes``."""
    tier = config.tiers[i]
    if config.block_bytes is None:
        return tier.capacity
    blocks = capacity_in_blocks(tier, config.block_bytes, config.header_room)
    return None if blocks is None else blocks * tier.footprint(config.block_bytes, config.header_room)


def _host_memory(config: StackConfig, ranks: int) -> Check:
    """Host tiers (one slab per rank) against MemAvailable: a slab larger than what is free maps fine
    and gets the process killed once the tier fills."""
    sizes = [_tier_bytes(config, i) for i, tier in enumerate(config.tiers) if tier.medium == HOST]
    if None in sizes:
        return Check("host memory", True, "not checked: capacity_blocks without block_bytes")
    need = sum(size or 0 for size in sizes) * ranks
    available = _mem_available()
    details = {"need_bytes": need, "available_bytes": available}
    if available is None:
        return Check("host memory", True, "not checked: /proc/meminfo has no MemAvailable", details)
    message = f"host tiers take {_gib(need)} ({ranks} rank(s)), MemAvailable is {_gib(available)}"
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


def _disk_space(config: StackConfig, i: int, engine: VllmEngine | None) -> Check:
    """A disk tier's slabs (one per rank) against the free space of the filesystem that will hold them,
    plus the space slabs already there hold (theirs to reuse)."""
    tier = config.tiers[i]
    assert isinstance(tier, DiskTierConfig)
    name = f"{_tier_label(config, i)} disk space"
    size = _tier_bytes(config, i)
    if size is None:
        return Check(name, True, "not checked: capacity_blocks without block_bytes")
    directories = _directories(tier, engine)
    need = size * len(directories)
    held = sum(_allocated(directory / SLAB_NAME) for directory in directories)
    try:
        vfs = os.statvfs(_existing_parent(Path(tier.path)))
    except OSError as exc:
        return Check(name, False, f"the filesystem of {tier.path} cannot be read: {exc.strerror}")
    usable = vfs.f_bavail * vfs.f_frsize + held
    details = {"need_bytes": need, "usable_bytes": usable, "held_by_slabs_bytes": held}
    message = f"slabs take {_gib(need)}, the filesystem has {_gib(usable)} for them"
    return Check(name, need <= usable, message, details)


def _allocated(slab: Path) -> int:
    """Bytes a slab file already holds on disk (0 for none, or a name that is not a regular file)."""
    try:
        st = os.lstat(slab)
    except OSError:
        return 0
    return st.st_blocks * 512 if stat.S_ISREG(st.st_mode) else 0


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
