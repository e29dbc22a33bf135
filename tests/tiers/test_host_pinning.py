"""The chunks a host slab is pinned in: they cover it exactly, in order, each ending where a slot and a
page both end (so no two registrations share a page), and at most the limit long unless one such unit
is longer. Pinning itself needs a GPU: tests/gpu/test_host_pinning.py."""

from __future__ import annotations

import math

import pytest

from kvtier.tiers.host_pinning import PAGE, chunks, pin

GIB = 2**30


@pytest.mark.parametrize(
    ("nbytes", "slot", "limit"),
    [
        (64 * GIB, 2 * 2**20, 4 * GIB),
        (64 * GIB + 3 * 2**20, 2**20 + 4096, 4 * GIB),  # slot size not a power of two
        (10_000 * 1536, 1536, 1_000_000),  # slots smaller than a page and not dividing it
        (5 * 3 * 2**20, 3 * 2**20, 2**20),  # one slot larger than the limit: whole slots
        (4096, 4096, 4 * GIB),
    ],
)
def test_chunks_cover_the_slab_on_slot_and_page_boundaries(nbytes, slot, limit):
    pieces = chunks(nbytes, slot, limit)
    unit = math.lcm(slot, PAGE)
    offset = 0
    for start, length in pieces:
        assert start == offset and length > 0
        offset += length
        if offset < nbytes:  # every inner boundary is a slot and a page boundary
            assert offset % slot == 0 and offset % PAGE == 0
        assert length <= max(limit, unit)
    assert offset == nbytes
    if nbytes > max(limit, unit):
        assert len(pieces) > 1


def test_no_chunks_for_an_empty_slab():
    assert chunks(0, 4096, GIB) == []
    assert pin(0, 0, 4096) == []
