"""JSON as the reports write it, and its numbers read back: an object's keys and a list's items one to a
line down to the second level, each written compactly below that. As easy
to read and grep as indented JSON (a node, a tensor per line), and written
by json's C encoder: with ``indent`` json uses its Python one, a tenth of a
two-dump job's time for its summary."""
from __future__ import annotations

import json
import math

# levels laid out one item to a line (the summary itself, then its lists: the nodes)
LEVELS = 2
# one encoder each way (json.dumps makes a new one for every call given allow_nan=False)
_ENCODERS = {True: json.JSONEncoder(allow_nan=True), False: json.JSONEncoder(allow_nan=False)}


def json_text(obj: object, *, allow_nan: bool = True, levels: int = LEVELS) -> str:
    """``obj`` as JSON text (see the module); ``allow_nan`` as json.dumps."""
    return _text(obj, 0, levels, allow_nan)


def _text(obj: object, depth: int, levels: int, allow_nan: bool) -> str:
    if depth >= levels or not isinstance(obj, (dict, list, tuple)) or not obj:
        return _ENCODERS[allow_nan].encode(obj)
    pad, inner = " " * depth, " " * (depth + 1)
    if isinstance(obj, dict):
        items = [f"{inner}{_ENCODERS[True].encode(k if isinstance(k, str) else json.dumps(k))}: "
                 f"{_text(v, depth + 1, levels, allow_nan)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    return "[\n" + ",\n".join(inner + _text(v, depth + 1, levels, allow_nan) for v in obj) + "\n" + pad + "]"


def summary_number(v: object) -> float:
    """A number of summary.json read back (null is NaN, "inf"/"-inf" the
    infinities, anything else that is not a number NaN)."""
    if type(v) is float:        # most of them: a page reads tens of thousands
        return v
    if v is None or isinstance(v, bool):
        return math.nan
    if isinstance(v, str):
        return {"inf": math.inf, "-inf": -math.inf}.get(v.strip().lower(), math.nan)
    try:
        return float(v)  # type: ignore[arg-type]  # any JSON value; what float() refuses is caught
    except (TypeError, ValueError):
        return math.nan
