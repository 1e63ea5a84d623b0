"""Dump directories on the collector's host: one ``.npy`` file per node output
and an optional ``manifest.json``::

    {"nodes": [{"name": "conv1", "op_type": "Conv", "order": 0, "file": "conv1.npy"}, ...]}

Without a manifest every ``*.npy`` file is a node named after its stem, in
file-name order. Every entry is validated on its own (name, path, header,
size) before anything is mapped, and a bad entry becomes an error record for
that node only: the rest of the dump streams on.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from layerdiff.errors import LayerdiffError, NotFoundError
from layerdiff.schema import ALLOWED_DTYPES, DEFAULT_MAX_TENSOR_BYTES, NodeRecord

MANIFEST = "manifest.json"


def check_node_name(name: object) -> str:
    """Node names are free text, but never a path: reject NUL and '..' segments."""
    if not isinstance(name, str) or not name:
        raise LayerdiffError("node name must be a non-empty string", field="name")
    if "\x00" in name:
        raise LayerdiffError("node name contains a NUL character", node=name.replace("\x00", "\\0"), field="name")
    if any(part == ".." for part in name.replace("\\", "/").split("/")):
        raise LayerdiffError("node name contains a '..' path segment", node=name, field="name")
    return name


def resolve_inside(root: Path, rel: object, node: str) -> Path:
    if not isinstance(rel, str) or not rel:
        raise LayerdiffError("manifest entry has no file", node=node, field="file")
    if "\x00" in rel or os.path.isabs(rel) or any(p == ".." for p in rel.replace("\\", "/").split("/")):
        raise LayerdiffError(f"file {rel!r} is outside the dump directory", node=node, field="file")
    p = (root / rel).resolve()
    if root.resolve() not in p.parents:
        raise LayerdiffError(f"file {rel!r} is outside the dump directory", node=node, field="file")
    return p


def read_npy(path: Path, max_bytes: int = DEFAULT_MAX_TENSOR_BYTES, name: str | None = None) -> np.ndarray:
    """Map a .npy file after checking its header against its size: corrupt,
    truncated or object-typed files are refused before any allocation."""
    shown = name or str(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            try:
                version = np.lib.format.read_magic(f)
            except ValueError as e:
                raise LayerdiffError(f"not a .npy file ({e})", file=shown) from e
            try:
                if version == (1, 0):
                    shape, fortran, dtype = np.lib.format.read_array_header_1_0(f, max_header_size=65536)
                elif version in ((2, 0), (3, 0)):
                    shape, fortran, dtype = np.lib.format.read_array_header_2_0(f, max_header_size=65536)
                else:
                    raise LayerdiffError(f"unsupported .npy version {version}", file=shown)
            except (ValueError, SyntaxError) as e:
                raise LayerdiffError(f"corrupt .npy header ({e})", file=shown) from e
            header_end = f.tell()
    except OSError as e:
        raise LayerdiffError(f"cannot be read: {e.strerror}", file=shown) from e
    if dtype.hasobject or dtype.name not in ALLOWED_DTYPES:
        raise LayerdiffError(f"dtype {dtype} is not a plain numeric type", file=shown, field="dtype")
    count = 1
    for s in shape:
        count *= s
    nbytes = count * dtype.itemsize
    if nbytes > max_bytes:
        raise LayerdiffError(f"declared shape {shape} is {nbytes} bytes, over the limit of {max_bytes}", file=shown,
                             field="shape")
    if size - header_end < nbytes:
        raise LayerdiffError(f"truncated: header declares {nbytes} bytes of data, file holds {size - header_end}",
                             file=shown)
    if nbytes == 0:
        return np.zeros(shape, dtype=dtype)
    arr = np.memmap(path, dtype=dtype, mode="r", offset=header_end, shape=tuple(shape),
                    order="F" if fortran else "C")
    return np.asarray(arr)


class DumpDirectory:
    """A directory of .npy node dumps, read where it lies."""

    def __init__(self, path: str, max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES) -> None:
        if not path:
            raise LayerdiffError("no dump path given", field="dump_path")
        self.root = Path(path)
        if not self.root.is_dir():
            raise NotFoundError(f"dump directory {path!r} does not exist on the collector host", field="dump_path")
        self.max_tensor_bytes = max_tensor_bytes
        self.entries = self._entries()

    def _entries(self) -> list[dict]:
        mpath = self.root / MANIFEST
        if not mpath.exists():
            files = sorted(p.name for p in self.root.glob("*.npy"))
            return [{"name": Path(f).stem, "file": f, "order": i, "op_type": ""} for i, f in enumerate(files)]
        try:
            doc = json.loads(mpath.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise LayerdiffError(f"is not valid JSON: {e}", file=str(mpath)) from e
        nodes = doc.get("nodes") if isinstance(doc, dict) else None
        if not isinstance(nodes, list):
            raise LayerdiffError("must hold {\"nodes\": [...]}", file=str(mpath), field="nodes")
        return nodes

    def records(self) -> Iterator[NodeRecord]:
        for i, entry in enumerate(self.entries):
            yield self._record(i, entry)

    def _record(self, i: int, entry: object) -> NodeRecord:
        if not isinstance(entry, dict):
            return NodeRecord.error(f"<entry {i}>", f"manifest entry {i} is not an object")
        raw_name = entry.get("name")
        op_type = entry.get("op_type") or ""
        order = entry.get("order", i)
        if not isinstance(op_type, str):
            op_type = str(op_type)
        if not isinstance(order, int) or isinstance(order, bool):
            order = i
        try:
            name = check_node_name(raw_name)
            path = resolve_inside(self.root, entry.get("file"), name)
            if not path.exists():
                raise LayerdiffError(f"manifest names a missing file {entry.get('file')!r}", node=name, field="file")
            arr = read_npy(path, self.max_tensor_bytes, name=str(entry.get("file")))
        except LayerdiffError as e:
            shown = raw_name if isinstance(raw_name, str) and raw_name else f"<entry {i}>"
            return NodeRecord.error(shown.replace("\x00", "\\0"), str(e), op_type, order)
        return NodeRecord(name=name, op_type=op_type, order=order, array=arr, node=name)


def write_dump(directory: str | Path, records: list[NodeRecord]) -> Path:
    """Write records as a dump directory with a manifest (used by tests, demos
    and to save what a live run produced)."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    nodes = []
    for i, r in enumerate(records):
        if r.array is None:
            continue
        fname = f"{i:05d}.npy"
        np.save(root / fname, r.array, allow_pickle=False)
        nodes.append({"name": r.name, "op_type": r.op_type, "order": r.order if r.order >= 0 else i, "file": fname})
    (root / MANIFEST).write_text(json.dumps({"nodes": nodes}, indent=1), encoding="utf-8")
    return root
