"""The performance tables of a job's report directory, in CSV:

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
- ``perf_skip.log``: each row or node left out, and why.
"""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from layerdiff.analyzer.report.perf.table import (
    AccuracyOfNode,
    NodePerf,
    PerfTable,
    bound_hint,
    json_num,
    num_text,
)
from layerdiff.common.names import safe_filename
from layerdiff.common.perfschema import PerfRecord

TIME_COLUMNS = ["total_us", "mean_us", "min_us", "max_us", "share_pct"]


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
    return num_text(sum(nums) / len(nums))


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
            w.writerow([n.name] + [num_text(n.counter_mean(c)) for c in t.counters]
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
                w.writerow([n.name, r.run] + [num_text(r.counters.get(c)) for c in t.counters]
                           + [n.op_type, n.order, _us(r.start_us), _us(time)]
                           + [i[k] for k in rest] + [r.extra.get(c, "") for c in t.extras])
    return files


def op_statistic(t: PerfTable) -> list[dict[str, Any]]:
    """Per op type, slowest first (the spirit of op_statistic)."""
    groups: dict[str, list[NodePerf]] = {}
    for n in t.nodes:
        groups.setdefault(n.op_type or "(unknown)", []).append(n)
    grand = sum(x for n in t.nodes for x in n.known_times)
    rows: list[dict[str, Any]] = []
    for op, ns in groups.items():
        times = [x for n in ns for x in n.known_times]
        total = sum(times) if times else None
        rows.append({"op_type": op, "count": sum(len(n.runs) for n in ns), "nodes": len(ns),
                     "total_us": total, "mean_us": sum(times) / len(times) if times else None,
                     "min_us": min(times) if times else None, "max_us": max(times) if times else None,
                     "share_pct": 100.0 * total / grand if total is not None and grand > 0 else None})
    rows.sort(key=lambda r: (-(r["total_us"] or 0.0), r["op_type"]))
    return rows


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
                        num_text(n.counter_mean("mcu_cycle")), hint["bound"] if hint else "",
                        i["input_shapes"], i["output_shapes"], n.reference_node or "",
                        "" if a is None else ("pass" if a.passed else "fail"),
                        "" if a is None else num_text(json_num(a.max_abs_err)),
                        "" if a is None else num_text(json_num(a.cosine)), "" if a is None else a.verdict])


def write_op_statistic(out: Path, rows: list[dict[str, Any]]) -> None:
    with open(out / "op_statistic.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        cols = ["op_type", "count", "nodes", "total_us", "mean_us", "min_us", "max_us", "share_pct"]
        w.writerow(cols)
        for r in rows:
            w.writerow([r["op_type"], r["count"], r["nodes"]] + [_us(r[c]) for c in cols[3:]])


def write_skip_log(out: Path, t: PerfTable) -> None:
    with open(out / "perf_skip.log", "w", encoding="utf-8") as f:
        for where, why in t.errors + t.hidden:
            f.write(f"{_one_line(where)}: {_one_line(why)}\n")


def _one_line(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
