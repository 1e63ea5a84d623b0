"""The directories a collector reads dumps from.

A dump path comes from whoever submits a job; the collector reads only
below its dump roots (``LAYERDIFF_DUMP_ROOTS``, ``:``-separated, or the
``--dump-roots`` flag). A path is taken whole: with a ``..`` component it is
refused, and it must still lie below a root once every symbolic link in it
is resolved (a link pointing out of the roots is refused, with the root
named). Without roots, a collector serving loopback only (the embedded
default, a developer's machine) reads any path it can, and one serving the
network reads none.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from layerdiff.common.errors import PermissionDenied


@dataclass(frozen=True)
class DumpRoots:
    roots: tuple[Path, ...] | None     # resolved; None: none configured
    local: bool = False                # the collector serves loopback only

    @classmethod
    def from_env(cls, value: str | None = None, *, local: bool) -> DumpRoots:
        raw = value if value is not None else os.environ.get("LAYERDIFF_DUMP_ROOTS", "")
        parts = [p.strip() for p in raw.split(":") if p.strip()]
        if not parts:
            return cls(None, local)
        return cls(tuple(Path(os.path.realpath(p)) for p in parts), local)

    def check(self, path: str) -> str:
        """The resolved path to read, or PermissionDenied naming why not."""
        if not path:
            return path     # the reader names the missing path itself
        if ".." in Path(path).parts:
            raise PermissionDenied("a dump path may not contain '..'", field="dump_path")
        if self.roots is None:
            if self.local:
                return path
            raise PermissionDenied("this collector reads dumps only below its dump roots, and none are set "
                                   "(LAYERDIFF_DUMP_ROOTS on the collector)", field="dump_path")
        resolved = Path(os.path.realpath(path))
        for root in self.roots:
            if resolved == root or root in resolved.parents:
                return str(resolved)
        shown = ", ".join(str(r) for r in self.roots)
        via = f" (it leads to {resolved})" if str(resolved) != os.path.abspath(path) else ""
        raise PermissionDenied(f"dump path {path!r}{via} is outside the collector's dump roots ({shown})",
                               field="dump_path")
