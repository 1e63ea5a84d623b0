"""What a failing node's own tensors show: an error concentrated on part of
an axis, an output that is the expected one in another layout, mask-like
sentinel values to leave out, a device output on a quantization grid; and
how numbers are written in the evidence sentences."""
from __future__ import annotations

import math

import numpy as np

from layerdiff.analyzer.compare import metrics as M
from layerdiff.analyzer.compare.compiled import _flat, as_stored, kernels, narrow_pair


def fmt(v: float | None) -> str:
    """A number in an evidence sentence: three significant digits, "nan" for none."""
    return "nan" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3g}"


def _finite_pairs(ref: np.ndarray, dev: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both tensors in float64 with every pair that is not finite on both
    sides set to zero on both: the evidence below is about the values the
    two sides share (non-finite values have their own reasoning), and
    float64 keeps sums of FP16-range values from overflowing."""
    r = ref.astype(np.float64)
    d = dev.astype(np.float64)
    if math.isfinite(float(np.sum(r)) + float(np.sum(d))):
        return r, d     # every value finite (a float64 sum of float32 values cannot overflow)
    bad = ~(np.isfinite(r) & np.isfinite(d))
    if bad.any():
        r[bad] = 0.0
        d[bad] = 0.0
    return r, d


def _rel_mean_err(r: np.ndarray, d: np.ndarray) -> float:
    """Mean |d - r| over the reference's RMS, of a pair from _finite_pairs."""
    scale = float(np.sqrt(np.mean(r * r))) or 1.0
    return float(np.mean(np.abs(d - r))) / scale


# the share of the reference's RMS a half of an axis must be off by, on
# average, for uneven_axis to name it (layout_match asks as much of the whole)
UNEVEN_MIN_REL = 0.05


def may_be_uneven(m: M.NodeMetrics) -> bool:
    """Whether uneven_axis or layout_match can find anything, from the
    node's metrics alone (they cost passes over the tensors, on the thread
    that receives the stream). With every value finite the metrics' mean
    |d - r| and RMS are exactly theirs; a half at least a third of the axis
    off by UNEVEN_MIN_REL puts the whole at UNEVEN_MIN_REL / 3 at least."""
    if m.ref_nan + m.ref_inf + m.dev_nan + m.dev_inf:
        return True
    scale = m.ref_rms if m.ref_rms > 0 else 1.0
    return not m.mean_abs_diff / scale < UNEVEN_MIN_REL / 3


# the most elements of a row of _error_profiles (its column sums, float64),
# and what its numpy path takes at a time (float64 copies of them, 8 MiB
# each, instead of the whole tensor's: a detector's largest activation held
# three float64 copies, 225 MB, at the analyzer's peak)
PROFILE_BLOCK = 1 << 20


def _error_profiles(ref: np.ndarray, dev: np.ndarray) -> tuple[list[np.ndarray], float]:
    """For each axis, the sums of |d - r| at each of its indices over all
    the others, and the sum of r², over the pairs finite on both sides (as
    _finite_pairs counts them), in float64. The tensor is read as rows of
    its trailing axes (at most PROFILE_BLOCK of them, where they fit): a
    row's sum gives the leading axes' profiles, the rows' sum the trailing
    axes', two sums per element; in one compiled pass over float32,
    float16 and float64 tensors as they are stored (a detector's failing
    nodes took a tenth of the job's own thread in float64 copies), else a
    block of elements at a time in numpy."""
    shape, nd = ref.shape, ref.ndim
    k = nd - 1     # the trailing axes k.. make a row
    while k > 0 and int(np.prod(shape[k - 1:], dtype=np.int64)) <= PROFILE_BLOCK:
        k -= 1
    inner = int(np.prod(shape[k:], dtype=np.int64))
    outer = ref.size // inner
    by_row, by_column = np.zeros(outer), np.zeros(inner)
    if narrow_pair(ref, dev) or ref.dtype == dev.dtype == np.float64:
        sum_r2 = float(kernels()._abs_profiles(as_stored(_flat(ref)), as_stored(_flat(dev)), outer, inner,
                                               by_row, by_column))
    else:
        r_rows, d_rows = np.reshape(ref, (outer, inner)), np.reshape(dev, (outer, inner))
        sum_r2 = 0.0
        step = max(1, PROFILE_BLOCK // inner)
        for i0 in range(0, outer, step):
            r, d = _finite_pairs(r_rows[i0:i0 + step], d_rows[i0:i0 + step])
            sum_r2 += float(np.einsum("ij,ij->", r, r))      # not BLAS: its threads would spin beside ours
            err = np.abs(np.subtract(d, r, out=d), out=d)
            by_row[i0:i0 + step] = err.sum(axis=1)
            by_column += err.sum(axis=0)
    leading, trailing = by_row.reshape(shape[:k]), by_column.reshape(shape[k:])
    profiles = []
    for ax, size in enumerate(shape):
        if size <= 1:
            profiles.append(np.zeros(size))
        elif ax < k:
            profiles.append(leading.sum(axis=tuple(a for a in range(k) if a != ax)))
        else:
            profiles.append(trailing.sum(axis=tuple(a for a in range(nd - k) if a != ax - k)))
    return profiles, sum_r2


def uneven_axis(ref: np.ndarray, dev: np.ndarray, names: str = "") -> str:
    """A sentence when the error sits on one part of an axis (the vendor's
    example: only the second half of H is wrong), else ''."""
    if ref.shape != dev.shape or ref.ndim == 0 or ref.size < 8:
        return ""
    profiles, sum_r2 = _error_profiles(ref, dev)
    scale = math.sqrt(sum_r2 / ref.size) or 1.0
    labels = names if len(names) == ref.ndim else ""
    best = ""
    best_ratio = 0.0
    for ax, size in enumerate(ref.shape):
        if size < 2:
            continue
        half = size // 2
        per_index = ref.size // size      # elements at each index of the axis
        a = float(profiles[ax][:half].sum()) / (per_index * half) / scale
        b = float(profiles[ax][half:].sum()) / (per_index * (size - half)) / scale
        hi, lo = max(a, b), min(a, b)
        if hi < UNEVEN_MIN_REL:
            continue
        ratio = hi / max(lo, 1e-12)
        if ratio >= 10 and ratio > best_ratio:
            where = "second" if b > a else "first"
            name = f" ({labels[ax]})" if labels else ""
            best = (f"error concentrated in the {where} half of axis {ax}{name}: mean |d-r|/rms "
                    f"{hi:.3g} there against {lo:.3g} in the other half")
            best_ratio = ratio
    return best


def layout_match(ref: np.ndarray, dev: np.ndarray, m: M.NodeMetrics | None = None) -> str:
    """A sentence when the device tensor is the reference in another layout
    (two axes swapped, or NHWC data read as NCHW), else ''. ``m``: the
    pair's metrics, whose mean |d - r| and RMS say, where every value is
    finite, that the pair is too close for any layout to be the answer
    without a pass over it."""
    if ref.shape != dev.shape or ref.ndim < 2 or ref.size < 4:
        return ""
    # the metrics' mean |d - r| and RMS are _rel_mean_err's where every value is finite
    known = m is not None and not (m.ref_nan + m.ref_inf + m.dev_nan + m.dev_inf)
    if m is not None and known and m.mean_abs_diff / (m.ref_rms if m.ref_rms > 0 else 1.0) < UNEVEN_MIN_REL:
        return ""
    if known:
        # every value finite: the tensors as they are (no float64 copies),
        # differences taken in float64 a part at a time
        r, d = ref, dev
        scale = (m.ref_rms if m is not None else 0.0) or 1.0
    else:
        r, d = _finite_pairs(ref, dev)
        if _rel_mean_err(r, d) < UNEVEN_MIN_REL:
            return ""
        scale = float(np.sqrt(np.mean(r * r))) or 1.0
    # each candidate as a view whose values in C order are the candidate's:
    # nothing is copied before a part of it has been looked at
    candidates: list[tuple[str, np.ndarray]] = []
    for i in range(ref.ndim):
        for j in range(i + 1, ref.ndim):
            if ref.shape[i] == ref.shape[j] and ref.shape[i] > 1:
                candidates.append((f"axes {i} and {j} swapped", np.swapaxes(r, i, j)))
    if ref.ndim == 4:
        n, c, h, w = ref.shape
        candidates.append(("NHWC data read as NCHW", r.transpose(0, 2, 3, 1)))
        candidates.append(("NCHW data read as NHWC", r.reshape(n, h, w, c).transpose(0, 3, 1, 2)))
    # a candidate is the answer when its mean |d - r| is under 1 % of the
    # reference's RMS: its first quarter (in C order) whose sum is over that
    # budget already rules it out (every term is positive), as most do. Its
    # first 32nd is summed before: a wrong layout's mean |d - r| is near the
    # RMS, a third of it is enough to rule it out there, for an eighth of
    # the work (a prefix over the budget is a quarter over it: nothing else
    # changes)
    budget = 0.01 * scale * r.size * (1 + 1e-9)
    q = max(1, r.size // 4)
    head = max(1, r.size // 32)
    d_part = _leading(d, q)
    for label, view in candidates:
        if _abs_diff_sum(d_part[:head], _leading(view, head)) > budget:
            continue
        if _abs_diff_sum(d_part, _leading(view, q)) > budget:
            continue
        cand = view if view.shape == ref.shape else view.reshape(ref.shape)
        if _abs_diff_sum(d, cand) / r.size / scale < 0.01:
            return f"layout: the device output is the expected output with {label}"
    return ""


def _abs_diff_sum(a: np.ndarray, b: np.ndarray) -> float:
    """sum |a - b|, the differences taken in float64 (one temporary)."""
    diff = np.subtract(a, b, dtype=np.float64)
    return float(np.sum(np.abs(diff, out=diff)))


def _leading(a: np.ndarray, q: int) -> np.ndarray:
    """The first ``q`` values of ``a`` (no axis of size 0) in C order, copying
    about ``q`` of them where ``a`` is a transposed view (a reshape of the
    whole would copy it all)."""
    while a.ndim > 1 and a[0].size >= q:
        a = a[0]
    if a.ndim > 1:
        a = a[:-(-q // a[0].size)]
    return a.reshape(-1)[:q]


def median(values: np.ndarray) -> float:
    """np.median of finite floats, to the bit (the two middle values
    averaged in the type np.mean uses: float32 for float16), without its
    checks: a call a tensor, and its first call imports numpy.ma."""
    n = values.size
    k = n // 2
    if n % 2:
        # asked with its neighbour, the middle value comes out the same, two
        # to four times as fast (numpy's selection of one kth is slower)
        return float(np.partition(values, (k, k + 1) if n > 2 else k)[k])
    part = np.partition(values, (k - 1, k))
    wide = np.float32 if values.dtype == np.float16 else values.dtype.type
    return float(values.dtype.type((wide(part[k - 1]) + wide(part[k])) / 2))


def core_mask(ref: np.ndarray) -> tuple[np.ndarray | None, float]:
    """The elements that are not mask-like sentinels (|x| above 1000 times
    the median magnitude: the -3.4e38 or -1e4 of an additive attention mask),
    and the threshold; (None, nan) where there are none."""
    a = np.abs(np.asarray(ref, np.float64)).ravel()
    finite = a[np.isfinite(a)]
    if not finite.size:
        return None, math.nan
    med = median(finite)
    if med <= 0:
        return None, math.nan
    thr = 1e3 * med
    keep = np.isfinite(a) & (a <= thr)
    if keep.all() or not keep.any():
        return None, math.nan
    return keep, thr


def quant_grid(dev: np.ndarray, max_levels: int = 256) -> tuple[float, int] | None:
    """(step, levels) where the device values lie on a grid of at most
    ``max_levels`` values (a dequantized INT8 tensor); None otherwise."""
    a = np.asarray(dev).ravel()
    if a.size > 8192:
        # more distinct values in a few thousand than a grid can hold: no grid (one cheap look first)
        head = a[:: a.size // 4096 + 1]
        if np.unique(head[np.isfinite(head)]).size > max_levels:
            return None
    if a.size > 1 << 22:
        a = a[:: a.size // (1 << 22) + 1]
    a = a[np.isfinite(a)]
    if a.size < 2:
        return None
    u = np.unique(a)
    if len(u) > max_levels or len(u) < 2:
        return None
    steps = np.diff(u.astype(np.float64))
    step = float(steps.min())
    # every gap a whole number of steps: one scale, not just few values
    if step <= 0 or not np.allclose(steps / step, np.round(steps / step), atol=1e-3):
        return None
    return step, int(len(u))
