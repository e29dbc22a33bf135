"""Real Mooncake Store servers for the remote-tier tests: a master and standalone segment owners.

Mooncake keeps data in memory segments that clients contribute, not in the master, so a test store is
two kinds of process: ``MooncakeMaster`` (RPC, the transfer engine's HTTP metadata server, and the
HTTP admin port with ``/health``) and ``SegmentOwner`` (the wheel's standalone ``mooncake_client``,
which holds ``size`` bytes of store memory for as long as it lives, like a long-lived owner in a
deployment). Both are context managers on free loopback ports that wait until the server answers and
always kill it on exit; ``kill()`` (SIGKILL), ``stop()`` (SIGSTOP), ``cont()`` and the master's
``restart()`` (same ports, empty store) inject faults. ``mooncake_store(owners)`` starts a master with
several owners; the master's admin API says which owner's segment holds each record (``replicas``).

Every bind flag is set to 127.0.0.1 and so is ``MC_TCP_BIND_ADDRESS`` (without it the transfer engine
advertises the first non-loopback interface). Mooncake 0.3.13 still listens on the wildcard address
for some sockets whatever the flags (the master's metadata server, the owner's HTTP server and
transfer engine ports); the addresses it advertises are loopback.

Servers run the package's ELF binaries directly (the ``mooncake_master`` console script is a Python
shim that execs them), so the pid is the server's, and under ``setpriv --pdeathsig KILL`` where
util-linux has it, so a test process that dies hard (a segfault in a client) takes its servers with it.
That signal follows the thread that started the server: start servers from the test's own thread.

Without the wheel or Debian's libibverbs1 (which the wheel links even for TCP), ``require_mooncake()``
skips with the exact install line, or fails under KVTIER_REQUIRE_REMOTE=1.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from helpers import processes
from helpers.ports import free_port

REQUIRED = os.environ.get("KVTIER_REQUIRE_REMOTE") == "1"
LOOPBACK = "127.0.0.1"
READY_TIMEOUT = 30.0
"""Seconds a server may take to answer (measured: master 1.3 to 1.4 s, owner 0.3 to 0.4 s)."""

PIP_LINE = f"{sys.executable} -m pip install 'mooncake-transfer-engine-non-cuda>=0.3.13'"
APT_LINE = "apt-get install -y libibverbs1"


def mooncake_problem() -> str | None:
    """Why Mooncake cannot run here (naming the line that installs what is missing), or None."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return f"the Mooncake Store wheel is not installed: {PIP_LINE}"
    package = Path(spec.submodule_search_locations[0])
    for binary in ("mooncake_master", "mooncake_client"):
        if not (package / binary).is_file():
            return f"the Mooncake wheel at {package} has no {binary} binary: {PIP_LINE}"
    try:
        importlib.import_module("mooncake.store")
    except ImportError as exc:
        if "libibverbs" in str(exc):
            return f"Mooncake needs Debian's libibverbs1 even for TCP ({exc}): {APT_LINE}"
        return f"mooncake.store does not import ({exc}): {PIP_LINE}"
    return None


def require_mooncake() -> None:
    """Skip (or, under KVTIER_REQUIRE_REMOTE=1, fail) the calling test when Mooncake cannot run here."""
    problem = mooncake_problem()
    if problem is not None and REQUIRED:
        pytest.fail(f"KVTIER_REQUIRE_REMOTE=1 but {problem}", pytrace=False)
    if problem is not None:
        pytest.skip(problem)


def _binary(name: str) -> str:
    spec = importlib.util.find_spec("mooncake")
    assert spec is not None and spec.submodule_search_locations, "call require_mooncake() first"
    return str(Path(spec.submodule_search_locations[0]) / name)


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection((LOOPBACK, port), timeout=0.5):
            return True
    except OSError:
        return False


def http_get(port: int, path: str, timeout: float = 1.0) -> bytes | None:
    """The body of a 200 answer from a loopback HTTP port, or None (refused, timed out, other status)."""
    try:
        with urllib.request.urlopen(f"http://{LOOPBACK}:{port}{path}", timeout=timeout) as answer:
            return answer.read() if answer.status == 200 else None
    except (OSError, urllib.error.URLError):
        return None


class _Server:
    """One server process: started with its output in a log file, signalled and killed by pid."""

    def __init__(self, tag: str) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix=f"kvtier-{tag}-"))
        self.log_path = self._dir / f"{tag}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def _argv(self) -> list[str]:
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    def _spawn(self) -> None:
        env = dict(os.environ, MC_TCP_BIND_ADDRESS=LOOPBACK)
        guard = ["setpriv", "--pdeathsig", "KILL", "--"] if shutil.which("setpriv") else []
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                guard + self._argv(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self._wait(self._ready, "to answer")

    def _wait(self, ready: Callable[[], bool], what: str, timeout: float = READY_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"{type(self).__name__} exited before {what}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{type(self).__name__} did not manage {what} in {timeout} s:\n{self.log_tail()}")
            time.sleep(0.05)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, and reap it (a stopped process dies of SIGKILL too)."""
        if self.alive:
            os.kill(self.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        """SIGSTOP, taken effect: the process keeps its sockets open and answers nothing, like a hung server."""
        processes.stop(self.pid)

    def cont(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.kill()
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)


class MooncakeMaster(_Server):
    """``mooncake_master`` with its HTTP metadata server (no etcd) on three free loopback ports.

    ``flags`` are extra ``--name=value`` flags (for example ``--client_ttl=2`` so that a dead owner's
    segment is dropped sooner than the default 10 s).
    """

    def __init__(self, *flags: str) -> None:
        super().__init__("mooncake-master")
        self.flags = flags
        self.rpc_port, self.metadata_port, self.metrics_port = free_port(), free_port(), free_port()

    def __enter__(self) -> MooncakeMaster:
        require_mooncake()
        try:
            self._spawn()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    @property
    def address(self) -> str:
        """``master`` in a tier's mooncake mapping."""
        return f"{LOOPBACK}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        """``metadata_server`` in a tier's mooncake mapping."""
        return f"http://{LOOPBACK}:{self.metadata_port}/metadata"

    def tier(self, timeout: float) -> dict:
        """A stack's remote tier mapping for this store (``backend: mooncake``), whose calls take ``timeout``."""
        return {
            "medium": "remote",
            "backend": "mooncake",
            "timeout": timeout,
            "mooncake": {"master": self.address, "metadata_server": self.metadata_url},
        }

    def _argv(self) -> list[str]:
        return [
            _binary("mooncake_master"),
            f"--rpc_port={self.rpc_port}",
            f"--rpc_address={LOOPBACK}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={LOOPBACK}",
            f"--http_metadata_server_port={self.metadata_port}",
            f"--metrics_host={LOOPBACK}",
            f"--metrics_port={self.metrics_port}",
            *self.flags,
        ]

    def _ready(self) -> bool:
        return _accepts(self.rpc_port) and _accepts(self.metadata_port) and self.health() is not None

    def health(self) -> dict | None:
        """The master's ``/health`` answer, or None when it does not answer within a second."""
        body = http_get(self.metrics_port, "/health")
        return None if body is None else json.loads(body)

    def segments(self) -> list[str]:
        """Names of the memory segments mounted now (``/get_all_segments``); [] when it does not answer."""
        body = http_get(self.metrics_port, "/get_all_segments")
        return [] if body is None else body.decode().split()

    def replicas(self, names: Sequence[str]) -> dict[str, list[str]]:
        """The segments holding each record's replicas (``/batch_query_keys``), [] for a record the master
        does not know: which owner holds a record, as ``SegmentOwner.segment`` names it."""
        assert not any("," in name for name in names), "the master splits its keys argument at commas"
        keys = ",".join(urllib.parse.quote(name, safe="") for name in names)
        body = http_get(self.metrics_port, f"/batch_query_keys?keys={keys}")
        assert body is not None, "the master's admin API did not answer /batch_query_keys"
        found = json.loads(body)["data"]
        return {
            name: [replica["transport_endpoint_"] for replica in found[name]["values"] or []]
            if found[name]["ok"]
            else []
            for name in names
        }

    def wait_segments(self, count: int, timeout: float = READY_TIMEOUT) -> None:
        """Wait until at least ``count`` segments are mounted (an owner re-mounts after a master restart)."""
        self._wait(lambda: len(self.segments()) >= count, f"to list {count} segment(s)", timeout)

    def wait_dropped(self, segment: str, timeout: float = READY_TIMEOUT) -> None:
        """Wait until ``segment`` is no longer mounted (a dead owner's goes ``--client_ttl`` after its last
        heartbeat)."""
        self._wait(lambda: segment not in self.segments(), f"to drop segment {segment}", timeout)

    def restart(self) -> None:
        """Kill the master and start a new one on the same ports: an empty store, the same address."""
        self.kill()
        self._spawn()


class SegmentOwner(_Server):
    """The wheel's standalone ``mooncake_client``: contributes ``size`` (a Mooncake size string such as
    "64MB") of store memory for as long as it lives, with its HTTP ``/health`` on a port of its own.
    Ready once it answers and the master lists its segment, whose name (``segment``: the owner's
    transfer endpoint, which the owner picks itself) is where ``MooncakeMaster.replicas`` places records."""

    def __init__(self, master: MooncakeMaster, size: str = "64MB") -> None:
        super().__init__("mooncake-owner")
        self.master = master
        self.size = size
        self.port, self.http_port = free_port(), free_port()
        self.segment = ""

    def __enter__(self) -> SegmentOwner:
        require_mooncake()
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start(self) -> None:
        """Spawn the owner and wait for its segment; an owner that exits at start (on a loaded machine one
        may give up on the master) is started once more, on other ports."""
        before = set(self.master.segments())
        try:
            self._spawn()
        except RuntimeError:
            self.kill()
            self.port, self.http_port = free_port(), free_port()
            before = set(self.master.segments())
            self._spawn()
        self._wait(lambda: self._mounted(before), "to mount its segment")

    def _argv(self) -> list[str]:
        return [
            _binary("mooncake_client"),
            f"--master_server_address={self.master.address}",
            f"--metadata_server={self.master.metadata_url}",
            f"--global_segment_size={self.size}",
            "--protocol=tcp",
            f"--host={LOOPBACK}",
            f"--port={self.port}",
            "--enable_http_server=true",
            f"--http_port={self.http_port}",
        ]

    def _ready(self) -> bool:
        return _accepts(self.port) and http_get(self.http_port, "/health") is not None

    def _mounted(self, before: set[str]) -> bool:
        """Whether the master lists a segment that it did not list ``before`` (then this owner's ``segment``)."""
        new = set(self.master.segments()) - before
        if len(new) == 1:
            (self.segment,) = new
        return bool(self.segment)


@contextmanager
def mooncake_store(owners: int, size: str = "64MB", *flags: str) -> Iterator[tuple[MooncakeMaster, list[SegmentOwner]]]:
    """A master (with ``flags``) and ``owners`` segment owners of ``size`` each, started one after the other
    (so each knows its segment) and all killed on exit."""
    with ExitStack() as servers:
        master = servers.enter_context(MooncakeMaster(*flags))
        yield master, [servers.enter_context(SegmentOwner(master, size)) for _ in range(owners)]
