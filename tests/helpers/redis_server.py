"""A real redis-server for the remote tier's tests: on a free loopback port, without persistence, and
always gone when the test is (killed by its pid; its files stay in the test's own directory).

    with redis_server(tmp_path, maxmemory="64mb", password="...") as server:
        server.url, server.client()      # a redis-py client for poking records directly
        server.stop(); server.cont()     # SIGSTOP / SIGCONT: a server that hangs, then resumes
        server.kill(); server.restart()  # SIGKILL; a fresh, empty server on the same port

TLS-only servers (no plain port; ``url`` is ``rediss://``), with a throwaway CA made by the openssl CLI:

    ca = certificate_authority(tmp_path / "ca")          # a CA of its own: ca.cert, ca.key
    tls = server_certificate(ca, tmp_path / "server")    # for IP 127.0.0.1, signed by ca: .cert .key .ca
    with redis_server(tmp_path / "redis", tls=tls) as server: ...

``require_redis()`` skips a test when redis-server or redis-py is missing, naming the install line,
and fails it instead under KVTIER_REQUIRE_REMOTE=1 (CI), where these tests must run; so does
``require_tls()`` when openssl or a redis-server built with TLS is missing. The config goes to
redis-server on stdin, so a password never appears in its command line.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import processes
from helpers.ports import free_port

SERVER = "redis-server"
INSTALL_SERVER = "apt-get install -y redis-server"
INSTALL_CLIENT = "pip install redis hiredis"
INSTALL_OPENSSL = "apt-get install -y openssl"
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
    skip_unless_present(missing)


def require_tls() -> None:
    """``require_redis()``, and skip (fail under KVTIER_REQUIRE_REMOTE=1) unless the openssl CLI is here
    and redis-server was built with TLS."""
    require_redis()
    missing = []
    if shutil.which("openssl") is None:
        missing.append(f"the openssl CLI is not installed: {INSTALL_OPENSSL}")
    if not _server_has_tls():
        missing.append(
            f"{SERVER} was built without TLS (BUILD_TLS=yes): {INSTALL_SERVER} from a distribution "
            f"that builds it with TLS (Debian and Ubuntu do)"
        )
    skip_unless_present(missing)


def skip_unless_present(missing: list[str]) -> None:
    """Skip the test naming what is ``missing`` (each with its install line), or fail it under
    KVTIER_REQUIRE_REMOTE=1 (CI, where the remote tier's tests must run); nothing when none is."""
    if missing:
        message = "; ".join(missing)
        if os.environ.get("KVTIER_REQUIRE_REMOTE") == "1":
            pytest.fail(f"KVTIER_REQUIRE_REMOTE=1 but {message}", pytrace=False)
        pytest.skip(message)


@functools.cache
def _server_has_tls() -> bool:
    """Whether redis-server links OpenSSL (a build without TLS refuses ``tls-port`` at start)."""
    path = shutil.which(SERVER)
    return path is not None and b"SSL_CTX_new" in Path(path).read_bytes()


@dataclass(frozen=True)
class CertificateAuthority:
    """A throwaway CA: its certificate (what a client trusts, ``ca_file``) and its private key."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class TlsFiles:
    """A server's certificate and key, and the certificate of the CA that signed it."""

    cert: Path
    key: Path
    ca: Path


def _openssl(*args: str | Path, cwd: Path) -> None:
    done = subprocess.run(["openssl", *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed ({done.returncode}): {done.stderr[-2000:]}")


_EC_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")


def certificate_authority(directory: Path, name: str = "kvtier test CA") -> CertificateAuthority:
    """A new self-signed CA (P-256, valid for a day) in ``directory``."""
    require_tls()
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "ca.crt", directory / "ca.key"
    _openssl(
        "req",
        "-x509",
        *_EC_KEY,
        "-keyout",
        key,
        "-out",
        cert,
        "-days",
        "1",
        "-subj",
        f"/CN={name}",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
        cwd=directory,
    )
    return CertificateAuthority(cert, key)


def server_certificate(ca: CertificateAuthority, directory: Path, san: str = "IP:127.0.0.1") -> TlsFiles:
    """A server certificate for ``san`` (the subjectAltName: ``IP:127.0.0.1``, ``DNS:localhost``, ...),
    signed by ``ca``, with its key, in ``directory``."""
    require_tls()
    directory.mkdir(parents=True, exist_ok=True)
    cert, key, request, extensions = (
        directory / name for name in ("server.crt", "server.key", "server.csr", "server.ext")
    )
    extensions.write_text(
        f"subjectAltName={san}\nbasicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
        "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n"
    )
    _openssl("req", "-new", *_EC_KEY, "-keyout", key, "-out", request, "-subj", "/CN=kvtier test server", cwd=directory)
    _openssl(
        "x509",
        "-req",
        "-in",
        request,
        "-CA",
        ca.cert,
        "-CAkey",
        ca.key,
        "-set_serial",
        str(int.from_bytes(os.urandom(8), "big")),
        "-days",
        "1",
        "-extfile",
        extensions,
        "-out",
        cert,
        cwd=directory,
    )
    return TlsFiles(cert, key, ca.cert)


class RedisServer:
    """One redis-server process; ``restart`` starts a new one on the same port (an empty store). With
    ``tls`` it listens on that port with TLS only (no plain port; clients need no certificate of their
    own); a restart takes the ``tls`` files set at that time (a server whose certificate changed)."""

    def __init__(
        self, directory: Path, maxmemory: str | None = None, password: str | None = None, tls: TlsFiles | None = None
    ) -> None:
        self.directory = directory
        self.maxmemory = maxmemory
        self.password = password
        self.tls = tls
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.stopped = False

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls is not None else 'redis'}://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [SERVER, "-"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n".join(self.config_lines()).encode() + b"\n")
        self.proc.stdin.close()
        self.stopped = False
        self._wait_ready()

    def config_lines(self) -> list[str]:
        """The server's configuration, one directive a line (given on stdin: no secret in its argv)."""
        if self.tls is None:
            listen = [f"port {self.port}"]
        else:
            listen = [
                "port 0",
                f"tls-port {self.port}",
                f"tls-cert-file {self.tls.cert}",
                f"tls-key-file {self.tls.key}",
                f"tls-ca-cert-file {self.tls.ca}",
                "tls-auth-clients no",
            ]
        lines = [
            *listen,
            "bind 127.0.0.1",
            "save ''",
            "appendonly no",
            f"dir {self.directory}",
            "daemonize no",
            f"logfile {self.directory / 'redis.log'}",
        ]
        if self.maxmemory is not None:
            lines += [f"maxmemory {self.maxmemory}", "maxmemory-policy allkeys-lru"]
        if self.password is not None:
            lines.append(f"requirepass {self.password}")
        return lines

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
                raise RuntimeError(
                    f"redis-server exited with {self.proc.returncode}; log: "
                    f"{(self.directory / 'redis.log').read_text(errors='replace')[-2000:]}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis-server on port {self.port} not ready after {READY_WITHIN_S} s")
            time.sleep(0.02)

    def client(self):
        """A redis-py client of its own (short timeouts), for writing or damaging records directly. Over
        TLS it trusts the server's own CA and checks no host name (it reaches any of a test's servers)."""
        import redis

        tls = {} if self.tls is None else {"ssl": True, "ssl_ca_certs": str(self.tls.ca), "ssl_check_hostname": False}
        return redis.Redis(
            host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5, socket_connect_timeout=5, **tls
        )

    def _signal(self, sig: int) -> None:
        assert self.proc is not None and self.proc.poll() is None, "the server is not running"
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        """SIGSTOP, taken effect: the server keeps its sockets open and answers nothing (a hung server)."""
        assert self.proc is not None and self.proc.poll() is None, "the server is not running"
        processes.stop(self.proc.pid)
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
def redis_server(
    directory: Path, maxmemory: str | None = None, password: str | None = None, tls: TlsFiles | None = None
) -> Iterator[RedisServer]:
    """A started server, killed on the way out whatever happened (skips when Redis, or with ``tls``
    openssl or Redis' TLS, is missing)."""
    if tls is None:
        require_redis()
    else:
        require_tls()
    server = RedisServer(directory, maxmemory, password, tls)
    try:
        server.start()
        yield server
    finally:
        server.kill()
