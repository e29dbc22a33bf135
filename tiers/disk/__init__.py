"""The local disk tier: one preallocated slab file of fixed-size slots that survives restarts.

Sealing (``encryption: aes-gcm``, ``kvtier.core.sealing``): each slot's bytes are the block (or its
compressed payload) sealed with AES-256-GCM, its seal in the slot's header page after the header, the
header's fields bound to it; whoever reads the disk, an image or a backup of it reads no KV, and a slot
that does not open (another secret, moved to another slot's key, changed) is a miss.

Compression (``compression: lz4 | zstd``) buys capacity, not speed (the codecs run slower than a
local SSD): each slot gets only ``slot_bytes`` of room, so the same file holds more slots, and a block
whose compressed payload does not fit that room is not stored (counted in ``incompressible``) and is
refused for good (``Tier.refuse``): the tier above drops it rather than offering it again and again.

Why it is crash-safe without a separate index or a sync per store: a slot's header holds the checksum
of the bytes it describes, and every read checks header and checksum, so a slot that a crash tore
(new header over old bytes, old header over new bytes, half a block) is a miss, never wrong data.
Each slot is written header and bytes in one call (``io``); a process killed mid-store leaves each
slot old or new. Reopening the directory rebuilds the index by scanning slot headers; a torn slot
found there fails its first load and is dropped.

Restart in seconds: a scan reads one header page per slot, minutes for a slab of millions of slots.
So a clean close leaves an index snapshot of the tier's blocks beside the slab (``snapshot``), and
the next open restores from it instead, after checking that it describes the slab exactly as that
close left it; the tier serves as soon as the blocks' slots are claimed, the blocks going back into
its index in chunks meanwhile (``kvtier.core.restore``). The open removes it before anything writes to the slab:
after a crash there is none, and the scan above recovers everything. A snapshot can only cause misses
(every load checks its slot's header), never wrong data.

- ``config``: the tier's YAML schema (``medium: disk``);
- ``slots``: a slot's geometry (header page, room for a block, its footprint), shared by schema and slab;
- ``format``: the slab's layout on disk: file header, slot headers (packed, unpacked, checked), geometry;
- ``files``: opening the directory, the slab and the files beside it without trusting the directory;
- ``slab``: the slab a process owns (``DiskSlab``): opened, fitted to its geometry, recovered, closed;
  and the slab as block storage (``FileStorage``);
- ``io``: where a block's bytes hit the disk and come back: the write and read paths (vectored runs,
  bounce buffers, sealing, compression), every load verified;
- ``transfer``: the transfer backend between host memory and a slab (``DiskBackend``), running ``io``;
- ``tier``: the tier over a slab (``DiskTier``, built by ``disk_tier``);
- ``snapshot``: the index snapshot a clean close leaves, and its checks at the next open;
- ``namespaces``: the namespaces that used the directory (``namespaces.json``);
- ``compression``: the block codecs (byte planes, then lz4 or zstd);
- ``inspect``: reading a slab another process may own, without its lock (``kvtier inspect``, recovery);
- ``ranks``: an engine's ranks' slabs, one directory each, and the identity an index of them names;
- ``doctor``: what ``kvtier doctor`` checks of the tier (its directories, its secrets, its free space).

This module builds the medium's registry entry (``MEDIUM``), which names the medium's transfer backend.
"""

from __future__ import annotations

from kvtier.core.config import TransferConfig
from kvtier.core.devices import Capabilities
from kvtier.core.media import Medium, RankRequest, RestartRequest, TierRequest
from kvtier.core.storage import BlockStorage
from kvtier.core.tier import Tier
from kvtier.core.tier_config import TierConfigBase
from kvtier.tiers.disk import doctor
from kvtier.tiers.disk.config import DiskTierConfig
from kvtier.tiers.disk.ranks import RankSlabs, rank_directory
from kvtier.tiers.disk.slab import DiskSlab, FileStorage
from kvtier.tiers.disk.tier import disk_tier
from kvtier.tiers.disk.transfer import DiskBackend


def _tier(request: TierRequest) -> Tier:
    assert isinstance(request.config, DiskTierConfig)
    policy, watermark = request.policy()
    return disk_tier(
        request.name,
        request.slots,
        request.layout,
        policy,
        watermark,
        request.is_fenced,
        config=request.config,
        namespace=request.stack.namespace,
    )


def _rank_storage(request: RankRequest) -> BlockStorage:
    """One rank's slab. Recovering takes up the newest sequence number and leaves every old header
    as it is: the blocks an engine's scheduler side took back (``RankSlabs``, ``_kept_blocks``) stay
    readable, and any slot is cleared before new bytes land in it. A worker holds no index (the
    scheduler side does), so its clean close leaves a snapshot of no blocks (``_no_blocks``): it
    carries the sequence number, and the next open takes it from there instead of reading every
    slot header; after a crash it reads them."""
    assert isinstance(request.config, DiskTierConfig)
    path = rank_directory(request.config.path, request.rank)
    slab = DiskSlab.from_config(request.config, request.slots, request.layout, request.namespace, path)
    try:
        slab.recover(lambda keys, slots: None)
    except BaseException:
        slab.close()
        raise
    slab.refuse = request.refuse
    slab.held_blocks = _no_blocks
    return FileStorage(slab, request.layout)


def _direct(other: str, caps: Capabilities) -> bool:
    """A disk slab and GPU memory copy without host staging where GPUDirect Storage is available."""
    return other == "gpu" and caps.gpu_direct_storage


def _kept_blocks(request: RestartRequest) -> RankSlabs:
    """The blocks every rank's slab kept, as the engine's scheduler side takes them back (``RankSlabs``)."""
    assert isinstance(request.config, DiskTierConfig)
    return RankSlabs(request.config, request.ranks, request.slots, request.layout, request.namespace)


def _backend(transfer: TransferConfig, config: TierConfigBase) -> DiskBackend:
    return DiskBackend(transfer.io_threads)


MEDIUM = Medium(
    "disk",
    DiskTierConfig,
    _tier,
    _rank_storage,
    direct=_direct,
    event_medium="STORAGE",
    hit_source="DISK",
    survives_restart=True,
    kept_blocks=_kept_blocks,
    directory_key="path",
    backend=_backend,
    doctor=doctor.checks,
    doctor_space=doctor.space,
)


def _no_blocks() -> tuple[list[bytes], list[int]]:
    """What an engine's worker lists for its slab's snapshot: no block (the scheduler side indexes them)."""
    return [], []
