"""Vendor performance counters in a dump directory, read where they lie.

The runtime writes its per-node counters beside the tensors, in CSV files
with a header row (UTF-8, comma-separated):

- ``perf/{op}.csv``: one file per node, one row per run of the node (the
  seed tool's ``perf/{op_name}.csv``); the node is the ``name`` column, or
  the file stem when there is none;
- ``op_perf.csv``: every node in one file, one row per run, in the order the
  nodes ran; the ``name`` column is required. Read only when ``perf/`` holds
  no CSV file, since it would then be the same runs again;
- ``perf/*.json``: an onnxruntime profile (or any Chrome trace with complete
  events), read by :mod:`layerdiff.collector.live.profile`.

Columns: ``name``; the counters of the seed's ``op_perf.csv``
(``mcu_cycle`` ... ``dma1_c1_byte``, see ``COUNTER_COLUMNS``), each an
unsigned integer, any subset of them; and optionally ``op_type``, ``order``
(execution order; default the order of first appearance in ``op_perf.csv``),
``run`` (default: the row's rank among the rows of its node),
``stream_id`` (or ``stream``: the timeline track), ``provider``,
``start_us`` and ``dur_us`` (microseconds). Any other column is kept and
passed through as text.

A file that cannot be read (not UTF-8, no header, no ``name`` column,
duplicate columns) becomes one error record naming the file; a row that
cannot be used (cells missing or extra, a counter that is not a
non-negative integer below 2**63, a bad time) becomes an error record naming
the file, the line, the node and the column. Every other row goes on.
"""
from __future__ import annotations

import csv
import math
from collections.abc import Iterator
from pathlib import Path

from layerdiff.collector.live.profile import parse_profile
from layerdiff.common.errors import NotFoundError
from layerdiff.common.perfschema import COUNTER_MAX, COUNTER_SET, PerfRecord

OP_PERF = "op_perf.csv"
PERF_DIR = "perf"
_IDENTITY = {"name", "op_type", "order", "run", "stream_id", "stream", "provider", "start_us", "dur_us"}
_ABSENT = {"", "na", "n/a", "none", "null", "-"}


class _RowError(Exception):
    def __init__(self, message: str, column: str | None = None) -> None:
        super().__init__(f"column {column!r}: {message}" if column else message)


def parse_counter(text: str, column: str) -> int | None:
    """A counter cell: an unsigned integer (``1500``, ``1.5e3``, ``0x5dc``);
    empty or NA = not measured."""
    try:
        v = int(text)       # the common case, first: a file has tens of counters per row
    except ValueError:
        return _parse_counter_other(text, column)
    return _in_counter_range(v, text, column)


def _in_counter_range(v: int, text: str, column: str) -> int:
    if v < 0:
        raise _RowError(f"negative count {v}", column)
    if v > COUNTER_MAX:
        raise _RowError(f"{text.strip()} overflows a 64-bit counter (a wrapped register?)", column)
    return v


def _parse_counter_other(text: str, column: str) -> int | None:
    t = text.strip()
    if t.lower() in _ABSENT:
        return None
    try:
        if t.lower().startswith(("0x", "-0x")):
            v = int(t, 16)
        else:
            try:
                v = int(t)
            except ValueError:
                f = float(t)
                if not math.isfinite(f):
                    raise _RowError(f"{t!r} is not a finite number", column) from None
                if f != int(f):
                    raise _RowError(f"{t!r} is not a whole count", column) from None
                v = int(f)
    except ValueError:
        raise _RowError(f"{t!r} is not a number", column) from None
    return _in_counter_range(v, t, column)


def _time(text: str, column: str) -> float | None:
    t = text.strip()
    if t.lower() in _ABSENT:
        return None
    try:
        v = float(t)
    except ValueError:
        raise _RowError(f"{t!r} is not a number", column) from None
    if not math.isfinite(v) or v < 0:
        raise _RowError(f"{t!r} is not a non-negative time", column)
    return v


def _index(text: str, column: str) -> int | None:
    t = text.strip()
    if t.lower() in _ABSENT:
        return None
    try:
        v = int(t)
    except ValueError:
        raise _RowError(f"{t!r} is not an integer", column) from None
    if v < 0 or v >= 2**31:
        raise _RowError(f"{v} is out of range", column)
    return v


def read_counter_file(path: Path, shown: str, *, default_name: str | None = None,
                      first_order: int = 0) -> Iterator[PerfRecord]:
    """Records of one counter file; ``default_name`` names the node of a
    per-node file without a ``name`` column."""
    try:
        f = open(path, "rb")
    except OSError as e:
        yield PerfRecord.error("", f"cannot be read: {e.strerror}", shown)
        return
    bad_lines: list[tuple[int, str]] = []

    def lines():
        # Decoded line by line, so that one line in another encoding costs
        # that row only, not the rest of the file.
        for no, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                bad_lines.append((no, f"line is not UTF-8 ({e.reason} at byte {e.start})"))
                text = "\n"
            yield text.lstrip("\ufeff") if no == 1 else text

    with f:
        reader = csv.reader(lines())
        try:
            header = next(reader, None)
        except csv.Error as e:
            yield PerfRecord.error("", f"unreadable header: {e}", shown)
            return
        if bad_lines:
            yield PerfRecord.error("", f"header {bad_lines[0][1]}", shown)
            return
        if not header:
            yield PerfRecord.error("", "empty file, no header row", shown)
            return
        header = [h.strip() for h in header]
        dup = next((h for h in header if header.count(h) > 1), None)
        if dup is not None:
            yield PerfRecord.error("", f"column {dup!r} appears twice in the header", shown)
            return
        if "name" not in header and default_name is None:
            yield PerfRecord.error("", "no 'name' column in the header", shown)
            return
        counter_cols = [h for h in header if h in COUNTER_SET]
        extra_cols = [h for h in header if h and h not in COUNTER_SET and h not in _IDENTITY]
        runs_seen: dict[str, int] = {}
        order_of: dict[str, int] = {}
        while True:
            try:
                cells = next(reader)
            except StopIteration:
                cells = None
            except csv.Error as e:
                yield PerfRecord.error("", f"unreadable at line {reader.line_num}: {e}; the rest of the file "
                                           "is left out", f"{shown}:{reader.line_num}")
                return
            for no, why in bad_lines:
                yield PerfRecord.error("", why, f"{shown}:{no}")
            bad_lines.clear()
            if cells is None:
                break
            where = f"{shown}:{reader.line_num}"
            if not cells or all(not c.strip() for c in cells):
                continue
            row = dict(zip(header, cells))
            name = (row.get("name") or "").strip() or (default_name or "")
            if len(cells) != len(header):
                yield PerfRecord.error(name, f"row has {len(cells)} cells, the header {len(header)}", where)
                continue
            if not name:
                yield PerfRecord.error("", "row has no node name", where)
                continue
            try:
                rec = _record(row, name, where, counter_cols, extra_cols)
            except _RowError as e:
                yield PerfRecord.error(name, str(e), where)
                continue
            if rec.order < 0 and default_name is None:
                rec.order = order_of.setdefault(name, first_order + len(order_of))
            if "run" not in row or rec.run < 0:
                rec.run = runs_seen.get(name, 0)
            runs_seen[name] = max(runs_seen.get(name, 0), rec.run + 1)
            yield rec


def _record(row: dict[str, str], name: str, where: str, counter_cols: list[str], extra_cols: list[str]
            ) -> PerfRecord:
    counters: dict[str, int] = {}
    for col in counter_cols:
        v = parse_counter(row[col], col)
        if v is not None:
            counters[col] = v
    order = _index(row.get("order", ""), "order")
    run = _index(row.get("run", ""), "run")
    stream = (row.get("stream_id") if "stream_id" in row else row.get("stream", "")) or ""
    return PerfRecord(name=name, op_type=row.get("op_type", "").strip(), order=-1 if order is None else order,
                      run=-1 if run is None else run, stream=stream.strip(),
                      provider=row.get("provider", "").strip(), start_us=_time(row.get("start_us", ""), "start_us"),
                      dur_us=_time(row.get("dur_us", ""), "dur_us"), counters=counters,
                      extra={col: row[col] for col in extra_cols}, source=where)


def dump_perf_records(path: str) -> Iterator[PerfRecord]:
    """Every performance record of a dump directory (see the module doc)."""
    root = Path(path)
    if not root.is_dir():
        raise NotFoundError(f"dump directory {path!r} does not exist on the collector host", field="dump_path")
    perf_dir = root / PERF_DIR
    per_node = sorted(p for p in perf_dir.iterdir() if p.is_file() and p.suffix.lower() == ".csv") \
        if perf_dir.is_dir() else []
    profiles = sorted(p for p in perf_dir.iterdir() if p.is_file() and p.suffix.lower() == ".json") \
        if perf_dir.is_dir() else []
    found = False
    if per_node:
        found = True
        for p in per_node:
            yield from read_counter_file(p, f"{PERF_DIR}/{p.name}", default_name=p.stem)
    elif (root / OP_PERF).is_file():
        found = True
        yield from read_counter_file(root / OP_PERF, OP_PERF)
    for p in profiles:
        found = True
        yield from parse_profile(p, f"{PERF_DIR}/{p.name}")
    if not found:
        raise NotFoundError(f"no performance data in {path!r}: expected {OP_PERF}, {PERF_DIR}/*.csv or "
                            f"{PERF_DIR}/*.json", field="dump_path")
