"""Block codecs of the disk tier: split 16-bit values into byte planes, then lz4 or zstd (level 1).

Why split: KV caches hold 16-bit floats. The high byte of each value (sign, most of the exponent)
repeats a lot; the low byte (mantissa) is close to noise. Interleaved, the codecs barely see the
repetition (lz4 saves nothing on raw bf16); as a plane of high bytes followed by a plane of low bytes,
bf16 N(0, 0.5^2) blocks of 256 KiB shrink to 0.85 of their size with lz4 and 0.69 with zstd-1
(bench/disk.py). Each plane is its own frame: zstd builds one entropy table per 128 KiB of input,
and a frame mixing both planes costs about a tenth of a 16-64 KiB block.

Payload of a block: u32 length of the high-plane frame, the high-plane frame, the low-plane frame.
``decompress`` raises ``CorruptPayload`` for anything that does not give back exactly the block's
size, so the caller reports a miss; the data checksum (checked by the caller) catches the rest.

The codec packages are imported only when a tier asks for them; a missing one is a ConfigError that
says what to install.
"""

from __future__ import annotations

import struct
import threading
from abc import ABC, abstractmethod

import numpy as np

from kvtier.core.errors import ConfigError

CODEC_IDS = {"none": 0, "lz4": 1, "zstd": 2}
CODEC_NAMES = {v: k for k, v in CODEC_IDS.items()}
_PACKAGES = {"lz4": "lz4", "zstd": "zstandard"}
_PREFIX = struct.Struct("<I")


class CorruptPayload(ValueError):
    """A stored payload does not decompress into exactly one block."""


def split_planes(raw: np.ndarray) -> np.ndarray:
    """The high bytes of every little-endian 16-bit value, then the low bytes (an odd last byte ends
    the low plane), as one array of the same size."""
    n = len(raw)
    pairs = raw[: n - n % 2].view("<u2")
    out = np.empty(n, np.uint8)
    out[: n // 2] = pairs >> 8
    out[n // 2 : n - n % 2] = pairs  # the assignment keeps the low byte
    out[n - n % 2 :] = raw[n - n % 2 :]
    return out


def merge_planes(high: np.ndarray, low: np.ndarray) -> np.ndarray:
    """The inverse of ``split_planes``, from its two planes."""
    n = len(high) + len(low)
    out = np.empty(n, np.uint8)
    pairs = out[: n - n % 2].view("<u2")
    np.left_shift(high, 8, out=pairs, dtype="<u2")  # in place: no temporary arrays
    pairs |= low[: len(high)]
    out[n - n % 2 :] = low[len(high) :]
    return out


class Codec(ABC):
    """Compresses one block (a uint8 array) into a payload and back. Safe to use from many threads."""

    name = ""
    _errors: tuple[type[Exception], ...]
    """What the codec's library (and unpacking its frame) raises for a damaged frame."""

    @abstractmethod
    def _pack(self, plane: np.ndarray) -> bytes:
        """One plane compressed into a frame."""

    @abstractmethod
    def _unpack(self, frame, size: int) -> bytes:
        """A frame decompressed back into its plane of ``size`` bytes."""

    def compress(self, raw: np.ndarray) -> bytes:
        planes = split_planes(raw)
        half = len(raw) // 2
        high = self._pack(planes[:half])
        return b"".join((_PREFIX.pack(len(high)), high, self._pack(planes[half:])))

    def decompress(self, payload, nbytes: int) -> np.ndarray:
        """The block of ``nbytes`` in ``payload``; raises CorruptPayload when it is not one."""
        payload = memoryview(payload)
        half = nbytes // 2
        try:
            (high_len,) = _PREFIX.unpack_from(payload)
            high_end = _PREFIX.size + high_len
            if high_end > len(payload):
                raise CorruptPayload("the high-plane frame runs past the payload")
            high = self._unpack(payload[_PREFIX.size : high_end], half)
            low = self._unpack(payload[high_end:], nbytes - half)
        except self._errors as exc:
            raise CorruptPayload(str(exc)) from exc
        if len(high) != half or len(low) != nbytes - half:
            raise CorruptPayload(f"decompressed {len(high)} + {len(low)} bytes, expected {nbytes}")
        return merge_planes(np.frombuffer(high, np.uint8), np.frombuffer(low, np.uint8))


class _Lz4(Codec):
    name = "lz4"

    def __init__(self) -> None:
        import lz4.block

        self._block = lz4.block
        self._errors = (lz4.block.LZ4BlockError, struct.error, ValueError)

    def _pack(self, plane: np.ndarray) -> bytes:
        return self._block.compress(plane, store_size=False)

    def _unpack(self, frame, size: int) -> bytes:
        return self._block.decompress(frame, uncompressed_size=size)


class _Zstd(Codec):
    name = "zstd"

    def __init__(self) -> None:
        import zstandard

        self._zstd = zstandard
        self._errors = (zstandard.ZstdError, struct.error, ValueError)
        self._local = threading.local()  # zstd contexts must not be shared between threads

    def _pack(self, plane: np.ndarray) -> bytes:
        local = self._local
        if not hasattr(local, "c"):
            local.c = self._zstd.ZstdCompressor(level=1)
        return local.c.compress(plane)

    def _unpack(self, frame, size: int) -> bytes:
        # A frame states its own size; check it first, so damage cannot make us allocate a huge buffer.
        if self._zstd.frame_content_size(frame) != size:
            raise CorruptPayload("the frame's content size is not the plane's")
        local = self._local
        if not hasattr(local, "d"):
            local.d = self._zstd.ZstdDecompressor()
        return local.d.decompress(frame)


_CODECS = {"lz4": _Lz4, "zstd": _Zstd}


def codec(name: str) -> Codec | None:
    """The codec called ``name`` (None for "none"); raises ConfigError for an unknown name or a codec
    whose package is not installed."""
    if name == "none":
        return None
    if name not in _CODECS:
        raise ConfigError(f"compression must be one of {', '.join(CODEC_IDS)}, got {name!r}")
    try:
        return _CODECS[name]()
    except ImportError:
        raise ConfigError(
            f"compression: {name} needs the {_PACKAGES[name]!r} package, which is not installed; "
            f"pip install 'kvtier[compression]'"
        ) from None
