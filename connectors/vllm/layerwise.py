"""In-step loads layer by layer: vLLM's forward pass starts on a layer as soon as that layer's blocks arrived.

A hit loaded in step (``host_hits: in_step``) is read by the forward pass of the step that loads it.
Waiting for the whole load in ``start_load_kv`` is always right; waiting per layer in
``wait_for_layer_load`` overlaps the copies of later layers with the compute of earlier ones, but it
is right only if vLLM calls that hook for every layer before computing it (attention backends and
graph modes differ). The worker learns that from the engine itself: until the engine has called the
hook for every layer of the served group in a step with an in-step load, such loads are waited for
whole; after that they are copied and waited for layer by layer. A later step in which the engine
skips a layer sends every later load back to whole waits, with an error logged (that step's forward
pass may have read a layer before it arrived).

Only where vLLM's KV cache is in CPU memory (its CPU engine, where this was measured). On a GPU vLLM
may replay a batch's attention inside a full CUDA graph, where no hook runs: a request whose tail is
one token looks like a decode and can join such a batch. Until a GPU session has checked which
batches call the hook, in-step loads on a GPU are waited for whole (there the copies are ordered on
streams and the wait is for their completion, not a CPU copy).
"""

from __future__ import annotations

import logging
import threading

from kvtier.core.errors import ClosedError, TransferError
from kvtier.core.storage import StridedStorage
from kvtier.core.transfer import OnComplete, Transfer, TransferRegistry

log = logging.getLogger(__name__)


class LayerwiseLoads:
    """One rank's layer-by-layer loads: whether they are on, and this step's layers still arriving."""

    def __init__(self, layers: dict[str, int], timeout: float) -> None:
        """``layers``: each layer of the served group and its fragment of a kvtier block."""
        self.layers = layers
        self.timeout = timeout
        self.on = False  # the engine has called wait_for_layer_load for every layer of an in-step load's step
        self._loading = False  # this step has in-step loads
        self._arrivals: dict[str, list[threading.Event]] = {}
        self._waited: set[str] = set()

    def begin_step(self, loading: bool) -> None:
        self._loading = loading
        self._arrivals = {}
        self._waited = set()

    def arrival(self, layer: str) -> threading.Event:
        """A new event for one load's copy of ``layer`` in this step, which ``wait`` waits for."""
        event = threading.Event()
        self._arrivals.setdefault(layer, []).append(event)
        return event

    def split(self, transfers: TransferRegistry) -> _LayerSplit:
        """A stand-in for ``transfers`` that sends each transfer as one copy per layer, each layer's
        arrival an event ``wait`` waits for."""
        return _LayerSplit(transfers, self)

    def wait(self, layer: str) -> None:
        """vLLM's ``wait_for_layer_load``: wait until this step's loads of the layer have arrived."""
        self._waited.add(layer)
        for arrived in self._arrivals.get(layer, ()):
            if not arrived.wait(self.timeout):
                raise TransferError(f"kvtier: layer {layer!r} of an in-step load did not arrive in {self.timeout} s")

    def end_step(self) -> None:
        """After the forward pass: whether the engine waited for every layer decides the next loads."""
        if not self._loading:
            return
        skipped = sorted(set(self.layers) - self._waited)
        if not skipped and not self.on:
            self.on = True
            log.info("kvtier: vLLM waits for every layer's load: in-step loads now go layer by layer")
        elif skipped and self.on:
            self.on = False
            log.error("kvtier: vLLM computed layers %s without waiting for their loads (in-step, layer by layer); "
                      "later in-step loads are waited for whole before the forward pass", skipped[:4])


class _LayerSplit:
    """Submits a transfer as one transfer per layer (what a ``StagedRun`` asks of its registry) and
    reports it whole once every layer's copy completed."""

    def __init__(self, transfers: TransferRegistry, loads: LayerwiseLoads) -> None:
        self._transfers = transfers
        self._loads = loads

    def submit(self, transfer: Transfer, on_complete: OnComplete) -> None:
        layers = self._loads.layers
        failed: set[int] = set()
        pending = [len(layers)]
        lock = threading.Lock()

        def arrived(event: threading.Event, lost: set[int], quarantine=None) -> None:
            with lock:
                failed.update(lost)
                pending[0] -= 1
                last = pending[0] == 0
            event.set()
            if last:
                on_complete(failed)

        everything = set(range(transfer.num_blocks))
        src, dst = transfer.src, transfer.dst
        for name, fragment in layers.items():
            event = self._loads.arrival(name)
            try:
                if not (isinstance(src, StridedStorage) and isinstance(dst, StridedStorage)):
                    raise TransferError("only strided storages split into layers")  # (the worker checks at start)
                part = Transfer(src.fragments([fragment]), transfer.src_slots, dst.fragments([fragment]),
                                transfer.dst_slots, transfer.keys)
                self._transfers.submit(part, lambda lost, quarantine=None, event=event: arrived(event, lost))
            except (TransferError, ClosedError):  # this layer cannot be copied: all its blocks failed
                arrived(event, everything)
