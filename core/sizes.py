"""Sizes as a config spells them ("512MiB", "1.5 GiB", 8589934592) and as messages print them."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any

from pydantic import BeforeValidator

from kvtier.core.errors import ConfigError, shown

_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_UNIT_NAMES = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


def _not_a_size(value: Any) -> ConfigError:
    return ConfigError(
        f"{shown(value)} is not a size: use a number with a unit, e.g. 512MiB or 8GiB (units: {_UNIT_NAMES})"
    )


def parse_size(value: Any) -> int:
    """Bytes from an int or a string with a unit ("512MiB", "1.5 GiB", "8gb"); units are case-insensitive.

    KB/MB/GB/TB are powers of 1000 and KiB/MiB/GiB/TiB powers of 1024, as on disk labels and in
    ``free -h`` respectively; a bare number string means bytes. The result must be a positive
    whole number of bytes, since a tier cannot hold a fraction of a byte.
    """
    if isinstance(value, bool):
        raise _not_a_size(value)
    if isinstance(value, int):
        if value <= 0:
            raise ConfigError(f"{value!r} is not a positive size in bytes; use e.g. 512MiB or 8GiB")
        return value
    if not isinstance(value, str):
        raise _not_a_size(value)
    match = _SIZE_RE.match(value)
    if match is None or match.group(2).lower() not in _UNITS | {"": 1}:
        raise _not_a_size(value)
    number, unit = match.groups()
    try:
        exact = Decimal(number) * _UNITS.get(unit.lower(), 1)
    except InvalidOperation:  # pragma: no cover - the regex admits only decimal numbers
        raise _not_a_size(value) from None
    if exact <= 0:
        raise ConfigError(f"{shown(value)} is not a positive size; use e.g. 512MiB or 8GiB")
    if exact != exact.to_integral_value():
        raise ConfigError(f"{shown(value)} is not a whole number of bytes ({exact} bytes)")
    return int(exact)


def format_size(n: int) -> str:
    """The shortest exact binary-unit spelling of a byte count, for messages (262144 -> '256KiB')."""
    for unit, factor in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= factor and n % factor == 0:
            return f"{n // factor}{unit}"
    return f"{n}B"


Size = Annotated[int, BeforeValidator(parse_size)]


def _size_or_zero(value: Any) -> int:
    """A size, or 0 (``0`` or ``"0"``) for "none at all"."""
    return 0 if value is not False and value in (0, "0") else parse_size(value)


SizeOrZero = Annotated[int, BeforeValidator(_size_or_zero)]
