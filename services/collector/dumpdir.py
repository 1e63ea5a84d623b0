"""Dump directories on the collector's host, read where they lie.

Each node output is one file, in one of these formats (each behind one
reader function with the same contract: validate, then map or read):

- ``npy``: a NumPy ``.npy`` file;
- ``npz``: a ``.npz`` archive, every member a node named by its key;
- ``onnx``: a serialized ONNX ``TensorProto`` (``.pb`` / ``.tensor``), named
  by its ``name`` field or the file stem;
- ``bin``: raw bytes at a byte offset of a file, with dtype and shape given
  by the manifest entry.

An optional ``manifest.json`` lists the nodes with their execution order::

    {"nodes": [{"name": "conv1", "op_type": "Conv", "order": 0, "file": "conv1.npy"},
               {"name": "fc", "file": "all.bin", "format": "bin", "dtype": "float16",
                "shape": [1, 10], "offset": 4096}]}

An entry's format is its ``format`` field, else the dump's format, else the
file extension. Without a manifest every file of a known extension (or of the
chosen format) is read, in file-name order. Every entry is validated on its own (name, path, header,
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
FORMATS = ("npy", "npz", "onnx", "bin")
_EXTENSIONS = {".npy": "npy", ".npz": "npz", ".pb": "onnx", ".tensor": "onnx", ".bin": "bin"}


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


def _size_of(dtype: np.dtype, shape, max_bytes: int, shown: str) -> int:
    count = 1
    for s in shape:
        if not isinstance(s, (int, np.integer)) or s < 0:
            raise LayerdiffError(f"invalid dimension {s!r} in shape {list(shape)}", file=shown, field="shape")
        count *= int(s)
        if count * dtype.itemsize > max_bytes:
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

    from layerdiff.onnxgraph import ONNX_TO_NUMPY

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


class DumpDirectory:
    """A directory of node dumps, read where it lies."""

    def __init__(self, path: str, max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES, fmt: str = "") -> None:
        if not path:
            raise LayerdiffError("no dump path given", field="dump_path")
        if fmt and fmt not in FORMATS:
            raise LayerdiffError(f"unknown dump format {fmt!r} (one of {', '.join(FORMATS)})", field="format")
        self.root = Path(path)
        if not self.root.is_dir():
            raise NotFoundError(f"dump directory {path!r} does not exist on the collector host", field="dump_path")
        self.max_tensor_bytes = max_tensor_bytes
        self.fmt = fmt
        self.entries = self._entries()

    def _entries(self) -> list[dict]:
        mpath = self.root / MANIFEST
        if not mpath.exists():
            files = sorted(p.name for p in self.root.iterdir() if p.is_file() and p.name != MANIFEST and
                           (_EXTENSIONS.get(p.suffix.lower()) == self.fmt if self.fmt else
                            _EXTENSIONS.get(p.suffix.lower()) in ("npy", "npz", "onnx")))
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
            if isinstance(entry, dict) and self._format(entry) == "npz":
                yield from self._npz_records(i, entry)
            else:
                yield self._record(i, entry)

    def _format(self, entry: dict) -> str:
        fmt = entry.get("format") or self.fmt
        if not fmt and isinstance(entry.get("file"), str):
            fmt = _EXTENSIONS.get(Path(entry["file"]).suffix.lower(), "npy")
        return fmt or "npy"

    def _npz_records(self, i: int, entry: dict) -> Iterator[NodeRecord]:
        order = entry.get("order", i) if isinstance(entry.get("order", i), int) else i
        try:
            path = resolve_inside(self.root, entry.get("file"), str(entry.get("name")))
            members = list(read_npz(path, self.max_tensor_bytes))
        except LayerdiffError as e:
            yield NodeRecord.error(str(entry.get("name") or f"<entry {i}>"), str(e), order=order)
            return
        for key, value in members:
            try:
                name = check_node_name(key)
            except LayerdiffError as e:
                yield NodeRecord.error(key.replace("\x00", "\\0") or f"<member of {path.name}>", str(e),
                                       order=order)
                continue
            if isinstance(value, LayerdiffError):
                yield NodeRecord.error(name, str(value), order=order, node=name)
            else:
                yield NodeRecord(name=name, op_type=entry.get("op_type") or "", order=order, array=value, node=name)

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
            return NodeRecord.error(shown.replace("\x00", "\\0"), str(e), op_type, order)
        return NodeRecord(name=name, op_type=op_type, order=order, array=arr, node=name)


def write_dump(directory: str | Path, records: list[NodeRecord], fmt: str = "npy") -> Path:
    """Write records as a dump directory with a manifest, in any of FORMATS
    (used to save what a live run produced, and by tests and demos)."""
    if fmt not in FORMATS:
        raise LayerdiffError(f"unknown dump format {fmt!r} (one of {', '.join(FORMATS)})", field="format")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    kept = [(i, r) for i, r in enumerate(records) if r.array is not None]
    nodes: list[dict] = []
    if fmt == "npz":
        np.savez(root / "dump.npz", **{r.name: r.array for _, r in kept})
        nodes.append({"name": "dump", "file": "dump.npz", "format": "npz", "order": 0})
    elif fmt == "bin":
        offset = 0
        with open(root / "dump.bin", "wb") as f:
            for i, r in kept:
                pad = -offset % 64
                f.write(b"\0" * pad)
                offset += pad
                arr = np.ascontiguousarray(r.array)
                f.write(arr.tobytes())
                nodes.append({"name": r.name, "op_type": r.op_type, "order": r.order if r.order >= 0 else i,
                              "file": "dump.bin", "format": "bin", "dtype": arr.dtype.name,
                              "shape": list(arr.shape), "offset": offset})
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
                          "file": fname})
    (root / MANIFEST).write_text(json.dumps({"nodes": nodes}, indent=1), encoding="utf-8")
    return root
