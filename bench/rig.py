"""What the transfer benchmarks share: one transfer run to its end and timed (``run_transfer``).

The benchmarks run as scripts (``python bench/disk.py``), so this module is found beside them.
"""

from __future__ import annotations

import threading
import time

from kvtier.core.transfer import Transfer, TransferBackend


class TransferFailed(RuntimeError):
    """A benchmark's transfer did not end, or ended with blocks failed: its figures would mean nothing."""


def run_transfer(backend: TransferBackend, transfer: Transfer, timeout: float = 120.0) -> float:
    """Seconds from submit until ``on_complete`` has run; raises TransferFailed if any block failed or
    the transfer did not complete within ``timeout`` seconds."""
    done = threading.Event()
    result: dict[str, set[int]] = {}

    def on_complete(failed: set[int]) -> None:
        result["failed"] = failed
        done.set()

    start = time.perf_counter()
    backend.submit(transfer, on_complete)
    if not done.wait(timeout):
        raise TransferFailed(f"a transfer of {transfer.num_blocks} blocks did not complete in {timeout} s")
    elapsed = time.perf_counter() - start
    if result["failed"]:
        raise TransferFailed(
            f"{len(result['failed'])} of {transfer.num_blocks} blocks failed (first: {min(result['failed'])})"
        )
    return elapsed
