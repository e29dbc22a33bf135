"""Where block bytes live, expressed as raw addresses.

Every storage (a tier's slab, an engine's per-layer KV tensors, a caller's arrays) answers one
question: the address of each fragment of each slot. A transfer between any two storages is then a
list of (source address, destination address, byte count) triples, which the CPU backend runs with
memmove and a CUDA backend hands to one batched driver copy. A storage keeps a reference to the
memory it describes, so the addresses stay valid for as long as the storage lives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvtier.core.devices import HOST_DEVICE
from kvtier.core.errors import TransferError
from kvtier.core.layout import BlockLayout

NO_BREAKS = np.empty(0, dtype=np.int64)


class BlockStorage:
    """Fragment addresses of ``num_slots`` blocks with one ``layout`` on one ``device`` ("cpu" or "cuda")."""

    by_key = False
    """True for a storage whose blocks are named by key, not slot (a remote store's records, a node
    daemon's slab): it has no slots and no addresses, and a copy to or from it names the blocks' keys."""

    def __init__(
        self,
        layout: BlockLayout,
        num_slots: int,
        device: str,
        keepalive: Any = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.layout = layout
        self.num_slots = int(num_slots)
        self.device = device
        self.header_room = 0  # bytes free right before each slot, contiguous with it (``contiguous_storage``)
        self.breaks = NO_BREAKS
        """Addresses no single copy may run across: where two separately registered (pinned) pieces of
        host memory meet (``tiers.host_pinning``). A DMA copy spanning two registrations is refused or
        goes wrong, so copies of consecutive slots are not merged across them (``Transfer.copies``)."""
        self._keepalive = keepalive
        self._on_close = on_close

    def fragment_addresses(self, slots: Sequence[int] | np.ndarray) -> np.ndarray:
        """Addresses as an int64 array of shape (len(slots), num_fragments); raises on a slot out of range."""
        return self._addresses(self.check_slots(slots))

    def check_slots(self, slots: Sequence[int] | np.ndarray) -> np.ndarray:
        """The slot ids as an int64 array; raises TransferError when one is out of range."""
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        if slots.size and (slots.min() < 0 or slots.max() >= self.num_slots):
            raise TransferError(f"slot ids must lie in [0, {self.num_slots}), got {slots.min()}..{slots.max()}")
        return slots

    def _addresses(self, slots: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def close(self) -> None:
        """Drop the reference to the memory (and release it when the storage owns it); do not use it afterwards."""
        self._keepalive = None
        self.num_slots = 0  # any later address request fails its range check
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()


class StridedStorage(BlockStorage):
    """Fragment f of slot s lies at ``bases[f] + s * strides[f]``.

    This covers a contiguous slab (one base per fragment offset, every stride ``block_bytes``) and
    per-layer tensors (one base per layer tensor, its block stride).
    """

    def __init__(
        self,
        layout: BlockLayout,
        num_slots: int,
        bases: Sequence[int] | np.ndarray,
        strides: Sequence[int],
        device: str = HOST_DEVICE,
        keepalive: Any = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(layout, num_slots, device, keepalive, on_close)
        self.bases = np.asarray(bases, dtype=np.int64)
        self.strides = np.asarray(strides, dtype=np.int64)
        if self.bases.shape != (layout.num_fragments,) or self.strides.shape != (layout.num_fragments,):
            raise TransferError(f"need one base and one stride per fragment ({layout.num_fragments})")

    def _addresses(self, slots: np.ndarray) -> np.ndarray:
        return self.bases[None, :] + slots[:, None] * self.strides[None, :]


class GroupedStorage(BlockStorage):
    """Several strided storages of one layout, device and size as one: slot ``g * n + s`` is slot ``s``
    of part ``g`` (``n`` slots each). vLLM's KV cache groups: one block table per group of layers."""

    def __init__(self, parts: Sequence[StridedStorage]) -> None:
        first = parts[0]
        if any((p.layout, p.device, p.num_slots) != (first.layout, first.device, first.num_slots) for p in parts):
            raise TransferError("grouped storages must share their layout, device and number of slots")
        super().__init__(first.layout, first.num_slots * len(parts), first.device, list(parts))
        self.part_slots = first.num_slots
        self.bases = np.stack([p.bases for p in parts])
        self.strides = np.stack([p.strides for p in parts])

    def _addresses(self, slots: np.ndarray) -> np.ndarray:
        part, slot = np.divmod(slots, self.part_slots)
        return self.bases[part] + slot[:, None] * self.strides[part]


class SlotListStorage(BlockStorage):
    """Each slot is its own contiguous buffer at ``slot_bases[s]`` (a list of separate arrays)."""

    def __init__(
        self, layout: BlockLayout, slot_bases: Sequence[int], device: str = HOST_DEVICE, keepalive: Any = None
    ) -> None:
        self.slot_bases = np.asarray(slot_bases, dtype=np.int64)
        super().__init__(layout, len(self.slot_bases), device, keepalive)

    def _addresses(self, slots: np.ndarray) -> np.ndarray:
        return self.slot_bases[slots][:, None] + self.layout.offsets[None, :]


def contiguous_storage(
    base: int,
    num_slots: int,
    layout: BlockLayout,
    device: str = HOST_DEVICE,
    keepalive: Any = None,
    on_close: Callable[[], None] | None = None,
    header_room: int = 0,
) -> StridedStorage:
    """A slab of ``num_slots`` back-to-back blocks starting at address ``base``, each after
    ``header_room`` bytes of its own: room where a transfer may put a header that then moves with the
    block as one piece (a remote store's record)."""
    stride = layout.block_bytes + header_room
    storage = StridedStorage(
        layout,
        num_slots,
        base + header_room + layout.offsets,
        [stride] * layout.num_fragments,
        device,
        keepalive,
        on_close,
    )
    storage.header_room = header_room
    return storage


def buffer_info(array: Any, writable: bool) -> tuple[int, int, str]:
    """(address, nbytes, device) of a C-contiguous numpy array or torch tensor; raises TransferError otherwise."""
    if isinstance(array, np.ndarray):
        if not array.flags.c_contiguous:
            raise TransferError("block buffers must be C-contiguous")
        if writable and not array.flags.writeable:
            raise TransferError("the destination array is read-only")
        return array.ctypes.data, array.nbytes, HOST_DEVICE
    if hasattr(array, "data_ptr") and hasattr(array, "is_contiguous"):  # a torch tensor, without importing torch
        if not array.is_contiguous():
            raise TransferError("block tensors must be contiguous")
        return array.data_ptr(), array.numel() * array.element_size(), array.device.type
    raise TransferError(f"blocks must be numpy arrays or torch tensors, got {type(array).__name__}")


def buffer_storage(blocks: Any, layout: BlockLayout, writable: bool = False) -> BlockStorage:
    """Wrap a caller's blocks as a storage: one array of n blocks (leading dimension n), or a list of arrays."""
    if isinstance(blocks, (list, tuple)):
        infos = [buffer_info(b, writable) for b in blocks]
        bad = [i for i, (_, n, _) in enumerate(infos) if n != layout.block_bytes]
        if bad:
            raise TransferError(f"block {bad[0]} has {infos[bad[0]][1]} bytes, the layout needs {layout.block_bytes}")
        devices = {d for _, _, d in infos}
        if len(devices) > 1:
            raise TransferError(f"blocks live on several devices: {sorted(devices)}")
        device = devices.pop() if devices else HOST_DEVICE
        return SlotListStorage(layout, [a for a, _, _ in infos], device, list(blocks))
    address, nbytes, device = buffer_info(blocks, writable)
    if nbytes % layout.block_bytes:
        raise TransferError(f"a buffer of {nbytes} bytes is not a whole number of {layout.block_bytes}-byte blocks")
    return contiguous_storage(address, nbytes // layout.block_bytes, layout, device, blocks)


Piece = tuple[int, int]
"""(address, size) of a run of a block's bytes in memory."""


def block_pieces(storage: BlockStorage, slots: Sequence[int]) -> list[list[Piece]]:
    """Each slot's bytes as (address, size) pieces in layout order, fragments that follow on in memory
    merged (a host slot is one piece): what a copy to or from memory addressed by key moves per block."""
    sizes = storage.layout.fragment_bytes
    out = []
    for row in storage.fragment_addresses(slots).tolist():
        pieces: list[Piece] = []
        for address, size in zip(row, sizes, strict=True):
            if pieces and sum(pieces[-1]) == address:
                pieces[-1] = (pieces[-1][0], pieces[-1][1] + size)
            else:
                pieces.append((address, size))
        out.append(pieces)
    return out
