"""onnxruntime's profiler turned into per-node performance records.

A live perf capture runs the device model (the same model the tensor capture
runs: as given, FP16 converted, INT8 QDQ, or the device export) as a whole,
with only its own outputs, once to warm up and then ``runs`` times under the
profiler. Each node's ``*_kernel_time`` event of each run becomes one record:
duration, start (from the first profiled run's start), thread, execution
provider, input and output shapes.

The graph optimization level decides which nodes run: ``extended`` (default)
fuses nodes as onnxruntime does and keeps the first fused node's name (a
Conv+Relu is timed as the Conv's name, op type FusedConv), so the times join
the accuracy rows by name; ``all`` adds the layout transformations of the
deployed session (x86 NCHWc), whose nodes get new names; ``basic`` and
``none`` time nearly the graph as written.

The same parser reads a profile written elsewhere (``perf/*.json`` of a dump):
an onnxruntime profile, or any Chrome trace whose complete (``X``) events name
the nodes. A file cut short yields every event before the cut and one error
record saying where it stopped.
"""
from __future__ import annotations

import bisect
import json
import math
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from layerdiff.common.errors import LayerdiffError
from layerdiff.common.onnxgraph import WeightSplit, lean_session
from layerdiff.common.perfschema import PerfRecord, shapes_json

if TYPE_CHECKING:
    import onnx
    import onnxruntime as ort
else:
    from layerdiff.common.lazy import onnx, ort

DEFAULT_RUNS = 5
MAX_RUNS = 1000
WARMUP_RUNS = 1
_KERNEL = "_kernel_time"
# the names users give -> onnxruntime's GraphOptimizationLevel members
GRAPH_OPTIMIZATION = {"all": "ORT_ENABLE_ALL", "extended": "ORT_ENABLE_EXTENDED", "basic": "ORT_ENABLE_BASIC",
                      "none": "ORT_DISABLE_ALL"}
DEFAULT_GRAPH_OPTIMIZATION = "extended"


def check_graph_optimization(level: str) -> str:
    level = (level or DEFAULT_GRAPH_OPTIMIZATION).lower()
    if level not in GRAPH_OPTIMIZATION:
        raise LayerdiffError(f"unknown graph optimization {level!r} (one of {', '.join(GRAPH_OPTIMIZATION)})",
                             field="graph_optimization")
    return level


def check_runs(runs: int) -> int:
    runs = int(runs or DEFAULT_RUNS)
    if runs < 1 or runs > MAX_RUNS:
        raise LayerdiffError(f"must be between 1 and {MAX_RUNS}", field="perf_runs")
    return runs


def profile_model(model: onnx.ModelProto | WeightSplit, feeds: dict[str, np.ndarray], providers: list, *,
                  runs: int = DEFAULT_RUNS, graph_optimization: str = DEFAULT_GRAPH_OPTIMIZATION
                  ) -> Iterator[PerfRecord]:
    runs = check_runs(runs)
    level = check_graph_optimization(graph_optimization)
    with tempfile.TemporaryDirectory(prefix="layerdiff-profile-") as tmp:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, GRAPH_OPTIMIZATION[level])
        so.enable_profiling = True
        so.profile_file_prefix = str(Path(tmp) / "profile")
        try:
            sess = lean_session(model, so, providers)
        except Exception as e:
            raise LayerdiffError(f"onnxruntime cannot load the device model: {e}", field="device_model") from e
        try:
            for _ in range(WARMUP_RUNS + runs):
                sess.run(None, feeds)
        except Exception as e:
            raise LayerdiffError(f"profiled device run failed: {e}", field="inputs") from e
        path = Path(sess.end_profiling())
        del sess
        yield from parse_profile(path, "onnxruntime profile", skip_runs=WARMUP_RUNS)


# ----------------------------------------------------------------- parsing

def _events(text: str) -> tuple[list, str]:
    """The trace's events and, when the text is cut short or broken, why
    reading stopped. Accepts the JSON array form and the object form
    ``{"traceEvents": [...]}``."""
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if isinstance(doc, list):
        return doc, ""
    if isinstance(doc, dict):
        ev = doc.get("traceEvents")
        return (ev, "") if isinstance(ev, list) else ([], "no traceEvents list")
    # Broken or cut short: take every complete event before the break.
    start = text.find("[")
    key = text.find('"traceEvents"')
    if key >= 0:
        start = text.find("[", key)
    if start < 0:
        return [], "not a JSON trace (no event list)"
    dec = json.JSONDecoder()
    events: list = []
    i = start + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n:
            return events, f"cut short after {len(events)} events (no closing bracket)"
        if text[i] == "]":
            return events, "broken after the event list"
        try:
            ev, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            return events, f"cut short after {len(events)} events at byte {i}: {e.msg}"
        events.append(ev)


def _num(v) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) and v >= 0 else None


def _shapes(v) -> str:
    # onnxruntime writes [{"float": [1, 3, 16, 16]}, ...]
    out = []
    if isinstance(v, list):
        for item in v:
            if isinstance(item, dict):
                for dtype, dims in item.items():
                    if isinstance(dims, list) and all(isinstance(d, int) for d in dims):
                        out.append([str(dtype), dims])
    return shapes_json(out)


def parse_profile(path: Path | str, shown: str, *, skip_runs: int = 0) -> Iterator[PerfRecord]:
    """Records of a profile file: onnxruntime's ``model_run`` events delimit
    the runs (the first ``skip_runs`` are warm-up and left out); without them
    a node's n-th event is its n-th run."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        yield PerfRecord.error("", f"cannot be read: {getattr(e, 'strerror', None) or e}", shown)
        return
    events, broken = _events(text)
    windows: list[tuple[float, float]] = []
    nodes: list[tuple[int, dict, float, float]] = []
    for k, ev in enumerate(events):
        if not isinstance(ev, dict) or ev.get("ph", "X") != "X":
            continue
        name = ev.get("name")
        ts, dur = _num(ev.get("ts")), _num(ev.get("dur"))
        if ev.get("cat") == "Session":
            if name == "model_run" and ts is not None and dur is not None:
                windows.append((ts, ts + dur))
            continue
        if ev.get("cat") not in (None, "Node", "Op", "Kernel"):
            continue
        if not isinstance(name, str) or not name:
            yield PerfRecord.error("", f"event {k} has no name", shown)
            continue
        if name.endswith("_fence_before") or name.endswith("_fence_after"):
            continue
        if ts is None or dur is None:
            yield PerfRecord.error(name, f"event {k}: ts / dur is not a non-negative number", shown)
            continue
        nodes.append((k, ev, ts, dur))
    windows.sort()
    kept_windows = windows[skip_runs:]
    if windows:
        assigned: list[tuple[int, dict, float, float, int]] = []
        late = 0
        starts = [a for a, _ in windows]
        for k, ev, ts, dur in nodes:
            run = bisect.bisect_right(starts, ts) - 1
            if run < 0 or ts > windows[run][1]:
                late += 1      # after the last complete run: its model_run event was never written
                continue
            if run >= skip_runs:
                assigned.append((k, ev, ts, dur, run - skip_runs))
        if late:
            yield PerfRecord.error("", f"{late} node events outside any complete run left out", shown)
    else:
        seen: dict[str, int] = {}
        assigned = []
        for k, ev, ts, dur in nodes:
            base = _node_name(ev["name"])
            assigned.append((k, ev, ts, dur, seen.get(base, 0)))
            seen[base] = seen.get(base, 0) + 1
    origin = kept_windows[0][0] if kept_windows else min((a[2] for a in assigned), default=0.0)
    order: dict[str, int] = {}
    for k, ev, ts, dur, run in sorted(assigned, key=lambda a: (a[4], a[2])):
        name = _node_name(ev["name"])
        raw_args = ev.get("args")
        args = raw_args if isinstance(raw_args, dict) else {}
        order.setdefault(name, len(order))
        tid = ev.get("tid")
        yield PerfRecord(
            name=name, op_type=str(args.get("op_name", "") or ""), order=order[name], run=run,
            stream=f"thread {tid}" if tid is not None else "", provider=str(args.get("provider", "") or ""),
            start_us=max(0.0, ts - origin), dur_us=dur, input_shapes=_shapes(args.get("input_type_shape")),
            output_shapes=_shapes(args.get("output_type_shape")), source=f"{shown} event {k}")
    if broken:
        yield PerfRecord.error("", broken, shown)


def _node_name(event_name: str) -> str:
    return event_name[:-len(_KERNEL)] if event_name.endswith(_KERNEL) else event_name
