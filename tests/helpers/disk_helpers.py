"""Host-over-disk stacks on a real slab file in a temporary directory, and storing and loading through
them: what the disk tier tests (tests/tiers) share. A block's bytes are a pure function of its key
(and a salt naming whose block it is), so every load can be checked bit-exact."""

from __future__ import annotations

import contextlib
import hashlib
import os

import numpy as np

from helpers.stack_helpers import content, key
from kvtier.builder import build_stack
from kvtier.core.config import load_config
from kvtier.core.layout import BlockLayout
from kvtier.core.storage import buffer_storage

BLOCK = 16 * 1024
LAYOUT = BlockLayout((BLOCK // 4,) * 4)


def config_dict(
    path,
    *,
    host=4,
    disk=16,
    namespace="model-a",
    fragments=4,
    block_bytes=BLOCK,
    placement="write_back",
    o_direct="auto",
    disk_watermark=None,
    gpu=None,
    **disk_options,
) -> dict:
    """A stack over a disk tier at ``path``; every tier evicts in LRU order, which tests here count on.
    ``disk_options`` are further keys of the disk tier (``shared_directory``, ``reinitialise``)."""
    tiers = []
    if gpu:
        tiers.append({"medium": "gpu", "capacity_blocks": gpu})
    if host:
        tiers.append({"medium": "host", "capacity_blocks": host})
    disk_cfg = {"medium": "disk", "path": str(path), "capacity_blocks": disk, "o_direct": o_direct, **disk_options}
    if disk_watermark:
        disk_cfg["watermark"] = {"high": disk_watermark[0], "low": disk_watermark[1]}
    tiers.append(disk_cfg)
    for tier in tiers:
        tier["eviction"] = "lru"
    return {
        "block_bytes": block_bytes,
        "fragments": fragments,
        "namespace": namespace,
        "placement": placement,
        "tiers": tiers,
    }


def open_stack(path, backends=None, **kwargs):
    return build_stack(load_config(config_dict(path, **kwargs)), backends=backends)


def data(k: bytes, salt: bytes = b"", nbytes: int = BLOCK) -> np.ndarray:
    """A block's bytes: a pure function of its key (and a salt naming whose block it is)."""
    return content(hashlib.blake2b(salt + k, digest_size=16).digest() if salt else k, nbytes)


def put(stack, keys, salt=b"", layout=LAYOUT, batch=None):
    """Store ``keys`` in batches the first tier can hold; returns the StoreResults."""
    batch = batch or stack.tiers[0].capacity
    results = []
    for i in range(0, len(keys), batch):
        chunk = keys[i : i + batch]
        blocks = np.stack([data(k, salt, layout.block_bytes) for k in chunk])
        results.append(stack.store(chunk, buffer_storage(blocks, layout), range(len(chunk))).result(timeout=30))
    return results


def get(stack, keys, layout=LAYOUT, dst_medium=None, out=None):
    """Load ``keys`` into a fresh zeroed buffer; returns (LoadResult, buffer)."""
    if out is None:
        out = np.zeros((len(keys), layout.block_bytes), np.uint8)
    dst = buffer_storage(out, layout, writable=True)
    result = stack.load(keys, dst, range(len(keys)), dst_medium=dst_medium).result(timeout=30)
    return result, out


@contextlib.contextmanager
def umask(mask: int):
    """The process's umask set to ``mask`` within the block (files a test creates get modes it chose)."""
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def assert_exact(keys, result, out, salt=b"", nbytes=BLOCK):
    """Every block loaded (a hit not reported failed) holds exactly its own bytes."""
    for i in range(result.hits):
        if i not in result.failed:
            assert np.array_equal(out[i], data(keys[i], salt, nbytes)), f"block {i} came back wrong"


KEYS = [key(i) for i in range(64)]

# A child process that opens a stack on the directory given as JSON config, says OPENED (or REFUSED and
# exits 3) and holds the directory until its stdin closes.
CHILD_OPEN = """
import json, sys
from kvtier.builder import build_stack
from kvtier.core.config import load_config
from kvtier.tiers.disk.files import DiskTierError
try:
    stack = build_stack(load_config(json.loads(sys.argv[1])))
except DiskTierError as exc:
    print("REFUSED", exc, flush=True)
    sys.exit(3)
print("OPENED", flush=True)
sys.stdin.read()  # hold the directory until the parent closes our stdin
stack.close()
"""
