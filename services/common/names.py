"""File names derived from node names (reports, converted dumps)."""
from __future__ import annotations

import hashlib
import re

_UNSAFE = re.compile(r"[^A-Za-z0-9_\-+=,@.]")


def safe_filename(name: str, taken: set[str]) -> str:
    """A file name derived from a node name that can never leave the report
    directory: path separators and unusual characters become ``_`` (as the seed
    tool names its files), bounded length, unique within the report (case
    folded, for case-insensitive file systems)."""
    digest = hashlib.sha1(name.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    base = _UNSAFE.sub("_", name).replace("..", "_").lstrip(".") or "node"
    if len(base) > 120:
        base = f"{base[:120]}_{digest}"
    stem, n = base, 1
    while stem.lower() in taken:
        n += 1
        stem = f"{base}_{digest}" if n == 2 else f"{base}_{digest}_{n}"
    taken.add(stem.lower())
    return stem
