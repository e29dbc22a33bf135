"""A server made to hang, for fault tests: SIGSTOP, and wait until it has taken effect.

``kill(pid, SIGSTOP)`` returns before the process stops: each of its threads stops when it next enters
the kernel or is next scheduled, so on a busy machine (tests in several processes on two cores) a thread
already running can still answer a request sent just after the signal, and a test of "calls against a
hung store fail" sees one answered. ``stop`` returns once every thread of the process is stopped.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

STOPPED_WITHIN_S = 10.0


def stop(pid: int) -> None:
    """SIGSTOP ``pid``; returns once every thread of it is stopped (state T)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + STOPPED_WITHIN_S
    while not all(_state(task) in ("T", "t", None) for task in Path(f"/proc/{pid}/task").iterdir()):
        assert time.monotonic() < deadline, f"process {pid} did not stop within {STOPPED_WITHIN_S} s of SIGSTOP"
        time.sleep(0.002)


def _state(task: Path) -> str | None:
    """A thread's state letter (None: it ended meanwhile)."""
    try:
        return (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None
