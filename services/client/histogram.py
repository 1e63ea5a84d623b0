"""``layerdiff histogram``: one histogram per dumped tensor, with the layer's
minimum and maximum drawn as red dashed lines.

The minimum and maximum come from a calibration range file
(``tensor_min_max.txt``, the per-layer ranges a quantizing converter writes)
when one is given and names the tensor, else from the tensor itself.  A wide
range around a narrow distribution (max - min > 30) is the sign that a
layer's input wants 16-bit quantization; such tensors are listed.

The range file is read by layerdiff.analyzer.diagnose.minmax (the same parser as the
job's ``--min-max``): one layer per line, its name and then min and max
(``conv1 -1.25 3.5``, ``conv1: -1.25, 3.5``, ``conv1 min: -1.25 max: 3.5``,
...). A line that does not parse, holds a non-finite number, has min > max
or repeats a name is skipped with its line number and the reason; the rest
of the file is used.

Output: ``{name}.png`` per tensor (names through layerdiff.common.names.safe_filename,
so a file never lands outside the output directory), ``histograms.json``
(tensor → file, min, max and where they came from) and
``histogram_skip.log`` (tensors and range lines not used, with the reason).
An output directory that already holds files is never emptied or
overwritten: the histograms go to a fresh sibling (``Histograms_2``, ...)
and the result says so.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from layerdiff.common.errors import LayerdiffError, NotFoundError
from layerdiff.common.names import safe_filename
from layerdiff.common.schema import ROLE_INPUT, STATUS_OK

DEFAULT_OUT = "Histograms"
WIDE_RANGE = 30.0
# A range file lists one line per layer: even a huge model stays far below this.
MAX_RANGE_FILE_BYTES = 64 << 20


@dataclass
class RangeFile:
    """Parsed range file: ``ranges`` by layer name, ``skipped`` lines as
    (``file:line``, reason)."""
    ranges: dict[str, tuple[float, float]] = field(default_factory=dict)
    skipped: list[tuple[str, str]] = field(default_factory=list)


def parse_min_max(path: str | Path) -> RangeFile:
    """Read a ``tensor_min_max.txt`` range file (see layerdiff.analyzer.diagnose.minmax)."""
    from layerdiff.analyzer.diagnose import minmax

    p = Path(path)
    try:
        size = p.stat().st_size
        if size > MAX_RANGE_FILE_BYTES:
            raise LayerdiffError(f"is {size} bytes, over the limit of {MAX_RANGE_FILE_BYTES} for a range file",
                                 file=str(p), field="min_max")
        raw = p.read_bytes()
    except FileNotFoundError as e:
        raise NotFoundError("range file does not exist", file=str(p), field="min_max") from e
    except IsADirectoryError as e:
        raise LayerdiffError("is a directory, not a range file", file=str(p), field="min_max") from e
    except OSError as e:
        raise LayerdiffError(f"cannot be read: {e.strerror}", file=str(p), field="min_max") from e
    if b"\x00" in raw:
        raise LayerdiffError("is not a text file (holds NUL bytes)", file=str(p), field="min_max")
    ranges, skipped = minmax.parse_min_max(raw.decode("utf-8", errors="replace"), shown=str(p))
    return RangeFile(ranges, skipped)


def _key(name: str) -> str:
    """Loose match between range-file names and dump names: the dump may have
    mapped '/', '.' or ':' to '_' (as vendor file names do)."""
    return re.sub(r"[^0-9a-z]+", "_", name.lower()).strip("_")


def fresh_dir(out: str | Path) -> tuple[Path, str]:
    """The directory to write into and a note when it is not ``out``: an
    existing non-empty directory (or a file) is left alone and the first free
    ``{out}_N`` sibling is used instead."""
    base = Path(out)
    if not base.exists() or (base.is_dir() and not any(base.iterdir())):
        return base, ""
    for n in range(2, 10_000):
        cand = base.with_name(f"{base.name}_{n}")
        if not cand.exists():
            return cand, f"{base} already exists and holds files; it was left as it is and the histograms " \
                         f"were written into {cand}"
    raise LayerdiffError(f"no free directory name next to {base}", field="out")


def tensor_histogram(path: Path, values: np.ndarray, title: str, lo: float, hi: float, source: str, *,
                     max_bins: int, min_bins: int) -> None:
    """One histogram PNG (plots.PLOT_WIDTH_PX x PLOT_HEIGHT_PX) of the finite
    values, with ``lo`` and ``hi`` as red dashed lines."""
    from layerdiff.analyzer.report import plots

    flat = np.asarray(values).reshape(-1)
    fin = np.isfinite(flat) if flat.dtype.kind == "f" else np.ones(flat.size, dtype=bool)
    vals = flat[fin].astype(np.float64) if not fin.all() else flat.astype(np.float64)
    dropped = int(flat.size - vals.size)
    rng = plots.ValueRange()
    rng.add(vals)
    if not rng.n:
        rng.lo, rng.hi, rng.n = lo, hi, 1
    # The bins span the data, so a narrow distribution keeps its detail; the
    # axis spans the lines too, so a wide calibrated range shows as the gap.
    bins = plots.bin_count(vals.size, max_bins, min_bins)
    edges = rng.edges(bins)
    left, right = min(float(edges[0]), lo), max(float(edges[-1]), hi)
    margin = (right - left) * 0.03 or 0.5
    counts = np.histogram(vals, bins=edges)[0] if vals.size else np.zeros(bins, dtype=np.int64)
    fig, (ax,) = plots.figure(1)
    ax.stairs(counts, edges, fill=True, color="#1f77b4", label=f"{vals.size} values, {bins} bins")
    ax.axvline(lo, color="red", linestyle="--", linewidth=1.5, label=f"min {lo:.6g} ({source})")
    ax.axvline(hi, color="red", linestyle="--", linewidth=1.5, label=f"max {hi:.6g} ({source})")
    note = f"; {dropped} non-finite values left out" if dropped else ""
    plots.plain_title(ax, f"{plots.shown_name(title)}{note}", fontsize=10)
    ax.set_xlim(left - margin, right + margin)
    ax.set_xlabel("value")
    ax.set_ylabel("count")
    ax.legend(loc="upper right", fontsize=9)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    plots.save_png(fig, path)


def write_histograms(dump: str | Path, out: str | Path = DEFAULT_OUT, *, min_max: str | Path | None = None,
                     max_bins: int | None = None, min_bins: int | None = None, fmt: str = "",
                     default_concat_dim: int = 0, progress: bool = False) -> dict:
    """Histogram every tensor of the dump directory ``dump`` (any format
    layerdiff.collector.dumps.directory.DumpDirectory reads) into ``out`` (default
    ``./Histograms``; see fresh_dir).  ``min_max``: a range file; ``max_bins``
    (default 128) and ``min_bins`` (default 1, at most max_bins) bound the
    bins.  Returns ``{"out", "note", "written": [{tensor, file, min, max,
    source, range}], "skipped": [(tensor, reason)], "range_lines_skipped":
    [(file:line, reason)], "unmatched_ranges": [names], "wide": [tensors]}``."""
    from layerdiff.analyzer.report import plots
    from layerdiff.collector.dumps.directory import DumpDirectory

    max_bins, min_bins = plots.check_bins(plots.DEFAULT_MAX_BINS if max_bins is None else max_bins,
                                          plots.DEFAULT_MIN_BINS if min_bins is None else min_bins)
    ranges = parse_min_max(min_max) if min_max else RangeFile()
    loose: dict[str, str] = {}
    for name in ranges.ranges:
        loose.setdefault(_key(name), name)
    reader = DumpDirectory(str(dump), fmt=fmt, default_concat_dim=default_concat_dim)
    target, note = fresh_dir(out)
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LayerdiffError(f"cannot create the output directory: {e.strerror}", file=str(target),
                             field="out") from e
    taken: set[str] = set()
    written: list[dict] = []
    skipped: list[tuple[str, str]] = []
    used: set[str] = set()
    records = reader.records()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(unit=" tensors", desc="histograms")
    try:
        for rec in records:
            if bar is not None:
                bar.update(1)
            label = f"{rec.node or rec.name}.input.{rec.slot}" if rec.role == ROLE_INPUT else rec.name
            if rec.status != STATUS_OK or rec.array is None:
                skipped.append((label, rec.message or rec.status))
                continue
            arr = rec.array
            if arr.dtype.kind not in "biuf":
                skipped.append((label, f"dtype {arr.dtype} has no histogram"))
                continue
            match = label if label in ranges.ranges else rec.name if rec.name in ranges.ranges else \
                loose.get(_key(label)) or loose.get(_key(rec.name))
            if match:
                lo, hi = ranges.ranges[match]
                source = "range file"
                used.add(match)
            else:
                fin = arr[np.isfinite(arr)] if arr.dtype.kind == "f" else arr
                if fin.size == 0:
                    skipped.append((label, "no finite values"))
                    continue
                lo, hi = float(fin.min()), float(fin.max())
                source = "tensor"
            fname = safe_filename(label, taken) + ".png"
            desc = f"{label} [{rec.op_type}] {tuple(arr.shape)} {arr.dtype}" if rec.op_type else \
                f"{label} {tuple(arr.shape)} {arr.dtype}"
            tensor_histogram(target / fname, arr, desc, lo, hi, source, max_bins=max_bins, min_bins=min_bins)
            written.append({"tensor": label, "file": fname, "min": lo, "max": hi, "source": source,
                            "range": hi - lo})
    finally:
        if bar is not None:
            bar.close()
    wide = [w["tensor"] for w in written if w["range"] > WIDE_RANGE]
    unmatched = [n for n in ranges.ranges if n not in used]
    (target / "histograms.json").write_text(json.dumps(
        {"tensors": written, "wide_range_threshold": WIDE_RANGE, "wide": wide, "unmatched_ranges": unmatched},
        indent=1), encoding="utf-8")
    with open(target / "histogram_skip.log", "w", encoding="utf-8") as f:
        for name, reason in skipped:
            f.write(f"{_one_line(name)}: {_one_line(reason)}\n")
        for where, reason in ranges.skipped:
            f.write(f"{_one_line(where)}: {_one_line(reason)}\n")
    return {"out": str(target), "note": note, "written": written, "skipped": skipped,
            "range_lines_skipped": ranges.skipped, "unmatched_ranges": unmatched, "wide": wide}


def _one_line(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
