"""Limits from the environment, read one way everywhere: a positive whole
number, for sizes also with a binary unit (``512M``, ``10G``, ``1.5TiB``).
Unset or empty means the default; anything else that is not such a number
is a LayerdiffError naming the variable (an operator's typo must not turn a
limit off)."""
from __future__ import annotations

import os
import re

from layerdiff.common.errors import LayerdiffError

_UNITS = {"": 1, "k": 1024, "m": 1024 ** 2, "g": 1024 ** 3, "t": 1024 ** 4}


def parse_bytes(text: str) -> int:
    """``10737418240``, ``10G``, ``10GiB``, ``512M``, ``1.5T`` (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not m:
        raise ValueError(text)
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def env_limit(name: str, default: int, *, size: bool = False) -> int:
    """The positive limit ``name`` sets (a size in bytes where ``size``)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = parse_bytes(raw) if size else int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        what = "a size in bytes (512M, 10G...)" if size else "a whole number"
        raise LayerdiffError(f"must be {what} above 0, got {raw!r}", field=name)
    return value
