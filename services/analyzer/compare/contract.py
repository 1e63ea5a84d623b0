"""What the compiled metric pass (``kernel.py``) and the Python around it
share: the constants of the metric definitions, the layout of a pass's
state, the float32 tolerances the vector kernel takes and the display rule.

Kept apart from ``kernel.py`` so that the Python side never imports numba
(the ahead-of-time build of the kernel runs without it: ``compiled.py``).
The compiled code freezes these values in: ``kernel.py`` keys its
just-in-time cache by this file's contents, and the ahead-of-time build is
keyed by them too.
"""

from __future__ import annotations

import numpy as np

# The constants of the metric definitions (metrics.py re-exports them); the
# default tolerances are also what warmup() loads the kernels with.
ATOL_DEFAULT = 0.005
RTOL_DEFAULT = 0.2
FP16_MAX = 65504.0
REL_EPS = 1e-10

_F32_MAX = float(np.finfo(np.float32).max)
# Elements per block of the float32 / float16 metric pass (kernel._acc_fast);
# its marks (one a block, see compiled.block_marks) are by these blocks.
_BLOCK = 2048


# ---------------------------------------------------------------------------
# State of a pass
# ---------------------------------------------------------------------------

# Layout of the state arrays shared by the compiled code and metrics.Accumulator.
# Integer part.
_I_N, _I_NERR, _I_FIRST, _I_V0 = 0, 1, 2, 3
_I_REF_NAN, _I_REF_INF, _I_DEV_NAN, _I_DEV_INF, _I_REF_OVF, _I_DEV_OVF = 4, 5, 6, 7, 8, 9
_I_REL1, _I_REL5 = 10, 11
_I_NFIN, _I_BOTH_NAN, _I_NFE = 12, 13, 14
_NI = 15
_INT_FIELDS = (
    "n", "errors", "first_offset", "v0_offset", "ref_nan", "ref_inf", "dev_nan",
    "dev_inf", "ref_overflow", "dev_overflow", "n_rel_lt_0_001", "n_rel_lt_0_005",
    "finite_pairs", "both_nan", "nonfinite_errors",
)
# Float part.  Moments are kept centred (Chan et al. parallel form): a
# reference with a large mean and a small spread keeps its std, and a
# constant tensor has exactly zero variance.
_F_FIRST_REF, _F_FIRST_DEV, _F_V0_REF, _F_V0_DEV = 0, 1, 2, 3
_F_SUM_ERR, _F_MAX_ERR, _F_SUM_AE, _F_MAX_AE, _F_SUM_REL, _F_MAX_REL = 4, 5, 6, 7, 8, 9
_F_MEAN_R, _F_M2_R, _F_MEAN_D, _F_M2_D, _F_C_RD, _F_SUM_E2 = 10, 11, 12, 13, 14, 15
_F_SUM_AR, _F_SUM_AD, _F_SUM_KL = 16, 17, 18
_NF = 19
_FLOAT_FIELDS = (
    "first_ref", "first_dev", "v0_ref", "v0_dev", "sum_err", "max_err", "sum_abs_diff",
    "max_abs_diff", "sum_rel", "max_rel", "mean_ref", "m2_ref", "mean_dev", "m2_dev",
    "c_ref_dev", "sum_sq_diff", "sum_abs_ref", "sum_abs_dev", "sum_kl",
)


def _new_state():
    iv = np.zeros(_NI, np.int64)
    iv[_I_FIRST] = -1
    iv[_I_V0] = -1
    fv = np.zeros(_NF, np.float64)
    fv[_F_FIRST_REF] = fv[_F_FIRST_DEV] = fv[_F_V0_REF] = fv[_F_V0_DEV] = np.nan
    return iv, fv


# ---------------------------------------------------------------------------
# The float32 tolerances of the vector kernel
# ---------------------------------------------------------------------------


def _f32_down(x: float) -> float:
    """Largest float32 <= x (x finite, |x| < float32 max)."""
    v = np.float32(x)
    if float(v) > x:
        v = np.nextafter(v, np.float32(-np.inf))
    return float(v)


def _f32_up(x: float) -> float:
    v = np.float32(x)
    if float(v) < x:
        v = np.nextafter(v, np.float32(np.inf))
    return float(v)


def _fast_tolerances(atol: float, rtol: float):
    """float32 (rtol_lo, atol_lo) for the float32 "may mismatch" test, or None.

    ``ae32 > max(fma(|r|, rtol_lo, atol_lo), 0)`` is true for every element
    that mismatches in float64 (and, rarely, for some that do not): rtol_lo
    and atol_lo are rtol and atol shrunk by 2**-20 and rounded down, and
    atol_lo is lowered by a further 2**-126 so that float32 rounding near the
    subnormal range cannot hide a mismatch (see the tests).  Tolerances
    outside [1e-30, 1e30] (other than 0) take the float64 test instead.
    """
    def ok(t):
        return t == 0.0 or 1e-30 <= t <= 1e30

    if not (ok(atol) and ok(rtol)):
        return None
    return (_f32_down(rtol * (1 - 2.0 ** -20)),
            _f32_down(atol * (1 - 2.0 ** -20) - 2.0 ** -126))


def display_value(v):
    """The vendor's display rule, for ref_value/dev_value only: NaN shows as
    0, an infinity as the largest float32 of its sign. Compiled into the
    kernel (kernel.py); plain Python for the numpy definitions."""
    if v != v:
        return 0.0
    if v == np.inf:
        return _F32_MAX
    if v == -np.inf:
        return -_F32_MAX
    return v
