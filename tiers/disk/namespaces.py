"""A disk tier's registry of the namespaces that used its directory: ``namespaces.json`` beside the slab.

A stack that opens the directory records its namespace there (``record``), so a later stack of another
block size or namespace that misses a block the slab holds can say so (``core/namespaces.py``). The
file follows the slab's rules (``files``): read only when it is one regular file of the running
user that nobody else can write (never through a link), written under a temporary name and renamed
over, 0600. It is a statistic's input, so anything wrong with it (missing, hostile, damaged, too
large, unreadable, unwritable) is one log line and an empty registry, never an error of the tier.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from kvtier.core.namespaces import REGISTRY_BYTES, KnownNamespace, decode_entries, encode_entries, listing
from kvtier.tiers.disk.files import open_file_for_reading, replace_file

log = logging.getLogger(__name__)

NAMESPACES_NAME = "namespaces.json"


def record(dir_fd: int, directory: Path, ours: KnownNamespace, *, shared: bool) -> list[KnownNamespace]:
    """Add ``ours`` to the registry in ``dir_fd`` (the checked descriptor of ``directory``), keeping the
    newest entries; returns the other namespaces it listed."""
    try:
        listed = _read(dir_fd, directory, shared)
    except (OSError, ValueError) as exc:  # DiskTierError (a link, another owner, a mode) is an OSError
        log.warning("disk tier %s: %s ignored: %s", directory, NAMESPACES_NAME, exc)
        listed = []
    try:
        replace_file(dir_fd, NAMESPACES_NAME, [encode_entries(listing(listed, ours))], shared=shared)
    except OSError as exc:
        log.warning("disk tier %s: %s not written: %s", directory, NAMESPACES_NAME, exc)
    return [entry for entry in listed if not entry.same(ours)]


def _read(dir_fd: int, directory: Path, shared: bool) -> list[KnownNamespace]:
    fd = open_file_for_reading(dir_fd, directory, NAMESPACES_NAME, "namespace registry", shared=shared)
    if fd is None:
        return []
    with os.fdopen(fd, "rb") as file:
        raw = file.read(REGISTRY_BYTES + 1)
    return decode_entries(raw)
