"""Parsing and formatting of byte sizes such as ``64GiB`` or ``1.5 TB``."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BeforeValidator

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: object) -> int:
    """Return ``value`` as a number of bytes.

    Accepts non-negative integers and strings like ``"64GiB"``, ``"512 MiB"``, ``"1.5TB"``.
    Raises ``ValueError`` naming the value for anything else (negative, non-numeric, bool).
    """
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative: {value!r}")
        return value
    if isinstance(value, float):
        if value < 0 or value != value:
            raise ValueError(f"size must be a non-negative number: {value!r}")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"not a size: {value!r}")
    m = _SIZE_RE.match(value)
    if not m:
        raise ValueError(f"not a size: {value!r} (expected e.g. '64GiB', '512MiB', '1TB' or bytes)")
    number, unit = m.groups()
    mult = _UNITS.get(unit.lower())
    if mult is None:
        raise ValueError(f"unknown size unit {unit!r} in {value!r} (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")
    return int(float(number) * mult)


def format_size(n: float) -> str:
    """Format a byte count with a binary unit, e.g. ``1.5 GiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover - loop always returns


Size = Annotated[int, BeforeValidator(parse_size)]
"""A byte count in a pydantic model: an integer, or a string such as ``"64GiB"``."""
