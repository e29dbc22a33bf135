"""A real node daemon for the node tier's tests: ``kvtier node serve`` as its own process, its socket in a
short temporary directory (a Unix socket path has at most 107 bytes), its slab in /dev/shm under a name
of its own; always gone, slab included, when the test is.

    with node_daemon(tmp_path, capacity="8MiB", block_bytes="64KiB", lease=2) as daemon:
        daemon.tier()                    # the engine side's tier config: {"medium": "node", "socket": ...}
        daemon.stats()                   # the daemon's counts (a STATS call of a connection of its own)
        daemon.pause(); daemon.resume()  # SIGSTOP / SIGCONT
        daemon.kill(); daemon.start()    # SIGKILL; a new daemon on the same socket and slab (a restart)
        daemon.stop()                    # SIGTERM, waited for
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from helpers import processes
from kvtier.tiers.node.client import NodeClient
from kvtier.tiers.node.protocol import Op

READY_WITHIN_S = 30.0


def daemon_config(
    socket: str,
    slab: str,
    settings: dict[str, Any],
    capacity: str,
    block_bytes: str,
    eviction: str | None,
    below: list[dict[str, Any]] | None,
) -> dict[str, Any]:
    """A daemon's YAML document: listening at ``socket``, its slab at ``slab`` (``settings`` go to its
    ``node`` section), a host slab of ``capacity`` evicting by ``eviction`` (None: the default), then ``below``."""
    return {
        "node": {"socket": socket, "slab": slab, **settings},
        "block_bytes": block_bytes,
        "tiers": [
            {"medium": "host", "capacity": capacity, **({"eviction": eviction} if eviction else {})},
            *(below or []),
        ],
    }


class NodeDaemonProcess:
    """One daemon's config, and the process serving it (None while stopped)."""

    def __init__(
        self,
        directory: Path,
        settings: dict[str, Any],
        capacity: str,
        block_bytes: str,
        eviction: str | None = None,
        below: list[dict[str, Any]] | None = None,
    ) -> None:
        self.directory = directory
        self.socket = str(Path(tempfile.mkdtemp(prefix="kvn", dir="/tmp")) / "node.sock")
        self.slab = f"/dev/shm/kvtier-test-{uuid.uuid4().hex[:12]}"
        self.config = directory / "node.yaml"
        self.log = directory / "node.log"
        document = daemon_config(self.socket, self.slab, settings, capacity, block_bytes, eviction, below)
        directory.mkdir(parents=True, exist_ok=True)
        self.config.write_text(yaml.safe_dump(document))
        self.process: subprocess.Popen | None = None

    def tier(self, **extra: Any) -> dict[str, Any]:
        """A node tier of an engine's stack on this daemon."""
        return {"medium": "node", "socket": self.socket, "timeout": 2.0, **extra}

    def start(self) -> None:
        """Start the daemon and wait until it answers on its socket."""
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "kvtier.cli", "node", "serve", str(self.config)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + READY_WITHIN_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the node daemon exited with {self.process.returncode}: {self.log.read_text()}")
            with contextlib.suppress(Exception):
                self.stats()
                return
            time.sleep(0.05)
        raise RuntimeError(f"the node daemon did not answer within {READY_WITHIN_S} s: {self.log.read_text()}")

    def stats(self) -> dict[str, Any]:
        """The daemon's STATS, asked on a connection of its own."""
        client = NodeClient(self.socket, 5.0)
        try:
            client.open()
            (stats,), _, _ = client.call(Op.STATS)
            return stats
        finally:
            client.close()

    def wait_stores(self, n: int, within: float = 10.0) -> None:
        """Wait until the daemon has taken ``n`` COMMITs in all: a store returns once its COMMIT is posted,
        and another engine's LOOKUP may reach the daemon before it."""
        deadline = time.monotonic() + within
        while self.stats()["stores"] < n:
            assert time.monotonic() < deadline, f"the daemon took {self.stats()['stores']} stores, not {n}"
            time.sleep(0.01)

    def signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def pause(self) -> None:
        """SIGSTOP, once every thread of the process is stopped."""
        assert self.process is not None
        processes.stop(self.process.pid)

    def resume(self) -> None:
        self.signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL, waited for: the socket file and the slab stay behind, as after a crash."""
        self.signal(signal.SIGKILL)
        assert self.process is not None
        self.process.wait(10)
        self.process = None

    def stop(self) -> int:
        """SIGTERM (after SIGCONT, should it be stopped); its exit status."""
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(20)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            self.process = None
        return code

    def close(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.slab)
        shutil.rmtree(Path(self.socket).parent, ignore_errors=True)


@contextlib.contextmanager
def node_daemon(
    directory: Path,
    capacity: str = "8MiB",
    block_bytes: str = "64KiB",
    eviction: str | None = "lru",
    below: list[dict[str, Any]] | None = None,
    **settings: Any,
) -> Iterator[NodeDaemonProcess]:
    """A daemon serving a slab of ``capacity`` with slots for ``block_bytes``, evicting by ``eviction`` (LRU: a
    test's blocks are stored at first sight; None: the default, adaptive), over the tiers ``below`` (a disk
    tier's entry); ``settings`` go to its ``node`` section (``lease``, ``allow_users``, ``max_held``, ...)."""
    daemon = NodeDaemonProcess(directory, settings, capacity, block_bytes, eviction, below)
    try:
        daemon.start()
        yield daemon
    finally:
        daemon.close()


@contextlib.contextmanager
def node_daemon_here(capacity: str, block_bytes: str, below: list[dict[str, Any]], **settings: Any) -> Iterator[Any]:
    """A daemon serving in a thread of this process, for tests that change its module's constants or inject
    a fault into a tier below its slab (the LRU slab of ``capacity``, then ``below``; ``settings`` go to its
    ``node`` section); yields the ``NodeDaemon``, its socket path in ``settings.socket``."""
    from kvtier.node_config import load_node_config
    from kvtier.node_daemon import NodeDaemon

    directory = Path(tempfile.mkdtemp(prefix="kvn", dir="/tmp"))
    slab = f"/dev/shm/kvtier-test-{uuid.uuid4().hex[:12]}"
    config = daemon_config(str(directory / "node.sock"), slab, settings, capacity, block_bytes, "lru", below)
    daemon = NodeDaemon(load_node_config(config))
    threading.Thread(target=daemon.serve, daemon=True).start()
    try:
        yield daemon
    finally:
        daemon.stop()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(slab)
        shutil.rmtree(directory, ignore_errors=True)
