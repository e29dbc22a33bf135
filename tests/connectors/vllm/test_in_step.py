"""Hits host memory holds whole, loaded in the step that computes the rest of the prompt
(``host_hits: in_step``): where vLLM's KV cache is in CPU memory, their copies run on vLLM's own thread
in ``start_load_kv`` (``CopiesHere``), so they have arrived before the forward pass with no hand-off to
a copy thread of kvtier's; asynchronous loads still run on those threads."""

from __future__ import annotations

import threading

import pytest

from helpers.vllm_helpers import assert_loads_back, prompt
from kvtier.transfers.cpu import CPUBackend

HOST_ONLY = {"tiers": [{"medium": "host", "capacity_blocks": 32}]}


@pytest.mark.parametrize("host_hits", ["in_step", "async"])
def test_in_step_copies_run_on_the_thread_that_starts_the_load(make_engine, monkeypatch, host_hits):
    threads: list[str] = []
    copy = CPUBackend._copy

    def recorded(self, copies, lo, hi):  # the real copy, noting which thread runs it
        threads.append(threading.current_thread().name)
        copy(self, copies, lo, hi)

    monkeypatch.setattr(CPUBackend, "_copy", recorded)
    engine = make_engine(HOST_ONLY, extra={"host_hits": host_hits})
    engine.run([engine.add(prompt(4, 5, seed=1), max_tokens=2)])
    engine.assert_no_leaks()
    threads.clear()
    assert_loads_back(engine, prompt(4, 9, seed=2), computed=9, blocks=4)  # its tail never fills a block
    assert threads
    if host_hits == "in_step":
        assert set(threads) == {threading.current_thread().name}
    else:
        assert all(name.startswith("kvtier-copy") for name in threads)
