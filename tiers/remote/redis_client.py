"""Redis or Valkey as kvtier's shared store (``backend: redis``): a ``StoreClient`` over one redis-py
connection (hiredis parses the replies).

One record is one string key, written by ``SET`` (atomic: a reader sees the old record or the new
one, never half of one; the server's own eviction removes whole keys). Every call is one round trip:
its commands are packed here and sent back to back, then the replies read in order.

- Writes send the record's pieces (the header, then the host slot itself) as they are: no copy on
  the way out. redis-py's own command packing would copy a value twice (``bytes()`` of the buffer,
  then hiredis' packer).
- Reads get each value as ``bytes`` from hiredis and copy it once into the record's pieces, only when
  it has exactly the record's size. redis-py cannot read into a buffer it did not allocate.
- RESP2 on purpose: every Redis and Valkey version speaks it, and it needs no ``HELLO`` round trip.
- No retries and no pooling inside: kvtier's link (``link.py``) runs each call with its deadline on a
  thread of its own, drops a client whose call failed and reconnects with backoff. The one exception:
  a connection that was idle when the server restarted fails on first use, so a call that fails
  before any reply arrived is sent once more on a fresh connection (every call here is idempotent).
- ``close()`` is final: every later call raises ClosedError instead of connecting again (redis-py
  would reconnect on the next command), so no call writes into a buffer after it. Calls and ``close()``
  share a lock: a close racing a call waits for it to return (bounded by the socket timeouts).
- The socket timeout is a backstop, ``SOCKET_TIMEOUT_FACTOR`` times the tier's timeout: the link's
  deadline is what the engine sees; the socket timeout ends the abandoned call later, so a stalled
  server takes one path (the deadline), not whichever of two equal timers fires first.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.connection import Connection, parse_url
from redis.retry import Retry

from kvtier.core.errors import ClosedError, StoreError
from kvtier.tiers.remote.client import Piece, Record, StoreClient

SOCKET_TIMEOUT_FACTOR = 3
CLIENT_NAME = "kvtier"
"""What ``CLIENT LIST`` shows for kvtier's connections."""
_COALESCE_BELOW = 64 * 1024
"""Chunks smaller than this are joined before they are sent (a small copy instead of one send each)."""


class RedisClient(StoreClient):
    """One connection to the Redis/Valkey server at ``url``; ``password`` is the secret itself (read from
    the environment variable the config names), never logged: redis-py keeps it out of reprs and errors."""

    name = "redis"

    def __init__(self, url: str, *, timeout: float, password: str | None = None, ca_file: str | None = None) -> None:
        options: dict[str, Any] = parse_url(url)
        connection_class = options.pop("connection_class", Connection)
        options.update(
            password=password,
            socket_timeout=timeout * SOCKET_TIMEOUT_FACTOR,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
            protocol=2,
            client_name=CLIENT_NAME,
        )
        if ca_file is not None:
            options["ssl_ca_certs"] = ca_file
        self.where = f"redis at {options.get('host', '?')}:{options.get('port', 6379)}"
        self._connection = connection_class(**options)
        self._used = False  # a reply came back on the current connection
        self._lock = threading.Lock()  # held by a call and by close(), so neither runs under the other
        self._closed = False

    def exists(self, names: Sequence[str]) -> list[bool]:
        return [reply == 1 for reply in self._exchange([_command(b"EXISTS", name.encode()) for name in names])]

    def put(self, names: Sequence[str], records: Sequence[Record]) -> list[bool]:
        chunks: list[bytes | memoryview] = []
        for name, record in zip(names, records, strict=True):
            encoded = name.encode()
            size = sum(size for _, size in record)
            chunks.append(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(encoded), encoded, size))
            chunks.extend(_view(piece) for piece in record)
            chunks.append(b"\r\n")
        return [reply == b"OK" for reply in self._exchange(_coalesced(chunks), len(names))]

    def get(self, names: Sequence[str], records: Sequence[Record]) -> list[bool]:
        sizes = [sum(size for _, size in record) for record in records]

        def take(i: int, reply: Any) -> bool:
            if not isinstance(reply, bytes) or len(reply) != sizes[i]:
                return False
            _scatter(reply, records[i])
            return True

        ok = [False] * len(names)
        replies = self._exchange([_command(b"GET", name.encode()) for name in names], on_reply=take)
        for i, reply in enumerate(replies):
            ok[i] = reply is True
        return ok

    def remove(self, names: Sequence[str]) -> None:
        if names:
            self._exchange([_command(b"DEL", *(name.encode() for name in names))])

    def close(self) -> None:
        """Disconnect for good; waits for a call in flight to return first, so that no reply of it is
        copied into a buffer after this returns. Closing again does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._connection.disconnect()

    def _exchange(
        self,
        commands: list[bytes | memoryview],
        count: int | None = None,
        on_reply: Callable[[int, Any], Any] | None = None,
    ) -> list[Any]:
        """Send ``commands`` (``count`` of them; one per entry when None) in one go and read their
        replies in order; ``on_reply(i, reply)`` turns each reply into what is returned for it as it
        arrives. An error reply stands for its command, the connection staying in step; when every
        reply is one (an unauthenticated connection, say) the store could not be asked: StoreError. A
        failure after some replies arrived returns those and None for the rest; one before any raises
        StoreError, except on a connection that had worked before: the server dropped it while it was
        idle (a restart), so the commands go once more on a new one. Raises ClosedError after ``close()``."""
        count = len(commands) if count is None else count
        with self._lock:
            if self._closed:
                raise ClosedError(f"the client of {self.where} was closed")
            if not count:
                return []
            try:
                return self._round_trip(commands, count, on_reply)
            except _Dropped:
                return self._round_trip(commands, count, on_reply)

    def _round_trip(
        self, commands: list[bytes | memoryview], count: int, on_reply: Callable[[int, Any], Any] | None
    ) -> list[Any]:
        out: list[Any] = []
        try:
            self._connection.send_packed_command(commands, check_health=False)
            while len(out) < count:
                try:
                    reply = self._connection.read_response()
                except redis.ResponseError as exc:
                    reply = exc
                out.append(reply if on_reply is None or isinstance(reply, Exception) else on_reply(len(out), reply))
                self._used = True
        except redis.RedisError as exc:
            self._connection.disconnect()
            reused, self._used = self._used, False
            if out:
                return out + [None] * (count - len(out))
            if reused and isinstance(exc, redis.ConnectionError):
                raise _Dropped from None
            raise StoreError(f"{self.where}: {exc}") from None
        if all(isinstance(reply, Exception) for reply in out):
            raise StoreError(f"{self.where} refused every command: {out[0]}")
        return out


class _Dropped(Exception):
    """A connection that had worked failed before any reply: the server dropped it while it was idle."""


def _command(*args: bytes) -> bytes:
    """One RESP command of plain arguments."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(arg), arg) for arg in args)


def _view(piece: Piece) -> memoryview:
    address, size = piece
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


def _coalesced(chunks: list[bytes | memoryview]) -> list[bytes | memoryview]:
    """The chunks with runs of small ones joined: each chunk is one send."""
    out: list[bytes | memoryview] = []
    small: list[bytes | memoryview] = []
    for chunk in chunks:
        if len(chunk) < _COALESCE_BELOW:
            small.append(chunk)
            continue
        if small:
            out.append(b"".join(small))
            small = []
        out.append(chunk)
    if small:
        out.append(b"".join(small))
    return out


def _scatter(value: bytes, record: Record) -> None:
    """Copy a value into the record's pieces (one memmove per piece, outside the GIL)."""
    source = np.frombuffer(value, np.uint8).ctypes.data
    at = 0
    for address, size in record:
        ctypes.memmove(address, source + at, size)
        at += size
