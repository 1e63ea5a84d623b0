"""Python API: the same job as ``layerdiff run``, for scripts and notebooks.

    import layerdiff
    result = layerdiff.run("model.onnx", "inputs.npz", precision="fp16", out="out")
    print(result.first_failing_node)

Without ``analyzer=``/``collector=`` addresses both services start in this
process on free loopback ports (the embedded default) and stop afterwards;
``compare`` of two dumps then serves nothing: both run in this process
without a server (``analyzer.local``, ``client.local_client``).

A job on a running analyzer outlives the client that submitted it:
``watch(job_id, analyzer=...)`` follows it again to its end and fetches its
reports, ``fetch(job_id, analyzer=...)`` fetches the reports of a finished
one; both return the same RunResult as ``run``. Ctrl-C (KeyboardInterrupt)
while a job runs cancels it on the analyzer and raises ``Interrupted``, a
KeyboardInterrupt whose message says what became of the job.

This module holds the public functions and what they read from their
arguments; the calls to the analyzer are ``analyzer_client``, following a
job to its reports is ``follow``, and the printed summary
(``format_summary``) is ``summary_text``.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from layerdiff.client import prefetch
from layerdiff.client.calls import Interrupted, by_ctrl_c, call_errors, call_failure
from layerdiff.client.follow import RunResult, fetch_result, follow
from layerdiff.common.errors import LayerdiffError
from layerdiff.common.localfile import FileStamp, LocalFile
from layerdiff.common.npz import write_npz
from layerdiff.v1 import layerdiff_pb2 as pb

if TYPE_CHECKING:
    from typing import TypeAlias

    from layerdiff.client.analyzer_client import AnalyzerClient
    from layerdiff.client.local_client import LocalClient

    Client: TypeAlias = AnalyzerClient | LocalClient


def read_artifact(path_or_bytes, field: str) -> tuple[bytes, str]:
    """The bytes and name of a file to upload (a directory travels as a tar).
    An empty file is bad input, never "no file"."""
    data, name, _ = read_upload(path_or_bytes, field)
    return data, name


def read_upload(path_or_bytes, field: str) -> tuple[bytes, str, LocalFile | None]:
    """``read_artifact``, and the file the bytes were read from where they
    are one file's, unchanged while it was read (the embedded services take
    it as it lies: ``ArtifactStore.put``)."""
    if isinstance(path_or_bytes, (bytes, bytearray)):
        if not path_or_bytes:
            raise LayerdiffError("is empty (0 bytes)", field=field)
        return bytes(path_or_bytes), field, None
    p = Path(path_or_bytes)
    if p.is_dir():
        # A SavedModel is a directory: it travels as one tar archive.
        from layerdiff.common.tf.archive import pack_directory

        return pack_directory(p), f"{p.resolve().name}.tar", None
    try:
        ahead = prefetch.take(p)        # read beside the imports, where the command line asked
        if ahead is not None and ahead[1] == FileStamp.of(p):
            return ahead[0], p.name, LocalFile(p, ahead[1], ahead[2])
        before = FileStamp.of(p)
        data = p.read_bytes()
        origin = LocalFile(p, before) if FileStamp.of(p) == before and len(data) == before.size else None
    except OSError as e:
        raise LayerdiffError(f"cannot be read: {e.strerror}", file=str(p), field=field) from e
    if not data:
        raise LayerdiffError("is empty (0 bytes)", file=str(p), field=field)
    return data, p.name, origin


def _inputs_bytes(inputs) -> tuple[bytes, str]:
    if isinstance(inputs, dict):
        import io

        buf = io.BytesIO()
        write_npz(buf, {k: np.asarray(v) for k, v in inputs.items()})
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


def run(model, inputs, *, out="layerdiff-out", device: str = "cpu", precision: str = "",
        device_model=None, dump: str | None = None, dump_format: str = "", default_concat_dim: int = 0,
        watch: bool = False, dump_mode: str = "output",
        analyzer: str | None = None,
        collector: str | None = None,
        atol: float | None = None, rtol: float | None = None, diff_cnt: int | None = None, op_config=None,
        map_node_dict=None, skip_keys=None, exclude_node_list=None, force_compare: bool = False,
        max_cores: int | None = None, show_graph: bool = False, max_plots: int | None = None,
        max_bins: int | None = None,
        min_bins: int | None = None, min_max=None, progress: bool | Callable[[pb.JobEvent], None] = True,
        timeout: float | None = None, perf_mode="accuracy", perf_all_nodes: bool = True,
        perf_runs: int | None = None, clock_mhz: float | None = None,
        perf_graph_optimization: str = "", signature: str = "", min_coverage: float | None = None,
        node_precision=None, on_job: Callable[[str], None] | None = None) -> RunResult:
    """Compare every node of ``model`` on the device against its FP32 CPU
    reference and fetch the reports into ``out``.

    ``model``: an ONNX file, a TensorFlow frozen GraphDef (``.pb``), a
    SavedModel directory (``signature`` picks its signature, default
    serving_default) or a Keras ``.keras`` file. ``inputs``: an .npz path or a
    dict of arrays. ``device_model``: a second model file (any of those kinds)
    run as the device. ``dump``: a dump directory on the collector's
    host, read instead of a live run. ``precision``: the live build (fp32,
    tf32, fp16, bf16, fp8_e4m3fn, fp8_e5m2, int8; default fp32), and the
    device's precision the error model judges by (default: the build's, or
    for a dump or device model what its tensors' types say);
    ``node_precision``: {node: precision} (or "node=precision" strings) for
    nodes that compute in another. ``show_graph``: plots for the failing
    nodes, the first ``max_plots`` in execution order (default 20, -1 every
    one; ``max_bins``/``min_bins`` for their histograms); ``min_max``: a
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
    from layerdiff.analyzer.report.perf.settings import parse_mode

    perf = pb.PerfOptions(mode=parse_mode(perf_mode), hide_span_nodes=not perf_all_nodes, runs=perf_runs or 0,
                          clock_mhz=clock_mhz or 0.0, graph_optimization=perf_graph_optimization or "")
    # the files' bytes, held until their upload only: a 90 MB model is not
    # kept in this process through the job
    held: dict[str, tuple[bytes, str, LocalFile | None]] = {"model": read_upload(model, "model"),
                                                             "inputs": (*_inputs_bytes(inputs), None)}
    if device_model is not None:
        held["device_model"] = read_upload(device_model, "device_model")
    model_name = held["model"][1]
    options = compare_options(atol=atol, rtol=rtol, diff_cnt=diff_cnt, op_config=op_config,
                              map_node_dict=map_node_dict, skip_keys=skip_keys, exclude_node_list=exclude_node_list,
                              force_compare=force_compare, max_cores=max_cores, show_graph=show_graph,
                              max_bins=max_bins, min_bins=min_bins, min_max=min_max, min_coverage=min_coverage,
                              node_precision=node_precision, max_plots=max_plots)

    def spec(client: Client, collector: str) -> pb.JobSpec:
        device_file = held.pop("device_model", None)
        return pb.JobSpec(
            model_artifact=client.upload(*held.pop("model")),
            inputs_artifact=client.upload(*held.pop("inputs")),
            device_model_artifact=client.upload(*device_file) if device_file is not None else "",
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
                    min_coverage: float | None = None, node_precision=None,
                    max_plots: int | None = None) -> pb.CompareOptions:
    """The comparison options ``run`` and ``compare`` share, as the wire carries them."""
    return pb.CompareOptions(
        atol=atol or 0.0, has_atol=atol is not None, rtol=rtol or 0.0, has_rtol=rtol is not None,
        diff_cnt=diff_cnt or 0, op_config_csv=_text_arg(op_config), map_node_dict=parse_map_node_dict(map_node_dict),
        skip_keys=parse_name_list(skip_keys), exclude_node_list=parse_name_list(exclude_node_list),
        force_compare=force_compare, max_cores=max_cores or 0, show_graph=show_graph, max_bins=max_bins or 0,
        min_bins=min_bins or 0, min_max_text=_text_arg(min_max), min_coverage=min_coverage or 0.0,
        has_min_coverage=min_coverage is not None, node_precision=parse_node_precision(node_precision),
        max_plots=max_plots or 0)


def parse_node_precision(value) -> dict[str, str]:
    """{node: precision} from a dict, or from "node=precision" strings
    (comma-separated, repeatable); each precision checked."""
    from layerdiff.common.precision import parse as parse_precision

    if not value:
        return {}
    items = value.items() if isinstance(value, dict) else [
        tuple(part.rsplit("=", 1)) if "=" in part else (part, "")
        for v in ([value] if isinstance(value, str) else value) for part in str(v).split(",") if part.strip()]
    out: dict[str, str] = {}
    for node, prec in items:
        node, prec = str(node).strip(), str(prec).strip()
        if not node or not prec:
            raise LayerdiffError(f"expected NODE=PRECISION, got {node!r}", field="node_precision")
        parsed = parse_precision(prec, field=f"node_precision[{node}]")
        out[node] = parsed.name if parsed is not None else "auto"
    return out


def _run_job(make_spec: Callable[[Client, str], pb.JobSpec], *, analyzer: str | None,
             collector: str | None, out, progress, timeout: float | None,
             on_job: Callable[[str], None] | None, in_process: bool = False) -> RunResult:
    """Start what is not running (an embedded collector, analyzer), submit
    the job ``make_spec(client, collector address)`` describes, follow it
    and fetch its reports. ``in_process``: a job whose records a collector
    in this process hands over (two dumps): with neither service given,
    both run here without a server. Ctrl-C cancels the job and raises
    Interrupted."""
    out = Path(out)
    # the job outlives this process only when neither service runs inside it
    reattachable = analyzer is not None and collector is not None
    with ExitStack() as stack:
        job_id = None
        client: Client | None = None
        try:
            if in_process and analyzer is None and collector is None and not os.environ.get("LAYERDIFF_BROKER_URL"):
                # nothing to serve: no socket, and neither gRPC nor Flight loaded
                from layerdiff.analyzer.local import LocalAnalyzer
                from layerdiff.client.local_client import LocalClient
                from layerdiff.collector.core import InProcessCollector

                reader = stack.enter_context(InProcessCollector())
                client = LocalClient(stack.enter_context(LocalAnalyzer()), beside=reader)
                collector = reader.address
            else:
                client, collector = _served(stack, analyzer, collector)
            spec = make_spec(client, collector)
            try:
                job_id = client.submit(spec)
            except call_errors() as e:
                raise call_failure(f"analyzer {client.address}", e) from None
            if on_job is not None:
                on_job(job_id)
            return follow(client, job_id, out, progress=progress, timeout=timeout, reattachable=reattachable)
        except Interrupted:
            raise
        except BaseException as e:
            if not by_ctrl_c(e):
                raise
            if job_id is None or client is None:
                raise Interrupted("interrupted; no job was started") from None
            raise client.interrupted(job_id) from None


def _served(stack: ExitStack, analyzer: str | None, collector: str | None) -> tuple[AnalyzerClient, str]:
    """A client of the analyzer at ``analyzer``, and the collector's address,
    each started in this process on a free loopback port where not given
    (they stop with ``stack``)."""
    from layerdiff.analyzer.service import AnalyzerServer
    from layerdiff.client.analyzer_client import AnalyzerClient, Embedded
    from layerdiff.collector.service import CollectorServer

    local = collector_store = None
    if collector is None:
        embedded = stack.enter_context(CollectorServer(check_runtime=False))
        collector, collector_store = embedded.address, embedded.flight.store
    if analyzer is None:
        served = stack.enter_context(AnalyzerServer(readiness=False))
        analyzer = served.address
        served.service.runner.keep_summaries = True      # its only client is this process's
        local = Embedded(served.service.store, collector_store, served.service.report_files,
                         served.service.runner.summary)
    client = AnalyzerClient(analyzer, local=local)
    stack.callback(client.close)
    return client, collector


def compare(reference_dump: str, device_dump: str, *, out="layerdiff-out", model=None,
            reference_collector: str | None = None, collector: str | None = None, analyzer: str | None = None,
            reference_format: str = "", dump_format: str = "", default_concat_dim: int = 0,
            watch: bool = False, dump_mode: str = "output", precision: str = "", device: str = "",
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
    names the device's (fp32, tf32, fp16, bf16, fp8_e4m3fn, fp8_e5m2,
    int8) for the error model; default: what the dumped types say.
    ``options``: the comparison options of ``run`` (atol, rtol, diff_cnt,
    map_node_dict, skip_keys, exclude_node_list, min_coverage, ...). The
    RunResult, exit statuses and reports are those of ``run``, the summary
    naming both dumps (``reference_dump``: path, collector, what it held)."""
    model_bytes, model_name = read_artifact(model, "model") if model is not None else (None, "")
    gold, dev = Path(str(reference_dump)), Path(str(device_dump))
    if gold.suffix.lower() == dev.suffix.lower() == ".npy" and gold.stem != dev.stem \
            and not options.get("map_node_dict"):
        # two tensor files are one tensor each: they pair whatever they are called
        options["map_node_dict"] = {gold.stem: dev.stem}
    opts = compare_options(**options)

    def spec(client: Client, device_collector: str) -> pb.JobSpec:
        golden = pb.ReferenceDump(collector=reference_collector or device_collector, dump=pb.DumpSource(
            path=str(reference_dump), format=reference_format or "", default_concat_dim=default_concat_dim))
        return pb.JobSpec(
            model_artifact=client.upload(model_bytes, model_name) if model_bytes is not None else "",
            collector=device_collector, device=device or "", precision=precision or "",
            dump_path=str(device_dump), dump_format=dump_format, default_concat_dim=default_concat_dim,
            watch=watch, dump_mode=dump_mode or "output", options=opts, reference_dump=golden,
            model_name=model_name if model_bytes is not None else "")

    # a dump watched as it is written streams from a served collector
    return _run_job(spec, analyzer=analyzer, collector=collector, out=out, progress=progress, timeout=timeout,
                    on_job=on_job, in_process=reference_collector is None and not watch)



def watch(job_id: str, *, analyzer: str, out="layerdiff-out", progress: bool | Callable[[pb.JobEvent], None] = True,
          timeout: float | None = None) -> RunResult:
    """Follow job ``job_id`` on ``analyzer`` (from its first event, whether
    it runs or has ended) to its end, fetch its reports into ``out`` and
    return the same RunResult as ``run``. Ctrl-C cancels the job and raises
    ``Interrupted``; failures raise JobFailed as ``run`` does."""
    from layerdiff.client.analyzer_client import AnalyzerClient

    client = AnalyzerClient(analyzer)
    try:
        return follow(client, job_id, out, progress=progress, timeout=timeout, reattachable=True)
    except Interrupted:
        raise
    except BaseException as e:
        if not by_ctrl_c(e):
            raise
        raise client.interrupted(job_id) from None
    finally:
        client.close()


def fetch(job_id: str, *, analyzer: str, out="layerdiff-out") -> RunResult:
    """The reports of finished job ``job_id`` on ``analyzer`` into ``out``,
    as the RunResult ``run`` returned. A job that is not DONE raises
    JobFailed: FAILED with its exit status, CANCELLED or still running with
    3, an unknown id with 2. Ctrl-C leaves the job as it is."""
    from layerdiff.client.analyzer_client import AnalyzerClient

    client = AnalyzerClient(analyzer)
    try:
        return fetch_result(client, job_id, out, reattachable=True)
    except Interrupted:
        raise
    except BaseException as e:
        if not by_ctrl_c(e):
            raise
        raise Interrupted(f"interrupted; the reports of job {job_id} were not all fetched", job_id) from None
    finally:
        client.close()
