"""The summary ``layerdiff run`` prints: a job's summary.json in a few
lines a person reads, the first failing node first.
"""
from __future__ import annotations

import shutil
import sys
import textwrap
from pathlib import Path

from layerdiff.common.tf.format import shown_model

# evidence sentences the terminal shows for the answer; report.html has them all
EVIDENCE_SHOWN = 2


def format_summary(summary: dict, out: Path | str, top: int = 10, width: int | None = None) -> str:
    """Human summary: the answer first (the node the headline names), then
    the coverage, the first node past the seed's tolerance (a detail), the
    failing nodes. Sentences wrap at ``width`` (None: one line each, as a
    pipe or a log wants them; terminal_width() gives a terminal's)."""
    c = summary["counts"]
    lines = _Wrapped(max(width, 40) if width else None)
    perf = summary.get("perf")
    if perf and perf.get("perf_mode") == "perf":
        return "\n".join(_perf_lines(summary, top) + [f"reports: {out}"])
    diagnosis = summary.get("diagnosis") or {}
    answer = summary.get("outcome") or {}
    no_answer = answer.get("status") == "no_answer"
    if no_answer:
        lines.append(f"NO ANSWER: {answer.get('reason')}")
    elif diagnosis.get("headline"):
        lines.append(f"VERDICT: {diagnosis['headline']}")
    # without an execution order (a golden dump's copied files) no node is called first
    order = summary.get("execution_order") or {}
    unordered = order.get("known") is False
    comp = summary.get("first_computation_error")
    if comp and unordered:
        comps = summary.get("computation_errors") or [comp]
        lines.append("COMPUTATION ERRORS (no execution order, none is called first): "
                     + ", ".join(f"{c['node']} ({c.get('op_type') or '?'})" for c in comps[:top])
                     + (f" and {len(comps) - top} more" if len(comps) > top else ""))
    elif comp:
        evidence = comp.get("evidence") or []
        lines.append(f"FIRST COMPUTATION ERROR: {comp['node']} ({_place(comp)})" + (":" if evidence else ""))
        for e in evidence[:EVIDENCE_SHOWN]:
            lines.append(f"  - {e}", indent="    ")
        if len(evidence) > EVIDENCE_SHOWN:
            lines.append(f"  ({len(evidence) - EVIDENCE_SHOWN} more in report.html)")
    for b in (summary.get("benign_computation_errors") or [])[:top]:
        lines.append(f"BENIGN: {b['node']} ({_place(b)}, cause: {b.get('cause') or '?'}) "
                     "computes differently, but the outputs absorb it"
                     + (f": {b['impact']['why']}" if (b.get("impact") or {}).get("why") else ""))
    for key in ("nan", "overflow"):
        if diagnosis.get(key):
            lines.append(f"{key.upper()}: {diagnosis[key]['text']}")
    lines.extend(_coverage_lines(summary.get("coverage")))
    first = summary.get("first_failing_node")
    named = (summary.get("answer") or {}).get("node") or (comp or {}).get("node")
    if first:
        # past the seed's atol/rtol: a detail, named as such where it is not the answer
        label = "FIRST NODE PAST ATOL/RTOL (rounding its precision explains)" if answer.get("status") == "pass" \
            else "FIRST FAILING NODE" if not named or named == first["node"] \
            else f"FIRST NODE PAST ATOL/RTOL (a detail: the answer is {named})"
        if unordered:
            label = label.replace("FIRST ", "A ", 1) + " (by name: no execution order)"
        lines.append(f"{label}: {first['node']} ({_place(first, unordered)}, tensor {first['tensor']})")
        lines.append(f"  errors/total {first['errors']}/{first['total']} outside atol={first['atol']:g} "
                     f"rtol={first['rtol']:g}; max_abs_err {_f(first['max_abs_err'])}, "
                     f"mean_rel_err {_f(first['mean_rel_err'])}, cosine {_f(first['cosine'])}, "
                     f"first mismatch at {tuple(first['first_mismatch_index'])}: "
                     f"ref {_f(first['ref_value'])} vs device {_f(first['dev_value'])}")
    elif not no_answer:
        lines.append("NO FAILING NODE: every compared node is within atol/rtol")
    golden = summary.get("reference_dump")
    if golden:
        lines.append(f"reference: dump {golden.get('dump_path')} {_read_by(golden.get('collector'))} "
                     f"({golden.get('tensors')} tensors, {golden.get('bytes')} bytes"
                     + (f", graph from {golden.get('model')}" if golden.get("model") else "")
                     + (f", no execution order: {order['why_unknown']}" if unordered else
                        f", order from {order['from']}" if order.get("from") else "")
                     + "); device: dump "
                     f"{summary.get('dump_path')} {_read_by(summary.get('collector'))}")
    what = f"device dump {summary.get('dump_path')}" if golden else \
        f"{shown_model(summary.get('model'))} on {summary.get('device')} ({summary.get('source')})"
    unknown = ""
    if c["invalid_out"]:
        names = [e["device"] for e in (summary.get("coverage") or {}).get("unmatched_examples") or []][:3]
        unknown = (f"{c['invalid_out']} device names matching no reference tensor"
                   + (f" ({', '.join(names)}{', ...' if c['invalid_out'] > len(names) else ''}; "
                      "invalid_out_nodename.log says why)" if names else " (invalid_out_nodename.log)"))
    lines.append(f"{what}, {summary.get('device_precision') or summary.get('precision')}: {c['compared']} compared, "
                 f"{c['failed']} failed, {c['passed']} passed, {c['skipped']} skipped, {c['not_dumped']} not dumped"
                 + (f", {unknown}" if unknown else ""))
    constants = summary.get("failing_constants") or []
    if constants:
        k = constants[0]
        overflow = f", {k['fp16_overflow']} beyond the FP16 range" if k.get("fp16_overflow") else ""
        lines.append(f"constants (weights) that differ on the device: {len(constants)}, first {k['node']} "
                     f"(tensor {k['tensor']}): {k['errors']}/{k['total']} outside tolerance{overflow}")
    if c.get("inputs_compared"):
        lines.append(f"node inputs: {c['inputs_compared']} compared, {c['inputs_failed']} failed")
    for o in (summary.get("overflow_nodes") or [])[:top]:
        side = "the reference dump" if o.get("side") == "reference" else "the device"
        lines.append(f"OVERFLOW flagged by {side} at {o['node']}: {o['why']}")
    failing = [n for n in summary.get("nodes", []) if not n["passed"] and not n.get("constant")
               and n.get("role") != "input"]
    if failing:
        lines.append(f"{min(top, len(failing))} of {len(failing)} failing nodes by name (no execution order):"
                     if unordered else f"first {min(top, len(failing))} failing nodes in execution order:")
        shown = failing[:top]
        # columns as wide as what they hold (an op type is never cut), the node's name within the width
        op_w = max([2] + [len(n["op_type"] or "") for n in shown])
        node_w = max(12, min(max(len(n["node"]) for n in shown), (width or 120) - op_w - 80))
        lines.append(f"  {'#':>5}  {'node':{node_w}.{node_w}}  {'op':{op_w}}  {'errors/total':>16}  "
                     f"{'max_abs_err':>11}  {'cosine':>9}  verdict", wrap=False)
        for n in shown:
            lines.append(f"  {n['order']:>5}  {n['node']:{node_w}.{node_w}}  {n['op_type'] or '':{op_w}}  "
                         f"{str(n['errors']) + '/' + str(n['total']):>16}  {_f(n['max_abs_err']):>11}  "
                         f"{_f(n['cosine']):>9}  {n.get('verdict') or ''}", wrap=False)
    drawn, left = len(summary.get("plots") or {}), summary.get("plots_not_drawn") or 0
    if left:
        lines.append(f"plots: the first {drawn} failing nodes drawn, {left} more not (--max-plots N or all draws "
                     "more)")
    elif drawn:
        lines.append(f"plots: {drawn} failing node{'s' if drawn > 1 else ''} drawn")
    if perf:
        lines.extend(_perf_lines(summary, top))
    lines.append(f"reports: {out}")
    return "\n".join(lines)


class _Wrapped(list):
    """The summary's lines, each sentence wrapped at the width (continued
    lines indented); tables are appended with ``wrap=False``."""

    def __init__(self, width: int | None) -> None:
        super().__init__()
        self.width = width

    def append(self, line: str, indent: str = "  ", wrap: bool = True) -> None:
        if not wrap or self.width is None or len(line) <= self.width:
            super().append(line)
            return
        lead = line[:len(line) - len(line.lstrip(" "))]
        super().append(textwrap.fill(line, self.width, initial_indent="", subsequent_indent=lead + indent,
                                     break_long_words=False, break_on_hyphens=False))

    def extend(self, lines) -> None:
        for line in lines:
            self.append(line)


def terminal_width() -> int | None:
    """The width to wrap at: the terminal's, where the output is one."""
    return shutil.get_terminal_size((100, 24)).columns if sys.stdout.isatty() else None


def _place(node: dict, unordered: bool = False) -> str:
    """"Conv, execution #2"; a dump without op types gives only the order,
    one without an order only the op type."""
    op = node.get("op_type")
    if unordered:
        return op or "op type unknown"
    return f"{op}, execution #{node.get('order')}" if op else f"execution #{node.get('order')}"


def _coverage_lines(cov) -> list[str]:
    if not isinstance(cov, dict):
        return []
    lines = [f"COVERAGE: {cov.get('text')}"]
    for e in (cov.get("unmatched_examples") or []) if not cov.get("adequate") else []:
        if e.get("closest"):
            lines.append(f"  device name {e['device']!r} matches nothing; did you mean "
                         + " or ".join(repr(c) for c in e["closest"]) + "?")
    unused = cov.get("map_node_dict_unused") or []
    if unused:
        lines.append(f"NOTE: {len(unused)} map_node_dict entries matched no device tensor: "
                     + ", ".join(f"{u['reference']!r} -> {u['device']!r}" for u in unused[:5])
                     + (" ..." if len(unused) > 5 else ""))
    unknown = cov.get("exclude_node_list_unknown") or []
    if unknown:
        lines.append("NOTE: exclude_node_list names no node of the reference: "
                     + ", ".join(repr(n) for n in unknown[:5]) + (" ..." if len(unknown) > 5 else ""))
    keys = cov.get("skip_keys_unused") or []
    if keys:
        lines.append("NOTE: skip_keys found in no reference name: " + ", ".join(repr(k) for k in keys))
    return lines


def _perf_lines(summary: dict, top: int) -> list[str]:
    p = summary["perf"]
    lines = [f"performance ({p['perf_mode']}): {p['nodes']} nodes, {p['records']} node runs, node time per run "
             f"{_f(p['node_time_us'])} us (time from {p['time_from']}); {p['skipped_rows']} rows skipped, "
             f"{p['hidden_nodes']} nodes left out (perf_skip.log)"]
    wrong = p.get("slow_and_wrong") or []
    if wrong:
        lines.append(f"SLOW AND WRONG: {', '.join(wrong)} (among the slowest nodes and failing)")
    if p["slowest"]:
        lines.append(f"slowest {min(top, len(p['slowest']))} nodes:")
        lines.append(f"  {'node':40.40}  {'op':14.14}  {'mean_us':>10}  {'share':>7}  {'accuracy':8}  bound")
        for n in p["slowest"][:top]:
            acc = n.get("accuracy")
            verdict = "" if acc is None else ("pass" if acc["passed"] else "FAIL")
            share = f"{n['share_pct']:.1f}%" if n["share_pct"] is not None else "-"
            lines.append(f"  {n['name']:40.40}  {n['op_type']:14.14}  {_f(n['mean_us']):>10}  {share:>7}  "
                         f"{verdict:8}  {n['bound'] or ''}")
    return lines


def _f(v) -> str:
    if v is None:
        return "nan"
    if isinstance(v, str):
        return v
    return f"{v:.6g}"


def _read_by(collector: str | None) -> str:
    """Where a dump was read: on a collector (its address), or by this
    command itself (``collector.core.InProcessCollector``'s address)."""
    return "read here" if str(collector or "").startswith("in-process:") else f"on collector {collector}"
