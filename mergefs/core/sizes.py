"""Byte sizes as users write them (``2GiB``, ``500MB``, ``1e9``) and as mergefs prints them. Pure."""

from __future__ import annotations
import re


_SIZE_UNITS = {
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
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def human_bytes(n: float | None) -> str:
    """``1536`` -> ``'1.50 KiB'`` (binary units); ``None`` -> ``'-'``."""
    if n is None:
        return "-"
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.2f} {unit}"
        x /= 1024
    return str(x)


def parse_size(value: object, what: str = "size") -> int:
    """Parse ``1048576``, ``'1MiB'``, ``'2GB'``, ``'512 KiB'`` into bytes."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a size like 1MiB, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{what}: must not be negative, got {value}")
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _SIZE_UNITS:
            return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    raise ValueError(f"{what}: expected a size like 1MiB or 2GB, got {value!r}")
