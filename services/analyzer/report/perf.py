"""Performance data beside accuracy: the per-node tables, the summaries and
the timeline of a job's performance stream.

Files written into the report directory (DUMP_OP_PERF 1 or 2):

- ``op_perf.csv``: one row per node, its counters averaged over its runs
  (the seed's columns first: ``name``, then the counters present), then
  ``op_type``, ``order``, ``runs``, time per run (total, mean, min, max, in
  microseconds), ``share_pct`` of the summed node time, stream, provider,
  shapes, and any column the counter files had beyond these;
- ``perf/{op}.csv``: one row per run of the node, the same columns;
- ``op_summary.csv``: one row per node in execution order with its time and
  its accuracy (result, max_abs_err, cosine) side by side;
- ``op_statistic.csv``: one row per op type: runs, nodes, total / mean / min /
  max time and share of time, slowest first;
- ``timeline.json``: Chrome trace event format (opens in Perfetto UI and
  chrome://tracing): one track per stream or thread, one slice per node run;
- ``perf_skip.log``: each row or node left out, and why.

Times: a record's own duration when the source measured one; otherwise
``mcu_cycle / clock_mhz`` (default 1000 MHz, so one microsecond stands for
1000 cycles), and ``summary.json`` says which.
"""
from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from layerdiff.analyzer.align.names import Aligner
from layerdiff.collector.live.profile import (
    DEFAULT_GRAPH_OPTIMIZATION,
    DEFAULT_RUNS,
    MAX_RUNS,
    check_graph_optimization,
)
from layerdiff.common.errors import LayerdiffError
from layerdiff.common.names import safe_filename
from layerdiff.common.perfschema import COUNTER_COLUMNS, PerfRecord, decode_perf
from layerdiff.v1 import layerdiff_pb2 as pb

DEFAULT_CLOCK_MHZ = 1000.0
SPAN_MARK = "_span"
# A job keeps its performance records in memory until the reports are
# written (a few hundred bytes each); beyond this many the rest is left out.
MAX_RECORDS = 2_000_000
SLOW_RANK = 10            # "slow": among the slowest tenth of the nodes, at most this many
MODES = {"accuracy": pb.PERF_MODE_ACCURACY, "perf": pb.PERF_MODE_PERF, "both": pb.PERF_MODE_BOTH,
         "0": pb.PERF_MODE_ACCURACY, "1": pb.PERF_MODE_PERF, "2": pb.PERF_MODE_BOTH}
MODE_NAMES = {pb.PERF_MODE_ACCURACY: "accuracy", pb.PERF_MODE_PERF: "perf", pb.PERF_MODE_BOTH: "both"}
TIME_COLUMNS = ["total_us", "mean_us", "min_us", "max_us", "share_pct"]


def parse_mode(value) -> int:
    """``accuracy`` / ``perf`` / ``both``, or the seed's DUMP_OP_PERF 0 / 1 / 2."""
    if isinstance(value, int) and value in MODE_NAMES:
        return value
    mode = MODES.get(str(value or "accuracy").strip().lower())
    if mode is None:
        raise LayerdiffError(f"unknown perf mode {value!r} (accuracy, perf, both, or 0, 1, 2)", field="perf_mode")
    return mode


@dataclass(frozen=True)
class PerfSettings:
    mode: int = pb.PERF_MODE_ACCURACY
    hide_span_nodes: bool = False
    runs: int = DEFAULT_RUNS
    clock_mhz: float = DEFAULT_CLOCK_MHZ
    graph_optimization: str = DEFAULT_GRAPH_OPTIMIZATION

    @property
    def enabled(self) -> bool:
        return self.mode != pb.PERF_MODE_ACCURACY

    @property
    def only(self) -> bool:
        return self.mode == pb.PERF_MODE_PERF

    def as_dict(self) -> dict:
        return {"perf_mode": MODE_NAMES[self.mode], "perf_all_nodes": not self.hide_span_nodes,
                "perf_runs": self.runs, "clock_mhz": self.clock_mhz,
                "graph_optimization": self.graph_optimization}


def check_perf_options(o: pb.PerfOptions) -> PerfSettings:
    """Checked at submit time, so bad options fail the Submit call."""
    if o.mode not in MODE_NAMES:
        raise LayerdiffError(f"unknown perf mode {o.mode}", field="perf_mode")
    runs = o.runs or DEFAULT_RUNS
    if runs < 1 or runs > MAX_RUNS:
        raise LayerdiffError(f"must be between 1 and {MAX_RUNS}", field="perf_runs")
    clock = o.clock_mhz or DEFAULT_CLOCK_MHZ
    if not math.isfinite(clock) or clock <= 0:
        raise LayerdiffError("must be a positive frequency in MHz", field="clock_mhz")
    return PerfSettings(o.mode, o.hide_span_nodes, runs, clock, check_graph_optimization(o.graph_optimization))


# ------------------------------------------------------------------ receive

@dataclass
class PerfData:
    records: list[PerfRecord] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)     # (where, why)


def receive(stream, max_records: int = MAX_RECORDS) -> PerfData:
    """Read a performance stream (record batches; ``stream.cancel()`` stops
    it) to its end, or to ``max_records`` records: the rest is left out with
    a reason."""
    data = PerfData()
    for batch in stream:
        try:
            records = decode_perf(batch)
        except ValueError as e:
            raise LayerdiffError(f"performance stream: {e}", field="stream") from None
        if len(data.records) + len(records) > max_records:
            stream.cancel()
            data.errors.append(("collector", f"more than {max_records} performance records; the rest is left out"))
            break
        for r in records:
            if r.ok:
                data.records.append(r)
            else:
                where = r.source or "collector"
                data.errors.append((f"{where} ({r.name})" if r.name else where, r.message))
    return data


# ---------------------------------------------------------------- aggregate

@dataclass
class NodePerf:
    name: str
    op_type: str
    order: int
    runs: list[PerfRecord]
    times: list[float | None]          # per run, microseconds
    site: object = None                # the reference TensorSite it joins, if any
    first_seen: int = 0

    @property
    def known_times(self) -> list[float]:
        return [t for t in self.times if t is not None]

    @property
    def total_us(self) -> float | None:
        t = self.known_times
        return sum(t) if t else None

    @property
    def mean_us(self) -> float | None:
        t = self.known_times
        return sum(t) / len(t) if t else None

    def counter_mean(self, name: str) -> float | None:
        vals = [r.counters[name] for r in self.runs if name in r.counters]
        return sum(vals) / len(vals) if vals else None

    @property
    def reference_node(self) -> str | None:
        return self.site.node if self.site is not None else None


@dataclass
class PerfTable:
    nodes: list[NodePerf]
    errors: list[tuple[str, str]]
    hidden: list[tuple[str, str]]
    counters: list[str]                # counter columns present, seed order
    extras: list[str]                  # pass-through columns, first-seen order
    time_from: str                     # "measured", "mcu_cycle at N MHz", "measured and ...", "none"
    settings: PerfSettings

    @cached_property
    def node_time_us(self) -> float:
        """Summed mean time of the nodes: one run of the network, node by node."""
        return sum(x.mean_us for x in self.nodes if x.mean_us is not None)

    def share_pct(self, n: NodePerf) -> float | None:
        total = self.node_time_us
        return 100.0 * n.mean_us / total if n.mean_us is not None and total > 0 else None

    def timed_nodes(self) -> int:
        return sum(1 for n in self.nodes if n.mean_us is not None)

    def slow_ranks(self) -> dict[str, int]:
        timed = sorted((n for n in self.nodes if n.mean_us is not None), key=lambda n: -n.mean_us)
        return {n.name: i + 1 for i, n in enumerate(timed)}


def _merge(into: PerfRecord, other: PerfRecord) -> None:
    """A second record of the same node and run (counters from one file, time
    from another) fills what the first lacks."""
    for k, v in other.counters.items():
        into.counters.setdefault(k, v)
    for k, v in other.extra.items():
        into.extra.setdefault(k, v)
    for attr in ("op_type", "stream", "provider", "input_shapes", "output_shapes"):
        if not getattr(into, attr):
            setattr(into, attr, getattr(other, attr))
    if into.start_us is None:
        into.start_us = other.start_us
    if into.dur_us is None:
        into.dur_us = other.dur_us
    if into.order < 0:
        into.order = other.order


def build_table(data: PerfData, aligner: Aligner | None, settings: PerfSettings) -> PerfTable:
    hidden: list[tuple[str, str]] = []
    by_name: dict[str, dict[int, PerfRecord]] = {}
    first_seen: dict[str, int] = {}
    hidden_names: set[str] = set()
    for r in data.records:
        if r.name in hidden_names:
            continue
        if r.name not in by_name:
            reason = ""
            if settings.hide_span_nodes and SPAN_MARK in r.name:
                reason = f"name contains {SPAN_MARK!r} (perf_all_nodes=False)"
            elif aligner is not None:
                reason = aligner.match(r.name, tensor=False).skip_reason
            if reason:
                hidden_names.add(r.name)
                hidden.append((r.name, reason))
                continue
            by_name[r.name] = {}
            first_seen[r.name] = len(first_seen)
        runs = by_name[r.name]
        if r.run in runs:
            _merge(runs[r.run], r)
        else:
            runs[r.run] = r
    measured = derived = False
    counters_present: set[str] = set()
    extras: dict[str, None] = {}
    nodes: list[NodePerf] = []
    for name, runs in by_name.items():
        recs = [runs[k] for k in sorted(runs)]
        times: list[float | None] = []
        for r in recs:
            counters_present.update(r.counters)
            for k in r.extra:
                extras.setdefault(k, None)
            if r.dur_us is not None:
                times.append(r.dur_us)
                measured = True
            elif "mcu_cycle" in r.counters:
                times.append(r.counters["mcu_cycle"] / settings.clock_mhz)
                derived = True
            else:
                times.append(None)
        site = aligner.match(name, tensor=False).site if aligner is not None else None
        order = next((r.order for r in recs if r.order >= 0), -1)
        op_type = next((r.op_type for r in recs if r.op_type), site.op_type if site is not None else "")
        nodes.append(NodePerf(name, op_type, order, recs, times, site, first_seen[name]))
    # Device order when the source knows it; the reference's order for nodes
    # of per-node files that do not say; first appearance otherwise.
    nodes.sort(key=lambda n: (n.order if n.order >= 0 else (n.site.order if n.site is not None else 1 << 30),
                              n.first_seen))
    clock = f"mcu_cycle at {settings.clock_mhz:g} MHz"
    time_from = ("measured and " + clock if derived else "measured") if measured else (clock if derived else "none")
    return PerfTable(nodes, list(data.errors), hidden, [c for c in COUNTER_COLUMNS if c in counters_present],
                     list(extras), time_from, settings)


def bound_hint(counter: callable) -> dict | None:
    """Data-bound or compute-bound, from a node's counters (5.7.2.2: look at
    the nodes with the most mcu_cycle first): data movement (mte_total_cycle)
    against the busiest compute unit (vme, mme, vec)."""
    data = counter("mte_total_cycle")
    units = {u: counter(f"{u}_cycle") for u in ("vme", "mme", "vec")}
    units = {u: v for u, v in units.items() if v is not None}
    if data is None and not units:
        return None
    busiest = max(units, key=units.get) if units else None
    compute = units.get(busiest, 0.0) if busiest else 0.0
    data = data or 0.0
    if data == 0 and compute == 0:
        return None
    if data > compute:
        return {"bound": "data-bound", "why": f"mte_total_cycle {_num(data)} > {busiest or 'compute'}_cycle "
                                               f"{_num(compute)}: moves dominate; look at tiling and reuse"}
    return {"bound": "compute-bound", "why": f"{busiest}_cycle {_num(compute)} >= mte_total_cycle {_num(data)}: "
                                             "a compute unit dominates; look at the kernel and its parallelism"}


# ------------------------------------------------------------------- writing

def _num(v) -> str:
    if v is None:
        return ""
    if isinstance(v, int):
        return str(v)
    if math.isfinite(v) and v == int(v) and abs(v) < 1e15:
        return str(int(v))
    return f"{v:.6f}".rstrip("0").rstrip(".")


def _us(v) -> str:
    return "" if v is None else f"{v:.3f}"


def _identity(n: NodePerf, r: PerfRecord | None) -> dict:
    recs = n.runs if r is None else [r]
    return {"op_type": n.op_type, "order": n.order,
            "stream": "|".join(dict.fromkeys(x.stream for x in recs if x.stream)),
            "provider": "|".join(dict.fromkeys(x.provider for x in recs if x.provider)),
            "input_shapes": next((x.input_shapes for x in recs if x.input_shapes), ""),
            "output_shapes": next((x.output_shapes for x in recs if x.output_shapes), "")}


def _extra_value(n: NodePerf, col: str) -> str:
    vals = [r.extra[col] for r in n.runs if col in r.extra]
    distinct = list(dict.fromkeys(vals))
    if len(distinct) <= 1:
        return distinct[0] if distinct else ""
    try:
        nums = [float(v) for v in vals]
    except ValueError:
        return "|".join(distinct)
    return _num(sum(nums) / len(nums))


def write_tables(out: Path, t: PerfTable) -> dict[str, str]:
    """op_perf.csv and perf/{op}.csv; returns node -> its per-run file."""
    out.mkdir(parents=True, exist_ok=True)
    ident = ["op_type", "order", "runs"]
    rest = ["stream", "provider", "input_shapes", "output_shapes"]
    with open(out / "op_perf.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["name"] + t.counters + ident + TIME_COLUMNS + rest + t.extras)
        for n in t.nodes:
            i = _identity(n, None)
            t_known = n.known_times
            w.writerow([n.name] + [_num(n.counter_mean(c)) for c in t.counters]
                       + [n.op_type, n.order, len(n.runs), _us(n.total_us), _us(n.mean_us),
                          _us(min(t_known) if t_known else None), _us(max(t_known) if t_known else None),
                          _us(t.share_pct(n))]
                       + [i[k] for k in rest] + [_extra_value(n, c) for c in t.extras])
    files: dict[str, str] = {}
    taken: set[str] = set()
    (out / "perf").mkdir(exist_ok=True)
    for n in t.nodes:
        fname = "perf/" + safe_filename(n.name, taken) + ".csv"
        files[n.name] = fname
        with open(out / fname, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["name", "run"] + t.counters + ["op_type", "order", "start_us", "dur_us"] + rest + t.extras)
            for r, time in zip(n.runs, n.times):
                i = _identity(n, r)
                w.writerow([n.name, r.run] + [_num(r.counters.get(c)) for c in t.counters]
                           + [n.op_type, n.order, _us(r.start_us), _us(time)]
                           + [i[k] for k in rest] + [r.extra.get(c, "") for c in t.extras])
    return files


def op_statistic(t: PerfTable) -> list[dict]:
    """Per op type, slowest first (the spirit of op_statistic)."""
    groups: dict[str, list[NodePerf]] = {}
    for n in t.nodes:
        groups.setdefault(n.op_type or "(unknown)", []).append(n)
    grand = sum(x for n in t.nodes for x in n.known_times)
    rows = []
    for op, ns in groups.items():
        times = [x for n in ns for x in n.known_times]
        total = sum(times) if times else None
        rows.append({"op_type": op, "count": sum(len(n.runs) for n in ns), "nodes": len(ns),
                     "total_us": total, "mean_us": total / len(times) if times else None,
                     "min_us": min(times) if times else None, "max_us": max(times) if times else None,
                     "share_pct": 100.0 * total / grand if total is not None and grand > 0 else None})
    rows.sort(key=lambda r: (-(r["total_us"] or 0.0), r["op_type"]))
    return rows


@dataclass
class AccuracyOfNode:
    passed: bool
    constant: bool
    tensors: list[str]
    max_abs_err: float | None
    cosine: float | None
    first_failing: bool = False
    overflow: str = ""                 # why the device flagged the node, if it did
    verdict: str = ""                  # the diagnosis of a failing node (computation / accumulated ...)


def accuracy_by_node(rows: list, first_failing_tensor: str | None,
                     overflow: dict[str, str] | None = None) -> dict[str, AccuracyOfNode]:
    """Reference node -> its compared outputs folded into one verdict. A
    node's inputs are what it inherited, not what it computed: they do not
    make its verdict."""
    out: dict[str, AccuracyOfNode] = {}
    for r in rows:
        if r.is_input:
            continue
        m = r.outcome.metrics
        a = out.get(r.site.node)
        if a is None:
            a = out[r.site.node] = AccuracyOfNode(True, r.is_constant, [], None, None)
        a.tensors.append(r.site.tensor)
        a.passed = a.passed and m.passed
        a.max_abs_err = _fmax(a.max_abs_err, m.max_abs_err)
        a.cosine = _fmin(a.cosine, m.cosine)
        if r.site.tensor == first_failing_tensor:
            a.first_failing = True
        a.overflow = (overflow or {}).get(r.site.node, "")
        finding = getattr(r, "finding", None)
        if finding is not None and finding.verdict and not a.verdict:
            a.verdict = finding.verdict
    return out


def _fmax(a, b):
    if b is None or (isinstance(b, float) and math.isnan(b)):
        return a
    return b if a is None else max(a, b)


def _fmin(a, b):
    if b is None or (isinstance(b, float) and math.isnan(b)):
        return a
    return b if a is None else min(a, b)


def _jnum(v):
    if isinstance(v, float):
        if math.isnan(v):
            return None
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return round(v, 6)
    return v


def wait_us(t: PerfTable) -> dict[str, float]:
    """Per node, the mean time its stream sat idle before it started (the
    gap after the previous node on the same stream in the same run), where
    the source gives start times."""
    by_track: dict[tuple[str, int], list[tuple[float, float, str]]] = {}
    for n in t.nodes:
        for r, dur in zip(n.runs, n.times):
            if r.start_us is not None and dur is not None:
                by_track.setdefault((r.stream, r.run), []).append((r.start_us, dur, n.name))
    gaps: dict[str, list[float]] = {}
    for slices in by_track.values():
        slices.sort()
        for (s0, d0, _), (s1, _, name) in zip(slices, slices[1:]):
            gaps.setdefault(name, []).append(max(0.0, s1 - (s0 + d0)))
    return {k: sum(v) / len(v) for k, v in gaps.items()}


def write_op_summary(out: Path, t: PerfTable, acc: dict[str, AccuracyOfNode]) -> None:
    ranks = t.slow_ranks()
    waits = wait_us(t)
    with open(out / "op_summary.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["order", "name", "op_type", "provider", "stream", "runs"] + TIME_COLUMNS
                   + ["wait_us", "slow_rank", "mcu_cycle", "bound", "input_shapes", "output_shapes",
                      "reference_node", "accuracy", "max_abs_err", "cosine", "verdict"])
        for n in t.nodes:
            i = _identity(n, None)
            kt = n.known_times
            a = acc.get(n.reference_node) if n.reference_node else None
            hint = bound_hint(n.counter_mean)
            w.writerow([n.order, n.name, n.op_type, i["provider"], i["stream"], len(n.runs),
                        _us(n.total_us), _us(n.mean_us), _us(min(kt) if kt else None),
                        _us(max(kt) if kt else None), _us(t.share_pct(n)), _us(waits.get(n.name)),
                        ranks.get(n.name, ""),
                        _num(n.counter_mean("mcu_cycle")), hint["bound"] if hint else "",
                        i["input_shapes"], i["output_shapes"], n.reference_node or "",
                        "" if a is None else ("pass" if a.passed else "fail"),
                        "" if a is None else _num(_jnum(a.max_abs_err)),
                        "" if a is None else _num(_jnum(a.cosine)), "" if a is None else a.verdict])


def write_op_statistic(out: Path, rows: list[dict]) -> None:
    with open(out / "op_statistic.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        cols = ["op_type", "count", "nodes", "total_us", "mean_us", "min_us", "max_us", "share_pct"]
        w.writerow(cols)
        for r in rows:
            w.writerow([r["op_type"], r["count"], r["nodes"]] + [_us(r[c]) for c in cols[3:]])


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
            args.update(accuracy="pass" if a.passed else "fail", max_abs_err=_jnum(a.max_abs_err),
                        cosine=_jnum(a.cosine))
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
        for run, (a, b) in sorted(spans.items()):
            slices.append({"name": f"run {run}", "cat": "run", "ph": "X", "ts": a, "dur": round(b - a, 3),
                           "pid": pid, "tid": lanes.place("runs", a, b), "args": {"run": run}})
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": title}}]
    for tid, name in lanes.names.items():
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    return {"traceEvents": events + slices, "displayTimeUnit": "ms",
            "otherData": {"tool": "layerdiff", "title": title, "time_from": t.time_from,
                          "clock_mhz": t.settings.clock_mhz, "placement": "start times" if placed_by_start
                          else "end to end per stream"}}


def write_skip_log(out: Path, t: PerfTable) -> None:
    with open(out / "perf_skip.log", "w", encoding="utf-8") as f:
        for where, why in t.errors + t.hidden:
            f.write(f"{_one_line(where)}: {_one_line(why)}\n")


def _one_line(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


def node_view(t: PerfTable | None, acc: dict[str, AccuracyOfNode], reference_order: dict[str, tuple[int, str]]
              ) -> list[dict]:
    """Per node, accuracy and time side by side: reference nodes in execution
    order (those compared or timed), then device-only nodes (fused or renamed)
    in device order. ``slow_and_wrong``: a failing computation among the
    slowest nodes (see slow_cut)."""
    ranks = t.slow_ranks() if t is not None else {}
    perf_of: dict[str, NodePerf] = {}
    device_only: list[NodePerf] = []
    for n in (t.nodes if t is not None else []):
        if n.reference_node is not None and n.reference_node not in perf_of:
            perf_of[n.reference_node] = n
        else:
            device_only.append(n)
    view = []
    names = [k for k, _ in sorted(reference_order.items(), key=lambda kv: kv[1][0])
             if k in acc or k in perf_of]
    for name in names:
        view.append(_view_entry(name, reference_order[name][1], reference_order[name][0], acc.get(name),
                                perf_of.get(name), t, ranks))
    for n in device_only:
        view.append(_view_entry(n.name, n.op_type, n.order, None, n, t, ranks))
    return view


def slow_cut(t: PerfTable) -> int:
    """How many of the slowest nodes count as slow: a tenth of the timed
    nodes, at least one, at most SLOW_RANK."""
    return max(1, min(SLOW_RANK, math.ceil(t.timed_nodes() / 10)))


def _view_entry(name, op_type, order, a: AccuracyOfNode | None, n: NodePerf | None, t, ranks) -> dict:
    perf = None
    if n is not None:
        kt = n.known_times
        hint = bound_hint(n.counter_mean)
        perf = {"device_name": n.name, "device_op_type": n.op_type, "runs": len(n.runs),
                "total_us": _jnum(n.total_us), "mean_us": _jnum(n.mean_us),
                "min_us": _jnum(min(kt)) if kt else None, "max_us": _jnum(max(kt)) if kt else None,
                "share_pct": _jnum(t.share_pct(n)), "slow_rank": ranks.get(n.name),
                "mcu_cycle": _jnum(n.counter_mean("mcu_cycle")),
                "bound": hint["bound"] if hint else None}
    accuracy = None
    if a is not None:
        accuracy = {"passed": a.passed, "constant": a.constant, "first_failing": a.first_failing,
                    "tensors": a.tensors, "max_abs_err": _jnum(a.max_abs_err), "cosine": _jnum(a.cosine),
                    "overflow": a.overflow or None, "verdict": a.verdict or None}
    slow = perf is not None and perf["slow_rank"] is not None and perf["slow_rank"] <= slow_cut(t)
    return {"node": name, "op_type": op_type, "order": order, "accuracy": accuracy, "perf": perf,
            "slow_and_wrong": bool(slow and a is not None and not a.passed and not a.constant)}


def write_perf_report(out: Path, t: PerfTable, rows: list, first_failing_tensor: str | None,
                      reference_order: dict[str, tuple[int, str]], title: str,
                      overflow: dict[str, str] | None = None) -> dict:
    """Every performance file; returns the sections summary.json gains:
    ``perf`` (settings, counts, time source, slowest nodes, op statistic,
    files) and ``node_view`` (accuracy and time per node, side by side)."""
    out.mkdir(parents=True, exist_ok=True)
    acc = accuracy_by_node(rows, first_failing_tensor, overflow)
    files = write_tables(out, t)
    write_op_summary(out, t, acc)
    stats = op_statistic(t)
    write_op_statistic(out, stats)
    (out / "timeline.json").write_text(json.dumps(timeline(t, acc, title), separators=(",", ":")),
                                       encoding="utf-8")
    write_skip_log(out, t)
    view = node_view(t, acc, reference_order)
    by_device = {v["perf"]["device_name"]: v for v in view if v["perf"] is not None}
    slowest = sorted((n for n in t.nodes if n.mean_us is not None), key=lambda n: -n.mean_us)[:SLOW_RANK]
    timed = [n.mean_us for n in t.nodes if n.mean_us is not None]
    perf = {
        **t.settings.as_dict(),
        "time_from": t.time_from,
        "nodes": len(t.nodes),
        "records": sum(len(n.runs) for n in t.nodes),
        "runs": max((len(n.runs) for n in t.nodes), default=0),
        "skipped_rows": len(t.errors),
        "hidden_nodes": len(t.hidden),
        "node_time_us": _jnum(sum(timed)) if timed else None,
        "counters": t.counters,
        "extra_columns": t.extras,
        "slowest": [{"name": n.name, "op_type": n.op_type, "mean_us": _jnum(n.mean_us),
                     "share_pct": _jnum(t.share_pct(n)), "mcu_cycle": _jnum(n.counter_mean("mcu_cycle")),
                     "bound": (bound_hint(n.counter_mean) or {}).get("bound"),
                     "reference_node": n.reference_node,
                     "accuracy": (by_device.get(n.name) or {}).get("accuracy")} for n in slowest],
        "op_statistic": [{k: _jnum(v) for k, v in r.items()} for r in stats],
        "slow_and_wrong": [v["node"] for v in view if v["slow_and_wrong"]],
        "files": {"op_perf": "op_perf.csv", "op_summary": "op_summary.csv", "op_statistic": "op_statistic.csv",
                  "timeline": "timeline.json", "skip_log": "perf_skip.log", "per_run": files},
    }
    return {"perf": perf, "node_view": view}


def _reference_order(sites) -> dict[str, tuple[int, str]]:
    out: dict[str, tuple[int, str]] = {}
    for s in sites:
        out.setdefault(s.node, (s.order, s.op_type))
    return out


def _title(job: dict) -> str:
    return f"{job.get('model')} on {job.get('device')} ({job.get('source')}, {job.get('precision')})"


def write_perf_sections(out: Path, data: PerfData, aligner: Aligner, sites, settings: PerfSettings, rep,
                        job: dict) -> dict:
    """DUMP_OP_PERF 2: the performance files, joined with the job's
    accuracy rows; returns the summary.json sections."""
    table = build_table(data, aligner, settings)
    first = rep.first_failing()
    return write_perf_report(out, table, rep.ordered(), first.site.tensor if first else None,
                             _reference_order(sites), _title(job), rep.overflow)


def write_perf_only(out: Path, data: PerfData, aligner: Aligner, sites, settings: PerfSettings, *, job: dict,
                    parameters: dict) -> dict:
    """DUMP_OP_PERF 1: performance files and a summary.json without any
    accuracy file (nothing was compared)."""
    from layerdiff import __version__
    from layerdiff.analyzer.compare.coverage import perf_only_outcome

    table = build_table(data, aligner, settings)
    sections = write_perf_report(out, table, [], None, _reference_order(sites), _title(job))
    summary = {
        "tool": "layerdiff", "version": __version__, **job, "parameters": parameters,
        "first_failing_node": None,
        "counts": {"reference_tensors": len(sites), "compared": 0, "failed": 0, "failed_constants": 0,
                   "passed": 0, "skipped": 0, "not_dumped": 0, "invalid_out": 0, "device_tensors": 0,
                   "inputs_compared": 0, "inputs_failed": 0, "overflowing_nodes": 0},
        "failing_nodes": [], "failing_constants": [], "failing_inputs": [], "overflow_nodes": [], "detail_files": {},
        "nodes": [],
        "outcome": perf_only_outcome(),
        **sections,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1, allow_nan=False), encoding="utf-8")
    return summary
