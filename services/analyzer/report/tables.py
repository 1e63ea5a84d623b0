"""The report's tables as Parquet (common.schema.REPORT_TABLES): the same
rows as cpu_vs_npu.csv and summary.json's nodes (nodes.parquet), the detail
CSVs (elements.parquet), alignment.csv and weights.csv, typed. Built from
the same rows the CSV and JSON files are written from."""
from __future__ import annotations

from itertools import repeat
from pathlib import Path

import numpy as np
import pyarrow as pa

# Parquet's writer itself: pyarrow.parquet adds the file systems' modules
# (pyarrow.fs, ssl) to it, 10 ms of the job's interpreter lock in the
# middle of its comparisons, for a local path neither needs. The files are
# the same byte for byte (tested); another pyarrow's may take other
# arguments: then pyarrow.parquet writes them (_parquet_file).
try:
    from pyarrow._parquet import ParquetWriter as _Writer
except ImportError:     # pragma: no cover  (a pyarrow without it)
    _Writer = None

from layerdiff.analyzer.compare.worst import WorstRows
from layerdiff.common.schema import (
    ALIGNMENT_SCHEMA,
    ELEMENTS_SCHEMA,
    NODES_SCHEMA,
    REPORT_TABLES,
    WEIGHTS_SCHEMA,
    column,
    run_offsets,
)

# NodeMetrics fields under their column names (the device is "npu" in the seed's columns)
_METRICS = {"max_abs_err": "max_abs_err", "mean_abs_err": "mean_abs_err", "max_rel_err": "max_rel_err",
            "mean_rel_err": "mean_rel_err", "ref_mean": "ref_mean", "ref_std": "ref_std", "ref_rms": "ref_rms",
            "max_abs_diff": "max_abs_diff", "mean_abs_diff": "mean_abs_diff", "cosine": "cosine", "mse": "mse",
            "rmse": "rmse", "pearson": "pearson", "sqnr_db": "sqnr_db", "rel_euclidean": "rel_euclidean",
            "kl_div": "kl_div", "rel_err_lt_0_001": "rel_err_lt_0_001", "rel_err_lt_0_005": "rel_err_lt_0_005",
            "ref_nan": "ref_nan", "ref_inf": "ref_inf", "npu_nan": "dev_nan", "npu_inf": "dev_inf",
            "fp16_overflow": "fp16_overflow", "npu_fp16_overflow": "dev_fp16_overflow",
            "finite_pairs": "finite_pairs", "both_nan": "both_nan", "nonfinite_errors": "nonfinite_errors",
            "atol": "atol", "rtol": "rtol", "errors": "errors", "total": "total",
            "first_diff_offset": "first_mismatch_offset", "ref_value": "ref_value", "npu_value": "dev_value"}


def node_columns(rows: list, aligned: list[tuple]) -> dict[str, list]:
    """NODES_SCHEMA's columns, a value a compared tensor (``rows``: the
    report's Rows in cpu_vs_npu.csv's order; ``aligned``: alignment_rows).
    The metrics' columns are read straight from each row's metrics: a dict
    of 72 keys a row, taken apart again a column at a time, was a third of
    the tables' time, holding the interpreter beside the other reports."""
    by_device = {dev: (method, conf) for ref, dev, method, conf, _ in aligned if dev}
    by_ref = {ref: (method, conf) for ref, dev, method, conf, _ in aligned if ref}
    out = []
    for i, r in enumerate(rows):
        m = r.outcome.metrics
        f, b = r.finding, r.budget
        impact = f.impact if f is not None else None
        method, conf = by_device.get(r.device_name) or by_ref.get(r.site.tensor) or (None, None)
        iso = r.isolated
        d = {"index": i, "node": r.site.node, "tensor": r.site.tensor, "role": r.role,
             "input_index": r.site.output_index if r.is_input else None, "op_type": r.site.op_type,
             "order": r.site.order, "device_name": r.device_name, "alignment_method": method,
             "alignment_confidence": conf, "device_dtype": r.device_dtype or None, "constant": r.is_constant,
             "passed": not r.failed, "first_diff_index": list(m.first_mismatch_index), "shape": list(m.shape),
             "note": r.outcome.note, "overflow": r.overflow or None,
             "verdict": f.verdict if f is not None else None, "cause": (f.cause or None) if f is not None else None,
             "evidence": list(f.evidence) if f is not None else [],
             "impact_harmful": impact.harmful if impact is not None else None,
             "impact_worst_output": (impact.worst_output or None) if impact is not None else None,
             "impact_cosine": impact.cosine if impact is not None else None,
             "precision": r.precision or None, "precision_from": r.precision_from or None,
             "reduction_length": b.k if b is not None else None,
             "explained_rel_err": b.rel if b is not None else None,
             "allowed_rel_err": b.allowed if b is not None else None,
             "rel_err": r.rel_err if b is not None else None, "own_rel_err": r.own_rel, "read_rel_err": r.read_rel,
             "worst_block": r.block.where if r.block is not None else None,
             "worst_block_rel_err": r.block.rel if r.block is not None else None,
             "masked": r.masked if b is not None else None,
             "isolated_errors": iso.errors if iso is not None else None,
             "isolated_cosine": iso.cosine if iso is not None else None,
             "isolated_mean_rel_err": iso.mean_rel_err if iso is not None else None,
             "isolated_max_abs_diff": iso.max_abs_diff if iso is not None else None}
        out.append(d)
    cols: dict[str, list] = {f.name: [] for f in NODES_SCHEMA}
    cols.update((name, list(map(dict.__getitem__, out, repeat(name)))) for name in (out[0] if out else ()))
    metrics = [r.outcome.metrics.__dict__ for r in rows]
    cols.update((col, list(map(dict.__getitem__, metrics, repeat(field)))) for col, field in _METRICS.items())
    return cols


def element_columns(rows: list, detail_files: dict[str, str]) -> dict[str, list | pa.Array]:
    """The worst elements of every failing tensor, as its detail CSV lists
    them, column by column (twenty thousand rows of dicts took longer to
    make into a table than the rest of the report)."""
    index_parts: list[np.ndarray] = []      # each tensor's (rows, rank) axis indices
    tensors: dict[str, list] = {"node": [], "tensor": [], "role": [], "input_index": [], "detail_file": []}
    counts: list[int] = []
    parts: list[WorstRows] = []
    for r in rows:
        fname = detail_files.get(r.label)
        if fname is None or not r.outcome.worst:
            continue
        worst = WorstRows.of(r.outcome.worst)     # columns as they are kept (tuples made columns)
        n = len(worst)
        shape = tuple(r.outcome.metrics.shape)
        for name, value in (("node", r.site.node), ("tensor", r.site.tensor), ("role", r.role),
                            ("input_index", r.site.output_index if r.is_input else None), ("detail_file", fname)):
            tensors[name].append(value)
        counts.append(n)
        parts.append(worst)
        index_parts.append(np.stack(np.unravel_index(worst.flat, shape), axis=1) if shape
                           else np.empty((n, 0), np.int64))
    # what is the same for a tensor's rows: a value a tensor, repeated in numpy (not a Python list a row)
    times = np.array(counts, np.int64)
    out: dict[str, list | pa.Array] = {
        "rank": _plain(np.concatenate([np.arange(n, dtype=np.int64) for n in counts]) if counts else [],
                       ELEMENTS_SCHEMA.field("rank").type)}
    for name, attr in (("flat_index", "flat"), ("std_value", "ref"), ("npu_value", "dev"), ("abs_diff", "abs_diff"),
                       ("relative_diff", "rel_diff")):
        out[name] = _plain(np.concatenate([getattr(w, attr) for w in parts]) if parts else [],
                           ELEMENTS_SCHEMA.field(name).type)
    for name, values in tensors.items():
        out[name] = _repeated(values, times, ELEMENTS_SCHEMA.field(name).type)
    out["index"] = _index_lists(index_parts)
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


def _index_lists(parts: list[np.ndarray]) -> pa.Array:
    """The elements' axis indices as one list<int64> array, from the
    tensors' index matrices (no list a row: twenty thousand of them)."""
    # each row's rank, repeated in numpy (a Python int a row was a fifth of the tables' time)
    ranks = np.repeat(np.array([p.shape[1] for p in parts], np.int64), [p.shape[0] for p in parts])
    flat = np.concatenate([p.reshape(-1) for p in parts]).astype(np.int64) if parts else np.empty(0, np.int64)
    child = pa.Array.from_buffers(pa.int64(), flat.size, [None, pa.py_buffer(flat)])
    return pa.ListArray.from_arrays(run_offsets(ranks), child)


def _table(rows: list[dict], schema: pa.Schema) -> pa.Table:
    # a column's values taken from the rows without a Python call a cell (50k cells for the nodes)
    return _from_columns({f.name: list(map(dict.get, rows, repeat(f.name))) for f in schema}, schema)


def _from_columns(cols: dict[str, list | pa.Array], schema: pa.Schema) -> pa.Table:
    return pa.Table.from_arrays([c if isinstance(c := cols[f.name], pa.Array) else column(c, f.type)
                                 for f in schema], schema=schema)


def write_tables(out: Path, rows: list, detail_files: dict[str, str], aligned: list[tuple],
                 weights: list[dict] | None) -> None:
    """nodes, elements, alignment and (where the graphs were aligned)
    weights.parquet into the report directory ``out``."""
    tables = {"nodes": _from_columns(node_columns(rows, aligned), NODES_SCHEMA),
              "elements": _from_columns(element_columns(rows, detail_files), ELEMENTS_SCHEMA),
              "alignment": _table([{"reference_tensor": ref or None, "device_tensor": dev or None, "method": method,
                                    "confidence": conf, "note": note} for ref, dev, method, conf, note in aligned],
                                  ALIGNMENT_SCHEMA)}
    if weights is not None:
        tables["weights"] = _table([{**w, "elements": w["elements"] if isinstance(w["elements"], int) else None,
                                     "max_abs_diff": float(w["max_abs_diff"])} for w in weights], WEIGHTS_SCHEMA)
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

