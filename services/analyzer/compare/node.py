"""One node's comparison: shape/layout reconciliation, then the metrics and,
for a failing node, its worst elements. Plain functions, no I/O, so that any
executor (local pool, remote workers) runs the same code."""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from layerdiff.analyzer.align import layout as L
from layerdiff.analyzer.align.layout import LayoutVote
from layerdiff.analyzer.compare import metrics as M
from layerdiff.analyzer.compare.tolerances import Tolerance


class SkipNode(Exception):
    """The node cannot be compared; the message says why (compare_skip.log)."""


@dataclass
class NodeOutcome:
    metrics: M.NodeMetrics
    # rows for {op_name}.csv: tuples (metrics.worst_elements), a list of them or WorstRows
    worst: Sequence = field(default_factory=list)
    note: str = ""                               # how shapes were reconciled, if they were


def _ordered_permutation(src: tuple, dst: tuple) -> tuple | None:
    """An axis permutation p with src[p] == dst that keeps axes of equal size
    in their order, or None if the sizes are not a permutation: the last
    resort for a shape that no layout permutation fits and several other
    permutations do."""
    if len(src) != len(dst) or sorted(src) != sorted(dst):
        return None
    used = [False] * len(src)
    perm = []
    for size in dst:
        i = next(i for i, s in enumerate(src) if not used[i] and s == size)
        used[i] = True
        perm.append(i)
    return tuple(perm)


def permute(ref_shape: tuple, dev: np.ndarray, layout=None) -> tuple[np.ndarray, str] | None:
    """The device tensor as a view in the reference's layout, and how it was
    brought there (the report's note), or None when its shape is not a
    permutation of the reference's. ``layout``: None (the shape alone
    decides, ``layerdiff.analyzer.align.layout.resolve``), the job's
    ``LayoutVote`` (consulted where the shape does not tell), or a
    permutation already decided (a task item carries it as a list)."""
    ref_shape = tuple(ref_shape)
    if layout is not None and not isinstance(layout, LayoutVote):
        p = tuple(int(i) for i in layout)
        if sorted(p) != list(range(dev.ndim)) or not L.fits(p, tuple(dev.shape), ref_shape):
            raise SkipNode(f"the layout permutation {p} does not bring shape {tuple(dev.shape)} to the "
                           f"reference's {ref_shape}")
        note = L.note_for(p, ref_shape)
    else:
        resolved, note, _ = L.resolve(ref_shape, tuple(dev.shape), layout)
        if resolved is None:
            return None
        p = resolved
    if p == L.identity(dev.ndim):
        return dev, note
    if L.keeps_order(p, ref_shape):
        return dev.reshape(ref_shape), note
    return dev.transpose(p), note


def reconcile(ref: np.ndarray, dev: np.ndarray, force_compare: bool, layout=None) -> tuple[np.ndarray, str]:
    """Bring the device tensor to the reference's shape, or raise SkipNode.
    ``layout``: see ``permute`` (the job's LayoutVote, or a decided permutation)."""
    if ref.shape == dev.shape and layout is None:
        return dev, ""
    if ref.size != dev.size:
        raise SkipNode(f"shape {tuple(dev.shape)} ({dev.size} elements) differs from the reference "
                       f"{tuple(ref.shape)} ({ref.size} elements)")
    done = permute(ref.shape, dev, layout)
    if done is not None:
        out, note = done
        return (out if out is dev else np.ascontiguousarray(out)), note
    squeezed_equal = tuple(s for s in ref.shape if s != 1) == tuple(s for s in dev.shape if s != 1)
    if squeezed_equal:
        return dev.reshape(ref.shape), "shape differs only by axes of size 1"
    perm = _ordered_permutation(tuple(dev.shape), tuple(ref.shape))
    if perm is not None:
        return (np.ascontiguousarray(dev.transpose(perm)),
                f"layout: device axes {perm} transposed to the reference (axes of equal size kept in order)")
    if force_compare:
        return dev.reshape(ref.shape), f"force_compare: device shape {tuple(dev.shape)} read as {tuple(ref.shape)}"
    raise SkipNode(f"shape {tuple(dev.shape)} differs from the reference {tuple(ref.shape)} with the same size; "
                   "use --force-compare to compare element by element")


# A node larger than this is compared in chunks whose partial results merge
# exactly; every executor cuts at the same bounds, so the local pool and the
# distributed workers report identical figures.
CHUNK_ELEMENTS = int(os.environ.get("LAYERDIFF_CHUNK_ELEMENTS", str(1 << 24)))


def chunk_bounds(n: int, size: int | None = None) -> list[tuple[int, int]]:
    size = size or CHUNK_ELEMENTS
    return [(s, min(s + size, n)) for s in range(0, n, size)] if n > size else [(0, n)]


def compare_chunk(ref_flat: np.ndarray, dev_flat: np.ndarray, offset: int, tol: Tolerance,
                  diff_cnt: int) -> tuple[M.Accumulator, list]:
    """Partial metrics of elements [offset, offset+len) and their worst rows
    (indices in the whole tensor)."""
    marks = M.block_marks(ref_flat, dev_flat)
    acc = M.accumulate(ref_flat, dev_flat, offset, tol.atol, tol.rtol, marks)
    worst = []
    if acc.errors and diff_cnt > 0:
        worst = [(i + offset, *rest) for i, *rest in M.worst_elements(ref_flat, dev_flat, tol.atol, tol.rtol,
                                                                      diff_cnt, marks)]
    return acc, worst


def merge_chunks(parts: list[tuple[M.Accumulator, list]], shape: tuple, diff_cnt: int
                 ) -> tuple[M.NodeMetrics, list]:
    """Combine chunk results given in offset order."""
    m = M.finalize(M.merge(a for a, _ in parts), tuple(shape))
    rows = [r for _, w in parts for r in w]
    rows.sort(key=M.worst_row_key)
    return m, rows[:diff_cnt]


def compare_node(ref: np.ndarray, dev: np.ndarray, tol: Tolerance, diff_cnt: int,
                 force_compare: bool = False, layout=None) -> NodeOutcome:
    dev, note = reconcile(ref, dev, force_compare, layout)
    if ref.size > CHUNK_ELEMENTS:
        r, d = ref.reshape(-1), dev.reshape(-1)
        parts = [compare_chunk(r[a:b], d[a:b], a, tol, diff_cnt) for a, b in chunk_bounds(ref.size)]
        m, worst = merge_chunks(parts, ref.shape, diff_cnt)
        return NodeOutcome(m, worst, note)
    marks = M.block_marks(ref, dev)     # where the worst elements lie, from the metric pass
    m = M.compare(ref, dev, tol.atol, tol.rtol, marks)
    rows = M.worst_rows(ref, dev, tol.atol, tol.rtol, diff_cnt, marks) if m.errors and diff_cnt > 0 else []
    return NodeOutcome(m, rows, note)
