"""Per-node accuracy metrics: device output vs. FP32 CPU reference.

Everything a node report needs is computed in one fused pass over the two
tensors (``compare``).  The pass is also available in chunked form
(``accumulate`` / ``merge`` / ``finalize``) so that a node too large for one
machine, or one message, can be split anywhere and recombined to the same
result: counts, offsets and maxima exactly, sums up to summation order (see
Accuracy below).

Definitions (``reference_metrics`` is the executable form of this list):

* A pair (r_i, d_i) is *finite* when both values are finite.  Only finite
  pairs enter a statistic: every sum, moment, maximum, relative error, the
  KL divergence, cosine, pearson, mse, rmse, sqnr_db, rel_euclidean, the
  rel_err_lt_* fractions and the reference mean / std / rms.  A finite pair
  mismatches when ``|d_i - r_i| > atol + rtol * |r_i|``.
* A non-finite pair (NaN or +-Inf on either side) enters no statistic and
  mismatches, except when both sides are the same infinity (+Inf/+Inf,
  -Inf/-Inf), which is equal: NaN against anything (NaN included), Inf
  against a finite value, +Inf against -Inf and Inf against NaN all fail.
  Substituting numbers for NaN/Inf before comparing (what the vendor tool
  does) would let a device NaN pass against a reference 0 and blend a
  float32-max stand-in into every statistic.
* ``errors`` counts finite and non-finite mismatches; ``nonfinite_errors``
  the non-finite ones, ``both_nan`` the pairs NaN on both sides and
  ``finite_pairs`` the finite pairs; ``total`` is the element count.
* When both tensors have integer or bool dtypes (any mix), a pair
  mismatches iff the values differ as integers: no tolerance, and int64
  beyond 2**53 or uint64 against int64 are told apart.  |e_i| is the exact
  integer difference rounded once to float64; the other statistics use the
  values converted to float64.  Every integer pair is finite.  An integer
  tensor against a float one follows the float rules.
* e_i = d_i - r_i, a_i = |e_i|, rel_i = a_i / |r_i| with |r_i| replaced by
  REL_EPS where r_i == 0.  max/mean_abs_diff, max/mean_rel_err, mse and the
  rel_err_lt_* fractions are over the finite pairs; max/mean_abs_err (the
  vendor's columns) over the finite mismatching pairs: 0 when nothing
  mismatches, NaN when every mismatch is a non-finite pair.
* Undefined is NaN, never a plausible number: with no finite pair every
  statistic is NaN; cosine is NaN when either side is all zero, pearson
  when either side is constant, kl_div when either side's sum of |x| is 0;
  sqnr_db is +inf when the error energy is 0 and the reference's is not,
  -inf the other way round, NaN when both are 0; rel_euclidean is inf when
  the reference is all zero and the error is not, NaN when both are.
* KL(P||Q) with P = |r| / sum|r|, Q = |d| / sum|d|, computed as
  ``(1/Sr) * sum |r_i| (ln max(|r_i|, REL_EPS) - ln max(|d_i|, REL_EPS))
  + ln(Sd/Sr)``: the floor is applied to the magnitudes, not to the
  normalised p_i/q_i, because a floor on p_i depends on the global sum and
  would need a second pass (and could not be merged across chunks).  Exactly
  KL whenever no non-zero magnitude lies below 1e-10.  Clamped at 0 (it can
  only come out negative through rounding).
* ``ref_value``/``dev_value`` (the vendor's ref_value / npu_value columns)
  are the values at the first mismatch, or at element 0 when nothing
  mismatches, shown with the vendor's display rule: NaN as 0 and +-Inf as
  +-float32 max.  That rule applies to these two fields only;
  ``worst_elements`` rows show the raw values.
* ``ref_nan``/``ref_inf``/``dev_nan``/``dev_inf`` count the raw values of
  each side.  ``fp16_overflow``/``dev_fp16_overflow`` count finite values
  with |x| > 65504 in float tensors (Inf is counted as Inf); they are 0 for
  integer and bool tensors, which no FP16 range applies to.

Implementation: the fused pass over the two tensors is ``kernel.py`` (one
numba compilation unit: see its docstring), the search for the worst
elements ``worst.py``; this module holds the definitions, the result
types and the public API.

Accuracy: every count, offset and maximum is exact, i.e. agrees with
``reference_metrics``.  The float32 kernel decides them with a safety band
(mismatch test against atol and rtol shrunk by 2**-20, relative-error
thresholds +-2**-19, maxima grown by 2**-22 / 2**-20) and reruns a block's
tolerance / relative-error work in IEEE float64 (no fast-math, no
contraction, same operations as the scalar path and numpy) whenever a
mismatch is possible, a threshold count falls in the band, or the block
could raise a running maximum.  Sums over elements on the float32 path are
accumulated in float32 for at most 32 terms per lane, then in float64: each
sum of non-negative terms (|e|, e^2, |r|, |d|, relative errors) is within
~2e-6 relative of its float64 value (typically ~1e-7), and the moments
within ~2e-6 of sum (r - shift)^2: the mean is within ~2e-6 * max |r|
absolute, std, rms, mse, rmse, rel_euclidean within ~2e-6 relative and
sqnr_db within ~2e-5 dB.  For float32/float16 pairs the KL log
term of an element is ``ln(max(|r|,eps) / max(|d|,eps))`` evaluated in
float32 (IEEE division, 8-entry table + degree-6 polynomial; max error
2e-7 relative / 2.5e-6 absolute over [1e-15, 1e15]), multiplied by |r| and
accumulated as above, and sum |d| is taken as sum |r| + sum (|d| - |r|)
where that does not cancel; KL then differs from the float64 definition by
at most ~2e-6 times the |r|-weighted mean of |ln(|r|/|d|)| (below 1e-7
absolute on typical data).  Other dtypes use float64 throughout (sums to
float64 summation order; integer |e| from the exact difference).  The
per-element formulas never depend on how a tensor is chunked, so chunked
and whole results differ only in summation order: for float32/float16
pairs that is the float32 accuracy above, for other dtypes relative 1e-9 is
far more than enough.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from layerdiff.analyzer.compare.compiled import _merge_state, _run, block_marks, warmup
from layerdiff.analyzer.compare.contract import (
    _FLOAT_FIELDS,
    _INT_FIELDS,
    ATOL_DEFAULT,
    FP16_MAX,
    REL_EPS,
    RTOL_DEFAULT,
    _new_state,
    display_value,
)
from layerdiff.analyzer.compare.worst import WorstRows, worst_elements, worst_row_key, worst_rows

__all__ = [
    "ATOL_DEFAULT",
    "RTOL_DEFAULT",
    "FP16_MAX",
    "REL_EPS",
    "NodeMetrics",
    "Accumulator",
    "compare",
    "accumulate",
    "merge",
    "finalize",
    "WorstRows",
    "worst_elements",
    "worst_row_key",
    "worst_rows",
    "block_marks",
    "reference_metrics",
    "warmup",
]


# ---------------------------------------------------------------------------
# Result types
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeMetrics:
    """Metrics of one node (see the module docstring for the definitions).

    ``ref_value``/``dev_value`` follow the vendor's display rule (NaN shown
    as 0, +-Inf as +-float32 max); every other field is computed on the raw
    values.  Statistics are over the ``finite_pairs`` finite pairs and NaN
    when there are none (an empty tensor included), while the mismatch
    fields are then 0 / -1 / ().
    """

    total: int
    errors: int
    first_mismatch_offset: int
    first_mismatch_index: tuple
    shape: tuple
    ref_value: float
    dev_value: float
    max_abs_err: float
    mean_abs_err: float
    max_abs_diff: float
    mean_abs_diff: float
    max_rel_err: float
    mean_rel_err: float
    ref_mean: float
    ref_std: float
    ref_rms: float
    cosine: float
    mse: float
    rmse: float
    pearson: float
    sqnr_db: float
    rel_euclidean: float
    kl_div: float
    rel_err_lt_0_001: float
    rel_err_lt_0_005: float
    ref_nan: int
    ref_inf: int
    dev_nan: int
    dev_inf: int
    fp16_overflow: int
    dev_fp16_overflow: int
    finite_pairs: int
    both_nan: int
    nonfinite_errors: int
    atol: float
    rtol: float

    @property
    def passed(self) -> bool:
        return self.errors == 0

    def as_dict(self) -> dict:
        values = self.__dict__       # fields() and getattr a field: a report asks this of every node
        out = {k: values[k] for k in _METRIC_FIELDS}
        for k in _TUPLE_FIELDS:
            out[k] = list(out[k])
        return out

    @classmethod
    def from_dict(cls, d: dict) -> NodeMetrics:
        kw = {f.name: d[f.name] for f in fields(cls)}
        kw["first_mismatch_index"] = tuple(kw["first_mismatch_index"])
        kw["shape"] = tuple(kw["shape"])
        return cls(**kw)


_METRIC_FIELDS = tuple(f.name for f in fields(NodeMetrics))
_TUPLE_FIELDS = ("first_mismatch_index", "shape")


@dataclass
class Accumulator:
    """Mergeable partial result of the metric pass (numbers only).

    ``n`` counts every element, ``finite_pairs`` the finite pairs that all
    sums, moments and maxima are over; ``errors`` includes the
    ``nonfinite_errors``.  ``mean_ref/m2_ref``, ``mean_dev/m2_dev`` and
    ``c_ref_dev`` are the centred first and second moments of r and d over
    the finite pairs and their co-moment; ``sum_sq_diff`` is sum (d - r)^2
    (kept directly: it cannot be recovered from the moments without
    cancellation).  ``v0_*`` hold the values at the smallest offset seen
    (offset 0 once all chunks are merged), ``first_*`` those at the first
    mismatch; offsets are -1 when absent.  These four values follow the
    display rule (NaN as 0, +-Inf as +-float32 max).
    """

    atol: float = ATOL_DEFAULT
    rtol: float = RTOL_DEFAULT
    n: int = 0
    errors: int = 0
    first_offset: int = -1
    v0_offset: int = -1
    ref_nan: int = 0
    ref_inf: int = 0
    dev_nan: int = 0
    dev_inf: int = 0
    ref_overflow: int = 0
    dev_overflow: int = 0
    n_rel_lt_0_001: int = 0
    n_rel_lt_0_005: int = 0
    finite_pairs: int = 0
    both_nan: int = 0
    nonfinite_errors: int = 0
    first_ref: float = math.nan
    first_dev: float = math.nan
    v0_ref: float = math.nan
    v0_dev: float = math.nan
    sum_err: float = 0.0
    max_err: float = 0.0
    sum_abs_diff: float = 0.0
    max_abs_diff: float = 0.0
    sum_rel: float = 0.0
    max_rel: float = 0.0
    mean_ref: float = 0.0
    m2_ref: float = 0.0
    mean_dev: float = 0.0
    m2_dev: float = 0.0
    c_ref_dev: float = 0.0
    sum_sq_diff: float = 0.0
    sum_abs_ref: float = 0.0
    sum_abs_dev: float = 0.0
    sum_kl: float = 0.0

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> Accumulator:
        kw: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in d:
                kw[f.name] = int(d[f.name]) if f.name in _INT_FIELDS else float(d[f.name])
        return cls(**kw)

    def _arrays(self):
        iv = np.array([getattr(self, k) for k in _INT_FIELDS], dtype=np.int64)
        fv = np.array([getattr(self, k) for k in _FLOAT_FIELDS], dtype=np.float64)
        return iv, fv

    @classmethod
    def _from_arrays(cls, iv, fv, atol, rtol) -> Accumulator:
        # tolist() gives Python ints and floats already
        return cls(float(atol), float(rtol), *iv.tolist(), *fv.tolist())


# _from_arrays hands the kernel's state over by position
assert [f.name for f in fields(Accumulator)] == ["atol", "rtol", *_INT_FIELDS, *_FLOAT_FIELDS]


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------


def accumulate(ref_chunk, dev_chunk, offset: int = 0, atol: float = ATOL_DEFAULT,
               rtol: float = RTOL_DEFAULT, marks: np.ndarray | None = None) -> Accumulator:
    """Partial metrics of one chunk starting at flat ``offset`` of the
    tensor; ``marks``: see ``compare``."""
    iv, fv = _run(ref_chunk, dev_chunk, atol, rtol, offset, marks)
    return Accumulator._from_arrays(iv, fv, atol, rtol)


def merge(accs: Iterable[Accumulator]) -> Accumulator:
    accs = list(accs)
    if not accs:
        return Accumulator()
    atol, rtol = accs[0].atol, accs[0].rtol
    iv, fv = _new_state()
    for a in accs:
        if a.atol != atol or a.rtol != rtol:
            raise ValueError("cannot merge accumulators built with different atol/rtol")
        jv, gv = a._arrays()
        _merge_state(iv, fv, jv, gv)
    return Accumulator._from_arrays(iv, fv, atol, rtol)


def _unravel(off: int, shape: tuple) -> tuple:
    if off < 0 or not shape:
        return ()
    index = []
    for s in reversed(shape):       # np.unravel_index's answer, without its array round trip
        off, i = divmod(off, s)
        index.append(i)
    return tuple(reversed(index))


def _ratio(a: float, b: float) -> float:
    return a / b if b != 0.0 else math.nan


def _clip1(x: float) -> float:
    return min(max(x, -1.0), 1.0) if x == x else x


_STAT_FIELDS = ("max_abs_diff", "mean_abs_diff", "max_rel_err", "mean_rel_err", "ref_mean",
                "ref_std", "ref_rms", "cosine", "mse", "rmse", "pearson", "sqnr_db",
                "rel_euclidean", "kl_div", "rel_err_lt_0_001", "rel_err_lt_0_005")


def _sqnr_db(r_zero: bool, e_zero: bool, sum_r2: float, sum_e2: float) -> float:
    """10 log10(reference energy / error energy); r_zero / e_zero say whether
    the reference / the error is all zero (decided exactly, while a sum of
    squares can underflow)."""
    if r_zero or e_zero:
        return math.nan if r_zero and e_zero else (-math.inf if r_zero else math.inf)
    if sum_e2 == 0.0:
        return math.inf if sum_r2 > 0.0 else math.nan
    q = sum_r2 / sum_e2
    return 10.0 * math.log10(q) if q > 0.0 else -math.inf


def _rel_euclidean(r_zero: bool, e_zero: bool, sum_r2: float, sum_e2: float) -> float:
    """||d - r|| / ||r||; undefined (NaN) when both are zero."""
    if r_zero:
        return math.nan if e_zero else math.inf
    if sum_r2 == 0.0:
        return math.inf if sum_e2 > 0.0 else math.nan
    return math.sqrt(sum_e2) / math.sqrt(sum_r2)


def finalize(acc: Accumulator, shape=None, ref_at=None, dev_at=None) -> NodeMetrics:
    """NodeMetrics from a (merged) accumulator.

    ``ref_at``/``dev_at`` are accepted for interface compatibility and not
    needed: the accumulator keeps the values it reports.
    """
    n = int(acc.n)
    if shape is None:
        shape = (n,)
    shape = tuple(int(s) for s in shape)
    if math.prod(shape) != n:
        raise ValueError(f"shape {shape} does not hold {n} elements")
    nan = math.nan
    errors = int(acc.errors)
    nfe = int(acc.nonfinite_errors)
    nf = int(acc.finite_pairs)
    first = int(acc.first_offset) if errors > 0 else -1
    if first >= 0:
        ref_value, dev_value = acc.first_ref, acc.first_dev
    elif n > 0:
        ref_value, dev_value = acc.v0_ref, acc.v0_dev
    else:
        ref_value = dev_value = nan
    # Over the finite mismatching pairs; undefined when every mismatch is
    # a non-finite pair.
    finite_errors = errors - nfe
    if finite_errors > 0:
        max_abs_err = float(acc.max_err)
        mean_abs_err = float(acc.sum_err) / finite_errors
    else:
        max_abs_err = mean_abs_err = nan if errors else 0.0

    if nf == 0:
        vals = dict.fromkeys(_STAT_FIELDS, nan)
    else:
        m2_r = max(acc.m2_ref, 0.0)
        m2_d = max(acc.m2_dev, 0.0)
        sum_r2 = m2_r + nf * acc.mean_ref * acc.mean_ref
        sum_d2 = m2_d + nf * acc.mean_dev * acc.mean_dev
        sum_rd = acc.c_ref_dev + nf * acc.mean_ref * acc.mean_dev
        sum_e2 = acc.sum_sq_diff
        # Sums of magnitudes are 0 exactly when every term is.
        r_zero = acc.sum_abs_ref == 0.0
        d_zero = acc.sum_abs_dev == 0.0
        e_zero = acc.sum_abs_diff == 0.0
        if r_zero or d_zero:
            cosine = nan
        else:
            cosine = _clip1(_ratio(sum_rd, math.sqrt(sum_r2) * math.sqrt(sum_d2)))
        # Exact zero variance: a constant block has u == 0 (v == 0) and the
        # Chan merge of equal means adds exactly 0.
        if m2_r == 0.0 or m2_d == 0.0:
            pearson = nan
        else:
            pearson = _clip1(_ratio(acc.c_ref_dev, math.sqrt(m2_r) * math.sqrt(m2_d)))
        sr, sd = acc.sum_abs_ref, acc.sum_abs_dev
        if sr == 0.0 or sd == 0.0:
            kl = nan
        else:
            kl = max(acc.sum_kl / sr + math.log(sd / sr), 0.0)
        mse = sum_e2 / nf
        vals = dict(
            max_abs_diff=float(acc.max_abs_diff), mean_abs_diff=acc.sum_abs_diff / nf,
            max_rel_err=float(acc.max_rel), mean_rel_err=acc.sum_rel / nf,
            ref_mean=float(acc.mean_ref), ref_std=math.sqrt(m2_r / nf),
            ref_rms=math.sqrt(sum_r2 / nf), cosine=cosine, mse=mse, rmse=math.sqrt(mse),
            pearson=pearson, sqnr_db=_sqnr_db(r_zero, e_zero, sum_r2, sum_e2),
            rel_euclidean=_rel_euclidean(r_zero, e_zero, sum_r2, sum_e2), kl_div=kl,
            rel_err_lt_0_001=acc.n_rel_lt_0_001 / nf, rel_err_lt_0_005=acc.n_rel_lt_0_005 / nf,
        )
    return NodeMetrics(
        total=n, errors=errors, first_mismatch_offset=first,
        first_mismatch_index=_unravel(first, shape), shape=shape,
        ref_value=float(ref_value), dev_value=float(dev_value),
        max_abs_err=max_abs_err, mean_abs_err=mean_abs_err,
        ref_nan=int(acc.ref_nan), ref_inf=int(acc.ref_inf), dev_nan=int(acc.dev_nan),
        dev_inf=int(acc.dev_inf), fp16_overflow=int(acc.ref_overflow),
        dev_fp16_overflow=int(acc.dev_overflow), finite_pairs=nf,
        both_nan=int(acc.both_nan), nonfinite_errors=nfe,
        atol=float(acc.atol), rtol=float(acc.rtol), **vals,
    )


def compare(ref: np.ndarray, dev: np.ndarray, atol: float = ATOL_DEFAULT,
            rtol: float = RTOL_DEFAULT, marks: np.ndarray | None = None) -> NodeMetrics:
    """All metrics of one node in one fused pass (``shape`` is ref.shape).
    ``marks`` (``block_marks(ref, dev)``): filled for ``worst_elements``
    of the same pair, which then reads only the blocks that matter."""
    shape = tuple(np.shape(ref))
    iv, fv = _run(ref, dev, atol, rtol, 0, marks)
    return finalize(Accumulator._from_arrays(iv, fv, atol, rtol), shape)


# ---------------------------------------------------------------------------
# Reference definition
# ---------------------------------------------------------------------------


def reference_metrics(ref, dev, atol: float = ATOL_DEFAULT,
                      rtol: float = RTOL_DEFAULT) -> NodeMetrics:
    """Plain numpy definition of every metric (slow; for checking)."""
    shape = tuple(np.shape(ref))
    ra = np.asarray(ref).reshape(-1)
    da = np.asarray(dev).reshape(-1)
    if ra.size != da.size:
        raise ValueError(
            f"element count mismatch: reference has {ra.size} elements, device has {da.size}")
    n = ra.size
    r0 = ra.astype(np.float64)
    d0 = da.astype(np.float64)
    nan = math.nan
    with np.errstate(all="ignore"):
        if ra.dtype.kind in "iub" and da.dtype.kind in "iub":
            # Exact: Python integers, the difference rounded once to float64.
            exact = da.astype(object) - ra.astype(object)
            e0 = exact.astype(np.float64)
            fin = np.ones(n, bool)
            mis = np.array([v != 0 for v in exact], bool)
        else:
            e0 = d0 - r0
            fin = np.isfinite(r0) & np.isfinite(d0)
            mis = np.where(fin, np.abs(e0) > atol + rtol * np.abs(r0), ~(r0 == d0))
        r, d, e = r0[fin], d0[fin], e0[fin]
        nf = r.size
        diff = np.abs(e)
        fmis = mis[fin]
        errors = int(mis.sum())
        first = int(np.argmax(mis)) if errors else -1
        at = first if first >= 0 else 0
        counts = dict(
            ref_nan=int(np.isnan(r0).sum()), ref_inf=int(np.isinf(r0).sum()),
            dev_nan=int(np.isnan(d0).sum()), dev_inf=int(np.isinf(d0).sum()),
            fp16_overflow=int((np.isfinite(r0) & (np.abs(r0) > FP16_MAX)).sum())
            if ra.dtype.kind == "f" else 0,
            dev_fp16_overflow=int((np.isfinite(d0) & (np.abs(d0) > FP16_MAX)).sum())
            if da.dtype.kind == "f" else 0,
            finite_pairs=nf, both_nan=int((np.isnan(r0) & np.isnan(d0)).sum()),
            nonfinite_errors=int((mis & ~fin).sum()),
        )
        if nf == 0:
            vals: dict[str, Any] = dict.fromkeys(_STAT_FIELDS, nan)
        else:
            rel = diff / np.where(r == 0, REL_EPS, np.abs(r))
            r_zero, d_zero, e_zero = not r.any(), not d.any(), not e.any()
            if r_zero or d_zero:
                cosine = nan
            else:
                cosine = float(np.clip(np.dot(r, d) / (np.linalg.norm(r) * np.linalg.norm(d)),
                                       -1.0, 1.0))
            if np.ptp(r) == 0 or np.ptp(d) == 0:
                pearson = nan
            else:
                rc, dc = r - r.mean(), d - d.mean()
                pearson = float(np.clip(np.dot(rc, dc) / (np.linalg.norm(rc)
                                                          * np.linalg.norm(dc)), -1.0, 1.0))
            if r_zero or e_zero:
                sqnr = nan if r_zero and e_zero else -math.inf if r_zero else math.inf
                rel_euc = (nan if e_zero else math.inf) if r_zero else 0.0
            else:
                sqnr = float(10.0 * np.log10(np.sum(r * r) / np.sum(e * e)))
                rel_euc = float(np.linalg.norm(e) / np.linalg.norm(r))
            sr, sd = np.abs(r).sum(), np.abs(d).sum()
            if sr == 0 or sd == 0:
                kl = nan
            else:
                p = np.abs(r) / sr
                lr = np.log(np.maximum(np.abs(r), REL_EPS) / sr)
                lq = np.log(np.maximum(np.abs(d), REL_EPS) / sd)
                kl = max(float(np.sum(p * (lr - lq))), 0.0)
            vals = dict(
                max_abs_diff=float(diff.max()), mean_abs_diff=float(diff.mean()),
                max_rel_err=float(rel.max()), mean_rel_err=float(rel.mean()),
                ref_mean=float(r.mean()), ref_std=float(r.std()),
                ref_rms=float(np.sqrt(np.mean(r * r))), cosine=cosine,
                mse=float(np.mean(e * e)), rmse=float(np.sqrt(np.mean(e * e))),
                pearson=pearson, sqnr_db=sqnr, rel_euclidean=rel_euc, kl_div=kl,
                rel_err_lt_0_001=float(np.mean(rel < 0.001)),
                rel_err_lt_0_005=float(np.mean(rel < 0.005)),
            )
    if fmis.any():
        max_abs_err, mean_abs_err = float(diff[fmis].max()), float(diff[fmis].mean())
    else:
        max_abs_err = mean_abs_err = nan if errors else 0.0
    return NodeMetrics(
        total=n, errors=errors, first_mismatch_offset=first,
        first_mismatch_index=_unravel(first, shape) if len(shape) else (),
        shape=shape,
        ref_value=display_value(float(r0[at])) if n else nan,
        dev_value=display_value(float(d0[at])) if n else nan,
        max_abs_err=max_abs_err, mean_abs_err=mean_abs_err,
        atol=float(atol), rtol=float(rtol), **counts, **vals,
    )
