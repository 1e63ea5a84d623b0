"""One reader per dump format, each with the same contract: validate the
file (header, declared dtype and shape against the size limit and against
the bytes the file holds), then map or read it. Nothing is allocated for a
tensor before its file has passed.

- ``npy``: a NumPy ``.npy`` file (read_npy);
- ``npz``: a ``.npz`` archive, every member a node named by its key (read_npz);
- ``onnx``: a serialized ONNX ``TensorProto`` (``.pb`` / ``.tensor``), named
  by its ``name`` field or the file stem (read_tensor_proto);
- ``bin``: raw bytes at a byte offset of a file, with dtype and shape given
  by the manifest entry (read_raw);
- ``h5``: an HDF5 dump laid out ``/op/seqid/{input,output}/N`` (PyTorch on
  NPU); output N of the first call of ``op`` is the node ``op`` (``op:N`` for
  N > 0), its later calls ``op@k`` (k = 1 for the second call, in seqid
  order), so that two dumps pair call by call whatever seqids each runtime
  gave. Execution order: a call group's ``order`` attribute, else its seqid
  (read_h5).

Tiled nodes (``bin`` / ``hex`` slices) are read by layerdiff.collector.dumps.tiled,
Ascend runtime dumps by layerdiff.collector.dumps.ascend.
"""
from __future__ import annotations

import errno
import io
import mmap
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np

from layerdiff.common.errors import LayerdiffError
from layerdiff.common.schema import (
    ALLOWED_DTYPES,
    DEFAULT_MAX_TENSOR_BYTES,
    ROLE_INPUT,
    ROLE_OUTPUT,
    dtype_name,
    span_bytes,
)

# no descriptor left to this process or the system: a limit to raise, not an unreadable file
_NO_DESCRIPTOR = (errno.EMFILE, errno.ENFILE)


class FinalLink(LayerdiffError):
    """read_npy was told not to follow a link, and the file is one."""


def read_npy(path: Path | str, max_bytes: int = DEFAULT_MAX_TENSOR_BYTES, name: str | None = None, *,
             no_link: bool = False) -> np.ndarray:
    """Map a .npy file after checking its header against its size: corrupt,
    truncated or object-typed files are refused before any allocation.
    The file is mapped once (read whole, up to SMALL_READ_BYTES) and its
    header read from there: no read or seek of its own (each a system call
    that lets the interpreter go, and waits to take it back from the threads
    comparing, a thousand times a dump). The array is read-only.
    ``no_link``: a symbolic link at ``path`` raises FinalLink (the caller
    checks where it leads, and asks again)."""
    shown = name or str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_NOFOLLOW if no_link else 0))
    except OSError as e:
        if no_link and e.errno == errno.ELOOP:
            raise FinalLink("a symbolic link", file=shown) from None
        if e.errno in _NO_DESCRIPTOR:
            raise       # not this file's fault: the job says what to raise (jobs.runner)
        raise LayerdiffError(f"cannot be read: {e.strerror}", file=shown) from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LayerdiffError("cannot be read: not a regular file", file=shown)
        size = st.st_size
        mapped: _NpyMap | _NpyBytes | None = None
        if len(_MAGIC) + 2 <= size <= SMALL_READ_BYTES:
            # read, not mapped: most of a dump's files are a few KiB, and a
            # mapping costs a page fault and, once dropped, an unmap (each
            # lets the interpreter go, a thousand times a dump)
            mapped = _NpyBytes(size)
            got_bytes = os.readv(fd, [mapped])
            if got_bytes < size:
                del mapped[got_bytes:]
                size = got_bytes
        elif size > SMALL_READ_BYTES:
            mapped = _NpyMap(fd, 0, access=mmap.ACCESS_READ)
    except OSError as e:
        if e.errno in _NO_DESCRIPTOR:
            raise
        raise LayerdiffError(f"cannot be read: {e.strerror}", file=shown) from e
    finally:
        os.close(fd)
    if mapped is None:
        raise LayerdiffError(f"not a .npy file ({size} bytes, shorter than any .npy header)", file=shown)
    got = bytes(mapped[:len(_MAGIC)])
    if got != _MAGIC:
        raise LayerdiffError(f"not a .npy file (the magic string is not correct; expected {_MAGIC!r}, "
                             f"got {got!r})", file=shown)
    version = (mapped[len(_MAGIC)], mapped[len(_MAGIC) + 1])
    if version not in ((1, 0), (2, 0), (3, 0)):
        raise LayerdiffError(f"unsupported .npy version {version}", file=shown)
    try:
        shape, fortran, dtype, header_end = _npy_header(mapped, version)
    except LayerdiffError:
        raise
    except Exception as e:  # numpy's header parser raises ValueError, SyntaxError, TokenError...
        raise LayerdiffError(f"corrupt .npy header ({type(e).__name__}: {e})", file=shown) from e
    if dtype.hasobject or dtype_name(dtype) not in ALLOWED_DTYPES:
        raise LayerdiffError(f"dtype {dtype} is not a plain numeric type", file=shown, field="dtype")
    count = 1
    for s in shape:
        count *= s
    nbytes = count * dtype.itemsize
    if nbytes > max_bytes or span_bytes(shape, dtype.itemsize) > max_bytes:
        raise LayerdiffError(f"declared shape {shape} is {nbytes} bytes, over the limit of {max_bytes}",
                             file=shown, field="shape")
    if size - header_end < nbytes:
        raise LayerdiffError(f"truncated: header declares {nbytes} bytes of data, file holds "
                             f"{size - header_end}", file=shown)
    if nbytes == 0:
        return np.zeros(shape, dtype=dtype)
    arr = np.ndarray(tuple(shape), dtype=dtype, buffer=mapped, offset=header_end, order="F" if fortran else "C")
    arr.flags.writeable = False     # as the mapping reads: the dump is never written through an array
    if not fortran:
        mapped.path, mapped.data_address, mapped.data_bytes = str(path), arr.ctypes.data, nbytes
    return arr


_MAGIC = b"\x93NUMPY"
# files up to this size are read into memory of their own, larger ones mapped
SMALL_READ_BYTES = 64 << 10


class _NpyMap(mmap.mmap):
    """A .npy file read_npy mapped, knowing which file and where its data
    lies (a C-order file's; see npy_file_of)."""

    path = ""
    data_address = 0
    data_bytes = 0


class _NpyBytes(bytearray):
    """A small .npy file read_npy read whole, knowing the same."""

    path = ""
    data_address = 0
    data_bytes = 0


def npy_file_of(arr: np.ndarray) -> Path | None:
    """The .npy file whose data ``arr`` is, whole and in C order, as
    read_npy mapped it (np.load maps that file the same way); None for
    anything else (a part of it, a copy, an array received or made)."""
    base = arr.base
    while isinstance(base, np.ndarray):
        base = base.base
    if not isinstance(base, (_NpyMap, _NpyBytes)) or not base.path or not arr.flags.c_contiguous \
            or arr.ctypes.data != base.data_address or arr.nbytes != base.data_bytes:
        return None
    return Path(base.path)


# The header numpy writes: {'descr': '<f4', 'fortran_order': False, 'shape': (1, 3), }
# padded with spaces and a newline; read without numpy's parser (ast, a third
# of reading a thousand small files). Anything else goes to numpy's.
_NUMPY_HEADER = re.compile(rb"\{'descr': '([<>|=]?[A-Za-z]\d*)', 'fortran_order': (False|True), "
                           rb"'shape': \(((?:\d+, )*(?:\d+,?)?)\), \}")
MAX_HEADER_BYTES = 65536


def _npy_header(mapped: mmap.mmap | bytearray, version: tuple[int, int]) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """(shape, fortran order, dtype, where the data starts) from the header
    of a mapped (or read) .npy file of this version."""
    start = len(_MAGIC) + 2
    width = 2 if version == (1, 0) else 4
    raw = mapped[start:start + width]
    n = int.from_bytes(raw, "little") if len(raw) == width else -1
    end = start + width + n
    if 0 <= n <= MAX_HEADER_BYTES and end <= len(mapped):
        m = _NUMPY_HEADER.fullmatch(mapped[start + width:end].rstrip(b" \n"))
        if m is not None:
            try:
                dtype = np.dtype(m[1].decode("ascii"))
            except TypeError:
                dtype = None
            if dtype is not None:
                return tuple(int(x) for x in m[3].split(b",") if x.strip()), m[2] == b"True", dtype, end
    # any other layout: numpy's own parser, on the header's bytes
    f = io.BytesIO(mapped[start:min(len(mapped), start + width + MAX_HEADER_BYTES)])
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, fortran, dtype = read(f, max_header_size=MAX_HEADER_BYTES)
    return shape, fortran, dtype, start + f.tell()


def size_of(dtype: np.dtype, shape, max_bytes: int, shown: str) -> int:
    count = 1
    for s in shape:
        if not isinstance(s, (int, np.integer)) or s < 0:
            raise LayerdiffError(f"invalid dimension {s!r} in shape {list(shape)}", file=shown, field="shape")
        count *= int(s)
    if count * dtype.itemsize > max_bytes or span_bytes(shape, dtype.itemsize) > max_bytes:
        raise LayerdiffError(f"declared shape {list(shape)} of {dtype} is over the limit of {max_bytes} bytes",
                             file=shown, field="shape")
    return count * dtype.itemsize


def plain_dtype(dtype: object, shown: str) -> np.dtype:
    try:
        dt = np.dtype(cast(Any, dtype))    # whatever the manifest says: np.dtype refuses what is no dtype
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
    dt = plain_dtype(dtype, shown)
    if not isinstance(shape, (list, tuple)):
        raise LayerdiffError("shape must be a list of dimensions", file=shown, field="shape")
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise LayerdiffError(f"offset {offset!r} is not a byte offset", file=shown, field="offset")
    nbytes = size_of(dt, shape, max_bytes, shown)
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
    nbytes = size_of(dt, list(t.dims), max_bytes, shown)
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
                    dt = plain_dtype(dtype, member)
                    nbytes = size_of(dt, shape, max_bytes, member)
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
    execution order or -1, the dtype the device wrote it in where the file
    holds it widened: its ``dtype`` attribute, '' if none, the call's op
    type: its ``class`` or ``op`` attribute, '' if none, and what else the
    call's group says of it as JSON text: ``attrs``, ``args``) for every
    ``/op/seqid/{input,output}/N`` dataset (a call's inputs before its
    outputs), each checked (dtype, declared size) before it is read."""
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
                op_type, about = _call_about(call)
                for role, members in sides:
                    for idx in numbered(members):
                        slot = int(idx) if idx.isdigit() else 0
                        name = base if idx == "0" or role == ROLE_INPUT else f"{base}:{idx}"
                        where = f"{shown}:/{op}/{seq}/{role}/{idx}"
                        try:
                            ds = members[idx]
                            if not isinstance(ds, h5py.Dataset):
                                raise LayerdiffError("is not a dataset", file=where)
                            dt = plain_dtype(ds.dtype, where)
                            size_of(dt, ds.shape or (), max_bytes, where)
                            flag = ds.attrs.get("overflow", "")
                            source = ds.attrs.get("dtype", "")
                            yield (name, np.asarray(ds[()], dtype=dt), role, slot,
                                   flag if isinstance(flag, str) else "", order,
                                   source if isinstance(source, str) else "", op_type, about)
                        except LayerdiffError as e:
                            yield name, e, role, slot, "", order, "", op_type, about
                        except Exception as e:  # a damaged dataset: this node only
                            yield name, LayerdiffError(f"unreadable dataset ({type(e).__name__}: {e})",
                                                       file=where), role, slot, "", order, "", op_type, about


def h5_ordered(path: Path) -> bool:
    """Does an HDF5 dump say in what order its calls ran: every call with an
    ``order`` attribute or a numeric seqid, all distinct, or a file that
    keeps its groups in the order they were written (``track_order``)? A
    file that cannot be read says so where it is read (True here)."""
    import h5py

    try:
        with h5py.File(path, "r") as f:
            if f["/"].id.get_create_plist().get_link_creation_order():
                return True
            orders = [_call_order(group[seq], seq) for group in f.values() if isinstance(group, h5py.Group)
                      for seq in group.keys()]
    except Exception:       # not HDF5, damaged: the records say what is wrong
        return True
    return all(o >= 0 for o in orders) and len(set(orders)) == len(orders)


ABOUT_MAX = 1 << 16      # characters of a call's description kept; a longer one is dropped


def _call_about(call) -> tuple[str, str]:
    """The op type a call's group names (``class`` of a module, ``op`` of an
    ATen operator) and its ``attrs``/``args``/``model_output`` (which of its
    outputs are the model's own) as one JSON object's text;
    ('', '') where it says nothing usable. Only JSON is read."""
    import json

    try:
        attrs = call.attrs if hasattr(call, "attrs") else {}
        op = attrs.get("class") or attrs.get("op") or ""
        about = {}
        for key in ("attrs", "args", "model_output"):
            v = attrs.get(key)
            if isinstance(v, str) and len(v) <= ABOUT_MAX:
                about[key] = json.loads(v)
    except Exception:       # a damaged or foreign attribute: the tensors still stand
        return "", ""
    op = op if isinstance(op, str) and len(op) <= 256 else ""
    text = json.dumps(about) if about else ""
    return op, text if len(text) <= ABOUT_MAX else ""


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

