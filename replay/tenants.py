"""Tenants in a replay: a trace line may say whose request it is (``"tenant"``), and kvtier keys each
tenant's blocks apart (``core/keys.py``), so the same block id sent by two tenants is two blocks here
too (``keep_tenants_apart``). ``with_flood`` adds a tenant that floods the cache with prefixes nobody
sends again, the workload fair shares are for; ``tenant_summary`` reports each tenant's hits, the
tenants that sent most by name and the rest together (a trace of many tenants gives a short report).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from kvtier.replay.trace import Request

TOP_TENANTS = 8
"""Tenants a report names (those with the most references); the others are summed as ``OTHERS``."""
NO_TENANT = "(none)"
OTHERS = "(others)"
STEADY, FLOOD = "steady", "flood"


def keep_tenants_apart(requests: Sequence[Request]) -> list[Request]:
    """The requests with block ids renumbered so that no id is two tenants' (equal ids of one tenant stay
    equal); unchanged where no request names a tenant."""
    if not any(r.tenant for r in requests):
        return list(requests)
    ids: dict[tuple[str, int], int] = {}
    return [
        replace(r, hash_ids=tuple(ids.setdefault((r.tenant or "", h), len(ids)) for h in r.hash_ids)) for r in requests
    ]


def with_flood(requests: Sequence[Request], blocks: int) -> list[Request]:
    """After each request, one from tenant ``flood`` of ``blocks`` blocks never sent before or after;
    requests that name no tenant become tenant ``steady``'s."""
    if blocks < 1:
        raise ValueError(f"a flood request needs at least one block, not {blocks}")
    first = max((h for r in requests for h in r.hash_ids), default=-1) + 1
    out = []
    for i, r in enumerate(requests):
        out.append(r if r.tenant else replace(r, tenant=STEADY))
        ids = tuple(range(first + i * blocks, first + (i + 1) * blocks))
        out.append(Request(r.timestamp, 0, 0, ids, tenant=FLOOD))
    return out


def count(by_tenant: dict[str, dict[str, int]], request: Request, hits: int) -> None:
    """Add one request's hits and references to its tenant's."""
    counts = by_tenant.setdefault(request.tenant or NO_TENANT, {"hits": 0, "references": 0})
    counts["hits"] += hits
    counts["references"] += len(request.hash_ids)


def tenant_summary(by_tenant: Mapping[str, Mapping[str, int]], top: int = TOP_TENANTS) -> dict[str, dict]:
    """Each of the ``top`` tenants with most references, then the rest summed as ``OTHERS``: hits,
    references, hit ratio. Empty where the trace names no tenant."""
    if set(by_tenant) <= {NO_TENANT}:
        return {}
    ranked = sorted(by_tenant.items(), key=lambda item: -item[1]["references"])
    kept = dict(ranked[:top])
    if len(ranked) > top:
        rest = ranked[top:]
        kept[OTHERS] = {
            "hits": sum(c["hits"] for _, c in rest),
            "references": sum(c["references"] for _, c in rest),
            "tenants": len(rest),
        }
    return {
        name: {**c, "hit_ratio": c["hits"] / c["references"] if c["references"] else 0.0} for name, c in kept.items()
    }
