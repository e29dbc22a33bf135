"""A host slab shared by an engine's processes (``SharedName``; MLA's one copy for every rank): real
processes map one /dev/shm file, see each other's bytes, and leave no name behind once all arrived; a
file that is not this user's private one, a name already taken and a first rank that never comes are
clear errors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid

import pytest

from kvtier.core.errors import ConfigError
from kvtier.core.layout import BlockLayout
from kvtier.tiers import host
from kvtier.tiers.host import HostSlab, SharedName

LAYOUT = BlockLayout.contiguous(64 << 10)


@pytest.fixture
def name():
    name = f"kvtier-test-{uuid.uuid4().hex[:12]}"
    yield name
    try:
        os.unlink(os.path.join(host.SHARED_DIR, name))
    except FileNotFoundError:
        pass


def test_two_processes_share_the_slots_and_the_name_is_gone_once_both_arrived(name):
    first = HostSlab(4, LAYOUT, 4096, SharedName(name, 0, 2))
    try:
        assert os.path.exists(os.path.join(host.SHARED_DIR, name))  # the second rank has not come yet
        first.array[:] = 7
        other = textwrap.dedent(f"""
            from kvtier.core.layout import BlockLayout
            from kvtier.tiers.host import HostSlab, SharedName
            slab = HostSlab(4, BlockLayout.contiguous(64 << 10), 4096, SharedName({name!r}, 1, 2))
            print(int(slab.array.min()), int(slab.array.max()))
            slab.array[:] = 9
            slab.close()
        """)
        done = subprocess.run([sys.executable, "-c", other], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split() == ["7", "7"]  # what the first rank wrote
        assert int(first.array.min()) == int(first.array.max()) == 9  # and it sees the second rank's bytes
        assert not os.path.exists(os.path.join(host.SHARED_DIR, name))
        assert first.storage.fragment_addresses([1])[0, 0] == first.address + 4096 + (64 << 10) + 4096
    finally:
        first.close()


def test_the_first_ranks_close_removes_the_name_when_a_rank_never_came(name):
    HostSlab(2, LAYOUT, 0, SharedName(name, 0, 2)).close()
    assert not os.path.exists(os.path.join(host.SHARED_DIR, name))


def test_a_name_already_taken_is_refused(name):
    with open(os.path.join(host.SHARED_DIR, name), "wb"):
        pass
    with pytest.raises(ConfigError, match="exists already"):
        HostSlab(2, LAYOUT, 0, SharedName(name, 0, 2))


@pytest.mark.parametrize("mode", [0o644, 0o660])
def test_a_joiner_refuses_a_file_others_may_read_or_write(name, mode):
    path = os.path.join(host.SHARED_DIR, name)
    with open(path, "wb") as f:
        f.truncate(4096 + 2 * LAYOUT.block_bytes)
    os.chmod(path, mode)
    with pytest.raises(ConfigError, match="not a private file of this user"):
        HostSlab(2, LAYOUT, 0, SharedName(name, 1, 2))


def test_a_joiner_gives_up_when_the_first_rank_never_creates_the_slab(name, monkeypatch):
    monkeypatch.setattr(host, "JOIN_TIMEOUT_S", 0.2)
    with pytest.raises(ConfigError, match="did not create the shared host slab"):
        HostSlab(2, LAYOUT, 0, SharedName(name, 1, 2))
    assert not os.path.exists(os.path.join(host.SHARED_DIR, name))


def test_a_creator_that_cannot_map_the_slab_leaves_no_name(name, monkeypatch):
    def no_memory(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(host.mmap, "mmap", no_memory)
    with pytest.raises(OSError, match="Cannot allocate memory"):
        HostSlab(2, LAYOUT, 0, SharedName(name, 0, 2))
    assert not os.path.exists(os.path.join(host.SHARED_DIR, name))
