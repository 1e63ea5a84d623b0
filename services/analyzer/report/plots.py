"""Analysis plots of a failing node (the seed's ``--show_graph`` set) and the
error-along-the-graph chart.

``node_plots`` writes three PNGs for one node output:

- ``{stem}_diff.png``: absolute error (top) and relative error (bottom) of the
  elements outside tolerance, against their flat (C-order) index;
- ``{stem}_diff_hist.png``: histograms of the relative error (top) and of the
  absolute error (bottom) of those elements;
- ``{stem}_hist.png``: histograms of the reference (CPU) and device (NPU)
  values over the same bins.

Errors follow the comparison's definitions: ``a = |d - r|``, ``rel = a / |r|``
(|r| replaced by 1e-10 where r == 0); an element is outside tolerance when
``a > atol + rtol * |r|``.  When no element is, the diff plots show every
element instead and say so in their title.

Guarantees:

- every PNG is exactly ``PLOT_WIDTH_PX`` x ``PLOT_HEIGHT_PX`` pixels
  (800 x 600: 8 x 6 inches at 100 dpi), whatever the data;
- NaN and +-Inf never stop a plot: only finite values are drawn and each
  title says how many values were left out;
- memory is bounded whatever the tensor size: the tensors are read in chunks
  of ``CHUNK`` elements (two passes: ranges, then bin counts), and a scatter
  plot draws at most ``MAX_POINTS`` evenly spaced failing elements plus the
  ``WORST_POINTS`` largest absolute errors, so the same input always gives
  the same picture and the peaks are never thinned away;
- histograms use ``clamp(ceil(sqrt(n)), min_bins, max_bins)`` bins for n
  finite values (the seed's ``--max_bins``, default 128, and ``--min_bins``,
  default 1, in [1, max_bins]).

Figures are built with matplotlib's object API on the Agg canvas (no pyplot
state, no display), so plots can be drawn from worker threads.  Titles are
drawn as plain text: node names are never read as markup.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from layerdiff.analyzer.report.jsontext import summary_number
from layerdiff.common.errors import LayerdiffError

PLOT_WIDTH_PX = 800
PLOT_HEIGHT_PX = 600
_DPI = 100
DEFAULT_MAX_BINS = 128
DEFAULT_MIN_BINS = 1
# A bound on what a user can ask for: more bins than this no screen shows,
# and the count arrays stay small.
BINS_LIMIT = 4096
MAX_POINTS = 20_000
WORST_POINTS = 1_000
CHUNK = 1 << 20
REL_EPS = 1e-10
_F32_MAX = float(np.finfo(np.float32).max)
_TITLE_CHARS = 90

# Colours: reference blue, device orange, errors red/purple.
_REF_COLOUR = "#1f77b4"
_DEV_COLOUR = "#ff7f0e"
_ABS_COLOUR = "#d62728"
_REL_COLOUR = "#9467bd"


def check_bins(max_bins: object = DEFAULT_MAX_BINS, min_bins: object = DEFAULT_MIN_BINS) -> tuple[int, int]:
    """Validate the bin bounds; returns (max_bins, min_bins)."""
    for name, v in (("max_bins", max_bins), ("min_bins", min_bins)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise LayerdiffError(f"must be a whole number, got {v!r}", field=name)
    assert isinstance(max_bins, (int, np.integer)) and isinstance(min_bins, (int, np.integer))    # checked above
    if not 1 <= max_bins <= BINS_LIMIT:
        raise LayerdiffError(f"must be between 1 and {BINS_LIMIT}, got {max_bins}", field="max_bins")
    if not 1 <= min_bins <= max_bins:
        raise LayerdiffError(f"must be between 1 and max_bins ({max_bins}), got {min_bins}", field="min_bins")
    return int(max_bins), int(min_bins)


def bin_count(n: int, max_bins: int = DEFAULT_MAX_BINS, min_bins: int = DEFAULT_MIN_BINS) -> int:
    """Number of histogram bins for ``n`` finite values (square-root rule,
    clamped to [min_bins, max_bins])."""
    return max(min_bins, min(max_bins, math.ceil(math.sqrt(max(n, 1)))))


def shown_name(name: str, limit: int = _TITLE_CHARS) -> str:
    """A node name fit for a plot title: control characters escaped, long
    names shortened in the middle."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(name))
    if len(text) > limit:
        half = (limit - 3) // 2
        text = f"{text[:half]}...{text[-half:]}"
    return text


# ----------------------------------------------------------------- figures

def figure(rows: int):
    """A figure of ``rows`` stacked axes, PLOT_WIDTH_PX x PLOT_HEIGHT_PX."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(PLOT_WIDTH_PX / _DPI, PLOT_HEIGHT_PX / _DPI), dpi=_DPI)
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(rows, 1, i + 1) for i in range(rows)]
    return fig, axes


def plain_title(obj, text: str, **kw) -> None:
    """Title of an axes (or suptitle of a figure), never read as markup."""
    # parse_math=False: a '$' in a node name must not start TeX math
    # (unbalanced ones would make matplotlib raise while drawing).
    if hasattr(obj, "set_title"):
        obj.set_title(text, parse_math=False, **kw)
    else:
        obj.suptitle(text, parse_math=False, **kw)


def save_png(fig, path: Path) -> None:
    """Save at the fixed size."""
    # Names in other scripts have no glyph in the bundled font: matplotlib
    # warns and draws boxes, which is all a title can do anyway.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        fig.savefig(path, dpi=_DPI, format="png")


def _dropped(n: int, what: str) -> str:
    return f"; {n} non-finite {what} left out" if n else ""


# ----------------------------------------------------------- chunked passes

def _flat(a: np.ndarray, name: str) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype.hasobject or a.dtype.kind not in "biuf":
        raise LayerdiffError(f"cannot plot dtype {a.dtype}", field=name)
    return a.reshape(-1)


def _chunks(ref: np.ndarray, dev: np.ndarray) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    for start in range(0, ref.size, CHUNK):
        yield start, ref[start:start + CHUNK].astype(np.float64), dev[start:start + CHUNK].astype(np.float64)


def _errors(r: np.ndarray, d: np.ndarray, atol: float, rtol: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(abs error, rel error, outside tolerance) with the comparison's NaN->0,
    Inf->float32 max replacement (so the failing set is the comparison's)."""
    rr = np.nan_to_num(r, nan=0.0, posinf=_F32_MAX, neginf=-_F32_MAX)
    dd = np.nan_to_num(d, nan=0.0, posinf=_F32_MAX, neginf=-_F32_MAX)
    a = np.abs(dd - rr)
    mag = np.abs(rr)
    rel = a / np.where(mag == 0, REL_EPS, mag)
    return a, rel, a > atol + rtol * mag


class ValueRange:
    """Running min/max and count of the finite values fed to it."""

    def __init__(self) -> None:
        self.lo, self.hi, self.n, self.dropped = math.inf, -math.inf, 0, 0

    def add(self, v: np.ndarray) -> None:
        fin = np.isfinite(v)
        k = int(fin.sum())
        self.dropped += v.size - k
        if k:
            self.n += k
            vals = v[fin] if k != v.size else v
            self.lo = min(self.lo, float(vals.min()))
            self.hi = max(self.hi, float(vals.max()))

    @property
    def wide(self) -> bool:
        """Positive values spanning more than three decades: log bins show them."""
        return self.n > 0 and self.lo > 0 and self.hi / self.lo > 1e3

    def edges(self, bins: int, log: bool = False) -> np.ndarray:
        if not self.n:
            return np.linspace(0.0, 1.0, bins + 1)
        lo, hi = self.lo, self.hi
        if log and self.wide:
            return np.geomspace(lo, hi, bins + 1)
        if lo == hi:  # a constant: one visible bar around it
            pad = abs(lo) * 0.05 or 0.5
            lo, hi = lo - pad, hi + pad
        return np.linspace(lo, hi, bins + 1)


def _hist(v: np.ndarray, edges: np.ndarray) -> np.ndarray:
    v = v[np.isfinite(v)]
    return np.histogram(v, bins=edges)[0] if v.size else np.zeros(len(edges) - 1, dtype=np.int64)


# ------------------------------------------------------------------- plots

def node_plots(out_dir: Path, stem: str, ref: np.ndarray, dev: np.ndarray, *, max_bins: int = DEFAULT_MAX_BINS,
               min_bins: int = DEFAULT_MIN_BINS, atol: float = 0.005, rtol: float = 0.2,
               title: str | None = None) -> dict[str, str]:
    """Write ``{stem}_diff.png``, ``{stem}_diff_hist.png`` and
    ``{stem}_hist.png`` into ``out_dir``; returns their file names as
    ``{"diff": ..., "diff_hist": ..., "hist": ...}``.

    ``stem`` must be a plain file name (use layerdiff.common.names.safe_filename on
    node names); ``title`` (default: the stem) names the node in the plots;
    ``atol``/``rtol`` decide which elements are outside tolerance (the
    comparison's defaults).  ``ref`` and ``dev`` must hold the same number of
    elements; they are compared in flat C order."""
    max_bins, min_bins = check_bins(max_bins, min_bins)
    if not stem or Path(stem).name != stem or stem in (".", ".."):
        raise LayerdiffError(f"plot file stem {stem!r} is not a plain file name", field="stem")
    for name, v in (("atol", atol), ("rtol", rtol)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise LayerdiffError(f"must be a finite number >= 0, got {v!r}", field=name)
    r, d = _flat(ref, "ref"), _flat(dev, "dev")
    if r.size != d.size:
        raise LayerdiffError(f"reference has {r.size} elements, device {d.size}", node=title or stem,
                             field="shape")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    label = shown_name(title if title is not None else stem)

    # Pass 1: ranges and counts.
    ref_rng, dev_rng = ValueRange(), ValueRange()
    n_fail = 0
    fail_abs, fail_rel, all_abs, all_rel = ValueRange(), ValueRange(), ValueRange(), ValueRange()
    nonfinite_pairs = 0
    for _, rc, dc in _chunks(r, d):
        ref_rng.add(rc)
        dev_rng.add(dc)
        a, rel, bad = _errors(rc, dc, atol, rtol)
        fin = np.isfinite(rc) & np.isfinite(dc)
        nonfinite_pairs += int(rc.size - fin.sum())
        n_fail += int(bad.sum())
        # errors of pairs holding NaN/Inf are artefacts of the replacement:
        # they decide failing, but are not drawn.
        sel = bad & fin
        fail_abs.add(a[sel])
        fail_rel.add(rel[sel])
        all_abs.add(a[fin])
        all_rel.add(rel[fin])
    total = int(r.size)
    only_failing = n_fail > 0
    abs_rng, rel_rng = (fail_abs, fail_rel) if only_failing else (all_abs, all_rel)
    shown_n = abs_rng.n

    # Pass 2: histogram counts and the scatter sample.
    b_err = bin_count(shown_n, max_bins, min_bins)
    # errors are often heavy-tailed (relative errors near zero references):
    # logarithmic bins when they span more than three decades
    abs_edges, rel_edges = abs_rng.edges(b_err, log=True), rel_rng.edges(b_err, log=True)
    b_val = bin_count(max(ref_rng.n, dev_rng.n), max_bins, min_bins)
    lo = min(ref_rng.lo, dev_rng.lo) if ref_rng.n or dev_rng.n else 0.0
    hi = max(ref_rng.hi, dev_rng.hi) if ref_rng.n or dev_rng.n else 1.0
    joint = ValueRange()
    if ref_rng.n or dev_rng.n:
        joint.lo, joint.hi, joint.n = lo, hi, 1
    val_edges = joint.edges(b_val)
    h_abs = np.zeros(b_err, dtype=np.int64)
    h_rel = np.zeros(b_err, dtype=np.int64)
    h_ref = np.zeros(b_val, dtype=np.int64)
    h_dev = np.zeros(b_val, dtype=np.int64)
    stride = max(1, math.ceil(shown_n / MAX_POINTS))
    seen = 0
    pick_idx: list[np.ndarray] = []
    pick_abs: list[np.ndarray] = []
    pick_rel: list[np.ndarray] = []
    worst_idx = np.zeros(0, dtype=np.int64)
    worst_abs = np.zeros(0)
    worst_rel = np.zeros(0)
    for start, rc, dc in _chunks(r, d):
        h_ref += _hist(rc, val_edges)
        h_dev += _hist(dc, val_edges)
        a, rel, bad = _errors(rc, dc, atol, rtol)
        sel = np.isfinite(rc) & np.isfinite(dc)
        if only_failing:
            sel &= bad
        idx = np.flatnonzero(sel)
        if not idx.size:
            continue
        ai, ri = a[idx], rel[idx]
        h_abs += _hist(ai, abs_edges)
        h_rel += _hist(ri, rel_edges)
        # every stride-th shown element, counted across chunks
        keep = (np.arange(seen, seen + idx.size) % stride) == 0
        seen += idx.size
        pick_idx.append(idx[keep] + start)
        pick_abs.append(ai[keep])
        pick_rel.append(ri[keep])
        if stride > 1:
            cand_idx = np.concatenate([worst_idx, idx + start])
            cand_abs = np.concatenate([worst_abs, ai])
            cand_rel = np.concatenate([worst_rel, ri])
            if cand_abs.size > WORST_POINTS:
                top = np.argpartition(-cand_abs, WORST_POINTS - 1)[:WORST_POINTS]
                cand_idx, cand_abs, cand_rel = cand_idx[top], cand_abs[top], cand_rel[top]
            worst_idx, worst_abs, worst_rel = cand_idx, cand_abs, cand_rel
    px = np.concatenate(pick_idx + [worst_idx]) if pick_idx else worst_idx
    pa = np.concatenate(pick_abs + [worst_abs]) if pick_abs else worst_abs
    pr = np.concatenate(pick_rel + [worst_rel]) if pick_rel else worst_rel
    if px.size:
        px, first = np.unique(px, return_index=True)
        pa, pr = pa[first], pr[first]

    subset = f"{n_fail} of {total} elements outside tolerance" if only_failing else \
        f"no element outside tolerance: all {total} elements shown"
    sampled = f", {px.size} drawn" if stride > 1 else ""
    names = {"diff": f"{stem}_diff.png", "diff_hist": f"{stem}_diff_hist.png", "hist": f"{stem}_hist.png"}

    # {stem}_diff.png
    fig, (ax1, ax2) = figure(2)
    plain_title(fig, f"{label}: {subset}{sampled}{_dropped(nonfinite_pairs, 'pairs')}", fontsize=10)
    for ax, ys, colour, what in ((ax1, pa, _ABS_COLOUR, "absolute error"), (ax2, pr, _REL_COLOUR, "relative error")):
        if ys.size:
            ax.scatter(px, ys, s=4, c=colour, linewidths=0)
            if only_failing and ys.min() > 0 and ys.max() / ys.min() > 1e3:
                ax.set_yscale("log")
        else:
            ax.text(0.5, 0.5, "no finite values", ha="center", va="center", transform=ax.transAxes)
        ax.set_ylabel(what)
        ax.set_xlim(-0.5, max(total, 1) - 0.5)
        ax.grid(True, alpha=0.3)
    ax2.set_xlabel("flat element index")
    fig.tight_layout()
    save_png(fig, out_dir / names["diff"])

    # {stem}_diff_hist.png
    fig, (ax1, ax2) = figure(2)
    plain_title(fig, f"{label}: error distribution, {subset}{_dropped(nonfinite_pairs, 'pairs')}", fontsize=10)
    for ax, counts, edges, rng, colour, what in ((ax1, h_rel, rel_edges, rel_rng, _REL_COLOUR, "relative error"),
                                                 (ax2, h_abs, abs_edges, abs_rng, _ABS_COLOUR, "absolute error")):
        ax.stairs(counts, edges, fill=True, color=colour)
        scale = ""
        if rng.wide:
            ax.set_xscale("log")
            scale = ", logarithmic bins"
        ax.set_xlabel(f"{what} ({len(counts)} bins{scale})")
        ax.set_ylabel("elements")
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    save_png(fig, out_dir / names["diff_hist"])

    # {stem}_hist.png
    fig, (ax,) = figure(1)
    dropped = ""
    if ref_rng.dropped or dev_rng.dropped:
        dropped = f"; non-finite values left out: CPU {ref_rng.dropped}, NPU {dev_rng.dropped}"
    plain_title(ax, f"{label}: value distribution ({b_val} bins){dropped}", fontsize=10)
    ax.stairs(h_ref, val_edges, fill=True, color=_REF_COLOUR, alpha=0.5, label=f"CPU (reference), {ref_rng.n} values")
    ax.stairs(h_dev, val_edges, fill=False, color=_DEV_COLOUR, linewidth=1.5,
              label=f"NPU (device), {dev_rng.n} values")
    ax.set_xlabel("value")
    ax.set_ylabel("elements")
    ax.legend(loc="upper right", fontsize=9)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    save_png(fig, out_dir / names["hist"])
    return names


def error_chart(out_path: Path, orders: Sequence[int], rel_err: Iterable[object], cosine: Iterable[object],
                labels: Sequence[str], first_index: int | None) -> Path:
    """The error-along-the-graph chart as a PNG: mean relative error (log
    scale, left axis) and cosine similarity (right axis) of each node by
    execution order, the first failing node marked by a red dashed line.

    ``first_index`` indexes into the sequences (None: nothing failed).
    Values may be summary numbers (null for NaN, "inf"); infinite relative
    errors are drawn at the top of the axis as triangles, NaN ones are left
    out.  Returns ``out_path``."""
    xs = np.asarray(list(orders), dtype=np.float64)
    rel = np.array([summary_number(v) for v in rel_err], dtype=np.float64)
    cos = np.array([summary_number(v) for v in cosine], dtype=np.float64)
    if not (len(xs) == len(rel) == len(cos) == len(labels)):
        raise LayerdiffError("orders, rel_err, cosine and labels must have the same length", field="error_chart")
    if first_index is not None and not 0 <= first_index < len(xs):
        raise LayerdiffError(f"first_index {first_index} is outside 0..{len(xs) - 1}", field="first_index")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax,) = figure(1)
    finite = np.isfinite(rel) & (rel > 0)
    floor = float(rel[finite].min()) if finite.any() else 1e-8
    top = float(rel[finite].max()) if finite.any() else 1.0
    ax.set_yscale("log")
    ax.plot(xs[finite], rel[finite], "o-", color=_ABS_COLOUR, markersize=3, linewidth=1,
            label="mean relative error")
    zero = np.isfinite(rel) & (rel == 0)
    if zero.any():  # exact agreement has no place on a log axis: drawn at the floor
        ax.plot(xs[zero], np.full(zero.sum(), floor / 10), "v", color=_ABS_COLOUR, markersize=4,
                label="relative error 0 (drawn at floor)")
    inf = np.isinf(rel)
    if inf.any():
        ax.plot(xs[inf], np.full(inf.sum(), top * 10), "^", color=_ABS_COLOUR, markersize=6,
                label="relative error inf (drawn at top)")
    ax.set_xlabel("execution order")
    ax.set_ylabel("mean relative error")
    ax.grid(True, alpha=0.3)
    ax2 = ax.twinx()
    okc = np.isfinite(cos)
    ax2.plot(xs[okc], cos[okc], "s-", color=_REF_COLOUR, markersize=3, linewidth=1, label="cosine similarity")
    ax2.set_ylabel("cosine similarity")
    ax2.set_ylim(min(-0.05, float(cos[okc].min()) - 0.05) if okc.any() else -0.05, 1.05)
    title = f"error along the graph ({len(xs)} nodes)"
    if first_index is not None:
        ax.axvline(xs[first_index], color="red", linestyle="--", linewidth=1.2)
        title += f"; first failing: {shown_name(labels[first_index], 50)} (order {int(xs[first_index])})"
    plain_title(ax, title, fontsize=10)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="lower right", fontsize=8)
    fig.tight_layout()
    save_png(fig, out_path)
    return out_path
