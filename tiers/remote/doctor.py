"""What ``kvtier doctor`` checks of a remote tier (``Medium.doctor``) and reports of it for sharing
(``Medium.sharing``): its secrets (its MAC key or its sealing secrets, and whatever its backend's
connector reads: a password, the client package), then a real client of the store opened the way the
tier opens one (``StoreLink`` over the backend's connector), asked one existence query within the
tier's timeout; and which records a stack reads there, which two engines must agree on to share.
"""

from __future__ import annotations

import secrets
from typing import Any

from kvtier.core.checks import Check, DoctorRequest
from kvtier.core.errors import ConfigError, KvtierError
from kvtier.core.namespaces import fingerprint
from kvtier.core.tier_config import TierConfigBase
from kvtier.tiers.remote.config import RemoteTierConfig
from kvtier.tiers.remote.factory import connector
from kvtier.tiers.remote.link import Connector, StoreLink
from kvtier.tiers.remote.record import mac_key


def checks(request: DoctorRequest) -> list[Check]:
    """The tier's secrets, then one round trip to the store when a client can be set up at all."""
    tier = request.config
    assert isinstance(tier, RemoteTierConfig)
    problems = []
    for read_secret in (lambda: mac_key(tier.auth_key_env), tier.sealing):
        try:
            read_secret()
        except ConfigError as exc:
            problems.append(str(exc))
    try:
        wired = connector(tier, lends_memory=False)
    except ConfigError as exc:
        problems.append(str(exc))
        return [Check(f"{request.label} secrets", False, "; ".join(problems))]
    secrets_check = Check(f"{request.label} secrets", not problems, "; ".join(problems) or "present")
    return [secrets_check, _round_trip(f"{request.label} store", wired, tier)]


def _round_trip(name: str, wired: Connector, tier: RemoteTierConfig) -> Check:
    """One existence query of a random record name through a real client, opened as the tier opens its
    lookup client (TLS and credentials as configured), within the tier's timeout; the error as the
    client words it (it never holds a secret: passwords come from the environment, not URLs)."""
    link = StoreLink(Connector(wired.connect, 1, wired.where), tier.timeout, "kvtier doctor")
    probe = f"{tier.prefix}doctor-{secrets.token_hex(8)}"
    try:
        link.ask(lambda client: client.exists([probe]))
    except KvtierError as exc:
        return Check(name, False, f"{wired.where} failed an existence query (timeout {tier.timeout:g} s): {exc}")
    finally:
        link.close(tier.timeout)  # an abandoned call's client is closed when it returns, not waited for
    return Check(name, True, f"{wired.where} answers")


def sharing(tier: TierConfigBase) -> dict[str, Any]:
    """Which records a stack reads on the store: where the store is, the names' prefix and the
    fingerprints of the MAC key and of the sealing key."""
    assert isinstance(tier, RemoteTierConfig)
    try:
        where = connector(tier, lends_memory=False).where
    except ConfigError:  # a missing password or client package: the secrets check names it
        where = f"{tier.backend} (its client cannot be set up)"
    try:
        mac = mac_key(tier.auth_key_env)
        mac_fingerprint = None if mac is None else fingerprint(mac)
    except ConfigError:
        mac_fingerprint = "unreadable"
    try:
        sealing = tier.sealing()
        sealing_fingerprint = None if sealing is None else sealing.key_id.hex()
    except ConfigError:
        sealing_fingerprint = "unreadable"
    return {
        "store": where,
        "store_prefix": tier.prefix,
        "store_mac_key": mac_fingerprint,
        "store_sealing_key": sealing_fingerprint,
    }
