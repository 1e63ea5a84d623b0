"""Python API: the same job as ``layerdiff run``, for scripts and notebooks.

    import layerdiff
    result = layerdiff.run("model.onnx", "inputs.npz", precision="fp16", out="out")
    print(result.first_failing_node)

Without ``analyzer=``/``collector=`` addresses both services start in this
process on free loopback ports (the embedded default) and stop afterwards.

A job on a running analyzer outlives the client that submitted it:
``watch(job_id, analyzer=...)`` follows it again to its end and fetches its
reports, ``fetch(job_id, analyzer=...)`` fetches the reports of a finished
one; both return the same RunResult as ``run``. Ctrl-C (KeyboardInterrupt)
while a job runs cancels it on the analyzer and raises ``Interrupted``, a
KeyboardInterrupt whose message says what became of the job.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from layerdiff.common.artifacts import chunks_of
from layerdiff.common.errors import EXIT_BAD_INPUT, EXIT_NO_ANSWER, JobFailed, LayerdiffError
from layerdiff.common.net import channel, connect_timeout, wait_ready
from layerdiff.common.security import ClientSecurity, with_token
from layerdiff.v1 import layerdiff_pb2 as pb
from layerdiff.v1 import layerdiff_pb2_grpc as pbg

CALL_TIMEOUT = 600.0
# Ctrl-C: the Cancel call (and the wait for a Submit under way) may take this long.
CANCEL_TIMEOUT = 5.0
# Closing a channel waits for its calls to drain; a call that Ctrl-C broke off
# inside grpc may never drain, so the client waits this long and goes on.
CLOSE_TIMEOUT = 2.0
# fetch of a job that is not DONE: how long its events are read to learn its state.
STATE_TIMEOUT = 5.0
TERMINAL = (pb.DONE, pb.FAILED, pb.CANCELLED)


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
        from layerdiff.common.tfgraph import pack_directory

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
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):   # usage: the wrong token
        return JobFailed(f"{what}: {details}", EXIT_BAD_INPUT)
    return JobFailed(f"{what}: {details}", EXIT_NO_ANSWER)


def _details(e: grpc.RpcError) -> str:
    """One line saying why a call failed."""
    code = e.code() if hasattr(e, "code") else None
    details = (e.details() if hasattr(e, "details") else "") or ""
    name = code.name if isinstance(code, grpc.StatusCode) else "error"
    return " ".join(f"{name}: {details}".split()) if details else name


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a job. ``message`` says what became of the job: cancelled
    on the analyzer, already ended, or why it could not be cancelled. It is a
    KeyboardInterrupt, so a script stops as it would anyway."""

    def __init__(self, message: str, job_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.job_id = job_id

    def __str__(self) -> str:
        return self.message


@contextmanager
def _sigint_held():
    """Hold off Ctrl-C while a job is being cancelled: a second press must not
    break off the cancel (it is bounded by CANCEL_TIMEOUT anyway)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        previous = signal.signal(signal.SIGINT, lambda *_: None)
    except (ValueError, OSError):
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)


def reattach_command(job_id: str, analyzer: str) -> str:
    return f"layerdiff watch {job_id} --analyzer {analyzer}"


class AnalyzerClient:
    """The analyzer's calls. ``submit``, ``watch``, ``fetch`` and ``cancel``
    raise grpc.RpcError as the service answers; ``run``, ``watch`` and
    ``fetch`` below turn every failure into a LayerdiffError."""

    def __init__(self, address: str, connect_timeout_s: float | None = None, local=None) -> None:
        """``local``: (the analyzer's store, the collector's or None) where
        the analyzer (and the collector) run in this process: uploads are
        handed to them in memory, in a file each, instead of sent."""
        self.address = address
        self.local = local
        wait = connect_timeout() if connect_timeout_s is None else connect_timeout_s
        security = ClientSecurity.from_env()
        self.channel = channel(address, security)
        try:
            wait_ready(self.channel, timeout=wait)
        except grpc.FutureTimeoutError:
            self.channel.close()
            hint = ("; over TLS: check that LAYERDIFF_TLS_CA signed its certificate and that it accepts this "
                    "client's (LAYERDIFF_TLS_CERT)") if security.tls else \
                "; if it serves TLS, give its CA in LAYERDIFF_TLS_CA"
            raise JobFailed(f"analyzer {address} is not reachable (no answer within {wait:g} s{hint})",
                            EXIT_NO_ANSWER) from None
        except BaseException:
            self.channel.close()
            raise
        self.stub = pbg.AnalyzerStub(with_token(self.channel, security))

    def upload(self, data: bytes, name: str) -> str:
        if self.local is not None:      # the embedded analyzer: handed over, not sent
            store, beside = self.local
            artifact = store.put(data, name).id
            if beside is not None:
                beside.link_from(store, artifact)
            return artifact
        call = self.stub.PutArtifact.future(chunks_of(data, name), timeout=CALL_TIMEOUT)
        try:
            return call.result().id
        except grpc.RpcError as e:
            raise rpc_failure(f"analyzer {self.address}, upload of {name}", e) from None
        except BaseException:
            call.cancel()
            raise

    def submit(self, spec: pb.JobSpec) -> str:
        """The job id. Ctrl-C while the analyzer takes the job waits a moment
        for its id and cancels it (raising Interrupted)."""
        call = self.stub.Submit.future(spec, timeout=CALL_TIMEOUT)
        try:
            return call.result().job_id
        except KeyboardInterrupt:
            with _sigint_held():
                try:
                    job_id = call.result(timeout=CANCEL_TIMEOUT).job_id
                except Exception:
                    call.cancel()
                    raise Interrupted("interrupted while submitting; no job was started") from None
            raise self.interrupted(job_id) from None

    def watch(self, job_id: str, timeout: float | None = None):
        """The job's events from its first, to its end. No deadline by
        default: a job may run for hours, and the channel's keepalive finds a
        dead link."""
        return self.stub.Watch(pb.JobRef(job_id=job_id), timeout=timeout)

    def state(self, job_id: str, timeout: float = STATE_TIMEOUT) -> tuple[pb.JobEvent | None, bool]:
        """The job's latest event, and whether the job has ended."""
        stream = self.watch(job_id, timeout=timeout)
        last = None
        try:
            for ev in stream:
                last = ev
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            return last, False
        finally:
            stream.cancel()
        return last, True

    def fetch(self, job_id: str, out: Path) -> list[Path]:
        out = Path(out)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise LayerdiffError(f"cannot create the report directory: {e.strerror}", file=str(out),
                                 field="out") from None
        root = out.resolve()
        written: list[Path] = []
        handle = None
        stream = self.stub.FetchReport(pb.ReportRequest(job_id=job_id), timeout=CALL_TIMEOUT)
        try:
            for chunk in stream:
                target = (out / chunk.path).resolve()
                if root not in target.parents:
                    raise LayerdiffError(f"report file {chunk.path!r} would land outside {out}", field="path")
                try:
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
                except OSError as e:
                    raise LayerdiffError(f"cannot write a report: {e.strerror}", file=str(target),
                                         field="out") from None
        finally:
            stream.cancel()
            if handle:
                handle.close()
        return written

    def cancel(self, job_id: str, timeout: float = 30) -> pb.JobEvent:
        return self.stub.Cancel(pb.JobRef(job_id=job_id), timeout=timeout)

    def interrupted(self, job_id: str) -> Interrupted:
        """Ctrl-C during job ``job_id``: cancel it (bounded, a second Ctrl-C
        held off) and say what became of it."""
        with _sigint_held():
            try:
                ev = self.cancel(job_id, timeout=CANCEL_TIMEOUT)
            except grpc.RpcError as e:
                return Interrupted(f"interrupted; job {job_id} could not be cancelled on analyzer {self.address} "
                                   f"({_details(e)}), it may still be running", job_id)
        if ev.state in (pb.DONE, pb.FAILED):
            return Interrupted(f"interrupted; job {job_id} had already ended ({pb.JobState.Name(ev.state)})",
                               job_id)
        return Interrupted(f"interrupted; job {job_id} cancelled", job_id)

    def close(self) -> None:
        closing = threading.Thread(target=self.channel.close, name="channel-close", daemon=True)
        closing.start()
        closing.join(CLOSE_TIMEOUT)


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
        perf_graph_optimization: str = "", signature: str = "", min_coverage: float | None = None,
        on_job: Callable[[str], None] | None = None) -> RunResult:
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

    ``on_job(job_id)`` is called once the analyzer has taken the job, before
    any progress. ``timeout``: seconds to wait for the job's end (default:
    none; a job may take hours, and a dead link is found by keepalive).
    Ctrl-C cancels the job on the analyzer and raises ``Interrupted``; an
    analyzer that stops answering raises JobFailed (exit status 3) naming it
    and the job.
    """
    from layerdiff.analyzer.report.perf import parse_mode

    perf = pb.PerfOptions(mode=parse_mode(perf_mode), hide_span_nodes=not perf_all_nodes, runs=perf_runs or 0,
                          clock_mhz=clock_mhz or 0.0, graph_optimization=perf_graph_optimization or "")
    model_bytes, model_name = read_artifact(model, "model")
    inputs_data, inputs_name = _inputs_bytes(inputs)
    device_model_bytes, device_model_name = read_artifact(device_model, "device_model") \
        if device_model is not None else (None, "")
    options = compare_options(atol=atol, rtol=rtol, diff_cnt=diff_cnt, op_config=op_config,
                              map_node_dict=map_node_dict, skip_keys=skip_keys, exclude_node_list=exclude_node_list,
                              force_compare=force_compare, max_cores=max_cores, show_graph=show_graph,
                              max_bins=max_bins, min_bins=min_bins, min_max=min_max, min_coverage=min_coverage)

    def spec(client: AnalyzerClient, collector: str) -> pb.JobSpec:
        return pb.JobSpec(
            model_artifact=client.upload(model_bytes, model_name),
            inputs_artifact=client.upload(inputs_data, inputs_name),
            device_model_artifact=client.upload(device_model_bytes, device_model_name)
            if device_model_bytes is not None else "",
            collector=collector, device=device, precision=precision, dump_path=dump or "",
            dump_format=dump_format, default_concat_dim=default_concat_dim, watch=watch,
            dump_mode=dump_mode or "output", options=options, model_name=model_name, perf=perf,
            signature=signature or "")

    return _run_job(spec, analyzer=analyzer, collector=collector, out=out, progress=progress, timeout=timeout,
                    on_job=on_job)


def compare_options(*, atol: float | None = None, rtol: float | None = None, diff_cnt: int | None = None,
                    op_config=None, map_node_dict=None, skip_keys=None, exclude_node_list=None,
                    force_compare: bool = False, max_cores: int | None = None, show_graph: bool = False,
                    max_bins: int | None = None, min_bins: int | None = None, min_max=None,
                    min_coverage: float | None = None) -> pb.CompareOptions:
    """The comparison options ``run`` and ``compare`` share, as the wire carries them."""
    return pb.CompareOptions(
        atol=atol or 0.0, has_atol=atol is not None, rtol=rtol or 0.0, has_rtol=rtol is not None,
        diff_cnt=diff_cnt or 0, op_config_csv=_text_arg(op_config), map_node_dict=parse_map_node_dict(map_node_dict),
        skip_keys=parse_name_list(skip_keys), exclude_node_list=parse_name_list(exclude_node_list),
        force_compare=force_compare, max_cores=max_cores or 0, show_graph=show_graph, max_bins=max_bins or 0,
        min_bins=min_bins or 0, min_max_text=_text_arg(min_max), min_coverage=min_coverage or 0.0,
        has_min_coverage=min_coverage is not None)


def _run_job(make_spec: Callable[[AnalyzerClient, str], pb.JobSpec], *, analyzer: str | None,
             collector: str | None, out, progress, timeout: float | None,
             on_job: Callable[[str], None] | None) -> RunResult:
    """Start what is not running (an embedded collector, analyzer), submit
    the job ``make_spec(client, collector address)`` describes, follow it
    and fetch its reports. Ctrl-C cancels the job and raises Interrupted."""
    from layerdiff.analyzer.service import AnalyzerServer
    from layerdiff.collector.service import CollectorServer

    out = Path(out)
    # the job outlives this process only when neither service runs inside it
    reattachable = analyzer is not None and collector is not None
    with ExitStack() as stack:
        job_id = None
        client = None
        try:
            local = collector_store = None
            if collector is None:
                embedded = stack.enter_context(CollectorServer())
                collector, collector_store = embedded.address, embedded.flight.store
            if analyzer is None:
                embedded = stack.enter_context(AnalyzerServer())
                analyzer, local = embedded.address, (embedded.service.store, collector_store)
            client = AnalyzerClient(analyzer, local=local)
            stack.callback(client.close)
            spec = make_spec(client, collector)
            try:
                job_id = client.submit(spec)
            except grpc.RpcError as e:
                raise rpc_failure(f"analyzer {analyzer}", e) from None
            if on_job is not None:
                on_job(job_id)
            return follow(client, job_id, out, progress=progress, timeout=timeout, reattachable=reattachable)
        except Interrupted:
            raise
        except KeyboardInterrupt:
            if job_id is None or client is None:
                raise Interrupted("interrupted; no job was started") from None
            raise client.interrupted(job_id) from None


def compare(reference_dump: str, device_dump: str, *, out="layerdiff-out", model=None,
            reference_collector: str | None = None, collector: str | None = None, analyzer: str | None = None,
            reference_format: str = "", dump_format: str = "", default_concat_dim: int = 0,
            watch: bool = False, dump_mode: str = "output", precision: str = "fp32", device: str = "",
            progress: bool | Callable[[pb.JobEvent], None] = True, timeout: float | None = None,
            on_job: Callable[[str], None] | None = None, **options) -> RunResult:
    """Compare two dumps, with the golden one as the reference and no model
    run: ``reference_dump`` on ``reference_collector``'s host (default: the
    device's collector), ``device_dump`` on ``collector``'s (default: one
    started in this process, reading both). Each is read where it lies, in
    any dump format (``reference_format`` / ``dump_format``: default
    detected). ``model``: an ONNX file (either side's) lending its graph
    (structure, op types, node order) to alignment and diagnosis.
    ``dump_mode`` all: both dumps hold node inputs, and a node whose inputs
    agree while its outputs do not is a computation error. ``precision``
    names the device's (fp16, int8) for the reasoning that depends on it.
    ``options``: the comparison options of ``run`` (atol, rtol, diff_cnt,
    map_node_dict, skip_keys, exclude_node_list, min_coverage, ...). The
    RunResult, exit statuses and reports are those of ``run``, the summary
    naming both dumps (``reference_dump``: path, collector, what it held)."""
    model_bytes, model_name = read_artifact(model, "model") if model is not None else (None, "")
    opts = compare_options(**options)

    def spec(client: AnalyzerClient, device_collector: str) -> pb.JobSpec:
        golden = pb.ReferenceDump(collector=reference_collector or device_collector, dump=pb.DumpSource(
            path=str(reference_dump), format=reference_format or "", default_concat_dim=default_concat_dim))
        return pb.JobSpec(
            model_artifact=client.upload(model_bytes, model_name) if model_bytes is not None else "",
            collector=device_collector, device=device or "", precision=precision or "fp32",
            dump_path=str(device_dump), dump_format=dump_format, default_concat_dim=default_concat_dim,
            watch=watch, dump_mode=dump_mode or "output", options=opts, reference_dump=golden,
            model_name=model_name if model_bytes is not None else "")

    return _run_job(spec, analyzer=analyzer, collector=collector, out=out, progress=progress, timeout=timeout,
                    on_job=on_job)


def follow(client: AnalyzerClient, job_id: str, out, *, progress: bool | Callable[[pb.JobEvent], None] = True,
           timeout: float | None = None, reattachable: bool = True) -> RunResult:
    """What ``run``, ``watch`` and ``fetch`` share once a job exists: follow
    its events to its end (a progress bar, or ``progress`` called with each
    event), check it answered, fetch its reports into ``out`` and read its
    summary. Every failure is a LayerdiffError (JobFailed with the exit
    status); Ctrl-C propagates as KeyboardInterrupt for the caller to cancel."""
    out = Path(out)
    last = _follow_events(client, job_id, progress, timeout, reattachable)
    _check_ended(job_id, last, client.address, reattachable)
    return fetch_result(client, job_id, out, reattachable=reattachable)


def fetch_result(client: AnalyzerClient, job_id: str, out, *, reattachable: bool = True) -> RunResult:
    """The reports of a finished job into ``out``, and its summary."""
    out = Path(out)
    not_done = False
    try:
        client.fetch(job_id, out)
    except grpc.RpcError as e:
        code = e.code() if hasattr(e, "code") else None
        # the analyzer has the job, not (yet) its reports: below, say in what state it is
        not_done = code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
        if not not_done:
            raise _job_failure(client.address, job_id, e, "while sending the reports of", reattachable,
                               retry=f"layerdiff fetch {job_id} --analyzer {client.address}") from None
    if not_done:
        _raise_not_done(client, job_id, reattachable)
    summary_path = out / "summary.json"
    try:
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise JobFailed(f"job {job_id}: the reports fetched into {out} hold no readable summary.json ({e})",
                        EXIT_NO_ANSWER) from None
    return RunResult(job_id, out, summary)


def _follow_events(client: AnalyzerClient, job_id: str, progress, timeout, reattachable) -> pb.JobEvent | None:
    bar = _progress_bar(progress is True)
    last = None
    stream = client.watch(job_id, timeout=timeout)
    try:
        for ev in stream:
            last = ev
            if callable(progress):
                progress(ev)
            if bar is not None:
                if ev.nodes_total and bar.total != ev.nodes_total:
                    bar.total = ev.nodes_total
                bar.set_description(pb.JobState.Name(ev.state).lower())
                bar.n = ev.nodes_done
                bar.refresh()
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and timeout is not None:
            hint = f" (follow it: {reattach_command(job_id, client.address)})" if reattachable else ""
            raise JobFailed(f"job {job_id} did not end within {timeout:g} s; it goes on on analyzer "
                            f"{client.address}{hint}", EXIT_NO_ANSWER) from None
        raise _job_failure(client.address, job_id, e, "during", reattachable) from None
    finally:
        stream.cancel()
        if bar is not None:
            bar.close()
    return last


def _job_failure(analyzer: str, job_id: str, e: grpc.RpcError, when: str, reattachable: bool,
                 retry: str | None = None) -> JobFailed:
    """A call about a job that failed: the analyzer does not know the job
    (exit status 2), or it stopped answering (3)."""
    code = e.code() if hasattr(e, "code") else None
    if code == grpc.StatusCode.NOT_FOUND:
        return JobFailed(f"analyzer {analyzer}: {e.details() or 'no job ' + repr(job_id)}", EXIT_BAD_INPUT)
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return JobFailed(f"analyzer {analyzer}: {e.details()}", EXIT_BAD_INPUT)
    hint = f" (reattach: {retry or reattach_command(job_id, analyzer)})" if reattachable else ""
    return JobFailed(f"analyzer {analyzer} stopped answering {when} job {job_id}: {_details(e)}{hint}",
                     EXIT_NO_ANSWER)


def _check_ended(job_id: str, last: pb.JobEvent | None, analyzer: str, reattachable: bool) -> None:
    """A job whose events ended without DONE: JobFailed with its exit status."""
    if last is not None and last.state == pb.DONE:
        return
    if last is None:
        raise JobFailed(f"job {job_id} lost: analyzer {analyzer} sent no progress", EXIT_NO_ANSWER)
    status = last.exit_status if last.state == pb.FAILED and last.exit_status else EXIT_NO_ANSWER
    if last.state not in TERMINAL:
        # the stream ended while the job runs: the analyzer is going away
        hint = f" (reattach: {reattach_command(job_id, analyzer)})" if reattachable else ""
        raise JobFailed(f"analyzer {analyzer} stopped answering during job {job_id}: its events ended while "
                        f"it was {pb.JobState.Name(last.state)}{hint}", EXIT_NO_ANSWER)
    raise JobFailed(f"job {job_id} {pb.JobState.Name(last.state)}: {last.message or 'no reason given'}", status)


def _raise_not_done(client: AnalyzerClient, job_id: str, reattachable: bool) -> None:
    """A job without reports: one line with its state and reason."""
    try:
        last, ended = client.state(job_id)
    except grpc.RpcError as e:
        raise _job_failure(client.address, job_id, e, "about", reattachable) from None
    if ended:
        _check_ended(job_id, last, client.address, reattachable)
    state = pb.JobState.Name(last.state) if last is not None else "QUEUED"
    done = f", {last.nodes_done}/{last.nodes_total} nodes" if last is not None and last.nodes_total else ""
    hint = f"; follow it: {reattach_command(job_id, client.address)}" if reattachable else ""
    raise JobFailed(f"job {job_id} is {state}{done}: reports exist once it is DONE{hint}", EXIT_NO_ANSWER)


def watch(job_id: str, *, analyzer: str, out="layerdiff-out", progress: bool | Callable[[pb.JobEvent], None] = True,
          timeout: float | None = None) -> RunResult:
    """Follow job ``job_id`` on ``analyzer`` (from its first event, whether
    it runs or has ended) to its end, fetch its reports into ``out`` and
    return the same RunResult as ``run``. Ctrl-C cancels the job and raises
    ``Interrupted``; failures raise JobFailed as ``run`` does."""
    client = AnalyzerClient(analyzer)
    try:
        return follow(client, job_id, out, progress=progress, timeout=timeout, reattachable=True)
    except Interrupted:
        raise
    except KeyboardInterrupt:
        raise client.interrupted(job_id) from None
    finally:
        client.close()


def fetch(job_id: str, *, analyzer: str, out="layerdiff-out") -> RunResult:
    """The reports of finished job ``job_id`` on ``analyzer`` into ``out``,
    as the RunResult ``run`` returned. A job that is not DONE raises
    JobFailed: FAILED with its exit status, CANCELLED or still running with
    3, an unknown id with 2. Ctrl-C leaves the job as it is."""
    client = AnalyzerClient(analyzer)
    try:
        return fetch_result(client, job_id, out, reattachable=True)
    except Interrupted:
        raise
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted; the reports of job {job_id} were not all fetched", job_id) from None
    finally:
        client.close()


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
        lines.append(f"FIRST COMPUTATION ERROR: {comp['node']} ({_place(comp)}): "
                     + "; ".join(comp.get("evidence") or []))
    for b in (summary.get("benign_computation_errors") or [])[:top]:
        lines.append(f"BENIGN: {b['node']} ({_place(b)}, cause: {b.get('cause') or '?'}) "
                     "computes differently, but the outputs absorb it"
                     + (f": {b['impact']['why']}" if (b.get("impact") or {}).get("why") else ""))
    for key in ("nan", "overflow"):
        if diagnosis.get(key):
            lines.append(f"{key.upper()}: {diagnosis[key]['text']}")
    lines.extend(_coverage_lines(summary.get("coverage")))
    first = summary.get("first_failing_node")
    if first:
        lines.append(f"FIRST FAILING NODE: {first['node']} ({_place(first)}, "
                     f"tensor {first['tensor']})")
        lines.append(f"  errors/total {first['errors']}/{first['total']} outside atol={first['atol']:g} "
                     f"rtol={first['rtol']:g}; max_abs_err {_f(first['max_abs_err'])}, "
                     f"mean_rel_err {_f(first['mean_rel_err'])}, cosine {_f(first['cosine'])}, "
                     f"first mismatch at {tuple(first['first_mismatch_index'])}: "
                     f"ref {_f(first['ref_value'])} vs device {_f(first['dev_value'])}")
    elif not no_answer:
        lines.append("NO FAILING NODE: every compared node is within atol/rtol")
    golden = summary.get("reference_dump")
    if golden:
        lines.append(f"reference: dump {golden.get('dump_path')} on collector {golden.get('collector')} "
                     f"({golden.get('tensors')} tensors, {golden.get('bytes')} bytes"
                     + (f", graph from {golden.get('model')}" if golden.get("model") else "") + "); device: dump "
                     f"{summary.get('dump_path')} on collector {summary.get('collector')}")
    lines.append(f"{summary.get('model')} on {summary.get('device')} "
                 f"({summary.get('device_precision') or summary.get('precision')}, "
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
        side = "the reference dump" if o.get("side") == "reference" else "the device"
        lines.append(f"OVERFLOW flagged by {side} at {o['node']}: {o['why']}")
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


def _place(node: dict) -> str:
    """"Conv, execution #2"; a dump without op types gives only the order."""
    op = node.get("op_type")
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
