"""A real redis-server for the remote tier's tests: on a free loopback port, without persistence, and
always gone when the test is (killed by its pid; its files stay in the test's own directory).

    with redis_server(tmp_path, maxmemory="64mb", password="...") as server:
        server.url, server.client()      # a redis-py client for poking records directly
        server.stop(); server.cont()     # SIGSTOP / SIGCONT: a server that hangs, then resumes
        server.kill(); server.restart()  # SIGKILL; a fresh, empty server on the same port

``require_redis()`` skips a test when redis-server or redis-py is missing, naming the install line,
and fails it instead under KVTIER_REQUIRE_REMOTE=1 (CI), where these tests must run. The config goes
to redis-server on stdin, so a password never appears in its command line.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

SERVER = "redis-server"
INSTALL_SERVER = "apt-get install -y redis-server"
INSTALL_CLIENT = "pip install redis hiredis"
READY_WITHIN_S = 10.0


def require_redis() -> None:
    """Skip (fail under KVTIER_REQUIRE_REMOTE=1) unless redis-server and redis-py with hiredis are here."""
    missing = []
    if shutil.which(SERVER) is None:
        missing.append(f"redis-server is not installed: {INSTALL_SERVER}")
    try:
        import hiredis  # noqa: F401
        import redis  # noqa: F401
    except ImportError as exc:
        missing.append(f"the Python client is missing ({exc.name}): {INSTALL_CLIENT}")
    if missing:
        message = "; ".join(missing)
        if os.environ.get("KVTIER_REQUIRE_REMOTE") == "1":
            pytest.fail(f"KVTIER_REQUIRE_REMOTE=1 but {message}", pytrace=False)
        pytest.skip(message)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process; ``restart`` starts a new one on the same port (an empty store)."""

    def __init__(self, directory: Path, maxmemory: str | None = None, password: str | None = None) -> None:
        self.directory = directory
        self.maxmemory = maxmemory
        self.password = password
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.stopped = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        lines = [f"port {self.port}", "bind 127.0.0.1", "save ''", "appendonly no", f"dir {self.directory}",
                 "daemonize no", f"logfile {self.directory / 'redis.log'}"]
        if self.maxmemory is not None:
            lines += [f"maxmemory {self.maxmemory}", "maxmemory-policy allkeys-lru"]
        if self.password is not None:
            lines.append(f"requirepass {self.password}")
        self.proc = subprocess.Popen([SERVER, "-"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n".join(lines).encode() + b"\n")
        self.proc.stdin.close()
        self.stopped = False
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_WITHIN_S
        while True:
            try:
                if self.client().ping():
                    return
            except Exception:
                pass
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; log: "
                                   f"{(self.directory / 'redis.log').read_text(errors='replace')[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis-server on port {self.port} not ready after {READY_WITHIN_S} s")
            time.sleep(0.02)

    def client(self):
        """A redis-py client of its own (short timeouts), for writing or damaging records directly."""
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5,
                           socket_connect_timeout=5)

    def _signal(self, sig: int) -> None:
        assert self.proc is not None and self.proc.poll() is None, "the server is not running"
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        """SIGSTOP: the server keeps its sockets open and answers nothing (a hung server)."""
        self._signal(signal.SIGSTOP)
        self.stopped = True

    def cont(self) -> None:
        self._signal(signal.SIGCONT)
        self.stopped = False

    def kill(self) -> None:
        """SIGKILL (also when stopped); returns once the process is gone."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.stopped = False

    def restart(self) -> None:
        """Kill this server and start a new one on the same port: the store comes back empty."""
        self.kill()
        self.start()


@contextlib.contextmanager
def redis_server(directory: Path, maxmemory: str | None = None, password: str | None = None) -> Iterator[RedisServer]:
    """A started server, killed on the way out whatever happened (skips when Redis is missing)."""
    require_redis()
    server = RedisServer(directory, maxmemory, password)
    try:
        server.start()
        yield server
    finally:
        server.kill()
