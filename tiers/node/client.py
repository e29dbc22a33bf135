"""An engine's connection to its machine's node daemon: control messages on the daemon's Unix socket, and
the daemon's slab mapped into this process (its descriptor comes over the socket, so the slab needs no
path an engine could open, nor one another user could).

Every call is bounded by the tier's timeout. A call that fails or times out closes the connection (a
reply might still come, out of step with the next request), which makes the daemon give back whatever
this connection held; the next calls fail at once for ``RETRY_AFTER_S``, then one of them reconnects.
So a dead or stopped daemon costs a miss or a dropped store per call within the timeout, never a hang,
and the engine comes back by itself when the daemon does. Each connection has its own ``epoch``: a
message about pins or reservations of an earlier connection is never sent on a later one (the daemon
gave those back when the earlier one closed).

The daemon must run as a user this process trusts (its own, root, or the tier's ``daemon_user``),
checked from the kernel's peer credentials: anyone can put a socket at a path in a shared directory.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterable
from typing import Any

from kvtier.core.errors import ConfigError, StoreError
from kvtier.tiers.node.protocol import (
    ERROR,
    OK,
    POSTED,
    VERSION,
    Op,
    ProtocolError,
    frame,
    peer_credentials,
    read_frame,
)
from kvtier.tiers.node.slab import Geometry, SlabView, map_slab

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1.0
"""How long after a failed call the next calls fail at once, before one tries to reconnect."""


class NodeClient:
    """One connection to the daemon at ``path``, shared by the threads of one tier (calls take turns), and
    the slab it maps. ``trusted_uids``: users the daemon may run as, besides this process's and root."""

    def __init__(self, path: str, timeout: float, trusted_uids: Iterable[int] = ()) -> None:
        self.path = path
        self.timeout = timeout
        self.trusted_uids = frozenset({os.geteuid(), 0, *trusted_uids})
        self.epoch = 0  # the current connection's number (0: none yet)
        self.node_id = ""  # the daemon's machine, as it names itself
        self.slab_path = ""  # the slab's file, as this process sees its mapping (/proc/self/fd of the descriptor)
        self.geometry: Geometry | None = None
        self._view: SlabView | None = None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._retry_at = 0.0
        self._closed = False

    def __repr__(self) -> str:
        return f"NodeClient({self.path!r}, {'connected' if self._sock else 'not connected'}, epoch {self.epoch})"

    def live_epoch(self) -> int | None:
        """The epoch of the connection that is up now (None: none is)."""
        return self.epoch if self._sock is not None else None

    def open(self) -> None:
        """Connect now, at an engine's start: a missing socket, a daemon of another protocol version or an
        untrusted one, a slab that does not map are one ConfigError naming the fix."""
        with self._lock:
            try:
                self._connect()
            except (OSError, StoreError, ProtocolError) as exc:
                raise ConfigError(f"node tier: {exc}") from None

    def call(self, op: Op, *args: Any) -> tuple[list[Any], int, SlabView]:
        """Send a request and wait for its reply (at most the timeout); returns the reply's results, the
        epoch of the connection that answered and the slab it maps. Raises StoreError when the daemon
        cannot be asked or answers an error."""
        assert op not in POSTED
        with self._lock:
            sock = self._ready()
            try:
                sock.sendall(frame([op, *args]))
                reply = read_frame(sock)
            except (OSError, EOFError, ProtocolError) as exc:
                self._fail(f"{op.name} failed: {exc or type(exc).__name__}")
            if reply[0] != OK:
                message = str(reply[1])[:200] if len(reply) > 1 else "no reason"
                self._fail(f"the daemon refused {op.name}: {message}")
            assert self._view is not None
            return reply[1:], self.epoch, self._view

    def post(self, op: Op, epoch: int, *args: Any) -> bool:
        """Send a request that gets no reply (``POSTED``), on the connection of ``epoch`` only: a later
        connection does not hold what an earlier one pinned or reserved. Whether it was sent on that
        connection (the daemon reads it before any later request of this process); never raises."""
        assert op in POSTED
        with self._lock:
            if self._sock is None or epoch != self.epoch:
                return False
            try:
                self._sock.sendall(frame([op, *args]))
                return True
            except (OSError, ProtocolError) as exc:
                try:
                    self._fail(f"{op.name} failed: {exc}")
                except StoreError:
                    pass
                return False

    def close(self) -> None:
        """Close the connection (the daemon gives back what it held); later calls fail."""
        with self._lock:
            self._closed = True
            self._disconnect()

    # --- under the lock ------------------------------------------------------------------------

    def _ready(self) -> socket.socket:
        if self._sock is not None:
            return self._sock
        if self._closed:
            raise StoreError("the node tier is closed")
        if time.monotonic() < self._retry_at:
            raise StoreError(f"the node daemon at {self.path} did not answer lately; retrying soon")
        try:
            return self._connect()
        except (OSError, EOFError, ProtocolError, ConfigError, StoreError) as exc:
            self._fail(f"cannot connect: {exc}")
        raise AssertionError("unreachable")

    def _connect(self) -> socket.socket:
        """Connect, check the daemon's user, say hello, map its slab (the same mapping again where the slab
        is the one mapped already)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(self.timeout)
            try:
                sock.connect(self.path)
            except FileNotFoundError:
                raise StoreError(f"no node daemon socket at {self.path}: is `kvtier node serve` running?") from None
            _, uid, _ = peer_credentials(sock)
            if uid not in self.trusted_uids:
                raise StoreError(
                    f"the node daemon at {self.path} runs as uid {uid}, which this engine does not trust "
                    f"(its own user, root, or the tier's daemon_user)"
                )
            hung_up = StoreError(
                f"the node daemon at {self.path} closed the connection at hello: is this engine's user (uid "
                f"{os.geteuid()}) allowed (node.allow_users in the daemon's YAML)?"
            )
            try:
                sock.sendall(frame([Op.HELLO, VERSION, os.getpid()]))
                head, fds, _, _ = socket.recv_fds(sock, 4096, 1)
            except (ConnectionResetError, BrokenPipeError):
                raise hung_up from None
            try:
                if not head:
                    raise hung_up
                reply = read_frame(sock, head)
                self._hello(reply, fds)
            finally:
                for fd in fds:  # (those ``_hello`` did not map)
                    _close(fd)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self.epoch += 1
        return sock

    def _hello(self, reply: list[Any], fds: list[int]) -> None:
        """Check the daemon's hello and map its slab (the first descriptor, which is then closed)."""
        if reply[0] == ERROR:
            raise StoreError(f"the node daemon at {self.path} refused this engine: {str(reply[1])[:200]}")
        if len(reply) != 6 or reply[1] != VERSION:
            version = reply[1] if len(reply) > 1 else "?"
            raise StoreError(
                f"the node daemon at {self.path} speaks protocol version {version}, this kvtier {VERSION}: "
                f"run the same kvtier release on both sides"
            )
        _, _, slots, slot_bytes, slab_id, node_id = reply
        if not fds:
            raise StoreError(f"the node daemon at {self.path} sent no slab")
        geometry = Geometry(slots, slot_bytes)
        if self._view is not None and self._view.id == slab_id and self._view.geometry == geometry:
            return  # (the descriptor is closed by the caller)
        fd = fds.pop(0)
        self.slab_path = os.readlink(f"/proc/self/fd/{fd}")
        self._view = map_slab(fd, geometry)
        self.geometry = geometry
        self.node_id = str(node_id)

    def _fail(self, why: str) -> None:
        """Close the connection, refuse calls for RETRY_AFTER_S, raise StoreError."""
        if self._sock is not None:
            log.warning("node tier: %s (%s); the connection is closed and reopened later", why, self.path)
        self._disconnect()
        self._retry_at = time.monotonic() + RETRY_AFTER_S
        raise StoreError(f"node daemon at {self.path}: {why}")

    def _disconnect(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
