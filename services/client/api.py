"""Python API: the same job as ``layerdiff run``, for scripts and notebooks.

    import layerdiff
    result = layerdiff.run("model.onnx", "inputs.npz", precision="fp16", out="out")
    print(result.first_failing_node)

Without ``analyzer=``/``collector=`` addresses both services start in this
process on free loopback ports (the embedded default) and stop afterwards.
"""
from __future__ import annotations

import json
import os
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import grpc
import numpy as np

from layerdiff.artifacts import upload
from layerdiff.errors import EXIT_BAD_INPUT, EXIT_NO_ANSWER, JobFailed, LayerdiffError
from layerdiff.net import channel, wait_ready
from layerdiff.v1 import layerdiff_pb2 as pb
from layerdiff.v1 import layerdiff_pb2_grpc as pbg

CALL_TIMEOUT = 600.0


@dataclass
class RunResult:
    job_id: str
    out: Path
    summary: dict

    @property
    def first_failing_node(self) -> str | None:
        f = self.summary.get("first_failing_node")
        return f["node"] if f else None

    @property
    def outcome(self) -> str:
        """``pass``, ``fail`` (failing nodes), ``no_answer`` (too little
        compared to answer) or ``perf_only``."""
        return (self.summary.get("outcome") or {}).get("status", "")

    @property
    def exit_status(self) -> int:
        """What ``layerdiff run`` exits with: 0 pass, 1 failing nodes, 3 too
        little compared to answer (2, bad input, is raised as JobFailed or
        LayerdiffError instead)."""
        return int((self.summary.get("outcome") or {}).get("exit_status", EXIT_NO_ANSWER))


def read_artifact(path_or_bytes, field: str) -> tuple[bytes, str]:
    """The bytes and name of a file to upload (a directory travels as a tar).
    An empty file is bad input, never "no file"."""
    if isinstance(path_or_bytes, (bytes, bytearray)):
        if not path_or_bytes:
            raise LayerdiffError("is empty (0 bytes)", field=field)
        return bytes(path_or_bytes), field
    p = Path(path_or_bytes)
    if p.is_dir():
        # A SavedModel is a directory: it travels as one tar archive.
        from layerdiff.tfgraph import pack_directory

        return pack_directory(p), f"{p.resolve().name}.tar"
    try:
        data = p.read_bytes()
    except OSError as e:
        raise LayerdiffError(f"cannot be read: {e.strerror}", file=str(p), field=field) from e
    if not data:
        raise LayerdiffError("is empty (0 bytes)", file=str(p), field=field)
    return data, p.name


def _inputs_bytes(inputs) -> tuple[bytes, str]:
    if isinstance(inputs, dict):
        import io

        buf = io.BytesIO()
        np.savez(buf, **{k: np.asarray(v) for k, v in inputs.items()})
        return buf.getvalue(), "inputs.npz"
    return read_artifact(inputs, "inputs")


def _text_arg(value) -> str:
    if value is None:
        return ""
    if isinstance(value, (str, os.PathLike)) and Path(value).is_file():
        return Path(value).read_text(encoding="utf-8")
    return str(value)


def parse_map_node_dict(value) -> dict[str, str]:
    if not value:
        return {}
    if isinstance(value, dict):
        return {str(k): str(v) for k, v in value.items()}
    text = _text_arg(value)
    try:
        d = json.loads(text)
    except ValueError as e:
        raise LayerdiffError(f"is not a JSON object {{\"cpu_name\": \"npu_name\"}}: {e}", field="map_node_dict") from e
    if not isinstance(d, dict):
        raise LayerdiffError("must be a JSON object {\"cpu_name\": \"npu_name\"}", field="map_node_dict")
    return {str(k): str(v) for k, v in d.items()}


def parse_name_list(value) -> list[str]:
    if not value:
        return []
    if isinstance(value, (list, tuple)):
        out = []
        for v in value:
            out.extend(parse_name_list(v))
        return out
    if isinstance(value, (str, os.PathLike)) and Path(value).is_file():
        return [ln.strip() for ln in Path(value).read_text(encoding="utf-8").splitlines() if ln.strip()]
    return [v.strip() for v in str(value).split(",") if v.strip()]


def rpc_failure(what: str, e: grpc.RpcError) -> LayerdiffError:
    """A failed call to a service: its refusal of bad input (exit status 2),
    or the service gone or unreachable (3)."""
    code = e.code() if hasattr(e, "code") else None
    details = (e.details() if hasattr(e, "details") else "") or str(code)
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.ALREADY_EXISTS):
        return JobFailed(details, EXIT_BAD_INPUT)
    return JobFailed(f"{what}: {details}", EXIT_NO_ANSWER)


class AnalyzerClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = channel(address)
        try:
            wait_ready(self.channel, timeout=15)
        except grpc.FutureTimeoutError:
            raise LayerdiffError(f"analyzer {address} is not reachable", field="analyzer") from None
        self.stub = pbg.AnalyzerStub(self.channel)

    def upload(self, data: bytes, name: str) -> str:
        try:
            return upload(self.stub, data, name, timeout=CALL_TIMEOUT)
        except grpc.RpcError as e:
            raise rpc_failure(f"analyzer {self.address}", e) from None

    def submit(self, spec: pb.JobSpec) -> str:
        return self.stub.Submit(spec, timeout=CALL_TIMEOUT).job_id

    def watch(self, job_id: str, timeout: float | None = None):
        return self.stub.Watch(pb.JobRef(job_id=job_id), timeout=timeout)

    def fetch(self, job_id: str, out: Path) -> list[Path]:
        out.mkdir(parents=True, exist_ok=True)
        root = out.resolve()
        written: list[Path] = []
        handle = None
        for chunk in self.stub.FetchReport(pb.ReportRequest(job_id=job_id), timeout=CALL_TIMEOUT):
            target = (out / chunk.path).resolve()
            if root not in target.parents:
                raise LayerdiffError(f"report file {chunk.path!r} would land outside {out}", field="path")
            if chunk.offset == 0:
                if handle:
                    handle.close()
                target.parent.mkdir(parents=True, exist_ok=True)
                handle = open(target, "wb")
                written.append(target)
            handle.write(chunk.data)
            if chunk.last:
                handle.close()
                handle = None
        if handle:
            handle.close()
        return written

    def cancel(self, job_id: str) -> None:
        self.stub.Cancel(pb.JobRef(job_id=job_id), timeout=30)

    def close(self) -> None:
        self.channel.close()


def _progress_bar(enabled):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=0, unit="node", desc="comparing", file=sys.stderr, disable=None, dynamic_ncols=True)


def run(model, inputs, *, out="layerdiff-out", device: str = "cpu", precision: str = "fp32",
        device_model=None, dump: str | None = None, dump_format: str = "", default_concat_dim: int = 0,
        watch: bool = False, dump_mode: str = "output",
        analyzer: str | None = None,
        collector: str | None = None,
        atol: float | None = None, rtol: float | None = None, diff_cnt: int | None = None, op_config=None,
        map_node_dict=None, skip_keys=None, exclude_node_list=None, force_compare: bool = False,
        max_cores: int | None = None, show_graph: bool = False, max_bins: int | None = None,
        min_bins: int | None = None, min_max=None, progress: bool | Callable[[pb.JobEvent], None] = True,
        timeout: float | None = None, perf_mode="accuracy", perf_all_nodes: bool = True,
        perf_runs: int | None = None, clock_mhz: float | None = None,
        perf_graph_optimization: str = "", signature: str = "", min_coverage: float | None = None) -> RunResult:
    """Compare every node of ``model`` on the device against its FP32 CPU
    reference and fetch the reports into ``out``.

    ``model``: an ONNX file, a TensorFlow frozen GraphDef (``.pb``), a
    SavedModel directory (``signature`` picks its signature, default
    serving_default) or a Keras ``.keras`` file. ``inputs``: an .npz path or a
    dict of arrays. ``device_model``: a second model file (any of those kinds)
    run as the device. ``dump``: a dump directory on the collector's
    host, read instead of a live run. ``show_graph``: plots for the failing
    nodes (``max_bins``/``min_bins`` for their histograms); ``min_max``: a
    tensor_min_max.txt giving the input ranges for the INT8 advice.
    Defaults: atol 0.005, rtol 0.2, diff_cnt 128, max_cores = CPU count,
    min_coverage 0.5 (the share of the reference's computed tensors that must
    be compared for an answer).

    The result's ``outcome`` / ``exit_status`` say what the job answers:
    ``pass`` (0), ``fail`` (1: failing nodes), ``no_answer`` (3: too little
    compared; the summary's ``coverage`` says why). Raises LayerdiffError on
    bad input, and JobFailed (with ``exit_status`` 2 or 3) when the job
    ends without an answer.

    ``perf_mode``: ``accuracy`` (default), ``perf`` or ``both`` (DUMP_OP_PERF
    0 / 1 / 2): performance records from the dump's counter files or a
    profiled live run, into op_perf.csv, perf/, op_summary.csv,
    op_statistic.csv, timeline.json and summary.json.
    """
    from layerdiff.analyzer.perf import parse_mode
    from layerdiff.analyzer.service import AnalyzerServer
    from layerdiff.collector.service import CollectorServer

    perf = pb.PerfOptions(mode=parse_mode(perf_mode), hide_span_nodes=not perf_all_nodes, runs=perf_runs or 0,
                          clock_mhz=clock_mhz or 0.0, graph_optimization=perf_graph_optimization or "")
    model_bytes, model_name = read_artifact(model, "model")
    inputs_data, inputs_name = _inputs_bytes(inputs)
    device_model_bytes, device_model_name = read_artifact(device_model, "device_model") \
        if device_model is not None else (None, "")
    out = Path(out)
    with ExitStack() as stack:
        if collector is None:
            collector = stack.enter_context(CollectorServer()).address
        if analyzer is None:
            analyzer = stack.enter_context(AnalyzerServer()).address
        client = AnalyzerClient(analyzer)
        stack.callback(client.close)
        options = pb.CompareOptions(
            atol=atol or 0.0, has_atol=atol is not None, rtol=rtol or 0.0, has_rtol=rtol is not None,
            diff_cnt=diff_cnt or 0, op_config_csv=_text_arg(op_config), map_node_dict=parse_map_node_dict(map_node_dict),
            skip_keys=parse_name_list(skip_keys), exclude_node_list=parse_name_list(exclude_node_list),
            force_compare=force_compare, max_cores=max_cores or 0, show_graph=show_graph, max_bins=max_bins or 0,
            min_bins=min_bins or 0, min_max_text=_text_arg(min_max), min_coverage=min_coverage or 0.0,
            has_min_coverage=min_coverage is not None)
        spec = pb.JobSpec(
            model_artifact=client.upload(model_bytes, model_name),
            inputs_artifact=client.upload(inputs_data, inputs_name),
            device_model_artifact=client.upload(device_model_bytes, device_model_name)
            if device_model_bytes is not None else "",
            collector=collector, device=device, precision=precision, dump_path=dump or "", dump_format=dump_format,
            default_concat_dim=default_concat_dim, watch=watch, dump_mode=dump_mode or "output", options=options,
            model_name=model_name, perf=perf, signature=signature or "")
        try:
            job_id = client.submit(spec)
        except grpc.RpcError as e:
            raise rpc_failure(f"analyzer {analyzer}", e) from None
        bar = _progress_bar(progress is True)
        last = None
        try:
            for ev in client.watch(job_id, timeout=timeout):
                last = ev
                if callable(progress):
                    progress(ev)
                if bar is not None:
                    if ev.nodes_total and bar.total != ev.nodes_total:
                        bar.total = ev.nodes_total
                    bar.set_description(pb.JobState.Name(ev.state).lower())
                    bar.n = ev.nodes_done
                    bar.refresh()
        except KeyboardInterrupt:
            client.cancel(job_id)
            raise
        except grpc.RpcError as e:
            raise rpc_failure(f"analyzer {analyzer}, job {job_id}", e) from None
        finally:
            if bar is not None:
                bar.close()
        if last is None or last.state != pb.DONE:
            reason = last.message if last is not None else "no progress received"
            status = last.exit_status if last is not None and last.state == pb.FAILED and last.exit_status \
                else EXIT_NO_ANSWER
            raise JobFailed(f"job {job_id} {pb.JobState.Name(last.state) if last else 'lost'}: {reason}", status)
        try:
            client.fetch(job_id, out)
        except grpc.RpcError as e:
            raise rpc_failure(f"analyzer {analyzer}, job {job_id}", e) from None
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    return RunResult(job_id, out, summary)


def format_summary(summary: dict, out: Path | str, top: int = 10) -> str:
    """Human summary; the first failing node comes first."""
    c = summary["counts"]
    lines = []
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
    comp = summary.get("first_computation_error")
    if comp:
        lines.append(f"FIRST COMPUTATION ERROR: {comp['node']} ({comp['op_type']}, execution #{comp['order']}): "
                     + "; ".join(comp.get("evidence") or []))
    for key in ("nan", "overflow"):
        if diagnosis.get(key):
            lines.append(f"{key.upper()}: {diagnosis[key]['text']}")
    lines.extend(_coverage_lines(summary.get("coverage")))
    first = summary.get("first_failing_node")
    if first:
        lines.append(f"FIRST FAILING NODE: {first['node']} ({first['op_type']}, execution #{first['order']}, "
                     f"tensor {first['tensor']})")
        lines.append(f"  errors/total {first['errors']}/{first['total']} outside atol={first['atol']:g} "
                     f"rtol={first['rtol']:g}; max_abs_err {_f(first['max_abs_err'])}, "
                     f"mean_rel_err {_f(first['mean_rel_err'])}, cosine {_f(first['cosine'])}, "
                     f"first mismatch at {tuple(first['first_mismatch_index'])}: "
                     f"ref {_f(first['ref_value'])} vs device {_f(first['dev_value'])}")
    elif not no_answer:
        lines.append("NO FAILING NODE: every compared node is within atol/rtol")
    lines.append(f"{summary.get('model')} on {summary.get('device')} ({summary.get('precision')}, "
                 f"{summary.get('source')}): {c['compared']} compared, {c['failed']} failed, {c['passed']} passed, "
                 f"{c['skipped']} skipped, {c['not_dumped']} not dumped, {c['invalid_out']} unknown device names")
    constants = summary.get("failing_constants") or []
    if constants:
        k = constants[0]
        overflow = f", {k['fp16_overflow']} beyond the FP16 range" if k.get("fp16_overflow") else ""
        lines.append(f"constants (weights) that differ on the device: {len(constants)}, first {k['node']} "
                     f"(tensor {k['tensor']}): {k['errors']}/{k['total']} outside tolerance{overflow}")
    if c.get("inputs_compared"):
        lines.append(f"node inputs: {c['inputs_compared']} compared, {c['inputs_failed']} failed")
    for o in (summary.get("overflow_nodes") or [])[:top]:
        lines.append(f"OVERFLOW flagged by the device at {o['node']}: {o['why']}")
    failing = [n for n in summary.get("nodes", []) if not n["passed"] and not n.get("constant")
               and n.get("role") != "input"]
    if failing:
        lines.append(f"first {min(top, len(failing))} failing nodes in execution order:")
        lines.append(f"  {'#':>5}  {'node':40.40}  {'op':14.14}  {'errors/total':>16}  {'max_abs_err':>11}  "
                     f"{'cosine':>9}  verdict")
        for n in failing[:top]:
            lines.append(f"  {n['order']:>5}  {n['node']:40.40}  {n['op_type']:14.14}  "
                         f"{str(n['errors']) + '/' + str(n['total']):>16}  {_f(n['max_abs_err']):>11}  "
                         f"{_f(n['cosine']):>9}  {n.get('verdict') or ''}")
    if perf:
        lines.extend(_perf_lines(summary, top))
    lines.append(f"reports: {out}")
    return "\n".join(lines)


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
