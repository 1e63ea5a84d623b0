"""The report's tables as Parquet (common.schema.REPORT_TABLES): the same
rows as cpu_vs_npu.csv and summary.json's nodes (nodes.parquet), the detail
CSVs (elements.parquet), alignment.csv and weights.csv, typed. Built from
the parts report.table_parts takes of the same rows the CSV and JSON files
are written from: by the report's process (report.writer), or by the job's
where it has none."""
from __future__ import annotations

from itertools import repeat
from pathlib import Path

import numpy as np
import pyarrow as pa

# Parquet's writer itself: pyarrow.parquet adds the file systems' modules
# (pyarrow.fs, ssl) to it, 10 ms of the job's interpreter lock in the
# middle of its comparisons, for a local path neither needs. The files are
# the same byte for byte (tested); another pyarrow's may take other
# arguments: then pyarrow.parquet writes them (write_parquet).
try:
    from pyarrow._parquet import ParquetWriter as _Writer
except ImportError:     # pragma: no cover  (a pyarrow without it)
    _Writer = None

from layerdiff.analyzer.report.table_parts import ELEMENT_TENSOR, ELEMENT_VALUES
from layerdiff.common.schema import (
    ALIGNMENT_SCHEMA,
    ELEMENTS_SCHEMA,
    NODES_SCHEMA,
    REPORT_TABLES,
    WEIGHTS_SCHEMA,
    column,
    run_offsets,
)


def element_arrays(parts: dict) -> dict[str, pa.Array]:
    """ELEMENTS_SCHEMA's arrays from table_parts.element_parts."""
    counts = np.asarray(parts["counts"], np.int64)
    out: dict[str, pa.Array] = {
        "rank": _plain(np.concatenate([np.arange(n, dtype=np.int64) for n in counts.tolist()]) if counts.size
                       else [], ELEMENTS_SCHEMA.field("rank").type)}
    for name, _ in ELEMENT_VALUES:
        out[name] = _plain(parts[name], ELEMENTS_SCHEMA.field(name).type)
    for name in ELEMENT_TENSOR:
        out[name] = _repeated(parts[name], counts, ELEMENTS_SCHEMA.field(name).type)
    out["index"] = _index_lists(np.repeat(np.asarray(parts["ranks"], np.int64), counts),
                                np.asarray(parts["index"], np.int64))
    return out


def _plain(values: np.ndarray | list, typ: pa.DataType) -> pa.Array:
    """A column of numbers without nulls (NaN stays a value), from numpy."""
    data = np.ascontiguousarray(values, np.dtype(typ.to_pandas_dtype()))
    return pa.Array.from_buffers(typ, len(data), [None, pa.py_buffer(data)])


def _repeated(values: list, times: np.ndarray, typ: pa.DataType) -> pa.Array:
    """``values[i]`` ``times[i]`` times over, as an Arrow array of ``typ``
    (string or an integer type; None: null)."""
    n = int(times.sum())
    valid = np.repeat(np.array([v is not None for v in values], bool), times)
    nulls = n - int(np.count_nonzero(valid))
    vbuf = pa.py_buffer(np.packbits(valid, bitorder="little")) if nulls else None
    if pa.types.is_string(typ):
        encoded = [b"" if v is None else v.encode("utf-8") for v in values]
        offsets = run_offsets(np.repeat(np.array([len(b) for b in encoded], np.int64), times))
        data = b"".join(b * int(t) for b, t in zip(encoded, times))
        return pa.Array.from_buffers(typ, n, [vbuf, offsets.buffers()[1], pa.py_buffer(data)], null_count=nulls)
    plain = np.repeat(np.array([0 if v is None else v for v in values], np.dtype(typ.to_pandas_dtype())), times)
    return pa.Array.from_buffers(typ, n, [vbuf, pa.py_buffer(plain)], null_count=nulls)


def _index_lists(ranks: np.ndarray, flat: np.ndarray) -> pa.Array:
    """The elements' axis indices as one list<int64> array: each row's
    rank (repeated in numpy: a Python int a row was a fifth of the tables'
    time) and every row's indices, one after another (no list a row)."""
    child = pa.Array.from_buffers(pa.int64(), flat.size, [None, pa.py_buffer(np.ascontiguousarray(flat))])
    return pa.ListArray.from_arrays(run_offsets(ranks), child)


def _table(rows: list[dict], schema: pa.Schema) -> pa.Table:
    # a column's values taken from the rows without a Python call a cell (50k cells for the nodes)
    return _from_columns({f.name: list(map(dict.get, rows, repeat(f.name))) for f in schema}, schema)


def _from_columns(cols: dict[str, list | pa.Array], schema: pa.Schema) -> pa.Table:
    # a column no row gave (none compared) is empty
    return pa.Table.from_arrays([c if isinstance(c := cols.get(f.name, []), pa.Array) else column(c, f.type)
                                 for f in schema], schema=schema)


def write_table_parts(out: Path, parts: dict) -> None:
    """The tables table_parts took, as Parquet files in ``out`` (TypeError
    or ValueError: a value of a type of its own among them, which marshal
    carried as its bytes)."""
    nodes = parts["nodes"]
    if any(type(v) is bytes for col in nodes.values() for v in col):
        raise TypeError("a node's value was carried as bytes (a numpy number): not a column's type")
    tables = {"nodes": _from_columns(nodes, NODES_SCHEMA),
              "elements": _from_columns(element_arrays(parts["elements"]), ELEMENTS_SCHEMA),
              "alignment": _table(parts["alignment"], ALIGNMENT_SCHEMA)}
    if parts.get("weights") is not None:
        tables["weights"] = _table(parts["weights"], WEIGHTS_SCHEMA)
    for name, table in tables.items():
        write_parquet(table, out / REPORT_TABLES[name][0])


def write_parquet(table: pa.Table, path: Path) -> None:
    """``table`` as a Parquet file at ``path`` (zstd), as pyarrow.parquet's
    write_table makes it with that compression."""
    if _Writer is not None:
        try:
            writer = _Writer(str(path), table.schema, compression="zstd", memory_pool=pa.system_memory_pool(),
                             writer_engine_version="V2")
        except TypeError:       # arguments this pyarrow's writer does not take
            pass
        else:
            try:
                writer.write_table(table)
            finally:
                writer.close()
            return
    import pyarrow.parquet as pq

    pq.write_table(table, path, compression="zstd", memory_pool=pa.system_memory_pool())

