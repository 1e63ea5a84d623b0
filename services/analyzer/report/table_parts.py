"""What the report's Parquet tables (report.tables) are made of, taken from
the job's rows as plain values and numpy columns: no pyarrow here.

The job's process takes these parts (a few milliseconds) and hands them to
the report's process (report.writer), which makes the tables: pyarrow's
import, the Arrow arrays and the encoding held the job's interpreter lock
for a twentieth of a two-dump job. ``pack`` / ``unpack`` carry them through
the pipe with marshal: plain values, and each numpy column as its type and
bytes.
"""
from __future__ import annotations

import marshal
from itertools import repeat

import numpy as np

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

# the elements' numeric columns: (table column, WorstRows column)
ELEMENT_VALUES = (("flat_index", "flat"), ("std_value", "ref"), ("npu_value", "dev"), ("abs_diff", "abs_diff"),
                  ("relative_diff", "rel_diff"))
# the elements' columns that hold one value a tensor
ELEMENT_TENSOR = ("node", "tensor", "role", "input_index", "detail_file")


def table_parts(rows: list, detail_files: dict[str, str], aligned: list[tuple], weights: list[dict] | None) -> dict:
    """The parts of the nodes, elements, alignment and (where the graphs
    were aligned) weights tables (``rows``: the report's Rows in
    cpu_vs_npu.csv's order; ``aligned``: alignment_rows)."""
    parts = {"nodes": node_columns(rows, aligned), "elements": element_parts(rows, detail_files),
             "alignment": [{"reference_tensor": ref or None, "device_tensor": dev or None, "method": method,
                            "confidence": conf, "note": note} for ref, dev, method, conf, note in aligned],
             "weights": None}
    if weights is not None:
        parts["weights"] = [{**w, "elements": w["elements"] if isinstance(w["elements"], int) else None,
                             "max_abs_diff": float(w["max_abs_diff"])} for w in weights]
    return parts


def node_columns(rows: list, aligned: list[tuple]) -> dict[str, list]:
    """NODES_SCHEMA's columns, a value a compared tensor, as lists (the
    columns of no row are left for the table to fill). The metrics' columns
    are read straight from each row's metrics: a dict of 72 keys a row,
    taken apart again a column at a time, was a third of the tables' time."""
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
    cols = {name: list(map(dict.__getitem__, out, repeat(name))) for name in (out[0] if out else ())}
    metrics = [r.outcome.metrics.__dict__ for r in rows]
    cols.update((col, list(map(dict.__getitem__, metrics, repeat(field)))) for col, field in _METRICS.items())
    return cols


def element_parts(rows: list, detail_files: dict[str, str]) -> dict:
    """The worst elements of every failing tensor, as its detail CSV lists
    them: each numeric column whole (numpy), each tensor's own values once
    with its count of rows, its rank, and its rows' axis indices (a rank a
    row, flattened)."""
    from layerdiff.analyzer.compare.worst import WorstRows  # the job's: not loaded where the tables are made

    tensors: dict[str, list] = {name: [] for name in ELEMENT_TENSOR}
    counts: list[int] = []
    ranks: list[int] = []
    parts: list = []
    indices: list[np.ndarray] = []
    for r in rows:
        fname = detail_files.get(r.label)
        if fname is None or not r.outcome.worst:
            continue
        worst = WorstRows.of(r.outcome.worst)     # columns as they are kept (tuples made columns)
        shape = tuple(r.outcome.metrics.shape)
        for name, value in (("node", r.site.node), ("tensor", r.site.tensor), ("role", r.role),
                            ("input_index", r.site.output_index if r.is_input else None), ("detail_file", fname)):
            tensors[name].append(value)
        counts.append(len(worst))
        ranks.append(len(shape))
        parts.append(worst)
        if shape:
            indices.append(np.stack(np.unravel_index(worst.flat, shape), axis=1).reshape(-1))
    out: dict = {name: (np.concatenate([getattr(w, attr) for w in parts]) if parts else
                        np.empty(0, np.int64 if attr == "flat" else np.float64))
                 for name, attr in ELEMENT_VALUES}
    out.update(tensors, counts=np.array(counts, np.int64), ranks=np.array(ranks, np.int64),
               index=np.concatenate(indices).astype(np.int64) if indices else np.empty(0, np.int64))
    return out


def pack(parts: dict) -> bytes:
    """The parts as bytes for another process (``unpack``)."""
    elements = {k: (v.dtype.str, v.tobytes()) if isinstance(v, np.ndarray) else v
                for k, v in parts["elements"].items()}
    return marshal.dumps({**parts, "elements": elements})


def unpack(data: bytes) -> dict:
    """What ``pack`` made, its numpy columns as read-only arrays over the bytes."""
    parts = marshal.loads(data)
    parts["elements"] = {k: np.frombuffer(v[1], np.dtype(v[0])) if isinstance(v, tuple) else v
                         for k, v in parts["elements"].items()}
    return parts
