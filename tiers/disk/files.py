"""Opening a disk tier's directory and slab file without trusting what others may have put there.

A slab's blocks are loaded into an engine's KV cache, so whoever can write the directory or the file
chooses what the engine computes with; whoever can read them learns which prompts were served. So by
default the directory must belong to the running user and be writable by nobody else (created 0700),
and the slab likewise (created 0600), whatever the umask. ``shared_directory`` accepts another owner
and group write, for a directory a group of services shares on purpose (every member can then plant
blocks); a world-writable directory or slab is refused even then.

Paths are resolved once: the directory is opened (``O_DIRECTORY``) and checked through that
descriptor, and the slab is opened relative to it, never through a symbolic link (``O_NOFOLLOW``), so
swapping a name between the check and the use gains nothing. A FIFO or device under the slab's name
cannot block the open (``O_NONBLOCK``) and is refused as not a regular file.

The slab itself carries the lock (``flock``, taken right after the open): two processes cannot use one
slab, whatever else is deleted from the directory. Who holds it is read from /proc/locks, never probed
with a lock of our own (a probe could make an engine that opens the slab at that moment fail).

The index snapshot a clean close leaves beside the slab (``snapshot``) passes the same checks as
the slab when it is read, and is written under a temporary name and renamed over its own: a crash
mid-write leaves the old state, never half a snapshot under the real name. The temporary name is
removed before it is created (``O_EXCL``), so a file planted there, such as a second name of the
slab, is never written through.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Literal, overload

from kvtier.core.errors import KvtierError

SLAB_NAME = "slab.kvt"
SNAPSHOT_NAME = "index.kvt"
_TEMPORARY_SUFFIX = ".tmp"
_OPEN_ATTEMPTS = 3  # a slab created or removed by another process between our two opens: try again


class DiskTierError(KvtierError, OSError):
    """The disk tier's directory cannot be used (locked by another process, no space, bad path, not trusted)."""


def _check_trust(st: os.stat_result, what: str, path: Path, shared: bool, fix: str) -> None:
    """Refuse a directory or slab (``what``) that someone other than the running user could write:
    another owner or group write (both accepted when ``shared``), or write by every user. ``fix`` says
    how to make it private."""
    euid = os.geteuid()
    mode = stat.S_IMODE(st.st_mode)
    name = f"disk tier {what} {str(path)!r}"
    share = (
        "set shared_directory: true if a group of services shares it on purpose (every user who can "
        "write it can then plant blocks this tier loads)"
    )
    if st.st_uid != euid and not shared:
        raise DiskTierError(
            f"{name} belongs to uid {st.st_uid}, not to uid {euid} that runs kvtier: its owner "
            f"could plant blocks this tier would load. Use a directory of your own, "
            f"`chown {euid} {path}`, or {share}"
        )
    if mode & stat.S_IWOTH:
        if shared:
            fix = f"`chmod o-w {path}` (shared_directory accepts group write, never write by every user)"
        raise DiskTierError(
            f"{name} is writable by every user (mode {mode:04o}): anyone could plant blocks this tier would load. {fix}"
        )
    if mode & stat.S_IWGRP and not shared:
        raise DiskTierError(f"{name} is writable by its group (mode {mode:04o}): {fix}, or {share}")


def _check_directory(st: os.stat_result, path: Path, shared: bool) -> None:
    _check_trust(
        st, "directory", path, shared, f"`chmod 700 {path}`, or name a new directory inside it (kvtier creates it 0700)"
    )


def _check_file(st: os.stat_result, what: str, path: Path, shared: bool) -> None:
    """Refuse a file of the tier (``what``: "slab", "index snapshot") that is not one plain file of ours
    (see ``_check_trust``)."""
    if not stat.S_ISREG(st.st_mode):
        raise DiskTierError(
            f"disk tier {what} {str(path)!r} is not a regular file; remove it or point the tier at another directory"
        )
    if st.st_nlink != 1:  # another name would change with every write (0: it was removed while we opened it)
        raise DiskTierError(
            f"disk tier {what} {str(path)!r} has {st.st_nlink} names (hard links), not exactly "
            f"one; remove the other names or the file"
        )
    _check_trust(st, what, path, shared, f"`chmod 600 {path}`")


def _make_directories(path: Path) -> None:
    """Create ``path`` and its missing parents, each exactly 0700: mkdir's mode is cut by the umask, so
    each is then set through a descriptor (a restrictive umask must not leave one unusable)."""
    missing = []
    while not os.path.lexists(path):
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            continue  # made meanwhile by someone else: the tier's own directory is checked when opened
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)


def _refuse_foreign_link(path: Path) -> None:
    """A symbolic link as the directory's own name is followed only when the running user or root
    owns it: another user could point it anywhere, at any time."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) and st.st_uid not in (os.geteuid(), 0):
        raise DiskTierError(
            f"disk tier directory {str(path)!r} is a symbolic link owned by uid {st.st_uid}; "
            f"kvtier follows only links of its own user or root. Name the real directory"
        )


@overload
def open_directory(path: Path, *, shared: bool, create: Literal[True]) -> int: ...
@overload
def open_directory(path: Path, *, shared: bool, create: bool) -> int | None: ...


def open_directory(path: Path, *, shared: bool, create: bool) -> int | None:
    """A descriptor of the tier's directory, once checked (``_check_trust``); created 0700 with its
    missing parents when ``create``, else None when it does not exist."""
    if create:
        try:
            _make_directories(path)
        except OSError as exc:
            raise DiskTierError(f"disk tier directory {str(path)!r} cannot be created: {exc.strerror}") from exc
    try:
        _refuse_foreign_link(path)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except DiskTierError:
        raise
    except OSError as exc:
        if isinstance(exc, FileNotFoundError) and not create:
            return None  # nothing there yet, so nothing to read
        raise DiskTierError(f"disk tier directory {str(path)!r} cannot be opened: {exc.strerror}") from exc
    return _kept_if(fd, _check_directory, path, shared)


def _kept_if(fd: int, check, path: Path, shared: bool) -> int:
    """``fd`` once ``check(its stat, path, shared)`` passes; closed when the check raises."""
    try:
        check(os.fstat(fd), path, shared)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_error(path: Path, exc: OSError, what: str = "slab") -> DiskTierError:
    if exc.errno == errno.ELOOP:
        return DiskTierError(
            f"disk tier {what} {str(path)!r} is a symbolic link; kvtier never follows one (it "
            f"would write wherever the link points): remove the link"
        )
    return DiskTierError(f"disk tier {what} {str(path)!r} cannot be opened: {exc.strerror}")


# O_NONBLOCK: a FIFO or device under the slab's name must not block the open; on a regular file it changes nothing.
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _open_or_create(dir_fd: int, path: Path, mode: int) -> tuple[int, bool]:
    """(descriptor, whether this call created the file) of the slab in ``dir_fd``."""
    for _ in range(_OPEN_ATTEMPTS):
        try:
            try:
                return os.open(SLAB_NAME, os.O_RDWR | _OPEN_FLAGS, dir_fd=dir_fd), False
            except FileNotFoundError:
                pass
            try:
                return os.open(SLAB_NAME, os.O_RDWR | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, mode, dir_fd=dir_fd), True
            except FileExistsError:
                pass  # another process created it meanwhile: open that one
        except OSError as exc:
            raise _open_error(path, exc) from exc
    raise DiskTierError(
        f"disk tier slab {str(path)!r} keeps appearing and vanishing; is another process opening this directory?"
    )


def _take_lock(fd: int, directory: Path) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = lock_holder(os.fstat(fd)) or "another process"
        raise DiskTierError(
            f"disk tier directory {str(directory)!r} is in use by {holder}; two kvtier "
            f"processes cannot share one directory"
        ) from None
    except OSError as exc:  # e.g. a filesystem without flock
        raise DiskTierError(f"disk tier slab {str(directory / SLAB_NAME)!r} cannot be locked: {exc.strerror}") from exc


def open_slab(dir_fd: int, directory: Path, *, shared: bool) -> tuple[int, bool]:
    """The slab in ``dir_fd`` (the checked descriptor of ``directory``), opened for writing and locked:
    (descriptor, whether this call created it). A new slab is exactly 0600 (0660 when ``shared``); an
    own older one more open than that is narrowed to it."""
    path = directory / SLAB_NAME
    mode = 0o660 if shared else 0o600
    fd, created = _open_or_create(dir_fd, path, mode)
    locked = False
    try:
        _take_lock(fd, directory)
        locked = True
        st = os.fstat(fd)
        _check_file(st, "slab", path, shared)
        if st.st_uid == os.geteuid() and (created or stat.S_IMODE(st.st_mode) & ~mode):
            os.fchmod(fd, mode)
    except BaseException:
        if created and locked:
            remove_slab(dir_fd, fd)
        os.close(fd)
        raise
    return fd, created


def remove_slab(dir_fd: int, fd: int) -> None:
    """Remove the slab name in ``dir_fd`` when it still names the file open as ``fd`` (a slab this
    process created and then failed to set up: no empty slab is left behind). Call it holding the lock."""
    try:
        if os.path.samestat(os.stat(SLAB_NAME, dir_fd=dir_fd, follow_symlinks=False), os.fstat(fd)):
            os.unlink(SLAB_NAME, dir_fd=dir_fd)
    except OSError:
        pass  # best effort: the open's own error is what the caller reports


def reopen_slab(dir_fd: int, directory: Path, fd: int, flags: int) -> int:
    """Another descriptor (other ``flags``, e.g. O_DIRECT) of the slab open as ``fd``; refused when the
    name no longer leads to that file."""
    other = os.open(SLAB_NAME, flags | _OPEN_FLAGS, dir_fd=dir_fd)
    if not os.path.samestat(os.fstat(other), os.fstat(fd)):
        os.close(other)
        raise DiskTierError(
            f"disk tier slab {str(directory / SLAB_NAME)!r} was replaced while it was being "
            f"opened; is another process using this directory?"
        )
    return other


def open_slab_for_reading(directory: Path, *, shared: bool) -> int | None:
    """A read-only descriptor of the slab in ``directory``, without the lock (its owner may be using it),
    after the same checks as ``open_slab``; None when there is no directory or no slab."""
    dir_fd = open_directory(directory, shared=shared, create=False)
    if dir_fd is None:
        return None
    try:
        return open_file_for_reading(dir_fd, directory, SLAB_NAME, "slab", shared=shared)
    finally:
        os.close(dir_fd)


def open_file_for_reading(dir_fd: int, directory: Path, name: str, what: str, *, shared: bool) -> int | None:
    """A read-only descriptor of the tier's file ``name`` (``what`` it is, for errors) in ``dir_fd``, the
    checked descriptor of ``directory``, once it passes the slab's checks (``_check_file``: one regular
    file of ours, never through a link); None when there is none. DiskTierError otherwise."""
    path = directory / name
    try:
        fd = os.open(name, os.O_RDONLY | _OPEN_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _open_error(path, exc, what) from exc
    return _kept_if(fd, lambda st, path, shared: _check_file(st, what, path, shared), path, shared)


def remove_file(dir_fd: int, name: str) -> bool:
    """Remove the name ``name`` from ``dir_fd`` durably (the directory is synced); False when there was
    none. Whatever the name is (a link, a FIFO), only the name goes. Raises OSError when it stays."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    os.fsync(dir_fd)
    return True


def replace_file(dir_fd: int, name: str, chunks: Iterable[bytes | memoryview], *, shared: bool) -> None:
    """Make ``name`` in ``dir_fd`` hold the bytes of ``chunks``, durably and all at once: written under a
    temporary name created afresh (0600, 0660 when ``shared``), synced, renamed over ``name``, and the
    directory synced. On any error the temporary file is removed and the OSError raised; ``name`` is
    then as it was."""
    temporary = name + _TEMPORARY_SUFFIX
    remove_file(dir_fd, temporary)  # a leftover of a crash, or a planted name: never written through
    mode = 0o660 if shared else 0o600
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, mode, dir_fd=dir_fd)
    try:
        try:
            os.fchmod(fd, mode)  # whatever the umask
            for chunk in chunks:
                _write_all(fd, chunk)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary, dir_fd=dir_fd)
        raise
    os.fsync(dir_fd)


def _write_all(fd: int, chunk: bytes | memoryview) -> None:
    view = memoryview(chunk).cast("B")
    while view:
        view = view[os.write(fd, view) :]


def lock_holder(st: os.stat_result) -> str | None:
    """Who holds the flock on the file ``st`` describes ("pid N"), from /proc/locks; None when nobody does
    or the holder cannot be seen (another PID namespace, no /proc)."""
    try:
        with open("/proc/locks") as locks:
            lines = locks.read().splitlines()
    except OSError:
        return None
    wanted = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    for line in lines:
        # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:5308611 0 EOF": device major:minor in hex, inode in decimal.
        # Waiters' lines read "1: -> FLOCK ..." and are skipped.
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK":
            continue
        place = fields[5].split(":")
        try:
            found = (int(place[0], 16), int(place[1], 16), int(place[2]))
        except (ValueError, IndexError):
            continue
        if found == wanted:
            return f"pid {fields[4]}" if fields[4].isdigit() and int(fields[4]) > 0 else "another process"
    return None
