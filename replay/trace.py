"""Mooncake request traces: one JSON object a line, read, checked and written.

A line holds ``hash_ids`` (the prompt's blocks, chained: equal id, equal prefix) and optionally
``timestamp``, ``input_length`` and ``output_length``. Traces come from outside (a file a user points
``kvtier replay`` at), so every line is checked before any replay sees it: a bad one is a ValueError
naming the file, the line and the field, never a crash or a skewed figure later. The same ``Request``
records come from the workload generator (``kvtier.replay.workload``), so every replay path treats a
generated workload and a trace file alike.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from os import PathLike


@dataclass(frozen=True)
class Request:
    """One line of a Mooncake trace. ``hash_ids`` name the prompt's blocks, chained (equal id = equal prefix).
    ``session``: the conversation it belongs to, where the generator knows it (a trace does not say).
    ``tenant``: whose request it is, where the trace says (kvtier's own field)."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session: int | None = None
    tenant: str | None = None


def load_trace(path: str | PathLike[str]) -> list[Request]:
    """Read a Mooncake JSONL trace; blank lines are skipped. Raises ValueError naming the file, the line
    and the field on bad input (``parse_request`` says what a line may hold)."""
    requests = []
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is reported with its number, like any other
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                requests.append(parse_request(line))
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: not a Mooncake trace line: {exc}") from None
    return requests


def parse_request(line: str | bytes) -> Request:
    """One trace line as a Request; raises ValueError naming the field that is wrong.

    A line is a JSON object. ``hash_ids`` is required: a list, possibly empty, of distinct integers in
    [0, 2**64). ``timestamp`` (a finite number), ``input_length`` and ``output_length`` (integers in
    [0, 2**63)) are optional and 0 when left out; ``session`` (kvtier's own: the conversation, an
    integer in [0, 2**63), as ``--save-trace`` writes it) and ``tenant`` (kvtier's own: whose request it is,
    a string of 1 to 255 UTF-8 bytes) are optional; other keys are ignored. Booleans
    are not numbers here, and a float is no length (JSON's ``1e400`` reads as infinity), so a trace from
    a buggy generator is refused up front rather than crashing the replay or skewing its figures.
    """
    try:
        obj = json.loads(line)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    except ValueError as exc:  # also UnicodeDecodeError
        raise ValueError(f"invalid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {_json_text(obj)}")
    if "hash_ids" not in obj:
        raise ValueError("missing field 'hash_ids'")
    timestamp = obj.get("timestamp", 0)
    if not _is_number(timestamp):
        raise ValueError(f"timestamp: expected a finite number, got {_json_text(timestamp)}")
    session = _length(obj, "session") if "session" in obj else None
    tenant = obj.get("tenant")
    if tenant is not None and not _is_tenant(tenant):
        raise ValueError(f"tenant: expected a string of 1 to 255 bytes, got {_json_text(tenant)}")
    return Request(
        timestamp,
        _length(obj, "input_length"),
        _length(obj, "output_length"),
        _block_ids(obj["hash_ids"]),
        session,
        tenant,
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_tenant(value: object) -> bool:
    """A string of 1 to 255 bytes as UTF-8 (JSON may carry lone surrogates, which UTF-8 cannot)."""
    try:
        return isinstance(value, str) and 0 < len(value.encode("utf-8")) <= 255
    except UnicodeEncodeError:
        return False


def _is_number(value: object) -> bool:
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


def _length(obj: dict, field: str) -> int:
    value = obj.get(field, 0)
    if not (_is_int(value) and 0 <= value < 2**63):
        raise ValueError(f"{field}: expected an integer in [0, 2**63), got {_json_text(value)}")
    return value


def _block_ids(ids: object) -> tuple[int, ...]:
    if not isinstance(ids, list):
        raise ValueError(f"hash_ids: expected a list of block ids, got {_json_text(ids)}")
    seen: set[int] = set()
    for position, h in enumerate(ids):
        if not (_is_int(h) and 0 <= h < 2**64):
            raise ValueError(f"hash_ids[{position}]: expected an integer in [0, 2**64), got {_json_text(h)}")
        if h in seen:
            raise ValueError(f"hash_ids[{position}]: {h} repeats an earlier id; a request's blocks are distinct")
        seen.add(h)
    return tuple(ids)


def _json_text(value: object, limit: int = 60) -> str:
    """A value as JSON writes it (``true``, ``Infinity``), shortened: what the user finds in the file."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def write_trace(requests: Iterable[Request], path: str | PathLike[str]) -> None:
    """Write requests as a Mooncake JSONL trace, the format ``load_trace`` reads back (with ``session``
    and ``tenant`` where a request has them)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            line = {
                "timestamp": r.timestamp,
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.hash_ids),
            }
            if r.session is not None:
                line["session"] = r.session
            if r.tenant is not None:
                line["tenant"] = r.tenant
            f.write(json.dumps(line) + "\n")
