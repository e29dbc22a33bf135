"""Mooncake Store as kvtier's shared store (``backend: mooncake``): a ``StoreClient`` over one
``MooncakeDistributedStore``.

Mooncake keeps records in memory segments that its clients contribute (a long-lived standalone
``mooncake_client`` in a deployment; an engine may contribute ``segment_size`` of its own, which leaves
with the process); its master only places them. Records move with the zero-copy multi-buffer calls
straight between the host slab and the owners' segments: a record is its header piece and the slot,
one Mooncake object, no staging copy. Over TCP that memory need not be registered (kvtier registers
none; a get into unregistered memory is bit-exact); RDMA would need ``register``, and is untried.

What the wheel (mooncake-transfer-engine 0.3.13) does that shapes this client, measured on loopback:

- Errors are per-key negative codes, never exceptions. -900/-901 mean the master could not be asked
  (dead, or stalled past ``MC_RPC_TIMEOUT_MS``): when every key says so the call raises StoreError,
  otherwise those keys are False.
- The Python calls take no timeout. Against a killed master each call after the first costs about
  4.3 s whatever the settings; a stalled segment owner holds a read or write for up to Mooncake's fixed
  60 s transfer limit. kvtier's deadline is therefore the transfer backend's (it runs these calls on
  threads of its own), never this client's.
- A read abandoned by that limit may still write into its buffers afterwards, until ``close()``
  (``late_writes``). A call that failed sooner did so once each of its transfers had failed or was
  never posted: a refused put (no room, -200), a missing record, an owner that refused the connection
  or sent no status frame within ``MC_TCP_STATUS_TIMEOUT_SEC`` (measured: a get stalled on a stopped
  owner fails in 2 s, one stopped mid-payload in 36 s, and neither writes anything once the owner
  resumes). ``close()`` while another thread is inside a call crashes the process, so calls
  and ``close()`` share a lock: ``close()`` waits for a call in flight to return.
- The calls release the GIL, with two exceptions that would stop every thread of the engine.
  ``setup()`` holds it against a master that does not answer: the first one in a process for all of
  its 4.4 s against a dead master, every one for the RPC timeout against a hung master. So the master's
  port and an HTTP metadata server are tried first, in Python, which releases it. And ``close()`` holds
  it for most of a second (0.81 s measured for a fresh client with nothing registered), so the link
  drops a client only when a failed call may have left a transfer running (``may_write_late``): one
  that lasted long enough for Mooncake's limit to abandon a transfer. A full store refuses puts and
  misses reads all the time; closing a client for each stopped a fleet's engines for half of a run.
- ``batch_put_from_multi_buffers`` keeps the old bytes when the name exists, and this wheel has no
  multi-buffer upsert, so ``put`` removes the names first (forced: every lookup or read grants a record
  a 10 s lease that a plain remove respects). A reader never sees half a record either way; one that
  reads a name while it is being replaced gets a miss or a record that fails kvtier's checksum.
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.core.errors import ClosedError, ConfigError, StoreError
from kvtier.tiers.remote.client import Record, StoreClient

NO_AVAILABLE_HANDLE = -200
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
RPC_FAIL = -900
RPC_TIMEOUT = -901
_UNREACHABLE = (RPC_FAIL, RPC_TIMEOUT)
"""Codes that say the master could not be asked, as opposed to an answer about one record."""
_NO_TRANSFER = (NO_AVAILABLE_HANDLE, OBJECT_NOT_FOUND, OBJECT_ALREADY_EXISTS, *_UNREACHABLE)
"""A record failed with one of these started no transfer: nothing of it can write late."""
TRANSFER_LIMIT_S = 60.0
"""Mooncake gives up on a transfer batch this long after posting it (on the wall clock), without
cancelling it: only then may a transfer outlive its call."""
LATE_AFTER_S = TRANSFER_LIMIT_S / 2
"""A failed call that lasted this long may have met that limit (half of it: room for the wall clock
to step); a shorter one cannot have."""

SETUP_RETRIES = 1
"""Mooncake retries setup 20 times by default: about 90 s against a dead master, 4.4 s with 1."""


def store_class() -> Any:
    """``MooncakeDistributedStore``, imported only when a mooncake tier is built (``factory`` asks
    for it then, so a missing package or library fails the start, not every later call)."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        if "libibverbs" in str(exc):
            raise ConfigError(
                f"backend: mooncake needs Debian's libibverbs1 even for TCP ({exc}); apt-get install -y libibverbs1"
            ) from None
        raise ConfigError(
            f"backend: mooncake needs the mooncake-transfer-engine-non-cuda package ({exc}); "
            f"pip install 'kvtier[remote]'"
        ) from None
    return MooncakeDistributedStore


def _environment(local_hostname: str, timeout: float) -> dict[str, str]:
    """Mooncake's settings that exist only as environment variables, read when a client is set up
    (and, for the status timeout, at every transfer): they apply to the whole process."""
    return {
        # Advertise this address to peers (else the first non-loopback interface's).
        "MC_TCP_BIND_ADDRESS": local_hostname,
        # A stalled master answers -901 after this instead of 30 s.
        "MC_RPC_TIMEOUT_MS": str(max(1, round(timeout * 1000))),
        "MC_STORE_CLIENT_SETUP_RETRIES": str(SETUP_RETRIES),
        # A transfer whose peer sends no status frame in this long is dropped (default 30 s): an owner
        # stalled before it answered frees the call in seconds instead of at the 60 s limit.
        "MC_TCP_STATUS_TIMEOUT_SEC": str(max(1, math.ceil(timeout))),
    }


def _check_reachable(master: str, metadata_server: str, timeout: float) -> None:
    """Raise StoreError unless the master's port accepts a connection and an HTTP metadata server (in
    the master's process in a plain deployment) answers at all, each within ``timeout``."""
    host, _, port = master.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as exc:
        raise StoreError(f"Mooncake master {master} does not accept connections ({exc})") from None
    if metadata_server.startswith(("http://", "https://")):
        try:
            urllib.request.urlopen(metadata_server, timeout=timeout).close()
        except urllib.error.HTTPError as answer:  # it answered (400: no key asked for)
            answer.close()
        except (OSError, ValueError) as exc:
            raise StoreError(f"Mooncake metadata server {metadata_server} does not answer ({exc})") from None


def _pieces(records: Sequence[Record]) -> tuple[list[list[int]], list[list[int]], list[int]]:
    addresses = [[address for address, _ in record] for record in records]
    sizes = [[size for _, size in record] for record in records]
    return addresses, sizes, [sum(piece) for piece in sizes]


class MooncakeClient(StoreClient):
    """One Mooncake Store client, set up as a tier's ``mooncake`` mapping says (``master`` is the
    ``host:port`` of mooncake_master's RPC service); ``timeout`` is the tier's, and bounds what Mooncake
    lets it bound: a stalled master's answer, a silent peer's transfer. Raises StoreError when the master
    does not answer (in about 4.4 s), ConfigError when the wheel or libibverbs1 is missing. With a
    ``fetch_buffer`` (bytes of the client's own for reads) it also ``fetch``es: records read into that
    buffer first, then copied where the caller's ``take`` says, never into the caller's memory late."""

    name = "mooncake"
    late_writes = True

    def __init__(
        self,
        *,
        master: str,
        metadata_server: str,
        timeout: float,
        segment_size: int = 0,
        protocol: str = "tcp",
        local_hostname: str = "127.0.0.1",
        fetch_buffer: int = 0,
    ) -> None:
        store_type = store_class()
        _check_reachable(master, metadata_server, timeout)
        os.environ.update(_environment(local_hostname, timeout))
        self._store = store_type()
        self._lock = threading.Lock()
        self._closed = False
        self._transfer_failed = False  # the last call failed a record whose transfer may have started
        self._last_call_s = 0.0  # how long the last call took
        self._fetches = fetch_buffer > 0
        # local_buffer_size: what ``fetch`` reads into; the zero-copy calls need none (0 without fetches).
        code = self._store.setup(local_hostname, metadata_server, segment_size, fetch_buffer, protocol, "", master)
        if code != 0:
            self._store.close()
            self._closed = True
            raise StoreError(
                f"Mooncake setup against master {master} (metadata {metadata_server}) failed with code {code}"
            )

    def register(self, address: int, size: int) -> None:
        """Register host memory that records' pieces will lie in (the host slab, once: Mooncake refuses a
        range that overlaps one registered before). RDMA moves only registered memory; TCP moves any,
        so kvtier registers nothing yet (the tests register theirs). The registration ends with the
        client (``close()``)."""
        code = self._call(self._store.register_buffer, address, size)
        if code != 0:
            raise StoreError(f"Mooncake could not register {size} bytes at {address:#x} (code {code})")

    def exists(self, names: Sequence[str]) -> list[bool]:
        if not names:
            return []
        codes = self._call(self._store.batch_is_exist, list(names))
        if all(code < 0 for code in codes):
            raise StoreError(f"Mooncake could not say whether records exist (codes {sorted(set(codes))})")
        return [code == 1 for code in codes]

    def put(self, names: Sequence[str], records: Sequence[Record]) -> list[bool]:
        if not names:
            return []
        addresses, sizes, _ = _pieces(records)
        removed = self._answered(self._call(self._store.batch_remove, list(names), True), "replace")
        codes = self._answered(
            self._call(self._store.batch_put_from_multi_buffers, list(names), addresses, sizes), "store"
        )
        # A name whose old record could not be removed may still hold it: the put "succeeds" without storing.
        ok = [code == 0 and gone in (0, OBJECT_NOT_FOUND) for code, gone in zip(codes, removed, strict=True)]
        self._transfer_failed = any(code not in (0, *_NO_TRANSFER) for code in codes)
        return ok

    def get(self, names: Sequence[str], records: Sequence[Record]) -> list[bool]:
        if not names:
            return []
        addresses, sizes, totals = _pieces(records)
        codes = self._answered(
            self._call(self._store.batch_get_into_multi_buffers, list(names), addresses, sizes), "load"
        )
        self._transfer_failed = any(
            code != total and code not in _NO_TRANSFER for code, total in zip(codes, totals, strict=True)
        )
        return [code == total for code, total in zip(codes, totals, strict=True)]

    def fetch(self, names: Sequence[str], size: int, take: Callable[[int, bytes | None], bool]) -> list[bool]:
        """Read the records into the client's fetch buffer (``get_batch``: Mooncake hands back copies), then
        offer each to ``take``; a missing record, one that failed, and one of another size are None. Only a
        client with a fetch buffer fetches."""
        if not self._fetches:
            raise NotImplementedError("this Mooncake client has no fetch buffer (mooncake.fetch_buffer) to fetch into")
        if not names:
            return []
        values = self._call(self._store.get_batch, list(names))
        self._transfer_failed = any(not value for value in values)  # (a failed read may still fill its buffer)
        return [take(i, value if len(value) == size else None) for i, value in enumerate(values)]

    def may_write_late(self) -> bool:
        """Whether the last call may have left a transfer running: it failed a record whose transfer
        may have started (not refused for room, missing, already there, or unasked) and lasted at least
        ``LATE_AFTER_S``. Mooncake's ``close()`` stops every thread of the engine for most of a second."""
        return self._transfer_failed and self._last_call_s >= LATE_AFTER_S

    def remove(self, names: Sequence[str]) -> None:
        if names:
            self._answered(self._call(self._store.batch_remove, list(names), True), "remove")

    def close(self) -> None:
        """Close the store, and with it its registrations and transfers (about a second); waits for a
        call in flight to return first (closing under it crashes the process), so afterwards no
        abandoned transfer writes anywhere."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._store.close()

    def _call(self, method: Callable[..., Any], *args: Any) -> Any:
        with self._lock:
            if self._closed:
                raise ClosedError("the Mooncake client was closed")
            start = time.monotonic()
            try:
                return method(*args)
            finally:
                self._last_call_s = time.monotonic() - start

    @staticmethod
    def _answered(codes: list[int], what: str) -> list[int]:
        """``codes``, unless none of them is an answer: every key says the master could not be asked."""
        if codes and all(code in _UNREACHABLE for code in codes):
            raise StoreError(f"Mooncake could not {what} any record: the master did not answer (code {codes[0]})")
        return codes
