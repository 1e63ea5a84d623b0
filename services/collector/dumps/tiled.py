"""Tiled nodes: a node dumped as per core / per tile slices, spliced back
into one tensor.

A tiled node's manifest entry lists its ``slices`` in order, each a ``bin``
file (raw bytes at an offset) or a ``hex`` text file (hex digits, whitespace
ignored), with the node's ``dtype`` and the grouping info ``concat_dim``;
without it the reader's ``default_concat_dim`` applies (-1: the first axis
whose size is not 1)::

    {"name": "conv5", "dtype": "float16", "shape": [1, 64, 32, 32], "concat_dim": 2,
     "slices": [{"file": "conv5.0.hex", "format": "hex", "shape": [1, 64, 16, 32]},
                {"file": "conv5.1.hex", "format": "hex", "shape": [1, 64, 16, 32]}]}

A slice that fails validation makes the node a ``check_skip`` record, slices
that do not splice a ``concat_skip`` record (check_skip.log, concate_skip.log).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from layerdiff.collector.dumps.manifest import MANIFEST, resolve_inside
from layerdiff.collector.dumps.readers import plain_dtype, read_raw, size_of
from layerdiff.common.errors import LayerdiffError
from layerdiff.common.schema import DEFAULT_MAX_TENSOR_BYTES, STATUS_CHECK_SKIP, STATUS_CONCAT_SKIP, NodeRecord


class SpliceError(LayerdiffError):
    """A tiled node that cannot be assembled; ``status`` says at which stage."""

    def __init__(self, message: str, status: str, **where) -> None:
        super().__init__(message, **where)
        self.status = status


_HEX = frozenset("0123456789abcdefABCDEF")


def read_hex(path: Path, nbytes: int, name: str | None = None) -> bytes:
    """Bytes written as hex digits (whitespace ignored): any other character,
    an odd digit count or a size other than ``nbytes`` is refused, and the
    file size is checked before it is read."""
    shown = name or str(path)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise LayerdiffError(f"cannot be read: {e.strerror}", file=shown) from e
    if size > 3 * nbytes + 4096:
        raise LayerdiffError(f"{size} bytes of text is too much for {nbytes} bytes of data", file=shown)
    text = path.read_bytes().decode("latin-1")
    digits = "".join(text.split())
    for pos, ch in enumerate(digits):
        if ch not in _HEX:
            raise LayerdiffError(f"foreign character {ch!r} in hex data (digit {pos})", file=shown)
    if len(digits) % 2:
        raise LayerdiffError("odd number of hex digits", file=shown)
    data = bytes.fromhex(digits)
    if len(data) != nbytes:
        raise LayerdiffError(f"hex data holds {len(data)} bytes, the slice shape needs {nbytes}", file=shown)
    return data


def concat_axis(shape: tuple, default_concat_dim: int) -> int:
    """The seed's rule: -1 means the first axis whose size is not 1."""
    if default_concat_dim == -1:
        return next((i for i, s in enumerate(shape) if s != 1), 0)
    return default_concat_dim


def splice(root: Path, entry: dict, name: str, default_concat_dim: int = 0,
           max_bytes: int = DEFAULT_MAX_TENSOR_BYTES) -> np.ndarray:
    """Read a tiled node's slices in order and concatenate them."""
    slices = entry.get("slices")
    if not isinstance(slices, list) or not slices:
        raise SpliceError("slices must be a non-empty list", STATUS_CHECK_SKIP, node=name, field="slices")
    try:
        dt = plain_dtype(entry.get("dtype"), name)
    except LayerdiffError as e:
        raise SpliceError(str(e), STATUS_CHECK_SKIP) from None
    parts: list[np.ndarray] = []
    total = 0
    for k, sl in enumerate(slices):
        where = f"slice {k}"
        try:
            if not isinstance(sl, dict):
                raise LayerdiffError(f"{where} is not an object", node=name, field="slices")
            path = resolve_inside(root, sl.get("file"), name)
            if not path.exists():
                raise LayerdiffError(f"{where}: file {sl.get('file')!r} is missing", node=name, field="slices")
            shape = sl.get("shape")
            if not isinstance(shape, list):
                raise LayerdiffError(f"{where} has no shape", node=name, field="shape")
            nbytes = size_of(dt, shape, max_bytes - total, f"{name} {where}")
            total += nbytes
            if sl.get("format", "bin") == "hex":
                arr = np.frombuffer(read_hex(path, nbytes, f"{sl.get('file')}"), dtype=dt).reshape(shape)
            elif sl.get("format", "bin") == "bin":
                arr = read_raw(path, dt.name, shape, sl.get("offset", 0), max_bytes, name=str(sl.get("file")))
            else:
                raise LayerdiffError(f"{where}: unknown slice format {sl.get('format')!r} (bin or hex)", node=name,
                                     field="format")
        except LayerdiffError as e:
            raise SpliceError(str(e), STATUS_CHECK_SKIP) from None
        parts.append(arr)
    axis = entry.get("concat_dim")
    if axis is None:
        axis = concat_axis(parts[0].shape, default_concat_dim)
    if not isinstance(axis, int) or not -parts[0].ndim <= axis < max(parts[0].ndim, 1):
        raise SpliceError(f"concat axis {axis!r} does not exist in slice shape {list(parts[0].shape)}",
                          STATUS_CONCAT_SKIP, node=name, field="concat_dim")
    for k, p in enumerate(parts[1:], start=1):
        a, b = list(parts[0].shape), list(p.shape)
        if len(a) != len(b) or any(x != y for i, (x, y) in enumerate(zip(a, b)) if i != axis % len(a)):
            raise SpliceError(f"slice {k} of shape {b} does not concatenate with slice 0 of shape {a} along axis "
                              f"{axis}", STATUS_CONCAT_SKIP, node=name, field="slices")
    out = np.concatenate(parts, axis=axis) if len(parts) > 1 else parts[0]
    want = entry.get("shape")
    if want is not None and list(out.shape) != list(want):
        raise SpliceError(f"spliced shape {list(out.shape)} is not the declared {list(want)}", STATUS_CONCAT_SKIP,
                          node=name, field="shape")
    return out


def write_tiled_dump(directory: str | Path, records: list[NodeRecord], *, tiles: int = 2, axis: int | None = None,
                     hex_text: bool = False, grouping: bool = True) -> Path:
    """Write records as a tiled dump: each node cut into ``tiles`` slices along
    ``axis`` (default: its longest axis), as raw or hex files, with the
    grouping info in the manifest unless ``grouping`` is False."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    nodes = []
    for i, r in enumerate(records):
        if r.array is None or r.array.ndim == 0:
            continue
        arr = np.ascontiguousarray(r.array)
        ax = int(np.argmax(arr.shape)) if axis is None else axis
        if ax >= arr.ndim:
            continue
        slices = []
        for k, piece in enumerate(np.array_split(arr, min(tiles, max(arr.shape[ax], 1)), axis=ax)):
            piece = np.ascontiguousarray(piece)
            fname = f"{i:05d}.{k}.{'hex' if hex_text else 'bin'}"
            if hex_text:
                hexed = piece.tobytes().hex()
                (root / fname).write_text("\n".join(hexed[j:j + 64] for j in range(0, len(hexed), 64)) + "\n")
            else:
                (root / fname).write_bytes(piece.tobytes())
            slices.append({"file": fname, "format": "hex" if hex_text else "bin", "shape": list(piece.shape)})
        entry = {"name": r.name, "op_type": r.op_type, "order": r.order if r.order >= 0 else i,
                 "dtype": arr.dtype.name, "shape": list(arr.shape), "slices": slices}
        if grouping:
            entry["concat_dim"] = ax
        nodes.append(entry)
    (root / MANIFEST).write_text(json.dumps({"nodes": nodes}, indent=1), encoding="utf-8")
    return root
