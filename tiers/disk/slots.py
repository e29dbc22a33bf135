"""The geometry of a disk tier's slots: arithmetic on sizes that the tier's schema and its slab share.

A slot on disk is one header page followed by room for a block's bytes, rounded up to whole pages
for O_DIRECT. Uncompressed the room is the whole block; with compression it is ``slot_bytes`` (by
default a codec-dependent fraction of the block), so the same file holds more slots. The schema
(``config``) needs these rules to count a ``capacity`` in bytes as blocks and to refuse a
``slot_bytes`` that cannot work, before any slab is opened; the slab's format (``format``) lays its
file out by them.
"""

from __future__ import annotations

import math

PAGE = 4096
# Room per block when compression is on and slot_bytes is not given, as a fraction of block_bytes:
# what bf16 KV blocks compress to with some margin (zstd-1 0.69, lz4 0.85 of 256 KiB blocks, bench/disk.py).
DEFAULT_SLOT_FRACTION = {"zstd": 0.75, "lz4": 0.875}


def round_up_to_page(n: int) -> int:
    """``n`` rounded up to whole pages: what O_DIRECT reads and writes."""
    return -(-n // PAGE) * PAGE


def slot_problem(block_bytes: int, compression: str, slot_bytes: int | None) -> str | None:
    """Why ``slot_bytes`` cannot work for this block size and codec, or None when it can."""
    if slot_bytes is None:
        return None
    if slot_bytes > block_bytes:
        return f"slot_bytes {slot_bytes} is larger than block_bytes {block_bytes}; at most block_bytes"
    if slot_bytes < PAGE:
        return f"slot_bytes {slot_bytes} is less than {PAGE} (4KiB), the smallest slot"
    if compression == "none" and slot_bytes != block_bytes:
        return (
            f"slot_bytes {slot_bytes} is smaller than block_bytes {block_bytes}, which only fits with "
            f"compression: lz4 or zstd"
        )
    return None


def slot_room(block_bytes: int, compression: str = "none", slot_bytes: int | None = None) -> int:
    """Bytes of block data one slot holds on disk: ``slot_bytes`` (by default all of ``block_bytes``
    uncompressed, a codec-dependent fraction compressed) rounded up to 4 KiB for O_DIRECT."""
    if slot_bytes is None:
        fraction = DEFAULT_SLOT_FRACTION.get(compression, 1.0)
        slot_bytes = min(block_bytes, math.ceil(block_bytes * fraction))
    return round_up_to_page(slot_bytes)


def slot_stride(block_bytes: int, compression: str = "none", slot_bytes: int | None = None) -> int:
    """Bytes of file per block (slot header and room): what a disk ``capacity`` in bytes is divided by."""
    return PAGE + slot_room(block_bytes, compression, slot_bytes)
