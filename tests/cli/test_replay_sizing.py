"""`kvtier replay` sizing: what each capacity buys per second of trace, and what loading its hits costs.

Invariants checked:
- tokens saved per second = hits x block tokens / trace span, per tier and in all, for the run and for
  every policy and capacity of a sweep, with the hits taken from the run's own counts and the span from
  the trace file's timestamps (read here, independently of kvtier);
- a real stack measures each tier's load bandwidth, once over all the runs of a command; the net
  prefill seconds saved per second is recompute minus load time of the hits, per second of trace, and
  it turns negative (the table says NO, LOSES) when the prefill rate is set so high that recomputing a
  block is faster than loading it;
- with --metadata-only nothing is measured: the load side comes from --load-gbps (figures exact) or is
  left unknown, and the table says so;
- a trace whose timestamps span no time gets no per-second figures (null), and no sizing panel;
- the plot gets a sizing panel with a second axis for a sweep;
- bad --load-gbps and --prefill-tokens-per-s values exit 2 with one clear line.
"""

from __future__ import annotations

import json

import matplotlib.pyplot as plt
import pytest
from matplotlib.image import imread

from helpers.replay_helpers import write
from kvtier.cli import main
from kvtier.plot import replay_figure

CHAINS = [[1, 2], [1, 3], [4], [1, 2], [1, 3]]  # LRU, 3 blocks: one hit in requests 2, 4 and 5
TOKENS = 512  # --block-tokens, the default


def run_json(capsys, *argv) -> dict:
    assert main(["replay", *map(str, argv), "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def span_of(trace) -> float:
    """The trace's span in seconds, from its timestamps (milliseconds)."""
    stamps = [json.loads(line)["timestamp"] for line in trace.read_text().splitlines()]
    return (max(stamps) - min(stamps)) / 1000


def check_rates(figures: dict, span: float, hits: dict[str, int]) -> None:
    """Tokens per second from the hits and span, and the net from the per-block costs, for every tier."""
    recompute = TOKENS / figures["prefill_tokens_per_s"]
    assert figures["recompute_s_per_block"] == pytest.approx(recompute)
    for name, n in hits.items():
        t = figures["tiers"][name]
        assert t["hits"] == n and t["tokens_saved_per_s"] == pytest.approx(n * TOKENS / span)
        assert t["recompute_s_per_s"] == pytest.approx(n * recompute / span)
        if t["load_gbps"] is not None:
            assert t["load_s_per_block"] == pytest.approx(figures["block_bytes"] / (t["load_gbps"] * 1e9))
            assert t["net_s_saved_per_s"] == pytest.approx(n * (recompute - t["load_s_per_block"]) / span)
            assert t["pays"] == (t["load_s_per_block"] < recompute)
    total = figures["total"]
    assert total["hits"] == sum(hits.values())
    assert total["tokens_saved_per_s"] == pytest.approx(sum(hits.values()) * TOKENS / span)


@pytest.fixture
def two_tier_config(tmp_path):
    config = tmp_path / "stack.yaml"
    config.write_text(
        "block_bytes: 4096\ntiers:\n  - medium: host\n    capacity_blocks: 64\n    eviction: lru\n"
        f"  - medium: disk\n    path: {tmp_path / 'disk'}\n    capacity_blocks: 64\n"
    )
    return config


def test_real_stack_sweep(tmp_path, capsys, two_tier_config):
    trace, png = tmp_path / "chat.jsonl", tmp_path / "sizing.png"
    argv = ["--conversations", 6, "--config", two_tier_config, "--policy", "lru", "--sweep", "8,64"]
    s = run_json(capsys, *argv, "--save-trace", trace, "--plot", png)
    span = span_of(trace)
    assert span > 0 and s["sizing"]["trace_seconds"] == pytest.approx(span)
    check_rates(s["sizing"], span, {name: t["hits"] for name, t in s["tiers"].items()})
    assert s["sizing"]["total"]["hits"] == s["hits"]
    # Most requests open with a system prompt the host tier holds: it serves loads alone, and is timed.
    assert s["sizing"]["tiers"]["host"]["load_gbps_from"] == "measured"
    assert s["sizing"]["block_bytes"] == 4096 and s["sizing"]["prefill_tokens_per_s"] == 10_000
    assert set(s["sizing_sweep"]) == {"lru"} and set(s["sizing_sweep"]["lru"]) == {"8", "64"}
    for capacity, figures in s["sizing_sweep"]["lru"].items():
        hits = round(s["sweep"]["lru"][capacity] * s["references"])  # the same requests in every run
        assert figures["total"]["hits"] == hits
        check_rates(figures, span, {name: t["hits"] for name, t in figures["tiers"].items()})
        # One bandwidth per tier, measured over all the command's runs: capacities differ in hits only.
        assert figures["tiers"]["host"]["load_gbps"] == s["sizing"]["tiers"]["host"]["load_gbps"]
    # Three panels (hit ratio, sizing, occupancy), 7 inches each at 110 dpi.
    assert imread(png).shape[1] == 3 * 7 * 110


def test_net_changes_sign_with_the_prefill_rate(tmp_path, capsys):
    # One host tier: every load reads that tier alone, so its bandwidth is always measured. At 1 token/s
    # a block takes 512 s to recompute, longer than any load may take (the replay's 120 s timeout); at
    # 1e18 tokens/s it takes 0.5 femtoseconds, less than any timed load.
    config = tmp_path / "host.yaml"
    config.write_text("block_bytes: 4096\ntiers:\n  - medium: host\n    capacity_blocks: 256\n")
    argv = ["--conversations", 4, "--config", config]
    slow = run_json(capsys, *argv, "--prefill-tokens-per-s", 1)["sizing"]
    fast = run_json(capsys, *argv, "--prefill-tokens-per-s", 1e18)["sizing"]
    assert slow["tiers"]["host"]["hits"] == fast["tiers"]["host"]["hits"] > 0
    assert slow["tiers"]["host"]["pays"] is True and slow["total"]["net_s_saved_per_s"] > 0
    assert fast["tiers"]["host"]["pays"] is False and fast["total"]["net_s_saved_per_s"] < 0
    assert main(["replay", *map(str, argv), "--prefill-tokens-per-s", "1e18"]) == 0
    out = capsys.readouterr().out
    assert "NO: recompute" in out and "LOSES" in out


def test_metadata_only_with_a_given_bandwidth_is_exact(tmp_path, capsys):
    # 3 hits over 4 ms of trace (timestamps 0..4 ms); a 4 KiB block at 0.004096 GB/s loads in 1 ms.
    # At 256,000 tokens/s a 512-token block recomputes in 2 ms: each hit saves 1 ms, 0.75 s per second.
    # At 1,024,000 tokens/s it recomputes in 0.5 ms: each hit loses 0.5 ms, -0.375 s per second.
    trace = write(tmp_path / "t.jsonl", CHAINS)
    argv = [trace, "--metadata-only", "--policy", "lru", "--capacity", 3, "--block-bytes", "4KiB"]
    slower = run_json(capsys, *argv, "--load-gbps", "cache=0.004096", "--prefill-tokens-per-s", 256_000)
    assert slower["hits"] == 3
    cache = slower["sizing"]["tiers"]["cache"]
    assert (cache["load_gbps_from"], cache["load_s_per_block"], cache["pays"]) == ("given", pytest.approx(1e-3), True)
    assert cache["tokens_saved_per_s"] == pytest.approx(3 * 512 / 0.004)
    assert slower["sizing"]["total"]["net_s_saved_per_s"] == pytest.approx(0.75)
    faster = run_json(capsys, *argv, "--load-gbps", "cache=0.004096", "--prefill-tokens-per-s", 1_024_000)
    assert faster["sizing"]["tiers"]["cache"]["pays"] is False
    assert faster["sizing"]["total"]["net_s_saved_per_s"] == pytest.approx(-0.375)
    # Without --load-gbps, only the recompute side: 3 blocks of 2 ms in 4 ms.
    unknown = run_json(capsys, *argv, "--prefill-tokens-per-s", 256_000)["sizing"]
    cache = unknown["tiers"]["cache"]
    assert (cache["load_gbps"], cache["pays"], cache["net_s_saved_per_s"]) == (None, None, None)
    assert cache["recompute_s_per_s"] == pytest.approx(1.5)
    assert main(["replay", *map(str, argv)]) == 0
    assert "unmeasured" in capsys.readouterr().out


def test_metadata_sweep_has_sizing_for_every_policy_and_capacity(tmp_path, capsys):
    trace = write(tmp_path / "t.jsonl", CHAINS)
    s = run_json(capsys, trace, "--metadata-only", "--policy", "lru,s3fifo", "--sweep", "1,3", "--load-gbps", "cache=1")
    assert set(s["sizing_sweep"]) == {"lru", "s3fifo"}
    for policy, by_capacity in s["sizing_sweep"].items():
        assert set(by_capacity) == {"1", "3"}
        for capacity, figures in by_capacity.items():
            hits = round(s["sweep"][policy][capacity] * s["references"])
            check_rates(figures, span_of(trace), {"cache": hits})
            assert figures["total"]["net_s_saved_per_s"] is not None
    fig = replay_figure(s, [])
    try:
        hits_panel, sizing_panel, occupancy_panel, net_axis = fig.axes  # the net's axis is the sizing panel's twin
        assert sizing_panel.get_title() == "what each capacity buys"
        assert "net prefill s saved per s" in net_axis.get_ylabel()
        assert len(sizing_panel.lines) == 2 and len(net_axis.lines) == 2 + 1  # a line per policy, and zero
    finally:
        plt.close(fig)


def test_a_trace_without_timestamps_has_no_rates(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"hash_ids": c}) + "\n" for c in CHAINS))
    s = run_json(capsys, trace, "--metadata-only", "--capacity", 3, "--sweep", "1,3", "--load-gbps", "cache=1")
    figures = s["sizing"]
    assert figures["trace_seconds"] == 0 and figures["tiers"]["cache"]["pays"] is True
    assert figures["tiers"]["cache"]["tokens_saved_per_s"] is None and figures["total"]["net_s_saved_per_s"] is None
    fig = replay_figure(s, [])
    try:
        assert len(fig.axes) == 2  # hit ratio and occupancy: no rates to draw
    finally:
        plt.close(fig)
    assert main(["replay", str(trace), "--metadata-only", "--capacity", "3"]) == 0
    assert "span no time" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--load-gbps", "disk"], "give TIER=GBPS pairs"),
        (["--load-gbps", ","], "give TIER=GBPS pairs"),
        (["--load-gbps", "ssd=1"], "no tier 'ssd' in this run; its tiers: gpu, host, disk"),
        (["--load-gbps", "host=1", "--metadata-only"], "no tier 'host' in this run; its tiers: cache"),
        (["--load-gbps", "host=1,host=2"], "tier 'host' is given twice"),
        (["--load-gbps", "disk=0"], "must be a positive number of GB/s"),
        (["--load-gbps", "disk=-1"], "must be a positive number of GB/s"),
        (["--load-gbps", "disk=nan"], "must be a positive number of GB/s"),
        (["--load-gbps", "disk=fast"], "must be a positive number of GB/s"),
        (["--prefill-tokens-per-s", "0"], "--prefill-tokens-per-s must be a positive number"),
        (["--prefill-tokens-per-s", "-5"], "--prefill-tokens-per-s must be a positive number"),
        (["--prefill-tokens-per-s", "inf"], "--prefill-tokens-per-s must be a positive number"),
    ],
)
def test_bad_sizing_input_exits_2_with_one_line(capsys, argv, message):
    assert main(["replay", "--conversations", "2", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier replay: ") and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_a_given_bandwidth_needs_a_block_size(tmp_path, capsys):
    config = tmp_path / "no-block-bytes.yaml"
    config.write_text("tiers:\n  - medium: host\n    capacity_blocks: 8\n")
    argv = ["replay", "--conversations", "2", "--config", str(config), "--metadata-only", "--load-gbps", "cache=1"]
    assert main(argv) == 2
    assert "--load-gbps needs the size of a block: give --block-bytes" in capsys.readouterr().err
    s = run_json(capsys, *argv[1:-2], "--block-bytes", "4KiB", "--load-gbps", "cache=1")
    assert s["sizing"]["block_bytes"] == 4096 and s["sizing"]["tiers"]["cache"]["load_s_per_block"] > 0
    unsized = run_json(capsys, *argv[1:-2])["sizing"]  # no bytes, no load side; the recompute side stays
    assert unsized["block_bytes"] is None and unsized["tiers"]["cache"]["load_s_per_block"] is None
    assert unsized["tiers"]["cache"]["recompute_s_per_s"] > 0
