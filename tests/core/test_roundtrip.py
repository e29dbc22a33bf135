"""Round trip at scale: thousands of random blocks stored through a GPU-over-host stack in both
placements, with evictions and watermark demotions forced along the way; afterwards every block the
stack still reports present comes back bit-exact, the counters add up, and nothing leaks."""

import numpy as np
import pytest

from helpers.stack_helpers import LAYOUT, assert_no_leaks, make_stack
from kvtier.core.storage import buffer_storage
from kvtier.policies import Watermark

NUM_BLOCKS = 3000


@pytest.mark.parametrize("placement", ["write_back", "write_through"])
def test_thousands_of_random_blocks_round_trip_bit_exact(placement):
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, (NUM_BLOCKS, LAYOUT.block_bytes), dtype=np.uint8)
    keys = [rng.bytes(16) for _ in range(NUM_BLOCKS)]
    stack = make_stack(
        gpu=64, host=1024, placement=placement, gpu_watermark=Watermark(0.9, 0.6), host_watermark=Watermark(0.95, 0.8)
    )
    reloaded = 0
    position = 0
    while position < NUM_BLOCKS:
        n = int(rng.integers(1, 33))
        batch = slice(position, min(position + n, NUM_BLOCKS))
        result = stack.store(keys[batch], buffer_storage(data[batch], LAYOUT), range(len(keys[batch]))).result(30)
        assert result.failed == []
        position = batch.stop
        if rng.random() < 0.3:  # read back a random earlier block while the tiers churn
            i = int(rng.integers(0, position))
            out = np.zeros((1, LAYOUT.block_bytes), np.uint8)
            loaded = stack.load([keys[i]], buffer_storage(out, LAYOUT, writable=True), [0]).result(30)
            if loaded.hits:
                assert loaded.failed == [] and np.array_equal(out[0], data[i])
                reloaded += 1
    stack.wait_idle()

    gpu, host = stack.tiers
    assert gpu.stats.evicted > 0 and host.stats.evicted > 0, "the workload must force evictions"
    if placement == "write_back":
        assert gpu.stats.demoted > 0, "write-back must demote"
    assert gpu.usage().used <= 0.9 * gpu.capacity and host.usage().used <= 0.95 * host.capacity

    present = [i for i in range(NUM_BLOCKS) if stack.lookup([keys[i]]).hits]
    assert len(present) >= host.usage().used, "every block in the host tier is findable"
    out = np.zeros((len(present), LAYOUT.block_bytes), np.uint8)
    for start in range(0, len(present), 256):
        chunk = present[start : start + 256]
        loaded = stack.load(
            [keys[i] for i in chunk], buffer_storage(out[start : start + 256], LAYOUT, writable=True), range(len(chunk))
        ).result(30)
        assert (loaded.hits, loaded.loaded, loaded.failed) == (len(chunk), len(chunk), [])
    wrong = [i for j, i in enumerate(present) if not np.array_equal(out[j], data[i])]
    assert wrong == [], f"{len(wrong)} present blocks came back wrong"
    assert reloaded > 0
    assert_no_leaks(stack)
    stack.close()
