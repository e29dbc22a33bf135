"""The node daemon's wire protocol: control messages only, on a Unix stream socket (the bytes of blocks
move through the shared slab, copied by the engines themselves).

A frame is a 4-byte little-endian length and a msgpack array, at most ``MAX_FRAME`` bytes. A request is
``[op, *args]``; every op but the posted ones (``POSTED``: releases, touches, commits, aborts, drops,
whose outcome the engine does not wait for: the daemon reads them before that engine's next request)
gets one reply, ``[OK, *results]`` or ``[ERROR, message]``, in order. Keys
on the wire are node keys (``NODE_KEY_BYTES``, bound to the engine's namespace), at most ``MAX_KEYS``
per message: a batch is one round trip per request phase.

    HELLO   [version, pid]           -> [OK, version, slots, slot_bytes, slab id, node id] and the slab's fd
    LOOKUP  [keys]                   -> [OK, [[slot, gen], [] or None per key]]  (READY: where, [] below the slab)
    PIN     [keys, length]           -> [OK, [[slot, gen] or None per key]]  (pinned by this connection; a
                                        block of a tier below comes up into the slab first, ``length`` bytes)
    RELEASE [keys]                   (unpins this connection's pins)
    TOUCH   [keys]                   (blocks read without a pin: a use, for the slab's policy)
    RESERVE [keys, lengths, tags]    -> [OK, [[slot, gen], [slot, gen, HELD], [HELD] or BUSY / FULL / DECLINED]]
                                        (``tags``: each block's tenant, its key's tag or b"", for the slab's shares)
    COMMIT  [keys]                   (publishes this connection's reservations: READY from then on)
    ABORT   [keys]                   (gives this connection's reservations back)
    DROP    [[key, gen], ...]        (a load found these blocks damaged: unreadable for everyone)
    STATS   []                       -> [OK, {name: number}]

Everything a peer sends is checked here (``request``): a message that is not a known op with arguments
of the right kinds and sizes raises ProtocolError, and the daemon closes that connection.
"""

from __future__ import annotations

import enum
import socket
import struct
from typing import Any

import msgpack

from kvtier.core.keys import TENANT_TAG_BYTES
from kvtier.tiers.node.slab import NODE_KEY_BYTES

VERSION = 2
"""Bumped whenever a message changes: a daemon and an engine of different versions refuse each other."""
MAX_FRAME = 1 << 20
MAX_KEYS = 16384
_LENGTH = struct.Struct("<I")


class Op(enum.IntEnum):
    HELLO = 1
    LOOKUP = 2
    PIN = 3
    RELEASE = 4
    RESERVE = 5
    COMMIT = 6
    ABORT = 7
    DROP = 8
    STATS = 9
    TOUCH = 10


POSTED = frozenset({Op.RELEASE, Op.TOUCH, Op.COMMIT, Op.ABORT, Op.DROP})
"""Ops that get no reply."""

OK, ERROR = 0, 1
HELD, BUSY, FULL, DECLINED = 1, 2, 3, 4
"""Why a RESERVE gave a key no slot: the daemon holds the block already (READY: ``[slot, gen, HELD]``, where
it is in the slab, or ``[HELD]``, in a tier below it), another writer is storing it, no room (every slot
pinned or being written, or the connection holds its share), the slab's policy does not admit it
(``adaptive``'s filter: a block is stored once it was asked for twice)."""


def is_slot_gen(answer: object) -> bool:
    """Whether a daemon's answer for a block is ``[slot, generation]``, a place to read or write it (else:
    not held, held below the slab, or not granted)."""
    return isinstance(answer, list) and len(answer) == 2 and all(type(v) is int for v in answer)


class ProtocolError(Exception):
    """A malformed, oversized or unexpected message: the connection that sent it is closed."""


def frame(message: list[Any]) -> bytes:
    """``message`` as one frame."""
    body = msgpack.packb(message, use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"a message of {len(body)} bytes is over the {MAX_FRAME}-byte limit")
    return _LENGTH.pack(len(body)) + body


def read_frame(sock: socket.socket, head: bytes = b"") -> list[Any]:
    """The next message from ``sock`` (``head``: bytes of it received already). Raises EOFError when the
    peer closed between messages, ProtocolError for a frame over the limit, a peer that closed inside
    one, or a body that is not one msgpack array; socket errors (a timeout among them) pass through."""
    header = head[: _LENGTH.size] + _read_exactly(sock, _LENGTH.size - len(head[: _LENGTH.size]), not head)
    (length,) = _LENGTH.unpack(header)
    if length > MAX_FRAME:
        raise ProtocolError(f"a frame of {length} bytes is over the {MAX_FRAME}-byte limit")
    body = head[_LENGTH.size :]
    if len(body) > length:
        raise ProtocolError("more bytes came with a frame than it holds")
    return decode(body + _read_exactly(sock, length - len(body), False))


def _read_exactly(sock: socket.socket, n: int, between: bool) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 16))
        if not chunk:
            if between and left == n:
                raise EOFError("the peer closed the connection")
            raise ProtocolError("the peer closed the connection inside a frame")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def decode(body: bytes) -> list[Any]:
    """A frame's body as a list; ProtocolError for anything else (bounded: no container or string may
    be larger than a frame allows, no extension types)."""
    try:
        message = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            max_bin_len=MAX_FRAME,
            max_str_len=MAX_FRAME,
            max_array_len=MAX_KEYS + 8,
            max_map_len=256,
            max_ext_len=0,
        )
    except Exception as exc:  # (msgpack raises several kinds for bad input)
        raise ProtocolError(f"not a msgpack message: {type(exc).__name__}") from None
    if not isinstance(message, list) or not message:
        raise ProtocolError(f"a message must be a non-empty array, got {type(message).__name__}")
    return message


# --- requests, as the daemon checks them -------------------------------------------------------------


def request(message: list[Any]) -> tuple[Op, list[Any]]:
    """The op and checked arguments of a request; ProtocolError for anything malformed."""
    try:
        op = Op(message[0])
    except (ValueError, TypeError):
        raise ProtocolError(f"unknown op {str(message[0])[:40]!r}") from None
    args = message[1:]
    if op is Op.HELLO:
        return op, [_int(v, "HELLO's version and pid", 0, 2**31) for v in _count(args, 2, op)]
    if op is Op.STATS:
        _count(args, 0, op)
        return op, []
    if op is Op.DROP:
        (pairs,) = _count(args, 1, op)
        return op, [[_pair(p) for p in _list(pairs, op)]]
    if op is Op.PIN:
        keys, length = _count(args, 2, op)
        return op, [_keys(keys, op), _int(length, "a block length", 1, 2**32 - 1)]
    if op is Op.RESERVE:
        keys, lengths, tags = _count(args, 3, op)
        keys, lengths = _keys(keys, op), [_int(n, "a block length", 1, 2**32 - 1) for n in _list(lengths, op)]
        tags = _list(tags, op)
        if not all(isinstance(tag, bytes) and len(tag) in (0, TENANT_TAG_BYTES) for tag in tags):
            raise ProtocolError(f"RESERVE's tenant tags must be empty or {TENANT_TAG_BYTES}-byte strings")
        if not len(lengths) == len(tags) == len(keys):
            raise ProtocolError(f"RESERVE of {len(keys)} keys with {len(lengths)} lengths and {len(tags)} tags")
        return op, [keys, lengths, tags]
    (keys,) = _count(args, 1, op)
    return op, [_keys(keys, op)]


def _count(args: list[Any], n: int, op: Op) -> list[Any]:
    if len(args) != n:
        raise ProtocolError(f"{op.name} takes {n} arguments, got {len(args)}")
    return args


def _list(value: Any, op: Op) -> list[Any]:
    if not isinstance(value, list) or len(value) > MAX_KEYS:
        raise ProtocolError(f"{op.name} needs a list of at most {MAX_KEYS} items")
    return value


def _keys(value: Any, op: Op) -> list[bytes]:
    keys = _list(value, op)
    if not all(isinstance(key, bytes) and len(key) == NODE_KEY_BYTES for key in keys):
        raise ProtocolError(f"{op.name}'s keys must be {NODE_KEY_BYTES}-byte strings")
    if len(set(keys)) != len(keys):
        raise ProtocolError(f"{op.name} names a key twice")
    return keys


def _int(value: Any, what: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ProtocolError(f"{what} must be an integer in [{low}, {high}]")
    return value


def _pair(value: Any) -> tuple[bytes, int]:
    if not isinstance(value, list) or len(value) != 2:
        raise ProtocolError("DROP names [key, generation] pairs")
    key, gen = value
    if not isinstance(key, bytes) or len(key) != NODE_KEY_BYTES:
        raise ProtocolError(f"DROP's keys must be {NODE_KEY_BYTES}-byte strings")
    return key, _int(gen, "a generation", 0, 2**64 - 1)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket, from the kernel."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid
