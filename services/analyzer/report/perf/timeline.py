"""``timeline.json`` of a job's report directory, in the Chrome trace event
format (opens in Perfetto UI and chrome://tracing): one track per stream or
thread, one slice per node run, its accuracy among the slice's arguments.
"""
from __future__ import annotations

from layerdiff.analyzer.report.perf.table import AccuracyOfNode, PerfTable, json_num


class _Lanes:
    """Tracks of the timeline. Perfetto wants the slices of one track nested
    or apart; a slice that would partly overlap the one before it on its
    stream (start times from a source that overlaps itself) goes to a second
    lane of that stream instead of being moved."""

    def __init__(self) -> None:
        self.names: dict[int, str] = {}
        self._lanes: dict[str, list[tuple[int, float]]] = {}     # stream -> [(tid, last end)]

    def place(self, stream: str, start: float, end: float) -> int:
        lanes = self._lanes.setdefault(stream, [])
        for i, (tid, last) in enumerate(lanes):
            if start >= last:
                lanes[i] = (tid, end)
                return tid
        tid = len(self.names) + 1
        self.names[tid] = stream if not lanes else f"{stream} (overlap {len(lanes)})"
        lanes.append((tid, end))
        return tid


def timeline(t: PerfTable, acc: dict[str, AccuracyOfNode], title: str) -> dict:
    """Chrome trace event format: one track per stream or thread, one
    complete ("X") slice per node run, a "runs" track spanning each run.
    Sources that give start times are placed where they ran; the others are
    laid end to end on their stream, run after run, in execution order."""
    pid = 1
    runs = [(n, r, time) for n in t.nodes for r, time in zip(n.runs, n.times) if time is not None]
    placed_by_start = bool(runs) and all(r.start_us is not None for _, r, _ in runs)
    lanes = _Lanes()
    lanes.place("runs", 0.0, 0.0)          # tid 1: the runs track comes first
    cursor: dict[str, float] = {}
    spans: dict[int, list[float]] = {}
    slices: list[dict] = []
    order_key = (lambda x: (x[1].start_us, x[0].order)) if placed_by_start else \
        (lambda x: (x[1].run, x[0].order if x[0].order >= 0 else 1 << 30, x[0].first_seen))
    for n, r, dur in sorted(runs, key=order_key):
        stream = r.stream or "stream 0"
        if placed_by_start:
            assert r.start_us is not None      # placed by start: every run has its start time
            ts = r.start_us
        else:
            ts = cursor.get(stream, 0.0)
            cursor[stream] = ts + dur
        # Rounded ends, not rounded durations: slices laid end to end then
        # share their boundary exactly instead of overlapping by a rounding.
        start, end = round(ts, 3), round(ts + dur, 3)
        a = acc.get(n.reference_node) if n.reference_node else None
        args = {"op_type": n.op_type, "run": r.run, "order": n.order}
        for k in ("provider", "input_shapes", "output_shapes"):
            if getattr(r, k):
                args[k] = getattr(r, k)
        args.update(r.counters)
        if a is not None:
            args.update(accuracy="pass" if a.passed else "fail", max_abs_err=json_num(a.max_abs_err),
                        cosine=json_num(a.cosine))
            if a.verdict:
                args["verdict"] = a.verdict
        cat = (n.op_type or "node") + (",accuracy_fail" if a is not None and not a.passed else "")
        slices.append({"name": n.name, "cat": cat, "ph": "X", "ts": start, "dur": round(end - start, 3),
                       "pid": pid, "tid": lanes.place(stream, start, end), "args": args})
        span = spans.setdefault(r.run, [start, end])
        span[0], span[1] = min(span[0], start), max(span[1], end)
    # Runs laid end to end stream by stream have no common span: the runs
    # track is drawn only from start times.
    if placed_by_start:
        for run, (first, last) in sorted(spans.items()):
            slices.append({"name": f"run {run}", "cat": "run", "ph": "X", "ts": first,
                           "dur": round(last - first, 3), "pid": pid, "tid": lanes.place("runs", first, last),
                           "args": {"run": run}})
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": title}}]
    for tid, name in lanes.names.items():
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    return {"traceEvents": events + slices, "displayTimeUnit": "ms",
            "otherData": {"tool": "layerdiff", "title": title, "time_from": t.time_from,
                          "clock_mhz": t.settings.clock_mhz, "placement": "start times" if placed_by_start
                          else "end to end per stream"}}
