"""What ``kvtier doctor`` checks of a node tier (``Medium.doctor``): its daemon, reached as the tier reaches
it at start (its socket, its user checked, the protocol version agreed, its slab mapped) and asked for
its numbers, whether the config's blocks fit its slots; and its sealing secrets.
"""

from __future__ import annotations

from kvtier.core.checks import Check, DoctorRequest, sealing_secrets
from kvtier.core.errors import KvtierError
from kvtier.core.sealing import SEAL_BYTES
from kvtier.tiers.node.client import NodeClient
from kvtier.tiers.node.config import NodeTierConfig
from kvtier.tiers.node.protocol import VERSION, Op


def checks(request: DoctorRequest) -> list[Check]:
    """The daemon, then the tier's secrets where it seals."""
    return [_daemon(request), *sealing_secrets(request)]


def _daemon(request: DoctorRequest) -> Check:
    """The daemon asked for its numbers; the connection is closed at once: it held nothing."""
    tier = request.config
    assert isinstance(tier, NodeTierConfig)
    name = f"{request.label} daemon"
    client = NodeClient(tier.socket, tier.timeout, [] if tier.daemon_uid is None else [tier.daemon_uid])
    try:
        client.open()
        (stats,), _, _ = client.call(Op.STATS)
    except KvtierError as exc:
        return Check(name, False, str(exc))
    finally:
        client.close()
    assert client.geometry is not None
    slots, slot_bytes = client.geometry
    details = {"node": client.node_id, "slots": slots, "slot_bytes": slot_bytes, "used_slots": stats["used_slots"]}
    block = request.stack.block_bytes
    if block is not None and block + (0 if tier.encryption == "none" else SEAL_BYTES) > slot_bytes:
        sealed = "" if tier.encryption == "none" else f" ({block + SEAL_BYTES} sealed)"
        return Check(name, False, f"blocks of {block} bytes{sealed} do not fit its slots of {slot_bytes}", details)
    message = (
        f"{tier.socket} answers (node {client.node_id}, protocol {VERSION}): {slots} slots of {slot_bytes} bytes, "
        f"{stats['used_slots']} in use, {stats['connected'] - 1} other connection(s)"
    )
    return Check(name, True, message, details)
