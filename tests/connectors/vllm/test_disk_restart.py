"""Disk blocks kept across a restart under vLLM's real scheduler: an engine fills host and disk and
shuts down (scheduler and worker sides); a new engine on the same directory finds the blocks every
rank's slab holds at the same slot and loads them with exact token counts and bit-exact KV. A block
one rank lacks (or whose header is damaged there) is not a hit; a block whose bytes are damaged is a
hit whose load fails and is recomputed; another namespace, layout or TP size finds nothing."""

from __future__ import annotations

import pytest

from helpers.vllm_helpers import (
    BLOCK,
    assert_loads_back,
    assert_recomputed_from,
    forget_gpu,
    held_by,
    prompt,
    scheduled_load,
    step_until_scheduled,
)
from kvtier.core.keys import chain_hashes
from kvtier.core.tier import BlockState
from kvtier.tiers.disk.slots import PAGE


def disk_config(path, placement: str = "write_through", namespace: str = "") -> dict:
    return {
        "placement": placement,
        "namespace": namespace,
        "tiers": [
            {"medium": "host", "capacity_blocks": 4},
            {"medium": "disk", "capacity_blocks": 16, "path": str(path)},
        ],
    }


def prefix_keys(engine, prefix: int) -> list[bytes]:
    return chain_hashes(prompt(4, 0, seed=0, prefix=prefix), BLOCK, engine.kvtier.request_namespace())


def on_disk(engine, keys: list[bytes]) -> list[bool]:
    return [engine.kvtier.tier("disk").state(k) is BlockState.READY for k in keys]


def slot_place(engine, key: bytes, rank: int) -> tuple:
    """(slab file path, file offset of the slot) where ``rank`` keeps ``key``."""
    slab = engine.workers[rank].connector.worker_side.storages["disk"].slab
    return slab.path, slab.slot_offset(engine.kvtier.tier("disk").slots([key])[0])


def overwrite(path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize("placement", ["write_through", "write_back"])
def test_disk_blocks_are_loaded_after_a_restart_bit_exact(make_engine, tmp_path, placement):
    config = disk_config(tmp_path / "disk", placement)
    before = make_engine(config)
    for p in (1, 2, 3):  # 4 blocks each through a 4-block host tier
        before.run([before.add(prompt(4, 5, seed=p, prefix=p), max_tokens=2)])
    # write-through puts every prefix on disk, write-back what was pushed out of the host tier
    kept = {p for p in (1, 2, 3) if on_disk(before, prefix_keys(before, p)) == [True] * 4}
    assert (kept == {1, 2, 3}) if placement == "write_through" else (1 in kept and 3 not in kept)
    assert before.kvtier.tier("disk").usage().used == 4 * len(kept)
    before.assert_no_leaks()
    before.shutdown()

    after = make_engine(config)
    assert after.kvtier.tier("disk").usage().used == 4 * len(kept) and after.kvtier.tier("host").usage().used == 0
    for p in (1, 2, 3):
        assert held_by(after, prefix_keys(after, p)) == ["disk" if p in kept else None] * 4
    forget_gpu(after)
    again = after.add(prompt(4, 11, seed=4, prefix=1), max_tokens=2)
    assert after.connector.get_num_new_matched_tokens(again, 0) == (4 * BLOCK, True)
    job = scheduled_load(after, again.request_id)
    assert job.num_blocks == 4 and job.missing == ()
    assert [c.src.tier for stage in job.stages for c in stage] == ["disk", "host"]
    out = step_until_scheduled(after, again)
    assert out.num_scheduled_tokens[again.request_id] == 11  # the tail only: 4 blocks came from disk
    assert after.blocks_match(again, range(4))
    after.run([again])
    assert sum(s["hit_blocks_disk"] for s in after.stats) == 4 and not after.load_errors
    stored = {
        h for e in after.events if type(e).__name__ == "BlockStored" and e.medium == "STORAGE" for h in e.block_hashes
    }
    assert set(prefix_keys(after, 1)) <= stored  # kept blocks are announced as the disk tier's
    last = after.add(prompt(4, 5, seed=5, prefix=3), max_tokens=2)  # its host copy died with the engine
    hits = 4 if 3 in kept else 0
    assert after.connector.get_num_new_matched_tokens(last, 0)[0] == hits * BLOCK
    out = step_until_scheduled(after, last)
    assert out.num_scheduled_tokens[last.request_id] == (4 - hits) * BLOCK + 5
    assert after.blocks_match(last, range(4))
    after.run([last])
    after.assert_no_leaks()


@pytest.mark.parametrize("damage", ["missing", "damaged header"])
def test_a_block_one_rank_lacks_is_not_kept(make_engine, tmp_path, damage):
    config = disk_config(tmp_path / "disk")
    before = make_engine(config, tp=2)
    before.run([before.add(prompt(4, 5, seed=1, prefix=1), max_tokens=2)])
    keys = prefix_keys(before, 1)
    path, offset = slot_place(before, keys[2], rank=1)
    before.shutdown()
    # rank 1 lost block 2's header (as a crash before the header write leaves it) or it is torn
    overwrite(path, offset, bytes(PAGE) if damage == "missing" else b"\xff" * 4)

    after = make_engine(config, tp=2)
    assert held_by(after, keys) == ["disk", "disk", None, "disk"]  # block 3 is whole on both ranks
    assert after.kvtier.tier("disk").usage().used == 3
    forget_gpu(after)
    again = after.add(prompt(4, 7, seed=2, prefix=1), max_tokens=2)
    assert after.connector.get_num_new_matched_tokens(again, 0) == (2 * BLOCK, True)
    out = step_until_scheduled(after, again)
    assert out.num_scheduled_tokens[again.request_id] == 2 * BLOCK + 7  # blocks 2 and 3 computed
    assert after.blocks_match(again, range(4)) and not after.load_errors
    after.run([again])
    assert on_disk(after, keys) == [True] * 4  # block 2 was stored anew (write-through)
    after.assert_no_leaks()
    after.shutdown()

    third = make_engine(config, tp=2)  # the recomputed block 2 is kept too now, on both ranks
    assert on_disk(third, keys) == [True] * 4 and third.kvtier.tier("disk").usage().used == 4
    assert_loads_back(third, prompt(4, 3, seed=3, prefix=1), computed=3, blocks=4)
    assert not third.load_errors


def test_a_kept_block_whose_bytes_are_damaged_is_recomputed(make_engine, tmp_path):
    """The header is intact, so the block is kept and counted as a hit; its load checks the bytes,
    fails, and vLLM is told to recompute exactly that block and the ones after it."""
    config = disk_config(tmp_path / "disk")
    before = make_engine(config)
    before.run([before.add(prompt(4, 5, seed=1, prefix=1), max_tokens=2)])
    keys = prefix_keys(before, 1)
    path, offset = slot_place(before, keys[2], rank=0)
    before.shutdown()
    overwrite(path, offset + PAGE + 100, b"\x00\xff" * 8)

    after = make_engine(config)
    assert held_by(after, keys) == ["disk"] * 4
    again = assert_recomputed_from(after, prompt(4, 7, seed=2, prefix=1), damaged=2, blocks=4, computed=2 * BLOCK + 7)
    after.run([again])
    assert sum(s["failed_load_blocks"] for s in after.stats) == 1
    assert after.kvtier.tier("disk").stats.read_errors == 1
    after.assert_no_leaks()


@pytest.mark.parametrize("change", ["namespace", "layout", "tp"])
def test_another_namespace_layout_or_tp_size_finds_nothing(make_engine, tmp_path, change):
    config = disk_config(tmp_path / "disk")
    before = make_engine(config, tp=2 if change == "tp" else 1)
    before.run([before.add(prompt(4, 5, seed=1, prefix=1), max_tokens=2)])
    assert before.kvtier.tier("disk").usage().used == 4
    before.shutdown()

    kwargs = {
        "namespace": {"config": disk_config(tmp_path / "disk", namespace="other")},
        "layout": {"layout": "BLHNC"},  # the same page size, other bytes per block id
        "tp": {},
    }[change]
    after = make_engine(kwargs.pop("config", config), **kwargs)
    assert after.kvtier.tier("disk").usage().used == 0
    forget_gpu(after)
    again = after.add(prompt(4, 7, seed=2, prefix=1), max_tokens=2)
    assert after.connector.get_num_new_matched_tokens(again, 0) == (0, False)
    out = step_until_scheduled(after, again)
    assert out.num_scheduled_tokens[again.request_id] == 4 * BLOCK + 7
    assert after.blocks_match(again, range(4))
    after.run([again])
    assert after.kvtier.tier("disk").usage().used == 4  # its own blocks, written over the foreign ones' slots
    after.assert_no_leaks()


def test_kept_blocks_are_evicted_oldest_first_when_the_disk_fills(make_engine, tmp_path):
    """The kept blocks enter the disk tier's policy in the order they were written: a full disk
    tier makes room by dropping the oldest prefix, not the newer one."""
    config = disk_config(tmp_path / "disk")
    config["tiers"][1]["capacity_blocks"] = 8
    before = make_engine(config)
    for p in (1, 2):
        before.run([before.add(prompt(4, 5, seed=p, prefix=p), max_tokens=2)])
    assert before.kvtier.tier("disk").usage().used == 8
    before.shutdown()

    after = make_engine(config)
    assert after.kvtier.tier("disk").usage().used == 8
    after.run([after.add(prompt(4, 5, seed=3, prefix=3), max_tokens=2)])  # written through: 4 disk slots
    assert [on_disk(after, prefix_keys(after, p)) for p in (1, 2, 3)] == [[False] * 4, [True] * 4, [True] * 4]
    removed = {
        h for e in after.events if type(e).__name__ == "BlockRemoved" and e.medium == "STORAGE" for h in e.block_hashes
    }
    assert removed == set(prefix_keys(after, 1))
    assert_loads_back(after, prompt(4, 7, seed=4, prefix=2), computed=7, blocks=4)
    after.shutdown()

    third = make_engine(config)  # prefix 3 took prefix 1's slots: their old headers were cleared first
    assert [on_disk(third, prefix_keys(third, p)) for p in (1, 2, 3)] == [[False] * 4, [True] * 4, [True] * 4]
    assert_loads_back(third, prompt(4, 7, seed=5, prefix=3), computed=7, blocks=4)
    assert not third.load_errors
