"""Dump directories on the collector's host, read where they lie.

Each node output is one file, in one of these formats (each behind one
reader function with the same contract: validate, then map or read):

- ``npy``: a NumPy ``.npy`` file;
- ``npz``: a ``.npz`` archive, every member a node named by its key;
- ``onnx``: a serialized ONNX ``TensorProto`` (``.pb`` / ``.tensor``), named
  by its ``name`` field or the file stem;
- ``bin``: raw bytes at a byte offset of a file, with dtype and shape given
  by the manifest entry;
- ``h5``: an HDF5 dump laid out ``/op/seqid/{input,output}/N`` (PyTorch on
  NPU); output N of the first call of ``op`` is the node ``op`` (``op:N`` for
  N > 0), its later calls ``op@k`` (k = 1 for the second call, in seqid
  order), so that two dumps pair call by call whatever seqids each runtime
  gave. Execution order: a call group's ``order`` attribute, else its seqid.

An optional ``manifest.json`` lists the nodes with their execution order::

    {"nodes": [{"name": "conv1", "op_type": "Conv", "order": 0, "file": "conv1.npy"},
               {"name": "fc", "file": "all.bin", "format": "bin", "dtype": "float16",
                "shape": [1, 10], "offset": 4096}]}

A tiled node (per core / per tile slices) lists its ``slices`` in order, each
a ``bin`` file (raw bytes at an offset) or a ``hex`` text file (hex digits,
whitespace ignored), with the node's ``dtype`` and the grouping info
``concat_dim``; without it the reader's ``default_concat_dim`` applies (-1:
the first axis whose size is not 1)::

    {"name": "conv5", "dtype": "float16", "shape": [1, 64, 32, 32], "concat_dim": 2,
     "slices": [{"file": "conv5.0.hex", "format": "hex", "shape": [1, 64, 16, 32]},
                {"file": "conv5.1.hex", "format": "hex", "shape": [1, 64, 16, 32]}]}

A slice that fails validation makes the node a ``check_skip`` record, slices
that do not splice a ``concat_skip`` record (check_skip.log, concate_skip.log).

An entry's format is its ``format`` field, else the dump's format, else the
file extension. Without a manifest every file of a known extension (or of the
chosen format) is read, in file-name order. Every entry is validated on its own (name, path, header,
size) before anything is mapped, and a bad entry becomes an error record for
that node only: the rest of the dump streams on.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from layerdiff.common.errors import LayerdiffError, NotFoundError
from layerdiff.common.schema import (
    ALLOWED_DTYPES,
    DEFAULT_MAX_TENSOR_BYTES,
    ROLE_INPUT,
    ROLE_OUTPUT,
    STATUS_CHECK_SKIP,
    STATUS_CONCAT_SKIP,
    NodeRecord,
    span_bytes,
)

MANIFEST = "manifest.json"
FORMATS = ("npy", "npz", "onnx", "bin", "h5", "ascend")
_EXTENSIONS = {".npy": "npy", ".npz": "npz", ".pb": "onnx", ".tensor": "onnx", ".bin": "bin", ".h5": "h5",
               ".hdf5": "h5"}


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
            except LayerdiffError:
                raise
            except Exception as e:  # numpy's header parser raises ValueError, SyntaxError, TokenError...
                raise LayerdiffError(f"corrupt .npy header ({type(e).__name__}: {e})", file=shown) from e
            header_end = f.tell()
    except OSError as e:
        raise LayerdiffError(f"cannot be read: {e.strerror}", file=shown) from e
    if dtype.hasobject or dtype.name not in ALLOWED_DTYPES:
        raise LayerdiffError(f"dtype {dtype} is not a plain numeric type", file=shown, field="dtype")
    count = 1
    for s in shape:
        count *= s
    nbytes = count * dtype.itemsize
    if nbytes > max_bytes or span_bytes(shape, dtype.itemsize) > max_bytes:
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


def _size_of(dtype: np.dtype, shape, max_bytes: int, shown: str) -> int:
    count = 1
    for s in shape:
        if not isinstance(s, (int, np.integer)) or s < 0:
            raise LayerdiffError(f"invalid dimension {s!r} in shape {list(shape)}", file=shown, field="shape")
        count *= int(s)
    if count * dtype.itemsize > max_bytes or span_bytes(shape, dtype.itemsize) > max_bytes:
        raise LayerdiffError(f"declared shape {list(shape)} of {dtype} is over the limit of {max_bytes} bytes",
                             file=shown, field="shape")
    return count * dtype.itemsize


def _plain_dtype(dtype: object, shown: str) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise LayerdiffError(f"dtype {dtype!r} is not a numeric type", file=shown, field="dtype") from None
    if dt.hasobject or dt.name not in ALLOWED_DTYPES:
        raise LayerdiffError(f"dtype {dt} is not a plain numeric type", file=shown, field="dtype")
    return dt


def read_raw(path: Path, dtype: object, shape: object, offset: object = 0,
             max_bytes: int = DEFAULT_MAX_TENSOR_BYTES, name: str | None = None) -> np.ndarray:
    """Map ``shape`` elements of ``dtype`` at byte ``offset`` of a raw file,
    after checking that the manifest's claims fit the file."""
    shown = name or str(path)
    dt = _plain_dtype(dtype, shown)
    if not isinstance(shape, (list, tuple)):
        raise LayerdiffError("shape must be a list of dimensions", file=shown, field="shape")
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise LayerdiffError(f"offset {offset!r} is not a byte offset", file=shown, field="offset")
    nbytes = _size_of(dt, shape, max_bytes, shown)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise LayerdiffError(f"cannot be read: {e.strerror}", file=shown) from e
    if offset + nbytes > size:
        raise LayerdiffError(f"{nbytes} bytes at offset {offset} run past the end of the file ({size} bytes)",
                             file=shown, field="offset")
    if nbytes == 0:
        return np.zeros(tuple(shape), dtype=dt)
    return np.asarray(np.memmap(path, dtype=dt, mode="r", offset=offset, shape=tuple(int(s) for s in shape)))


def read_tensor_proto(path: Path, max_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
                      name: str | None = None) -> tuple[str, np.ndarray]:
    """(tensor name, array) of a serialized onnx.TensorProto; the declared
    shape is checked against the limit and against the data before decoding."""
    import onnx
    from onnx import numpy_helper

    from layerdiff.common.onnxgraph import ONNX_TO_NUMPY

    shown = name or str(path)
    try:
        size = path.stat().st_size
        if size > max_bytes + 65536:
            raise LayerdiffError(f"file of {size} bytes is over the limit of {max_bytes}", file=shown)
        t = onnx.TensorProto.FromString(path.read_bytes())
    except LayerdiffError:
        raise
    except OSError as e:
        raise LayerdiffError(f"cannot be read: {e.strerror}", file=shown) from e
    except Exception as e:
        raise LayerdiffError(f"is not an ONNX TensorProto ({type(e).__name__})", file=shown) from e
    if t.data_location == onnx.TensorProto.EXTERNAL:
        raise LayerdiffError("refers to external data", file=shown, field="data_location")
    dtype = ONNX_TO_NUMPY.get(t.data_type)
    if dtype is None:
        raise LayerdiffError(f"element type {t.data_type} is not a plain numeric type", file=shown, field="data_type")
    dt = np.dtype(dtype)
    nbytes = _size_of(dt, list(t.dims), max_bytes, shown)
    count = nbytes // dt.itemsize
    if t.HasField("raw_data"):
        if len(t.raw_data) != nbytes:
            raise LayerdiffError(f"raw_data holds {len(t.raw_data)} bytes, dims {list(t.dims)} need {nbytes}",
                                 file=shown, field="raw_data")
    else:
        held = max(len(t.float_data), len(t.int32_data), len(t.int64_data), len(t.double_data),
                   len(t.uint64_data))
        if held != count:
            raise LayerdiffError(f"holds {held} values, dims {list(t.dims)} need {count}", file=shown,
                                 field="dims")
    try:
        arr = numpy_helper.to_array(t)
    except Exception as e:
        raise LayerdiffError(f"cannot be decoded ({type(e).__name__}: {e})", file=shown) from e
    return t.name or path.stem, arr


def read_npz(path: Path, max_bytes: int = DEFAULT_MAX_TENSOR_BYTES) -> Iterator[tuple[str, object]]:
    """(key, array or LayerdiffError) for every member of an .npz archive,
    each member's header checked before it is decompressed."""
    import zipfile

    shown = str(path.name)
    try:
        zf = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as e:
        raise LayerdiffError(f"is not an .npz archive ({e})", file=shown) from e
    except Exception as e:   # a damaged directory: "zip file version 6.4", bad sizes...
        raise LayerdiffError(f"is not a readable .npz archive ({type(e).__name__}: {e})", file=shown) from e
    with zf:
        for info in zf.infolist():
            key = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
            member = f"{shown}:{info.filename}"
            try:
                if info.file_size > max_bytes + 65536:
                    raise LayerdiffError(f"member of {info.file_size} bytes is over the limit", file=member)
                with zf.open(info) as f:
                    version = np.lib.format.read_magic(f)
                    reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                        np.lib.format.read_array_header_2_0
                    shape, fortran, dtype = reader(f, max_header_size=65536)
                    dt = _plain_dtype(dtype, member)
                    nbytes = _size_of(dt, shape, max_bytes, member)
                    data = f.read(nbytes + 1)
                if len(data) != nbytes:
                    raise LayerdiffError(f"truncated: header declares {nbytes} bytes, member holds {len(data)}",
                                         file=member)
                arr = np.frombuffer(data, dtype=dt).reshape(shape, order="F" if fortran else "C")
                yield key, arr
            except LayerdiffError as e:
                yield key, e
            except Exception as e:  # zlib, bad magic, cut archive: this member only
                yield key, LayerdiffError(f"unreadable member ({type(e).__name__}: {e})", file=member)


def read_h5(path: Path, max_bytes: int = DEFAULT_MAX_TENSOR_BYTES) -> Iterator[tuple]:
    """(node name, array or LayerdiffError, role, slot, overflow flag,
    execution order or -1) for every ``/op/seqid/{input,output}/N`` dataset
    (a call's inputs before its outputs), each checked (dtype, declared size)
    before it is read."""
    import h5py

    shown = path.name
    try:
        f = h5py.File(path, "r")
    except Exception as e:  # h5py raises OSError and others for non-HDF5 bytes
        raise LayerdiffError(f"is not an HDF5 file ({type(e).__name__}: {e})", file=shown) from e

    def numbered(group):
        return sorted(group.keys(), key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else 0, k))

    with f:
        for op in f.keys():   # the file's own order (insertion order where it tracks it)
            group = f[op]
            if not isinstance(group, h5py.Group):
                yield op, LayerdiffError("is not an /op/seqid group", file=shown, node=op), ROLE_OUTPUT, 0
                continue
            for n_call, seq in enumerate(numbered(group)):
                call = group[seq]
                base = op if n_call == 0 else f"{op}@{n_call}"
                sides = [(role, call.get(role)) for role in (ROLE_INPUT, ROLE_OUTPUT)] \
                    if isinstance(call, h5py.Group) else []
                sides = [(role, g) for role, g in sides if isinstance(g, h5py.Group)]
                if not sides:
                    yield base, LayerdiffError("has no input or output group", file=shown, node=f"{op}/{seq}"), \
                        ROLE_OUTPUT, 0
                    continue
                order = _call_order(call, seq)
                for role, members in sides:
                    for idx in numbered(members):
                        slot = int(idx) if idx.isdigit() else 0
                        name = base if idx == "0" or role == ROLE_INPUT else f"{base}:{idx}"
                        where = f"{shown}:/{op}/{seq}/{role}/{idx}"
                        try:
                            ds = members[idx]
                            if not isinstance(ds, h5py.Dataset):
                                raise LayerdiffError("is not a dataset", file=where)
                            dt = _plain_dtype(ds.dtype, where)
                            _size_of(dt, ds.shape or (), max_bytes, where)
                            flag = ds.attrs.get("overflow", "")
                            yield (name, np.asarray(ds[()], dtype=dt), role, slot,
                                   flag if isinstance(flag, str) else "", order)
                        except LayerdiffError as e:
                            yield name, e, role, slot, "", order
                        except Exception as e:  # a damaged dataset: this node only
                            yield name, LayerdiffError(f"unreadable dataset ({type(e).__name__}: {e})",
                                                       file=where), role, slot, "", order


def _call_order(call, seq: str) -> int:
    """A call's execution order: its ``order`` attribute (layerdiff.torch
    writes one), else a numeric seqid; -1 when neither says."""
    try:
        value = call.attrs.get("order") if hasattr(call, "attrs") else None
    except Exception:       # a damaged attribute: the seqid still tells
        value = None
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and 0 <= value < 1 << 31:
        return int(value)
    return int(seq) if seq.isdigit() and len(seq) < 10 else -1


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
        dt = _plain_dtype(entry.get("dtype"), name)
    except LayerdiffError as e:
        raise SpliceError(str(e), STATUS_CHECK_SKIP) from None
    parts, total = [], 0
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
            nbytes = _size_of(dt, shape, max_bytes - total, f"{name} {where}")
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


class DumpDirectory:
    """A directory of node dumps, read where it lies."""

    def __init__(self, path: str, max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES, fmt: str = "",
                 default_concat_dim: int = 0, entries: list[dict] | None = None) -> None:
        """``entries``: read these manifest entries instead of listing the directory."""
        if not path:
            raise LayerdiffError("no dump path given", field="dump_path")
        if fmt and fmt not in FORMATS:
            raise LayerdiffError(f"unknown dump format {fmt!r} (one of {', '.join(FORMATS)})", field="format")
        self.root = Path(path)
        if not self.root.is_dir():
            raise NotFoundError(f"dump directory {path!r} does not exist on the collector host", field="dump_path")
        self.max_tensor_bytes = max_tensor_bytes
        self.fmt = fmt
        self.default_concat_dim = default_concat_dim
        self.ascend_files: list[Path] | None = None
        self.graph_inputs: list[str] = []     # the manifest's top-level "inputs" (see collector.dumpgraph)
        self.entries = entries if entries is not None else self._entries()

    def _entries(self) -> list[dict]:
        mpath = self.root / MANIFEST
        if not mpath.exists() and self.fmt in ("", "ascend"):
            # Vendor runtime dumps: {op_type}.{op_name}.{task_id}.{stream_id}.{timestamp}
            # files, possibly under {time}/{device_id}/{model_id}/{data_index}.
            from layerdiff.collector.dumps import ascend

            files = ascend.dump_files(self.root)
            if self.fmt == "ascend" or any(ascend.looks_like_dump(p) for p in files[:8]):
                self.ascend_files = files
                return []
        if not mpath.exists():
            files = sorted(p.name for p in self.root.iterdir() if p.is_file() and p.name != MANIFEST and
                           (_EXTENSIONS.get(p.suffix.lower()) == self.fmt if self.fmt else
                            _EXTENSIONS.get(p.suffix.lower()) in ("npy", "npz", "onnx", "h5")))
            return [{"name": Path(f).stem, "file": f, "order": i, "op_type": ""} for i, f in enumerate(files)]
        try:
            doc = json.loads(mpath.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise LayerdiffError(f"is not valid JSON: {e}", file=str(mpath)) from e
        nodes = doc.get("nodes") if isinstance(doc, dict) else None
        inputs = doc.get("inputs") if isinstance(doc, dict) else None
        if isinstance(inputs, list):
            self.graph_inputs = [v for v in inputs if isinstance(v, str)]
        if not isinstance(nodes, list):
            raise LayerdiffError("must hold {\"nodes\": [...]}", file=str(mpath), field="nodes")
        return nodes

    def records(self) -> Iterator[NodeRecord]:
        if self.ascend_files is not None:
            from layerdiff.collector.dumps import ascend

            yield from ascend.records(self.root, self.ascend_files, self.max_tensor_bytes, check_node_name)
            return
        for i, entry in enumerate(self.entries):
            if isinstance(entry, dict) and self._format(entry) in ("npz", "h5"):
                yield from self._archive_records(i, entry)
            else:
                yield self.read_entry(i, entry)

    def _format(self, entry: dict) -> str:
        fmt = entry.get("format") or self.fmt
        if not fmt and isinstance(entry.get("file"), str):
            fmt = _EXTENSIONS.get(Path(entry["file"]).suffix.lower(), "npy")
        return fmt or "npy"

    def _archive_records(self, i: int, entry: dict) -> Iterator[NodeRecord]:
        """Files holding many nodes (npz, HDF5)."""
        order = entry.get("order", i) if isinstance(entry.get("order", i), int) else i
        try:
            path = resolve_inside(self.root, entry.get("file"), str(entry.get("name")))
            read = read_h5 if self._format(entry) == "h5" else read_npz
            members = list(read(path, self.max_tensor_bytes))
        except LayerdiffError as e:
            yield NodeRecord.error(str(entry.get("name") or f"<entry {i}>"), str(e), order=order)
            return
        # npz members carry no role of their own: the entry's "members" map says
        # which are inputs; HDF5 datasets say it by their group.
        placements = entry.get("members") if isinstance(entry.get("members"), dict) else {}
        for key, value, *where in members:
            placed = placements.get(key) if not where else None
            rec_order = order
            try:
                name = check_node_name(key)
                if isinstance(placed, dict):
                    role, slot, node = _placement(placed, name)
                elif where:
                    role, slot = where[0], where[1]
                    node = name
                    placed = {"overflow": where[2]} if len(where) > 2 and where[2] else None
                    if len(where) > 3 and where[3] >= 0:
                        rec_order = where[3]
                else:
                    role, slot, node = ROLE_OUTPUT, 0, name
            except LayerdiffError as e:
                yield NodeRecord.error(key.replace("\x00", "\\0") or f"<member of {path.name}>", str(e),
                                       order=order)
                continue
            if isinstance(value, LayerdiffError):
                yield NodeRecord.error(name, str(value), order=rec_order, node=node, role=role, slot=slot)
            else:
                yield _placed(NodeRecord(name=name, op_type=entry.get("op_type") or "", order=rec_order,
                                         array=value),
                              placed if isinstance(placed, dict) else {}, role, slot, node)

    def read_entry(self, i: int, entry: object) -> NodeRecord:
        """One manifest entry as a record (an error record if it cannot be read)."""
        if not isinstance(entry, dict):
            return NodeRecord.error(f"<entry {i}>", f"manifest entry {i} is not an object")
        raw_name = entry.get("name")
        op_type = entry.get("op_type") or ""
        order = entry.get("order", i)
        if not isinstance(op_type, str):
            op_type = str(op_type)
        if not isinstance(order, int) or isinstance(order, bool):
            order = i
        role, slot = ROLE_OUTPUT, 0
        try:
            name = check_node_name(raw_name)
            role, slot, node = _placement(entry, name)
            if "slices" in entry:
                arr = splice(self.root, entry, name, self.default_concat_dim, self.max_tensor_bytes)
                return _placed(NodeRecord(name=name, op_type=op_type, order=order, array=arr), entry, role, slot,
                               node)
            path = resolve_inside(self.root, entry.get("file"), name)
            if not path.exists():
                raise LayerdiffError(f"manifest names a missing file {entry.get('file')!r}", node=name, field="file")
            fmt = self._format(entry)
            shown = str(entry.get("file"))
            if fmt == "npy":
                arr = read_npy(path, self.max_tensor_bytes, name=shown)
            elif fmt == "onnx":
                _, arr = read_tensor_proto(path, self.max_tensor_bytes, name=shown)
            elif fmt == "bin":
                arr = read_raw(path, entry.get("dtype"), entry.get("shape"), entry.get("offset", 0),
                               self.max_tensor_bytes, name=shown)
            else:
                raise LayerdiffError(f"unknown format {fmt!r} (one of {', '.join(FORMATS)})", node=name,
                                     field="format")
        except LayerdiffError as e:
            shown = raw_name if isinstance(raw_name, str) and raw_name else f"<entry {i}>"
            return NodeRecord.error(shown.replace("\x00", "\\0"), str(e), op_type, order,
                                    status=getattr(e, "status", "error"), role=role, slot=slot)
        return _placed(NodeRecord(name=name, op_type=op_type, order=order, array=arr), entry, role, slot, node)


def _placement(entry: dict, name: str) -> tuple[str, int, str]:
    """(role, slot, node) of a manifest entry: an output of the node it names
    unless it says ``"role": "input"`` (then ``slot`` is the input index and
    ``node`` the consuming node)."""
    role = entry.get("role", ROLE_OUTPUT)
    if role not in (ROLE_OUTPUT, ROLE_INPUT):
        raise LayerdiffError(f"role {role!r} is neither 'output' nor 'input'", node=name, field="role")
    slot = entry.get("slot", 0)
    if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < 1 << 20:
        raise LayerdiffError(f"slot {slot!r} is not an input/output index", node=name, field="slot")
    node = entry.get("node", name)
    node = check_node_name(node) if node != name else name
    return role, slot, node


def _placed(rec: NodeRecord, entry: dict, role: str, slot: int, node: str) -> NodeRecord:
    rec.role, rec.slot, rec.node = role, slot, node
    flag = entry.get("overflow")
    rec.overflow = flag if isinstance(flag, str) else ""
    return rec


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


def placement(r: NodeRecord) -> dict:
    """The manifest fields that place a record on its node (see _placement)."""
    d: dict = {}
    if r.role == ROLE_INPUT:
        d.update(role=ROLE_INPUT, slot=r.slot, node=r.node or r.name)
    elif r.node and r.node != r.name:
        d.update(node=r.node, slot=r.slot)
    if r.overflow:
        d["overflow"] = r.overflow
    return d


def write_dump(directory: str | Path, records: Iterable[NodeRecord], fmt: str = "npy") -> Path:
    """Write records (outputs, and inputs where a record's role says so) as a
    dump directory in any of FORMATS, with a manifest where the format needs
    one (used to save what a live run produced, and by tests and demos).
    Every format but npz and ascend writes each record as it comes, so a
    generator's dump never has to fit in memory. Returns the directory a
    reader should be given."""
    if fmt not in FORMATS:
        raise LayerdiffError(f"unknown dump format {fmt!r} (one of {', '.join(FORMATS)})", field="format")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    kept: Iterable[tuple[int, NodeRecord]] = ((i, r) for i, r in enumerate(records) if r.array is not None)
    if fmt in ("npz", "ascend"):
        kept = list(kept)
    if fmt == "ascend":
        return _write_ascend(root, kept)
    nodes: list[dict] = []
    if fmt == "h5":
        import h5py

        with h5py.File(root / "dump.h5", "w", track_order=True) as f:
            for _, r in kept:
                # grouped by operator, as the layout is: /op/seqid/{input,output}/N
                node = (r.node or r.name).replace("/", "_")
                ds = f.create_dataset(f"{node}/0/{r.role}/{r.slot}", data=r.array)
                if r.overflow:
                    ds.attrs["overflow"] = r.overflow
        nodes.append({"name": "dump", "file": "dump.h5", "format": "h5", "order": 0})
    elif fmt == "npz":
        keys = [r.name if r.role != ROLE_INPUT else f"{r.node or r.name}.input.{r.slot}" for _, r in kept]
        np.savez(root / "dump.npz", **{k: r.array for k, (_, r) in zip(keys, kept)})
        members = {k: placement(r) for k, (_, r) in zip(keys, kept) if placement(r)}
        nodes.append({"name": "dump", "file": "dump.npz", "format": "npz", "order": 0, "members": members})
    elif fmt == "bin":
        offset = 0
        with open(root / "dump.bin", "wb") as f:
            for i, r in kept:
                pad = -offset % 64
                f.write(b"\0" * pad)
                offset += pad
                arr = np.require(r.array, requirements="C")  # keeps 0-d tensors 0-d
                f.write(arr.tobytes())
                nodes.append({"name": r.name, "op_type": r.op_type, "order": r.order if r.order >= 0 else i,
                              "file": "dump.bin", "format": "bin", "dtype": arr.dtype.name,
                              "shape": list(arr.shape), "offset": offset, **placement(r)})
                offset += arr.nbytes
    else:
        from onnx import numpy_helper

        for i, r in kept:
            if fmt == "onnx":
                fname = f"{i:05d}.pb"
                (root / fname).write_bytes(numpy_helper.from_array(np.asarray(r.array), r.name).SerializeToString())
            else:
                fname = f"{i:05d}.npy"
                np.save(root / fname, r.array, allow_pickle=False)
            nodes.append({"name": r.name, "op_type": r.op_type, "order": r.order if r.order >= 0 else i,
                          "file": fname, **placement(r)})
    (root / MANIFEST).write_text(json.dumps({"nodes": nodes}, indent=1), encoding="utf-8")
    return root


def _write_ascend(root: Path, kept: list[tuple[int, NodeRecord]]) -> Path:
    """One vendor dump file per node ({time}/{device_id}/{model_id}/{data_index}
    layout), and an overflow record for every node flagged as overflowing."""
    from layerdiff.collector.dumps import ascend, overflow

    leaf = ascend.leaf_dir(root)
    leaf.mkdir(parents=True, exist_ok=True)
    groups: dict[str, list[NodeRecord]] = {}
    for _, r in kept:
        groups.setdefault(r.node or r.name, []).append(r)
    base = int(time.time() * 1e6)
    for task_id, (node, recs) in enumerate(groups.items(), start=1):
        ins = sorted((r for r in recs if r.role == ROLE_INPUT), key=lambda r: r.slot)
        outs = sorted((r for r in recs if r.role != ROLE_INPUT), key=lambda r: r.slot)
        stamp = base + 2 * task_id
        fname = ascend.file_name(recs[0].op_type, node, task_id, 0, stamp)
        ascend.write_dump_file(leaf / fname, node, [r.array for r in ins], [r.array for r in outs], stamp)
        if any(r.overflow for r in recs):
            payload = overflow.encode_classic({"model_id": 1, "stream_id": 0, "task_id": task_id,
                                               "status": 0x20})
            ascend.write_op_debug_file(leaf / ascend.file_name("Opdebug", "Node_OpDebug", 10**6 + task_id, 0,
                                                               stamp + 1), payload, stamp + 1)
    return root
