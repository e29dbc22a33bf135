"""Route planner invariants: host memory reaches every medium in one hop; GPU <-> disk goes through
host memory unless GPUDirect Storage is on; a node slab reaches an engine's blocks in host memory
directly; a route always starts at the source and ends at the
destination; unknown media are refused."""

import itertools

import pytest

from kvtier.core.devices import Capabilities
from kvtier.core.media import media
from kvtier.core.routes import plan_route

MEDIA = [m.name for m in media()]


@pytest.mark.parametrize(
    "src,dst,expected",
    [
        ("gpu", "host", ("gpu", "host")),
        ("host", "gpu", ("host", "gpu")),
        ("host", "disk", ("host", "disk")),
        ("disk", "host", ("disk", "host")),
        ("gpu", "gpu", ("gpu", "gpu")),
        ("disk", "gpu", ("disk", "host", "gpu")),
        ("gpu", "disk", ("gpu", "host", "disk")),
        ("remote", "gpu", ("remote", "host", "gpu")),
        ("disk", "remote", ("disk", "host", "remote")),
    ],
)
def test_routes_without_gds(src, dst, expected):
    assert plan_route(src, dst) == expected


def test_gds_makes_disk_gpu_direct_only():
    caps = Capabilities(gpu_direct_storage=True)
    assert plan_route("disk", "gpu", caps) == ("disk", "gpu")
    assert plan_route("gpu", "disk", caps) == ("gpu", "disk")
    assert plan_route("remote", "gpu", caps) == ("remote", "host", "gpu")


def test_a_node_slab_reaches_an_engines_blocks_directly_only_where_they_are_host_memory():
    assert plan_route("node", "gpu") == ("node", "host", "gpu")  # (the slab is not registered with CUDA)
    caps = Capabilities(gpu_in_host_memory=True)  # (vLLM built for CPU)
    assert plan_route("node", "gpu", caps) == ("node", "gpu")
    assert plan_route("gpu", "node", caps) == ("gpu", "node")
    assert plan_route("remote", "gpu", caps) == ("remote", "host", "gpu")


@pytest.mark.parametrize("src,dst", list(itertools.product(MEDIA, MEDIA)))
def test_every_route_is_well_formed(src, dst):
    route = plan_route(src, dst)
    assert route[0] == src and route[-1] == dst
    assert len(route) in (2, 3)
    assert all(m == "host" for m in route[1:-1])


def test_unknown_medium_is_refused():
    with pytest.raises(ValueError, match="unknown medium 'tape'"):
        plan_route("tape", "gpu")
