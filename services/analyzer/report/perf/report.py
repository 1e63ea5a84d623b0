"""A job's performance report (DUMP_OP_PERF 1 or 2): every performance file
of the report directory, and the sections summary.json gains.

Files written into the report directory:

- ``op_perf.csv``, ``perf/{op}.csv``, ``op_summary.csv``,
  ``op_statistic.csv``, ``perf_skip.log``: the tables (see ``files``);
- ``timeline.json``: one track per stream or thread, one slice per node run
  (see ``timeline``);
- with DUMP_OP_PERF 1 (nothing compared), ``summary.json`` itself.

summary.json gains ``perf`` (settings, counts, time source, slowest nodes,
op statistic, files) and ``node_view`` (accuracy and time per node, side by
side; a failing computation among the slowest nodes is ``slow_and_wrong``).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from layerdiff.analyzer.align.names import Aligner
from layerdiff.analyzer.report.jsontext import json_text
from layerdiff.analyzer.report.perf.files import (
    op_statistic,
    write_op_statistic,
    write_op_summary,
    write_skip_log,
    write_tables,
)
from layerdiff.analyzer.report.perf.settings import PerfSettings
from layerdiff.analyzer.report.perf.table import (
    AccuracyOfNode,
    NodePerf,
    PerfData,
    PerfTable,
    accuracy_by_node,
    bound_hint,
    build_table,
    json_num,
)
from layerdiff.analyzer.report.perf.timeline import timeline

SLOW_RANK = 10            # "slow": among the slowest tenth of the nodes, at most this many


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
                "total_us": json_num(n.total_us), "mean_us": json_num(n.mean_us),
                "min_us": json_num(min(kt)) if kt else None, "max_us": json_num(max(kt)) if kt else None,
                "share_pct": json_num(t.share_pct(n)), "slow_rank": ranks.get(n.name),
                "mcu_cycle": json_num(n.counter_mean("mcu_cycle")),
                "bound": hint["bound"] if hint else None}
    accuracy = None
    if a is not None:
        accuracy = {"passed": a.passed, "constant": a.constant, "first_failing": a.first_failing,
                    "tensors": a.tensors, "max_abs_err": json_num(a.max_abs_err), "cosine": json_num(a.cosine),
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
    slowest = sorted((n for n in t.nodes if n.mean_us is not None), key=lambda n: -(n.mean_us or 0.0))[:SLOW_RANK]
    timed = [n.mean_us for n in t.nodes if n.mean_us is not None]
    perf = {
        **t.settings.as_dict(),
        "time_from": t.time_from,
        "nodes": len(t.nodes),
        "records": sum(len(n.runs) for n in t.nodes),
        "runs": max((len(n.runs) for n in t.nodes), default=0),
        "skipped_rows": len(t.errors),
        "hidden_nodes": len(t.hidden),
        "node_time_us": json_num(sum(timed)) if timed else None,
        "counters": t.counters,
        "extra_columns": t.extras,
        "slowest": [{"name": n.name, "op_type": n.op_type, "mean_us": json_num(n.mean_us),
                     "share_pct": json_num(t.share_pct(n)), "mcu_cycle": json_num(n.counter_mean("mcu_cycle")),
                     "bound": (bound_hint(n.counter_mean) or {}).get("bound"),
                     "reference_node": n.reference_node,
                     "accuracy": (by_device.get(n.name) or {}).get("accuracy")} for n in slowest],
        "op_statistic": [{k: json_num(v) for k, v in r.items()} for r in stats],
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
    (out / "summary.json").write_text(json_text(summary, allow_nan=False), encoding="utf-8")
    return summary
