"""kvtier as the storage backend (L3) of a real SGLang 0.5.23 server on CPU, loaded by SGLang's ``dynamic`` backend.

What it shows, each on real servers: a prompt SGLang stored comes back from kvtier's disk tier after
``/flush_cache`` with the same greedy tokens, and kvtier's counters on SGLang's ``/metrics`` say so; a server
started again on the same disk finds it (SGLang's own restart loses its host cache); a second server sharing a
remote tier (a real redis-server, a real Mooncake Store), or one machine's node daemon, gets from it a prompt only
the first server saw; bytes damaged in the storage between two runs never change the tokens under kvtier (damaged
pages are misses, recomputed), where SGLang's own ``file`` backend, put through the same steps, loads them and
answers other tokens (both outcomes are written to the test's report); a kvtier configuration with a mistake stops
SGLang at start with kvtier's one-line error naming the key.
"""

from __future__ import annotations

import random
import urllib.request
from pathlib import Path

import pytest

from helpers.mooncake_server import MooncakeMaster, SegmentOwner
from helpers.node_daemon import node_daemon
from helpers.redis_server import redis_server
from sglang_server.harness import PAGE_SIZE, VOCAB_SIZE, ServerFailed, flush_cache, generate, wait_until

PROMPT_TOKENS = 64
NEW_TOKENS = 8
REUSABLE = (PROMPT_TOKENS - 1) // PAGE_SIZE * PAGE_SIZE
"""Prompt tokens SGLang takes from a cache: all but the last, in whole pages (60 of 64)."""
PAGES = PROMPT_TOKENS // PAGE_SIZE
STORED_WITHIN_S = 60.0


def prompt_ids(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(PROMPT_TOKENS)]


def kvtier_extra(config: dict) -> dict:
    """The extra config that loads kvtier with ``config`` inline (prefetch from storage for any miss of a page)."""
    return {
        "backend_name": "kvtier",
        "module_path": "kvtier.connectors.sglang.backend",
        "class_name": "KVTierStorage",
        "interface_v1": 1,
        "prefetch_threshold": PAGE_SIZE,
        "config": config,
    }


def disk_config(path: Path) -> dict:
    return {"tiers": [{"medium": "disk", "path": str(path), "capacity": "64MiB"}]}


def disk_blocks(path: Path) -> int:
    """Pages kvtier's disk tier holds (rank 0's slab, read without its lock while the server runs)."""
    from kvtier.tiers.disk.files import DiskTierError
    from kvtier.tiers.disk.inspect import inspect_slab

    try:
        return inspect_slab(path / "rank0")["blocks"]
    except DiskTierError:
        return 0


def kvtier_counters(url: str) -> dict[str, float]:
    """kvtier's samples on SGLang's ``/metrics`` (``--enable-metrics``), by name and labels."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        lines = response.read().decode().splitlines()
    return {
        name: float(value)
        for name, _, value in (line.rpartition(" ") for line in lines)
        if name.startswith("sglang:kvtier_")
    }


def damage_pages(files: list[tuple[Path, int, int]]) -> None:
    """Overwrite each (file, offset, size) run with 0x7F bytes: KV values of about 3e38, which no model survives."""
    for path, offset, size in files:
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(b"\x7f" * size)


def test_a_flushed_prompt_comes_back_from_kvtiers_disk_also_after_a_restart_and_never_damaged(
    make_server, tmp_path, record_property
):
    disk = tmp_path / "kv"
    prompt = prompt_ids(1)
    server = make_server(storage="dynamic", extra_config=kvtier_extra(disk_config(disk)), args=("--enable-metrics",))
    first = generate(server.url, prompt, NEW_TOKENS)
    assert first.cached() == {"device": 0, "host": 0, "storage": 0}
    wait_until(lambda: disk_blocks(disk) >= PAGES, STORED_WITHIN_S, f"{PAGES} pages on kvtier's disk")
    flush_cache(server.url)
    again = generate(server.url, prompt, NEW_TOKENS)
    assert again.cached() == {"device": 0, "host": 0, "storage": REUSABLE}
    assert again.ids == first.ids
    counters = kvtier_counters(server.url)  # made in SGLang's scheduler process, served by its /metrics
    assert counters['sglang:kvtier_hit_blocks_total{tier="disk",tp_rank="0"}'] == REUSABLE // PAGE_SIZE
    assert counters['sglang:kvtier_stored_blocks_total{tp_rank="0"}'] >= PAGES
    assert counters['sglang:kvtier_failed_load_blocks_total{tp_rank="0"}'] == 0
    server.stop()

    restarted = make_server(storage="dynamic", extra_config=kvtier_extra(disk_config(disk)))
    after_restart = generate(restarted.url, prompt, NEW_TOKENS)
    assert after_restart.cached() == {"device": 0, "host": 0, "storage": REUSABLE}
    assert after_restart.ids == first.ids
    restarted.stop()

    from kvtier.tiers.disk.inspect import inspect_slab

    slab = inspect_slab(disk / "rank0")
    stride, used = slab["slot_stride"], slab["blocks"]
    damage_pages([(Path(slab["path"]), 4096 + slot * stride + 4096, stride - 4096) for slot in range(used)])
    damaged = make_server(storage="dynamic", extra_config=kvtier_extra(disk_config(disk)))
    recomputed = generate(damaged.url, prompt, NEW_TOKENS)
    record_property("kvtier_tokens", {"stored": first.ids, "damaged": recomputed.ids, **recomputed.cached()})
    assert recomputed.cached()["storage"] == 0
    assert recomputed.ids == first.ids


def test_sglangs_file_backend_serves_damaged_bytes(make_server, tmp_path, record_property):
    """The control of the damage step above: SGLang's own ``file`` backend loads the same damage and answers other
    tokens. Nothing of kvtier runs here."""
    store = tmp_path / "store"
    extra = {"file_storage_path": str(store), "prefetch_threshold": PAGE_SIZE}
    prompt = prompt_ids(1)
    server = make_server(storage="file", extra_config=extra)
    first = generate(server.url, prompt, NEW_TOKENS)
    wait_until(lambda: len(list(store.glob("*.bin"))) >= PAGES, STORED_WITHIN_S, f"{PAGES} page files")
    server.stop()
    damage_pages([(path, 0, path.stat().st_size) for path in store.glob("*.bin")])
    damaged = make_server(storage="file", extra_config=extra)
    loaded = generate(damaged.url, prompt, NEW_TOKENS)
    record_property("file_backend_tokens", {"stored": first.ids, "damaged": loaded.ids, **loaded.cached()})
    assert loaded.cached()["storage"] == REUSABLE  # it served every damaged page
    assert loaded.ids != first.ids


def redis_keys(server) -> int:
    return server.client().dbsize()


def mooncake_keys(master: MooncakeMaster) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{master.metrics_port}/metrics", timeout=5) as response:
        lines = response.read().decode().splitlines()
    return int(float(next(line.split()[1] for line in lines if line.startswith("master_key_count "))))


@pytest.mark.parametrize("store", ["redis", "mooncake"])
def test_a_second_server_gets_from_the_shared_store_a_prompt_only_the_first_saw(make_server, tmp_path, store):
    with redis_server(tmp_path / "redis") if store == "redis" else MooncakeMaster() as server:
        if store == "redis":
            settings, count = {"url": server.url}, lambda: redis_keys(server)
            owner = None
        else:
            settings, count = (
                {"master": server.address, "metadata_server": server.metadata_url},
                lambda: mooncake_keys(server),
            )
            owner = SegmentOwner(server, "128MB").__enter__()
        try:
            config = {
                "tiers": [
                    {"medium": "host", "capacity": "16MiB"},
                    {"medium": "remote", "backend": store, "timeout": 2.0, store: settings},
                ]
            }
            first = make_server(storage="dynamic", extra_config=kvtier_extra(config), name="first")
            second = make_server(storage="dynamic", extra_config=kvtier_extra(config), name="second")
            prompt = prompt_ids(2)
            reference = generate(first.url, prompt, NEW_TOKENS)
            wait_until(lambda: count() >= PAGES, STORED_WITHIN_S, f"{PAGES} records in the {store} store")
            shared = generate(second.url, prompt, NEW_TOKENS)
            assert shared.cached() == {"device": 0, "host": 0, "storage": REUSABLE}
            assert shared.ids == reference.ids
        finally:
            if owner is not None:
                owner.__exit__(None, None, None)


def test_a_second_server_gets_from_the_node_daemon_a_prompt_only_the_first_saw(make_server, tmp_path):
    """Two servers on one machine, one node daemon (a real one): the second's prompt comes from the slab
    the first one's pages went into, with the same greedy tokens, and the daemon holds one copy of them."""
    with node_daemon(tmp_path / "node", capacity="64MiB", block_bytes="256KiB") as daemon:
        config = {"tiers": [daemon.tier()]}
        first = make_server(storage="dynamic", extra_config=kvtier_extra(config), name="first")
        second = make_server(storage="dynamic", extra_config=kvtier_extra(config), name="second")
        prompt = prompt_ids(3)
        reference = generate(first.url, prompt, NEW_TOKENS)
        wait_until(lambda: daemon.stats()["stores"] >= PAGES, STORED_WITHIN_S, f"{PAGES} pages at the node daemon")
        shared = generate(second.url, prompt, NEW_TOKENS)
        assert shared.cached() == {"device": 0, "host": 0, "storage": REUSABLE}
        assert shared.ids == reference.ids
        assert daemon.stats()["stores"] < 2 * PAGES  # the prompt's pages are held once


@pytest.mark.parametrize(
    ("config", "line"),
    [
        (
            {"tiers": [{"medium": "disk", "path": "/tmp/kvtier-never", "capacity": "lots"}]},
            "tiers[0].capacity: 'lots' is not a size",
        ),
        ({"tiers": [{"medium": "gpu"}]}, "tiers[0].medium: gpu: SGLang keeps GPU KV itself"),
    ],
)
def test_a_configuration_mistake_stops_sglang_at_start_with_kvtiers_line(make_server, config, line, record_property):
    with pytest.raises(ServerFailed) as failed:
        make_server(storage="dynamic", extra_config=kvtier_extra(config))
    errors = [text for text in failed.value.log_tail.splitlines() if "ConfigError" in text and line in text]
    assert errors, failed.value.log_tail
    record_property("sglang_log_line", errors[-1])
