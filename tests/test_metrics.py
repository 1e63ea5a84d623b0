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

from layerdiff.analyzer import metrics as M

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
    "dev_fp16_overflow", "atol", "rtol",
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
    for f in ("cosine", "pearson", "rel_err_lt_0_001", "rel_err_lt_0_005", "mse", "kl_div"):
        assert math.isnan(getattr(m, f)), f


def test_all_zero_both():
    m = M.compare(np.zeros(10, np.float32), np.zeros(10, np.float32))
    assert m.passed and m.cosine == 1.0 and m.pearson == 1.0
    assert m.sqnr_db == math.inf and m.rel_euclidean == 0.0 and m.kl_div == 0.0
    assert m.mse == 0.0 and m.ref_std == 0.0 and m.max_rel_err == 0.0
    assert m.rel_err_lt_0_001 == 1.0


def test_zero_ref_nonzero_dev():
    m = M.compare(np.zeros(4, np.float32), np.array([0, 0.001, 0, 1], np.float32))
    # |d| = [0, .001, 0, 1] vs tol 0.005 -> only the last mismatches
    assert m.errors == 1 and m.first_mismatch_offset == 3
    assert m.cosine == 0.0 and math.isnan(m.kl_div)
    assert m.sqnr_db == -math.inf and m.rel_euclidean == math.inf
    # rel uses REL_EPS for r == 0: max rel = 1 / 1e-10
    assert m.max_rel_err == pytest.approx(1e10)
    assert math.isnan(m.pearson)  # reference is constant, device is not


def test_nonzero_ref_zero_dev():
    m = M.compare(np.array([1, 2], np.float32), np.zeros(2, np.float32))
    assert m.cosine == 0.0 and math.isnan(m.kl_div) and math.isnan(m.pearson)
    assert m.rel_euclidean == 1.0 and m.sqnr_db == 0.0


def test_constant_tensors():
    eq = M.compare(np.full(100, 0.1, np.float32), np.full(100, 0.1, np.float32))
    assert eq.pearson == 1.0 and eq.ref_std == 0.0 and eq.cosine == 1.0 and eq.kl_div == 0.0
    ne = M.compare(np.full(100, 0.1, np.float32), np.full(100, 0.2, np.float32))
    assert math.isnan(ne.pearson) and ne.ref_std == 0.0
    assert ne.cosine == pytest.approx(1.0)
    # reference constant across many blocks (exercises the block merge)
    big = M.compare(np.full(10_000, 3.0, np.float32), np.full(10_000, 3.0, np.float16))
    assert big.pearson == 1.0 and big.ref_std == 0.0
    # device constant, reference not
    m = M.compare(np.arange(50, dtype=np.float32), np.full(50, 7.0, np.float32))
    assert math.isnan(m.pearson)


def test_large_offset_small_spread_std():
    r = (1000.0 + np.arange(4096) % 3 * 1e-3).astype(np.float64)
    m = M.compare(r, r)
    assert m.ref_std == pytest.approx(float(np.std(r)), rel=1e-9)
    assert m.pearson == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("n", [5, 64, 5000])
def test_nan_inf_counts_and_replacement(n):
    r = np.linspace(-1, 1, n).astype(np.float32)
    d = r.copy()
    r[1] = np.nan
    d[2] = np.nan
    r[3] = d[3] = np.nan          # NaN on both sides: 0 vs 0, no mismatch
    r[4] = np.inf
    d[4] = np.inf                 # both +inf -> both float32 max: equal
    m = M.compare(r, d)
    assert (m.ref_nan, m.dev_nan, m.ref_inf, m.dev_inf) == (2, 2, 1, 1)
    assert m.dev_fp16_overflow == 1 and m.fp16_overflow == 0
    # offsets 1 and 2 compare 0 against the other side's value
    expect = M.reference_metrics(r, d)
    assert_exact_fields(m, expect)
    # offset 1: NaN -> 0 against linspace value |.| > 0.005
    assert m.first_mismatch_offset == 1
    assert np.isfinite(m.mse) and np.isfinite(m.cosine)


def test_inf_against_finite():
    r = np.array([1.0, -np.inf, 2.0], np.float32)
    d = np.array([1.0, 5.0, np.inf], np.float32)
    m = M.compare(r, d)
    assert m.errors == 2 and m.first_mismatch_offset == 1
    assert m.ref_value == -F32_MAX and m.dev_value == 5.0
    assert m.max_abs_diff == pytest.approx(F32_MAX)
    assert (m.ref_inf, m.dev_inf, m.dev_fp16_overflow) == (1, 1, 1)


def test_fp16_overflow_counts():
    r = np.array([65504.0, 65505.0, -70000.0, 1e30, np.inf, np.nan, 3.0], np.float32)
    d = np.array([65504.0, 1.0, -70000.0, 7.0, 1.0, 1.0, -1e6], np.float32)
    m = M.compare(r, d)
    # ref: finite with |r| > 65504 -> 65505, -70000, 1e30 (inf and nan excluded)
    assert m.fp16_overflow == 3
    # dev: -70000 and -1e6
    assert m.dev_fp16_overflow == 2
    d16 = np.array([np.inf, -np.inf, 1, 1, 1, 1, 1], np.float16)
    assert M.compare(r, d16).dev_fp16_overflow == 2


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.uint16, np.int32,
                                   np.int64, np.bool_])
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
    # mixed with float
    m2 = M.compare(r.astype(np.float32), d)
    assert m2.errors == m.errors


def test_int64_extremes():
    r = np.array([2**62, -(2**62), 0], np.int64)
    d = np.array([2**62, 0, 1], np.int64)
    assert_exact_fields(M.compare(r, d), M.reference_metrics(r, d))


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


def data_peak(r):
    rr = np.nan_to_num(np.asarray(r, np.float64).reshape(-1), nan=0.0, posinf=F32_MAX,
                       neginf=-F32_MAX)
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


def _tensor_pairs():
    dtypes = st.sampled_from([np.float32, np.float16, np.float64, np.int8, np.int32,
                              np.uint8, np.bool_])

    @st.composite
    def pair(draw):
        shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=40))
        rdt, ddt = draw(dtypes), draw(dtypes)
        base = draw(st.sampled_from(["normal", "wide", "ints", "special"]))
        n = int(np.prod(shape))
        seed = draw(st.integers(0, 2**32 - 1))
        rng = np.random.default_rng(seed)
        if base == "normal":
            r = rng.standard_normal(n)
        elif base == "wide":
            r = rng.standard_normal(n) * 10.0 ** rng.uniform(-8, 6, n)
        elif base == "ints":
            r = rng.integers(-5, 6, n).astype(np.float64)
        else:
            r = rng.choice([0.0, -0.0, 1.0, -2.5, 65504.0, 7e4, 1e-30, 1e38, np.nan,
                            np.inf, -np.inf], n)
        kind = draw(st.sampled_from(["close", "noisy", "independent", "equal"]))
        if kind == "close":
            d = r * (1 + rng.standard_normal(n) * 1e-3)
        elif kind == "noisy":
            d = r + rng.standard_normal(n) * draw(st.sampled_from([1e-4, 0.1, 10.0]))
        elif kind == "independent":
            d = rng.choice([0.0, 3.0, np.nan, np.inf, -1.0, 1e5], n) if base == "special" \
                else rng.standard_normal(n)
        else:
            d = r.copy()

        def cast(x, dt):
            with np.errstate(all="ignore"):
                if np.dtype(dt).kind in "iub":
                    x = np.nan_to_num(x, nan=0, posinf=0, neginf=0)
                    if dt == np.bool_:
                        return (x > 0.5).reshape(shape)
                    info = np.iinfo(dt)
                    return np.clip(np.round(x), info.min, info.max).astype(dt).reshape(shape)
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
    rr = np.nan_to_num(np.asarray(r, np.float64).reshape(-1), nan=0.0, posinf=F32_MAX,
                       neginf=-F32_MAX)
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


def test_worst_elements_matches_sort():
    rng = np.random.default_rng(5)
    r = rng.standard_normal(20_000).astype(np.float32)
    d = (r + rng.standard_normal(r.size) * 0.3).astype(np.float16)
    d[::97] = np.float16(1.0)
    r[3] = np.nan
    rows = M.worst_elements(r, d, count=128)
    rr = np.nan_to_num(r.astype(np.float64), nan=0.0, posinf=F32_MAX, neginf=-F32_MAX)
    dd = d.astype(np.float64)
    diff = np.abs(dd - rr)
    mis = np.flatnonzero(diff > 0.005 + 0.2 * np.abs(rr))
    order = sorted(mis, key=lambda i: (-diff[i], i))[:128]
    assert [row[0] for row in rows] == order
    for i, rv, dv, ad, rel in rows[:5]:
        assert (rv, dv, ad) == (rr[i], dd[i], diff[i])
        assert rel == diff[i] / (abs(rr[i]) if rr[i] != 0 else 1e-10)
    assert M.compare(r, d).errors == len(mis)


# ---------------------------------------------------------------------------
# Pieces of the kernel
# ---------------------------------------------------------------------------


def test_log32_accuracy():
    from numba import njit

    @njit
    def logs(q, out):
        for i in range(q.size):
            out[i] = M._log32(q[i])

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
    assert m.errors == 0 and m.ref_nan == 2046 and m.ref_inf == 2


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
    assert M.compare(c, c).pearson == 1.0
    q = np.full(r.size, 0.25, np.float32)                     # exact in float16
    m = M.compare(q, q.astype(np.float16))
    assert m.ref_std == 0.0 and m.pearson == 1.0
    assert math.isnan(M.compare(c, c.astype(np.float16)).pearson)   # 0.3 != fp16(0.3)


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
        assert M._W == 8
        assert M._HAS_AVX2 == (target == "avx2") and M._HAS_F16C == (target == "avx2")
    else:
        assert M._W == (16 if M._HAS_AVX512 else 8)


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
