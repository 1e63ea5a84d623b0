"""The one Arrow schema of the tensor stream.

A capture is an Arrow Flight DoGet stream (gRPC) of record batches of
TENSOR_SCHEMA. Every row is one chunk of one node tensor: small tensors share
a batch, a tensor larger than the chunk size spans several rows (ascending
offsets) that the receiver re-joins into one buffer. Rows with status "error"
carry no data and say in ``message`` why that node could not be produced; the
stream goes on with the next node. Tensor bytes are wrapped, never copied, on
the sending side (Flight writes them straight from the mapped file or the
runtime's buffer).

Guaranteed: bit-exact tensors, validated dtype / shape / size before any
allocation, per-row errors. Not guaranteed: that the sender's node order is
an execution order (the ``order`` column says what the sender knows).
"""
from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING

import numpy as np

from layerdiff.common.errors import LayerdiffError, LimitError
from layerdiff.common.sizes import DEFAULT_CHUNK_BYTES

if TYPE_CHECKING:
    import pyarrow as pa

    TENSOR_SCHEMA: pa.Schema
    NODES_SCHEMA: pa.Schema
    ELEMENTS_SCHEMA: pa.Schema
    ALIGNMENT_SCHEMA: pa.Schema
    WEIGHTS_SCHEMA: pa.Schema
    REPORT_TABLES: dict[str, tuple[str, pa.Schema]]
else:
    from layerdiff.common.lazy import pa


def __getattr__(name: str) -> object:
    """The Arrow schemas (TENSOR_SCHEMA and the report's tables), made when
    first asked for: pyarrow is loaded then, not by every command that
    imports this module for a record or a constant (two dumps compared in
    one process need it only for their Parquet tables)."""
    if name == "TENSOR_SCHEMA":
        return _tensor_schema()
    if name in _REPORT_SCHEMAS:
        return _report_schemas()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@cache
def _tensor_schema() -> pa.Schema:
    return pa.schema([
        pa.field("name", pa.string()),          # tensor name as the device knows it
        pa.field("op_type", pa.string()),
        pa.field("order", pa.int32()),          # execution order on the device (-1 unknown)
        pa.field("dtype", pa.string()),         # numpy dtype name, from ALLOWED_DTYPES
        pa.field("shape", pa.list_(pa.int64())),
        pa.field("total_bytes", pa.int64()),
        pa.field("offset", pa.int64()),         # byte offset of this chunk in the tensor
        pa.field("data", pa.binary()),
        pa.field("status", pa.string()),        # "ok", or why not: "error", "check_skip", "concat_skip"
        pa.field("message", pa.string()),       # why, for "error" rows; flags for "ok" rows
        pa.field("node", pa.string()),          # the node that produced (output) or consumed (input) the tensor
        pa.field("role", pa.string()),          # "output" (a node's output) or "input" (what the node read)
        pa.field("slot", pa.int32()),           # output index, or input index for inputs
        pa.field("overflow", pa.string()),      # the device flagged this node as overflowing: why ("" = not flagged)
        # the type the device wrote the tensor in, where the wire carries it widened
        # (bfloat16, float8_e4m3fn... as float32); "" = dtype itself
        pa.field("source_dtype", pa.string()),
        # what the device recorded of the call as a JSON object's text (a module's
        # configuration, an operator's arguments); "" = nothing
        pa.field("attributes", pa.string()),
    ])


STATUS_OK = "ok"
STATUS_ERROR = "error"             # the node's data could not be read
STATUS_CHECK_SKIP = "check_skip"   # a slice of a tiled node failed validation (check_skip.log)
STATUS_CONCAT_SKIP = "concat_skip" # the slices do not splice into one tensor (concate_skip.log)

ROLE_OUTPUT = "output"
ROLE_INPUT = "input"
# Which tensors of each node a capture carries (the runtime's dump_mode).
DUMP_MODES = ("output", "input", "all")


def check_dump_mode(mode: str) -> str:
    mode = (mode or "output").lower()
    if mode not in DUMP_MODES:
        raise LayerdiffError(f"unknown dump_mode {mode!r} (one of {', '.join(DUMP_MODES)})", field="dump_mode")
    return mode

def _source_dtype(v) -> str:
    """A sender's source_dtype, kept only as a short type name: it is looked
    up and printed, never trusted further."""
    v = v or ""
    return v if len(v) <= 32 and v.replace("_", "").isalnum() and v.isascii() else ""


ATTRIBUTES_MAX = 1 << 16


def _about(v) -> str:
    """A sender's attributes: JSON text of at most ATTRIBUTES_MAX characters
    (parsed, never evaluated, where it is used), else nothing."""
    return v if isinstance(v, str) and len(v) <= ATTRIBUTES_MAX else ""


def attribute(attributes: str, key: str):
    """The value under ``key`` of a record's attributes (JSON text, parsed,
    never evaluated); None where the text holds no such key or is not a
    JSON object. The text is parsed only where it names the key."""
    if f'"{key}"' not in attributes:
        return None
    import json

    try:
        doc = json.loads(attributes)
    except ValueError:
        return None
    return doc.get(key) if isinstance(doc, dict) else None


def original_op(attributes: str) -> tuple[str, int] | None:
    """The framework op a device output says it stands for (an Ascend
    dump's ``original_op``: its name and output index), from a record's
    attributes; None where it names none or the text is not that."""
    v = attribute(attributes, "original_op")
    if not isinstance(v, dict) or "name" not in v:
        return None
    name, index = v["name"], v.get("output_index", 0)
    if not isinstance(name, str) or not name.strip() or len(name) > 1024 or not name.isprintable() or \
            not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < 1 << 16:
        return None
    return name, index


# Only plain numeric dtypes ever cross the wire (no object arrays, no pickles).
ALLOWED_DTYPES = frozenset({
    "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
    "float16", "float32", "float64",
})
_DTYPE_NAMES: dict[np.dtype, str] = {}


def dtype_name(dtype: np.dtype) -> str:
    """``dtype.name``, remembered for the types a dump may hold: numpy
    works it out in Python each time it is asked (twice a tensor,
    thousands of tensors a job)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = dtype.name
        if name in ALLOWED_DTYPES:      # a few dozen at most, whatever a file declares
            _DTYPE_NAMES[dtype] = name
    return name


DEFAULT_MAX_TENSOR_BYTES = 8 * 1024**3


def span_bytes(shape, itemsize: int) -> int:
    """The bytes a tensor of this shape spans, counting a zero dimension as
    one: what an allocator must be able to address even for an empty tensor
    (numpy refuses [0, 10**10, 10**10]). Every size check compares both this
    and the true size against its limit."""
    n = itemsize
    for s in shape:
        n *= max(int(s), 1)
    return n
_MAX_ROWS_PER_BATCH = 4096


@dataclass
class NodeRecord:
    """One node output on the device side: a tensor, or the reason it is missing."""

    name: str
    op_type: str = ""
    order: int = -1
    array: np.ndarray | None = None
    status: str = STATUS_OK
    message: str = ""
    node: str = ""
    role: str = ROLE_OUTPUT
    slot: int = 0
    overflow: str = ""
    source_dtype: str = ""      # the device's type where ``array`` holds it widened (see TENSOR_SCHEMA)
    attributes: str = ""        # JSON text: the call's configuration or arguments (see TENSOR_SCHEMA)
    extra: dict = field(default_factory=dict)
    # The receive buffer behind ``array`` on the analyzer side: the record
    # holds one reference; whoever keeps reading the array retains its own.
    lease: BufferLease | None = None

    @classmethod
    def error(cls, name: str, message: str, op_type: str = "", order: int = -1, node: str = "",
              status: str = STATUS_ERROR, role: str = ROLE_OUTPUT, slot: int = 0) -> NodeRecord:
        return cls(name=name, op_type=op_type, order=order, status=status, message=message, node=node, role=role,
                   slot=slot)


# ----------------------------------------------------------------- encoding

# ----------------------------------------------------------- Arrow columns
#
# pa.array probes for pandas, and imports it where it is installed: a third
# of a second and ~50 MB in every process that builds a batch, the
# collector's included. Columns here are made from their buffers instead.

def column(values: list | tuple, typ: pa.DataType) -> pa.Array:
    """An Arrow array of ``typ`` from Python values (None: null): string,
    binary, bool, ints, floats (NaN stays a value), lists of those, and
    maps from dicts."""
    values = values if isinstance(values, list) else list(values)
    n = len(values)
    nulls = values.count(None) if n else 0
    vbuf = pa.py_buffer(np.packbits(np.array([v is not None for v in values], dtype=bool), bitorder="little")) \
        if nulls else None
    if pa.types.is_map(typ):       # dicts (None: an empty one)
        return pa.MapArray.from_arrays(run_offsets([len(v or ()) for v in values]),
                                       column([k for v in values for k in (v or {})], typ.key_type),
                                       column([x for v in values for x in (v or {}).values()], typ.item_type))
    if pa.types.is_string(typ) or pa.types.is_binary(typ):
        if pa.types.is_string(typ) and set(map(type, values)) <= {str, type(None)}:
            texts = values if not nulls else ["" if v is None else v for v in values]
            data = "".join(texts).encode("utf-8")
            lengths = list(map(len, texts))
            if len(data) == sum(lengths):   # ASCII: a character a byte, no encoding per value
                return pa.Array.from_buffers(typ, n, [vbuf, run_offsets(lengths).buffers()[1], pa.py_buffer(data)],
                                             null_count=nulls)
        parts = [b"" if v is None else v if isinstance(v, bytes) else str(v).encode("utf-8") for v in values]
        return pa.Array.from_buffers(typ, n, [vbuf, run_offsets(list(map(len, parts))).buffers()[1],
                                              pa.py_buffer(b"".join(parts))], null_count=nulls)
    if pa.types.is_list(typ):
        child = column([x for v in values if v is not None for x in v], typ.value_type)
        offsets = run_offsets([0 if v is None else len(v) for v in values])
        return pa.Array.from_buffers(typ, n, [vbuf, offsets.buffers()[1]], null_count=nulls, children=[child])
    fill = False if pa.types.is_boolean(typ) else 0
    plain = values if not nulls else [fill if v is None else v for v in values]
    if pa.types.is_boolean(typ):
        data = pa.py_buffer(np.packbits(np.array(plain, dtype=bool), bitorder="little"))
    else:
        data = pa.py_buffer(np.array(plain, dtype=np.dtype(typ.to_pandas_dtype())))
    return pa.Array.from_buffers(typ, n, [vbuf, data], null_count=nulls)


def run_offsets(lengths) -> pa.Array:
    """int32 offsets (n + 1 of them) of runs of these lengths (a list or
    an integer array)."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    if len(lengths):
        np.cumsum(np.array(lengths, dtype=np.int64), out=offsets[1:])
    return pa.Array.from_buffers(pa.int32(), len(offsets), [None, pa.py_buffer(offsets)])


def empty_batch(schema: pa.Schema) -> pa.RecordBatch:
    """A batch of no rows (a stream's heartbeat)."""
    return pa.RecordBatch.from_arrays([column([], f.type) for f in schema], schema=schema)


class _Batcher:
    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.rows: list[tuple] = []
        self.views: list[memoryview] = []
        self.nbytes = 0

    def add(self, rec: NodeRecord, dtype: str, shape: tuple, total: int, offset: int,
            view: memoryview | None) -> None:
        self.rows.append((rec.name, rec.op_type, rec.order, dtype, list(shape), total, offset,
                          rec.status, rec.message, rec.node, rec.role, rec.slot, rec.overflow, rec.source_dtype,
                          rec.attributes if offset == 0 else ""))
        self.views.append(view if view is not None else memoryview(b""))
        if view is not None:
            self.nbytes += len(view)

    def full(self) -> bool:
        return self.nbytes >= self.chunk_bytes or len(self.rows) >= _MAX_ROWS_PER_BATCH

    def flush(self) -> pa.RecordBatch | None:
        if not self.rows:
            return None
        n = len(self.rows)
        lengths = np.fromiter((len(v) for v in self.views), dtype=np.int64, count=n)
        offsets = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        # A single chunk is wrapped without a copy; several small ones are joined.
        data = pa.py_buffer(self.views[0]) if n == 1 else pa.py_buffer(b"".join(self.views))
        data_arr = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets), data])
        cols = list(zip(*self.rows))
        batch = pa.RecordBatch.from_arrays([
            column(cols[0], pa.string()), column(cols[1], pa.string()), column(cols[2], pa.int32()),
            column(cols[3], pa.string()), column(cols[4], pa.list_(pa.int64())),
            column(cols[5], pa.int64()), column(cols[6], pa.int64()), data_arr,
            column(cols[7], pa.string()), column(cols[8], pa.string()), column(cols[9], pa.string()),
            column(cols[10], pa.string()), column(cols[11], pa.int32()), column(cols[12], pa.string()),
            column(cols[13], pa.string()), column(cols[14], pa.string()),
        ], schema=_tensor_schema())
        self.rows, self.views, self.nbytes = [], [], 0
        return batch


class RecordEncoder:
    """Records in, record batches out, each batch carrying at most about
    ``chunk_bytes`` of tensor payload: ``add`` returns the batches a record
    completes, ``flush`` the partial one (a sender calls it when its source
    pauses, so that small tensors do not wait for the batch to fill). The
    batches reference the records' memory: keep the arrays alive until the
    batch is sent."""

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self._b = _Batcher(max(1024, int(chunk_bytes or DEFAULT_CHUNK_BYTES)))

    @property
    def pending(self) -> bool:
        return bool(self._b.rows)

    def add(self, rec: NodeRecord) -> list[pa.RecordBatch]:
        b, out = self._b, []
        if rec.status != STATUS_OK or rec.array is None:
            b.add(rec, "", (), 0, 0, None)
        else:
            arr = rec.array if rec.array.flags.c_contiguous else np.ascontiguousarray(rec.array)
            dtype = arr.dtype.name
            if dtype not in ALLOWED_DTYPES:
                b.add(NodeRecord.error(rec.name, f"dtype {dtype} cannot be sent", rec.op_type, rec.order, rec.node,
                                       role=rec.role, slot=rec.slot), "", (), 0, 0, None)
            else:
                raw = memoryview(arr.reshape(-1).view(np.uint8).data) if arr.size else memoryview(b"")
                total = arr.nbytes
                off = 0
                while True:
                    take = min(max(b.chunk_bytes - b.nbytes, 1), total - off)
                    b.add(rec, dtype, arr.shape, total, off, raw[off:off + take])
                    off += take
                    if b.full():
                        msg = b.flush()
                        if msg is not None:
                            out.append(msg)
                    if off >= total:
                        break
        if b.full():
            msg = b.flush()
            if msg is not None:
                out.append(msg)
        return out

    def flush(self) -> pa.RecordBatch | None:
        return self._b.flush()


def encode_records(records: Iterable[NodeRecord], chunk_bytes: int = DEFAULT_CHUNK_BYTES
                   ) -> Iterator[pa.RecordBatch]:
    """All the records as record batches (see RecordEncoder)."""
    enc = RecordEncoder(chunk_bytes)
    for rec in records:
        yield from enc.add(rec)
    msg = enc.flush()
    if msg is not None:
        yield msg


# ----------------------------------------------------------------- decoding

class BufferPool:
    """Receive buffers handed back once a tensor has been compared. Writing
    into pages already mapped runs about three times faster than into fresh
    allocations, and layers of a network repeat their sizes."""

    def __init__(self, max_bytes: int = 128 * 1024**2) -> None:
        self.max_bytes = max_bytes
        self._free: dict[int, list[np.ndarray]] = {}
        self._free_bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            bucket = self._free.get(nbytes)
            if bucket:
                self._free_bytes -= nbytes
                return bucket.pop()
        return np.empty(nbytes, dtype=np.uint8)

    def trim(self) -> None:
        """Let every free buffer go: a large allocation comes (the
        reference's next segment), which they would only add to."""
        with self._lock:
            self._free.clear()
            self._free_bytes = 0

    def give(self, buf: np.ndarray | None) -> None:
        if buf is None or buf.dtype != np.uint8 or buf.ndim != 1:
            return
        with self._lock:
            if self._free_bytes + buf.nbytes <= self.max_bytes:
                self._free.setdefault(buf.nbytes, []).append(buf)
                self._free_bytes += buf.nbytes


class BufferLease:
    """One receive buffer and the number of its holders. A completed record
    holds it once; a pending comparison, a device value kept for the
    isolated re-run, anything that goes on reading the array after the
    record is handled, retains it and releases it when done. The buffer goes
    back to its pool only when the last holder has released it, so a
    buffer is never refilled with another tensor while something still
    reads it, whatever order the tensors arrive and finish in."""

    __slots__ = ("_buffer", "_pool", "_holders", "_lock")

    def __init__(self, buffer: np.ndarray, pool: BufferPool | None = None) -> None:
        self._buffer: np.ndarray | None = buffer
        self._pool = pool
        self._holders = 1
        self._lock = threading.Lock()

    @property
    def holders(self) -> int:
        return self._holders

    def retain(self) -> BufferLease:
        with self._lock:
            if self._holders <= 0:
                raise RuntimeError("a receive buffer was retained after its last release")
            self._holders += 1
        return self

    def release(self) -> None:
        with self._lock:
            if self._holders <= 0:
                raise RuntimeError("a receive buffer was released more often than it was held")
            self._holders -= 1
            if self._holders:
                return
            buf, self._buffer = self._buffer, None
        if self._pool is not None and buf is not None:
            self._pool.give(buf)


class TensorAssembler:
    """Re-joins chunked rows into whole tensors, validating every field
    before allocating. Each completed record holds its receive buffer
    through ``record.lease``: release it when done with the array (retain
    it first to go on reading the array after that)."""

    def __init__(self, max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES, pool: BufferPool | None = None) -> None:
        self.max_tensor_bytes = max_tensor_bytes
        self.pool = pool
        self._cur: tuple | None = None   # (record, buffer, filled)

    def feed(self, batch: pa.RecordBatch) -> list[NodeRecord]:
        out: list[NodeRecord] = []
        n = batch.num_rows
        # every column but the data (7) as Python values, in schema order
        (names, ops, orders, dtypes, shapes, totals, offs, statuses, messages, nodes, roles, slots,
         overflows, sources, abouts) = (batch.column(k).to_pylist()
                                        for k in (0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15))
        data = batch.column(7)
        bufs = data.buffers()
        doffs = np.frombuffer(bufs[1], dtype=np.int32)[data.offset:data.offset + n + 1] if bufs[1] is not None \
            else np.zeros(n + 1, np.int32)
        dbytes = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None and bufs[2].size else \
            np.zeros(0, np.uint8)
        for i in range(n):
            name = names[i] or ""
            role = roles[i] if roles[i] in (ROLE_OUTPUT, ROLE_INPUT) else ROLE_OUTPUT
            slot = slots[i] if slots[i] is not None and slots[i] >= 0 else 0
            if statuses[i] != STATUS_OK:
                self._abandon(out)
                rec = NodeRecord.error(name, messages[i] or "no reason given", ops[i] or "",
                                       orders[i] if orders[i] is not None else -1, nodes[i] or "",
                                       status=statuses[i] or STATUS_ERROR, role=role, slot=slot)
                rec.overflow = overflows[i] or ""
                out.append(rec)
                continue
            piece = dbytes[doffs[i]:doffs[i + 1]]
            try:
                rec = self._row(out, name, ops[i], orders[i], dtypes[i], shapes[i], totals[i], offs[i],
                                messages[i], nodes[i], piece, (role, slot, overflows[i] or "",
                                                               _source_dtype(sources[i]), _about(abouts[i])))
            except LayerdiffError as e:
                self._cur = None
                out.append(NodeRecord.error(name, str(e), ops[i] or "", orders[i] if orders[i] is not None else -1,
                                            role=role, slot=slot))
                continue
            if rec is not None:
                out.append(rec)
        return out

    def _abandon(self, out: list[NodeRecord]) -> None:
        if self._cur is not None:
            rec, buf, filled = self._cur
            out.append(NodeRecord.error(rec.name, f"stream moved on after {filled} of {buf.size} bytes",
                                        rec.op_type, rec.order, rec.node, role=rec.role, slot=rec.slot))
            self._cur = None

    def _row(self, out, name, op_type, order, dtype, shape, total, offset, message, node, piece, where):
        if offset == 0:
            self._abandon(out)
            if dtype not in ALLOWED_DTYPES:
                raise LayerdiffError(f"dtype {dtype!r} is not allowed", node=name, field="dtype")
            shape = tuple(int(s) for s in (shape or ()))
            if any(s < 0 for s in shape):
                raise LayerdiffError(f"negative dimension in shape {shape}", node=name, field="shape")
            itemsize = np.dtype(dtype).itemsize
            expected = itemsize
            for s in shape:
                expected *= s
                if expected > self.max_tensor_bytes:
                    break
            if expected > self.max_tensor_bytes or span_bytes(shape, itemsize) > self.max_tensor_bytes:
                raise LimitError(f"shape {shape} of {dtype} exceeds the tensor limit of {self.max_tensor_bytes} bytes",
                                 node=name, field="shape")
            if expected != total:
                raise LayerdiffError(f"shape {shape} of {dtype} is {expected} bytes, total_bytes says {total}",
                                     node=name, field="total_bytes")
            rec = NodeRecord(name=name, op_type=op_type or "", order=order if order is not None else -1,
                             message=message or "", node=node or "", role=where[0], slot=where[1],
                             overflow=where[2], source_dtype=where[3], attributes=where[4])
            buf = self.pool.take(total) if self.pool is not None else np.empty(total, dtype=np.uint8)
            rec.extra = {"dtype": dtype, "shape": shape}
            self._cur = (rec, buf, 0)
        else:
            if self._cur is None or (self._cur[0].name, self._cur[0].role, self._cur[0].slot) != \
                    (name, where[0], where[1]) or self._cur[2] != offset:
                raise LayerdiffError(f"chunk at offset {offset} does not continue the tensor", node=name,
                                     field="offset")
        rec, buf, filled = self._cur
        if filled + piece.size > buf.size:
            self._cur = None
            raise LayerdiffError(f"chunks exceed total_bytes {buf.size}", node=name, field="data")
        buf[filled:filled + piece.size] = piece
        filled += piece.size
        if filled == buf.size:
            self._cur = None
            rec.array = buf.view(np.dtype(rec.extra["dtype"])).reshape(rec.extra["shape"])
            rec.lease = BufferLease(buf, self.pool)
            return rec
        self._cur = (rec, buf, filled)
        return None

    def finish(self) -> list[NodeRecord]:
        """Call at the end of the stream: an incomplete tensor becomes an error."""
        out: list[NodeRecord] = []
        self._abandon(out)
        return out


# --------------------------------------------------------------- report tables
#
# The tables a report holds beside its CSV and JSON files, as Parquet (one
# file each, REPORT_TABLES), for pandas, polars or DuckDB. Same content as
# the files they accompany (cpu_vs_npu.csv and summary.json's nodes, the
# per-node detail CSVs, alignment.csv, weights.csv), typed: NaN is a metric
# that is undefined (cosine of two zero tensors), null a figure that was not
# made (no re-run, no verdict). Each file's schema metadata names its table
# and REPORT_SCHEMA_VERSION; a version adds columns, never renames or retypes
# one, so a reader fills what an older report lacks with nulls
# (layerdiff.client.results).

REPORT_SCHEMA_VERSION = 1
TABLE_KEY, VERSION_KEY = b"layerdiff.table", b"layerdiff.schema_version"


def _col(name: str, typ: pa.DataType, doc: str) -> pa.Field:
    return pa.field(name, typ, metadata={b"doc": doc.encode()})


def _table_schema(table: str, fields: list[pa.Field]) -> pa.Schema:
    return pa.schema(fields, metadata={TABLE_KEY: table.encode(), VERSION_KEY: str(REPORT_SCHEMA_VERSION).encode()})


@cache
def _report_schemas() -> dict[str, object]:
    f64, i64, i32, string, boolean = pa.float64(), pa.int64(), pa.int32(), pa.string(), pa.bool_()
    metric_docs = {
        "max_abs_err": "seed max_abs_err: max |d - r| over the pairs past the tolerance",
        "mean_abs_err": "seed mean_abs_err", "max_rel_err": "seed max_abs_total: max |d - r| / |r|",
        "mean_rel_err": "seed mean_abs_total: mean |d - r| / |r|", "ref_mean": "seed mean of the reference",
        "ref_std": "seed std of the reference", "ref_rms": "seed rms of the reference",
        "max_abs_diff": "max |d - r|", "mean_abs_diff": "mean |d - r|",
        "cosine": "cosine similarity (NaN: a zero side)",
        "mse": "mean squared error", "rmse": "root mean squared error", "pearson": "Pearson correlation",
        "sqnr_db": "signal to quantization noise ratio, dB", "rel_euclidean": "||d - r|| / ||r||",
        "kl_div": "KL divergence of |r| and |d| as distributions",
        "rel_err_lt_0_001": "share of pairs whose relative error is under 1/1000",
        "rel_err_lt_0_005": "share of pairs whose relative error is under 5/1000",
    }

    nodes = _table_schema("nodes", [
        _col("index", i32, "row of cpu_vs_npu.csv (a node's inputs before its outputs, in execution order)"),
        _col("node", string, "reference node"),
        _col("tensor", string, "reference tensor compared"),
        _col("role", string, "output (what the node wrote) or input (what it read)"),
        _col("input_index", i32, "which input, for role input; null for outputs"),
        _col("op_type", string, "the node's operator"),
        _col("order", i32, "the node's execution order in the reference"),
        _col("device_name", string, "the device tensor paired with it"),
        _col("alignment_method", string, "how the pair was made (alignment.csv's method)"),
        _col("alignment_confidence", f64, "how sure that pairing is, 0 to 1 (null where not scored)"),
        _col("device_dtype", string, "the type the device computed the tensor in"),
        _col("constant", boolean, "a weight or constant, not a computation"),
        _col("passed", boolean, "within the seed's atol/rtol everywhere (result pass)"),
        _col("atol", f64, "the seed's absolute tolerance applied"),
        _col("rtol", f64, "the seed's relative tolerance applied"),
        _col("errors", i64, "elements past the tolerance"),
        _col("total", i64, "elements compared"),
        _col("first_diff_offset", i64, "flat index of the first element past the tolerance (-1: none)"),
        _col("first_diff_index", pa.list_(i64), "its index along each axis"),
        _col("shape", pa.list_(i64), "the tensor's shape"),
        _col("ref_value", f64, "the reference at the first element past the tolerance"),
        _col("npu_value", f64, "the device there"),
        *[_col(k, f64, doc) for k, doc in metric_docs.items()],
        _col("ref_nan", i64, "NaN in the reference"), _col("ref_inf", i64, "Inf in the reference"),
        _col("npu_nan", i64, "NaN on the device"), _col("npu_inf", i64, "Inf on the device"),
        _col("fp16_overflow", i64, "reference values beyond FP16's range"),
        _col("npu_fp16_overflow", i64, "device values beyond FP16's range"),
        _col("finite_pairs", i64, "pairs finite on both sides"), _col("both_nan", i64, "pairs NaN on both sides"),
        _col("nonfinite_errors", i64, "pairs where one side alone is not finite"),
        _col("note", string, "how the tensors were brought together (layout, shape)"),
        _col("overflow", string, "why the device flagged the node as overflowing (null: not flagged)"),
        _col("verdict", string, "the diagnosis of a failing node (null: none made)"),
        _col("cause", string, "why: kernel, weight, range, layout, quantization... (null: none)"),
        _col("evidence", pa.list_(string), "the sentences the verdict rests on"),
        _col("impact_harmful", boolean, "its own error changes the model's outputs (null: not measured)"),
        _col("impact_worst_output", string, "the output it changes most"),
        _col("impact_cosine", f64, "that output's cosine with only this node's device value put in"),
        _col("precision", string, "what the node is taken to compute in (fp32, fp16, bf16, int8...)"),
        _col("precision_from", string, "where that was read from"),
        _col("reduction_length", i64, "K, the length of the node's reductions (null: unknown)"),
        _col("explained_rel_err", f64, "relative RMS error the node's own arithmetic explains"),
        _col("allowed_rel_err", f64, "relative RMS error it may add before it is a computation error"),
        _col("rel_err", f64, "its relative RMS error ||d - r|| / ||r|| (mask-like values left out)"),
        _col("own_rel_err", f64, "the error it adds itself, against its re-run on its device inputs"),
        _col("read_rel_err", f64, "the largest relative RMS error of what it read"),
        _col("worst_block", string, "the part of the tensor with the largest relative error"),
        _col("worst_block_rel_err", f64, "that part's relative RMS error"),
        _col("masked", i64, "mask-like reference values left out of the error model's figures"),
        _col("isolated_errors", i64, "elements past the tolerance against its re-run alone (null: no re-run)"),
        _col("isolated_cosine", f64, "cosine against its re-run alone"),
        _col("isolated_mean_rel_err", f64, "mean relative error against its re-run alone"),
        _col("isolated_max_abs_diff", f64, "max |d - r| against its re-run alone"),
    ])

    elements = _table_schema("elements", [
        _col("node", string, "reference node"),
        _col("tensor", string, "reference tensor"),
        _col("role", string, "output or input"),
        _col("input_index", i32, "which input, for role input; null for outputs"),
        _col("detail_file", string, "the per-node CSV holding the same rows"),
        _col("rank", i32, "0 for the worst element"),
        _col("flat_index", i64, "the element's index in the flattened tensor (the detail CSV's index)"),
        _col("index", pa.list_(i64), "its index along each axis"),
        _col("std_value", f64, "the reference's value"),
        _col("npu_value", f64, "the device's value"),
        _col("abs_diff", f64, "|d - r|"),
        _col("relative_diff", f64, "|d - r| / |r|"),
    ])

    alignment = _table_schema("alignment", [
        _col("reference_tensor", string, "reference tensor (null: a device tensor left unmatched)"),
        _col("device_tensor", string, "device tensor (null: none for this reference tensor)"),
        _col("method", string, "map, graph, fused, name, value, fused into, folded, not dumped, attributed, unmatched"),
        _col("confidence", f64, "how sure the pairing is, 0 to 1 (null where not scored)"),
        _col("note", string, "why"),
    ])

    weights = _table_schema("weights", [
        _col("reference_node", string, "reference node"), _col("reference_weight", string, "its weight"),
        _col("device_node", string, "device node"), _col("device_weight", string, "the device's copy of it"),
        _col("relation", string, "how the two relate (equal, transposed, folded...)"),
        _col("elements", i64, "elements compared"), _col("differing", i64, "elements that differ"),
        _col("max_abs_diff", f64, "max |d - r| (NaN: not compared)"), _col("note", string, "why"),
    ])
    # table name -> (file in the report, schema)
    report_tables = {"nodes": ("nodes.parquet", nodes), "elements": ("elements.parquet", elements),
                     "alignment": ("alignment.parquet", alignment), "weights": ("weights.parquet", weights)}
    return {"NODES_SCHEMA": nodes, "ELEMENTS_SCHEMA": elements, "ALIGNMENT_SCHEMA": alignment,
            "WEIGHTS_SCHEMA": weights, "REPORT_TABLES": report_tables}


_REPORT_SCHEMAS = frozenset({"NODES_SCHEMA", "ELEMENTS_SCHEMA", "ALIGNMENT_SCHEMA", "WEIGHTS_SCHEMA", "REPORT_TABLES"})
