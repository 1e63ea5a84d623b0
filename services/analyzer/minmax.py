"""``tensor_min_max.txt``: the minimum and maximum of each layer's tensors as
a quantization calibrator records them. One tensor per line, its name and
two numbers, separated by spaces, commas or a colon::

    conv1_input  -3.2  41.7
    relu2: 0.0, 6.0

Blank lines and lines starting with ``#`` are ignored; any other line that
does not parse is skipped with a reason naming the file and the line."""
from __future__ import annotations

import math
import re

_LINE = re.compile(r"^\s*(?P<name>.+?)\s*[:,\s]\s*(?P<lo>[-+0-9.eEinfINFaN]+)\s*[,\s]\s*(?P<hi>[-+0-9.eEinfINFaN]+)\s*$")


def parse_min_max(text: str, shown: str = "tensor_min_max.txt") -> tuple[dict[str, tuple[float, float]],
                                                                      list[tuple[str, str]]]:
    """({tensor: (min, max)}, [(where, why) for skipped lines])."""
    ranges: dict[str, tuple[float, float]] = {}
    skipped: list[tuple[str, str]] = []
    for i, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{shown}:{i}"
        m = _LINE.match(line)
        if not m:
            skipped.append((where, "not 'name min max'"))
            continue
        try:
            lo, hi = float(m["lo"]), float(m["hi"])
        except ValueError:
            skipped.append((where, "min or max is not a number"))
            continue
        if not (math.isfinite(lo) and math.isfinite(hi)) or lo > hi:
            skipped.append((where, f"min {lo} and max {hi} are not a finite range"))
            continue
        name = m["name"].strip().rstrip(":,").strip()
        if not name:
            skipped.append((where, "no tensor name"))
            continue
        ranges[name] = (lo, hi)
    return ranges, skipped
