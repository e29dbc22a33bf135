"""Cost of kvtier's block keys: BLAKE2b-128 chains, unkeyed and keyed, next to the xxh3-128 chains they replaced.

What is measured
    ``chain_hashes``: one conversion per call, one hash per full block. Per block: a long prompt
    (``--tokens``) given as an int64 array, so that the figure is the hashing alone, cut into 16-token
    and into 512-token blocks, the time per call divided by its blocks. Per prompt: one 2,048-token
    prompt as a Python list (what vLLM's scheduler side passes) in 16-token blocks, the whole call
    (list conversion, root and 128 links). Keys per second follow from the time per block. Each
    figure is the best of ``--repeat`` timings of ``--number`` calls; the variants are timed back to
    back for each figure, so that they see the same machine.

Reference, measured in the same run
    The chain kvtier used before: ``xxh3_128(parent + tokens)`` links under an ``xxh3_128`` root,
    kept here (``xxh3_chain``) only as the yardstick. ``ratio`` = xxh3 time / unkeyed BLAKE2b time per
    16-token block: the share of xxh3's speed the collision-resistant keys keep (``ratio_keyed`` for
    the keyed chain, ``ratio_2048_prompt`` for the whole call on a prompt). For scale, the chain
    vLLM 0.33's own prefix cache computes for every request anyway, by default SHA-256 over a
    pickle of (parent hash, block's token ids, extra keys), is timed too (``vllm_sha256_chain``).

The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pickle
import timeit

import numpy as np
import xxhash

from kvtier.core.keys import chain_hashes

SECRET = b"a bench secret of some 32 bytes!"


def xxh3_chain(token_ids: list[int] | np.ndarray, block_size: int, namespace: bytes = b"") -> list[bytes]:
    """The previous key chain (the reference only): one conversion, an xxh3 root, one xxh3 per block."""
    data = np.asarray(token_ids).astype("<i8", copy=False).tobytes()
    stride = block_size * 8
    prev = xxhash.xxh3_128_digest(b"kvtier\0" + namespace)
    keys = []
    for i in range(len(token_ids) // block_size):
        prev = xxhash.xxh3_128_digest(prev + data[i * stride : (i + 1) * stride])
        keys.append(prev)
    return keys


def vllm_sha256_chain(token_ids: list[int] | np.ndarray, block_size: int) -> list[bytes]:
    """vLLM's default block hash (``hash_block_tokens`` with ``sha256``), for scale only."""
    tokens = token_ids.tolist() if isinstance(token_ids, np.ndarray) else token_ids
    prev = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=pickle.HIGHEST_PROTOCOL)).digest()
    keys = []
    for i in range(len(tokens) // block_size):
        block = tuple(tokens[i * block_size : (i + 1) * block_size])
        prev = hashlib.sha256(pickle.dumps((prev, block, None), protocol=pickle.HIGHEST_PROTOCOL)).digest()
        keys.append(prev)
    return keys


VARIANTS = {
    "xxh3-128": lambda tokens, bs: xxh3_chain(tokens, bs, b"ns"),
    "blake2b-128": lambda tokens, bs: chain_hashes(tokens, bs, b"ns"),
    "blake2b-128 keyed": lambda tokens, bs: chain_hashes(tokens, bs, b"ns", secret=SECRET),
    "vLLM sha256(pickle)": vllm_sha256_chain,
}


def best_us(fn, tokens: list[int] | np.ndarray, block_size: int, number: int, repeat: int) -> float:
    """Microseconds per call, the best of ``repeat`` timings of ``number`` calls."""
    return min(timeit.repeat(lambda: fn(tokens, block_size), number=number, repeat=repeat)) / number * 1e6


def measure(args) -> dict[str, dict[str, float]]:
    rng = np.random.default_rng(0)
    long_prompt = rng.integers(0, 150_000, args.tokens)
    prompt = rng.integers(0, 150_000, 2048).tolist()
    cases = {
        "us_per_16_block": (long_prompt, 16, args.tokens // 16),
        "us_per_512_block": (long_prompt, 512, args.tokens // 512),
        "us_per_2048_prompt": (prompt, 16, 1),
    }
    out: dict[str, dict[str, float]] = {name: {} for name in VARIANTS}
    for case, (tokens, block_size, per) in cases.items():
        number = max(1, args.number * 65536 // (len(tokens) * 16)) if per > 1 else args.number
        for name, fn in VARIANTS.items():
            out[name][case] = best_us(fn, tokens, block_size, number, args.repeat) / per
    for figures in out.values():
        figures["keys_per_s_16"] = 1e6 / figures["us_per_16_block"]
        figures["keys_per_s_512"] = 1e6 / figures["us_per_512_block"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=65536, help="length of the prompt timed per block")
    parser.add_argument("--number", type=int, default=200, help="calls per timing (scaled down for long prompts)")
    parser.add_argument("--repeat", type=int, default=15, help="timings per figure; the best is kept")
    args = parser.parse_args()

    results = measure(args)
    print(
        f"{'hash':20} {'us/16-tok block':>16} {'us/512-tok block':>17} {'us/2048-tok prompt':>19} "
        f"{'keys/s (16)':>12} {'keys/s (512)':>13}"
    )
    for name, r in results.items():
        print(
            f"{name:20} {r['us_per_16_block']:16.3f} {r['us_per_512_block']:17.3f} {r['us_per_2048_prompt']:19.1f} "
            f"{r['keys_per_s_16']:12,.0f} {r['keys_per_s_512']:13,.0f}"
        )
    xxh3, blake, keyed = (results[name]["us_per_16_block"] for name in ("xxh3-128", "blake2b-128", "blake2b-128 keyed"))
    prompt = {name: results[name]["us_per_2048_prompt"] for name in VARIANTS}
    summary = {
        "ratio": round(xxh3 / blake, 3),
        "ratio_keyed": round(xxh3 / keyed, 3),
        "ratio_2048_prompt": round(prompt["xxh3-128"] / prompt["blake2b-128"], 3),
        **{f"{name} {k}": round(v, 3) for name, r in results.items() for k, v in r.items()},
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
