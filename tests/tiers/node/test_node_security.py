"""Who may use a node daemon, and what a hostile peer can do to it, against a real daemon process:

- a process of a user the daemon does not allow is refused (one log line); an allowed one maps the slab
  through the descriptor the daemon sends, though it cannot open the slab's file (0600, the daemon's);
- an engine refuses a daemon that runs as a user it does not trust (anyone can bind a socket where a
  shared directory allows);
- malformed, oversized or unknown messages (hypothesis) close that connection only: the daemon goes on
  serving every other engine, and counts them;
- a daemon of another protocol version is one clear error at an engine's start.

The users: the tests fork a child that becomes ``nobody`` (they need root, as CI runs them; elsewhere
they skip).
"""

from __future__ import annotations

import os
import pwd
import socket
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from helpers.node_daemon import node_daemon
from kvtier import KVTier
from kvtier.core.errors import ConfigError
from kvtier.tiers.node import client as node_client, protocol
from kvtier.tiers.node.client import NodeClient
from kvtier.tiers.node.protocol import Op, ProtocolError, frame, read_frame, request

BLOCK = 64 * 1024
NOBODY = pwd.getpwnam("nobody").pw_uid

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root (CI runs as root)")


def as_nobody(work: Callable[[], str]) -> str:
    """Run ``work`` in a forked child that became ``nobody``; what it returned, or its exception's text."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no return from here
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            result = work()
        except BaseException as exc:  # noqa: BLE001 (everything is the answer)
            result = f"{type(exc).__name__}: {exc}"
        os.write(write, result.encode()[:4000])
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        answer = pipe.read().decode()
    os.waitpid(pid, 0)
    return answer


def open_to_all(daemon) -> None:
    """Let other users reach the socket's directory (a test directory is 0700)."""
    os.chmod(Path(daemon.socket).parent, 0o755)


@needs_root
def test_a_user_the_daemon_does_not_allow_is_refused_with_one_log_line(tmp_path):
    with node_daemon(tmp_path, allow_groups=[]) as daemon:
        open_to_all(daemon)
        os.chmod(
            daemon.socket, 0o666
        )  # (the socket is 0600 without other users: open it to show peer credentials decide)

        def engine() -> str:
            KVTier.open({"block_bytes": BLOCK, "tiers": [daemon.tier()]})
            return "connected"

        answer = as_nobody(engine)
        assert answer.startswith("ConfigError") and "closed the connection at hello" in answer
        assert f"uid {NOBODY} is not allowed" in daemon.log.read_text()
        assert daemon.stats()["refused"] == 1


@needs_root
def test_an_allowed_user_maps_the_slab_it_cannot_open_and_round_trips_blocks(tmp_path, rng):
    blocks = rng.integers(0, 256, (3, BLOCK), dtype=np.uint8)
    tokens = list(range(48))
    with node_daemon(tmp_path, allow_users=["nobody"]) as daemon:
        open_to_all(daemon)
        assert os.stat(daemon.socket).st_mode & 0o777 == 0o666
        slab = os.stat(daemon.slab)
        assert (slab.st_mode & 0o777, slab.st_uid) == (0o600, 0)
        with KVTier.open({"block_bytes": BLOCK, "tiers": [daemon.tier()]}) as ours:
            ours.store_now(tokens, blocks)

        def engine() -> str:
            try:
                open(daemon.slab, "rb")
                return "opened the slab's file"
            except PermissionError:
                pass
            with KVTier.open({"block_bytes": BLOCK, "tiers": [daemon.tier(daemon_user=0)]}) as kv:
                out = np.zeros_like(blocks)
                result = kv.load_now(tokens, out)
                return f"loaded {result.loaded}, equal {np.array_equal(out, blocks)}"

        assert as_nobody(engine) == "loaded 3, equal True"


@needs_root
def test_an_engine_refuses_a_daemon_running_as_a_user_it_does_not_trust():
    directory = tempfile.mkdtemp(prefix="kvn", dir="/tmp")
    os.chmod(directory, 0o777)
    path = os.path.join(directory, "node.sock")
    ready, go = os.pipe()
    pid = os.fork()
    if pid == 0:  # a fake daemon, as nobody: accepts, says nothing, closes
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.bind(path)
            server.listen(4)
            os.write(go, b"!")
            for _ in range(2):
                conn, _ = server.accept()
                conn.recv(4096)
                conn.close()
        finally:
            os._exit(0)
    try:
        assert os.read(ready, 1) == b"!"
        with pytest.raises(ConfigError, match=f"runs as uid {NOBODY}, which this engine does not trust"):
            NodeClient(path, 1.0).open()
        with pytest.raises(ConfigError, match="closed the connection at hello"):  # trusted: it gets to hello
            NodeClient(path, 1.0, [NOBODY]).open()
    finally:
        os.waitpid(pid, 0)
        os.unlink(path)
        os.rmdir(directory)


def test_a_daemon_of_another_protocol_version_is_one_clear_error_at_start(tmp_path, monkeypatch):
    with node_daemon(tmp_path) as daemon:
        monkeypatch.setattr(node_client, "VERSION", protocol.VERSION + 1)
        with pytest.raises(ConfigError, match=f"protocol version {protocol.VERSION + 1}, this daemon speaks"):
            KVTier.open({"block_bytes": BLOCK, "tiers": [daemon.tier()]})


# --- hostile messages ------------------------------------------------------------------------------


def connected(daemon, hello: bool = True) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(daemon.socket)
    if hello:
        sock.sendall(frame([Op.HELLO, protocol.VERSION, os.getpid()]))
        _, fds, _, _ = socket.recv_fds(sock, 4096, 1)
        for fd in fds:
            os.close(fd)
    return sock


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with node_daemon(tmp_path_factory.mktemp("hostile")) as running:
        yield running


@pytest.fixture(scope="module")
def engine(daemon):
    """A well-behaved engine beside the hostile connections; it must keep working throughout."""
    with KVTier.open({"block_bytes": BLOCK, "tiers": [daemon.tier()]}) as kv:
        yield kv


def round_trip(engine: KVTier, rng, start: int) -> bool:
    blocks = rng.integers(0, 256, (2, BLOCK), dtype=np.uint8)
    tokens = list(range(start, start + 32))
    engine.store_now(tokens, blocks)
    out = np.zeros_like(blocks)
    return engine.load_now(tokens, out).loaded == 2 and np.array_equal(out, blocks)


values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=40) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=6),
    max_leaves=20,
)
messages = st.one_of(
    st.lists(values, min_size=1, max_size=4),  # any array
    st.tuples(st.sampled_from(list(Op)), st.lists(values, max_size=3)).map(lambda m: [int(m[0]), *m[1]]),  # known ops
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(message=messages)
def test_a_malformed_message_closes_that_connection_only(daemon, engine, message):
    body = msgpack.packb(message, use_bin_type=True)
    try:
        op, _ = request(message)
        valid = op is not Op.HELLO
    except ProtocolError:
        valid = False
    sock = connected(daemon)
    try:
        sock.sendall(struct.pack("<I", len(body)) + body)
        if not valid:
            assert closed_by_peer(sock)
        elif op not in protocol.POSTED:
            assert read_frame(sock)[0] == protocol.OK
    finally:
        sock.close()


def test_after_hostile_peers_the_daemon_serves_engines_and_counted_them(daemon, engine, rng):
    before = daemon.stats()["protocol_errors"]
    for raw in (
        b"\xff\xff\xff\xff",  # a frame of 4 GiB announced
        struct.pack("<I", 5) + b"\xc1\xc1\xc1\xc1\xc1",  # not msgpack
        struct.pack("<I", 10) + b"abc",  # a frame its sender hangs up inside
    ):
        sock = connected(daemon, hello=False)
        sock.sendall(raw)
        sock.shutdown(socket.SHUT_WR)
        assert closed_by_peer(sock)
        sock.close()
    sock = connected(daemon, hello=False)
    sock.sendall(frame([Op.LOOKUP, []]))  # anything before HELLO
    assert closed_by_peer(sock)
    sock.close()
    sock = connected(daemon, hello=False)
    sock.sendall(frame([Op.HELLO, 999, 1]))
    reply = read_frame(sock)
    assert reply[0] == protocol.ERROR and "protocol version 999" in reply[1]
    assert closed_by_peer(sock)
    sock.close()
    assert daemon.stats()["protocol_errors"] - before == 5
    assert round_trip(engine, rng, 50_000)


@settings(max_examples=500, deadline=None)
@given(raw=st.binary(max_size=200))
def test_any_bytes_decode_to_a_request_or_a_protocol_error(raw):
    try:
        request(protocol.decode(raw))
    except ProtocolError:
        pass
