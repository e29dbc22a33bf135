"""Redis or Valkey as kvtier's shared store (``backend: redis``): a ``StoreClient`` over one redis-py
connection (hiredis parses the replies), and the pieces it shares with the Redis Cluster client
(``redis_cluster``): each record's command packed here, and ``Pipe``, pipelined exchanges over one
connection.

One record is one string key, written by ``SET`` (atomic: a reader sees the old record or the new
one, never half of one; the server's own eviction removes whole keys). Every call is one round trip:
its commands are packed here and sent back to back, then the replies read in order.

- Writes send the record's pieces (the header, then the host slot itself) as they are: no copy on
  the way out. redis-py's own command packing would copy a value twice (``bytes()`` of the buffer,
  then hiredis' packer).
- Reads get each value as ``bytes`` from hiredis and copy it once into the record's pieces, only when
  it has exactly the record's size (``get``), or hand it, as it arrives, to the caller's ``take``
  (``fetch``: the caller checks it and copies it, and stops when the call's deadline has passed).
  redis-py cannot read into a buffer it did not allocate.
- RESP2 on purpose: every Redis and Valkey version speaks it, and it needs no ``HELLO`` round trip.
- No retries and no pooling inside: kvtier's link (``link.py``) runs each call with its deadline on a
  thread of its own, drops a client whose call failed and reconnects with backoff. The one exception:
  a connection that was idle when the server restarted fails on first use, so a call that fails
  before any reply arrived is sent once more on a fresh connection (every call here is idempotent).
- ``close()`` is final: every later call raises ClosedError instead of connecting again (redis-py
  would reconnect on the next command), so no call writes into a buffer after it. Calls and ``close()``
  share a lock: a close racing a call waits for it to return (bounded by the socket timeouts).
- The link's deadline is what the engine sees: at the deadline the link ``interrupt``s an abandoned
  call (its sockets are shut down under it, and it sends nothing more), so the thread in it, perhaps
  the engine's own (``StoreLink.run_here``), is back at once. The socket timeout,
  ``SOCKET_TIMEOUT_FACTOR`` times the tier's timeout, is a backstop behind it, so a stalled server
  takes one path (the deadline), not whichever of two equal timers fires first.
"""

from __future__ import annotations

import contextlib
import ctypes
import socket
import threading
from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.connection import Connection, parse_url
from redis.retry import Retry

from kvtier.core.errors import ClosedError, StoreError
from kvtier.tiers.remote.client import Piece, Record, StoreClient, scatter

SOCKET_TIMEOUT_FACTOR = 3
CLIENT_NAME = "kvtier"
"""What ``CLIENT LIST`` shows for kvtier's connections."""
READ_BYTES = 512 * 1024
"""What one read from a server's socket takes at most (redis-py's default: 64 KiB): a block's value
arrives in fewer reads, and each read is a wait for the GIL in a busy process."""
_COALESCE_BELOW = 64 * 1024
"""Chunks smaller than this are joined before they are sent (a small copy instead of one send each)."""

Chunk = bytes | memoryview
"""Bytes to send as they are: packed RESP, or a view of a record's piece (sent without a copy)."""
OnReply = Callable[[int, Any], Any]
"""``on_reply(i, reply)``: what is returned for record ``i``'s reply (not called for an error reply)."""


class PipelinedClient(StoreClient):
    """The StoreClient calls of both Redis clients: one command per record, packed here, and the replies
    turned into answers; ``_exchange`` says how they reach the server(s). Calls and ``close()`` hold one
    lock, and ``close()`` is final (module docstring)."""

    name = "redis"
    interruptible = True
    where: str

    def __init__(self) -> None:
        self._lock = threading.Lock()  # held by a call and by close(), so neither runs under the other
        self._closed = False
        self._stop = threading.Event()  # interrupted: no pipe sends again

    def exists(self, names: Sequence[str]) -> list[bool]:
        replies = self._call(names, [[command(b"EXISTS", name.encode())] for name in names])
        return [reply == 1 for reply in replies]

    def put(self, names: Sequence[str], records: Sequence[Record]) -> list[bool]:
        replies = self._call(names, [_set(name, record) for name, record in zip(names, records, strict=True)])
        return [reply == b"OK" for reply in replies]

    def get(self, names: Sequence[str], records: Sequence[Record]) -> list[bool]:
        def take(i: int, reply: Any) -> bool:
            return _taken(reply, records[i])

        replies = self._call(names, [[command(b"GET", name.encode())] for name in names], take)
        return [reply is True for reply in replies]

    def fetch(self, names: Sequence[str], size: int, take: Callable[[int, bytes | None], bool]) -> list[bool]:
        def value(i: int, reply: Any) -> bool:
            return take(i, reply if isinstance(reply, bytes) and len(reply) == size else None)

        replies = self._call(names, [[command(b"GET", name.encode())] for name in names], value)
        return [reply is True for reply in replies]

    def remove(self, names: Sequence[str]) -> None:
        self._call(names, [[command(b"DEL", name.encode())] for name in names])

    def close(self) -> None:
        """Disconnect for good; waits for a call in flight to return first, so that no reply of it is
        copied into a buffer after this returns. Closing again does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._disconnect()

    def interrupt(self) -> None:
        """Shut the sockets down under the call in progress (its read or write fails at once) and make
        every later send fail; not under the lock, which that call holds."""
        self._stop.set()
        for pipe in self._pipes():
            pipe.shutdown()

    def _call(self, names: Sequence[str], commands: list[list[Chunk]], on_reply: OnReply | None = None) -> list[Any]:
        """Each record's reply, in order (``_exchange``); raises ClosedError after ``close()``."""
        with self._lock:
            if self._closed:
                raise ClosedError(f"the client of {self.where} was closed")
            return self._exchange(names, commands, on_reply) if names else []

    @abstractmethod
    def _exchange(self, names: Sequence[str], commands: list[list[Chunk]], on_reply: OnReply | None) -> list[Any]:
        """Send record ``i``'s ``commands[i]`` and return its reply: ``on_reply(i, reply)`` where given,
        the reply itself otherwise, an error reply as its exception, None where none came. Raises
        StoreError when nothing could be asked."""

    @abstractmethod
    def _disconnect(self) -> None: ...

    @abstractmethod
    def _pipes(self) -> list[Pipe]:
        """The connections open now (for ``interrupt``, from another thread)."""


class RedisClient(PipelinedClient):
    """One connection to the Redis/Valkey server at ``url``; ``password`` is the secret itself (read from
    the environment variable the config names), never logged: redis-py keeps it out of reprs and errors."""

    def __init__(self, url: str, *, timeout: float, password: str | None = None, ca_file: str | None = None) -> None:
        super().__init__()
        options = connection_options(url, timeout=timeout, password=password, ca_file=ca_file)
        self._pipe = Pipe(options, self._stop)
        self.where = self._pipe.where

    def _exchange(self, names: Sequence[str], commands: list[list[Chunk]], on_reply: OnReply | None) -> list[Any]:
        """One round trip. An error reply stands for its command, the connection staying in step; when
        every reply is one (an unauthenticated connection, say) the store could not be asked: StoreError.
        A failure after some replies arrived returns those and None for the rest; one before any raises
        StoreError, except on a connection that had worked before: the server dropped it while it was
        idle (a restart), so the commands go once more on a new one."""
        chunks = coalesced([chunk for command in commands for chunk in command])
        replies = self._pipe.exchange(chunks, len(names), on_reply)
        if replies.dropped:
            replies = self._pipe.exchange(chunks, len(names), on_reply)
        if replies.failure is not None and not replies.arrived:
            raise StoreError(f"{self.where}: {replies.failure}")
        if all(isinstance(reply, Exception) for reply in replies.values):
            raise StoreError(f"{self.where} refused every command: {replies.values[0]}")
        return replies.values

    def _disconnect(self) -> None:
        self._pipe.disconnect()

    def _pipes(self) -> list[Pipe]:
        return [self._pipe]


def connection_options(url: str, *, timeout: float, password: str | None, ca_file: str | None) -> dict[str, Any]:
    """redis-py ``Connection`` arguments for the server at ``url`` (its class under ``connection_class``):
    no retries, RESP2, kvtier's client name, the socket timeout a backstop behind the tier's ``timeout``."""
    options: dict[str, Any] = parse_url(url)
    options.update(
        password=password,
        socket_timeout=timeout * SOCKET_TIMEOUT_FACTOR,
        socket_connect_timeout=timeout,
        socket_read_size=READ_BYTES,
        retry=Retry(NoBackoff(), 0),
        protocol=2,
        client_name=CLIENT_NAME,
    )
    if ca_file is not None:
        options["ssl_ca_certs"] = ca_file
    return options


@dataclass
class Replies:
    """What came back for a batch sent on a ``Pipe``."""

    values: list[Any]
    """One per command, in order: ``on_reply``'s answer, an error reply as its exception, None if none came."""
    arrived: int
    """How many replies came before ``failure``."""
    failure: redis.RedisError | None = None
    """What broke the connection, if something did (it is disconnected then)."""
    dropped: bool = False
    """It broke before any reply on a connection that had worked: the server dropped it while it was idle
    (a restart), so the same commands may go once more (``Pipe`` reconnects on the next send)."""


class Pipe:
    """Pipelined exchanges over one redis-py connection, opened on the first send: ``send`` packed
    commands in one go, then ``receive`` their replies in order. Split in two so that a client of several
    servers sends to all of them before it reads any (their round trips overlap). Once ``stop`` is set
    (its client interrupted) every send fails."""

    def __init__(self, options: dict[str, Any], stop: threading.Event) -> None:
        options = dict(options)
        connection_class = options.pop("connection_class", Connection)
        self.where = f"redis at {options.get('host', '?')}:{options.get('port', 6379)}"
        self._connection = connection_class(**options)
        self._used = False  # a reply came back on the current connection
        self._failure: redis.RedisError | None = None  # what broke the last send
        self._stop = stop

    def send(self, chunks: list[Chunk]) -> None:
        """Send ``chunks`` (whole commands); a failure is kept for ``receive`` to report."""
        if self._stop.is_set():
            self._failure = redis.ConnectionError(f"the call on {self.where} was interrupted")
            return
        try:
            self._connection.send_packed_command(chunks, check_health=False)
            self._failure = None
        except redis.RedisError as exc:
            self._failure = exc
            self._connection.disconnect()

    def receive(self, count: int, on_reply: OnReply | None = None, wait: Callable[[], float] | None = None) -> Replies:
        """The replies of the ``count`` commands sent last, ``on_reply(i, reply)`` applied to each as it
        arrives. With ``wait``, a first reply not begun within ``wait()`` seconds is a timeout; the socket
        timeout bounds each read either way (asking before every reply costs three system calls, each a
        wait for the GIL in a busy process). Any failure disconnects (no late reply is read)."""
        values: list[Any] = []
        failure, self._failure = self._failure, None
        if failure is None:
            try:
                while len(values) < count:
                    if wait is not None and not values and not self._connection.can_read(wait()):
                        raise redis.TimeoutError(f"no reply from {self.where} in time")
                    try:
                        reply = self._connection.read_response()
                    except redis.ResponseError as exc:
                        reply = exc
                    if on_reply is not None and not isinstance(reply, Exception):
                        reply = on_reply(len(values), reply)
                    values.append(reply)
                    self._used = True
            except redis.RedisError as exc:
                failure = exc
                self._connection.disconnect()
        arrived = len(values)
        if failure is None:
            return Replies(values, arrived)
        reused, self._used = self._used, False
        dropped = not arrived and reused and isinstance(failure, redis.ConnectionError)
        return Replies(values + [None] * (count - arrived), arrived, failure, dropped)

    def exchange(self, chunks: list[Chunk], count: int, on_reply: OnReply | None = None) -> Replies:
        """One round trip: ``send``, then ``receive``."""
        self.send(chunks)
        return self.receive(count, on_reply)

    def disconnect(self) -> None:
        self._connection.disconnect()

    def shutdown(self) -> None:
        """From another thread: end a read or write in progress on this connection (it fails at once).
        The plain socket's shutdown, also under TLS: ``SSLSocket.shutdown`` would drop its TLS state
        under the reading thread."""
        sock = self._connection._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                socket.socket.shutdown(sock, socket.SHUT_RDWR)


def command(*args: bytes) -> bytes:
    """One RESP command of plain arguments."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(arg), arg) for arg in args)


def _set(name: str, record: Record) -> list[Chunk]:
    """``SET name <record>``, the record's pieces sent as they are (no copy)."""
    encoded = name.encode()
    size = sum(size for _, size in record)
    return [
        b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(encoded), encoded, size),
        *(_view(piece) for piece in record),
        b"\r\n",
    ]


def _taken(reply: Any, record: Record) -> bool:
    """Copy a GET's value into the record's pieces if it has exactly their size; whether it had."""
    if not isinstance(reply, bytes) or len(reply) != sum(size for _, size in record):
        return False
    scatter(reply, record)
    return True


def _view(piece: Piece) -> memoryview:
    address, size = piece
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


def coalesced(chunks: list[Chunk]) -> list[Chunk]:
    """The chunks with runs of small ones joined: each chunk is one send."""
    out: list[Chunk] = []
    small: list[Chunk] = []
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
