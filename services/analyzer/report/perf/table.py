"""Performance data beside accuracy: the job's performance stream read into
one table of nodes, and what the report files share about it.

- the settings (``perf_mode``: DUMP_OP_PERF 0 / 1 / 2, runs, clock) are
  ``settings``', checked at submit time;
- ``receive``: the performance stream read to its end (within MAX_RECORDS);
- ``build_table``: the records folded into one row per node (``NodePerf``),
  in execution order, joined with the reference's nodes; ``bound_hint``:
  data-bound or compute-bound from a node's counters;
- ``accuracy_by_node``: the compared outputs of each reference node folded
  into one verdict, to set beside its time;
- the number formats of the CSV (``num_text``) and JSON (``json_num``) files.

The files are written by ``files`` (the CSV tables), ``timeline``
(``timeline.json``) and ``report`` (all of them, and the summary.json
sections).

Times: a record's own duration when the source measured one; otherwise
``mcu_cycle / clock_mhz`` (default 1000 MHz, so one microsecond stands for
1000 cycles), and ``summary.json`` says which.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

from layerdiff.analyzer.align.names import Aligner
from layerdiff.analyzer.report.perf.settings import PerfSettings
from layerdiff.common.errors import LayerdiffError
from layerdiff.common.onnxgraph import TensorSite
from layerdiff.common.perfschema import COUNTER_COLUMNS, PerfRecord, decode_perf

SPAN_MARK = "_span"
# A job keeps its performance records in memory until the reports are
# written (a few hundred bytes each); beyond this many the rest is left out.
MAX_RECORDS = 2_000_000


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
    site: TensorSite | None = None     # the reference site it joins, if any
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
        timed = sorted((n for n in self.nodes if n.mean_us is not None), key=lambda n: -(n.mean_us or 0.0))
        return {n.name: i + 1 for i, n in enumerate(timed)}


def _merge(into: PerfRecord, other: PerfRecord) -> None:
    """A second record of the same node and run (counters from one file, time
    from another) fills what the first lacks."""
    for k, v in other.counters.items():
        into.counters.setdefault(k, v)
    for k, text in other.extra.items():
        into.extra.setdefault(k, text)
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


def bound_hint(counter: Callable[[str], float | None]) -> dict[str, str] | None:
    """Data-bound or compute-bound, from a node's counters (5.7.2.2: look at
    the nodes with the most mcu_cycle first): data movement (mte_total_cycle)
    against the busiest compute unit (vme, mme, vec)."""
    data = counter("mte_total_cycle")
    cycles = {u: counter(f"{u}_cycle") for u in ("vme", "mme", "vec")}
    units = {u: v for u, v in cycles.items() if v is not None}
    if data is None and not units:
        return None
    busiest = max(units, key=lambda u: units[u]) if units else None
    compute = units.get(busiest, 0.0) if busiest else 0.0
    data = data or 0.0
    if data == 0 and compute == 0:
        return None
    if data > compute:
        return {"bound": "data-bound",
                "why": f"mte_total_cycle {num_text(data)} > {busiest or 'compute'}_cycle "
                       f"{num_text(compute)}: moves dominate; look at tiling and reuse"}
    return {"bound": "compute-bound",
            "why": f"{busiest}_cycle {num_text(compute)} >= mte_total_cycle {num_text(data)}: "
                   "a compute unit dominates; look at the kernel and its parallelism"}


# ------------------------------------------------------------- number formats

def num_text(v) -> str:
    """A number in a CSV cell: integers without a fraction, others to 6
    decimals without trailing zeros; None is empty."""
    if v is None:
        return ""
    if isinstance(v, int):
        return str(v)
    if math.isfinite(v) and v == int(v) and abs(v) < 1e15:
        return str(int(v))
    return f"{v:.6f}".rstrip("0").rstrip(".")


def json_num(v):
    """A number in JSON: floats to 6 decimals, NaN as null, infinities as
    "inf" / "-inf" (JSON has no literal for them)."""
    if isinstance(v, float):
        if math.isnan(v):
            return None
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return round(v, 6)
    return v


# ------------------------------------------------------- accuracy per node

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

