"""A job: reference, device stream, alignment, comparisons, reports.

The first reference segment is computed while the collector starts
producing; flow control holds the device stream back whenever the analyzer
is busy, at most two comparisons per core are in flight, and every tensor is
dropped once compared, so memory stays near one reference segment plus a
handful of device tensors whatever the size of the network.
"""
from __future__ import annotations

import logging
import shutil
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from layerdiff.analyzer.align import Aligner
from layerdiff.analyzer.consumer import StreamConsumer
from layerdiff.analyzer.coverage import MIN_COVERAGE_DEFAULT
from layerdiff.analyzer.minmax import parse_min_max
from layerdiff.analyzer.perf import PerfSettings, check_perf_options
from layerdiff.analyzer.pool import LocalPool
from layerdiff.analyzer.reference import OnnxReference, SegmentedReference
from layerdiff.analyzer.tfreference import TFReference, open_reference
from layerdiff.analyzer.report import JobReport, write_report
from layerdiff.analyzer.tolerances import Tolerances
from layerdiff.artifacts import ArtifactStore
from layerdiff.errors import EXIT_BAD_INPUT, EXIT_NO_ANSWER, LayerdiffError, NotFoundError, UnavailableError
from layerdiff.onnxgraph import load_inputs
from layerdiff.collector.service import CollectorClient, flight_message
from layerdiff.schema import BufferPool, TensorAssembler, check_dump_mode
from layerdiff.v1 import layerdiff_pb2 as pb

log = logging.getLogger(__name__)
TERMINAL = {pb.DONE, pb.FAILED, pb.CANCELLED}
DIFF_CNT_DEFAULT = 128
PRECISIONS = ("fp32", "fp16", "int8")
# Finished jobs kept with their reports; older ones are forgotten and deleted.
KEEP_FINISHED_JOBS = 64


@dataclass
class Job:
    id: str
    spec: pb.JobSpec
    report_dir: Path
    state: int = pb.QUEUED
    events: list = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)
    cancelled: threading.Event = field(default_factory=threading.Event)
    call: object = None
    summary: dict | None = None
    error: str = ""

    def emit(self, state: int | None = None, **kw) -> None:
        with self.cond:
            if state is not None:
                self.state = state
            self.events.append(pb.JobEvent(job_id=self.id, state=self.state, **kw))
            self.cond.notify_all()

    @property
    def done(self) -> bool:
        return self.state in TERMINAL


@dataclass
class Prepared:
    """Everything checked at submit time, so bad input fails the Submit call."""
    reference: OnnxReference | TFReference
    feeds: dict
    aligner: Aligner
    tolerances: Tolerances
    diff_cnt: int
    max_cores: int
    force_compare: bool
    quantized: bool = False
    show_graph: bool = False
    max_bins: int = 128
    min_bins: int = 1
    given_ranges: dict = field(default_factory=dict)     # from a tensor_min_max.txt
    range_skips: list = field(default_factory=list)      # its lines that did not parse
    perf: PerfSettings = field(default_factory=PerfSettings)
    min_coverage: float | None = None   # None: the default (coverage.MIN_COVERAGE_DEFAULT)


def prepare(spec: pb.JobSpec, store: ArtifactStore) -> Prepared:
    if not spec.collector:
        raise LayerdiffError("no collector address given", field="collector")
    if spec.precision and spec.precision not in PRECISIONS and not spec.device_model_artifact:
        raise LayerdiffError(f"unknown precision {spec.precision!r} (one of {', '.join(PRECISIONS)})",
                             field="precision")
    model_name = spec.model_name or store.name(spec.model_artifact)
    reference = open_reference(store.read(spec.model_artifact, "model_artifact"), model_name, spec.signature)
    inputs_name = store.name(spec.inputs_artifact) if spec.inputs_artifact else "inputs"
    feeds = reference.check_inputs(load_inputs(store.read(spec.inputs_artifact, "inputs_artifact"), inputs_name),
                                   inputs_name)
    if spec.device_model_artifact:
        store.path(spec.device_model_artifact, "device_model_artifact")
    elif isinstance(reference, TFReference) and not spec.dump_path:
        reference.check_device_precision(spec.precision)
    o = spec.options
    aligner = Aligner(reference.sites, map_node_dict=dict(o.map_node_dict), skip_keys=list(o.skip_keys),
                      exclude_node_list=list(o.exclude_node_list))
    tolerances = Tolerances(o.atol if o.has_atol or o.atol else None, o.rtol if o.has_rtol or o.rtol else None,
                            o.op_config_csv)
    if o.diff_cnt < 0:
        raise LayerdiffError("must be >= 0", field="diff_cnt")
    if o.max_cores < 0:
        raise LayerdiffError("must be >= 0", field="max_cores")
    check_dump_mode(spec.dump_mode)
    max_bins = o.max_bins or 128
    min_bins = o.min_bins or 1
    if max_bins < 1 or max_bins > 4096:
        raise LayerdiffError(f"must be in [1, 4096], got {max_bins}", field="max_bins")
    if not 1 <= min_bins <= max_bins:
        raise LayerdiffError(f"must be in [1, max_bins={max_bins}], got {min_bins}", field="min_bins")
    given_ranges, range_skips = parse_min_max(o.min_max_text) if o.min_max_text.strip() else ({}, [])
    quantized = spec.precision == "int8" or (bool(spec.device_model_artifact) and _is_quantized(
        store.read(spec.device_model_artifact, "device_model_artifact")))
    min_coverage = o.min_coverage if o.has_min_coverage or o.min_coverage else None
    if min_coverage is not None and not 0.0 <= min_coverage <= 1.0:
        raise LayerdiffError(f"must be in [0, 1], got {min_coverage:g}", field="min_coverage")
    perf = check_perf_options(spec.perf)
    if perf.enabled and not spec.dump_path:
        _check_live_perf(spec, store)
    if perf.only and spec.watch:
        raise LayerdiffError("watch streams tensors while the runtime writes them; a performance-only job reads "
                             "the counter files once: run it when the runtime has finished", field="watch")
    return Prepared(reference, feeds, aligner, tolerances, o.diff_cnt or DIFF_CNT_DEFAULT, o.max_cores,
                    o.force_compare, quantized, o.show_graph, max_bins, min_bins, given_ranges, range_skips,
                    perf=perf, min_coverage=min_coverage)


def _check_live_perf(spec: pb.JobSpec, store: ArtifactStore) -> None:
    """Live performance data is onnxruntime's profiler: the file that runs as
    the device must be ONNX."""
    from layerdiff.tfgraph import is_tensorflow

    artifact = spec.device_model_artifact or spec.model_artifact
    name = store.name(artifact)
    if is_tensorflow(name, store.read(artifact)):
        raise LayerdiffError("performance data of a live run comes from onnxruntime's profiler, and this is a "
                             "TensorFlow model; give the runtime's counter files as a dump, or an ONNX device model",
                             file=name, field="perf")


def _is_quantized(model_bytes: bytes) -> bool:
    """A fixed-point build: the device model quantizes somewhere."""
    import onnx

    try:
        model = onnx.load_model_from_string(model_bytes)
    except Exception:
        return False
    return any(n.op_type in ("QuantizeLinear", "QLinearConv", "QLinearMatMul", "ConvInteger", "MatMulInteger")
               for n in model.graph.node)


class JobRunner:
    """Runs jobs on the local pool, or on Celery workers when a broker URL is
    given (LAYERDIFF_BROKER_URL or --broker)."""

    def __init__(self, store: ArtifactStore, jobs_dir: Path, broker_url: str | None = None) -> None:
        self.store = store
        self.jobs_dir = Path(jobs_dir)
        self.broker_url = broker_url or None
        self.jobs: dict[str, Job] = {}
        self._lock = threading.Lock()

    def executor(self, job_id: str, max_cores: int | None):
        if self.broker_url:
            from layerdiff.analyzer.fanout import CeleryPool

            return CeleryPool(self.broker_url, job_id, max_cores)
        return LocalPool(max_cores)

    def submit(self, spec: pb.JobSpec) -> Job:
        prepared = prepare(spec, self.store)
        if self.broker_url:
            from layerdiff.analyzer.store import TensorStore

            TensorStore(self.broker_url).ping()   # a broker refusing connections fails the Submit itself
        job_id = uuid.uuid4().hex[:16]
        job = Job(id=job_id, spec=spec, report_dir=self.jobs_dir / job_id)
        with self._lock:
            self._forget_old_jobs()
            self.jobs[job.id] = job
        job.emit(pb.QUEUED, nodes_total=len(prepared.reference.sites))
        threading.Thread(target=self._run, args=(job, prepared), name=f"job-{job.id}", daemon=True).start()
        return job

    def _forget_old_jobs(self) -> None:
        finished = [j for j in self.jobs.values() if j.done]
        for old in finished[:max(0, len(finished) - KEEP_FINISHED_JOBS + 1)]:
            del self.jobs[old.id]
            shutil.rmtree(old.report_dir, ignore_errors=True)

    def get(self, job_id: str) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            raise NotFoundError(f"no job {job_id!r}", field="job_id")
        return job

    def cancel(self, job_id: str) -> Job:
        job = self.get(job_id)
        if not job.done:
            job.cancelled.set()
            if job.call is not None:
                job.call.cancel()
        return job

    # ------------------------------------------------------------------ run

    def _run(self, job: Job, p: Prepared) -> None:
        started = time.time()
        total = len(p.reference.sites)
        try:
            summary = self._execute(job, p, started)
            job.summary = summary
            first = summary["first_failing_node"]
            answer = summary["outcome"]
            job.emit(pb.DONE, nodes_done=total, nodes_total=total, first_failing_node=first["node"] if first else "",
                     message=answer["reason"], outcome=answer["status"], exit_status=answer["exit_status"])
        except _Cancelled:
            job.emit(pb.CANCELLED, message="cancelled")
        except LayerdiffError as e:
            job.error = str(e)
            job.emit(pb.FAILED, message=str(e), exit_status=failure_exit_status(e))
        except Exception as e:  # a bug: say so, keep the service up
            log.exception("job %s failed", job.id)
            job.error = f"internal error: {type(e).__name__}: {e}"
            job.emit(pb.FAILED, message=job.error, exit_status=failure_exit_status(e))

    def _capture_request(self, job: Job, collector) -> pb.CaptureRequest:
        spec = job.spec
        if spec.dump_path:
            return pb.CaptureRequest(job_id=job.id, dump=pb.DumpSource(
                path=spec.dump_path, format=spec.dump_format, default_concat_dim=spec.default_concat_dim,
                watch=spec.watch))
        model = collector.upload(self.store.read(spec.model_artifact), self.store.name(spec.model_artifact))
        inputs = collector.upload(self.store.read(spec.inputs_artifact), self.store.name(spec.inputs_artifact))
        device_model = collector.upload(self.store.read(spec.device_model_artifact),
                                        self.store.name(spec.device_model_artifact)) \
            if spec.device_model_artifact else ""
        return pb.CaptureRequest(job_id=job.id, live=pb.LiveSource(
            model_artifact=model, inputs_artifact=inputs, device_model_artifact=device_model,
            precision=spec.precision or "fp32", device=spec.device or "cpu", dump_mode=spec.dump_mode or "output",
            signature=spec.signature))

    def _execute(self, job: Job, p: Prepared, started: float) -> dict:
        spec = job.spec
        total = len(p.reference.sites)
        # Timed first, before the reference runs, so that nothing of this job
        # loads the host while the device is being timed; a watched dump's
        # counter files are read once the runtime has finished writing it.
        perf = self._capture_perf(job, p) if p.perf.enabled and not spec.watch else None
        if p.perf.only:
            from layerdiff.analyzer.perf import write_perf_only

            job.emit(pb.REPORTING, nodes_total=total)
            return write_perf_only(job.report_dir, perf, p.aligner, p.reference.sites, p.perf,
                                   job=self._job_info(job, p, started), parameters=self._parameters(job, p))
        job.emit(pb.REFERENCE, nodes_total=total)
        mode = check_dump_mode(spec.dump_mode)
        # Node inputs read tensors that are also node outputs: such values are
        # kept until every comparison that needs them has had them.
        uses = {t: n + (mode == "all") for t, n in p.reference.input_uses().items()} if mode != "output" else None
        reference = SegmentedReference(p.reference, p.feeds, uses)
        helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reference")
        # The first segment is computed while the collector starts producing.
        ref_future = helper.submit(reference.ensure, 0)
        helper.shutdown(wait=False)

        collector = CollectorClient(spec.collector)
        try:
            collector.wait_ready()
            if job.cancelled.is_set():
                raise _Cancelled()
            request = self._capture_request(job, collector)
            try:
                job.call = collector.capture(request)
            except (pa.ArrowException, KeyError) as e:   # refused before the first batch
                raise collector_error(job.spec.collector, e) from None
            if job.cancelled.is_set():
                job.call.cancel()
            rep = JobReport()
            executor = self.executor(job.id, p.max_cores or None)
            try:
                self._consume(job, p, job.call, ref_future, executor, rep, total)
            finally:
                executor.close()
        finally:
            collector.close()
        if job.cancelled.is_set():
            raise _Cancelled()
        if p.perf.enabled and perf is None:
            perf = self._capture_perf(job, p)
        job.emit(pb.REPORTING, nodes_done=total, nodes_total=total)
        job_info = self._job_info(job, p, started)
        sections = None
        if perf is not None:
            from layerdiff.analyzer.perf import write_perf_sections

            def sections():
                return write_perf_sections(job.report_dir, perf, p.aligner, p.reference.sites, p.perf, rep,
                                           job_info)
        return write_report(job.report_dir, rep, parameters=self._parameters(job, p), job=job_info,
                            node_runtime=p.reference.node_runtime(), consumers=p.reference.consumers,
                            all_sites=p.reference.sites, aligner=p.aligner, node_inputs=p.reference.node_inputs,
                            sections=sections, min_coverage=p.min_coverage)

    def _parameters(self, job: Job, p: Prepared) -> dict:
        o = job.spec.options
        return {
            "atol": p.tolerances.default.atol, "rtol": p.tolerances.default.rtol, "diff_cnt": p.diff_cnt,
            "op_config": bool(o.op_config_csv.strip()), "map_node_dict": dict(o.map_node_dict),
            "skip_keys": list(o.skip_keys), "exclude_node_list": list(o.exclude_node_list),
            "force_compare": o.force_compare, "max_cores": p.max_cores or None,
            "dump_mode": check_dump_mode(job.spec.dump_mode),
            "min_coverage": MIN_COVERAGE_DEFAULT if p.min_coverage is None else p.min_coverage,
        }

    def _job_info(self, job: Job, p: Prepared, started: float) -> dict:
        spec = job.spec
        return {
            "job_id": job.id, "model": p.reference.name, "device": spec.device or "cpu",
            "precision": spec.precision or "fp32",
            "source": "dump" if spec.dump_path else ("device_model" if spec.device_model_artifact else "live"),
            "dump_path": spec.dump_path or None, "collector": spec.collector,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "elapsed_s": round(time.time() - started, 3),
        }

    def _capture_perf(self, job: Job, p: Prepared):
        """The collector's performance stream for this job's source: the
        dump's counter files, or the device model profiled on the collector."""
        from layerdiff.analyzer.perf import receive

        job.emit(pb.COMPARING, nodes_total=len(p.reference.sites), message="capturing performance data")
        collector = CollectorClient(job.spec.collector)
        try:
            collector.wait_ready()
            if job.cancelled.is_set():
                raise _Cancelled()
            request = self._capture_request(job, collector)
            request.stream = pb.CAPTURE_STREAM_PERF
            request.perf.CopyFrom(pb.PerfCapture(runs=p.perf.runs, graph_optimization=p.perf.graph_optimization))
            try:
                job.call = collector.capture(request)
                if job.cancelled.is_set():
                    job.call.cancel()
                data = receive(job.call)
            except (pa.ArrowException, KeyError) as e:
                if job.cancelled.is_set():
                    raise _Cancelled() from None
                raise collector_error(job.spec.collector, e) from None
        finally:
            collector.close()
        if job.cancelled.is_set():
            raise _Cancelled()
        return data

    def _consume(self, job: Job, p: Prepared, call, ref_future: Future, executor, rep: JobReport,
                 total: int) -> None:
        assembler = TensorAssembler(pool=BufferPool())

        def progress(done: int, node: str, passed: bool) -> None:
            job.emit(nodes_done=done, nodes_total=total, node=node, node_passed=passed)

        consumer = StreamConsumer(p, executor, ref_future.result, rep, job.report_dir, progress,
                                  dump_mode=check_dump_mode(job.spec.dump_mode))
        try:
            try:
                for chunk in call:
                    if job.state != pb.COMPARING:
                        job.emit(pb.COMPARING, nodes_done=consumer.done, nodes_total=total)
                    if job.cancelled.is_set():
                        call.cancel()
                        break
                    for rec in assembler.feed(chunk.data):
                        consumer.take(rec)
                for rec in assembler.finish():
                    consumer.take(rec)
            except (pa.ArrowException, KeyError) as e:
                if job.cancelled.is_set():
                    raise _Cancelled() from None
                raise collector_error(job.spec.collector, e) from None
            if job.cancelled.is_set():
                raise _Cancelled()
            consumer.finish()
        except BaseException:
            consumer.abandon()
            raise


class _Cancelled(Exception):
    pass


def collector_error(address: str, e: BaseException) -> LayerdiffError:
    """A collector call that failed: the collector's own refusal (bad
    input), or the collector unreachable, gone or silent (a component)."""
    import pyarrow.flight as flight

    text = f"collector {address}: {flight_message(e)}"
    if isinstance(e, (flight.FlightUnavailableError, flight.FlightTimedOutError, flight.FlightCancelledError)):
        return UnavailableError(text, field="collector")
    return LayerdiffError(text)


def failure_exit_status(e: BaseException) -> int:
    """2 for bad input or usage; 3 when a component failed and the job
    could not answer."""
    if isinstance(e, LayerdiffError) and not isinstance(e, UnavailableError):
        return EXIT_BAD_INPUT
    return EXIT_NO_ANSWER
