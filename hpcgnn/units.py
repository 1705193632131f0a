"""Byte sizes as text: :func:`parse_size` reads ``"24GiB"``-style settings, :func:`fmt_bytes`
writes ``"1.23 GiB"`` for messages and tables."""
from __future__ import annotations

import re

from hpcgnn.errors import InputError


def fmt_bytes(n: float) -> str:
    """``1.23 GiB`` style (binary units)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000 ** 2, "mb": 1000 ** 2,
          "mib": 1 << 20, "g": 1000 ** 3, "gb": 1000 ** 3, "gib": 1 << 30, "t": 1000 ** 4,
          "tb": 1000 ** 4, "tib": 1 << 40}


def parse_size(text, what: str = "size") -> int:
    """``"24GiB"``, ``"512 MiB"``, ``"1.5GB"`` or a plain number of bytes -> bytes; a bad value
    raises InputError naming ``what``."""
    if isinstance(text, (int, float)) and not isinstance(text, bool) and text >= 0:
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise InputError(f"{what} = {text!r}: expected a size such as '24GiB', '512MiB' or a number of bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
