"""The worst mismatching elements of a node, worst first (the rows of
the per-node detail tables).  The compiled search (a bounded heap) is
``kernel._worst_marked`` for float32 and float16 pairs (the blocks their
metric pass marks), ``kernel._worst`` for other floats (widened to float64
a piece at a time) and ``kernel._worst_int`` (as ``compiled.kernels()``
gives them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from layerdiff.analyzer.compare.compiled import (
    _PIECE,
    _as_i64,
    _flat,
    _into_f64,
    _kind,
    _run,
    as_stored,
    block_marks,
    check_marks,
    kernels,
)
from layerdiff.analyzer.compare.contract import ATOL_DEFAULT, REL_EPS, RTOL_DEFAULT

__all__ = ["WorstRows", "worst_elements", "worst_row_key", "worst_rows"]


def worst_row_key(row) -> tuple:
    """Sort key of ``worst_elements`` rows, also for rows of several chunks
    merged: non-finite pairs first by index, then finite pairs by abs_diff
    descending, then index."""
    i, rv, dv, ad = row[:4]
    if not (math.isfinite(rv) and math.isfinite(dv)):
        return (0, 0.0, i)
    return (1, -ad, i)


class WorstRows(Sequence):
    """``worst_elements``' rows kept as their five columns (numpy arrays:
    the flat indices as int64, the values and differences as float64): a
    sequence of (flat index, ref value, dev value, abs_diff, relative_diff)
    tuples, equal to their list, for whatever reads it row by row; its
    columns for the reports that take them whole (the detail file's frame,
    the elements table). A job fails hundreds of tensors: as tuples, their
    rows were tens of thousands of objects, each made, then looked at by
    the interpreter's collector, then taken apart again."""

    __slots__ = ("flat", "ref", "dev", "abs_diff", "rel_diff")

    def __init__(self, flat: np.ndarray, ref: np.ndarray, dev: np.ndarray, abs_diff: np.ndarray,
                 rel_diff: np.ndarray) -> None:
        self.flat = np.ascontiguousarray(flat, np.int64)     # (Sequence has an index method)
        self.ref, self.dev, self.abs_diff, self.rel_diff = (np.ascontiguousarray(c, np.float64)
                                                            for c in (ref, dev, abs_diff, rel_diff))

    @classmethod
    def of(cls, rows) -> WorstRows:
        """Rows given as tuples (a list of them, or WorstRows as they are)."""
        if isinstance(rows, WorstRows):
            return rows
        rows = list(rows)
        if not rows:
            return cls(*(np.empty(0) for _ in range(5)))
        return cls(np.array([r[0] for r in rows], np.int64), *(np.array([r[k] for r in rows], np.float64)
                                                               for k in range(1, 5)))

    def __len__(self) -> int:
        return len(self.flat)

    def __iter__(self):
        return zip(self.flat.tolist(), self.ref.tolist(), self.dev.tolist(), self.abs_diff.tolist(),
                   self.rel_diff.tolist())

    def __getitem__(self, i):
        if isinstance(i, slice):
            return list(self)[i]
        return (int(self.flat[i]), float(self.ref[i]), float(self.dev[i]), float(self.abs_diff[i]),
                float(self.rel_diff[i]))

    def __eq__(self, other) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return list(self) == list(other)

    __hash__ = None     # type: ignore[assignment]  # as a list: compared by value, never a key

    def __repr__(self) -> str:
        return repr(list(self))

    def values(self) -> np.ndarray:
        """The four values of each row, a row after another (n x 4, float64)."""
        return np.column_stack((self.ref, self.dev, self.abs_diff, self.rel_diff))


def worst_elements(ref: np.ndarray, dev: np.ndarray, atol: float = ATOL_DEFAULT,
                   rtol: float = RTOL_DEFAULT, count: int = 128, marks: np.ndarray | None = None) -> list:
    """Up to ``count`` mismatching elements, worst first, as a list of rows
    (``worst_rows`` keeps them as columns)."""
    return list(worst_rows(ref, dev, atol, rtol, count, marks))


def worst_rows(ref: np.ndarray, dev: np.ndarray, atol: float = ATOL_DEFAULT,
               rtol: float = RTOL_DEFAULT, count: int = 128, marks: np.ndarray | None = None) -> WorstRows:
    """Up to ``count`` mismatching elements, worst first.

    Rows are ``(flat index, ref value, dev value, abs_diff, relative_diff)``
    with the raw values (NaN and Inf as they are), abs_diff = |d - r| and
    relative_diff = abs_diff / |r| (REL_EPS for r == 0) in IEEE float64, so
    NaN or inf for a non-finite pair; for two integer tensors abs_diff is
    the exact difference rounded once.  Pairs with NaN or Inf come first (by
    index), then the rest by abs_diff descending then index
    (``worst_row_key``). Float32 and float16 pairs are searched only in
    the blocks their metric pass marks (``block_marks``): ``marks`` is
    what ``metrics.compare`` of the same pair with the same tolerances
    left, else the pass is made here.
    """
    r = _flat(ref)
    d = _flat(dev)
    if r.size != d.size:
        raise ValueError(
            f"element count mismatch: reference has {r.size} elements, device has {d.size}")
    kr, kd = _kind(r), _kind(d)
    count = int(count)
    if count <= 0 or r.size == 0:
        return WorstRows.of(())
    hidx = np.empty(count, np.int64)
    hdiff = np.empty(count, np.float64)
    hcls = np.empty(count, np.int64)
    k = 0
    integer = kr == "int" and kd == "int"
    ru, du = r.dtype == np.uint64, d.dtype == np.uint64
    narrow = kr in ("f32", "f16") and kd in ("f32", "f16")
    if narrow:      # read as they are stored, each element widened as it is read
        if marks is None:       # the metric pass tells where the mismatches lie
            made = block_marks(r, d)
            assert made is not None     # a float32/float16 pair
            _run(r, d, atol, rtol, 0, made)
            marks = made
        k = kernels()._worst_marked(as_stored(r), as_stored(d), float(atol), float(rtol),
                                    check_marks(marks, r.size), 0, k, hidx, hdiff, hcls)
    else:
        # one float64 scratch piece per side for the whole tensor: a fresh one per
        # piece is a fresh mapping (memory.MMAP_THRESHOLD_BYTES), faulted in anew
        scratch = None if integer else (np.empty(min(_PIECE, r.size)), np.empty(min(_PIECE, r.size)))
        for s in range(0, r.size, _PIECE):
            if integer:
                k = kernels()._worst_int(_as_i64(r[s:s + _PIECE]), _as_i64(d[s:s + _PIECE]), ru, du, s, k,
                               hidx, hdiff, hcls)
            else:
                assert scratch is not None    # made above for every tensor that is not integer on both sides
                rp, dp = r[s:s + _PIECE], d[s:s + _PIECE]
                k = kernels()._worst(_into_f64(rp, scratch[0]), _into_f64(dp, scratch[1]), float(atol),
                                     float(rtol), s, k, hidx, hdiff, hcls)
    if integer:     # exact differences of integers past 2**53: Python's ints, a row at a time
        rows = []
        for j in range(k):
            i = int(hidx[j])
            rv, dv = float(r[i]), float(d[i])
            diff = float(abs(int(d[i]) - int(r[i])))
            rows.append((i, rv, dv, diff, diff / (abs(rv) if rv != 0.0 else REL_EPS)))
        rows.sort(key=worst_row_key)
        return WorstRows.of(rows)
    # the rows as columns: a diff_cnt of rows a failing node, hundreds of nodes
    idx = hidx[:k]
    x = r[idx].astype(np.float64)
    y = d[idx].astype(np.float64)
    with np.errstate(all="ignore"):
        ae = np.abs(y - x)
        rd = ae / np.where(x != 0.0, np.abs(x), REL_EPS)
    finite = np.isfinite(x) & np.isfinite(y)
    # worst_row_key's order: non-finite pairs first by index, then abs_diff descending, then index
    order = np.lexsort((idx, np.where(finite, -ae, 0.0), finite))
    return WorstRows(idx[order], x[order], y[order], ae[order], rd[order])
