import json
import math
import os
import platform
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from layerdiff.analyzer.compare import kernel as K
from layerdiff.analyzer.compare import metrics as M

F32_MAX = float(np.finfo(np.float32).max)
FLOAT_FIELDS = [
    "max_abs_err", "mean_abs_err", "max_abs_diff", "mean_abs_diff", "max_rel_err",
    "mean_rel_err", "ref_mean", "ref_std", "ref_rms", "cosine", "mse", "rmse", "pearson",
    "sqnr_db", "rel_euclidean", "kl_div", "rel_err_lt_0_001", "rel_err_lt_0_005",
]
EXACT_FIELDS = [
    "total", "errors", "first_mismatch_offset", "first_mismatch_index", "shape", "ref_value",
    "dev_value", "max_abs_err", "max_abs_diff", "max_rel_err", "rel_err_lt_0_001",
    "rel_err_lt_0_005", "ref_nan", "ref_inf", "dev_nan", "dev_inf", "fp16_overflow",
    "dev_fp16_overflow", "finite_pairs", "both_nan", "nonfinite_errors", "atol", "rtol",
]
STAT_FIELDS = [
    "max_abs_diff", "mean_abs_diff", "max_rel_err", "mean_rel_err", "ref_mean", "ref_std",
    "ref_rms", "cosine", "mse", "rmse", "pearson", "sqnr_db", "rel_euclidean", "kl_div",
    "rel_err_lt_0_001", "rel_err_lt_0_005",
]


def same_float(a, b, rtol, atol=0.0):
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= atol + rtol * max(abs(a), abs(b))


def assert_exact_fields(a, b):
    for f in EXACT_FIELDS:
        va, vb = getattr(a, f), getattr(b, f)
        if isinstance(va, float):
            assert same_float(va, vb, 0.0), (f, va, vb)
        else:
            assert va == vb, (f, va, vb)


# ---------------------------------------------------------------------------
# Worked example
# ---------------------------------------------------------------------------


def test_hand_computed_example():
    # ref=[1,2,3,4], dev=[1,2,3.5,8], atol=0.005, rtol=0.2
    # |d-r| = [0, 0, 0.5, 4]; tol = 0.005 + 0.2|r| = [0.205, 0.405, 0.605, 0.805]
    # mismatch only at offset 3 (4 > 0.805); 0.5 < 0.605 passes.
    m = M.compare(np.array([1, 2, 3, 4], np.float32), np.array([1, 2, 3.5, 8], np.float32))
    assert (m.total, m.errors, m.first_mismatch_offset) == (4, 1, 3)
    assert m.first_mismatch_index == (3,) and m.shape == (4,)
    assert (m.ref_value, m.dev_value) == (4.0, 8.0)
    assert not m.passed
    assert m.max_abs_err == 4.0 and m.mean_abs_err == 4.0
    # all diffs: max 4, mean 4.5/4
    assert m.max_abs_diff == 4.0 and m.mean_abs_diff == pytest.approx(1.125)
    # rel = [0, 0, 0.5/3, 4/4] -> max 1, mean (1/6 + 1)/4 = 7/24
    assert m.max_rel_err == 1.0 and m.mean_rel_err == pytest.approx(7 / 24)
    # two of four have rel < 0.001 (and < 0.005)
    assert m.rel_err_lt_0_001 == 0.5 and m.rel_err_lt_0_005 == 0.5
    # mean 2.5; population var = (2.25+.25+.25+2.25)/4 = 1.25; rms = sqrt(30/4)
    assert m.ref_mean == 2.5
    assert m.ref_std == pytest.approx(math.sqrt(1.25), rel=1e-12)
    assert m.ref_rms == pytest.approx(math.sqrt(7.5), rel=1e-12)
    # <r,d> = 1+4+10.5+32 = 47.5; |r|^2 = 30; |d|^2 = 1+4+12.25+64 = 81.25
    assert m.cosine == pytest.approx(47.5 / math.sqrt(30 * 81.25), rel=1e-12)
    # sum (d-r)^2 = 0.25 + 16 = 16.25
    assert m.mse == pytest.approx(16.25 / 4, rel=1e-12)
    assert m.rmse == pytest.approx(math.sqrt(16.25 / 4), rel=1e-12)
    # centred r = [-1.5,-.5,.5,1.5]; mean d = 3.625, centred d = [-2.625,-1.625,-.125,4.375]
    # cov sum = 3.9375+0.8125-0.0625+6.5625 = 11.25; sum rc^2 = 5; sum dc^2 = 28.6875
    assert m.pearson == pytest.approx(11.25 / math.sqrt(5 * 28.6875), rel=1e-12)
    assert m.sqnr_db == pytest.approx(10 * math.log10(30 / 16.25), rel=1e-12)
    assert m.rel_euclidean == pytest.approx(math.sqrt(16.25 / 30), rel=1e-12)
    # P = [1,2,3,4]/10, Q = [1,2,3.5,8]/14.5:
    # KL = .3 ln(3/3.5) + .4 ln(4/8) + ln(14.5/10) = 0.0480595...
    kl = 0.3 * math.log(3 / 3.5) + 0.4 * math.log(0.5) + math.log(1.45)
    assert m.kl_div == pytest.approx(kl, abs=1e-6)
    assert (m.ref_nan, m.ref_inf, m.dev_nan, m.dev_inf) == (0, 0, 0, 0)
    assert (m.fp16_overflow, m.dev_fp16_overflow) == (0, 0)
    assert (m.finite_pairs, m.both_nan, m.nonfinite_errors) == (4, 0, 0)
    assert (m.atol, m.rtol) == (0.005, 0.2)


def test_as_dict_is_json_ready():
    m = M.compare(np.zeros((2, 3), np.float32), np.ones((2, 3), np.float32))
    d = m.as_dict()
    assert d["shape"] == [2, 3] and d["first_mismatch_index"] == [0, 0]
    json.dumps(d)
    back = M.NodeMetrics.from_dict(json.loads(json.dumps(d)))
    assert_exact_fields(back, m)
    for f in FLOAT_FIELDS:
        assert same_float(getattr(back, f), getattr(m, f), 0.0), f


def test_passing_node_reports_offset_zero_values():
    m = M.compare(np.array([2.0, 3.0], np.float32), np.array([2.001, 3.0], np.float32))
    assert m.passed and m.first_mismatch_offset == -1 and m.first_mismatch_index == ()
    assert m.ref_value == 2.0 and m.dev_value == float(np.float32(2.001))
    assert m.max_abs_err == 0.0 and m.mean_abs_err == 0.0


# ---------------------------------------------------------------------------
# Edge cases
# ---------------------------------------------------------------------------


def test_empty():
    m = M.compare(np.zeros((0, 3), np.float32), np.zeros(0, np.float16))
    assert m.total == 0 and m.errors == 0 and m.passed and m.shape == (0, 3)
    assert m.first_mismatch_offset == -1 and m.first_mismatch_index == ()
    assert math.isnan(m.ref_value) and math.isnan(m.dev_value)
    assert m.max_abs_err == 0.0 and m.mean_abs_err == 0.0
    assert (m.finite_pairs, m.both_nan, m.nonfinite_errors) == (0, 0, 0)
    for f in STAT_FIELDS:
        assert math.isnan(getattr(m, f)), f


def test_all_zero_both():
    # Nothing to compare a direction or a spread with: cosine, pearson, sqnr,
    # rel_euclidean and KL are undefined, not a perfect score.
    m = M.compare(np.zeros(10, np.float32), np.zeros(10, np.float32))
    assert m.passed and math.isnan(m.cosine) and math.isnan(m.pearson)
    assert math.isnan(m.sqnr_db) and math.isnan(m.rel_euclidean) and math.isnan(m.kl_div)
    assert m.mse == 0.0 and m.ref_std == 0.0 and m.max_rel_err == 0.0
    assert m.rel_err_lt_0_001 == 1.0 and m.finite_pairs == 10


def test_zero_ref_nonzero_dev():
    m = M.compare(np.zeros(4, np.float32), np.array([0, 0.001, 0, 1], np.float32))
    # |d| = [0, .001, 0, 1] vs tol 0.005 -> only the last mismatches
    assert m.errors == 1 and m.first_mismatch_offset == 3
    assert math.isnan(m.cosine) and math.isnan(m.kl_div)
    assert m.sqnr_db == -math.inf and m.rel_euclidean == math.inf
    # rel uses REL_EPS for r == 0: max rel = 1 / 1e-10
    assert m.max_rel_err == pytest.approx(1e10)
    assert math.isnan(m.pearson)  # reference is constant, device is not


def test_nonzero_ref_zero_dev():
    m = M.compare(np.array([1, 2], np.float32), np.zeros(2, np.float32))
    assert math.isnan(m.cosine) and math.isnan(m.kl_div) and math.isnan(m.pearson)
    assert m.rel_euclidean == 1.0 and m.sqnr_db == 0.0


def test_constant_tensors():
    eq = M.compare(np.full(100, 0.1, np.float32), np.full(100, 0.1, np.float32))
    assert math.isnan(eq.pearson) and eq.ref_std == 0.0 and eq.kl_div == 0.0
    assert eq.cosine == pytest.approx(1.0, abs=1e-15)
    assert eq.sqnr_db == math.inf and eq.rel_euclidean == 0.0
    ne = M.compare(np.full(100, 0.1, np.float32), np.full(100, 0.2, np.float32))
    assert math.isnan(ne.pearson) and ne.ref_std == 0.0
    assert ne.cosine == pytest.approx(1.0)
    # reference constant across many blocks (exercises the block merge)
    big = M.compare(np.full(10_000, 3.0, np.float32), np.full(10_000, 3.0, np.float16))
    assert math.isnan(big.pearson) and big.ref_std == 0.0 and big.passed
    # device constant, reference not
    m = M.compare(np.arange(50, dtype=np.float32), np.full(50, 7.0, np.float32))
    assert math.isnan(m.pearson)


def test_large_offset_small_spread_std():
    r = (1000.0 + np.arange(4096) % 3 * 1e-3).astype(np.float64)
    m = M.compare(r, r)
    assert m.ref_std == pytest.approx(float(np.std(r)), rel=1e-9)
    assert m.pearson == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("n", [5, 64, 5000])
def test_nan_inf_counts_and_pairs(n):
    r = np.linspace(-1, 1, n).astype(np.float32)
    d = r.copy()
    r[1] = np.nan
    d[2] = np.nan
    r[3] = d[3] = np.nan          # NaN on both sides: a mismatch all the same
    r[4] = np.inf
    d[4] = np.inf                 # the same infinity on both sides: equal
    m = M.compare(r, d)
    assert (m.ref_nan, m.dev_nan, m.ref_inf, m.dev_inf) == (2, 2, 1, 1)
    assert m.dev_fp16_overflow == 0 and m.fp16_overflow == 0
    assert (m.errors, m.nonfinite_errors, m.both_nan) == (3, 3, 1)
    assert m.finite_pairs == n - 4
    assert_exact_fields(m, M.reference_metrics(r, d))
    assert m.first_mismatch_offset == 1
    assert (m.ref_value, m.dev_value) == (0.0, float(d[1]))   # NaN shown as 0
    # the finite pairs agree exactly: no statistic sees the four others
    assert m.mse == 0.0 and m.max_abs_diff == 0.0
    assert math.isnan(m.max_abs_err) and math.isnan(m.mean_abs_err)
    if n > 6:
        assert m.cosine == pytest.approx(1.0, abs=1e-12)


def test_inf_against_finite():
    r = np.array([1.0, -np.inf, 2.0], np.float32)
    d = np.array([1.0, 5.0, np.inf], np.float32)
    m = M.compare(r, d)
    assert m.errors == 2 and m.nonfinite_errors == 2 and m.first_mismatch_offset == 1
    assert m.ref_value == -F32_MAX and m.dev_value == 5.0
    # only the pair (1, 1) is finite
    assert m.finite_pairs == 1 and m.max_abs_diff == 0.0 and m.mse == 0.0
    assert math.isnan(m.max_abs_err) and math.isnan(m.mean_abs_err)
    # an Inf is counted as Inf, not also as an FP16 overflow
    assert (m.ref_inf, m.dev_inf, m.dev_fp16_overflow) == (1, 1, 0)


def test_fp16_overflow_counts():
    r = np.array([65504.0, 65505.0, -70000.0, 1e30, np.inf, np.nan, 3.0], np.float32)
    d = np.array([65504.0, 1.0, -70000.0, 7.0, 1.0, 1.0, -1e6], np.float32)
    m = M.compare(r, d)
    # ref: finite with |r| > 65504 -> 65505, -70000, 1e30 (inf and nan excluded)
    assert m.fp16_overflow == 3
    # dev: -70000 and -1e6
    assert m.dev_fp16_overflow == 2
    d16 = np.array([np.inf, -np.inf, 1, 1, 1, 1, 1], np.float16)
    m16 = M.compare(r, d16)
    assert m16.dev_fp16_overflow == 0 and m16.dev_inf == 2
    m64 = M.compare(r.astype(np.float64), np.array([7e4, -1e300, np.inf, 0, 0, 0, 0]))
    assert (m64.fp16_overflow, m64.dev_fp16_overflow, m64.dev_inf) == (3, 2, 1)


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.uint16, np.int32,
                                   np.uint32, np.int64, np.uint64, np.bool_])
def test_integer_dtypes(dtype):
    rng = np.random.default_rng(1)
    r = rng.integers(0, 2 if dtype == np.bool_ else 100, 300).astype(dtype)
    d = r.copy()
    d[::7] = (d[::7] + 1) if dtype != np.bool_ else ~d[::7]
    m = M.compare(r, d)
    expect = M.reference_metrics(r, d)
    assert_exact_fields(m, expect)
    for f in FLOAT_FIELDS:
        assert same_float(getattr(m, f), getattr(expect, f), 1e-9, 1e-12), f
    # integers compare exactly: every changed element fails, however large
    assert m.errors == 43 and m.first_mismatch_offset == 0
    assert m.max_abs_err == 1.0 and m.finite_pairs == 300
    assert (m.fp16_overflow, m.dev_fp16_overflow) == (0, 0)
    # mixed with float: the float rules (with tolerance)
    m2 = M.compare(r.astype(np.float32), d)
    rf = r.astype(np.float64)
    assert m2.errors == int((np.abs(d.astype(np.float64) - rf) > 0.005 + 0.2 * rf).sum())


def test_int64_extremes():
    r = np.array([2**62, -(2**62), 0, 2**63 - 1, -(2**63)], np.int64)
    d = np.array([2**62, 0, 1, -(2**63), 2**63 - 1], np.int64)
    m = M.compare(r, d)
    assert_exact_fields(m, M.reference_metrics(r, d))
    assert m.errors == 4 and m.first_mismatch_offset == 1
    # |e| up to 2**64 - 1, rounded once
    assert m.max_abs_diff == float(2**64 - 1) and m.max_abs_err == float(2**64 - 1)


def test_size_mismatch():
    with pytest.raises(ValueError, match=r"6.*5|5.*6"):
        M.compare(np.zeros(6, np.float32), np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="6"):
        M.accumulate(np.zeros(6), np.zeros(5), 0)
    with pytest.raises(ValueError):
        M.worst_elements(np.zeros(6), np.zeros(5))


def test_multidim_first_mismatch_index_and_reshape():
    r = np.zeros((2, 3, 4), np.float32)
    d = np.zeros(24, np.float16)          # caller-reshaped device output
    d[1 * 12 + 2 * 4 + 3] = 1.0
    m = M.compare(r, d)
    assert m.shape == (2, 3, 4) and m.first_mismatch_offset == 23
    assert m.first_mismatch_index == (1, 2, 3)
    # non-contiguous input
    rt = np.arange(24, dtype=np.float32).reshape(4, 6).T
    m = M.compare(rt, rt + np.float32(1))
    assert m.shape == (6, 4) and m.first_mismatch_index == (0, 0)


def test_scalar_tensor():
    m = M.compare(np.float32(1.0), np.float32(2.0))
    assert m.total == 1 and m.shape == () and m.first_mismatch_offset == 0
    assert m.first_mismatch_index == ()


def test_custom_tolerances():
    r = np.array([1.0, 1.0], np.float32)
    d = np.array([1.0, 1.5], np.float32)
    assert M.compare(r, d, atol=0.0, rtol=0.6).passed
    m = M.compare(r, d, atol=0.0, rtol=0.4)
    assert m.errors == 1 and (m.atol, m.rtol) == (0.0, 0.4)


def test_tolerance_boundary_is_strict():
    # |d - r| == atol + rtol*|r| exactly is not a mismatch.
    r = np.array([0.0, 1.0], np.float64)
    d = np.array([0.5, 1.75], np.float64)
    m = M.compare(r, d, atol=0.5, rtol=0.25)
    assert m.errors == 0


# ---------------------------------------------------------------------------
# NaN, Inf and integers: the kernel against the definition spelled out here
# (independently of reference_metrics)
# ---------------------------------------------------------------------------


def _display(v):
    # ref_value / dev_value only: NaN shown as 0, +-Inf as +-float32 max
    if math.isnan(v):
        return 0.0
    return math.copysign(F32_MAX, v) if math.isinf(v) else v


def finite_pair_oracle(r, d, atol=M.ATOL_DEFAULT, rtol=M.RTOL_DEFAULT):
    """Every field the definition fixes, computed with numpy over the finite
    pairs; non-finite pairs mismatch unless both are the same infinity;
    integer tensors compare exactly."""
    nan = math.nan
    rf, df = np.asarray(r).reshape(-1), np.asarray(d).reshape(-1)
    x, y = rf.astype(np.float64), df.astype(np.float64)
    with np.errstate(all="ignore"):
        if rf.dtype.kind in "iub" and df.dtype.kind in "iub":
            exact = [int(b) - int(a) for a, b in zip(rf.tolist(), df.tolist())]
            e = np.array([float(v) for v in exact], np.float64)
            fin = np.ones(x.size, bool)
            mis = np.array([v != 0 for v in exact], bool)
        else:
            e = y - x
            fin = np.isfinite(x) & np.isfinite(y)
            same_inf = np.isinf(x) & (x == y)
            mis = np.where(fin, np.abs(e) > atol + rtol * np.abs(x), ~same_inf)
        errors = int(mis.sum())
        first = int(np.flatnonzero(mis)[0]) if errors else -1
        at = max(first, 0)
        out = dict(
            total=x.size, errors=errors, first_mismatch_offset=first,
            finite_pairs=int(fin.sum()), both_nan=int((np.isnan(x) & np.isnan(y)).sum()),
            nonfinite_errors=int((mis & ~fin).sum()),
            ref_value=_display(x[at]) if x.size else nan,
            dev_value=_display(y[at]) if x.size else nan,
            ref_nan=int(np.isnan(x).sum()), ref_inf=int(np.isinf(x).sum()),
            dev_nan=int(np.isnan(y).sum()), dev_inf=int(np.isinf(y).sum()),
            fp16_overflow=int((np.isfinite(x) & (np.abs(x) > 65504)).sum())
            if rf.dtype.kind == "f" else 0,
            dev_fp16_overflow=int((np.isfinite(y) & (np.abs(y) > 65504)).sum())
            if df.dtype.kind == "f" else 0,
        )
        xs, ys, es = x[fin], y[fin], e[fin]
        ae = np.abs(es)
        fm = mis[fin]
        out["max_abs_err"] = float(ae[fm].max()) if fm.any() else (nan if errors else 0.0)
        out["mean_abs_err"] = float(ae[fm].mean()) if fm.any() else (nan if errors else 0.0)
        if not fin.any():
            out.update(dict.fromkeys(STAT_FIELDS, nan))
            return out
        rel = ae / np.where(xs == 0, 1e-10, np.abs(xs))
        nr = math.sqrt(np.sum(xs * xs))
        nd = math.sqrt(np.sum(ys * ys))
        ne = math.sqrt(np.sum(es * es))
        if nr == 0 or nd == 0:
            cosine = nan
        else:
            cosine = float(np.sum(xs * ys)) / (nr * nd)
        if xs.min() == xs.max() or ys.min() == ys.max():
            pearson = nan
        else:
            pearson = float(np.corrcoef(xs, ys)[0, 1])
        if nr == 0 and ne == 0:
            sqnr = rel_euc = nan
        elif ne == 0:
            sqnr, rel_euc = math.inf, 0.0
        elif nr == 0:
            sqnr, rel_euc = -math.inf, math.inf
        else:
            sqnr, rel_euc = 20 * math.log10(nr / ne), ne / nr
        sr, sd = np.abs(xs).sum(), np.abs(ys).sum()
        if sr == 0 or sd == 0:
            kl = nan
        else:
            kl = max(0.0, float(np.sum(np.abs(xs) / sr * (
                np.log(np.maximum(np.abs(xs), 1e-10) / sr)
                - np.log(np.maximum(np.abs(ys), 1e-10) / sd)))))
        out.update(
            max_abs_diff=float(ae.max()), mean_abs_diff=float(ae.mean()),
            max_rel_err=float(rel.max()), mean_rel_err=float(rel.mean()),
            ref_mean=float(xs.mean()), ref_std=float(xs.std()),
            ref_rms=float(np.sqrt(np.mean(xs * xs))), cosine=cosine,
            mse=float(np.mean(es * es)), rmse=float(np.sqrt(np.mean(es * es))),
            pearson=pearson, sqnr_db=sqnr, rel_euclidean=rel_euc, kl_div=kl,
            rel_err_lt_0_001=float(np.mean(rel < 0.001)),
            rel_err_lt_0_005=float(np.mean(rel < 0.005)),
        )
    return out


ORACLE_EXACT = ("total", "errors", "first_mismatch_offset", "finite_pairs", "both_nan",
                "nonfinite_errors", "ref_value", "dev_value", "max_abs_err", "max_abs_diff",
                "max_rel_err", "rel_err_lt_0_001", "rel_err_lt_0_005", "ref_nan", "ref_inf",
                "dev_nan", "dev_inf", "fp16_overflow", "dev_fp16_overflow")


def assert_matches_oracle(m, r, d, atol=M.ATOL_DEFAULT, rtol=M.RTOL_DEFAULT):
    want = finite_pair_oracle(r, d, atol, rtol)
    fast = is_fast(np.asarray(r), np.asarray(d))
    scale, peak = data_scale(r), data_peak(r)
    for f, w in want.items():
        g = getattr(m, f)
        if f in ORACLE_EXACT:
            assert same_float(float(g), float(w), 0.0), (f, g, w)
        else:
            assert float_field_ok(f, g, w, fast, scale, peak), (f, g, w)
    assert m.passed == (want["errors"] == 0)
    return want


def _blocky(dtype_r=np.float32, dtype_d=np.float32, seed=43):
    """Three blocks and a bit, with NaN / Inf at block ends and starts."""
    rng = np.random.default_rng(seed)
    n = 3 * 2048 + 5
    r = rng.standard_normal(n) * 4
    d = r + rng.standard_normal(n) * 0.05
    r[0] = np.nan                      # first element of the tensor / block 0
    d[2047] = np.inf                   # last of block 0
    r[2048] = d[2048] = np.nan         # first of block 1, NaN on both sides
    r[4095] = d[4095] = -np.inf        # last of block 1, equal
    d[4096] = -np.inf                  # first of block 2
    r[4096] = np.inf
    r[6144] = np.nan                   # first of the short last block
    d[n - 1] = np.nan
    with np.errstate(all="ignore"):
        return r.astype(dtype_r), d.astype(dtype_d)


def _block_of_nan():
    r = np.linspace(-3, 3, 3 * 2048, dtype=np.float32)
    d = r.copy()
    d[2048:4096] = np.nan              # a whole block with no finite pair
    return r, d


def _edge_cases():
    f32, f16, f64 = np.float32, np.float16, np.float64
    nan, inf = np.nan, np.inf

    def a(v, t=f32):
        return np.array(v, t)

    r_bl, d_bl = _blocky()
    r_bn, d_bn = _block_of_nan()
    return {
        # a device NaN where the reference is 0 fails; the rest is judged alone
        "dev_nan_vs_ref_zero": (a([0, 1, 2, 3]), a([nan, 1.1, 2, 3]),
                                dict(errors=1, first_mismatch_offset=0, finite_pairs=3,
                                     nonfinite_errors=1, ref_value=0.0, dev_value=0.0)),
        "nan_both_sides": (a([nan, 1, 2]), a([nan, 1, 2]),
                           dict(errors=1, both_nan=1, nonfinite_errors=1, mse=0.0)),
        "one_dev_nan_in_4": (a([1, 2, 3, 4]), a([1, 2, 3, nan]),
                             dict(errors=1, first_mismatch_offset=3, finite_pairs=3)),
        "dev_inf_next_to_7e4": (a([7e4, 1, 2]), a([inf, 1, 2]),
                                dict(errors=1, first_mismatch_offset=0, fp16_overflow=1,
                                     dev_fp16_overflow=0, dev_inf=1, dev_value=F32_MAX)),
        "same_inf_both": (a([inf, -inf, 1, 2]), a([inf, -inf, 1, 2]),
                          dict(errors=0, finite_pairs=2, mse=0.0, max_abs_diff=0.0)),
        "pos_inf_vs_neg_inf": (a([inf, 1, 2]), a([-inf, 1, 2]),
                               dict(errors=1, nonfinite_errors=1, finite_pairs=2)),
        "inf_vs_nan": (a([inf, 1, 2]), a([nan, 1, 2]), dict(errors=1, both_nan=0)),
        "all_nan": (a([nan] * 5), a([nan] * 5),
                    dict(errors=5, both_nan=5, finite_pairs=0, max_abs_err=nan,
                         mean_abs_err=nan, **dict.fromkeys(STAT_FIELDS, nan))),
        "all_nonfinite_pairs": (a([nan, inf, -inf, 1]), a([1, 1, -inf, nan]),
                                dict(errors=3, finite_pairs=0, cosine=nan, mse=nan)),
        "empty": (a([]), a([], f16), dict(errors=0, finite_pairs=0, cosine=nan)),
        "constant": (np.full(3000, 0.7, f32), np.full(3000, 0.7, f32),
                     dict(errors=0, pearson=nan, ref_std=0.0, mse=0.0, sqnr_db=math.inf)),
        "all_zero": (np.zeros(3000, f32), np.zeros(3000, f16),
                     dict(errors=0, cosine=nan, pearson=nan, sqnr_db=nan,
                          rel_euclidean=nan, kl_div=nan, mse=0.0)),
        "int64_beyond_2_53": (a([2**60 + 1, 3, 2**53 + 1], np.int64),
                              a([2**60, 3, 2**53], np.int64),
                              dict(errors=2, first_mismatch_offset=0, max_abs_diff=1.0,
                                   max_abs_err=1.0, mean_abs_err=1.0)),
        "uint64_vs_int64": (a([2**63, 5, 2**64 - 1, 0], np.uint64), a([-1, 5, -1, 0], np.int64),
                            dict(errors=2, first_mismatch_offset=0,
                                 max_abs_diff=float(2**64), ref_value=float(2**63),
                                 dev_value=-1.0)),
        "bool": (a([True, False, True, False], np.bool_), a([True, True, False, False], np.bool_),
                 dict(errors=2, first_mismatch_offset=1, fp16_overflow=0)),
        "bool_vs_uint8": (a([True, False, True], np.bool_), a([1, 0, 2], np.uint8),
                          dict(errors=1, first_mismatch_offset=2)),
        "ints_no_tolerance": (a([100, -7, 100000], np.int32), a([101, -7, 100000], np.int64),
                              dict(errors=1, fp16_overflow=0, dev_fp16_overflow=0)),
        "int_vs_float_nan": (a([1, 2, 70000], np.int32), a([1, nan, 70000.5]),
                             dict(errors=1, nonfinite_errors=1, fp16_overflow=0,
                                  dev_fp16_overflow=1)),
        "f16_vs_f32": (a([1, nan, inf, -2, 0.5], f16), a([1, 1, inf, -2.2, 0.5]),
                       dict(errors=1, first_mismatch_offset=1)),
        "f32_vs_f16": (a([1, 70000, inf, -2, 0.5]), a([1, inf, inf, -2.2, nan], f16),
                       dict(errors=2, fp16_overflow=1, dev_fp16_overflow=0)),
        "f64_vs_f32": (a([1e30, nan, 3, -inf], f64), a([1e30, 3, 3, -inf]),
                       dict(errors=1, fp16_overflow=1, dev_fp16_overflow=1)),
        "block_boundaries_f32": (r_bl, d_bl, dict(first_mismatch_offset=0, both_nan=1)),
        "block_boundaries_f16_dev": (r_bl, d_bl.astype(f16), dict(both_nan=1)),
        "block_boundaries_f16_ref": (r_bl.astype(f16), d_bl, dict(both_nan=1)),
        "block_boundaries_f64": (r_bl.astype(f64), d_bl.astype(f64), dict(both_nan=1)),
        "block_without_finite_pair": (r_bn, d_bn, dict(errors=2048, finite_pairs=4096,
                                                       first_mismatch_offset=2048)),
    }


EDGE_CASES = _edge_cases()


@pytest.mark.parametrize("name", sorted(EDGE_CASES))
def test_nonfinite_and_integer_edge_cases(name):
    r, d, expect = EDGE_CASES[name]
    m = M.compare(r, d)
    assert_matches_oracle(m, r, d)
    for f, v in expect.items():
        assert same_float(float(getattr(m, f)), float(v), 0.0), (f, getattr(m, f), v)
    n = r.size
    cut_sets = [[], [n // 2], list(range(1, n))] if n <= 8 else \
        [[2048], [2047, 2049], [1, 2048, 4096, 4097], [100, 2500, 6000, 6144]]
    for cuts in cut_sets:
        c = chunked(r, d, [k for k in cuts if k <= n])
        assert_matches_oracle(c, r, d)
        assert_same_result(c, m, data_scale(r), is_fast(r, d), data_peak(r))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_block_shift_skips_nonfinite_first_element(dtype):
    # A large mean with a small spread keeps its std only when the moments
    # are taken about a value of the data: when a block starts with NaN or
    # Inf the shift must come from a finite pair of the block.
    n = 3 * 2048
    r = (1000.0 + np.arange(n) % 3 * 1e-3).astype(dtype)
    d = r.copy()
    for at, (x, y) in zip((0, 2048, 4096), ((np.nan, 1.0), (np.inf, np.inf), (1.0, -np.inf))):
        r[at], d[at] = x, y
    fin = np.isfinite(r) & np.isfinite(d)
    want = float(np.std(r[fin].astype(np.float64)))
    for m in (M.compare(r, d), chunked(r, d, [1, 2049, 4097])):
        assert m.ref_std == pytest.approx(want, rel=1e-9 if dtype == np.float64 else 1e-3)
        assert m.finite_pairs == n - 3 and m.errors == 2 and m.mse == 0.0
        assert m.pearson == pytest.approx(1.0, abs=1e-9)


def test_int_difference_rounding_matches_python():
    # |d - r| of integers up to 2**64 + 2**63, rounded once (ties to even)
    rng = np.random.default_rng(47)
    u = np.concatenate([rng.integers(0, 2**63, 2000, dtype=np.uint64) * np.uint64(2)
                        + rng.integers(0, 2, 2000, dtype=np.uint64),
                        np.array([2**64 - 1, 2**64 - 2**11, 2**64 - 2**11 - 1, 2**63 + 2**11,
                                  2**63 + 2**10, 2**63 + 3 * 2**10, 2**53 + 1], np.uint64)])
    i = np.concatenate([rng.integers(-2**63, 2**63 - 1, 2000, dtype=np.int64),
                        np.array([-2**63, -2**63 + 1, -2**11, -1, -2**10 - 1, 0, -1], np.int64)])
    rows = M.worst_elements(u, i, count=u.size)
    m = M.compare(u, i)
    exact = [abs(int(b) - int(a)) for a, b in zip(u.tolist(), i.tolist())]
    assert m.errors == sum(v != 0 for v in exact)
    assert m.max_abs_diff == float(max(exact))
    assert m.mean_abs_diff == pytest.approx(sum(float(v) for v in exact) / len(exact), rel=1e-12)
    got = {row[0]: row[3] for row in rows}
    for k, v in enumerate(exact):
        if v:
            assert got[k] == float(v), (k, u[k], i[k])
    for a, b in ((i, i[::-1].copy()), (u, u[::-1].copy())):
        mm = M.compare(a, b)
        ex = [abs(int(y) - int(x)) for x, y in zip(a.tolist(), b.tolist())]
        assert mm.max_abs_diff == float(max(ex)) and mm.errors == sum(v != 0 for v in ex)


# ---------------------------------------------------------------------------
# The fast kernel against the reference definition
# ---------------------------------------------------------------------------


# float32/float16 pairs take the float32 kernel: every sum over elements is
# accumulated in float32 for <= 32 terms per lane before being widened, so
# sums carry a relative error of at most ~2e-6 (module docstring); counts,
# offsets and maxima stay exact.
FAST_RTOL = 1e-5


def is_fast(r, d):
    return r.dtype in (np.float32, np.float16) and d.dtype in (np.float32, np.float16)


def float_field_ok(f, a, b, fast, scale, peak):
    """Whether metric ``f`` of a result agrees with another (``b``)."""
    if f in ("ref_mean", "ref_std"):
        # sums with cancellation: absolute error relative to the data scale
        # (on the fast path: to the largest magnitude, which the per-block
        # shift may be)
        return same_float(a, b, FAST_RTOL if fast else 1e-9,
                          FAST_RTOL * peak if fast else 1e-12 * scale)
    if f == "kl_div":
        # float32 log of the ratio on the fast path (see module doc)
        return same_float(a, b, 1e-5, 5e-6 if fast else 1e-9)
    if f in ("cosine", "pearson"):
        return same_float(a, b, 1e-9, 1e-6 if fast else 1e-9)
    if f == "sqnr_db":
        return same_float(a, b, 1e-9, 1e-4 if fast else 1e-8)
    return same_float(a, b, FAST_RTOL if fast else 1e-9, 1e-300)


def finite_ref(r):
    rr = np.asarray(r).reshape(-1).astype(np.float64)
    return rr[np.isfinite(rr)]


def data_peak(r):
    rr = finite_ref(r)
    return float(np.max(np.abs(rr))) if rr.size else 0.0


def check_against_reference(r, d, atol=M.ATOL_DEFAULT, rtol=M.RTOL_DEFAULT):
    m = M.compare(r, d, atol, rtol)
    e = M.reference_metrics(r, d, atol, rtol)
    assert_exact_fields(m, e)
    fast = is_fast(r, d)
    scale, peak = data_scale(r), data_peak(r)
    for f in FLOAT_FIELDS:
        a, b = getattr(m, f), getattr(e, f)
        assert float_field_ok(f, a, b, fast, scale, peak), (f, a, b)
    return m


def test_kernel_matches_reference_across_block_boundaries():
    rng = np.random.default_rng(7)
    for n in (1, 7, 8, 9, 15, 16, 17, 2047, 2048, 2049, 4096 + 13, 3 * 2048 + 5):
        r = (rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3, n)).astype(np.float32)
        d = (r * (1 + rng.standard_normal(n) * 0.1) + rng.standard_normal(n) * 1e-3)
        check_against_reference(r, d.astype(np.float32))
        check_against_reference(r, d.astype(np.float16))
        check_against_reference(r.astype(np.float16), d.astype(np.float32))


def test_special_values_in_some_blocks_only():
    rng = np.random.default_rng(3)
    n = 5 * 2048 + 3
    r = rng.standard_normal(n).astype(np.float32)
    d = (r + rng.standard_normal(n).astype(np.float32) * 0.01).astype(np.float32)
    r[2048 + 5] = np.nan
    d[4 * 2048 + 1] = np.inf
    r[3 * 2048 + 100] = 1e6          # > 65504: careful path for that block
    r[n - 1] = 1e-40                 # float32 subnormal reference
    d[100] = 0.0
    r[200] = 0.0
    check_against_reference(r, d)
    check_against_reference(r, d.astype(np.float16))


# Integers that float64 cannot tell apart, the int64/uint64 extremes and
# their neighbours.
BIG_INTS = [0, 1, -1, 2**53, 2**53 + 1, 2**60, 2**60 + 1, 2**62, 2**63 - 1, 2**63,
            2**64 - 1, -(2**63), -(2**63) + 1, -(2**60) - 1]


def _tensor_pairs():
    dtypes = st.sampled_from([np.float32, np.float16, np.float64, np.int8, np.int32,
                              np.int64, np.uint8, np.uint64, np.bool_])

    @st.composite
    def pair(draw):
        shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=40))
        rdt, ddt = draw(dtypes), draw(dtypes)
        base = draw(st.sampled_from(["normal", "wide", "ints", "special", "sprinkled",
                                     "bigints"]))
        n = int(np.prod(shape))
        seed = draw(st.integers(0, 2**32 - 1))
        rng = np.random.default_rng(seed)
        kind = draw(st.sampled_from(["close", "noisy", "independent", "equal"]))
        if base == "bigints":
            r = [BIG_INTS[i] for i in rng.integers(0, len(BIG_INTS), n)]
            if kind == "close":
                d = [v + int(k) for v, k in zip(r, rng.integers(-1, 2, n))]
            elif kind == "noisy":
                d = [v + int(k) for v, k in zip(r, rng.integers(-1000, 1001, n))]
            elif kind == "independent":
                d = [BIG_INTS[i] for i in rng.integers(0, len(BIG_INTS), n)]
            else:
                d = list(r)

            def cast(x, dt):
                dt = np.dtype(dt)
                if dt.kind == "b":
                    return np.array([v > 0 for v in x], bool).reshape(shape)
                if dt.kind in "iu":
                    info = np.iinfo(dt)
                    x = [min(max(v, int(info.min)), int(info.max)) for v in x]
                    return np.array(x, dt).reshape(shape)
                with np.errstate(all="ignore"):
                    return np.array([float(v) for v in x], np.float64).astype(dt).reshape(shape)

            return cast(r, rdt), cast(d, ddt)
        if base == "normal":
            r = rng.standard_normal(n)
        elif base == "wide":
            r = rng.standard_normal(n) * 10.0 ** rng.uniform(-8, 6, n)
        elif base in ("ints", "sprinkled"):
            r = rng.integers(-5, 6, n).astype(np.float64) if base == "ints" \
                else rng.standard_normal(n) * 3
        else:
            r = rng.choice([0.0, -0.0, 1.0, -2.5, 65504.0, 7e4, 1e-30, 1e38, np.nan,
                            np.inf, -np.inf], n)
        if kind == "close":
            d = r * (1 + rng.standard_normal(n) * 1e-3)
        elif kind == "noisy":
            d = r + rng.standard_normal(n) * draw(st.sampled_from([1e-4, 0.1, 10.0]))
        elif kind == "independent":
            d = rng.choice([0.0, 3.0, np.nan, np.inf, -1.0, 1e5], n) if base == "special" \
                else rng.standard_normal(n)
        else:
            d = r.copy()
        if base == "sprinkled" and n:
            # NaN / Inf on either side or both, anywhere (block starts and
            # ends included when the tensor spans several blocks)
            specials = np.array([np.nan, np.inf, -np.inf])
            for x in (r, d):
                at = rng.integers(0, n, rng.integers(1, 1 + max(1, n // 50)))
                x[at] = specials[rng.integers(0, 3, at.size)]
            both = rng.integers(0, n, rng.integers(0, 4))
            r[both] = d[both] = specials[rng.integers(0, 3, both.size)]
            starts = np.arange(0, n, 2048)
            pick = starts[rng.random(starts.size) < 0.5]
            r[pick] = specials[rng.integers(0, 3, pick.size)]

        def cast(x, dt):
            with np.errstate(all="ignore"):
                if np.dtype(dt).kind in "iub":
                    x = np.nan_to_num(x, nan=0, posinf=0, neginf=0)
                    if dt == np.bool_:
                        return (x > 0.5).reshape(shape)
                    info = np.iinfo(dt)
                    lo, hi = max(int(info.min), -2**62), min(int(info.max), 2**62)
                    return np.clip(np.round(x), lo, hi).astype(dt).reshape(shape)
                return x.astype(dt).reshape(shape)

        return cast(r, rdt), cast(d, ddt)

    return pair()


@settings(max_examples=250, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(_tensor_pairs(), st.sampled_from([(0.005, 0.2), (0.0, 0.0), (1e-3, 1e-3), (1.0, 0.0)]))
def test_kernel_matches_reference_random(pair, tol):
    r, d = pair
    check_against_reference(r, d.reshape(-1), *tol)


# ---------------------------------------------------------------------------
# Chunked form
# ---------------------------------------------------------------------------


def chunked(r, d, cuts, atol=M.ATOL_DEFAULT, rtol=M.RTOL_DEFAULT, order=None):
    rf, df = r.reshape(-1), d.reshape(-1)
    bounds = [0] + sorted(cuts) + [rf.size]
    accs = [M.accumulate(rf[a:b], df[a:b], a, atol, rtol) for a, b in zip(bounds, bounds[1:])]
    if order is not None:
        accs = [accs[i] for i in order]
    # through the wire format
    accs = [M.Accumulator.from_dict(json.loads(json.dumps(a.to_dict()))) for a in accs]
    return M.finalize(M.merge(accs), r.shape)


def data_scale(r):
    rr = finite_ref(r)
    return float(np.sqrt(np.mean(rr * rr))) if rr.size else 0.0


def assert_same_result(a, b, scale=0.0, fast=False, peak=0.0):
    assert_exact_fields(a, b)
    for f in FLOAT_FIELDS:
        va, vb = getattr(a, f), getattr(b, f)
        if fast:
            # float32 partial sums: chunk boundaries move the block
            # boundaries, so sums agree to the fast path's accuracy only
            ok = float_field_ok(f, va, vb, True, scale, peak)
        else:
            # the mean and std can cancel (e.g. +-float32 max): judge them
            # against the data scale, everything else relative to itself
            atol = {"ref_mean": 1e-12 * scale, "ref_std": 1e-12 * scale, "sqnr_db": 1e-8,
                    "kl_div": 1e-10}.get(f, 1e-12)
            ok = same_float(va, vb, 1e-9, atol)
        assert ok, (f, va, vb)


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(_tensor_pairs(), st.data())
def test_chunked_equals_whole(pair, data):
    r, d = pair
    n = r.size
    cuts = data.draw(st.lists(st.integers(0, n), max_size=6)) if n else []
    k = len(cuts) + 1
    order = data.draw(st.permutations(range(k)))
    assert_same_result(chunked(r, d, cuts, order=order), M.compare(r, d), data_scale(r),
                       is_fast(r, d), data_peak(r))


def test_chunked_large_random_cuts():
    rng = np.random.default_rng(11)
    n = 50_000
    r = (rng.standard_normal(n) * 3).astype(np.float32)
    d = (r + rng.standard_normal(n) * 0.5).astype(np.float16)
    r[rng.integers(0, n, 20)] = np.nan
    whole = M.compare(r.reshape(50, 1000), d)
    for _ in range(5):
        cuts = list(rng.integers(0, n, rng.integers(1, 30)))
        order = list(rng.permutation(len(cuts) + 1))
        assert_same_result(chunked(r.reshape(50, 1000), d, cuts, order=order), whole,
                           data_scale(r), True, data_peak(r))


def test_merge_empty_and_tolerance_checks():
    a = M.accumulate(np.ones(3), np.ones(3), 0)
    assert_same_result(M.finalize(M.merge([a, M.Accumulator()]), (3,)),
                       M.compare(np.ones(3), np.ones(3)))
    assert M.merge([]).n == 0
    with pytest.raises(ValueError):
        M.merge([a, M.accumulate(np.ones(3), np.ones(3), 3, rtol=0.5)])
    with pytest.raises(ValueError):
        M.finalize(a, (4,))


# ---------------------------------------------------------------------------
# worst_elements
# ---------------------------------------------------------------------------


def test_worst_elements_order_and_limit():
    r = np.zeros(10, np.float32)
    d = np.array([0, 5, 1, 5, 0.001, 9, -9, 2, 0, 3], np.float32)
    rows = M.worst_elements(r, d, 0.005, 0.2, count=4)
    # abs diffs: 9 (idx 5), 9 (idx 6), 5 (1), 5 (3), 3 (9), 2 (7), 1 (2); ties by index
    assert [row[0] for row in rows] == [5, 6, 1, 3]
    i, rv, dv, ad, rel = rows[1]
    assert (rv, dv, ad) == (0.0, -9.0, 9.0) and rel == pytest.approx(9.0 / 1e-10)
    allrows = M.worst_elements(r, d, 0.005, 0.2, count=100)
    assert [row[0] for row in allrows] == [5, 6, 1, 3, 9, 7, 2]
    assert M.worst_elements(r, r) == []
    assert M.worst_elements(r, d, count=0) == []


def worst_by_sort(r, d, atol=M.ATOL_DEFAULT, rtol=M.RTOL_DEFAULT):
    """Indices of every mismatch in worst_elements order: non-finite pairs
    by index, then finite ones by |d - r| descending, then index."""
    rr, dd = r.reshape(-1).astype(np.float64), d.reshape(-1).astype(np.float64)
    with np.errstate(all="ignore"):
        diff = np.abs(dd - rr)
        fin = np.isfinite(rr) & np.isfinite(dd)
        mis = np.where(fin, diff > atol + rtol * np.abs(rr), ~(rr == dd))
    return sorted(np.flatnonzero(mis), key=lambda i: (1, -diff[i], i) if fin[i] else (0, 0, i))


def test_worst_elements_matches_sort():
    rng = np.random.default_rng(5)
    r = rng.standard_normal(20_000).astype(np.float32)
    d = (r + rng.standard_normal(r.size) * 0.3).astype(np.float16)
    d[::97] = np.float16(1.0)
    r[3] = np.nan
    d[5000] = np.inf
    r[7000] = d[7000] = -np.inf          # equal: not a row
    r[9000] = d[9000] = np.nan           # a row
    rows = M.worst_elements(r, d, count=128)
    order = worst_by_sort(r, d)
    assert [row[0] for row in rows] == order[:128]
    assert [row[0] for row in rows[:3]] == [3, 5000, 9000]
    rr, dd = r.astype(np.float64), d.astype(np.float64)
    for i, rv, dv, ad, rel in rows[3:8]:
        assert (rv, dv, ad) == (rr[i], dd[i], abs(dd[i] - rr[i]))
        assert rel == ad / (abs(rr[i]) if rr[i] != 0 else 1e-10)
    m = M.compare(r, d)
    assert m.errors == len(order) and m.nonfinite_errors == 3
    assert sorted(rows, key=M.worst_row_key) == rows


@pytest.mark.parametrize("dtypes", [(np.float32, np.float16), (np.float32, np.float32), (np.float64, np.float64)])
def test_worst_elements_past_a_full_heap_are_those_a_sort_finds(dtypes):
    """Once the kept rows are full, the search passes over stretches where
    nothing would be kept: what lies past them is still found (a larger
    error far along, a NaN or Inf after thousands of finite pairs) and a
    tie with the least kept row found later stays out, as a sort orders
    them; where every kept row is NaN or Inf, no later pair enters."""
    rng = np.random.default_rng(9)
    n = 50_000
    r = rng.standard_normal(n).astype(dtypes[0])
    d = (r.astype(np.float64) + np.round(rng.standard_normal(n) * 8) / 8).astype(dtypes[1])   # ties aplenty
    d[41_234] = d[41_234] + 100           # the worst finite pair, far along
    d[47_000] = np.nan                    # non-finite, late
    r[49_999] = np.inf
    for count in (16, 128):
        rows = M.worst_elements(r, d, count=count)
        assert [row[0] for row in rows] == worst_by_sort(r, d)[:count]
        assert rows[0][0] == 47_000 and rows[2][0] == 41_234
    r2, d2 = r.copy(), d.copy()
    d2[:8] = np.nan                       # the first eight pairs fill a heap of eight
    rows = M.worst_elements(r2, d2, count=8)
    assert [row[0] for row in rows] == list(range(8)) == worst_by_sort(r2, d2)[:8]


def _edge_pairs(rng, n: int, atol: float, rtol: float, dev_type) -> tuple[np.ndarray, np.ndarray]:
    """Pairs a float32 decision could get wrong, one to a stretch of 200
    that agrees otherwise (a block the search passes over unless that one
    pair may mismatch): errors a step or two of the device type either side
    of the tolerance, magnitudes near float32's largest (their difference
    overflows float32) and subnormals; a NaN and a large error too."""
    with np.errstate(all="ignore"):   # float16 holds none of the largest: Inf (and Inf - Inf) there
        r = (rng.standard_normal(n) * np.exp2(rng.integers(-20, 20, n))).astype(dev_type).astype(np.float32)
        at = np.arange(rng.integers(0, 200), n, 200)
        r[at[::7]] = rng.choice([3.0e38, -3.0e38, 1e-40, -1e-42, 0.0], at[::7].size)
        d = r.astype(dev_type)
        tol = atol + rtol * np.abs(r[at].astype(np.float64))
        edge = (r[at] + np.where(rng.random(at.size) < 0.5, tol, -tol)).astype(dev_type)
        step = rng.integers(-2, 3, at.size)
        for _ in range(2):
            edge = np.where(step > 0, np.nextafter(edge, dev_type(np.inf)), edge)
            edge = np.where(step < 0, np.nextafter(edge, dev_type(-np.inf)), edge)
            step = step - np.sign(step)
        d[at] = edge
        big = at[np.abs(r[at]) > 1e38]
        d[big[::2]] = -r[big[::2]]             # |d - r| beyond float32's range
    d[n // 2] = r[n // 2] + 7
    d[n // 2 + 5000] = np.nan
    return r, d


@pytest.mark.parametrize("dev_type", [np.float32, np.float16])
@pytest.mark.parametrize("atol, rtol", [(0.005, 0.2), (0.0, 1e-3), (1e-40, 0.5), (1e-3, 0.0)])
def test_worst_elements_led_by_float32_marks_miss_nothing(dev_type, atol, rtol):
    """float32 and float16 tensors are searched only in the blocks their
    metric pass (float32 lanes, float64 where a block may mismatch) marks:
    at the edge of the tolerance, past float32's range, among subnormals,
    with the kept rows full or never filled, the rows are still exactly
    those a sort in float64 finds, whether the marks are handed over or
    made by the search itself."""
    rng = np.random.default_rng(23)
    r, d = _edge_pairs(rng, 200_000, atol, rtol, dev_type)
    order = worst_by_sort(r, d, atol, rtol)
    assert len(order) > 300        # the edge pairs mismatch about half the time
    marks = M.block_marks(r, d)
    M.compare(r, d, atol, rtol, marks)
    for count in (8, 128, len(order) + 10):      # the kept rows full, and never filled
        rows = M.worst_elements(r, d, atol, rtol, count=count)
        assert [row[0] for row in rows] == order[:count]
        # the same, led by the marks the metric pass left: the blocks it names alone are read
        assert repr(M.worst_elements(r, d, atol, rtol, count=count, marks=marks)) == repr(rows)    # NaN too


@pytest.mark.parametrize("dtypes", [(np.float32, np.float16), (np.float16, np.float32), (np.float32, np.float32)])
def test_worst_elements_led_by_the_metric_pass_marks_are_a_sorts(dtypes):
    """The metric pass marks each block with its worst mismatch (or NaN
    and Inf, or none); the search reads only blocks that could enter: the
    rows are those of a sort whatever lies where (ties, a non-finite pair
    after a full heap, a tensor with no mismatch, a partial last block)."""
    rng = np.random.default_rng(31)
    n = 3 * 2048 * 7 + 1234
    r = rng.standard_normal(n).astype(dtypes[0])
    d = (r.astype(np.float64) + np.round(rng.standard_normal(n) * 4) / 4).astype(dtypes[1])   # ties aplenty
    d[20_000] = d[20_000] + 50
    d[-3] = np.nan                        # in the partial last block
    r[30_000] = np.inf
    for a, b in ((r, d), (r, r.astype(dtypes[1])), (r[:100], d[:100])):
        marks = M.block_marks(a, b)
        assert marks is not None and marks.size == -(-a.size // 2048)
        m = M.compare(a, b, marks=marks)
        want = worst_by_sort(a, b)
        assert m.errors == len(want)
        for count in (1, 16, 128, len(want) + 1):
            assert [row[0] for row in M.worst_elements(a, b, count=count, marks=marks)] == want[:count]
    assert M.block_marks(r.astype(np.float64), d.astype(np.float64)) is None    # float64 pairs: no marks
    size = M.block_marks(r, d).size
    for wrong in (np.empty(size - 1), np.empty(size, np.float32), np.empty(2 * size)[::2]):
        with pytest.raises(ValueError, match="block_marks"):
            M.compare(r, d, marks=wrong)        # never written past its end
        with pytest.raises(ValueError, match="block_marks"):
            M.worst_elements(r, d, marks=wrong)


def test_a_block_whose_worst_barely_beats_the_kept_rows_is_read():
    """Once 128 rows are kept, a later block is read when its worst
    mismatch beats the least kept one by any amount (a float32 step here),
    and passed over when it only ties it."""
    n = 60 * 2048
    r = np.zeros(n, np.float32)
    d = (1 - np.arange(n) * 2.0 ** -22).astype(np.float32)    # every error smaller than the one before
    d[50 * 2048 + 7] = d[126]      # later, beats the 128th worst (d[127]) by one float32 step
    d[55 * 2048 + 3] = d[127]      # ties it: a sort puts it after, out of the first 128
    rows = M.worst_elements(r, d, count=128)
    assert [row[0] for row in rows] == worst_by_sort(r, d)[:128]
    assert 50 * 2048 + 7 in [row[0] for row in rows] and 55 * 2048 + 3 not in [row[0] for row in rows]


def test_a_tie_with_the_least_kept_row_in_an_earlier_block_is_kept():
    """The worst rows lie late in the tensor and are found first; an
    earlier block whose worst only ties the 128th of them still holds a
    row that a sort puts before it (equal errors go by index), and so does
    a block of a NaN, whose mark is the worst of all."""
    n = 60 * 2048
    r = np.zeros(n, np.float32)
    d = np.full(n, 2.0 ** -10, np.float32)
    d[40 * 2048:40 * 2048 + 200] = 1 - np.arange(200, dtype=np.float32) * 2.0 ** -20    # the worst, late
    d[30 * 2048 + 1] = np.nan                  # first of the 128 rows
    d[3 * 2048 + 11] = d[40 * 2048 + 126]      # ties the 128th, earlier: it goes before it
    rows = M.worst_elements(r, d, count=128)
    assert [row[0] for row in rows] == worst_by_sort(r, d)[:128]
    kept = [row[0] for row in rows]
    assert kept[0] == 30 * 2048 + 1 and kept[-1] == 3 * 2048 + 11
    assert 40 * 2048 + 125 in kept and 40 * 2048 + 126 not in kept


def test_compared_nodes_worst_rows_do_not_depend_on_the_marks(monkeypatch):
    """compare_node, whole or in chunks, gives the worst rows of a plain
    search."""
    from layerdiff.analyzer.compare import node as N
    from layerdiff.analyzer.compare.tolerances import Tolerance

    rng = np.random.default_rng(4)
    r = rng.standard_normal((3, 50, 700)).astype(np.float32)
    d = (r + rng.standard_normal(r.shape).astype(np.float32) * 0.05).astype(np.float16)
    d[1, 3, 5] = np.inf
    want = repr(M.worst_elements(r, d, 0.005, 0.01, count=64))     # NaN rows compare by their text
    assert repr(N.compare_node(r, d, Tolerance(0.005, 0.01), 64).worst) == want
    monkeypatch.setattr(N, "CHUNK_ELEMENTS", 10_000)
    assert repr(N.compare_node(r, d, Tolerance(0.005, 0.01), 64).worst) == want


def test_worst_rows_kept_as_columns_read_as_their_rows():
    """A node's worst rows are kept as columns (WorstRows): read row by row
    they are worst_elements' tuples (types, order, NaN and Inf as they are),
    equal to their list, and the report's frame of them and the elements
    table take the same bytes and values as from the tuples."""
    from layerdiff.analyzer.report.table_parts import element_parts
    from layerdiff.analyzer.report.tables import element_arrays
    from layerdiff.analyzer.report.writer import detail_frame

    rng = np.random.default_rng(9)
    r = rng.standard_normal((2, 30, 40)).astype(np.float32)
    d = (r + rng.standard_normal(r.shape).astype(np.float32) * 0.05).astype(np.float16)
    d[0, 1, 2], d[1, 2, 3], r[1, 0, 0] = np.inf, np.nan, 0.0
    d[1, 0, 0] = 0.5
    rows = M.worst_rows(r, d, 0.005, 0.01, count=40)
    listed = M.worst_elements(r, d, 0.005, 0.01, count=40)
    assert isinstance(rows, M.WorstRows) and len(rows) == len(listed) == 40 and rows
    assert repr(rows) == repr(listed) and repr(list(rows)) == repr(listed)
    assert [type(v) for v in rows[0]] == [int, float, float, float, float] and repr(rows[-1]) == repr(listed[-1])
    assert repr(rows[2:5]) == repr(listed[2:5])
    finite = M.WorstRows.of([w for w in listed if all(map(math.isfinite, w[1:]))])
    assert finite == [w for w in listed if all(map(math.isfinite, w[1:]))] and finite != listed[:3]
    assert M.WorstRows.of(rows) is rows and M.WorstRows.of(()) == [] and not M.WorstRows.of(())
    assert detail_frame("n.csv", rows) == detail_frame("n.csv", listed)

    class _Row:     # what element_parts reads of a report row
        def __init__(self, worst):
            self.label, self.role, self.is_input = "t", "output", False
            self.site = type("S", (), {"node": "n", "tensor": "t", "output_index": 0})()
            self.outcome = type("O", (), {"worst": worst, "metrics": type("m", (), {"shape": r.shape})()})()

    for worst in (rows, listed):
        cols = element_arrays(element_parts([_Row(worst)], {"t": "n.csv"}))
        assert cols["rank"].to_pylist() == list(range(40))
        for k, name in enumerate(("flat_index", "std_value", "npu_value", "abs_diff", "relative_diff")):
            assert repr(cols[name].to_pylist()) == repr([w[k] for w in listed]), name
        assert cols["index"].to_pylist()[0] == list(np.unravel_index(listed[0][0], r.shape))


def test_worst_elements_raw_values():
    r = np.array([1.0, np.nan, 2.0, np.inf, 0.0, np.inf, 5.0, 0.0], np.float32)
    d = np.array([9.0, 1.0, np.nan, -np.inf, np.nan, np.inf, 5.0, 3.0], np.float32)
    rows = M.worst_elements(r, d)
    assert [row[0] for row in rows] == [1, 2, 3, 4, 0, 7]
    by = {row[0]: row for row in rows}
    _, rv, dv, ad, rel = by[1]
    assert math.isnan(rv) and dv == 1.0 and math.isnan(ad) and math.isnan(rel)
    _, rv, dv, ad, rel = by[3]
    assert (rv, dv, ad) == (math.inf, -math.inf, math.inf) and math.isnan(rel)
    _, rv, dv, ad, rel = by[4]
    assert rv == 0.0 and math.isnan(dv) and math.isnan(ad)
    assert by[0][1:] == (1.0, 9.0, 8.0, 8.0)
    assert by[7][1:] == (0.0, 3.0, 3.0, 3.0 / 1e-10)
    assert [row[0] for row in M.worst_elements(r, d, count=3)] == [1, 2, 3]
    # across chunks: merging the rows of each by worst_row_key gives the same
    parts = [[(i + a, *rest) for i, *rest in M.worst_elements(r[a:b], d[a:b])]
             for a, b in ((0, 3), (3, 5), (5, 8))]
    merged = sorted((row for p in parts for row in p), key=M.worst_row_key)
    assert [row[0] for row in merged] == [row[0] for row in rows]


def test_worst_elements_integers_exact():
    r = np.array([2**60, 5, 2**63 - 1, 7, -(2**63)], np.int64)
    d = np.array([2**60 + 1, 5, -(2**63), 7, -(2**63)], np.int64)
    rows = M.worst_elements(r, d)
    assert [row[0] for row in rows] == [2, 0]
    assert rows[0][3] == float(2**64 - 1) and rows[1][3] == 1.0
    assert rows[1][1] == float(2**60) and rows[1][4] == 1.0 / float(2**60)
    u = np.array([2**63, 2**64 - 1, 3], np.uint64)
    i = np.array([-1, -(2**63), 3], np.int64)
    rows = M.worst_elements(u, i)
    assert [(row[0], row[3]) for row in rows] == [(1, float(2**64 - 1 + 2**63)),
                                                 (0, float(2**63 + 1))]
    # no tolerance for integers: 100 vs 101 is a row
    assert [row[0] for row in M.worst_elements(np.array([100, 3], np.int32),
                                               np.array([101, 3], np.int16))] == [0]


# ---------------------------------------------------------------------------
# Pieces of the kernel
# ---------------------------------------------------------------------------


def test_log32_accuracy():
    from numba import njit

    @njit
    def logs(q, out):
        for i in range(q.size):
            out[i] = K._log32(q[i])

    lo = np.array([1e-15], np.float32).view(np.uint32)[0]
    hi = np.array([1e15], np.float32).view(np.uint32)[0]
    q = np.arange(lo, hi, 997, dtype=np.uint32).view(np.float32)
    q = np.concatenate([q, np.float32(1) + np.arange(-5000, 5000, dtype=np.float32) * 2**-23])
    out = np.empty_like(q)
    logs(q, out)
    exact = np.log(q.astype(np.float64))
    err = np.abs(out - exact)
    assert err.max() < 2.5e-6      # ~1/2 ulp of |log| <= 34.6 in float32
    nz = exact != 0
    assert (err[nz] / np.abs(exact[nz])).max() < 2.5e-7
    assert set(out[q == 1].tolist()) == {0.0}


def test_half_conversion_exact():
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
    r = np.where(np.isfinite(h), h, 0).astype(np.float16)
    m = M.compare(r, r.astype(np.float32))
    assert m.errors == 0 and m.max_abs_diff == 0.0
    m = M.compare(h, h)      # includes NaN and Inf bit patterns
    # NaN never equals NaN; the two infinities equal themselves
    assert m.ref_nan == 2046 and m.ref_inf == 2 and m.both_nan == 2046
    assert m.errors == m.nonfinite_errors == 2046 and m.finite_pairs == 65536 - 2048
    assert m.max_abs_diff == 0.0 and math.isnan(m.max_abs_err)


def test_warmup_idempotent():
    """Warming the kernel up twice changes nothing a comparison returns."""
    r = np.linspace(-3, 3, 5000, dtype=np.float32)
    d = (r + np.float32(0.01)).astype(np.float16)
    M.warmup()
    first = M.compare(r, d)
    M.warmup()
    assert M.compare(r, d) == first and first.total == 5000


# ---------------------------------------------------------------------------
# Exactness of the float32 kernel's decisions
# ---------------------------------------------------------------------------


def _on_boundary(r, factor):
    """Device values whose float64 |d - r| lands on or next to factor*|r|."""
    rng = np.random.default_rng(17)
    d = (r.astype(np.float64) * (1 + factor)).astype(np.float32)
    # nudge some by one float32 ulp either way
    k = rng.integers(-1, 2, r.size)
    return np.where(k > 0, np.nextafter(d, np.float32(np.inf)),
                    np.where(k < 0, np.nextafter(d, np.float32(-np.inf)), d)).astype(np.float32)


@pytest.mark.parametrize("factor", [0.001, 0.005, -0.001, -0.005])
def test_fast_rel_threshold_counts_exact(factor):
    rng = np.random.default_rng(23)
    r = (rng.standard_normal(3 * 2048 + 40) * 10.0 ** rng.uniform(-3, 3, 3 * 2048 + 40)
         ).astype(np.float32)
    d = _on_boundary(r, factor)
    check_against_reference(r, d)
    check_against_reference(r, d.astype(np.float16))


@pytest.mark.parametrize("tol", [(0.005, 0.2), (0.0, 0.001), (0.0, 0.0), (1e-3, 0.0),
                                 (1e-30, 1e-30), (-1.0, 0.5), (1e31, 0.0), (1e-40, 0.3)])
def test_fast_tolerance_boundary_exact(tol):
    atol, rtol = tol
    rng = np.random.default_rng(29)
    n = 2 * 2048 + 8
    r = (rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 4, n)).astype(np.float32)
    # d - r == atol + rtol*|r| (rounded to float32), and its neighbours
    t = (np.float64(atol) + np.float64(rtol) * np.abs(r.astype(np.float64)))
    d = (r.astype(np.float64) + t).astype(np.float32)
    d[::3] = np.nextafter(d[::3], np.float32(np.inf))
    d[1::3] = np.nextafter(d[1::3], np.float32(-np.inf))
    d[::11] = r[::11]
    r[5::17] = 0.0
    check_against_reference(r, d, atol, rtol)


def test_fast_tiny_magnitudes_take_exact_path():
    # squares of differences this small underflow float32: such blocks must
    # still agree with the float64 definition (e.g. sqnr finite, not inf)
    rng = np.random.default_rng(31)
    r = (rng.standard_normal(4096) * 1e-30).astype(np.float32)
    d = (r * (1 + rng.standard_normal(4096) * 1e-3)).astype(np.float32)
    r[2048:] = 0.0
    d[2048:] = 0.0
    d[3000] = 1e-40
    m = check_against_reference(r, d)
    assert math.isfinite(m.sqnr_db) and m.mse > 0.0


def test_fast_constant_sides_exact():
    rng = np.random.default_rng(37)
    r = rng.standard_normal(3 * 2048 + 5).astype(np.float32)
    c = np.full(r.size, 0.3, np.float32)
    assert math.isnan(M.compare(r, c).pearson)       # device constant
    assert math.isnan(M.compare(c, r).pearson)       # reference constant
    assert math.isnan(M.compare(c, c).pearson)       # both: no spread to correlate
    q = np.full(r.size, 0.25, np.float32)                     # exact in float16
    m = M.compare(q, q.astype(np.float16))
    assert m.ref_std == 0.0 and math.isnan(m.pearson) and m.mse == 0.0
    assert m.cosine == pytest.approx(1.0, abs=1e-15) and m.sqnr_db == math.inf
    m = M.compare(c, c.astype(np.float16))           # 0.3 != fp16(0.3)
    assert math.isnan(m.pearson) and m.ref_std == 0.0 and m.mse > 0.0


def test_fast_similarity_near_one_keeps_relative_accuracy():
    # 1 - cosine and 1 - pearson far below float32 resolution
    rng = np.random.default_rng(41)
    n = 100_000
    r = (rng.standard_normal(n) * 3 + 1).astype(np.float32)
    d = (r.astype(np.float64) * (1 + rng.standard_normal(n) * 1e-6)).astype(np.float32)
    m, e = M.compare(r, d), M.reference_metrics(r, d)
    assert 0 < 1 - e.cosine < 1e-10
    assert same_float(1 - m.cosine, 1 - e.cosine, 1e-2, 1e-15)
    assert same_float(1 - m.pearson, 1 - e.pearson, 1e-2, 1e-15)


def test_fast_maxima_exact_when_growing_or_tied():
    n = 40 * 2048
    r = np.ones(n, np.float32)
    d = (1 + np.linspace(0, 1e-3, n)).astype(np.float32)      # |e| grows every block
    check_against_reference(r, d)
    d2 = r + np.float32(2.0 ** -20)
    d2[-1] += np.float32(2.0 ** -22)                          # exact max decided late
    check_against_reference(r, d2.astype(np.float32))
    rr = np.full(n, 3.0, np.float32)
    rr[::2] = 7.0
    check_against_reference(rr, (rr * np.float32(1.0007)).astype(np.float32))


# ---------------------------------------------------------------------------
# Narrower targets
# ---------------------------------------------------------------------------

# The kernel's shape depends on the target (16 lanes and merged sweeps with
# AVX-512, 8 lanes and separate sweeps with AVX2, no permute or half
# conversion instructions on plain x86-64): the exactness tests run again in
# a child process compiled for each narrower target.
_NARROW_TARGETS = {
    "avx2": ("haswell", "+avx,+avx2,+fma,+f16c,+sse4.2,+popcnt,+bmi,+bmi2,+lzcnt"),
    "x86-64": ("x86-64", "+sse2"),
}


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                    reason="x86-64 target names")
@pytest.mark.skipif(os.environ.get("LAYERDIFF_NARROW_TARGET") is not None,
                    reason="already running for a narrower target")
@pytest.mark.parametrize("target", sorted(_NARROW_TARGETS))
def test_kernel_exact_on_narrower_targets(target, tmp_path):
    cpu, features = _NARROW_TARGETS[target]
    env = dict(os.environ, NUMBA_CPU_NAME=cpu, NUMBA_CPU_FEATURES=features,
               NUMBA_CACHE_DIR=str(tmp_path), LAYERDIFF_NARROW_TARGET=target)
    tests = ("boundaries or special_values or half_conversion or fast_ or "
             "chunked_large or lanes_follow_target")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", tests],
        env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1]


def test_kernel_lanes_follow_target():
    target = os.environ.get("LAYERDIFF_NARROW_TARGET")
    if target is not None:
        assert K._W == 8
        assert K._HAS_AVX2 == (target == "avx2") and K._HAS_F16C == (target == "avx2")
    else:
        assert K._W == (16 if K._HAS_AVX512 else 8)


def test_device_moments_do_not_cancel_when_the_tensors_disagree():
    """A device output far smaller than a wide-ranging reference (a broken
    node): building the device moments from r and d - r would cancel in
    float32; the kernel must still agree with the float64 definition."""
    rng = np.random.default_rng(5)
    r = np.clip(rng.standard_normal(4096) * 5e3, -6e4, 6e4).astype(np.float32)   # float32 sweep range
    r[::7] = rng.standard_normal(586).astype(np.float32) * 1e-6
    cases = [(r, (rng.standard_normal(4096) * 1.5).astype(np.float32)),          # unrelated, tiny
             (r, (-r * np.float32(1e-4) + 0.3).astype(np.float32)),              # opposite sign, tiny
             (r, rng.standard_normal(4096).astype(np.float16))]                  # float16 device
    for ref, dev in cases:
        got, want = M.compare(ref, dev), M.reference_metrics(ref, dev)
        for name in ("cosine", "pearson", "rmse", "mse"):
            g, w = getattr(got, name), getattr(want, name)
            assert abs(g - w) <= 1e-5 * max(abs(w), 1e-3), (name, g, w)


def test_metrics_as_a_dict_are_every_field_in_order_with_lists_for_tuples():
    """summary.json's and the workers' form of a node's metrics: every
    field in declaration order, the tuple-typed ones (shape, first mismatch
    index) as lists; from_dict gives the same metrics back."""
    from dataclasses import fields

    m = M.compare(np.arange(12, dtype=np.float32).reshape(3, 4), np.arange(12, dtype=np.float32).reshape(3, 4) * 1.1)
    d = m.as_dict()
    assert list(d) == [f.name for f in fields(M.NodeMetrics)]
    assert {k for k, v in d.items() if isinstance(v, list)} == {f.name for f in fields(M.NodeMetrics)
                                                                 if "tuple" in str(f.type)}
    assert json.dumps(M.NodeMetrics.from_dict(d).as_dict()) == json.dumps(d)     # NaN != NaN: compared as text
