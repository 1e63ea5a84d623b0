"""Sums of squares along kept axes, in one pass over a tensor.

The error model cuts a tensor into blocks (channels, tiles, rows) and needs,
for each index of the kept axes, the sum of the squared errors and of the
squared reference values there. Done with numpy, that was a squared copy of
each tensor, a cleaned copy where a value was not finite, and two reductions
that widen to float64 a piece at a time: half of a detector's job went into
it. Here each tensor is read once (the compiled loops are in ``kernel.py``).

Each square is taken in the tensor's own type, float32 or float64 (float16
and integers are widened to float32 first), as ``np.square(x, dtype=...)``
takes it; a square that is not finite counts as zero; the sums are float64.
"""
from __future__ import annotations

import math

import numpy as np

from layerdiff.analyzer.compare.compiled import as_stored, kernels


def _contiguous(x: np.ndarray) -> np.ndarray:
    return x.reshape(-1) if x.flags.c_contiguous else np.ascontiguousarray(x).reshape(-1)


def _split(shape: tuple, first: int, last: int) -> tuple[int, tuple, tuple]:
    return math.prod(shape[:first]), shape[first:last + 1], shape[last + 1:]


def takes_pair(ref_dtype, dev_dtype) -> bool:
    """Does ``pair_square_sums`` take tensors of these types (float32 or
    float16 against float32 or float16, float64 against float64)?"""
    narrow = (np.float32, np.float16)
    return (ref_dtype in narrow and dev_dtype in narrow) or (ref_dtype == np.float64 and dev_dtype == np.float64)


def pair_square_sums(ref: np.ndarray, dev: np.ndarray, first: int,
                     last: int) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]] | None:
    """``square_sums`` of the error ``dev - ref`` and of ``ref`` together,
    in one pass over the two tensors and without the error made whole: the
    error in float32 (float64 for a float64 reference), as
    ``np.subtract(dev, ref, dtype=...)`` takes it. ((error², reference²) for
    the kept axes, (error², reference²) for the axes after them); None for
    types this pass does not take (the caller makes the error)."""
    ref, dev = np.asarray(ref), np.asarray(dev)
    if ref.shape != dev.shape or not takes_pair(ref.dtype, dev.dtype):
        return None
    if ref.dtype == np.float16:
        ref = ref.astype(np.float32)
    p, kept, after = _split(ref.shape, first, last)
    k, q = math.prod(kept), math.prod(after)
    ek, rk, eq, rq = np.zeros(k), np.zeros(k), np.zeros(q), np.zeros(q)
    if ref.size:
        r = _contiguous(ref)
        d = _contiguous(dev)
        kernels()._pair_sums(r, as_stored(d), p, k, q, ek, rk, eq, rq)
    return (ek.reshape(kept), rk.reshape(kept)), (eq.reshape(after), rq.reshape(after))


def _flat(x: np.ndarray) -> np.ndarray:
    """The tensor as a flat array of float32 or float64 in C order."""
    x = np.asarray(x)
    if x.dtype != np.float64 and x.dtype != np.float32:
        x = x.astype(np.float32)
    return x.reshape(-1) if x.flags.c_contiguous else np.ascontiguousarray(x).reshape(-1)


def square_sums(x: np.ndarray, first: int, last: int) -> tuple[np.ndarray, np.ndarray]:
    """The float64 sums of the finite squares of ``x`` for every index of
    axes ``first``..``last`` (over all the others), and for every index of
    the axes after ``last`` (over all the others), in one pass; shaped as
    those axes."""
    p, kept, after = _split(x.shape, first, last)
    by_k = np.zeros(math.prod(kept), np.float64)
    by_q = np.zeros(math.prod(after), np.float64)
    if x.size:
        kernels()._square_sums(_flat(x), p, by_k.size, by_q.size, by_k, by_q)
    return by_k.reshape(kept), by_q.reshape(after)
