"""The node daemon's start, in this process (no connection is needed): its YAML is checked key by key;
its slab file is created private, reopened when its geometry matches, and never taken from a file that is
not this user's private node slab (a symlink, another user's file, anything else: refused, untouched);
its socket replaces a stale one only; its index comes back from the slot headers, newest copy first."""

from __future__ import annotations

import os
import socket
import uuid

import pytest

from kvtier.core.errors import ConfigError
from kvtier.node_config import load_node_config
from kvtier.node_daemon import NodeDaemon
from kvtier.tiers.node.slab import READY, WRITING, Geometry, SlabFile

BLOCK = 64 * 1024


@pytest.fixture
def paths(tmp_path):
    """A socket path and a slab path of the test's own (the slab in /dev/shm, removed afterwards)."""
    slab = f"/dev/shm/kvtier-test-{uuid.uuid4().hex[:12]}"
    yield str(tmp_path / "n.sock"), slab
    if os.path.lexists(slab):
        os.unlink(slab)


def config(socket_path: str, slab: str, **node) -> dict:
    return {
        "node": {"socket": socket_path, "slab": slab, **node},
        "block_bytes": BLOCK,
        "tiers": [{"medium": "host", "capacity_blocks": 8}],
    }


def error(source) -> str:
    with pytest.raises(ConfigError) as info:
        load_node_config(source)
    return str(info.value)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c.pop("node"), "missing key 'node'"),
        (lambda c: c.update(namespace="m"), "namespace: describes an engine's blocks, not the daemon's"),
        (lambda c: c["node"].update(allow_users=["no-such-user-here"]), "node.allow_users"),
        (lambda c: c["node"].update(lease=0), "node.lease"),
        (lambda c: c["node"].update(max_held=2), "node.max_held"),
        (lambda c: c["node"].update(sockets="/x"), "node"),
        (lambda c: c.pop("block_bytes"), "missing key 'block_bytes'"),
        (
            lambda c: c.update(tiers=[{"medium": "disk", "path": "/tmp/x", "capacity": "1GiB"}]),
            "tiers[0]: the slab is a host",
        ),
        (lambda c: c["tiers"].append({"medium": "node", "socket": "/x.sock"}), "tiers[1]: the daemon serves"),
        (lambda c: c.update(placement="write_back"), "placement: the slab copies every block down"),
    ],
)
def test_a_bad_daemon_config_is_one_error_naming_its_key(paths, change, message):
    document = config(*paths)
    change(document)
    assert message in error(document)


def test_the_slab_is_created_private_reopened_when_its_geometry_matches_and_else_replaced(paths):
    """Replaced, never truncated: an engine still mapping the old file must not die reading it (SIGBUS)."""
    _, path = paths
    geometry = Geometry.for_blocks(4, BLOCK)
    first = SlabFile(path, geometry)
    assert not first.reused and os.stat(path).st_mode & 0o777 == 0o600
    first.view.headers["state"][2] = READY
    slab_id = first.view.id
    first.close()
    again = SlabFile(path, geometry)
    assert again.reused and again.view.id == slab_id and again.view.headers["state"][2] == READY
    again.close()
    inode = os.stat(path).st_ino
    other = SlabFile(path, Geometry.for_blocks(8, BLOCK))  # another geometry: a new file, the old one untouched
    assert not other.reused and other.view.id != slab_id and not other.view.headers["state"].any()
    assert os.stat(path).st_ino != inode
    assert again.view.headers["state"][2] == READY and again.view.block(3, BLOCK)[BLOCK - 1] == 0  # (no SIGBUS)
    other.close()


def test_a_second_daemon_on_the_same_slab_is_refused(paths):
    _, path = paths
    first = SlabFile(path, Geometry.for_blocks(4, BLOCK))
    try:
        with pytest.raises(ConfigError, match="in use by another node daemon"):
            SlabFile(path, Geometry.for_blocks(4, BLOCK))
    finally:
        first.close()


def test_a_file_that_is_not_our_private_node_slab_is_refused_and_left_as_it_was(paths, tmp_path):
    _, path = paths
    with open(path, "wb") as f:
        f.write(b"somebody's data")
    os.chmod(path, 0o600)
    with pytest.raises(ConfigError, match="is not a node slab: refusing to overwrite it"):
        SlabFile(path, Geometry.for_blocks(4, BLOCK))
    assert open(path, "rb").read() == b"somebody's data"
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="is not a private file of this user"):
        SlabFile(path, Geometry.for_blocks(4, BLOCK))
    os.unlink(path)
    target = tmp_path / "elsewhere"
    target.write_bytes(b"x")
    os.symlink(target, path)
    with pytest.raises(ConfigError, match="cannot open the node slab"):
        SlabFile(path, Geometry.for_blocks(4, BLOCK))
    assert target.read_bytes() == b"x"


def test_a_socket_path_holding_anything_but_a_stale_socket_is_refused(paths):
    socket_path, slab = paths
    with open(socket_path, "w") as f:
        f.write("a file")
    with pytest.raises(ConfigError, match="exists and is not a socket"):
        NodeDaemon(load_node_config(config(socket_path, slab)))
    os.unlink(socket_path)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(socket_path)
    stale.close()  # (the file stays: nobody listens)
    daemon = NodeDaemon(load_node_config(config(socket_path, slab)))
    try:
        with pytest.raises(ConfigError, match="another daemon listens at"):
            NodeDaemon(load_node_config(config(socket_path, slab + "-2")))
    finally:
        daemon.stop()
        if os.path.exists(slab + "-2"):
            os.unlink(slab + "-2")


def test_a_restarted_daemon_restores_the_newest_copy_of_each_committed_block(paths):
    socket_path, slab = paths
    daemon = NodeDaemon(load_node_config(config(socket_path, slab)))
    h = daemon.headers
    rows = {  # slot: (state, key, seq)
        0: (READY, b"a" * 16, 5),
        1: (READY, b"b" * 16, 2),
        2: (READY, b"a" * 16, 9),  # a newer copy of a
        3: (WRITING, b"c" * 16, 0),  # never committed
    }
    for slot, (state, key, seq) in rows.items():
        h[slot] = (3, state, BLOCK, key, 0, seq, 1, b"")
    daemon.stop()
    again = NodeDaemon(load_node_config(config(socket_path, slab)))
    try:
        assert again.restored == 2
        assert again.tier.ready_blocks() == ([b"b" * 16, b"a" * 16], [1, 2])  # oldest first
        assert again.headers["state"][0] == 0  # the older copy's slot is free
        assert again._seq == 9  # commits go on counting from the newest
    finally:
        again.stop()
