"""Ascend runtime dumps, read in their own format where they lie.

The runtime writes one file per executed operator,
``{op_type}.{op_name}.{task_id}.{stream_id}.{timestamp}`` (older runtimes:
without ``stream_id``), under ``{dump_path}/{time}/{device_id}/{model_id}/{data_index}``;
``.``, ``/``, ``\\`` and spaces in op names become ``_``. Each file is an
8-byte little-endian header length, a ``DumpData`` protobuf header
(``proto/layerdiff/vendor/ascend_dump.proto``) and the tensor bytes: inputs,
then outputs, then buffers. Overflow records (``Opdebug.Node_OpDebug.*``)
have the same shape with the overflow payload as their one output
(``layerdiff.collector.dumps.overflow``).

A node's output k is the record ``op_name`` (k = 0) or ``op_name:k``; its
input k is a record with role ``input`` and slot k. Tiled device layouts
(NC1HWC0, FRACTAL_NZ) are restored to the original shape; every size is
checked against the header and the file before anything is mapped.
"""
from __future__ import annotations

import json
import os
import re
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from layerdiff.collector.dumps import narrow
from layerdiff.common.errors import LayerdiffError
from layerdiff.common.schema import DEFAULT_MAX_TENSOR_BYTES, ROLE_INPUT, ROLE_OUTPUT, NodeRecord, span_bytes

MAX_HEADER_BYTES = 64 * 1024 * 1024
_NAME = re.compile(r"^(?P<op_type>[^.]+)\.(?P<op_name>[^.]+)\.(?P<task_id>\d+)(?:\.(?P<stream_id>\d+))?"
                   r"\.(?P<timestamp>\d+)$")
_SANITIZE = re.compile(r"[./\\ \x00-\x1f]")

# OutputDataType -> numpy dtype name (bfloat16 is widened to float32 on read)
DTYPES = {1: "float32", 2: "float16", 3: "int8", 4: "uint8", 5: "int16", 6: "uint16", 7: "int32", 8: "int64",
          9: "uint32", 10: "uint64", 11: "bool", 12: "float64"}
_TO_CODE = {v: k for k, v in DTYPES.items()}
DT_BF16 = 27
# OutputFormat values
FORMAT_NCHW, FORMAT_NHWC, FORMAT_ND, FORMAT_NC1HWC0, FORMAT_FRACTAL_NZ = 0, 1, 2, 3, 29
_PLAIN_FORMATS = {0: "NCHW", 1: "NHWC", 2: "ND", 14: "CHWN", 16: "HWCN", 26: "MD", 27: "NDHWC"}


def _pb():
    from layerdiff.vendor import ascend_dump_pb2

    return ascend_dump_pb2


@dataclass(frozen=True)
class DumpName:
    op_type: str
    op_name: str
    task_id: int
    stream_id: int
    timestamp: int

    @property
    def is_op_debug(self) -> bool:
        return self.op_type.lower() == "opdebug"


def parse_name(filename: str) -> DumpName | None:
    m = _NAME.match(filename)
    if not m:
        return None
    return DumpName(m["op_type"], m["op_name"], int(m["task_id"]), int(m["stream_id"] or 0), int(m["timestamp"]))


def sanitize(name: str) -> str:
    """Op names as the runtime writes them into file names."""
    return _SANITIZE.sub("_", name)


def looks_like_dump(path: Path) -> bool:
    """A vendor-named file whose first 8 bytes are a plausible header length."""
    if parse_name(path.name) is None:
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(8)
        size = path.stat().st_size
    except OSError:
        return False
    return len(head) == 8 and 0 < struct.unpack("<Q", head)[0] <= min(size - 8, MAX_HEADER_BYTES)


def read_header(path: Path, shown: str | None = None):
    """(DumpData header, byte offset of the tensor data, file size)."""
    shown = shown or path.name
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise LayerdiffError(f"truncated: {size} bytes, no header length", file=shown)
            hlen = struct.unpack("<Q", head)[0]
            if hlen > MAX_HEADER_BYTES or hlen > size - 8:
                raise LayerdiffError(f"header length {hlen} does not fit the file ({size} bytes)", file=shown,
                                     field="header_length")
            raw = f.read(hlen)
    except OSError as e:
        raise LayerdiffError(f"cannot be read: {e.strerror}", file=shown) from e
    try:
        header = _pb().DumpData.FromString(raw)
    except Exception as e:  # protobuf raises DecodeError and friends
        raise LayerdiffError(f"header is not an Ascend DumpData protobuf ({type(e).__name__})", file=shown) from e
    return header, 8 + hlen, size


def source_dtype(data_type: int) -> str:
    """The type the runtime dumped a tensor in, where it is read widened to
    float32 (bfloat16, the FP8/FP6/FP4/HiFloat formats, the sub-byte
    integers; '' for the types NumPy holds as they are)."""
    return "bfloat16" if data_type == DT_BF16 else narrow.DECODED.get(data_type, "")


def _tensor(path: Path, t, offset: int, shown: str, max_bytes: int) -> np.ndarray:
    """One tensor of the file, validated, in its original layout."""
    dtype: np.dtype
    narrow_name = narrow.DECODED.get(t.data_type, "")
    if t.data_type == DT_BF16:
        dtype, itemsize = np.dtype("uint16"), 2
    elif narrow_name:
        dtype, itemsize = np.dtype("uint8"), 1
    elif t.data_type in narrow.NOT_DECODED:
        raise LayerdiffError(f"data type {narrow.NOT_DECODED[t.data_type]} ({t.data_type}) is not decoded: it is "
                             "not a real tensor; dump this tensor as float16 or float32", file=shown,
                             field="data_type")
    elif t.data_type in DTYPES:
        dtype = np.dtype(DTYPES[t.data_type])
        itemsize = dtype.itemsize
    else:
        raise LayerdiffError(f"data type {t.data_type} is not a plain numeric type", file=shown, field="data_type")
    dims = list(t.shape.dim)
    count = int(np.prod(dims, dtype=object)) if dims else 1
    if span_bytes(dims, itemsize) > max_bytes:
        raise LayerdiffError(f"shape {dims} is over the tensor limit of {max_bytes} bytes", file=shown, field="shape")
    # sub-byte codes come packed or one to a byte: the size the header gives says which
    packed = narrow.layout(narrow_name, count, int(t.size)) if narrow_name else \
        (False if count * itemsize == t.size else None)
    if packed is None:
        what = f"{narrow.packed_size(narrow_name, count)} bytes packed or {count} one per byte" \
            if narrow_name in narrow.WIDTH else f"{count * itemsize} bytes"
        raise LayerdiffError(f"shape {dims} of {source_dtype(t.data_type) or dtype} is {what}, the header says "
                             f"{t.size}", file=shown, field="size")
    if t.size > max_bytes:
        raise LayerdiffError(f"{t.size} bytes is over the tensor limit of {max_bytes}", file=shown, field="size")
    n = int(t.size) // itemsize
    raw = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(n,)) if n else np.zeros(0, dtype)
    if t.data_type == DT_BF16:   # the upper half of a float32
        raw = (raw.astype(np.uint32) << 16).view(np.float32)
    elif narrow_name:
        raw = narrow.widen(narrow_name, raw, count, packed)
    original = [int(d) for d in t.original_shape.dim] if t.HasField("original_shape") else []
    return _restore_layout(np.asarray(raw), t.format, dims, original, shown)


def _restore_layout(flat: np.ndarray, fmt: int, dims: list[int], original: list[int], shown: str) -> np.ndarray:
    if fmt in _PLAIN_FORMATS:
        return flat.reshape(dims)
    if fmt == FORMAT_NC1HWC0:
        if len(dims) != 5:
            raise LayerdiffError(f"NC1HWC0 tensor with shape {dims}", file=shown, field="shape")
        n, c1, h, w, c0 = dims
        c = original[1] if len(original) == 4 else c1 * c0
        if len(original) == 4 and (original[0], original[2], original[3]) != (n, h, w) or c > c1 * c0:
            raise LayerdiffError(f"original shape {original} does not fit NC1HWC0 {dims}", file=shown,
                                 field="original_shape")
        return np.ascontiguousarray(flat.reshape(dims).transpose(0, 1, 4, 2, 3).reshape(n, c1 * c0, h, w)[:, :c])
    if fmt == FORMAT_FRACTAL_NZ:
        if len(dims) < 4:
            raise LayerdiffError(f"FRACTAL_NZ tensor with shape {dims}", file=shown, field="shape")
        *batch, w1, h1, h0, w0 = dims
        hh, ww = (original[-2], original[-1]) if len(original) >= 2 else (h1 * h0, w1 * w0)
        if hh > h1 * h0 or ww > w1 * w0 or (original and list(original[:-2]) != batch):
            raise LayerdiffError(f"original shape {original} does not fit FRACTAL_NZ {dims}", file=shown,
                                 field="original_shape")
        nb = len(batch)
        perm = list(range(nb)) + [nb + 1, nb + 2, nb, nb + 3]
        full = flat.reshape(dims).transpose(perm).reshape(*batch, h1 * h0, w1 * w0)
        return np.ascontiguousarray(full[..., :hh, :ww])
    from layerdiff.vendor import ascend_dump_pb2

    try:
        label = ascend_dump_pb2.OutputFormat.Name(ascend_dump_pb2.OutputFormat.ValueType(fmt))
    except ValueError:
        label = str(fmt)
    raise LayerdiffError(f"device layout {label} is not restored to the original shape; dump this node in ND/NCHW",
                         file=shown, field="format")


def read_dump_file(path: Path, max_bytes: int = DEFAULT_MAX_TENSOR_BYTES, shown: str | None = None):
    """(header, [(role, slot, array or LayerdiffError)]) of one dump file:
    the header and the data sizes are checked as a whole first, then each
    tensor on its own."""
    shown = shown or path.name
    header, offset, size = read_header(path, shown)
    parts = [(ROLE_INPUT, i, t) for i, t in enumerate(header.input)] + \
            [(ROLE_OUTPUT, i, t) for i, t in enumerate(header.output)]
    declared = sum(int(t.size) for _, _, t in parts) + sum(int(b.size) for b in header.buffer)
    if offset + declared > size:
        raise LayerdiffError(f"header declares {declared} bytes of data, the file holds {size - offset}",
                             file=shown, field="size")
    out: list[tuple[str, int, np.ndarray | LayerdiffError]] = []
    for role, slot, t in parts:
        try:
            out.append((role, slot, _tensor(path, t, offset, f"{shown}:{role}.{slot}", max_bytes)))
        except LayerdiffError as e:
            out.append((role, slot, e))
        offset += int(t.size)
    return header, out


def _regular(e: os.DirEntry[str]) -> bool:
    """A file, not a link to one."""
    try:
        return e.is_file(follow_symlinks=False)
    except OSError:
        return False


def _directory(e: os.DirEntry[str]) -> bool:
    """A directory, not a link to one."""
    try:
        return e.is_dir(follow_symlinks=False)
    except OSError:
        return False


def dump_files(root: Path, max_depth: int = 6) -> list[Path]:
    """Every vendor dump file under root ({time}/{device_id}/{model_id}/{data_index}
    or any part of it), leaf directories in sorted order, files in execution
    order (timestamp, then task id)."""
    found: list[Path] = []

    def execution_order(p: Path) -> tuple[int, int, str]:
        n = parse_name(p.name)
        assert n is not None    # only files whose names parse are listed
        return n.timestamp, n.task_id, p.name

    def walk(d: Path, depth: int) -> None:
        # the directory's own listing says what each entry is (no look at
        # each file: a user's dump of a thousand .npy files is listed here
        # too, before it is known not to be the runtime's)
        try:
            with os.scandir(d) as it:
                children = sorted(it, key=lambda e: e.name)
        except OSError:
            return
        files = [d / c.name for c in children if parse_name(c.name) and _regular(c)]
        files.sort(key=execution_order)
        found.extend(files)
        if depth < max_depth:
            for c in children:
                if _directory(c):
                    walk(d / c.name, depth + 1)

    walk(root, 0)
    return found


def overflow_flags(files: list[Path], root: Path) -> tuple[dict[tuple[int, int], str], list[tuple[str, str]]]:
    """{(stream_id, task_id): why} from every overflow record among the files,
    and (file, reason) for records that could not be decoded."""
    from layerdiff.collector.dumps import overflow

    flags: dict[tuple[int, int], str] = {}
    bad: list[tuple[str, str]] = []
    for p in files:
        name = parse_name(p.name)
        if name is None or not name.is_op_debug:
            continue
        shown = str(p.relative_to(root))
        try:
            _, tensors = read_dump_file(p, shown=shown)
            for _, _, arr in tensors:
                if isinstance(arr, LayerdiffError):
                    raise arr
                for flag in overflow.flagged_tasks(overflow.decode(np.asarray(arr).tobytes(), shown)):
                    flags[(flag["stream_id"], flag["task_id"])] = overflow.describe(flag)
        except LayerdiffError as e:
            bad.append((shown, str(e)))
    return flags, bad


def records(root: Path, files: list[Path], max_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
            check_name=lambda n: n) -> Iterator[NodeRecord]:
    """Input and output records of every operator file, in execution order,
    overflowing operators marked."""
    flags, bad = overflow_flags(files, root)
    for shown, reason in bad:
        yield NodeRecord.error(shown, f"overflow record unreadable: {reason}")
    seen: dict[str, int] = {}
    order = 0
    for p in files:
        name = parse_name(p.name)
        if name is None or name.is_op_debug:
            continue
        shown = str(p.relative_to(root))
        try:
            header, tensors = read_dump_file(p, max_bytes, shown)
            try:
                node = check_name(header.op_name or name.op_name)
            except LayerdiffError as e:
                raise LayerdiffError(str(e), file=shown, field="op_name") from None
            if not tensors:   # a header without inputs or outputs: say so rather than pass over the file
                raise LayerdiffError("holds no input or output tensor", file=shown, field="output")
        except LayerdiffError as e:
            yield NodeRecord.error(name.op_name, str(e), name.op_type, order)
            order += 1
            continue
        # A node dumped again (another data_index, iteration or device) is
        # kept apart so it never overwrites the first.
        runs = seen.get(node, 0)
        seen[node] = runs + 1
        if runs:
            node = f"{node}@{runs}"
        why = flags.get((name.stream_id, name.task_id), "")
        for role, slot, arr in tensors:
            rec_name = node if role == ROLE_INPUT or slot == 0 else f"{node}:{slot}"
            if isinstance(arr, LayerdiffError):
                rec = NodeRecord.error(rec_name, str(arr), name.op_type, order, node, role=role, slot=slot)
            else:
                rec = NodeRecord(name=rec_name, op_type=name.op_type, order=order, array=arr, node=node, role=role,
                                 slot=slot)
                # what the device computed it in, where it is read widened (the error model's precision)
                side = header.input if role == ROLE_INPUT else header.output
                rec.source_dtype = source_dtype(side[slot].data_type) if slot < len(side) else ""
                if role != ROLE_INPUT and slot < len(side) and side[slot].original_op.name:
                    # the runtime's own word on which framework op this output stands for
                    orig = side[slot].original_op
                    rec.attributes = json.dumps({"original_op": {"name": orig.name,
                                                                 "output_index": int(orig.output_index)}})
            rec.overflow = why
            yield rec
        order += 1


# ------------------------------------------------------------------ writing

def _tensor_header(msg, arr: np.ndarray | narrow.Codes, packed: bool = True) -> bytes:
    """Fill ``msg`` (an OpOutput/OpInput) for ``arr`` and return its bytes:
    a NumPy array, bfloat16 and ml_dtypes' narrow types included (written
    with the vendor's code, the sub-byte ones ``packed`` as the runtime
    packs them, else one code per byte), or ``narrow.Codes`` for the
    formats no NumPy type holds."""
    if isinstance(arr, narrow.Codes):
        name, codes = arr.name, np.asarray(arr.codes)
        if name not in narrow.CODE or codes.dtype != np.uint8:
            raise LayerdiffError(f"codes of {name} ({codes.dtype}) have no Ascend data type: one of "
                                 f"{', '.join(narrow.CODE)}, as uint8", field="dtype")
        code, shape, data = narrow.CODE[name], codes.shape, _codes_bytes(name, codes, packed)
    else:
        arr = np.require(arr, requirements="C")  # keeps 0-d tensors 0-d
        name, shape = narrow.ML_DTYPES.get(arr.dtype.name, ""), arr.shape
        if name:
            code, data = narrow.CODE[name], _codes_bytes(name, arr.view(np.uint8), packed)
        else:
            found = DT_BF16 if arr.dtype.name == "bfloat16" else _TO_CODE.get(arr.dtype.name)
            if found is None:
                raise LayerdiffError(f"dtype {arr.dtype} has no Ascend data type", field="dtype")
            code, data = found, arr.tobytes()
    msg.data_type = code
    msg.format = FORMAT_ND if len(shape) != 4 else FORMAT_NCHW
    msg.shape.dim.extend(int(d) for d in shape)
    msg.original_shape.dim.extend(int(d) for d in shape)
    msg.size = len(data)
    return data


def _codes_bytes(name: str, codes: np.ndarray, packed: bool) -> bytes:
    """One-per-byte codes of ``name`` as a dump holds them: sub-byte ones
    ``packed`` as the runtime packs them, else a byte each."""
    return narrow.pack(name, codes) if packed and name in narrow.WIDTH else np.ascontiguousarray(codes).tobytes()


def write_dump_file(path: Path, op_name: str, inputs: list, outputs: list, dump_time: int | None = None,
                    packed: bool = True, original_ops: list[tuple[str, int] | None] | None = None) -> Path:
    """A runtime dump file of ``inputs`` and ``outputs`` (NumPy arrays or
    ``narrow.Codes``; ``packed``: sub-byte codes as the runtime packs them,
    else one to a byte); ``original_ops``: per output, the framework op
    (name, output index) it stands for, as the runtime records it."""
    pb = _pb()
    header = pb.DumpData(version="2.0", dump_time=dump_time or int(time.time() * 1e6), op_name=op_name)
    blobs = [_tensor_header(header.input.add(), a, packed) for a in inputs]
    for k, a in enumerate(outputs):
        msg = header.output.add()
        blobs.append(_tensor_header(msg, a, packed))
        orig = original_ops[k] if original_ops and k < len(original_ops) else None
        if orig is not None:
            msg.original_op.name, msg.original_op.output_index = orig
    raw = header.SerializeToString()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for b in blobs:
            f.write(b)
    return path


def write_op_debug_file(path: Path, payload: bytes, dump_time: int | None = None) -> Path:
    """An overflow record file: the payload as the one uint8 output."""
    return write_dump_file(path, "Node_OpDebug", [], [np.frombuffer(payload, dtype=np.uint8)], dump_time)


def leaf_dir(dump_path: str | Path, when: float | None = None, device_id: int = 0, model_id: int = 1,
             data_index: int = 0) -> Path:
    """{dump_path}/{time}/{device_id}/{model_id}/{data_index}, as the runtime lays it out."""
    stamp = time.strftime("%Y%m%d%H%M%S", time.localtime(when if when is not None else time.time()))
    return Path(dump_path) / stamp / str(device_id) / str(model_id) / str(data_index)


def file_name(op_type: str, op_name: str, task_id: int, stream_id: int, timestamp: int) -> str:
    """The runtime's file name; an op name too long for a file name is cut
    and made unique with a digest (the header keeps the full name)."""
    import hashlib

    name = sanitize(op_name) or "op"
    if len(name.encode()) > 160:
        name = name.encode()[:120].decode(errors="ignore") + "_" + hashlib.sha256(op_name.encode()).hexdigest()[:16]
    return f"{sanitize(op_type)[:40] or 'Op'}.{name}.{task_id}.{stream_id}.{timestamp}"
