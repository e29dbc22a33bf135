"""What sealing a block costs a core, against what a record costs today (``kvtier.core.sealing``).

What is measured
    ``--blocks`` blocks of ``--block-bytes`` (256 KiB and 2 MiB) in host memory, each step timed over
    them all, medians of ``--rounds``, on one thread:

    - ``plain``: what a remote record's writer and reader do to a block today without a secret: the
      xxh3-64 checksum of its bytes (the bytes go out as they are);
    - ``mac``: the same with ``auth_key_env``: the checksum and the keyed BLAKE2b MAC over the bytes;
    - ``sealed``: AES-256-GCM (``cryptography``, OpenSSL) into a staging buffer as a store would, and
      opened in place as a load would (the tag authenticates: no checksum, no MAC);
    - ``memcpy``: copying the blocks, for scale.

Ratios
    ``sealed_over_mac``: sealed / MAC GB/s, the lower of sealing and opening, at the largest block
    (the issue's goal: at least 1, sealing as fast as the MAC path); ``sealed_over_plain`` likewise
    against the checksum alone. ``ratio``: ``sealed_over_mac``. The last line is one JSON object with
    every figure. This is the CPU's part only: bench/remote.py and bench/disk.py measure tiers.

    .venv/bin/python bench/sealing.py [--block-bytes 262144,2097152] [--blocks 32] [--rounds 15]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import xxhash

from kvtier.core.sealing import SealingKeys

SECRET = b"bench secret of at least 16 bytes"
MAC_KEY = bytes(range(32))


def gbps(step: Callable[[], object], nbytes: int, rounds: int) -> float:
    """GB/s of ``step`` over ``nbytes``, the median of ``rounds`` (after one untimed)."""
    step()
    took = []
    for _ in range(rounds):
        start = time.perf_counter()
        step()
        took.append(time.perf_counter() - start)
    return nbytes / statistics.median(took) / 1e9


def measure(block_bytes: int, blocks: int, rounds: int) -> dict[str, float]:
    """Every path's GB/s for ``blocks`` blocks of ``block_bytes``."""
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (blocks, block_bytes), dtype=np.uint8)
    staging = np.empty_like(data)
    sealer = SealingKeys(SECRET).sealer(b"8bytetag")
    identities = [i.to_bytes(32, "little") for i in range(blocks)]
    seals: list[bytes] = []
    nbytes = data.nbytes

    def checksums() -> None:
        for row in data:
            xxhash.xxh3_64_intdigest(row)

    def macs() -> None:
        for row in data:
            xxhash.xxh3_64_intdigest(row)
            hashlib.blake2b(row, key=MAC_KEY, digest_size=32).digest()

    def seal() -> None:
        seals[:] = [sealer.seal([row], [out], ident) for row, out, ident in zip(data, staging, identities, strict=True)]

    def open_in_place() -> None:
        sealed = staging.copy()  # (opened in place: a fresh copy of the ciphertext each round, timed apart)
        start = time.perf_counter()
        for row, ident, seal_ in zip(sealed, identities, seals, strict=True):
            assert sealer.open([row], [row], seal_, ident)
        opened[0] += time.perf_counter() - start
        assert np.array_equal(sealed, data)

    figures = {
        "memcpy": gbps(lambda: np.copyto(staging, data), nbytes, rounds),
        "plain": gbps(checksums, nbytes, rounds),
        "mac": gbps(macs, nbytes, rounds),
        "seal": gbps(seal, nbytes, rounds),
    }
    took = []
    for _ in range(rounds):
        opened = [0.0]
        open_in_place()
        took.append(opened[0])
    figures["open"] = nbytes / statistics.median(took) / 1e9
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-bytes", default="262144,2097152")
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    sizes = [int(b) for b in args.block_bytes.split(",")]
    out: dict = {}
    print(f"{'block':>8} {'memcpy':>8} {'checksum':>9} {'+ MAC':>8} {'seal':>8} {'open':>8}   (GB/s, one thread)")
    for size in sizes:
        f = measure(size, args.blocks, args.rounds)
        out[str(size)] = f
        print(
            f"{size // 1024:>6}Ki {f['memcpy']:>8.2f} {f['plain']:>9.2f} {f['mac']:>8.2f} {f['seal']:>8.2f} "
            f"{f['open']:>8.2f}",
            flush=True,
        )
    largest = out[str(max(sizes))]
    sealed = min(largest["seal"], largest["open"])
    out["sealed_over_mac"] = sealed / largest["mac"]
    out["sealed_over_plain"] = sealed / largest["plain"]
    out["ratio"] = out["sealed_over_mac"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
