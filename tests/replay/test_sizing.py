"""Sizing arithmetic (kvtier.replay.sizing), figures worked out by hand.

Invariants checked:
- the trace's span is its last timestamp minus its first, in seconds (timestamps are milliseconds);
- per tier: tokens saved/s = hits x block tokens / span; recompute, load and net seconds per second
  from the prefill rate and the bandwidth; ``pays`` is whether a block loads faster than it recomputes;
- a given bandwidth replaces a measured one and says so; a tier without hits loads nothing whatever
  its bandwidth; a tier with hits and no bandwidth leaves its net and the total's unknown (None);
- a trace that spans no time leaves every per-second figure unknown;
- load times pool per tier across runs: bandwidth = all bytes / all seconds.
"""

from __future__ import annotations

import pytest

from kvtier.replay.sizing import Assumptions, LoadTimes, sizing, trace_seconds
from kvtier.replay.trace import Request


def test_trace_seconds():
    stamps = [2_000, 500, 4_500.5]  # out of order: the span is from the earliest to the latest
    assert trace_seconds([Request(t, 0, 0, ()) for t in stamps]) == pytest.approx(4.0005)
    assert trace_seconds([]) == 0.0 and trace_seconds([Request(7, 0, 0, (1,))]) == 0.0


def test_figures_by_hand():
    # 10 s of trace, 100-token blocks of 1 MB, 1,000 prefill tokens/s: recomputing a block takes
    # 0.1 s. host measured at 100 GB/s (a block loads in 10 us: pays), disk given at 0.005 GB/s
    # (0.2 s a block: does not pay; its measured 50 GB/s is ignored).
    assumed = Assumptions(prefill_tokens_per_s=1_000, trace_seconds=10.0, load_gbps={"disk": 0.005})
    figures = sizing({"host": 30, "disk": 20}, 100, 10**6, {"host": 100.0, "disk": 50.0}, assumed)
    host, disk, total = figures["tiers"]["host"], figures["tiers"]["disk"], figures["total"]
    assert figures["recompute_s_per_block"] == pytest.approx(0.1)
    assert (host["load_gbps"], host["load_gbps_from"], host["pays"]) == (100.0, "measured", True)
    assert (disk["load_gbps"], disk["load_gbps_from"], disk["pays"]) == (0.005, "given", False)
    assert host["load_s_per_block"] == pytest.approx(1e-5) and disk["load_s_per_block"] == pytest.approx(0.2)
    assert host["tokens_saved_per_s"] == pytest.approx(300) and disk["tokens_saved_per_s"] == pytest.approx(200)
    assert host["recompute_s_per_s"] == pytest.approx(0.3) and disk["recompute_s_per_s"] == pytest.approx(0.2)
    assert host["load_s_per_s"] == pytest.approx(3e-5) and disk["load_s_per_s"] == pytest.approx(0.4)
    assert host["net_s_saved_per_s"] == pytest.approx(0.3 - 3e-5)
    assert disk["net_s_saved_per_s"] == pytest.approx(-0.2)
    assert total["hits"] == 50 and total["tokens_saved_per_s"] == pytest.approx(500)
    assert total["net_s_saved_per_s"] == pytest.approx(0.1 - 3e-5)


def test_unknown_bandwidth():
    assumed = Assumptions(prefill_tokens_per_s=1_000, trace_seconds=10.0)
    idle = sizing({"host": 30, "disk": 0}, 100, 10**6, {"host": 100.0}, assumed)
    disk = idle["tiers"]["disk"]
    assert (disk["load_gbps"], disk["load_s_per_block"], disk["pays"]) == (None, None, None)
    assert disk["load_s_per_s"] == 0.0 and disk["net_s_saved_per_s"] == 0.0  # no hits: nothing to load
    assert idle["total"]["net_s_saved_per_s"] == pytest.approx(idle["tiers"]["host"]["net_s_saved_per_s"])
    unmeasured = sizing({"host": 30, "disk": 5}, 100, 10**6, {"host": 100.0}, assumed)
    disk, total = unmeasured["tiers"]["disk"], unmeasured["total"]
    assert disk["recompute_s_per_s"] == pytest.approx(0.05) and disk["tokens_saved_per_s"] == pytest.approx(50)
    assert (disk["load_s_per_s"], disk["net_s_saved_per_s"]) == (None, None)
    assert (total["load_s_per_s"], total["net_s_saved_per_s"]) == (None, None)
    assert total["recompute_s_per_s"] == pytest.approx(0.35)


def test_a_trace_without_a_span():
    figures = sizing({"cache": 4}, 512, 4096, {"cache": 1.0}, Assumptions(10_000, trace_seconds=0.0))
    cache = figures["tiers"]["cache"]
    assert cache["hits"] == 4 and cache["pays"] is True and figures["recompute_s_per_block"] == pytest.approx(0.0512)
    for key in ("tokens_saved_per_s", "recompute_s_per_s", "load_s_per_s", "net_s_saved_per_s"):
        assert cache[key] is None and figures["total"][key] is None


def test_load_times_pool_across_runs():
    pooled, run = LoadTimes(), LoadTimes()
    pooled.add("host", 3 * 10**9, 1.0)
    run.add("host", 10**9, 1.0)
    run.add("disk", 10**9, 4.0)
    pooled.merge(run)
    assert pooled.gbps() == {"host": pytest.approx(2.0), "disk": pytest.approx(0.25)}
    assert LoadTimes().gbps() == {}
