"""Hits host memory holds whole, loaded in the step that computes the rest of the prompt
(``host_hits: in_step``): the worker waits for them before the forward pass, and, once vLLM has shown
it calls ``wait_for_layer_load`` for every layer, copies them layer by layer and waits per layer
(that a layer's wait holds until its copies arrived: ``test_worker.py``)."""

from __future__ import annotations

import logging

from helpers.vllm_harness import LAYERS
from helpers.vllm_helpers import assert_loads_back, prompt

HOST_ONLY = {"tiers": [{"medium": "host", "capacity_blocks": 32}]}


def layerwise(engine, rank: int = 0):
    return engine.workers[rank].connector.worker_side.layerwise


def test_loads_go_layer_by_layer_once_vllm_waited_for_every_layer(make_engine, caplog):
    engine = make_engine(HOST_ONLY)
    for p in (1, 2):
        engine.run([engine.add(prompt(4, 5, seed=p, prefix=p), max_tokens=2)])
    assert not layerwise(engine).on  # no in-step load yet: nothing learned
    with caplog.at_level(logging.INFO, logger="kvtier.connectors.vllm.layerwise"):
        assert_loads_back(engine, prompt(4, 9, seed=3, prefix=1), computed=9, blocks=4)  # waited for whole
    assert layerwise(engine).on and "layer by layer" in caplog.text
    assert_loads_back(engine, prompt(4, 9, seed=4, prefix=2), computed=9, blocks=4)  # layer by layer


def test_an_engine_that_skips_a_layer_gets_whole_waits(make_engine, caplog):
    engine = make_engine(HOST_ONLY)
    engine.run([engine.add(prompt(4, 5, seed=1), max_tokens=2)])
    engine.workers[0].skip_layer_waits = {LAYERS[1]}
    assert_loads_back(engine, prompt(4, 9, seed=2), computed=9, blocks=4)
    assert not layerwise(engine).on  # never learned: every in-step load is waited for whole
    engine.workers[0].skip_layer_waits = set()
    assert_loads_back(engine, prompt(4, 9, seed=3), computed=9, blocks=4)
    assert layerwise(engine).on
    engine.workers[0].skip_layer_waits = {LAYERS[0]}
    with caplog.at_level(logging.ERROR, logger="kvtier.connectors.vllm.layerwise"):
        assert_loads_back(engine, prompt(4, 9, seed=4), computed=9, blocks=4)
    assert not layerwise(engine).on and "without waiting" in caplog.text
