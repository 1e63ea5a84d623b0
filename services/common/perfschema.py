"""The Arrow schema of the performance stream, beside the tensor stream.

A performance capture is its own Arrow Flight DoGet stream (the same
``CaptureRequest`` ticket with ``stream = CAPTURE_STREAM_PERF``) of record
batches of PERF_SCHEMA. Every row is one run of one node: the node as the
device names it, its execution order, which run it was, where it ran (stream
or thread, execution provider), when and for how long (microseconds, when
known), its input and output shapes, and the vendor counters of that run
(the ``op_perf.csv`` columns of the seed tool, integers). Columns a counter
file has beyond those travel in ``extra`` as text, untouched.

Rows with status "error" say in ``message`` why a row of a counter file or
profile could not be used, and ``source`` says where it came from
(``file:line``); the stream goes on with the next row.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING

from layerdiff.common.schema import column

if TYPE_CHECKING:
    import pyarrow as pa

    PERF_SCHEMA: pa.Schema
else:
    from layerdiff.common.lazy import pa

# The per-node counters of the seed's op_perf.csv (5.8.2.3), in its order.
COUNTER_COLUMNS = (
    "mcu_cycle", "vme_cycle", "mme_cycle", "vec_cycle", "syn_cycle", "mte_total_cycle",
    "vme_inst", "mme_inst", "vec_inst", "syn_inst", "mte_pld_inst", "mte_icmov_inst", "mte_mov_inst",
    "pal_vme_mme_cycle", "pal_mte_mme_cycle", "pal_vme_mte_cycle", "pal_total_cycle",
    "mte_icmov_cycle", "mte_l12llb_cycle", "mte_llb2l1_cycle", "mte_pld_cycle",
    "mte_pld_byte", "mte_l12llb_byte", "mte_llb2l1_byte", "mte_icmov_byte",
    "syn_wait_cycle", "vec_slot_wait_cycle", "mme_slot_wait_cycle", "mte_slot_wait_cycle",
    "l1_conflict_cycle", "im_conflict_cycle", "dcache_miss_cnt", "icache_miss_cnt", "instruction_cnt",
    "dma0_llb_conflict_cycle", "dma0_c0_cycle0", "dma0_c0_cycle1", "dma0_c0_byte",
    "dma0_c1_cycle0", "dma0_c1_cycle1", "dma0_c1_byte",
    "dma1_llb_conflict_cycle", "dma1_c0_cycle0", "dma1_c0_cycle1", "dma1_c0_byte",
    "dma1_c1_cycle0", "dma1_c1_cycle1", "dma1_c1_byte",
)
COUNTER_SET = frozenset(COUNTER_COLUMNS)
# Counters are unsigned hardware registers; anything at or beyond 2**63 is a
# wrapped or garbage value, not a count (and would not fit the wire's int64).
COUNTER_MAX = 2**63 - 1


@cache
def perf_schema() -> pa.Schema:
    """PERF_SCHEMA, made on first use (pyarrow is loaded then)."""
    return pa.schema([
        pa.field("name", pa.string()),            # node name as the device knows it
        pa.field("op_type", pa.string()),
        pa.field("order", pa.int32()),            # execution order on the device (-1 unknown)
        pa.field("run", pa.int32()),              # which run of the node (0, 1, ...)
        pa.field("stream", pa.string()),          # stream id or thread: one timeline track each
        pa.field("provider", pa.string()),        # execution provider / engine ("" unknown)
        pa.field("start_us", pa.float64()),       # start, microseconds from the capture's origin (null unknown)
        pa.field("dur_us", pa.float64()),         # duration in microseconds (null unknown)
        pa.field("input_shapes", pa.string()),    # JSON list of [dtype, [dims]] (empty unknown)
        pa.field("output_shapes", pa.string()),
        pa.field("counters", pa.map_(pa.string(), pa.int64())),   # COUNTER_COLUMNS present for this run
        pa.field("extra", pa.map_(pa.string(), pa.string())),     # further columns, passed through
        pa.field("status", pa.string()),          # "ok" or "error"
        pa.field("message", pa.string()),         # why, for "error" rows
        pa.field("source", pa.string()),          # file:line, or "onnxruntime profile"
    ])


def __getattr__(name: str) -> object:
    if name == "PERF_SCHEMA":
        return perf_schema()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


STATUS_OK = "ok"
STATUS_ERROR = "error"
_ROWS_PER_BATCH = 4096


@dataclass
class PerfRecord:
    """One run of one node, or (status "error") a row that could not be used."""

    name: str
    op_type: str = ""
    order: int = -1
    run: int = 0
    stream: str = ""
    provider: str = ""
    start_us: float | None = None
    dur_us: float | None = None
    input_shapes: str = ""
    output_shapes: str = ""
    counters: dict[str, int] = field(default_factory=dict)
    extra: dict[str, str] = field(default_factory=dict)
    status: str = STATUS_OK
    message: str = ""
    source: str = ""

    @classmethod
    def error(cls, name: str, message: str, source: str = "") -> PerfRecord:
        return cls(name=name, status=STATUS_ERROR, message=message, source=source)

    @property
    def ok(self) -> bool:
        return self.status == STATUS_OK


def shapes_json(shapes: list) -> str:
    return json.dumps(shapes, separators=(",", ":")) if shapes else ""


def _batch(recs: list[PerfRecord]) -> pa.RecordBatch:
    # Column by column: several times faster than row dictionaries for the
    # tens of counters every row carries.
    def col(attr, typ):
        return column([getattr(r, attr) for r in recs], typ)

    return pa.RecordBatch.from_arrays([
        col("name", pa.string()), col("op_type", pa.string()), col("order", pa.int32()), col("run", pa.int32()),
        col("stream", pa.string()), col("provider", pa.string()), col("start_us", pa.float64()),
        col("dur_us", pa.float64()), col("input_shapes", pa.string()), col("output_shapes", pa.string()),
        column([r.counters for r in recs], perf_schema().field("counters").type),
        column([r.extra for r in recs], perf_schema().field("extra").type),
        col("status", pa.string()), col("message", pa.string()), col("source", pa.string()),
    ], schema=perf_schema())


class PerfEncoder:
    """Performance records in, batches of up to _ROWS_PER_BATCH rows out;
    ``flush`` sends a partial batch (see layerdiff.common.schema.RecordEncoder)."""

    def __init__(self) -> None:
        self._rows: list[PerfRecord] = []

    @property
    def pending(self) -> bool:
        return bool(self._rows)

    def add(self, record: PerfRecord) -> list[pa.RecordBatch]:
        self._rows.append(record)
        return [self.flush()] if len(self._rows) >= _ROWS_PER_BATCH else []

    def flush(self) -> pa.RecordBatch | None:
        rows, self._rows = self._rows, []
        return _batch(rows) if rows else None


def encode_perf(records: Iterable[PerfRecord]) -> Iterator[pa.RecordBatch]:
    enc = PerfEncoder()
    for r in records:
        yield from enc.add(r)
    msg = enc.flush()
    if msg is not None:
        yield msg


def _maps(arr: pa.MapArray) -> list[dict]:
    offsets = arr.offsets.to_pylist()
    keys, items = arr.keys.to_pylist(), arr.items.to_pylist()
    return [dict(zip(keys[offsets[i]:offsets[i + 1]], items[offsets[i]:offsets[i + 1]]))
            for i in range(len(arr))]


def _time(v) -> float | None:
    if v is None:
        return None
    v = float(v)
    return v if math.isfinite(v) and v >= 0 else None


def decode_perf(batch: pa.RecordBatch) -> list[PerfRecord]:
    """Records of one batch, each checked again on this side: a row whose
    counters or times are out of range becomes an error record naming the
    node and the field, whatever the sender did."""
    if not batch.schema.equals(perf_schema()):
        raise ValueError("batch is not of PERF_SCHEMA")
    out: list[PerfRecord] = []
    cols = {f.name: batch.column(i) for i, f in enumerate(perf_schema())}
    plain = {k: v.to_pylist() for k, v in cols.items() if k not in ("counters", "extra")}
    counters_of, extra_of = _maps(cols["counters"]), _maps(cols["extra"])
    for i in range(batch.num_rows):
        name = plain["name"][i] or ""
        source = plain["source"][i] or ""
        if (plain["status"][i] or STATUS_ERROR) != STATUS_OK:
            out.append(PerfRecord.error(name, plain["message"][i] or "no reason given", source))
            continue
        counters = counters_of[i]
        bad = next((k for k, v in counters.items() if k not in COUNTER_SET or v is None or v < 0), None)
        if bad is not None:
            out.append(PerfRecord.error(name, f"counter {bad!r} is unknown or negative", source))
            continue
        raw_start, raw_dur = plain["start_us"][i], plain["dur_us"][i]
        start, dur = _time(raw_start), _time(raw_dur)
        if (raw_dur is not None and dur is None) or (raw_start is not None and start is None):
            out.append(PerfRecord.error(name, "start_us / dur_us is negative or not finite", source))
            continue
        order, run = plain["order"][i], plain["run"][i]
        out.append(PerfRecord(
            name=name, op_type=plain["op_type"][i] or "", order=order if order is not None else -1,
            run=run or 0, stream=plain["stream"][i] or "", provider=plain["provider"][i] or "",
            start_us=start, dur_us=dur, input_shapes=plain["input_shapes"][i] or "",
            output_shapes=plain["output_shapes"][i] or "", counters=counters,
            extra={k: v for k, v in extra_of[i].items() if v is not None}, source=source))
    return out
