"""``tensor_min_max.txt``: the minimum and maximum of each layer's tensors as
a quantization calibrator records them. One tensor per line, its name first
and then the two numbers; any of these layouts::

    conv1_input  -3.2  41.7
    relu2: 0.0, 6.0
    relu2,0.0,6.0
    relu2 min: 0.0 max: 6.0
    relu2 [0.0, 6.0]

The name is everything before the two numbers (it may hold spaces and
``#``; quotes around it are dropped). Blank lines and lines starting with
``#`` are ignored; any other line that does not parse, holds NaN or Inf,
has min > max or repeats a name (the first line is kept) is skipped with a
reason naming the file and the line. One parser for the job's ``--min-max`` and for
``layerdiff histogram``."""
from __future__ import annotations

import math
import re

_NUM = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|inf(?:inity)?|nan)"
# The name is the shortest prefix after which exactly two numbers follow; a
# separator (or an opening bracket) is required between it and the first, so
# digits that end a name are never read as its minimum.
_LINE = re.compile(
    rf"^(?P<name>.*?)(?:[\s:=,]+|(?=[\[(]))[\[(]?\s*(?:min\s*[:=]?\s*)?(?P<lo>{_NUM})\s*[,;\s]\s*"
    rf"(?:max\s*[:=]?\s*)?(?P<hi>{_NUM})\s*[\])]?\s*$", re.IGNORECASE)


def _clip(text: str, n: int = 80) -> str:
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= n else text[:n] + "..."


def parse_min_max(text: str, shown: str = "tensor_min_max.txt") -> tuple[dict[str, tuple[float, float]],
                                                                      list[tuple[str, str]]]:
    """({tensor: (min, max)}, [(where, why) for skipped lines]); ``where`` is
    ``{shown}:{line number}``."""
    ranges: dict[str, tuple[float, float]] = {}
    skipped: list[tuple[str, str]] = []
    for i, line in enumerate(text.splitlines(), start=1):
        # only whole-line comments: layer names may hold '#' (fc1000#185)
        body = "" if line.lstrip().startswith("#") else line.strip()
        if not body:
            continue
        where = f"{shown}:{i}"
        m = _LINE.match(body)
        name = m["name"].strip().strip("\"'").strip() if m else ""
        if not m or not name:
            skipped.append((where, f"not 'name min max': {_clip(body)}"))
            continue
        lo, hi = float(m["lo"]), float(m["hi"])
        if not (math.isfinite(lo) and math.isfinite(hi)):
            skipped.append((where, f"{_clip(name)}: min/max not finite ({m['lo']}, {m['hi']})"))
        elif lo > hi:
            skipped.append((where, f"{_clip(name)}: min {lo:g} is above max {hi:g}"))
        elif name in ranges:
            skipped.append((where, f"{_clip(name)}: listed again, the first line is kept"))
        else:
            ranges[name] = (lo, hi)
    return ranges, skipped
