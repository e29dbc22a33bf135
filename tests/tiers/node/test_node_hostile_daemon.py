"""An engine against a node daemon that answers nonsense (a buggy or hostile one of a trusted user): every
reply shape hypothesis makes up, to every request, costs misses and dropped stores, never an exception out
of a load or a store, a hang, or bytes the engine takes for a block. The fake daemon is a real Unix socket
server that says hello properly (a real slab, mapped by the engine) and then answers each request with the
reply under test."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import uuid

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from kvtier import KVTier
from kvtier.tiers.node.protocol import OK, POSTED, VERSION, Op, frame, read_frame
from kvtier.tiers.node.slab import Geometry, SlabFile

BLOCK = 4096


class FakeDaemon:
    """Says hello with ``slab`` and answers every request that wants a reply with ``reply``."""

    def __init__(self, path: str, slab: SlabFile, reply) -> None:
        self.slab = slab
        self.reply = reply
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(path)
        self.server.listen(4)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._session, args=(conn,), daemon=True).start()

    def _session(self, conn: socket.socket) -> None:
        try:
            read_frame(conn)  # HELLO
            hello = [OK, VERSION, *self.slab.geometry, self.slab.view.id, "fake"]
            socket.send_fds(conn, [frame(hello)], [self.slab.shared_fd])
            while True:
                op = Op(read_frame(conn)[0])
                if op not in POSTED:
                    body = msgpack.packb(self.reply, use_bin_type=True)
                    conn.sendall(len(body).to_bytes(4, "little") + body)
        except (OSError, EOFError, ValueError):
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.server.close()


replies = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 2**40) | st.binary(max_size=20) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=5),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reply=st.one_of(replies, st.lists(replies, min_size=1, max_size=3).map(lambda r: [OK, *r])))
def test_nonsense_from_the_daemon_is_misses_and_drops_never_an_error_or_wrong_bytes(reply):
    directory = tempfile.mkdtemp(prefix="kvn", dir="/tmp")
    path = os.path.join(directory, "node.sock")
    slab_path = f"/dev/shm/kvtier-test-{uuid.uuid4().hex[:12]}"
    slab = SlabFile(slab_path, Geometry.for_blocks(8, BLOCK))
    daemon = FakeDaemon(path, slab, reply)
    try:
        config = {
            "block_tokens": 4,
            "block_bytes": BLOCK,
            "tiers": [{"medium": "node", "socket": path, "timeout": 0.5}],
        }
        with KVTier.open(config) as kv:
            tokens = list(range(12))
            blocks = np.full((3, BLOCK), 7, np.uint8)
            stored = kv.store_now(tokens, blocks, timeout=10)
            assert stored.stored + stored.dropped + len(stored.failed) + stored.present == 3
            out = np.zeros_like(blocks)
            loaded = kv.load_now(tokens, out, timeout=10)
            good = [i for i in range(loaded.hits) if i not in loaded.failed]
            assert not any(out[i].any() for i in good)  # nothing in the slab: a "hit" must have failed its checks
            assert loaded.loaded == 0
    finally:
        daemon.close()
        slab.close()
        os.unlink(slab_path)
        os.unlink(path)
        os.rmdir(directory)
