"""Report files of a job, written into its private report directory:

- ``cpu_vs_npu.csv``: one row per compared node output in execution order,
  the seed tool's columns first, then layerdiff's further metrics;
- ``{op_name}.csv``: for each failing node, its worst elements (at most
  ``diff_cnt``; index, std_value, npu_value, abs_diff, relative_diff),
  written while the job compares (report.details);
- ``compare_skip.log``, ``invalid_out_nodename.log``,
  ``dump_memory_nodename.log``, ``overflow_nodename.log``: a node and a
  reason per line;
- ``op_config.csv``: a template with every node and NA tolerances;
- ``node_runtime.json``, ``consumer_map.json``: node order and graph edges;
- ``summary.json``: everything a machine needs (first failing node, counts,
  the job's parameters, tool version) and per-node metrics.
"""
from __future__ import annotations

import csv
import io
import math
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from layerdiff import __version__
from layerdiff.analyzer.compare import coverage
from layerdiff.analyzer.compare.node import NodeOutcome
from layerdiff.analyzer.diagnose import verdicts as diagnose
from layerdiff.analyzer.diagnose import weights as weights_mod
from layerdiff.analyzer.diagnose.errormodel import Block, Budget
from layerdiff.analyzer.report.details import DetailFiles
from layerdiff.analyzer.report.documents import write_documents
from layerdiff.analyzer.report.jsontext import json_text
from layerdiff.analyzer.report.table_parts import table_parts
from layerdiff.common.names import safe_filename
from layerdiff.common.onnxgraph import TensorSite
from layerdiff.common.schema import STATUS_CHECK_SKIP, STATUS_CONCAT_SKIP

SEED_COLUMNS = ["op_name", "nan/inf", "errors/total", "1st_diff_offset/offset_dim/data_shape", "ref_value",
                "npu_value", "max_abs_err", "mean_abs_err", "max_abs_total", "mean_abs_total", "mean", "std", "rms"]
EXTRA_COLUMNS = ["index", "node", "tensor", "op_type", "device_name", "result", "atol", "rtol",
                 "max_abs_diff", "mean_abs_diff", "cosine", "mse", "rmse", "pearson", "sqnr_db", "rel_euclidean",
                 "kl_div", "rel_err_lt_0.001", "rel_err_lt_0.005", "ref_nan", "ref_inf", "npu_nan", "npu_inf",
                 "fp16_overflow", "npu_fp16_overflow", "finite_pairs", "both_nan", "nonfinite_errors", "note", "role",
                 "overflow", "verdict", "cause", "evidence",
                 # the error model: what the node computes in, the relative RMS error its own arithmetic
                 # explains and may add (FACTOR times it), the error it adds itself (re-run alone), and read
                 "precision", "explained_rel_err", "allowed_rel_err", "own_rel_err", "read_rel_err"]


def g6(v: float) -> str:
    """Six significant digits; nan, inf and -inf as such (a NaN's sign is not shown)."""
    return f"{v:.6g}"


@dataclass
class Row:
    """One comparison: a node output, or (role "input") the tensor a node
    read, in which case ``site.output_index`` is the input index."""
    site: TensorSite
    device_name: str
    outcome: NodeOutcome
    role: str = "output"
    overflow: str = ""
    device_dtype: str = ""           # what the device computed this tensor in (float16: FP16 range applies)
    # evidence gathered while the tensors were at hand (failing nodes only)
    isolated: object = None          # metrics of the device against the node re-run alone on its device inputs
    isolation_note: str = ""         # why there is no isolated re-run
    unit_note: str = ""              # what it was re-run with (producers the device did not send)
    weight_range: str = ""           # its weights beyond what its precision holds
    isolated_core: object = None     # the same without mask-like values (|x| >> the rest), where the reference has some
    core_note: str = ""
    quant_step: float = 0.0          # a quantized build: the step of the grid the device values lie on
    quant_levels: int = 0
    clipped: str = ""                # an INT8 hand-over that saturates: where and how far
    int8_bound: object = None        # a quantized Conv/Gemm/MatMul: (expected rounding RMSE, how it was had)
    inherited: str = ""              # why no closer look was needed: its error is what it read
    layout: str = ""
    uneven: str = ""
    # the error model (layerdiff.analyzer.diagnose.errormodel), for node outputs
    precision: str = ""              # what the node is taken to compute in
    precision_from: str = ""         # where that was read from
    budget: Budget | None = None     # the error its own arithmetic explains
    block: Block | None = None       # the part of the tensor with the largest relative error
    axis_block: Block | None = None  # the worst window of its channels (features), without what stands out
    read_rel: float | None = None    # the largest relative RMS error of what it read (None: unknown)
    # a row normalization's input: its error over each row's spread (errormodel.normalized_read)
    norm_read: tuple[float, float] | None = None
    own_rel: float | None = None     # the relative RMS error it adds itself (against its isolated re-run)
    own_block: Block | None = None   # the part of that error with the largest relative error
    looked: bool = False             # examined: its error was more than its own arithmetic explains
    masked: int = 0                  # mask-like reference values left out of the error model's figures
    err_rel: float | None = None     # relative RMS error without them (None: none left out)
    err_rms: float | None = None
    constants_read: frozenset = frozenset()    # the weights the node reads
    reads: tuple = ()                          # the tensors it reads from other nodes and weights
    finding: diagnose.Finding | None = None     # set when the report is written

    @property
    def blocks(self) -> list[Block]:
        """Its worst block, and its worst window of channels (features)
        where that is another."""
        return [b for b in dict.fromkeys((self.block, self.axis_block)) if b is not None]

    @property
    def failed(self) -> bool:
        """Past the seed's atol/rtol somewhere (its statistic, not the verdict)."""
        return not self.outcome.metrics.passed

    @property
    def rel_err(self) -> float:
        """Its relative RMS error, ||device - reference|| / ||reference||
        (mask-like reference values left out, where it holds some)."""
        v = self.err_rel if self.err_rel is not None else self.outcome.metrics.rel_euclidean
        return v if not math.isnan(v) else 0.0

    @property
    def abs_err(self) -> float:
        """Its RMS error (mask-like reference values left out)."""
        v = self.err_rms if self.err_rms is not None else self.outcome.metrics.rmse
        return v if not math.isnan(v) else 0.0

    @property
    def is_input(self) -> bool:
        return self.role == "input"

    @property
    def label(self) -> str:
        return f"{self.site.node}.input.{self.site.output_index}" if self.is_input else self.site.tensor

    @property
    def is_constant(self) -> bool:
        return self.site.is_constant


@dataclass
class JobReport:
    rows: list[Row] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)        # (node, reason)
    invalid_out: list[tuple[str, str]] = field(default_factory=list)    # (device name, reason)
    not_dumped: list[TensorSite] = field(default_factory=list)
    # reference tensors computed inside a fused device node (Conv+BN+Relu as one
    # kernel): not dumped by design; the fusion's output is compared instead
    fused: list[tuple[TensorSite, str]] = field(default_factory=list)   # (site, device node covering it)
    # device tensors standing for a reference tensor without being compared:
    # (device tensor, reference tensor, why) - INT8 views, weight copies
    attributed: list[tuple[str, str, str]] = field(default_factory=list)
    # reference tensors the device folded into constants (the graphs say so)
    folded: list[tuple[TensorSite, str]] = field(default_factory=list)  # (site, why)
    value_pairs: list[dict] = field(default_factory=list)   # pairings decided by value (alignment.csv rows)
    device_names: list[str] = field(default_factory=list)
    check_skip: list[tuple[str, str]] = field(default_factory=list)     # tiled slices that failed validation
    concat_skip: list[tuple[str, str]] = field(default_factory=list)    # slices that did not splice
    overflow: dict[str, str] = field(default_factory=dict)              # node -> why the device flagged it
    reference_overflow: dict[str, str] = field(default_factory=dict)    # node -> why a golden dump's runtime did
    input_ranges: dict[str, tuple[float, float]] = field(default_factory=dict)  # reference min/max of op inputs
    quantized: bool = False
    range_skips: list[tuple[str, str]] = field(default_factory=list)    # tensor_min_max.txt lines not read
    plots: dict[str, dict] = field(default_factory=dict)                # row label -> plot files
    plots_left: int = 0     # failing rows past the plot limit (Prepared.max_plots), not drawn
    user_skipped: set[str] = field(default_factory=set)                 # tensors the options skip
    device_errors: list[tuple[str, str]] = field(default_factory=list)  # device entries that could not be read

    def note_overflow(self, node: str, why: str) -> None:
        self.overflow.setdefault(node, why)

    def log_splice_failure(self, rec) -> None:
        if rec.status == STATUS_CHECK_SKIP:
            self.check_skip.append((rec.name, rec.message))
        elif rec.status == STATUS_CONCAT_SKIP:
            self.concat_skip.append((rec.name, rec.message))

    def in_graph_order(self, sites: list[TensorSite]) -> None:
        """Sort every list by the reference's execution order, then by name,
        so that no file depends on the order the device stream came in."""
        rank: dict[str, int] = {}
        for s in sites:
            rank.setdefault(s.tensor, s.order)
            rank.setdefault(s.node, s.order)
        last = len(sites)

        def key(item) -> tuple:
            name = item[0] if isinstance(item, tuple) else item
            return (rank.get(name.split(" (input ")[0], last), name, item)

        for items in (self.skipped, self.invalid_out, self.device_names, self.check_skip, self.concat_skip):
            items.sort(key=key)
        self.overflow = dict(sorted(self.overflow.items(), key=key))
        self.plots = dict(sorted(self.plots.items(), key=key))

    def ordered(self) -> list[Row]:
        # a node's inputs come before its outputs, as it reads them first
        return sorted(self.rows, key=lambda r: (r.site.order, not r.is_input, r.site.output_index))

    def first_failing(self) -> Row | None:
        """The first failing computation in execution order. Constants are
        parameters, not computations: a constant that differs (a weight that
        overflows FP16, a quantized weight) is reported on its own, and so
        are node inputs, which a node inherits rather than computes."""
        return next((r for r in self.ordered() if r.failed and not r.is_constant and not r.is_input), None)


def _seed_cells(r: Row) -> list[str]:
    m = r.outcome.metrics
    idx = "(" + ",".join(str(i) for i in m.first_mismatch_index) + ")"
    shape = "(" + ",".join(str(i) for i in m.shape) + ")"
    name = f"{r.site.node}.input.{r.site.output_index}" if r.is_input else r.site.node
    return [
        f"{name}(atol={m.atol:g},rtol={m.rtol:g})",
        f"{m.dev_nan}/{m.dev_inf}",
        f"{m.errors}/{m.total}",
        f"{m.first_mismatch_offset}/{idx}/{shape}",
        g6(m.ref_value), g6(m.dev_value),
        g6(m.max_abs_err), g6(m.mean_abs_err), g6(m.max_rel_err), g6(m.mean_rel_err),
        g6(m.ref_mean), g6(m.ref_std), g6(m.ref_rms),
    ]


def _extra_cells(i: int, r: Row) -> list[str]:
    m = r.outcome.metrics
    return [str(i), r.site.node, r.site.tensor, r.site.op_type, r.device_name, "fail" if r.failed else "pass",
            g6(m.atol), g6(m.rtol), g6(m.max_abs_diff), g6(m.mean_abs_diff), g6(m.cosine), g6(m.mse), g6(m.rmse),
            g6(m.pearson), g6(m.sqnr_db), g6(m.rel_euclidean), g6(m.kl_div), g6(m.rel_err_lt_0_001),
            g6(m.rel_err_lt_0_005), str(m.ref_nan), str(m.ref_inf), str(m.dev_nan), str(m.dev_inf),
            str(m.fp16_overflow), str(m.dev_fp16_overflow), str(m.finite_pairs), str(m.both_nan),
            str(m.nonfinite_errors), r.outcome.note, r.role, r.overflow,
            r.finding.verdict if r.finding else "", r.finding.cause if r.finding else "",
            " | ".join(r.finding.evidence) if r.finding else "", *_model_cells(r)]


def _model_cells(r: Row) -> list[str]:
    b = r.budget
    return [r.precision, g6(b.rel) if b is not None else "", g6(b.allowed) if b is not None else "",
            g6(r.own_rel) if r.own_rel is not None else "", g6(r.read_rel) if r.read_rel is not None else ""]


def _json_num(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


def node_summary(r: Row) -> dict:
    d = r.outcome.metrics.as_dict()
    for k, v in d.items():     # only the few non-finite floats rewritten (every node's forty numbers)
        if isinstance(v, float) and not math.isfinite(v):
            d[k] = _json_num(v)
    d.update(node=r.site.node, tensor=r.site.tensor, op_type=r.site.op_type, order=r.site.order,
             device_name=r.device_name, passed=not r.failed, constant=r.is_constant, note=r.outcome.note,
             role=r.role, overflow=r.overflow or None)
    if r.is_input:
        d["input_index"] = r.site.output_index
    d.update(verdict=r.finding.verdict if r.finding else None, cause=r.finding.cause if r.finding else "",
             evidence=list(r.finding.evidence) if r.finding else [],
             impact=r.finding.impact.as_dict() if r.finding and r.finding.impact is not None else None)
    if r.isolated is not None:
        d["isolated"] = {k: _json_num(getattr(r.isolated, k)) for k in ("errors", "total", "cosine",
                                                                          "mean_rel_err", "max_abs_diff")}
    if r.budget is not None:
        b = r.budget
        d["error_model"] = {"precision": r.precision, "precision_from": r.precision_from, "k": b.k,
                            "rho": _json_num(b.rho), "explained_rel_err": _json_num(b.rel),
                            "allowed_rel_err": _json_num(b.allowed), "rel_err": _json_num(r.rel_err),
                            "own_rel_err": _json_num(r.own_rel) if r.own_rel is not None else None,
                            "read_rel_err": _json_num(r.read_rel) if r.read_rel is not None else None,
                            "worst_block": {"where": r.block.where, "rel_err": _json_num(r.block.rel)}
                            if r.block is not None else None,
                            "masked": r.masked, "words": b.explains()}
    return d


_PRECISION = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}


def device_precision(rows: list[Row], quantized: bool) -> str:
    """What the device computed in, as its tensors show it (not as asked):
    int8 for a quantized build, else the float type most node outputs came
    in ("mixed fp16/fp32" where neither holds most of them)."""
    if quantized:
        return "int8"
    kinds: dict[str, int] = {}
    for r in rows:
        if not r.is_input and r.device_dtype in _PRECISION:
            kinds[_PRECISION[r.device_dtype]] = kinds.get(_PRECISION[r.device_dtype], 0) + 1
    if not kinds:
        return ""
    top, n = max(kinds.items(), key=lambda kv: kv[1])
    if len(kinds) > 1 and 2 * n < sum(kinds.values()):
        return "mixed " + "/".join(sorted(kinds))
    return top


def _measure_impact(rows: list[Row], impact) -> None:
    """Each computation error's effect on the model's outputs, in execution
    order (the budget goes to the earliest), as the last piece of its evidence."""
    if impact is None:
        return
    measured = [r for r in rows if r.finding is not None and r.finding.verdict == diagnose.COMPUTATION
                and not r.is_input and not r.is_constant]
    impact.prepare([r.site.tensor for r in measured])
    for r in measured:
        f = r.finding
        assert f is not None        # chosen above for its finding
        f.impact = impact.measure(r.site.tensor)
        if f.impact.harmful is False:
            f.impact.why = _why_absorbed(r)
        f.evidence.append(f.impact.sentence())


def _why_absorbed(r: Row) -> str:
    """What the data say about why a computation error does not reach the outputs."""
    assert r.finding is not None        # only a row with a finding has an impact to explain
    if r.isolated_core is not None:
        return f"its differences lie in mask-like values ({r.core_note}), which what follows saturates"
    if any("clamped" in e for e in r.finding.evidence):
        return "a constant the device clamped, whose new value acts the same downstream"
    return ""


def _read_rows(rows: list[Row], node_inputs: dict[str, list[str]]) -> dict[str, list[Row]]:
    """node -> the rows of what it read: its own input rows where the device
    sent them, else the output rows of the tensors it reads."""
    by_tensor = {r.site.tensor: r for r in rows if not r.is_input}
    own: dict[str, list[Row]] = {}
    for r in rows:
        if r.is_input:
            own.setdefault(r.site.node, []).append(r)
    out = {}
    for node, ins in node_inputs.items():
        out[node] = own.get(node) or [by_tensor[t] for t in ins if t in by_tensor]
    return out


def write_report(out: Path, rep: JobReport, *, parameters: dict, job: dict, node_runtime: list[dict],
                 consumers: dict[str, list[str]], all_sites: list[TensorSite], aligner,
                 node_inputs: dict[str, list[str]] | None = None,
                 sections: dict | Callable[[], dict | None] | None = None,
                 min_coverage: float | None = None, impact=None, weights: list | None = None,
                 presumed: dict[str, str] | None = None, outputs: set[str] | frozenset = frozenset(),
                 order: diagnose.ExecutionOrder | None = None, details: DetailFiles | None = None) -> dict:
    """``sections``: further top-level parts of summary.json (the performance
    data, its per-node view), written by their own modules; a callable is
    called once every row carries its diagnosis. The coverage comes first:
    below ``min_coverage`` the headline is that the job cannot answer.
    ``impact`` (impact.ImpactRunner): measures what each computation error
    does to the outputs; the headline names the first harmful one.
    ``weights``: the device model's weights against the reference's
    (weights.csv), which name "cause: weight" without the node's inputs.
    ``presumed``: node -> the tensor it is presumed to read (a golden dump
    that records no inputs: the node before it in execution order), said
    in its evidence. ``order``: what the execution order was read from
    (without one, no node is called first). ``details``: the detail files
    written while the job compared (report.details), placed here; without
    them, written here."""
    order = order or diagnose.ExecutionOrder()
    out.mkdir(parents=True, exist_ok=True)
    rep.in_graph_order(all_sites)
    rows = rep.ordered()
    weight_issues = weights_mod.issues(weights or [], getattr(aligner, "groups", {}))
    findings = diagnose.decide(rows, _read_rows(rows, node_inputs or {}), rep.quantized, weight_issues,
                               unknown_reads={n for n, t in (presumed or {}).items() if not t},
                               order_unknown=order.unknown)
    for r in rows:
        r.finding = findings.get(id(r))
        if r.finding and presumed and presumed.get(r.site.node):
            r.finding.evidence.append(f"what it read is presumed from the execution order: {presumed[r.site.node]}, "
                                      "the output of the node before it (neither dump records its inputs; a model "
                                      "or dump_mode all gives them)")
        if r.finding and r.finding.cause == "quantization" and r.quant_step and consumers.get(r.site.node):
            # the hand-over's break shows in what it feeds: name it
            r.finding.hand_over = list(consumers[r.site.node])
            r.finding.evidence.append("its INT8 hand-over feeds " + ", ".join(consumers[r.site.node]))
    _measure_impact(rows, impact)
    nan_overflow = diagnose.nan_and_overflow(rows)
    cov = coverage.assess(rep, all_sites, aligner, min_coverage=min_coverage, source=job.get("source", ""),
                          dump_path=job.get("dump_path") or "")
    taken: set[str] = set()
    detail_files = {r.label: safe_filename(r.label if r.is_input or r.site.output_index else r.site.node, taken)
                    + ".csv" for r in rows if r.failed}
    aligned = alignment_rows(rep, aligner, all_sites)
    if details is not None:
        # Written while the job compared: the last few and the renames are
        # handed to the report's process (report.writer), or made here.
        details.place(rows, detail_files)
    # The Parquet tables are made of their parts by the report's process
    # (pyarrow's import, the arrays and the encoding held this process's
    # interpreter lock for a twentieth of a two-dump job), or here, beside
    # the rest, on a thread of their own (as the detail files not written
    # yet): Parquet's encoding and creating hundreds of files let the
    # interpreter go meanwhile.
    parts = table_parts(rows, detail_files, aligned, weights)
    tables_here = details is None or not details.hand_tables(parts)
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="report-aside") as aside:
        written = []
        if tables_here:
            from layerdiff.analyzer.report.tables import write_table_parts  # pyarrow's: only where needed

            written.append(aside.submit(write_table_parts, out, parts))
        if details is None:
            written.append(aside.submit(DetailFiles(out).place, rows, detail_files))
        first = rep.first_failing()
        comps = [r for r in rows if r.finding and r.finding.verdict == diagnose.COMPUTATION and not r.finding.benign]
        first_comp = comps[0] if comps else None
        benign = [r for r in rows if r.finding and r.finding.benign]
        undecided = [r for r in rows if r.finding and r.finding.verdict == diagnose.UNDECIDED]
        spent = diagnose.outputs_out_of_tolerance(rows, node_inputs or {}, outputs)
        text = diagnose.headline(first_comp, first, nan_overflow, benign, undecided, spent, order, comps)
        answer = coverage.outcome(rep, cov, diagnose.exit_of(first_comp, nan_overflow, benign, undecided, spent,
                                                             first, order.unknown))
        if answer["status"] == "no_answer":
            text = f"NO ANSWER: {answer['reason']}"
        diagnosis = {"headline": text, **nan_overflow}
        kind, named = diagnose.answer_row(first_comp, nan_overflow, benign, undecided, spent, rows)
        if answer["status"] == "no_answer" and kind != diagnose.UNDECIDED:
            kind, named = "no answer", None       # too little compared to name anything
        if impact is not None:
            unmeasured = [r.site.node for r in rows if r.finding and r.finding.impact is not None
                          and r.finding.impact.harmful is None]
            diagnosis["impact"] = {**impact.summary(), "not_measured": unmeasured}
        verdicts = [{"node": r.site.node, "tensor": r.site.tensor, "op_type": r.site.op_type, "order": r.site.order,
                     "verdict": r.finding.verdict, "cause": r.finding.cause, "evidence": list(r.finding.evidence),
                     "impact": r.finding.impact.as_dict() if r.finding.impact is not None else None}
                    for r in rows if r.finding]
        inputs = [r for r in rows if r.is_input]
        rows_out = [r for r in rows if not r.is_input]
        failed = [r for r in rows_out if r.failed]
        failed_constants = [r for r in failed if r.is_constant]
        summary = {
            "tool": "layerdiff",
            "version": __version__,
            **job,
            "parameters": parameters,
            "outcome": answer,
            # the answer, as the headline words it: what every view of the job names
            "answer": _answer(text, kind, named, answer, cov),
            "coverage": cov,
            "diagnosis": diagnosis,
            # without an execution order the "first" ones are the first listed, by name (execution_order.known)
            "execution_order": {"from": order.source or None, "known": not order.unknown,
                                "why_unknown": order.unknown or None},
            "computation_errors": [node_summary(r) for r in comps],
            "first_computation_error": node_summary(first_comp) if first_comp else None,
            "device_precision": device_precision(rows, rep.quantized),
            "first_failing_node": node_summary(first) if first else None,
            "benign_computation_errors": [node_summary(r) for r in benign],
            "counts": {
                "reference_tensors": len(all_sites),
                "compared": len(rows_out),
                "failed": len(failed) - len(failed_constants),
                "failed_constants": len(failed_constants),
                "passed": len(rows_out) - len(failed),
                "inputs_compared": len(inputs),
                "inputs_failed": sum(r.failed for r in inputs),
                "overflowing_nodes": len(rep.overflow),
                "skipped": len(rep.skipped),
                "not_dumped": len(rep.not_dumped),
                "fused": len(rep.fused),
                "folded": len(rep.folded),
                "attributed": len(rep.attributed),
                "invalid_out": len(rep.invalid_out),
                "device_tensors": len(rep.device_names),
            },
            "failing_nodes": [r.site.tensor for r in failed if not r.is_constant],
            "failing_constants": [node_summary(r) for r in failed_constants],
            "failing_inputs": [r.label for r in inputs if r.failed],
            "overflow_nodes": [{"node": n, "why": why, "side": "device"} for n, why in rep.overflow.items()] +
                              [{"node": n, "why": why, "side": "reference"}
                               for n, why in rep.reference_overflow.items()],
            "verdicts": verdicts,
            "plots": rep.plots,
            "plots_not_drawn": rep.plots_left,
            "quantization": diagnose.quantization_advice(all_sites, node_inputs or {}, rows, rep.input_ranges,
                                                         rep.quantized),
            "detail_files": detail_files,
            "nodes": [node_summary(r) for r in rows],
        }
        summary.update((sections() if callable(sections) else sections) or {})
        # summary.json, the page and the explorer's files (a third of the
        # reports' time) made by the report's process from a copy while
        # the files below are written here (the summary is made first for
        # that), or made here after them
        documents_here = details is None or not details.hand_over(summary)
        _write_csv(out / "cpu_vs_npu.csv", SEED_COLUMNS + EXTRA_COLUMNS,
                   (_seed_cells(r) + _extra_cells(i, r) for i, r in enumerate(rows)))
        _write_log(out / "compare_skip.log", rep.skipped +
                   [(s.tensor, f"fused into device node {dev!r}: its output is compared instead")
                    for s, dev in rep.fused] +
                   [(s.tensor, why) for s, why in rep.folded] +
                   [(s.tensor, "not dumped by the device (not produced, or fused away where no device graph says so)")
                    for s in rep.not_dumped])
        write_alignment(out / "alignment.csv", aligned)
        if weights is not None:
            weights_mod.write_csv(out / "weights.csv", weights)
        _write_log(out / "invalid_out_nodename.log", rep.invalid_out)
        _write_log(out / "options_unmatched.log", coverage.unmatched_options(cov))
        _write_log(out / "check_skip.log", rep.check_skip)
        _write_log(out / "concate_skip.log", rep.concat_skip)
        _write_log(out / "overflow_nodename.log", list(rep.overflow.items()) +
                   [(f"{n} (reference dump)", why) for n, why in rep.reference_overflow.items()])
        if rep.range_skips:
            _write_log(out / "min_max_skip.log", rep.range_skips)
        (out / "dump_memory_nodename.log").write_text("".join(_one_line(n) + "\n" for n in rep.device_names),
                                                      encoding="utf-8")
        _write_csv(out / "op_config.csv", ["op_name", "atol", "rtol"],
                   ([node, "NA", "NA"] for node in dict.fromkeys(s.node for s in all_sites)))
        (out / "node_runtime.json").write_text(json_text(node_runtime), encoding="utf-8")
        (out / "consumer_map.json").write_text(json_text(consumers), encoding="utf-8")

        if documents_here:
            write_documents(out, summary)
    for done in written:
        done.result()
    # what the process was handed but could not make (a value of a type of its own among them)
    left = details.finish() if details is not None else frozenset()
    if "documents" in left and not documents_here:
        write_documents(out, summary)
    if "tables" in left and not tables_here:
        from layerdiff.analyzer.report.tables import write_table_parts

        write_table_parts(out, parts)
    return summary


def _answer(headline: str, kind: str, row: Row | None, outcome: dict, cov: dict) -> dict:
    """summary.json's ``answer``: the headline, what it is, the node it
    names (with its cause and evidence), the outcome and the coverage it
    stands on (layerdiff.client.follow.Answer reads it)."""
    f = row.finding if row is not None else None
    return {"headline": headline, "verdict": kind, "status": outcome.get("status"),
            "exit_status": outcome.get("exit_status"), "reason": outcome.get("reason"),
            "node": row.site.node if row is not None else None, "tensor": row.site.tensor if row is not None else None,
            "op_type": row.site.op_type if row is not None else None,
            "order": row.site.order if row is not None else None,
            "cause": (f.cause or None) if f is not None else None,
            "evidence": list(f.evidence) if f is not None else [],
            "coverage": {"compared": cov.get("compared"), "expected": cov.get("expected"),
                         "ratio": cov.get("ratio"), "adequate": cov.get("adequate")}}


ALIGNMENT_COLUMNS = ["reference_tensor", "device_tensor", "method", "confidence", "note"]


def alignment_rows(rep: JobReport, aligner, sites: list[TensorSite]) -> list[tuple[str, str, str, float | None, str]]:
    """How every reference tensor and every device tensor was paired, or
    why not (reference tensor, device tensor, method, confidence, note):
    map (map_node_dict), graph, fused, name, value; "fused into" for
    reference tensors a device fusion covers, "folded" for those the device
    computes as constants, "not dumped", and "unmatched" device tensors with
    the closest reference names. The rows of alignment.csv and
    alignment.parquet."""
    by_value = {r["device_tensor"] for r in rep.value_pairs}
    rows = [r for r in aligner.rows() if r.get("device_tensor") not in by_value]
    # names left open (ambiguous, a near miss) are listed once, with the unmatched device tensors below
    why_open = {r["device_tensor"]: r.get("note", "") for r in rows if not r.get("reference_tensor")}
    decided = [r for r in rows if r.get("reference_tensor")] + list(rep.value_pairs)
    rank = {s.tensor: s.order for s in sites}
    last = len(sites)
    decided.sort(key=lambda r: (rank.get(r.get("reference_tensor", ""), last), r.get("device_tensor", "")))
    out: list[tuple[str, str, str, float | None, str]] = []
    for r in decided:
        conf = r.get("confidence")
        out.append((r.get("reference_tensor", ""), r.get("device_tensor", ""), r.get("method", ""),
                    None if conf is None else float(conf), r.get("note", "")))
    out += [(s.tensor, "", "fused into", None, f"computed inside device node {dev}") for s, dev in rep.fused]
    out += [(s.tensor, "", "folded", None, why) for s, why in rep.folded]
    out += [(s.tensor, "", "not dumped", None, "") for s in rep.not_dumped]
    out += [(ref, dev, "attributed", None, why) for dev, ref, why in rep.attributed]
    for name, reason in rep.invalid_out:
        close = aligner.closest(name.split(" (input ")[0])
        note = "; ".join(x for x in (reason, why_open.get(name, "")) if x)
        note += f"; closest reference names: {', '.join(close)}" if close else ""
        out.append(("", name, "unmatched", None, note))
    return out


def write_alignment(path: Path, rows: list[tuple[str, str, str, float | None, str]]) -> None:
    """alignment.csv from alignment_rows (names and notes on one line each)."""
    _write_csv(path, ALIGNMENT_COLUMNS,
               ([_one_line(ref), _one_line(dev), method, "" if conf is None else f"{conf:.3g}", _one_line(note)]
                for ref, dev, method, conf, note in rows))


def _write_csv(path: Path, header: list[str], rows: Iterable[list[str]]) -> None:
    """A CSV file made in memory and written at once: written row by row,
    each 8 KiB flushed lets the interpreter go and waits to take it back
    from the threads writing the tables beside it (0.1 s for the 330 KB
    of a detector's cpu_vs_npu.csv, against 0.02 s alone)."""
    buf = io.StringIO(newline="")
    w = csv.writer(buf)
    w.writerow(header)
    w.writerows(rows)
    with open(path, "w", newline="", encoding="utf-8") as f:
        f.write(buf.getvalue())


def _write_log(path: Path, items: list[tuple[str, str]]) -> None:
    # one line per node, whatever the name holds; written at once (_write_csv)
    path.write_text("".join(f"{_one_line(name)}: {_one_line(reason)}\n" for name, reason in items),
                    encoding="utf-8")


def _one_line(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
