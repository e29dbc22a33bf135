"""What ``kvtier doctor`` checks of a disk tier (``Medium.doctor``, ``Medium.doctor_space``): each directory
it would open against the trust rules of its start (``open_slab_for_reading``: owner, mode, links of
the directory and its slab) and whether another process holds its slab; its sealing secrets; and its
slabs against the free space of their filesystem (a slab already there counts as usable: its space is
the tier's). Nothing is created, locked or written.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvtier.core.checks import Check, DoctorRequest, gib, sealing_secrets
from kvtier.tiers.disk.config import DiskTierConfig
from kvtier.tiers.disk.files import SLAB_NAME, DiskTierError, lock_holder, open_slab_for_reading
from kvtier.tiers.disk.ranks import rank_directory


def checks(request: DoctorRequest) -> list[Check]:
    """Every directory the tier opens, then its secrets where it seals."""
    return [_directory(request, directory) for directory in _directories(request)] + sealing_secrets(request)


def space(request: DoctorRequest) -> list[Check]:
    """The tier's slabs (one per rank) against the free space of the filesystem that will hold them,
    plus the space slabs already there hold (theirs to reuse)."""
    tier = request.config
    assert isinstance(tier, DiskTierConfig)
    name = f"{request.label} disk space"
    size = request.tier_bytes()
    if size is None:
        return [Check(name, True, "not checked: capacity_blocks without block_bytes")]
    directories = _directories(request)
    need = size * len(directories)
    held = sum(_allocated(directory / SLAB_NAME) for directory in directories)
    try:
        vfs = os.statvfs(_existing_parent(Path(tier.path)))
    except OSError as exc:
        return [Check(name, False, f"the filesystem of {tier.path} cannot be read: {exc.strerror}")]
    usable = vfs.f_bavail * vfs.f_frsize + held
    details = {"need_bytes": need, "usable_bytes": usable, "held_by_slabs_bytes": held}
    message = f"slabs take {gib(need)}, the filesystem has {gib(usable)} for them"
    return [Check(name, need <= usable, message, details)]


def _directories(request: DoctorRequest) -> list[Path]:
    """The directories the tier opens: its ``path``, or under an engine each rank's directory in it."""
    tier = request.config
    assert isinstance(tier, DiskTierConfig)
    if request.engine_ranks is None:
        return [Path(tier.path)]
    return [rank_directory(tier.path, rank) for rank in range(request.engine_ranks)]


def _directory(request: DoctorRequest, directory: Path) -> Check:
    """Whether the tier would open ``directory``: the trust rules of its start (directory and slab),
    or, for a directory yet to be made, whether the running user can make it; and whether another
    process holds its slab (two processes cannot use one)."""
    tier = request.config
    assert isinstance(tier, DiskTierConfig)
    name = f"{request.label} directory {directory}"
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


def _allocated(slab: Path) -> int:
    """Bytes a slab file already holds on disk (0 for none, or a name that is not a regular file)."""
    try:
        st = os.lstat(slab)
    except OSError:
        return 0
    return st.st_blocks * 512 if stat.S_ISREG(st.st_mode) else 0
