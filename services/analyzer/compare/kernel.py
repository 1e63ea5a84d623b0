"""The fused metric pass, compiled: what ``metrics.compare`` and
``metrics.accumulate`` run, and the search behind
``worst.worst_elements``.  The definitions it implements, and its
accuracy, are in the docstring of ``metrics.py``.

Implementation: float32 and float16 pairs go through a hand-vectorised
kernel (LLVM IR emitted from numba intrinsics: 16 float32 lanes with
AVX-512, 8 elsewhere; blocks of 2048 elements kept in L1 while the next one is
prefetched, no tensor-sized temporaries, float16 read as bits and widened in
registers).  Blocks containing NaN, Inf, magnitudes above
65504 or non-zero magnitudes below 2**-80 fall back to a scalar float64 path
that sets the non-finite pairs aside; integer/bool pairs take an exact
integer path, and every other dtype combination is widened to float64 in
bounded pieces and takes the scalar path.  First-, second- and
co-moments are accumulated about a per-block shift (a finite pair of the
block) and merged with Chan's pairwise formulas, so a large mean does not
eat the variance and constant tensors have exactly zero variance.  The
device moments are rebuilt from those of u = r - shift and
w = (d - shift_d) - u, so 1 - cosine and 1 - pearson keep relative
accuracy when the tensors nearly agree; where they do not, and building
the device moments that way would cancel (more than two bits lost), the
block's moments are summed again in float64.

Beside it, the sums of squares along kept axes behind ``squares.py``.

The state of a pass is a pair of arrays (``contract._new_state``): integer
counters and float sums at the ``_I_*`` / ``_F_*`` indices, which
``metrics.Accumulator`` names field by field.

Everything numba compiles is here, and only that: this module is imported
to build the kernels ahead of time (``build.py``, run by ``make setup``)
and, where no build matches these sources and this CPU, to compile them
just in time (``compiled.py`` chooses; the Python side never imports numba
otherwise). Why one module, over 1000 lines: it is one numba compilation
unit. The ``cache=True`` functions here compile in the LLVM IR emitters,
the intrinsics, the inline scalar helpers and the module constants, and
numba invalidates a cached function only when the file defining it
changes: split across files, an edit to an emitter, a helper or a constant
would leave stale machine code in the cache. The one exception,
``contract.py`` (the values the Python side shares), keys the cache's
directory by its contents.
"""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path

import numpy as np
from llvmlite import binding as _llvm
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core import config as _nb_config
from numba.extending import intrinsic, overload

from layerdiff.analyzer.compare import contract
from layerdiff.analyzer.compare.contract import (
    _BLOCK,
    _F32_MAX,
    _F_C_RD,
    _F_FIRST_DEV,
    _F_FIRST_REF,
    _F_M2_D,
    _F_M2_R,
    _F_MAX_AE,
    _F_MAX_ERR,
    _F_MAX_REL,
    _F_MEAN_D,
    _F_MEAN_R,
    _F_SUM_AD,
    _F_SUM_AE,
    _F_SUM_AR,
    _F_SUM_E2,
    _F_SUM_ERR,
    _F_SUM_KL,
    _F_SUM_REL,
    _F_V0_DEV,
    _F_V0_REF,
    _I_BOTH_NAN,
    _I_DEV_INF,
    _I_DEV_NAN,
    _I_DEV_OVF,
    _I_FIRST,
    _I_N,
    _I_NERR,
    _I_NFE,
    _I_NFIN,
    _I_REF_INF,
    _I_REF_NAN,
    _I_REF_OVF,
    _I_REL1,
    _I_REL5,
    _I_V0,
    FP16_MAX,
    REL_EPS,
    _f32_down,
    _f32_up,
    display_value,
)

# numba re-checks a cached function against its own file only; what it
# freezes in from contract.py is keyed in by the cache's directory (under
# NUMBA_CACHE_DIR where one is set), set while this module defines its
# functions and restored at the end of the module.
_CACHE_DIR_BEFORE = _nb_config.CACHE_DIR  # type: ignore[attr-defined]  # numba sets its config attributes at import


def _jit_cache_base() -> Path:
    """NUMBA_CACHE_DIR where set, else beside this file where it can be
    written (as numba would), else the user's cache directory."""
    if _CACHE_DIR_BEFORE:
        return Path(_CACHE_DIR_BEFORE)
    here = Path(__file__).parent
    beside = here / "__pycache__"
    if os.access(beside if beside.exists() else here, os.W_OK):
        return beside
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "layerdiff" / "numba"


_nb_config.CACHE_DIR = str(  # type: ignore[attr-defined]
    _jit_cache_base() / ("jit-" + hashlib.sha256(Path(contract.__file__).read_bytes()).hexdigest()[:16]))

_F32_MAX_32 = np.float32(_F32_MAX)
_FP16_MAX_32 = np.float32(FP16_MAX)
_EPS_32 = np.float32(REL_EPS)
# Bit pattern of float32(65504): every |x| whose bits compare above it (as an
# unsigned integer) is > 65504, Inf or NaN, i.e. needs the careful path.
_FP16_MAX_BITS = 0x477FE000
# Elements per block (contract._BLOCK, 2048): the reference and device
# slices of one block (<= 16 KiB) stay in L1 while the kernel sweeps them
# two to five times.


# ---------------------------------------------------------------------------
# LLVM IR building blocks
# ---------------------------------------------------------------------------

_I16, _I32, _I64 = ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F16, _F32, _F64 = ir.HalfType(), ir.FloatType(), ir.DoubleType()
_PTR = ir.PointerType()
_V8F = ir.VectorType(_F32, 8)
_V8I = ir.VectorType(_I32, 8)


def _target_has_feature(name: str) -> bool:
    # Mirrors numba's choice of target features for the JIT.
    feats = _nb_config.CPU_FEATURES  # type: ignore[attr-defined]  # numba sets its config attributes at import
    if feats is None:
        feats = _llvm.get_host_cpu_features().flatten()
    return "+" + name in feats.split(",")


_HAS_F16C = _target_has_feature("f16c")
_HAS_AVX2 = _target_has_feature("avx2")
_HAS_AVX512 = _target_has_feature("avx512f")

# float32 lanes per group.  Every sum in the kernel is a loop-carried chain
# (an add or fma per group), so a sweep cannot go faster than one group per
# add/fma latency: with AVX-512 a group of 16 lanes (one zmm register, and 32
# of them to hold the accumulators) does twice the work per link of the
# chain.  Elsewhere 8 lanes fill the 256-bit registers (or are split by LLVM
# on narrower targets).  Results do not depend on the choice beyond
# summation order.
_W = 16 if _HAS_AVX512 else 8
# Sweeps of the block kernel that share one loop (see _build_block_fn): with
# the 32 registers of AVX-512 sweeps 2-4 fit in one loop, so the block is read
# twice instead of four times; with 16 registers merging them would spill.
# Sweep 1 stays alone either way: a block that must take the scalar path is
# then found before the expensive sweeps run.
_SWEEP_GROUPS = ((1,), (2, 3, 4)) if _HAS_AVX512 else ((1,), (2,), (3,), (4,))
_VF = ir.VectorType(_F32, _W)
_VI = ir.VectorType(_I32, _W)
_VH = ir.VectorType(_I16, _W)
_VD = ir.VectorType(_F64, _W)
_VHD = ir.VectorType(_F64, _W // 2)
_VHL = ir.VectorType(_I64, _W // 2)


def _c(ty, v):
    if isinstance(ty, ir.VectorType):
        return ir.Constant(ty, [ir.Constant(ty.element, v)] * ty.count)
    return ir.Constant(ty, v)


def _like(ty, elem):
    """Type with the shape of ``ty`` and element type ``elem``."""
    return ir.VectorType(elem, ty.count) if isinstance(ty, ir.VectorType) else elem


def _type_suffix(ty):
    el = ty.element if isinstance(ty, ir.VectorType) else ty
    s = {_F32: "f32", _F64: "f64", _I32: "i32", _I64: "i64"}[el]
    return f"v{ty.count}{s}" if isinstance(ty, ir.VectorType) else s


def _call_intr(b, base, *args):
    ty = args[0].type
    fnty = ir.FunctionType(ty, [a.type for a in args])
    fn = cgutils.get_or_insert_function(b.module, fnty, f"llvm.{base}.{_type_suffix(ty)}")
    return b.call(fn, list(args))


def _fma(b, x, y, z):
    # Explicit fused multiply-add: exactly rounded, so the vector kernels and
    # the scalar fallback produce identical results where it is used.
    return _call_intr(b, "fma", x, y, z)


def _fabs(b, x):
    return _call_intr(b, "fabs", x)


def _fmax(b, x, y):
    # select(x > y, x, y): maps to (v)maxps/pd; inputs are never NaN here.
    return b.select(b.fcmp_ordered(">", x, y), x, y)


def _log_tables():
    """Reciprocal / log tables for the 8 sub-intervals of [sqrt(.5), sqrt(2)).

    Interval j holds the mantissas whose bit offset from sqrt(.5) has top
    three bits j.  r_j ~ 1/centre_j (any float32 works: the identity
    log m = log(m r_j) - log r_j is exact); the interval holding 1 gets
    r = 1, L = 0 so that logs of ratios near 1 keep full relative accuracy.
    """
    base = 0x3F3504F3
    recips, logs = [], []
    for j in range(8):
        lo = np.array([base + (j << 20)], np.uint32).view(np.float32)[0]
        hi = np.array([base + ((j + 1) << 20)], np.uint32).view(np.float32)[0]
        if lo <= 1.0 < hi:
            r = np.float32(1.0)
        else:
            r = np.float32((float(lo) + float(hi)) / (2.0 * float(lo) * float(hi)))
        recips.append(float(r))
        logs.append(float(np.float32(-math.log(float(r)))))
    return recips, logs


_LOG_RECIP, _LOG_TAB = _log_tables()
# log1p(t) ~ t + t^2 (c2 + t (c3 + t (c4 + t c5))); |t| <= 0.057 on every
# interval, truncation error <= t^6/6 < 6e-9.
_LOG1P_C = (-0.5, 1.0 / 3.0, -0.25, 0.2)
_LN2_HI = 0.693359375      # few mantissa bits: e * _LN2_HI is exact
_LN2_LO = -2.12194440e-4


def _lookup8(b, table, idx):
    """table[idx] for a constant 8-entry float32 table (scalar or vector idx)."""
    tv = ir.Constant(_V8F, [ir.Constant(_F32, v) for v in table])
    if not isinstance(idx.type, ir.VectorType):
        return b.extract_element(tv, idx)
    vty = _like(idx.type, _F32)
    if idx.type.count == 16 and _HAS_AVX512:
        # idx < 8: the table repeated fills the 16 lanes vpermps indexes
        t16 = ir.Constant(vty, [ir.Constant(_F32, v) for v in table] * 2)
        fnty = ir.FunctionType(vty, [vty, idx.type])
        fn = cgutils.get_or_insert_function(b.module, fnty, "llvm.x86.avx512.permvar.sf.512")
        return b.call(fn, [t16, idx])
    if idx.type.count == 8 and _HAS_AVX2:
        fnty = ir.FunctionType(_V8F, [_V8F, _V8I])
        fn = cgutils.get_or_insert_function(b.module, fnty, "llvm.x86.avx2.permps")
        return b.call(fn, [tv, idx])
    out = ir.Constant(vty, ir.Undefined)
    for k in range(idx.type.count):
        lane = ir.Constant(_I32, k)
        out = b.insert_element(out, b.extract_element(tv, b.extract_element(idx, lane)), lane)
    return out


def _emit_log32(b, q):
    """Natural log of a positive normal float32 ``q`` (scalar or <8 x float>).

    q = 2**e * m, m in [sqrt(.5), sqrt(2)); log m = L_j + log1p(m r_j - 1)
    with an 8-entry table picked by the top mantissa bits and a degree-6
    polynomial.  Max error ~2.5e-7 absolute and ~2e-7 relative (measured
    over all float32 in [1e-15, 1e15] in the tests); vector and scalar
    forms give bit-identical results (same operations, exact fma).
    """
    fty = q.type
    ity = _like(fty, _I32)
    t = b.sub(b.bitcast(q, ity), _c(ity, 0x3F3504F3))
    e = b.sitofp(b.ashr(t, _c(ity, 23)), fty)
    off = b.and_(t, _c(ity, 0x7FFFFF))
    m = b.bitcast(b.add(off, _c(ity, 0x3F3504F3)), fty)
    j = b.lshr(off, _c(ity, 20))
    r = _lookup8(b, _LOG_RECIP, j)
    lj = _lookup8(b, _LOG_TAB, j)
    x = _fma(b, m, r, _c(fty, -1.0))
    z = b.fmul(x, x)
    c2, c3, c4, c5 = (_c(fty, v) for v in _LOG1P_C)
    # (c2 + c3 x) + x^2 (c4 + c5 x): two short chains instead of one long one.
    p = _fma(b, z, _fma(b, c5, x, c4), _fma(b, c3, x, c2))
    y = _fma(b, z, p, x)
    y = b.fadd(y, _fma(b, e, _c(fty, _LN2_LO), lj))
    return _fma(b, e, _c(fty, _LN2_HI), y)


def _emit_h2f(b, h):
    """Exact IEEE half (given as i16 bits) -> float32, scalar or vector."""
    fty = _like(h.type, _F32)
    if _HAS_F16C:
        return b.fpext(b.bitcast(h, _like(h.type, _F16)), fty)
    # Portable path: shift exponent+mantissa into float32 position and rebias
    # with a multiply by 2**112 (also right for subnormal halves); Inf/NaN get
    # the all-ones exponent.
    ity = _like(h.type, _I32)
    hi = b.zext(h, ity)
    sign = b.shl(b.and_(hi, _c(ity, 0x8000)), _c(ity, 16))
    em = b.shl(b.and_(hi, _c(ity, 0x7FFF)), _c(ity, 13))
    scaled = b.bitcast(b.fmul(b.bitcast(em, fty), _c(fty, 2.0 ** 112)), ity)
    infnan = b.icmp_unsigned(">=", b.and_(hi, _c(ity, 0x7C00)), _c(ity, 0x7C00))
    bits = b.select(infnan, b.or_(em, _c(ity, 0x7F800000)), scaled)
    return b.bitcast(b.or_(bits, sign), fty)


# Order of the per-block sums written by the kernels (and by the scalar path).
# u = r - shift_r, v = d - shift_d (shifts: the values of the block's first
# finite pair).
# _B_NERRP and _B_AMB are only written by the float32 sweep: the number of
# lanes that may mismatch, and the number whose relative error lies too close
# to 0.001 or 0.005 for float32 to decide (both 0 means its counts are exact).
# _B_SUW and _B_SW2 are the float32 sweep's sum u*w and sum w*w (w = v - u):
# when the device moments built from them cancel, the block's moments are
# summed again in float64 (_redo_moments).  _B_NFIN is the number of finite
# pairs the sums are over (set by the caller for the vector part: the kernel
# only accepts blocks of finite pairs); _B_NERR also counts the non-finite
# mismatches, which add to no sum.
(_B_SU, _B_SU2, _B_SV, _B_SV2, _B_SUV, _B_SE2, _B_SAE, _B_MAE, _B_SAR, _B_SAD,
 _B_NERR, _B_SERR, _B_MERR, _B_SREL, _B_MREL, _B_C1, _B_C5, _B_SKL,
 _B_NERRP, _B_AMB, _B_SUW, _B_SW2, _B_NFIN) = range(23)
_NB = 23

# Groups of _W elements summed in float32 before a partial sum is widened to
# float64: each float32 lane then adds at most 32 terms, which bounds the
# relative error of a sum of non-negative terms by 33 * 2**-24 < 2e-6.
_SUB = 32
# Relative half-width of the band around a threshold inside which a float32
# decision is not trusted (the float32 quantities are within 2**-21 of the
# float64 ones: a few roundings of 2**-24 each).
_BAND = 2.0 ** -19


_T1_LO, _T1_HI = _f32_down(0.001 * (1 - _BAND)), _f32_up(0.001 * (1 + _BAND))
_T5_LO, _T5_HI = _f32_down(0.005 * (1 - _BAND)), _f32_up(0.005 * (1 + _BAND))



def _no_unroll_md(module, tag):
    """Self-referential loop id carrying llvm.loop.unroll.disable."""
    flag = module.add_metadata([ir.MetaDataString(module, "llvm.loop.unroll.disable")])
    md = module.add_metadata([ir.MetaDataString(module, "layerdiff." + tag), flag])
    md.operands = (md, flag)
    return md


class _Emitter:
    """IR helpers shared by the block kernels (one function being built)."""

    _lo_mask = ir.Constant(ir.VectorType(_I32, _W // 2), list(range(_W // 2)))
    _hi_mask = ir.Constant(ir.VectorType(_I32, _W // 2), list(range(_W // 2, _W)))

    def __init__(self, fn, b, outp):
        self.fn, self.b, self.outp = fn, b, outp

    def splat(self, v, ty):
        b = self.b
        vec = b.insert_element(ir.Constant(ty, ir.Undefined), v, ir.Constant(_I32, 0))
        return b.shuffle_vector(vec, ir.Constant(ty, ir.Undefined),
                                ir.Constant(ir.VectorType(_I32, ty.count), [0] * ty.count))

    def load(self, ptr, half, i):
        """Group i (_W elements) of a float32 or float16-bits array."""
        b = self.b
        off = b.mul(i, ir.Constant(_I64, _W))
        if half:
            v = b.load(b.gep(ptr, [off], source_etype=_I16), typ=_VH)
            v.align = 2
            return _emit_h2f(b, v)
        v = b.load(b.gep(ptr, [off], source_etype=_F32), typ=_VF)
        v.align = 4
        return v

    def prefetch(self, ptr, half, i, ahead):
        """Prefetch the group ``ahead`` elements past group i.

        Each block is first read by sweep 1 and then only from L1: without
        this the memory sits idle during the later sweeps and the load of
        the next block waits for them.  Prefetching a block ahead (a hint:
        it never faults, also past the end of the array) overlaps the two.
        """
        b = self.b
        off = b.add(b.mul(i, ir.Constant(_I64, _W)), ir.Constant(_I64, ahead))
        p = b.gep(ptr, [off], source_etype=_I16 if half else _F32)
        fnty = ir.FunctionType(ir.VoidType(), [_PTR, _I32, _I32, _I32])
        fn = cgutils.get_or_insert_function(b.module, fnty, "llvm.prefetch.p0")
        b.call(fn, [p, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])

    def halves(self, v):
        b = self.b
        return (b.fpext(b.shuffle_vector(v, v, self._lo_mask), _VHD),
                b.fpext(b.shuffle_vector(v, v, self._hi_mask), _VHD))

    def store(self, idx, val):
        self.b.store(val, self.b.gep(self.outp, [ir.Constant(_I64, idx)], source_etype=_F64))

    def reduce(self, v, pick):
        b = self.b
        s = b.extract_element(v, ir.Constant(_I32, 0))
        for k in range(1, v.type.count):
            s = pick(b, s, b.extract_element(v, ir.Constant(_I32, k)))
        return s

    def loop(self, start, stop, inits, body, unroll=False):
        """for i in range(start, stop) (at least one trip) carrying ``inits``."""
        b, fn = self.b, self.fn
        pre = b.block
        hdr = fn.append_basic_block("sweep")
        ex = fn.append_basic_block("sweep_end")
        b.branch(hdr)
        b.position_at_end(hdr)
        i = b.phi(_I64)
        i.add_incoming(start, pre)
        phis = {}
        for k, v in inits.items():
            phis[k] = b.phi(v.type)
            phis[k].add_incoming(v, pre)
        nxt = body(i, dict(phis))
        i_next = b.add(i, ir.Constant(_I64, 1))
        end = b.block
        i.add_incoming(i_next, end)
        for k, ph in phis.items():
            ph.add_incoming(nxt[k], end)
        br = b.cbranch(b.icmp_signed("<", i_next, stop), hdr, ex)
        if not unroll:
            # Unrolling these bodies only adds register spills.
            br.set_metadata("llvm.loop", _no_unroll_md(b.module, hdr.name))
        b.position_at_end(ex)
        return nxt


def _fsum(bb, x, y):
    return bb.fadd(x, y)


def _isum(bb, x, y):
    return bb.add(x, y)


def _umax(bb, x, y):
    return bb.select(bb.icmp_unsigned(">", x, y), x, y)


def _umin(bb, x, y):
    return bb.select(bb.icmp_unsigned("<", x, y), x, y)


# Moments and squares are taken of values scaled by 2**40 (exact): with every
# non-zero input magnitude >= _TINY (smaller ones send the block to the
# scalar path) no product of two non-zero scaled differences falls below the
# float32 normal range, and with magnitudes <= 65504 none overflows.
_SCALE = 2.0 ** 40
_TINY = 2.0 ** -80
_TINY_BITS = 0x17800000          # bits of float32 2**-80


def _build_block_fn(module, name, ref_half, dev_half):
    """float32 vector kernel over ``ng`` groups of _W elements of one block.

    The block (<= 16 KiB) stays in L1 and is swept in four parts, run as
    separate loops or merged ones (``_SWEEP_GROUPS``) so that each loop's
    accumulators live in registers.  Per element work is done in _W float32
    lanes; every sum is widened to float64 after ``_SUB`` groups (<= 32
    float32 additions per lane), and the block's float64 partial sums are
    what the caller merges.

    1. max and min non-zero |r|, |d| bit patterns, and the moments of
       u = r - shift_r and w = (d - shift_d) - u: the d-moments are rebuilt
       in float64 from (u, w) so that 1 - pearson and 1 - cosine keep
       relative accuracy (they depend only on how w varies), and a constant
       r or d still gives exactly zero variance (u == 0, resp. w == -u).
       If a NaN, an Inf, a magnitude above 65504 or a non-zero magnitude
       below _TINY shows up, the kernel returns 1 at once: the caller
       redoes the block on the exact scalar path.
    2. e^2, |e| sum and max, |r|, |d| and |d| - |r| sums, and the "may
       mismatch" count (``_fast_tolerances``).
    3. relative error sum, max and threshold counts (with a band of
       ``_BAND`` around each threshold).
    4. the KL log term (a loop of its own with 16 registers: its constants
       alone fill them).

    The caller reruns the exact float64 sweep (``_build_exact_fn``) when a
    mismatch is possible, a threshold count fell in the band, or the block's
    float32 maximum of |e| or of the relative error could raise the running
    maximum: counts, offsets and maxima therefore stay exact.
    """
    fnty = ir.FunctionType(_I64, [_PTR, _PTR, _I64, _F64, _F64, _F64, _F64, _PTR])
    fn = ir.Function(module, fnty, name=name)
    fn.linkage = "internal"
    fn.attributes.add("nounwind")
    rp, dp, ng, rtol_lo, atol_lo, shift_r, shift_d, outp = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    em = _Emitter(fn, b, outp)
    zero64 = ir.Constant(_I64, 0)
    sub = ir.Constant(_I64, _SUB)
    nsub = b.sdiv(b.add(ng, ir.Constant(_I64, _SUB - 1)), sub)
    zf = _c(_VF, 0.0)
    zi = _c(_VI, 0)
    zdw = _c(_VD, 0.0)
    absmask = _c(_VI, 0x7FFFFFFF)
    kv = _c(_VF, _SCALE)

    def fabs_bits(v):
        return b.and_(b.bitcast(v, _VI), absmask)

    def sweep(keep, sums, body):
        """Nested loop: ``keep`` values carried through, ``sums`` (float32)
        restarted every _SUB groups and added to float64 totals."""
        def outer(j, o):
            lo = b.mul(j, sub)
            hi = b.add(lo, sub)
            hi = b.select(b.icmp_signed("<", hi, ng), hi, ng)
            inits = {k: o[k] for k in keep}
            inits.update({k: zf for k in sums})
            a = em.loop(lo, hi, inits, body)
            out = {k: a[k] for k in keep}
            for k in sums:
                out[k + "64"] = b.fadd(o[k + "64"], b.fpext(a[k], _VD))
            return out

        inits = dict(keep)
        inits.update({k + "64": zdw for k in sums})
        o = em.loop(zero64, nsub, inits, outer)
        tot = {k: o[k] for k in keep}
        tot.update({k: em.reduce(o[k + "64"], _fsum) for k in sums})
        return tot

    def count(acc, cond):
        return b.sub(acc, b.sext(cond, _VI))

    sr32 = b.fptrunc(shift_r, _F32)
    sd32 = b.fptrunc(shift_d, _F32)
    srk = em.splat(b.fmul(b.fneg(sr32), ir.Constant(_F32, _SCALE)), _VF)
    sdk = em.splat(b.fmul(b.fneg(sd32), ir.Constant(_F32, _SCALE)), _VF)
    one = _c(_VI, 1)
    rtolv = em.splat(b.fptrunc(rtol_lo, _F32), _VF)
    atolv = em.splat(b.fptrunc(atol_lo, _F32), _VF)
    eps32 = _c(_VF, float(_EPS_32))

    # ---- 1: range check and moments ----------------------------------------
    def body1(i, a):
        rv = em.load(rp, ref_half, i)
        dv = em.load(dp, dev_half, i)
        rb = fabs_bits(rv)
        db = fabs_bits(dv)
        a["mxb"] = _umax(b, a["mxb"], _umax(b, rb, db))
        # (bits - 1) wraps 0 to the top, so the minimum is over non-zeros.
        a["mnb"] = _umin(b, a["mnb"], _umin(b, b.sub(rb, one), b.sub(db, one)))
        u = _fma(b, rv, kv, srk)
        v = _fma(b, dv, kv, sdk)
        w = b.fsub(v, u)
        a["su"] = b.fadd(a["su"], u)
        a["sw"] = b.fadd(a["sw"], w)
        a["su2"] = _fma(b, u, u, a["su2"])
        a["sw2"] = _fma(b, w, w, a["sw2"])
        a["suw"] = _fma(b, u, w, a["suw"])
        return a

    # ---- 2: error magnitudes, |r|, |d|, tolerance pre-test -----------------
    def body2(i, a):
        rv = em.load(rp, ref_half, i)
        dv = em.load(dp, dev_half, i)
        ar = _fabs(b, rv)
        ad = _fabs(b, dv)
        e = b.fsub(dv, rv)
        ae = _fabs(b, e)
        es = b.fmul(e, kv)
        a["se2"] = _fma(b, es, es, a["se2"])
        a["sae"] = b.fadd(a["sae"], ae)
        a["mae"] = _fmax(b, ae, a["mae"])
        a["sar"] = b.fadd(a["sar"], ar)
        a["sad"] = b.fadd(a["sad"], ad)
        a["sdr"] = b.fadd(a["sdr"], b.fsub(ad, ar))
        tol = _fmax(b, _fma(b, ar, rtolv, atolv), zf)
        a["nerrp"] = count(a["nerrp"], b.fcmp_ordered(">", ae, tol))
        return a

    # ---- 3: relative error and threshold counts -----------------------------
    def body3(i, a):
        rv = em.load(rp, ref_half, i)
        dv = em.load(dp, dev_half, i)
        ar = _fabs(b, rv)
        ae = _fabs(b, b.fsub(dv, rv))
        den = b.select(b.fcmp_ordered("==", rv, zf), eps32, ar)
        rel = b.fdiv(ae, den)
        a["srel"] = b.fadd(a["srel"], rel)
        a["mrel"] = _fmax(b, rel, a["mrel"])
        a["c1lo"] = count(a["c1lo"], b.fcmp_ordered("<", rel, _c(_VF, _T1_LO)))
        a["c1hi"] = count(a["c1hi"], b.fcmp_ordered("<", rel, _c(_VF, _T1_HI)))
        a["c5lo"] = count(a["c5lo"], b.fcmp_ordered("<", rel, _c(_VF, _T5_LO)))
        a["c5hi"] = count(a["c5hi"], b.fcmp_ordered("<", rel, _c(_VF, _T5_HI)))
        return a

    # ---- 4: KL log term -----------------------------------------------------
    def body4(i, a):
        rv = em.load(rp, ref_half, i)
        dv = em.load(dp, dev_half, i)
        ar = _fabs(b, rv)
        lg = _emit_log32(b, b.fdiv(_fmax(b, ar, eps32), _fmax(b, _fabs(b, dv), eps32)))
        a["skl"] = _fma(b, ar, lg, a["skl"])
        return a

    specs = {
        1: ({"mxb": zi, "mnb": _c(_VI, -1)}, ("su", "sw", "su2", "sw2", "suw"), body1),
        2: ({"mae": zf, "nerrp": zi}, ("se2", "sae", "sar", "sad", "sdr"), body2),
        3: (dict({k: zi for k in ("c1lo", "c1hi", "c5lo", "c5hi")}, mrel=zf), ("srel",),
            body3),
        4: ({}, ("skl",), body4),
    }

    def fused(group):
        def body(i, a):
            if group is groups[-1]:
                # The block's last sweep: bring the next block in meanwhile.
                em.prefetch(rp, ref_half, i, _BLOCK)
                em.prefetch(dp, dev_half, i, _BLOCK)
            for k in group:
                a = specs[k][2](i, a)
            return a
        keep, sums = {}, ()
        for k in group:
            keep.update(specs[k][0])
            sums += specs[k][1]
        return sweep(keep, sums, body)

    # Sweeps sharing one loop read each element once (LLVM merges the
    # repeated loads and conversions).
    groups = _SWEEP_GROUPS
    t = fused(groups[0])
    maxbits = em.reduce(t["mxb"], _umax)
    minbits = em.reduce(t["mnb"], _umin)
    bad = b.or_(b.icmp_unsigned(">", maxbits, ir.Constant(_I32, _FP16_MAX_BITS)),
                b.icmp_unsigned("<", minbits, ir.Constant(_I32, _TINY_BITS - 1)))
    bail = fn.append_basic_block("bail")
    go = fn.append_basic_block("go")
    b.cbranch(bad, bail, go)
    b.position_at_end(bail)
    b.ret(ir.Constant(_I64, 1))
    b.position_at_end(go)
    for g in groups[1:]:
        t.update(fused(g))

    ik = ir.Constant(_F64, 1.0 / _SCALE)
    ik2 = ir.Constant(_F64, 1.0 / (_SCALE * _SCALE))
    su2, suw, sw2 = t["su2"], t["suw"], t["sw2"]
    em.store(_B_SU, b.fmul(t["su"], ik))
    em.store(_B_SV, b.fmul(b.fadd(t["su"], t["sw"]), ik))
    em.store(_B_SU2, b.fmul(su2, ik2))
    # (su2 + 2 suw) + sw2: exactly 0 when w == -u everywhere (constant d).
    em.store(_B_SV2, b.fmul(b.fadd(b.fadd(su2, b.fmul(suw, ir.Constant(_F64, 2.0))), sw2),
                            ik2))
    em.store(_B_SUV, b.fmul(b.fadd(su2, suw), ik2))
    em.store(_B_SUW, b.fmul(suw, ik2))
    em.store(_B_SW2, b.fmul(sw2, ik2))

    em.store(_B_SE2, b.fmul(t["se2"], ik2))
    em.store(_B_SAE, t["sae"])
    em.store(_B_MAE, b.fpext(em.reduce(t["mae"], _fmax), _F64))
    sar, sad, sdr = t["sar"], t["sad"], t["sdr"]
    em.store(_B_SAR, sar)
    # sum |d| as sum |r| + sum (|d| - |r|) while that does not cancel: then
    # ln(sum|d| / sum|r|) in KL keeps relative accuracy however small it is.
    small = b.fcmp_ordered("<=", b.call(
        cgutils.get_or_insert_function(module, ir.FunctionType(_F64, [_F64]), "llvm.fabs.f64"),
        [sdr]), b.fmul(sar, ir.Constant(_F64, 0.5)))
    em.store(_B_SAD, b.select(small, b.fadd(sar, sdr), sad))
    em.store(_B_NERRP, b.sitofp(em.reduce(t["nerrp"], _isum), _F64))

    def icount(v):
        return b.sitofp(em.reduce(v, _isum), _F64)

    em.store(_B_SREL, t["srel"])
    em.store(_B_SKL, t["skl"])
    em.store(_B_MREL, b.fpext(em.reduce(t["mrel"], _fmax), _F64))
    em.store(_B_C1, icount(t["c1lo"]))
    em.store(_B_C5, icount(t["c5lo"]))
    em.store(_B_AMB, icount(b.add(b.sub(t["c1hi"], t["c1lo"]), b.sub(t["c5hi"], t["c5lo"]))))
    for idx in (_B_NERR, _B_SERR, _B_MERR):
        em.store(idx, ir.Constant(_F64, 0.0))
    b.ret(ir.Constant(_I64, 0))
    return fn


def _build_exact_fn(module, name, ref_half, dev_half):
    """float64 tolerance test and relative error over ``ng`` groups of _W.

    Writes the mismatch count, |e| sum and max over mismatches, the max of
    |e|, relative error sum and max and the threshold counts, all with the same IEEE
    float64 operations as the scalar path and ``reference_metrics``.
    """
    fnty = ir.FunctionType(ir.VoidType(), [_PTR, _PTR, _I64, _F64, _F64, _PTR])
    fn = ir.Function(module, fnty, name=name)
    fn.linkage = "internal"
    fn.attributes.add("nounwind")
    rp, dp, ng, atol, rtol, outp = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    em = _Emitter(fn, b, outp)
    zd = _c(_VHD, 0.0)
    zl = _c(_VHL, 0)
    atolv = em.splat(atol, _VHD)
    rtolv = em.splat(rtol, _VHD)

    def body(i, a):
        rv = em.load(rp, ref_half, i)
        dv = em.load(dp, dev_half, i)
        for x, y in zip(em.halves(rv), em.halves(dv)):
            ax = _fabs(b, x)
            ae = _fabs(b, b.fsub(y, x))
            a["mae"] = _fmax(b, ae, a["mae"])
            # No fast-math flags anywhere here: these must round exactly like
            # the scalar path and like numpy's ``atol + rtol * |r|``.
            tol = b.fadd(b.fmul(ax, rtolv), atolv)
            mis = b.fcmp_ordered(">", ae, tol)
            a["nerr"] = b.add(a["nerr"], b.zext(mis, _VHL))
            emis = b.select(mis, ae, zd)
            a["serr"] = b.fadd(a["serr"], emis)
            a["merr"] = _fmax(b, emis, a["merr"])
            den = b.select(b.fcmp_ordered("==", x, zd), _c(_VHD, REL_EPS), ax)
            rel = b.fdiv(ae, den)
            a["srel"] = b.fadd(a["srel"], rel)
            a["mrel"] = _fmax(b, rel, a["mrel"])
            a["c1"] = b.add(a["c1"], b.zext(b.fcmp_ordered("<", rel, _c(_VHD, 0.001)), _VHL))
            a["c5"] = b.add(a["c5"], b.zext(b.fcmp_ordered("<", rel, _c(_VHD, 0.005)), _VHL))
        return a

    inits = {"nerr": zl, "c1": zl, "c5": zl, "serr": zd, "merr": zd, "srel": zd,
             "mrel": zd, "mae": zd}
    a = em.loop(ir.Constant(_I64, 0), ng, inits, body)
    em.store(_B_MAE, em.reduce(a["mae"], _fmax))
    em.store(_B_SERR, em.reduce(a["serr"], _fsum))
    em.store(_B_MERR, em.reduce(a["merr"], _fmax))
    em.store(_B_SREL, em.reduce(a["srel"], _fsum))
    em.store(_B_MREL, em.reduce(a["mrel"], _fmax))
    em.store(_B_NERR, b.sitofp(em.reduce(a["nerr"], _isum), _F64))
    em.store(_B_C1, b.sitofp(em.reduce(a["c1"], _isum), _F64))
    em.store(_B_C5, b.sitofp(em.reduce(a["c5"], _isum), _F64))
    b.ret_void()
    return fn


def _get_fn(module, builder, prefix, ref_half, dev_half):
    name = f"layerdiff_metrics_{prefix}_{'h' if ref_half else 'f'}{'h' if dev_half else 'f'}"
    try:
        return module.get_global(name)
    except KeyError:
        return builder(module, name, ref_half, dev_half)


def _is_f32_or_half_array(t):
    return (isinstance(t, types.Array) and t.ndim == 1 and t.layout == "C"
            and t.dtype in (types.float32, types.uint16))


def _data_ptrs(context, builder, sig, args, start):
    ra = context.make_array(sig.args[0])(context, builder, args[0])
    da = context.make_array(sig.args[1])(context, builder, args[1])
    oa = context.make_array(sig.args[-1])(context, builder, args[-1])
    return (builder.gep(ra.data, [start], inbounds=True),
            builder.gep(da.data, [start], inbounds=True), oa.data)


@intrinsic
def _block_kernel(typingctx, r, d, start, ng, rtol_lo, atol_lo, shift_r, shift_d, out):
    if not (_is_f32_or_half_array(r) and _is_f32_or_half_array(d)):
        return None
    sig = types.int64(r, d, types.int64, types.int64, types.float64, types.float64,
                      types.float64, types.float64, out)

    def codegen(context, builder, sig, args):
        rptr, dptr, optr = _data_ptrs(context, builder, sig, args, args[2])
        fn = _get_fn(builder.module, _build_block_fn, "block",
                     sig.args[0].dtype == types.uint16, sig.args[1].dtype == types.uint16)
        return builder.call(fn, [rptr, dptr, args[3], args[4], args[5], args[6], args[7],
                                 optr])

    return sig, codegen


@intrinsic
def _exact_kernel(typingctx, r, d, start, ng, atol, rtol, out):
    if not (_is_f32_or_half_array(r) and _is_f32_or_half_array(d)):
        return None
    sig = types.none(r, d, types.int64, types.int64, types.float64, types.float64, out)

    def codegen(context, builder, sig, args):
        rptr, dptr, optr = _data_ptrs(context, builder, sig, args, args[2])
        fn = _get_fn(builder.module, _build_exact_fn, "exact",
                     sig.args[0].dtype == types.uint16, sig.args[1].dtype == types.uint16)
        builder.call(fn, [rptr, dptr, args[3], args[4], args[5], optr])
        return context.get_dummy_value()

    return sig, codegen


def _scalar_intrinsic(name: str, arg, ret, emit):
    """A one-argument intrinsic whose body is emitted by ``emit(builder, x)``
    (the scalar path uses the same float32 log and float16 widening as the
    vector kernel)."""
    def typer(typingctx, x):
        if x != arg:
            return None

        def codegen(context, builder, sig, args):
            return emit(builder, args[0])

        return ret(arg), codegen

    typer.__name__ = typer.__qualname__ = name
    return intrinsic(typer)


_log32 = _scalar_intrinsic("_log32", types.float32, types.float32, _emit_log32)
_h2f = _scalar_intrinsic("_h2f", types.uint16, types.float32, _emit_h2f)


def _ld32(a, i):
    raise NotImplementedError


@overload(_ld32)
def _ov_ld32(a, i):
    # uint16 arrays reaching the compiled code are always float16 bit views.
    if a.dtype == types.uint16:
        return lambda a, i: _h2f(a[i])
    if a.dtype == types.float32:
        return lambda a, i: a[i]


# ---------------------------------------------------------------------------
# Scalar element path (block tails, blocks holding NaN/Inf/|x|>65504, and
# every other dtype, which is widened to float64 piecewise)
# ---------------------------------------------------------------------------



_replace64 = njit(inline="always", error_model="numpy")(display_value)


@njit(inline="always", error_model="numpy")
def _finite(v):
    return abs(v) < np.inf


@njit(inline="always", error_model="numpy")
def _mismatch64(x, y, atol, rtol):
    """Element mismatch test (metrics.py's docstring): tolerance on a finite pair,
    anything but the same infinity on both sides otherwise."""
    if _finite(x) and _finite(y):
        return abs(y - x) > abs(x) * rtol + atol
    return not (x == y)


# Per-call integer counters (spc) of the scalar paths.
_S_REF_NAN, _S_REF_INF, _S_DEV_NAN, _S_DEV_INF, _S_REF_OVF, _S_DEV_OVF = 0, 1, 2, 3, 4, 5
_S_BOTH_NAN, _S_NFE = 6, 7
_NS = 8


@njit(inline="always", error_model="numpy")
def _count_special(x, y, ovf_r, ovf_d, spc):
    # Only called for pairs with a value outside [-65504, 65504] or NaN.
    # ovf_*: whether the side is a float tensor (an FP16 range applies).
    _count_special_side(x, ovf_r, spc, _S_REF_NAN, _S_REF_INF, _S_REF_OVF)
    _count_special_side(y, ovf_d, spc, _S_DEV_NAN, _S_DEV_INF, _S_DEV_OVF)


@njit(inline="always", error_model="numpy")
def _count_special_side(v, ovf, spc, at_nan, at_inf, at_ovf):
    if v != v:
        spc[at_nan] += 1
    elif abs(v) == np.inf:
        spc[at_inf] += 1
    elif ovf and abs(v) > FP16_MAX:
        spc[at_ovf] += 1


@njit(inline="always", error_model="numpy")
def _nonfinite_pair(x, y, blk, spc):
    # Enters no statistic; a mismatch unless both sides are the same infinity.
    if x != x and y != y:
        spc[_S_BOTH_NAN] += 1
    if not (x == y):
        blk[_B_NERR] += 1.0
        spc[_S_NFE] += 1


@njit(inline="always", error_model="numpy")
def _elem_stats(x, y, e, ae, mis, sr, sd, blk):
    # One finite pair: x, y the values as float64, e = d - r, ae = |e|.
    # Same operations, with the same rounding, as the float64 sweep
    # (_build_exact_fn) and reference_metrics.
    u = x - sr
    v = y - sd
    ax = abs(x)
    blk[_B_NFIN] += 1.0
    blk[_B_SU] += u
    blk[_B_SU2] += u * u
    blk[_B_SV] += v
    blk[_B_SV2] += v * v
    blk[_B_SUV] += u * v
    blk[_B_SE2] += e * e
    blk[_B_SAE] += ae
    if ae > blk[_B_MAE]:
        blk[_B_MAE] = ae
    blk[_B_SAR] += ax
    blk[_B_SAD] += abs(y)
    if mis:
        blk[_B_NERR] += 1.0
        blk[_B_SERR] += ae
        if ae > blk[_B_MERR]:
            blk[_B_MERR] = ae
    den = ax if x != 0.0 else REL_EPS
    rel = ae / den
    blk[_B_SREL] += rel
    if rel > blk[_B_MREL]:
        blk[_B_MREL] = rel
    if rel < 0.001:
        blk[_B_C1] += 1.0
    if rel < 0.005:
        blk[_B_C5] += 1.0


@njit(inline="always", error_model="numpy")
def _elem_common(x, y, sr, sd, atol, rtol, blk):
    # x, y: a finite pair as float64.
    e = y - x
    ae = abs(e)
    _elem_stats(x, y, e, ae, ae > abs(x) * rtol + atol, sr, sd, blk)


@njit(inline="always", error_model="numpy")
def _log_term64(x, y):
    return math.log(max(abs(x), REL_EPS)) - math.log(max(abs(y), REL_EPS))


@njit(inline="always", error_model="numpy")
def _elem32(rr, dd, sr, sd, atol, rtol, blk, spc):
    # rr, dd: raw float32 values.
    if abs(rr) <= _FP16_MAX_32 and abs(dd) <= _FP16_MAX_32:
        _elem_common(np.float64(rr), np.float64(dd), sr, sd, atol, rtol, blk)
        qa = max(abs(rr), _EPS_32)
        qb = max(abs(dd), _EPS_32)
        blk[_B_SKL] += np.float64(abs(rr) * _log32(qa / qb))
    else:
        x = np.float64(rr)
        y = np.float64(dd)
        _count_special(x, y, True, True, spc)
        if _finite(x) and _finite(y):
            _elem_common(x, y, sr, sd, atol, rtol, blk)
            blk[_B_SKL] += abs(x) * _log_term64(x, y)
        else:
            _nonfinite_pair(x, y, blk, spc)


@njit(inline="always", error_model="numpy")
def _elem64(x, y, sr, sd, atol, rtol, blk, spc, ovf_r, ovf_d):
    if not (abs(x) <= FP16_MAX and abs(y) <= FP16_MAX):
        _count_special(x, y, ovf_r, ovf_d, spc)
        if not (_finite(x) and _finite(y)):
            _nonfinite_pair(x, y, blk, spc)
            return
    _elem_common(x, y, sr, sd, atol, rtol, blk)
    blk[_B_SKL] += abs(x) * _log_term64(x, y)


# The top bit of a uint64 (2**63).
_U63 = np.uint64(1 << 63)


@njit(inline="always", error_model="numpy")
def _isplit(v, uns):
    """(negative, magnitude as uint64) of an integer given as int64; with
    ``uns`` the int64 holds the bits of a uint64."""
    if uns or v >= 0:
        return False, np.uint64(v)
    return True, np.uint64(-(v + 1)) + np.uint64(1)


@njit(inline="always", error_model="numpy")
def _ifloat(neg, mag):
    f = np.float64(mag)
    return -f if neg else f


@njit(inline="always", error_model="numpy")
def _idiff(rn, rm, dn, dm):
    """d - r of two sign/magnitude integers, rounded once to float64.

    The magnitude of the difference can reach 2**64 + 2**63 (uint64 max
    against int64 min): when the sum of magnitudes carries past 2**64, half
    of it (with the dropped bit kept as a sticky bit, so that the rounding
    is still the correct one) fits a uint64 and is converted instead."""
    if rn == dn:
        if dm >= rm:
            ae = np.float64(dm - rm)
            pos = not dn
        else:
            ae = np.float64(rm - dm)
            pos = dn
    else:
        t = rm + dm
        if t < rm:
            ae = 2.0 * np.float64((t >> np.uint64(1)) | (t & np.uint64(1)) | _U63)
        else:
            ae = np.float64(t)
        pos = rn
    return ae if pos else -ae


@njit(error_model="numpy", nogil=True, cache=True)
def _merge_moments(iv, fv, n_b, mean_r, m2_r, mean_d, m2_d, c_rd):
    """Chan et al. pairwise update of the centred moments in (iv, fv)."""
    n_a = iv[_I_NFIN]
    if n_b == 0:
        return
    if n_a == 0:
        fv[_F_MEAN_R] = mean_r
        fv[_F_M2_R] = m2_r
        fv[_F_MEAN_D] = mean_d
        fv[_F_M2_D] = m2_d
        fv[_F_C_RD] = c_rd
        return
    n = n_a + n_b
    dr = mean_r - fv[_F_MEAN_R]
    dd = mean_d - fv[_F_MEAN_D]
    w = n_b / n
    f = n_a * w
    fv[_F_MEAN_R] += dr * w
    fv[_F_MEAN_D] += dd * w
    fv[_F_M2_R] += m2_r + dr * dr * f
    fv[_F_M2_D] += m2_d + dd * dd * f
    fv[_F_C_RD] += c_rd + dr * dd * f


@njit(error_model="numpy", nogil=True, cache=True)
def _merge_block(iv, fv, blk, m, sr, sd):
    # m: elements of the block; the sums are over its blk[_B_NFIN] finite pairs.
    mf = np.int64(blk[_B_NFIN])
    if mf > 0:
        mu = blk[_B_SU] / mf
        mv = blk[_B_SV] / mf
        # The shifts are values of the block, so these differences lose at
        # most ~m ulps even when a shift is an outlier; a constant block has
        # u == 0 (v == 0) everywhere and gets exactly zero variance.
        m2_r = max(blk[_B_SU2] - blk[_B_SU] * mu, 0.0)
        m2_d = max(blk[_B_SV2] - blk[_B_SV] * mv, 0.0)
        c_rd = blk[_B_SUV] - blk[_B_SU] * mv
        _merge_moments(iv, fv, mf, sr + mu, m2_r, sd + mv, m2_d, c_rd)
        iv[_I_NFIN] += mf
    iv[_I_N] += m
    nerr = np.int64(blk[_B_NERR])
    iv[_I_NERR] += nerr
    iv[_I_REL1] += np.int64(blk[_B_C1])
    iv[_I_REL5] += np.int64(blk[_B_C5])
    fv[_F_SUM_ERR] += blk[_B_SERR]
    if nerr > 0 and blk[_B_MERR] > fv[_F_MAX_ERR]:
        fv[_F_MAX_ERR] = blk[_B_MERR]
    fv[_F_SUM_AE] += blk[_B_SAE]
    if blk[_B_MAE] > fv[_F_MAX_AE]:
        fv[_F_MAX_AE] = blk[_B_MAE]
    fv[_F_SUM_REL] += blk[_B_SREL]
    if blk[_B_MREL] > fv[_F_MAX_REL]:
        fv[_F_MAX_REL] = blk[_B_MREL]
    fv[_F_SUM_E2] += blk[_B_SE2]
    fv[_F_SUM_AR] += blk[_B_SAR]
    fv[_F_SUM_AD] += blk[_B_SAD]
    fv[_F_SUM_KL] += blk[_B_SKL]


@njit(error_model="numpy", nogil=True, cache=True)
def _finish_specials(iv, spc):
    iv[_I_REF_NAN] += spc[_S_REF_NAN]
    iv[_I_REF_INF] += spc[_S_REF_INF]
    iv[_I_DEV_NAN] += spc[_S_DEV_NAN]
    iv[_I_DEV_INF] += spc[_S_DEV_INF]
    iv[_I_REF_OVF] += spc[_S_REF_OVF]
    iv[_I_DEV_OVF] += spc[_S_DEV_OVF]
    iv[_I_BOTH_NAN] += spc[_S_BOTH_NAN]
    iv[_I_NFE] += spc[_S_NFE]


# Bounds on the relative error of the float32 |e| (one rounding) and of a
# float32 relative error (a few roundings of 2**-24; inputs below _TINY never
# reach the float32 sweep, so nothing there underflows).
_AE32_GROW = 1.0 + 2.0 ** -22
_REL32_GROW = 1.0 + 2.0 ** -20


@njit(error_model="numpy", nogil=True, cache=True)
def _moments_cancel(blk):
    """The float32 sweep builds the device moments from u and w = v - u, so
    that 1 - cosine keeps its accuracy when device and reference nearly
    agree. When they do not (a device output far smaller than the
    reference, of the opposite sign...), sum v*v = sum u*u + 2 sum u*w +
    sum w*w and sum u*v = sum u*u + sum u*w cancel, and the float32 rounding
    of the parts (about 2e-6 of each) would swamp the result. More than two
    bits lost is the signal to sum the block again in float64."""
    suw = abs(blk[_B_SUW])
    return (blk[_B_SU2] + 2.0 * suw + blk[_B_SW2] > 4.0 * blk[_B_SV2]
            or blk[_B_SU2] + suw > 4.0 * abs(blk[_B_SUV]))


@njit(error_model="numpy", nogil=True, cache=True)
def _redo_moments(r, d, lo, hi, sr, sd, blk):
    """The moment sums of elements [lo, hi) in float64, with the operations
    and rounding of the scalar path (_elem_stats). The float32 sweep only
    takes blocks free of NaN, Inf and out-of-range values, so every pair
    here is finite."""
    su = su2 = sv = sv2 = suv = 0.0
    for i in range(lo, hi):
        u = np.float64(_ld32(r, i)) - sr
        v = np.float64(_ld32(d, i)) - sd
        su += u
        su2 += u * u
        sv += v
        sv2 += v * v
        suv += u * v
    blk[_B_SU] = su
    blk[_B_SU2] = su2
    blk[_B_SV] = sv
    blk[_B_SV2] = sv2
    blk[_B_SUV] = suv


@njit(inline="always", error_model="numpy")
def _shift32(r, d, lo, hi):
    """Moment shifts of block [lo, hi): its first finite pair (0 if none).
    A non-finite value would turn every u = r - shift into NaN or Inf."""
    for i in range(lo, hi):
        x = np.float64(_ld32(r, i))
        y = np.float64(_ld32(d, i))
        if _finite(x) and _finite(y):
            return x, y
    return 0.0, 0.0


@njit(error_model="numpy", nogil=True, cache=True)
def _acc_fast(r, d, atol, rtol, rtol_lo, atol_lo, exact_tol, base, iv, fv, marks):
    """Metric pass over float32 / float16-bits arrays (1-D, C order).

    ``rtol_lo``/``atol_lo`` come from ``_fast_tolerances``; ``exact_tol``
    forces the float64 tolerance sweep on every block (tolerances it cannot
    represent). ``marks`` (empty: not wanted) receives, for each block of
    _BLOCK elements, what the worst-elements search needs of it
    (``_worst_marked``): -1 where nothing mismatches, +Inf where a pair
    with NaN or Inf does, else the largest |d - r| of its mismatches
    (exact: a block that may mismatch is decided in float64).
    """
    n = r.size
    blk = np.empty(_NB, np.float64)
    spc = np.zeros(_NS, np.int64)
    for s in range(0, n, _BLOCK):
        m = min(_BLOCK, n - s)
        nfe = spc[_S_NFE]
        sr, sd = _shift32(r, d, s, s + m)
        ng = m // _W
        blk[:] = 0.0
        start = s
        if ng > 0:
            if _block_kernel(r, d, s, ng, rtol_lo, atol_lo, sr, sd, blk) == 0:
                start = s + ng * _W
                # The kernel only accepts groups of finite pairs.
                blk[_B_NFIN] = np.float64(ng * _W)
                # When a count was not decided (or relative errors are huge)
                # the float64 sweep replaces the block's tolerance and
                # relative-error results.  The float32 maxima of |e| and of
                # the relative error are within _AE32_GROW resp. _REL32_GROW
                # of the float64 ones: when either could raise the running
                # maximum the float64 sweep supplies the maxima only, so
                # that the sums never depend on what came before the block
                # (chunked and whole results then agree).
                mrel = blk[_B_MREL]
                mae = blk[_B_MAE]
                redo = (exact_tol or blk[_B_NERRP] > 0.0 or blk[_B_AMB] > 0.0
                        or mrel >= 1e30)
                if redo or (mae > 0.0 and (mae * _AE32_GROW > fv[_F_MAX_AE]
                                           or mrel * _REL32_GROW > fv[_F_MAX_REL])):
                    srel = blk[_B_SREL]
                    _exact_kernel(r, d, s, ng, atol, rtol, blk)
                    if not redo:
                        blk[_B_SREL] = srel
                if _moments_cancel(blk):
                    _redo_moments(r, d, s, s + ng * _W, sr, sd, blk)
            else:
                blk[:] = 0.0
        for i in range(start, s + m):
            _elem32(_ld32(r, i), _ld32(d, i), sr, sd, atol, rtol, blk, spc)
        if blk[_B_NERR] > 0.0 and iv[_I_FIRST] < 0:
            for i in range(s, s + m):
                x = np.float64(_ld32(r, i))
                y = np.float64(_ld32(d, i))
                if _mismatch64(x, y, atol, rtol):
                    iv[_I_FIRST] = base + i
                    fv[_F_FIRST_REF] = _replace64(x)
                    fv[_F_FIRST_DEV] = _replace64(y)
                    break
        if marks.size:
            marks[s // _BLOCK] = np.inf if spc[_S_NFE] > nfe else (blk[_B_MERR] if blk[_B_NERR] > 0.0 else -1.0)
        _merge_block(iv, fv, blk, m, sr, sd)
    _finish_specials(iv, spc)
    if n > 0 and (iv[_I_V0] < 0 or base < iv[_I_V0]):
        iv[_I_V0] = base
        fv[_F_V0_REF] = _replace64(np.float64(_ld32(r, 0)))
        fv[_F_V0_DEV] = _replace64(np.float64(_ld32(d, 0)))


@njit(error_model="numpy", nogil=True, cache=True)
def _acc_f64(r, d, atol, rtol, base, iv, fv, ovf_r, ovf_d):
    """Same pass, all in float64, for every other dtype (float64 inputs).

    ``ovf_r``/``ovf_d``: whether that side is a float tensor (an integer
    side mixed with a float one counts no FP16 overflow)."""
    n = r.size
    blk = np.empty(_NB, np.float64)
    spc = np.zeros(_NS, np.int64)
    for s in range(0, n, _BLOCK):
        m = min(_BLOCK, n - s)
        sr = sd = 0.0
        for i in range(s, s + m):
            if _finite(r[i]) and _finite(d[i]):
                sr = r[i]
                sd = d[i]
                break
        blk[:] = 0.0
        for i in range(s, s + m):
            _elem64(r[i], d[i], sr, sd, atol, rtol, blk, spc, ovf_r, ovf_d)
        if blk[_B_NERR] > 0.0 and iv[_I_FIRST] < 0:
            for i in range(s, s + m):
                if _mismatch64(r[i], d[i], atol, rtol):
                    iv[_I_FIRST] = base + i
                    fv[_F_FIRST_REF] = _replace64(r[i])
                    fv[_F_FIRST_DEV] = _replace64(d[i])
                    break
        _merge_block(iv, fv, blk, m, sr, sd)
    _finish_specials(iv, spc)
    if n > 0 and (iv[_I_V0] < 0 or base < iv[_I_V0]):
        iv[_I_V0] = base
        fv[_F_V0_REF] = _replace64(r[0])
        fv[_F_V0_DEV] = _replace64(d[0])


@njit(error_model="numpy", nogil=True, cache=True)
def _acc_int(r, d, ru, du, base, iv, fv):
    """Same pass for two integer/bool tensors given as int64 arrays (``ru``/
    ``du``: the array holds uint64 bits).  Pairs compare exactly as
    integers; |e| is the exact difference rounded once to float64, the
    other sums use the values as float64.  Every pair is finite."""
    n = r.size
    blk = np.empty(_NB, np.float64)
    for s in range(0, n, _BLOCK):
        m = min(_BLOCK, n - s)
        rn, rm = _isplit(r[s], ru)
        dn, dm = _isplit(d[s], du)
        sr = _ifloat(rn, rm)
        sd = _ifloat(dn, dm)
        blk[:] = 0.0
        for i in range(s, s + m):
            rn, rm = _isplit(r[i], ru)
            dn, dm = _isplit(d[i], du)
            x = _ifloat(rn, rm)
            y = _ifloat(dn, dm)
            e = _idiff(rn, rm, dn, dm)
            _elem_stats(x, y, e, abs(e), rn != dn or rm != dm, sr, sd, blk)
            blk[_B_SKL] += abs(x) * _log_term64(x, y)
        if blk[_B_NERR] > 0.0 and iv[_I_FIRST] < 0:
            for i in range(s, s + m):
                rn, rm = _isplit(r[i], ru)
                dn, dm = _isplit(d[i], du)
                if rn != dn or rm != dm:
                    iv[_I_FIRST] = base + i
                    fv[_F_FIRST_REF] = _ifloat(rn, rm)
                    fv[_F_FIRST_DEV] = _ifloat(dn, dm)
                    break
        _merge_block(iv, fv, blk, m, sr, sd)
    if n > 0 and (iv[_I_V0] < 0 or base < iv[_I_V0]):
        iv[_I_V0] = base
        rn, rm = _isplit(r[0], ru)
        dn, dm = _isplit(d[0], du)
        fv[_F_V0_REF] = _ifloat(rn, rm)
        fv[_F_V0_DEV] = _ifloat(dn, dm)


@njit(error_model="numpy", nogil=True, cache=True)
def _merge_state(iv, fv, jv, gv):
    """(iv, fv) <- (iv, fv) merged with (jv, gv)."""
    _merge_moments(iv, fv, jv[_I_NFIN], gv[_F_MEAN_R], gv[_F_M2_R], gv[_F_MEAN_D],
                   gv[_F_M2_D], gv[_F_C_RD])
    for k in (_I_N, _I_NFIN, _I_NERR, _I_REF_NAN, _I_REF_INF, _I_DEV_NAN, _I_DEV_INF,
              _I_REF_OVF, _I_DEV_OVF, _I_REL1, _I_REL5, _I_BOTH_NAN, _I_NFE):
        iv[k] += jv[k]
    if jv[_I_FIRST] >= 0 and (iv[_I_FIRST] < 0 or jv[_I_FIRST] < iv[_I_FIRST]):
        iv[_I_FIRST] = jv[_I_FIRST]
        fv[_F_FIRST_REF] = gv[_F_FIRST_REF]
        fv[_F_FIRST_DEV] = gv[_F_FIRST_DEV]
    if jv[_I_V0] >= 0 and (iv[_I_V0] < 0 or jv[_I_V0] < iv[_I_V0]):
        iv[_I_V0] = jv[_I_V0]
        fv[_F_V0_REF] = gv[_F_V0_REF]
        fv[_F_V0_DEV] = gv[_F_V0_DEV]
    for k in (_F_SUM_ERR, _F_SUM_AE, _F_SUM_REL, _F_SUM_E2, _F_SUM_AR, _F_SUM_AD, _F_SUM_KL):
        fv[k] += gv[k]
    for k in (_F_MAX_ERR, _F_MAX_AE, _F_MAX_REL):
        if gv[k] > fv[k]:
            fv[k] = gv[k]


# ---------------------------------------------------------------------------
# Worst elements: the bounded heap behind worst.worst_elements
# ---------------------------------------------------------------------------


@njit(inline="always")
def _worse(a_cls, a_diff, a_idx, b_cls, b_diff, b_idx):
    # Class 0 (non-finite pairs, |e| kept at 0 so that they go by index)
    # before class 1 (finite pairs: larger |e| first), then smaller index.
    if a_cls != b_cls:
        return a_cls < b_cls
    return a_diff > b_diff or (a_diff == b_diff and a_idx < b_idx)



@njit(inline="always", error_model="numpy")
def _heap_move(hdiff, hidx, hcls, src, dst):
    """Entry ``src`` of the worst-elements heap into slot ``dst``."""
    hdiff[dst] = hdiff[src]
    hidx[dst] = hidx[src]
    hcls[dst] = hcls[src]


@njit(inline="always")
def _heap_add(k, hidx, hdiff, hcls, i, ae, cls):
    """Add (i, ae, cls) to the bounded heap (root = least bad kept) of ``k``
    entries; returns the new k."""
    if k < hidx.size:
        c = k
        k += 1
        while c > 0:
            p = (c - 1) // 2
            if _worse(hcls[p], hdiff[p], hidx[p], cls, ae, i):
                _heap_move(hdiff, hidx, hcls, p, c)
                c = p
            else:
                break
    elif _worse(cls, ae, i, hcls[0], hdiff[0], hidx[0]):
        c = 0
        while True:
            lft = 2 * c + 1
            if lft >= k:
                break
            ch = lft
            if lft + 1 < k and _worse(hcls[lft], hdiff[lft], hidx[lft],
                                      hcls[lft + 1], hdiff[lft + 1], hidx[lft + 1]):
                ch = lft + 1
            if _worse(cls, ae, i, hcls[ch], hdiff[ch], hidx[ch]):
                _heap_move(hdiff, hidx, hcls, ch, c)
                c = ch
            else:
                break
    else:
        return k
    hdiff[c] = ae
    hidx[c] = i
    hcls[c] = cls
    return k


def _ld64(a, i):
    raise NotImplementedError


@overload(_ld64)
def _ov_ld64(a, i):
    # float64 arrays as they are; float32 arrays and float16 bit views widened
    if a.dtype == types.float64:
        return lambda a, i: a[i]
    if a.dtype in (types.float32, types.uint16):
        return lambda a, i: np.float64(_ld32(a, i))


# Elements the search reads at a time: once the heap is full, a block is
# first counted for pairs that would enter it (a branch-free, vectorized
# pass) and passed over where none would.
_WORST_BLOCK = 512


@njit(inline="always", error_model="numpy")
def _may_enter(r, d, b0, b1, floor, atol, rtol):
    # How many pairs of [b0, b1) may enter a heap whose root is ``floor``
    # (0 while it fills): a NaN or Inf pair that is not the same infinity,
    # or a mismatch worse than the root. The block is indexed as a slice of
    # its own: an index numba cannot prove non-negative (b0 + j) is wrapped
    # around element by element, and that alone keeps a loop from being
    # vectorized (here and in the sums below: 2-4x slower).
    rb = r[b0:b1]
    db = d[b0:b1]
    hits = 0
    for j in range(rb.size):
        x = rb[j]
        y = db[j]
        ae = abs(y - x)
        nonfinite = (x - x != 0.0) | (y - y != 0.0)
        hits += (nonfinite & (x != y)) | ((ae > abs(x) * rtol + atol) & (ae > floor))
    return hits


@njit(error_model="numpy", nogil=True, cache=True)
def _worst(r, d, atol, rtol, base, k, hidx, hdiff, hcls):
    """The worst mismatches into the heap (see _heap_add), of float64
    arrays (float32 and float16 take ``_worst_marked``). Indices only grow
    from call to call, so once the heap is full a finite pair enters only
    with a larger abs_diff than its root's, and a pair with NaN or Inf
    always does (unless the root is one: then none can): a block where
    ``_may_enter`` finds none is passed over, as is one without a
    mismatch while the heap fills."""
    n = r.size
    if hidx.size == 0:
        return k
    for b0 in range(0, n, _WORST_BLOCK):
        b1 = min(b0 + _WORST_BLOCK, n)
        full = k == hidx.size
        if full and hcls[0] == 0:
            return k
        if _may_enter(r, d, b0, b1, hdiff[0] if full else 0.0, atol, rtol) == 0:
            continue
        k = _worst_scan(r, d, b0, b1, atol, rtol, base, k, hidx, hdiff, hcls)
    return k


@njit(error_model="numpy", nogil=True, cache=True)
def _worst_marked(r, d, atol, rtol, marks, base, k, hidx, hdiff, hcls):
    """``_worst`` of float32 arrays and float16 bit views whose metric
    pass (``_acc_fast``) left its marks: only the blocks whose mismatches
    could enter the heap are read, and no screening pass over the rest.
    They are read worst mark first (blocks with a non-finite pair, +Inf,
    in their order, as those pairs go by index): the heap fills with the
    worst at once, and the first block whose mark is below what the heap
    keeps ends the search (read in their order, a failing FP16 tensor's
    blocks were nearly all read before the heap's least kept rose)."""
    n = r.size
    if hidx.size == 0:
        return k
    # -1 (nothing mismatches there) sorts after every mark; a stable sort
    # keeps equal marks in block order
    order = np.argsort(-marks, kind="mergesort")
    for t in range(order.size):
        b = order[t]
        mark = marks[b]
        if not mark >= 0.0:         # nothing mismatches here, nor in any block after it
            break
        if k == hidx.size:
            if hcls[0] == 0:        # all kept are non-finite pairs of earlier blocks
                return k
            if mark < hdiff[0]:     # neither its worst nor any later block's would enter
                break
        b0 = b * _BLOCK
        k = _worst_scan(r, d, b0, min(b0 + _BLOCK, n), atol, rtol, base, k, hidx, hdiff, hcls)
    return k


@njit(inline="always", error_model="numpy")
def _worst_scan(r, d, b0, b1, atol, rtol, base, k, hidx, hdiff, hcls):
    """Every mismatch of [b0, b1) offered to the heap, exactly (float64)."""
    for j in range(b0, b1):
        x = _ld64(r, j)
        y = _ld64(d, j)
        if _finite(x) and _finite(y):
            ae = abs(y - x)
            if not ae > abs(x) * rtol + atol:
                continue
            k = _heap_add(k, hidx, hdiff, hcls, base + j, ae, 1)
        elif not (x == y):
            k = _heap_add(k, hidx, hdiff, hcls, base + j, 0.0, 0)
    return k


@njit(error_model="numpy", nogil=True, cache=True)
def _worst_int(r, d, ru, du, base, k, hidx, hdiff, hcls):
    """The same for integer arrays given as in ``_acc_int``."""
    for j in range(r.size):
        rn, rm = _isplit(r[j], ru)
        dn, dm = _isplit(d[j], du)
        if rn != dn or rm != dm:
            k = _heap_add(k, hidx, hdiff, hcls, base + j, abs(_idiff(rn, rm, dn, dm)), 1)
    return k


# ---------------------------------------------------------------------------
# Sums of squares along kept axes (squares.py says what they are for)
# ---------------------------------------------------------------------------


# reassoc: the sums may be taken in any order (vectorized); nothing else of
# fastmath, which would let the finiteness test go
@njit(error_model="numpy", nogil=True, cache=True, fastmath={"reassoc"})
def _square_sums(x, p, k, q, by_k, by_q):
    # x: p*k*q elements seen as (p, k, q); by_k[j] += the finite squares of
    # x[:, j, :], by_q[m] += those of x[:, :, m]
    i = 0
    for _ in range(p):
        for j in range(k):
            row = x[i:i + q]        # indexed from 0: vectorized (see _may_enter)
            s = 0.0
            for m in range(q):
                v = row[m]
                v2 = v * v
                t = v2 if v2 - v2 == 0.0 else 0.0     # finite (Inf - Inf and NaN are NaN)
                s += t
                by_q[m] += t
            by_k[j] += s
            i += q


def _dev(d, i):
    raise NotImplementedError


@overload(_dev)
def _ov_dev(d, i):
    # a float16 device tensor comes as its bits, widened as the metric pass
    # widens them (in registers: a table lookup per element kept the loop
    # from being vectorized, and took twice as long)
    if d.dtype == types.uint16:
        return lambda d, i: _h2f(d[i])
    return lambda d, i: d[i]


@intrinsic
def _prefetch(typingctx, a, i):
    """A hint to load the cache line of ``a[i]`` (never faults, also past
    the end of ``a``)."""
    if not (isinstance(a, types.Array) and a.ndim == 1 and isinstance(i, types.Integer)):
        return None
    sig = types.none(a, i)

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        fnty = ir.FunctionType(ir.VoidType(), [_PTR, _I32, _I32, _I32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [builder.gep(ary.data, [args[1]]), ir.Constant(_I32, 0), ir.Constant(_I32, 3),
                          ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return sig, codegen


# _pair_sums reads a long row a piece at a time, the memory a piece ahead
# asked for first: read as one stream, a float16 device tensor and its
# float32 reference came at half the rate the metric pass reads them (the
# widening between the loads leaves too few of them under way). Rows shorter
# than a piece are read whole (a piece's bookkeeping would cost more).
_PAIR_PIECE = 256
_PAIR_AHEAD = 1024


@njit(inline="always", error_model="numpy", fastmath={"reassoc"})
def _pair_row(rr, dd, ee, er):
    # one row: its error and reference squares added into ee, er (indexed
    # from 0: vectorized, see _may_enter), and their sums
    se = 0.0
    sr = 0.0
    for m in range(rr.size):
        rv = rr[m]
        ev = _dev(dd, m) - rv
        e2 = ev * ev
        r2 = rv * rv
        te = e2 if e2 - e2 == 0.0 else 0.0
        tr = r2 if r2 - r2 == 0.0 else 0.0
        se += te
        sr += tr
        ee[m] += te
        er[m] += tr
    return se, sr


@njit(error_model="numpy", nogil=True, cache=True, fastmath={"reassoc"})
def _pair_sums(r, d, p, k, q, ek, rk, eq, rq):
    # as _square_sums, for the error d - r (in their type) and for r at once
    i = 0
    if q < _PAIR_PIECE:
        for _ in range(p):
            for j in range(k):
                se, sr = _pair_row(r[i:i + q], d[i:i + q], eq, rq)
                ek[j] += se
                rk[j] += sr
                i += q
        return
    asked = 0       # the elements up to here were asked for (a cache line of float32s at a time)
    for _ in range(p):
        for j in range(k):
            se = 0.0
            sr = 0.0
            for c0 in range(0, q, _PAIR_PIECE):
                c1 = min(q, c0 + _PAIR_PIECE)
                while asked < i + c1 + _PAIR_AHEAD:
                    _prefetch(r, asked)
                    if asked % 32 == 0:     # a line of float16s (as their bits), or two of float32s
                        _prefetch(d, asked)
                    asked += 16
                a, b = _pair_row(r[i + c0:i + c1], d[i + c0:i + c1], eq[c0:c1], rq[c0:c1])
                se += a
                sr += b
            ek[j] += se
            rk[j] += sr
            i += q


# ---------------------------------------------------------------------------
# Where along each axis a failing tensor's error lies (evidence.uneven_axis)
# ---------------------------------------------------------------------------


# reassoc: the sums may be taken in any order (vectorized)
@njit(error_model="numpy", nogil=True, cache=True, fastmath={"reassoc"})
def _abs_profiles(r, d, outer, inner, by_row, by_col):
    # r, d: outer*inner elements seen as (outer, inner); by_row[i] += the
    # |d - r| of row i, by_col[m] += those of column m, each in float64
    # over the pairs finite on both sides (any other counts as 0 - 0);
    # returns the sum of r^2 over the same pairs
    s2 = 0.0
    for i in range(outer):
        rr = r[i * inner:(i + 1) * inner]       # indexed from 0: vectorized (see _may_enter)
        dd = d[i * inner:(i + 1) * inner]
        srow = 0.0
        for m in range(inner):
            x = _ld64(rr, m)
            y = _ld64(dd, m)
            fin = (x - x == 0.0) & (y - y == 0.0)
            e = abs(y - x) if fin else 0.0
            s2 += x * x if fin else 0.0
            srow += e
            by_col[m] += e
        by_row[i] += srow
    return s2


# ---------------------------------------------------------------------------
# The worst window of an error model's sums (errormodel.worst_blocks)
# ---------------------------------------------------------------------------


@njit(inline="always", error_model="numpy")
def _running_row(x, c, i, ring):
    # row i of numpy's cumsum of x along axis 0, into its slot of the ring
    # c (the rows kept: a window of rows and the one before it)
    w = x.shape[1]
    at = i % ring
    if i == 0:
        for j in range(w):
            c[at, j] = x[0, j]
    else:
        was = (i - 1) % ring
        for j in range(w):
            c[at, j] = c[was, j] + x[i, j]


@njit(inline="always", error_model="numpy")
def _window_row(c, i, wh, ring, out):
    # row i of the running sums along each row of the wh-row windows'
    # sums, as numpy's cumsum along axis 1 of (cumsum[i + wh - 1] -
    # cumsum[i - 1]) gives them (cumsum[wh - 1] at i 0), into out
    top = (i + wh - 1) % ring
    before = (i - 1) % ring
    s = c[top, 0] if i == 0 else c[top, 0] - c[before, 0]
    out[0] = s
    for j in range(1, c.shape[1]):
        s = s + (c[top, j] if i == 0 else c[top, j] - c[before, j])
        out[j] = s


@njit(error_model="numpy", nogil=True, cache=True)
def _best_window(se, sr, wh, ww, n, floor, out):
    """The window of wh x ww entries of the sums of squares ``se`` (error)
    and ``sr`` (reference), 2-D, whose relative RMS error is the largest
    (as np.argmax finds it: the first largest, a NaN first): its flat
    index, with out = (its relative error, the RMS it is taken relative to
    squared, its error sum, its reference sum); -1 where no window fits or
    none has a reference to be relative to. Each window's sums are the
    running sums' differences numpy's cumsum gives (along the rows, then
    along each row of the windows of rows), made as they are read: only a
    window of rows of the running sums is kept (a whole table of them, for
    a 272 x 272 tile grid, outgrew the cache and took 9 ns a cell)."""
    h, w = se.shape
    if wh > h or ww > w:
        return -1
    ring = wh + 1
    ce = np.empty((ring, w))
    cr = np.empty((ring, w))
    re = np.empty(w)
    rr = np.empty(w)
    made = 0            # the rows of the running sums made so far
    best = -1
    best_rel = 0.0
    best_sq = -1.0      # the best's relative error squared (a root is taken only past it)
    k = 0
    for i in range(h - wh + 1):
        while made < i + wh:
            _running_row(se, ce, made, ring)
            _running_row(sr, cr, made, ring)
            made += 1
        _window_row(ce, i, wh, ring, re)
        _window_row(cr, i, wh, ring, rr)
        for j in range(w - ww + 1):
            e = re[ww - 1] if j == 0 else re[j + ww - 1] - re[j - 1]
            r = rr[ww - 1] if j == 0 else rr[j + ww - 1] - rr[j - 1]
            den = max(r / n, floor) if r / n == r / n else r / n
            if den > 0:
                sq = e / n / den
                # the root of a square in [0, the best's] is no larger than
                # the best's: taken only for a larger square, or a NaN one
                # (a NaN or negative square: a sum's difference below zero)
                if best < 0 or (best_rel == best_rel and not (0.0 <= sq <= best_sq)):
                    rel = math.sqrt(sq)
                    if best < 0 or rel != rel or rel > best_rel:
                        best, best_rel, best_sq = k, rel, sq
                        out[0], out[1], out[2], out[3] = rel, den, e, r
            elif best < 0:      # no reference to be relative to: -1, which no later window is below
                best, best_rel, best_sq = k, -1.0, -1.0
                out[0], out[1], out[2], out[3] = -1.0, den, e, r
            k += 1
    if best >= 0 and best_rel < 0:
        return -1
    return best


# ---------------------------------------------------------------------------
# How much two names share (align.names.close_matches' "did you mean")
# ---------------------------------------------------------------------------


@njit(error_model="numpy", nogil=True, cache=True)
def _matched(a, b):
    """The total size of the matching blocks difflib.SequenceMatcher(None,
    a, b) finds (its ratio is twice this over the two lengths), for code
    points ``a`` and ``b`` and no junk (difflib's autojunk starts at 200
    elements of b: the caller asks difflib itself there). Each block is the
    longest common run of its ranges, the first in a then in b of equal
    ones (difflib's find_longest_match), then the ranges left and right of
    it are matched the same way."""
    la, lb = a.size, b.size
    prev = np.zeros(lb + 1, np.int64)     # prev[j + 1]: the common run ending at a[i - 1], b[j]
    cur = np.zeros(lb + 1, np.int64)
    ranges = np.empty((min(la, lb) + 2, 4), np.int64)
    ranges[0, 0], ranges[0, 1], ranges[0, 2], ranges[0, 3] = 0, la, 0, lb
    top = 1
    total = 0
    while top > 0:
        top -= 1
        alo, ahi, blo, bhi = ranges[top, 0], ranges[top, 1], ranges[top, 2], ranges[top, 3]
        besti, bestj, bestk = alo, blo, 0
        for j in range(blo, bhi + 1):
            prev[j] = 0
        for i in range(alo, ahi):
            cur[blo] = 0
            ai = a[i]
            for j in range(blo, bhi):
                if ai == b[j]:
                    k = prev[j] + 1
                    cur[j + 1] = k
                    if k > bestk:
                        besti, bestj, bestk = i - k + 1, j - k + 1, k
                else:
                    cur[j + 1] = 0
            prev, cur = cur, prev
        if bestk:
            total += bestk
            if alo < besti and blo < bestj:
                ranges[top, 0], ranges[top, 1], ranges[top, 2], ranges[top, 3] = alo, besti, blo, bestj
                top += 1
            if besti + bestk < ahi and bestj + bestk < bhi:
                ranges[top, 0], ranges[top, 1] = besti + bestk, ahi
                ranges[top, 2], ranges[top, 3] = bestj + bestk, bhi
                top += 1
    return total


_nb_config.CACHE_DIR = _CACHE_DIR_BEFORE  # type: ignore[attr-defined]
