"""Mooncake Store as a remote tier's backend (``backend: mooncake``): its settings and how to open its
clients (``mooncake_client``, imported only then: the wheel is an optional extra)."""

from __future__ import annotations

import functools
from typing import Literal

from pydantic import Field, model_validator

from kvtier.core.sizes import SizeOrZero
from kvtier.core.tier_config import ConfigModel
from kvtier.tiers.remote.config import StoreBackend
from kvtier.tiers.remote.link import Connector


class MooncakeConfig(ConfigModel):
    """How to reach a Mooncake Store: its master and metadata server, and what this process contributes."""

    master: str = Field(
        pattern=r"^[^\s:/]+:\d{1,5}$", description="host:port (the Mooncake master's RPC address, e.g. 127.0.0.1:50051)"
    )
    metadata_server: str = Field(
        pattern=r"^[a-z][a-z0-9+.-]*://\S+$", description="a URL, e.g. http://127.0.0.1:8080/metadata"
    )
    # Memory this process lends the store (0: none; blocks then live in other clients' segments, e.g. a
    # standalone mooncake_client: a process that exits takes the blocks in its segment with it).
    segment_size: SizeOrZero = 0
    # Clients open at once for loads and stores (calls in parallel; each its own transfer engine). A
    # process that lends memory keeps one: a segment lives and dies with the client that mounted it.
    pool_size: int = Field(1, ge=1)
    protocol: Literal["tcp", "rdma"] = "tcp"
    local_hostname: str = Field("127.0.0.1", min_length=1)  # the address peers reach this process at
    # Memory of each loading client's own that reads land in first (0: reads go straight into the memory
    # they are for, zero copy). With it a read past its deadline writes only there, so loads need no
    # staging slot (one more copy each): what a node daemon's store below its slab needs. At least the
    # bytes of the largest batch a load reads (blocks x block size).
    fetch_buffer: SizeOrZero = 0

    @model_validator(mode="after")
    def _one_lender(self) -> MooncakeConfig:
        if self.pool_size > 1 and self.segment_size:
            raise ValueError(
                "pool_size above 1 needs segment_size 0: a process that lends memory to the store keeps "
                "one client, whose segment lives and dies with it (lend memory from a standalone "
                "mooncake_client instead, or set pool_size: 1)"
            )
        return self


def connector(options: MooncakeConfig, timeout: float, lends_memory: bool) -> Connector:
    """``pool_size`` clients (one when lending memory), each one call at a time. A client that does not
    ``lends_memory`` mounts no segment whatever ``segment_size`` says: lookup clients (the vLLM
    scheduler's among them) only ask, so the memory an engine lends is its workers' alone."""
    from kvtier.tiers.remote.mooncake_client import MooncakeClient, store_class

    store_class()  # raises ConfigError naming the install line when the wheel or libibverbs1 is missing

    connect = functools.partial(
        MooncakeClient,
        master=options.master,
        metadata_server=options.metadata_server,
        timeout=timeout,
        segment_size=options.segment_size if lends_memory else 0,
        protocol=options.protocol,
        local_hostname=options.local_hostname,
        fetch_buffer=options.fetch_buffer if lends_memory else 0,
    )
    return Connector(connect, options.pool_size, f"Mooncake master {options.master}")


BACKEND = StoreBackend(
    "mooncake", MooncakeConfig, connector, reads_anywhere=False, fetches=lambda options: options.fetch_buffer > 0
)
