"""A Redis Cluster as kvtier's shared store (``backend: redis`` with ``cluster: true``): a ``StoreClient``
over one connection per master node, the records spread over the cluster's 16384 hash slots.

- The topology (which master serves which slot) comes from ``CLUSTER SLOTS``, asked of the first node
  that answers: the masters known, then ``url`` and the seeds, then the replicas known. It is asked at
  the first call, after a node failed, after a MOVED, and when a failed node's backoff ends (its slots
  may have gone to a promoted replica meanwhile).
- A record's slot is ``redis.crc.key_slot`` of its name. A call groups its records' commands by master
  and sends every master its batch before it reads any reply: one pipelined round trip per node per
  call, the nodes' round trips overlapping (``round_trips`` counts them).
- MOVED: the slot map is asked again and the record sent once more, to the node MOVED names; ASK: once
  more to the node named, after ``ASKING``. A record redirected again, or answered TRYAGAIN or
  CLUSTERDOWN, fails (False): no retry loop; the engine recomputes its block.
- A node that fails (refused, reset, silent) fails its own records only. Waiting for replies is bounded
  by ``REPLY_SHARE`` of the tier's timeout for the whole call (a reply already on its way gets
  ``GRACE_SHARE`` more), so the call returns before the link's deadline with the other nodes' answers.
  The node is then down for a backoff (doubling up to the link's maximum) in which its records fail at
  once, without asking it. StoreError only when no node could be asked and no master answered lately
  (``ALIVE_FOR_S``): a call for a dead master's records alone is then a miss for them.
- Each connection is a ``redis_client.Pipe`` (the same packing and zero-copy writes as ``RedisClient``,
  the same single resend of a batch whose connection had been dropped while idle), and every node gets
  the options of ``url``: password, TLS and its CA.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any
from urllib.parse import urlsplit

from redis.crc import key_slot
from redis.exceptions import AskError, MovedError

from kvtier.core.errors import StoreError
from kvtier.tiers.remote.link import FIRST_BACKOFF_S, MAX_BACKOFF_S
from kvtier.tiers.remote.redis_client import (
    Chunk,
    OnReply,
    Pipe,
    PipelinedClient,
    Replies,
    coalesced,
    command,
    connection_options,
)

SLOTS = 16384
REPLY_SHARE = 0.75
"""How much of the tier's timeout a call waits for replies in all (and any one socket operation takes)."""
GRACE_SHARE = 0.1
"""How much of the tier's timeout a node's reply may still take once the call's waiting time is spent."""
_ASKING = command(b"ASKING")
_CLUSTER_SLOTS = command(b"CLUSTER", b"SLOTS")

ALIVE_FOR_S = 10.0
"""How long a node's last answer says it is up, when a call could ask none of the nodes it needed."""
Address = tuple[str, int]
Route = list[tuple[int, bool]]
"""One node's share of a call: (record index, whether ``ASKING`` goes before its command)."""


class _Node:
    """One node as this client sees it: its connection (opened on first use) and its backoff."""

    def __init__(self, address: Address, options: dict[str, Any], stop: threading.Event) -> None:
        self.pipe = Pipe({**options, "host": address[0], "port": address[1]}, stop)
        self.backoff = 0.0
        self.down_until = 0.0
        self.answered_at = -ALIVE_FOR_S  # when it last answered

    def down(self, now: float) -> bool:
        return now < self.down_until

    def alive(self, now: float) -> bool:
        """Answered within ``ALIVE_FOR_S`` and not failed since."""
        return not self.down(now) and now - self.answered_at < ALIVE_FOR_S

    def failed(self) -> None:
        self.backoff = min(MAX_BACKOFF_S, self.backoff * 2 or FIRST_BACKOFF_S)
        self.down_until = time.monotonic() + self.backoff

    def answered(self) -> None:
        self.backoff = self.down_until = 0.0
        self.answered_at = time.monotonic()


class RedisClusterClient(PipelinedClient):
    """The Redis Cluster that ``url``'s node (or, when it is down, one of ``seeds``) belongs to; every node
    is reached with ``url``'s options, ``password`` and ``ca_file`` (see ``RedisClient``)."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float,
        password: str | None = None,
        ca_file: str | None = None,
        seeds: Sequence[str] = (),
    ) -> None:
        super().__init__()
        self._reply_within = REPLY_SHARE * timeout
        self._grace = GRACE_SHARE * timeout
        self._options = connection_options(url, timeout=timeout, password=password, ca_file=ca_file)
        self._options.update(socket_timeout=self._reply_within, socket_connect_timeout=self._reply_within)
        self._options.pop("db", None)  # a cluster has database 0 only
        self._seeds = [_address(seed) for seed in (url, *seeds)]
        self.where = f"redis cluster at {self._seeds[0][0]}:{self._seeds[0][1]}"
        self._owners: list[Address | None] = [None] * SLOTS  # the master serving each slot, as last told
        self._masters: set[Address] = set()
        self._replicas: list[Address] = []
        self._nodes: dict[Address, _Node] = {}
        self._stale = True  # the slot map must be asked for before the next call
        self.round_trips = 0  # batches sent to a node (one per node per call, plus redirects and resends)
        self.topology_queries = 0  # CLUSTER SLOTS asked

    def _exchange(self, names: Sequence[str], commands: list[list[Chunk]], on_reply: OnReply | None) -> list[Any]:
        """One round to the masters the slot map names, then at most one more for the records redirected
        (MOVED, ASK); what is redirected again stays an error reply (False)."""
        wait = _waiting(time.monotonic() + self._reply_within, self._grace)
        self._refresh_if_due(wait)
        slots = [key_slot(name.encode()) for name in names]
        replies: list[Any] = [None] * len(names)
        answered = self._round(
            _routes((self._owners[slot], False, i) for i, slot in enumerate(slots)), commands, on_reply, replies, wait
        )
        moved = [i for i, reply in enumerate(replies) if isinstance(reply, MovedError)]
        asked = [
            i for i, reply in enumerate(replies) if isinstance(reply, AskError) and not isinstance(reply, MovedError)
        ]
        if moved:
            self._refresh(wait)  # where it fails, MOVED's own address still takes the record
            for i in moved:
                self._owners[slots[i]] = replies[i].node_addr
                self._masters.add(replies[i].node_addr)
        if moved or asked:
            redirected = [(self._owners[slots[i]], False, i) for i in moved] + [
                (replies[i].node_addr, True, i) for i in asked
            ]
            answered |= self._round(_routes(redirected), commands, on_reply, replies, wait)
        if not answered and not self._any_master_up():
            raise StoreError(f"{self.where}: no node could be asked, and no master answered lately")
        return replies  # (records of a node that is down: None, a miss; the link stays up for the others)

    def _any_master_up(self) -> bool:
        """Whether some master answered lately and has not failed since: then a call whose records all
        lie on dead nodes is a miss for them, not a failure that would take the link down for every
        node's records. A cluster none of whose masters answered lately is down as a whole."""
        now = time.monotonic()
        return any(address in self._nodes and self._nodes[address].alive(now) for address in self._masters)

    def _round(
        self,
        routes: dict[Address | None, Route],
        commands: list[list[Chunk]],
        on_reply: OnReply | None,
        replies: list[Any],
        wait: Callable[[], float],
    ) -> bool:
        """Send each node (not down) its records' commands, then read each node's replies into ``replies``
        (records of a node that failed, is down or unknown stay None); whether any node answered."""
        now = time.monotonic()
        sent: list[tuple[_Node, list[Chunk], list[int | None]]] = []
        for address, route in routes.items():
            node = None if address is None else self._node(address)
            if node is None or node.down(now):
                continue
            chunks, owners = _batch(route, commands)
            node.pipe.send(chunks)
            self.round_trips += 1
            sent.append((node, chunks, owners))
        answered = False
        for node, chunks, owners in sent:
            got = self._receive(node, chunks, len(owners), _for_records(owners, on_reply), wait)
            answered |= got.arrived > 0
            for reply, record in zip(got.values, owners, strict=True):
                if record is not None:
                    replies[record] = reply
        return answered

    def _receive(
        self, node: _Node, chunks: list[Chunk], count: int, on_reply: OnReply | None, wait: Callable[[], float]
    ) -> Replies:
        """The replies of what was just sent to ``node``, sent once more where its connection had been
        dropped while idle; a node that failed is down for its backoff, and the slot map is asked again."""
        got = node.pipe.receive(count, on_reply, wait)
        if got.dropped:
            node.pipe.send(chunks)
            self.round_trips += 1
            got = node.pipe.receive(count, on_reply, wait)
        if got.failure is None:
            node.answered()
        else:
            node.failed()
            self._stale = True
        return got

    def _refresh_if_due(self, wait: Callable[[], float]) -> None:
        """Ask for the slot map when it is stale or a failed master may be tried again (its slots may
        have moved); StoreError while no node ever told it."""
        now = time.monotonic()
        failed = (self._nodes.get(address) for address in self._masters)
        why = "every node known is down"
        if self._stale or any(node is not None and node.backoff and not node.down(now) for node in failed):
            why = self._refresh(wait) or why
        if not self._masters:
            raise StoreError(f"{self.where}: no node told which node serves which slot ({why})")

    def _refresh(self, wait: Callable[[], float]) -> str | None:
        """Ask the first node that answers for the slot map (the old map stays when none does) and drop
        the connections of nodes no longer in it; None once one told it, else why the last one asked did
        not (never a secret: redis-py keeps the password out of its errors)."""
        now = time.monotonic()
        why = None
        for address in dict.fromkeys([*sorted(self._masters), *self._seeds, *self._replicas]):
            node = self._node(address)
            if node.down(now):
                continue
            node.pipe.send([_CLUSTER_SLOTS])
            self.topology_queries += 1
            got = self._receive(node, [_CLUSTER_SLOTS], 1, None, wait)
            try:
                owners, replicas = _slot_map(got.values[0], address)
            except (TypeError, ValueError) as exc:  # no answer, an error reply, or not a slot map
                why = f"{node.pipe.where}: {got.failure or exc}"
                continue
            self._owners, self._replicas = owners, replicas
            self._masters = {owner for owner in owners if owner is not None}
            self._stale = False
            for gone in set(self._nodes) - self._masters - set(self._seeds) - set(replicas):
                self._nodes.pop(gone).pipe.disconnect()
            return None
        return why

    def _node(self, address: Address) -> _Node:
        node = self._nodes.get(address)
        if node is None:
            node = self._nodes[address] = _Node(address, self._options, self._stop)
        return node

    def _disconnect(self) -> None:
        for node in self._nodes.values():
            node.pipe.disconnect()

    def _pipes(self) -> list[Pipe]:
        return [node.pipe for node in list(self._nodes.values())]  # (list(): one step under the GIL)


def _address(url: str) -> Address:
    parts = urlsplit(url)
    return parts.hostname or "localhost", parts.port or 6379


def _waiting(deadline: float, grace: float) -> Callable[[], float]:
    """How long a reply may still be waited for: until ``deadline``, and at least ``grace``."""
    return lambda: max(deadline - time.monotonic(), grace)


def _routes(destinations: Iterable[tuple[Address | None, bool, int]]) -> dict[Address | None, Route]:
    """(node, asking, record index) grouped by node, in record order."""
    routes: dict[Address | None, Route] = {}
    for address, asking, i in destinations:
        routes.setdefault(address, []).append((i, asking))
    return routes


def _batch(route: Route, commands: list[list[Chunk]]) -> tuple[list[Chunk], list[int | None]]:
    """One node's commands to send in one go (``ASKING`` before each it is asked to take during a
    migration), and the record each of its replies answers (None: an ``ASKING``'s)."""
    chunks: list[Chunk] = []
    owners: list[int | None] = []
    for i, asking in route:
        if asking:
            chunks.append(_ASKING)
            owners.append(None)
        chunks.extend(commands[i])
        owners.append(i)
    return coalesced(chunks), owners


def _for_records(owners: list[int | None], on_reply: OnReply | None) -> OnReply | None:
    """``on_reply`` of a node's j-th reply as that of the record it answers (an ASKING's reply is kept)."""
    if on_reply is None:
        return None

    def take(j: int, reply: Any) -> Any:
        i = owners[j]
        return reply if i is None else on_reply(i, reply)

    return take


def _slot_map(reply: Any, asked: Address) -> tuple[list[Address | None], list[Address]]:
    """The master of each slot and the replicas, from a ``CLUSTER SLOTS`` reply (asked of ``asked``);
    TypeError or ValueError when it is not one."""
    if not isinstance(reply, list):
        raise TypeError(f"CLUSTER SLOTS answered {type(reply).__name__}")
    owners: list[Address | None] = [None] * SLOTS
    replicas: list[Address] = []
    for first, last, master, *others in reply:
        if not (isinstance(first, int) and isinstance(last, int) and 0 <= first <= last < SLOTS):
            raise ValueError(f"CLUSTER SLOTS named the slots {first!r}..{last!r}")
        owners[first : last + 1] = [_endpoint(master, asked)] * (last + 1 - first)
        replicas.extend(address for address in map(lambda node: _endpoint(node, asked), others) if address)
    return owners, replicas


def _endpoint(node: Any, asked: Address) -> Address | None:
    """A node's address in a ``CLUSTER SLOTS`` reply: [host, port, id, ...]; an empty host is the node
    asked, "?" an unknown one (None: its slots cannot be reached)."""
    host, port = node[0], node[1]
    if not isinstance(host, bytes) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"CLUSTER SLOTS named the node {host!r}:{port!r}")
    if host == b"?":
        return None
    return (host.decode() or asked[0]), port
