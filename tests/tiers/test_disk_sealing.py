"""A disk tier that seals its slots (``encryption: aes-gcm``): real AES-256-GCM over a real slab file.

What it shows: blocks written through a host-over-disk stack come back bit-exact after a restart,
raw and compressed, and the slab file holds none of their bytes; a slot relabelled as another block's
(its header rewritten, its own checksum too), a flipped byte of its ciphertext or of its seal, a secret
of another deployment are misses, never bytes in the caller's memory; during a rotation the previous
secret still opens; a plain tier finds nothing in a sealed slab (the cache is discarded, saying why),
and a missing secret is one error at start, and one failed check in ``kvtier doctor``.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from helpers.stack_helpers import flip
from kvtier import KVTier
from kvtier.core.errors import ConfigError
from kvtier.doctor import diagnose
from kvtier.tiers.disk.files import SLAB_NAME
from kvtier.tiers.disk.format import SEAL_AT, SlotHeader, read_slot_headers
from kvtier.tiers.disk.slots import PAGE

BLOCK = 64 * 1024
TOKENS = 16
PLANTED = b"PLANTED-KV-BYTES-0123456789abcdef"
SECRET, OTHER = "KVTIER_TEST_DISK_SEAL", "KVTIER_TEST_DISK_OTHER_SEAL"


@pytest.fixture(autouse=True)
def secrets(monkeypatch):
    monkeypatch.setenv(SECRET, "a disk sealing secret of 32 byte")
    monkeypatch.setenv(OTHER, "another disk sealing secret, 32b")


def config(path, secret: str | None = SECRET, previous: str | None = None, compression: str = "none") -> dict:
    disk = {"medium": "disk", "path": str(path), "capacity_blocks": 16, "compression": compression}
    if compression != "none":
        disk["slot_bytes"] = BLOCK
    if secret is not None:
        disk.update(encryption="aes-gcm", encryption_key_env=secret)
    if previous is not None:
        disk["encryption_previous_key_env"] = previous
    return {"block_tokens": TOKENS, "block_bytes": BLOCK, "tiers": [{"medium": "host", "capacity_blocks": 8}, disk]}


def prompt(n: int) -> list[int]:
    return list(range(n * TOKENS))


def blocks(n: int, compressible: bool = False) -> np.ndarray:
    rng = np.random.default_rng(7)
    out = (rng.integers(0, 4, (n, BLOCK)) if compressible else rng.integers(0, 256, (n, BLOCK))).astype(np.uint8)
    out[:, 5000 : 5000 + len(PLANTED)] = np.frombuffer(PLANTED, np.uint8)
    return out


def stored(cfg: dict, n: int = 4, compressible: bool = False) -> np.ndarray:
    """``n`` blocks stored through a stack of ``cfg``, closed: they are in the slab."""
    data = blocks(n, compressible)
    with KVTier.open(cfg) as kv:
        assert kv.store_now(prompt(n), data).stored == n
    return data


def load(cfg: dict, n: int = 4):
    """A fresh stack's load of the prompt (its host tier empty: from disk)."""
    out = np.zeros((n, BLOCK), np.uint8)
    with KVTier.open(cfg) as kv:
        result = kv.load_now(prompt(n), out)
        stats = kv.stats()
    return result, out, stats


def slots_by_key(path) -> dict[bytes, int]:
    fd = os.open(path / SLAB_NAME, os.O_RDONLY)
    try:
        return {h.key: slot for slot, h, _ in read_slot_headers(fd, 16, PAGE + BLOCK) if h is not None}
    finally:
        os.close(fd)


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_sealed_slots_hold_none_of_the_blocks_bytes_and_come_back_after_a_restart(tmp_path, compression):
    cfg = config(tmp_path / "cache", compression=compression)
    data = stored(cfg, compressible=compression != "none")
    slab = (tmp_path / "cache" / SLAB_NAME).read_bytes()
    assert PLANTED not in slab and data[0, :64].tobytes() not in slab
    result, out, stats = load(cfg)
    assert (result.loaded, result.failed) == (4, []) and np.array_equal(out, data)
    assert stats["disk"]["hits"] == 4


@pytest.mark.parametrize("change", ["relabelled", "ciphertext byte", "seal byte"])
def test_a_slot_relabelled_or_changed_does_not_open(tmp_path, change):
    cfg = config(tmp_path / "cache")
    data = stored(cfg)
    path = tmp_path / "cache"
    with KVTier.open(cfg) as kv:
        keys = kv.keys(prompt(4))
    where = slots_by_key(path)
    offset = PAGE + where[keys[1]] * (PAGE + BLOCK)  # block 1's slot header page
    if change == "relabelled":  # blocks 1 and 2 swap labels, their headers' checksums made to match
        other = PAGE + where[keys[2]] * (PAGE + BLOCK)
        fd = os.open(path / SLAB_NAME, os.O_RDWR)
        try:
            one, two = (SlotHeader.unpack(os.pread(fd, PAGE, at)) for at in (offset, other))
            assert one is not None and two is not None
            os.pwrite(fd, dataclasses.replace(one, key=keys[2]).pack()[:SEAL_AT], offset)
            os.pwrite(fd, dataclasses.replace(two, key=keys[1]).pack()[:SEAL_AT], other)
        finally:
            os.close(fd)
    else:
        flip(path / SLAB_NAME, offset + (PAGE + 777 if change == "ciphertext byte" else SEAL_AT + 20))
    bad = [1, 2] if change == "relabelled" else [1]
    result, out, stats = load(cfg)
    assert (result.hits, result.failed) == (4, bad)  # found, and those do not open
    for i in range(4):  # nothing of a slot that does not open reaches the caller's memory
        assert not out[i].any() if i in bad else np.array_equal(out[i], data[i])
    assert stats["disk"]["read_errors"] == len(bad)


def test_another_secret_misses_and_a_rotation_still_opens(tmp_path):
    path = tmp_path / "cache"
    data = stored(config(path))
    result, out, _ = load(config(path, secret=OTHER))
    assert result.loaded == 0 and not out.any()
    data = stored(config(path))  # (the failed loads dropped them: stored again)
    result, out, _ = load(config(path, secret=OTHER, previous=SECRET))
    assert result.loaded == 4 and np.array_equal(out, data)


def test_a_plain_tier_finds_nothing_in_a_sealed_slab_and_says_why(tmp_path, caplog):
    path = tmp_path / "cache"
    stored(config(path))
    result, out, _ = load(config(path, secret=None))
    assert result.loaded == 0 and not out.any()
    assert "encryption changed from aes-gcm to none; discarding the old cache" in caplog.text


def test_a_missing_secret_is_one_error_at_start_and_a_failed_doctor_check(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET)
    cfg = config(tmp_path / "cache")
    with pytest.raises(ConfigError, match=f"^encryption_key_env: the environment variable {SECRET} is unset"):
        KVTier.open(cfg)
    assert not (tmp_path / "cache").exists()
    path = tmp_path / "kvtier.yaml"
    path.write_text(str(cfg).replace("'", '"'))  # (JSON is YAML)
    report = diagnose(str(path))
    assert report["failed"] == ["tiers[1] (disk) secrets"]


def test_encryption_without_its_secret_is_refused(tmp_path):
    cfg = config(tmp_path / "cache")
    del cfg["tiers"][1]["encryption_key_env"]
    with pytest.raises(ConfigError, match="encryption: aes-gcm needs encryption_key_env"):
        KVTier.open(cfg)
