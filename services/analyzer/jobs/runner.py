"""A job: reference, device stream, alignment, comparisons, reports.

The first reference segment is computed while the collector starts
producing; flow control holds the device stream back whenever the analyzer
is busy, at most two comparisons per core are in flight, and every tensor is
dropped once compared, so memory stays near one reference segment plus a
handful of device tensors whatever the size of the network.

The job itself (state, events, record) is ``job.py``; what a Submit checks
before the job starts is ``prepare.py``.
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from layerdiff.analyzer.compare import metrics as M
from layerdiff.analyzer.compare.coverage import MIN_COVERAGE_DEFAULT
from layerdiff.analyzer.diagnose.verdicts import ExecutionOrder
from layerdiff.analyzer.execute.local import LocalPool
from layerdiff.analyzer.jobs.budget import DEFAULT_BUDGET, MemoryBudget
from layerdiff.analyzer.jobs.consumer import StreamConsumer
from layerdiff.analyzer.jobs.job import Job, failure_exit_status
from layerdiff.analyzer.jobs.prepare import (
    Prepared,
    dump_graph_alignment,
    fp16_build_weights,
    is_fp16_build,
    make_aligner,
    prepare,
)
from layerdiff.analyzer.jobs.receive import CollectorStream, InProcessStream, upload_timeout
from layerdiff.analyzer.jobs.records import JobRecords, Retention, dir_bytes, drop_broker_keys, is_disk_full
from layerdiff.analyzer.reference.dump import DumpReference
from layerdiff.analyzer.reference.onnxrt import OnnxReference
from layerdiff.analyzer.reference.segments import SegmentedReference
from layerdiff.analyzer.report.details import DetailFiles
from layerdiff.analyzer.report.files import JobReport, write_report
from layerdiff.collector.core import Collector, in_process
from layerdiff.common.artifacts import ArtifactStore
from layerdiff.common.errors import EXIT_NO_ANSWER, LayerdiffError, LimitError, NotFoundError
from layerdiff.common.openfiles import open_files_limit, too_many_open_files
from layerdiff.common.schema import BufferPool, TensorAssembler, check_dump_mode
from layerdiff.common.settings import env_limit
from layerdiff.v1 import layerdiff_pb2 as pb

if TYPE_CHECKING:
    import pyarrow as pa

    from layerdiff.collector.service import CollectorClient
else:
    from layerdiff.common.lazy import pa

log = logging.getLogger(__name__)
# Finished jobs that keep their whole event history in memory; older ones keep
# their final event, as after a restart. Finished jobs and their reports are
# deleted by retention (jobrecords: LAYERDIFF_RETAIN_*), not by count here.
KEEP_EVENT_HISTORY = 64


MAX_JOBS_PER_CLIENT_DEFAULT = 4
# a golden dump is spilled to the analyzer's disk while its job runs
REFERENCE_DUMP_BYTES_DEFAULT = 64 * 1024 ** 3
SPILL_DIR = "spill"
REPORT_QUOTA_BYTES_DEFAULT = 2 * 1024 ** 3


def _check_report_quota(report_dir: Path) -> None:
    """A job's reports past LAYERDIFF_REPORT_QUOTA_BYTES (2 GiB) fail it (and
    a failed job's partial reports are deleted): the reports are bounded by
    construction (diff_cnt rows per failing node, plots for the first 40),
    and this bound is the one an operator sets."""
    quota = env_limit("LAYERDIFF_REPORT_QUOTA_BYTES", REPORT_QUOTA_BYTES_DEFAULT, size=True)
    used = dir_bytes(report_dir)        # os.walk: no Path made for each of a few hundred files
    if used > quota:
        raise LimitError(f"the reports take {used} bytes, over the per-job quota of {quota} "
                         "(LAYERDIFF_REPORT_QUOTA_BYTES); fewer rows per failing node (--diff-cnt) or no plots "
                         "make them smaller", field="reports")


def max_jobs_per_client() -> int:
    """LAYERDIFF_MAX_JOBS_PER_CLIENT: jobs one token may have running at once (4)."""
    return env_limit("LAYERDIFF_MAX_JOBS_PER_CLIENT", MAX_JOBS_PER_CLIENT_DEFAULT)


class JobRunner:
    """Runs jobs on the local pool, or on Celery workers when a broker URL is
    given (LAYERDIFF_BROKER_URL or --broker)."""

    def __init__(self, store: ArtifactStore, jobs_dir: Path, broker_url: str | None = None,
                 retention: Retention | None = None, keep_summaries: bool = False) -> None:
        """Reads back the jobs recorded under ``jobs_dir`` (those that were
        running when the analyzer stopped are recorded as FAILED) and
        applies ``retention`` (default: from LAYERDIFF_RETAIN_*).
        ``keep_summaries``: each finished job keeps its summary (Job.summary)
        for a client in this process."""
        self.store = store
        self.keep_summaries = keep_summaries
        self.jobs_dir = Path(jobs_dir)
        self.workdir = self.jobs_dir.parent
        self.broker_url = broker_url or None
        self.jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        # jobs each owner has being prepared: they count against the owner's
        # bound before they are in self.jobs, so two submits at once cannot
        # both pass it
        self._submitting: dict[str, int] = {}
        self._retention_lock = threading.Lock()
        self.records = JobRecords(self.jobs_dir, retention if retention is not None else Retention.from_env())
        # golden dumps spilled by jobs a stopped analyzer left behind
        shutil.rmtree(self.workdir / SPILL_DIR, ignore_errors=True)
        records, interrupted = self.records.load()
        for rec in records:
            try:
                job = Job.from_record(rec, self.records.report_dir(rec["id"]))
            except (KeyError, ValueError, TypeError) as e:
                log.warning("job record %s is not usable (%s): ignored", rec.get("id"), e)
                continue
            self.jobs[job.id] = job
        if interrupted:
            log.warning("%d job(s) were running when the analyzer stopped, now recorded as FAILED: %s",
                        len(interrupted), ", ".join(interrupted))
            if self.broker_url:   # in the background: a broker that does not answer never holds start-up
                threading.Thread(target=drop_broker_keys, args=(self.broker_url, interrupted),
                                 name="drop-interrupted-jobs", daemon=True).start()
        self._enforce_retention()

    def executor(self, job_id: str, max_cores: int | None):
        if self.broker_url:
            from layerdiff.analyzer.execute.fanout import CeleryPool

            return CeleryPool(self.broker_url, job_id, max_cores)
        return LocalPool(max_cores)

    def submit(self, spec: pb.JobSpec, owner: str = "") -> Job:
        """``owner``: the digest of the submitting token; only it (or an
        admin token) may watch, fetch or cancel the job."""
        limit = max_jobs_per_client()
        with self._lock:
            # a cancelled job is winding down: Ctrl-C and run again is not refused
            running = self._submitting.get(owner, 0) + sum(
                1 for j in self.jobs.values() if j.owner == owner and not j.done and not j.cancelled.is_set())
            if owner and running >= limit:     # without tokens every client is the same one: no per-client bound
                raise LimitError(f"{running} jobs of this client are still running, the most one client may run "
                                 f"at once (LAYERDIFF_MAX_JOBS_PER_CLIENT={limit}); wait for one to end")
            self._submitting[owner] = self._submitting.get(owner, 0) + 1
        try:
            return self._submit(spec, owner)
        finally:
            with self._lock:
                self._submitting[owner] -= 1
                if not self._submitting[owner]:
                    del self._submitting[owner]

    def _submit(self, spec: pb.JobSpec, owner: str) -> Job:
        job_id = os.urandom(8).hex()     # as uuid4's first 16 hex digits (uuid: 1 ms of every command's start)
        job = Job(id=job_id, spec=spec, report_dir=self.records.report_dir(job_id), owner=owner)
        self.store.hold(job.artifacts)   # from here until the job ends, retention leaves them alone
        try:
            prepared = prepare(spec, self.store)
            if self.broker_url:
                from layerdiff.analyzer.execute.store import TensorStore

                with TensorStore(self.broker_url) as check:   # a broker refusing connections fails the Submit itself
                    check.ping()
        except BaseException:
            self.store.release(job.artifacts)
            raise
        with self._lock:
            self._forget_old_jobs()
            self.jobs[job.id] = job
        job.emit(pb.QUEUED, nodes_total=len(prepared.reference.sites))
        try:
            self.records.save(job.record())   # before the job can end and record that
        except Exception:
            log.exception("job %s: its record was not written", job.id)
        if prepared.weights is None and is_fp16_build(spec, prepared.reference):
            # made beside the job (the FP16 build is shared with an embedded collector's run)
            aside = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights")
            prepared.weights_aside = aside.submit(fp16_build_weights, spec, prepared.reference)
            aside.shutdown(wait=False)
        job.thread = threading.Thread(target=self._run, args=(job, prepared), name=f"job-{job.id}", daemon=True)
        job.thread.start()
        return job

    def _forget_old_jobs(self) -> None:
        """Finished jobs beyond the newest KEEP_EVENT_HISTORY keep only their
        final event in memory (their records and reports stay, under the
        retention limits)."""
        finished = [j for j in self.jobs.values() if j.done and len(j.events) > 1]
        for old in finished[:max(0, len(finished) - KEEP_EVENT_HISTORY)]:
            with old.cond:
                old.dropped += len(old.events) - 1
                old.events = old.events[-1:]

    def _enforce_retention(self) -> None:
        try:
            with self._retention_lock:
                deleted = self.records.enforce(self.store)
        except Exception:   # never a reason to fail a job or the start-up
            log.exception("retention of finished jobs and uploads failed")
            return
        with self._lock:
            for job_id in deleted:
                job = self.jobs.get(job_id)
                if job is not None and job.done:
                    del self.jobs[job_id]

    def get(self, job_id: str) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            why = self.records.why_forgotten(job_id)
            if why:
                raise NotFoundError(f"job {job_id!r} and its reports were deleted: {why}", field="job_id")
            raise NotFoundError(f"no job {job_id!r} on this analyzer; {self.records.retention.describe()}",
                                field="job_id")
        return job

    def cancel(self, job_id: str) -> Job:
        """Cancel a job: every wait of its thread ends at once (the stream,
        the comparisons, the reference); the job then reads CANCELLED."""
        job = self.get(job_id)
        if not job.done:
            job.cancelled.set()
            for part in (job.call, job.executor):
                if part is not None:
                    part.cancel()
        return job

    def summary(self, job_id: str) -> dict | None:
        """A finished job's summary (what its summary.json says), where this
        runner keeps them (keep_summaries); else None."""
        job = self.jobs.get(job_id)
        return job.summary if job is not None else None

    def report_files(self, job_id: str) -> list[tuple[str, Path]]:
        """(path in the report, file) of every file of a DONE job's report."""
        job = self.get(job_id)
        if job.state != pb.DONE:
            raise LayerdiffError(f"job is {pb.JobState.Name(job.state)}, reports exist once it is DONE"
                                 + (f" ({job.error})" if job.error else ""), field="job_id")
        root = job.report_dir
        if not (root / "summary.json").is_file():
            raise reports_gone(job_id, root)
        return report_listing(root)

    def stop(self, timeout: float = 2.0) -> None:
        """Cancel every job under way and wait, ``timeout`` at most, for
        their threads to end (a service stopping, its work dir about to go)."""
        with self._lock:
            running = [j for j in self.jobs.values() if j.thread is not None and j.thread.is_alive()]
        for job in running:
            self.cancel(job.id)
        end = time.monotonic() + timeout
        for job in running:
            assert job.thread is not None    # running: the jobs with a thread
            job.thread.join(max(0.0, end - time.monotonic()))

    # ------------------------------------------------------------------ run

    def _run(self, job: Job, p: Prepared) -> None:
        started = time.time()
        try:
            try:
                summary = self._execute(job, p, started)
                total = len(p.reference.sites)     # a golden dump's are known once it has streamed
                first = summary["first_failing_node"]
                answer = summary["outcome"]
                if self.keep_summaries:
                    job.summary = summary
                state, end = pb.DONE, dict(
                    nodes_done=total, nodes_total=total, first_failing_node=first["node"] if first else "",
                    message=answer["reason"], outcome=answer["status"], exit_status=answer["exit_status"])
            except _Cancelled:
                state, end = pb.CANCELLED, dict(message="cancelled")
            except Exception as e:
                if is_disk_full(e):
                    job.error = (f"disk full: the analyzer's work dir {self.workdir} has no space left for the "
                                 "reports; free space there and run the job again")
                    log.warning("job %s: %s (%s)", job.id, job.error, e)
                    exit_status = EXIT_NO_ANSWER
                elif too_many_open_files(e):
                    limit = open_files_limit()
                    job.error = ("too many open files: each tensor a job keeps mapped from a dump holds one, and "
                                 f"this process may hold {limit if limit > 0 else 'no more'}; raise the limit "
                                 "(ulimit -n, or the service's LimitNOFILE) and run the job again")
                    log.warning("job %s: %s (%s)", job.id, job.error, e)
                    exit_status = EXIT_NO_ANSWER
                elif isinstance(e, LayerdiffError):
                    job.error = str(e)
                    exit_status = failure_exit_status(e)
                else:   # a bug: say so, keep the service up
                    log.exception("job %s failed", job.id)
                    job.error = f"internal error: {type(e).__name__}: {e}"
                    exit_status = failure_exit_status(e)
                state, end = pb.FAILED, dict(message=job.error, exit_status=exit_status)
            self._finish(job, state, end)
        finally:
            self.store.release(job.artifacts)
            if isinstance(p.reference, DumpReference):
                p.reference.close()
        self._enforce_retention()

    def _finish(self, job: Job, state: pb.JobState.ValueType, end: dict) -> None:
        """Record the job's end, then tell its watchers: a client that has
        seen the end finds it recorded, whatever happens to the analyzer."""
        job.finished_at = time.time()
        if state != pb.DONE:   # reports are fetched from DONE jobs only: free the space at once
            shutil.rmtree(job.report_dir, ignore_errors=True)
        try:
            self.records.finish(job.record(pb.JobEvent(job_id=job.id, state=state, **end)))
        except Exception:   # a record never ends the job thread
            log.exception("job %s: its record was not written", job.id)
        job.emit(state, **end)

    def _capture_request(self, job: Job, collector) -> pb.CaptureRequest:
        spec = job.spec
        if spec.dump_path:
            return pb.CaptureRequest(job_id=job.id, dump=pb.DumpSource(
                path=spec.dump_path, format=spec.dump_format, default_concat_dim=spec.default_concat_dim,
                watch=spec.watch))
        def upload(artifact: str) -> str:
            if collector.has_artifact(artifact):    # ids are contents' digests: sent before, or handed over
                return artifact
            data = self.store.read(artifact)
            return collector.upload(data, self.store.name(artifact), timeout=upload_timeout(len(data)))

        model = upload(spec.model_artifact)
        inputs = upload(spec.inputs_artifact)
        device_model = upload(spec.device_model_artifact) if spec.device_model_artifact else ""
        return pb.CaptureRequest(job_id=job.id, live=pb.LiveSource(
            model_artifact=model, inputs_artifact=inputs, device_model_artifact=device_model,
            precision=spec.precision or "fp32", device=spec.device or "cpu", dump_mode=spec.dump_mode or "output",
            signature=spec.signature))

    def _execute(self, job: Job, p: Prepared, started: float) -> dict:
        # the failing tensors' files, written while the job compares, by the
        # report's process: started first, so that it boots while the
        # reference is read (one core), not while both cores compare
        details = DetailFiles(job.report_dir)
        details.start()
        try:
            return self._execute_with(job, p, started, details)
        finally:
            details.close()

    def _execute_with(self, job: Job, p: Prepared, started: float, details: DetailFiles) -> dict:
        spec = job.spec
        if p.golden:
            self._receive_golden(job, p)
        total = len(p.reference.sites)
        # Timed first, before the reference runs, so that nothing of this job
        # loads the host while the device is being timed; a watched dump's
        # counter files are read once the runtime has finished writing it.
        if p.perf.enabled:
            p.settle_graph(spec.options)     # the performance tables pair device nodes by it
        perf = self._capture_perf(job, p) if p.perf.enabled and not spec.watch else None
        if p.perf.only:
            from layerdiff.analyzer.report.perf.report import write_perf_only

            job.emit(pb.REPORTING, nodes_total=total)
            assert perf is not None    # captured above: a performance-only job is never watched (prepare)
            return write_perf_only(job.report_dir, perf, p.aligner, p.reference.sites, p.perf,
                                   job=self._job_info(job, p, started), parameters=self._parameters(job, p))
        job.emit(pb.REFERENCE, nodes_total=total)
        mode = check_dump_mode(spec.dump_mode)
        # Node inputs read tensors that are also node outputs: such values are
        # kept until every comparison that needs them has had them.
        # A golden dump's values are mapped from its spill files: kept for
        # every reader whatever the mode, at no memory cost.
        uses = {t: n + (mode == "all" or p.golden) for t, n in p.reference.input_uses().items()} \
            if mode != "output" or p.golden else None
        budget = MemoryBudget.from_env()
        pool = BufferPool()     # the device tensors' receive buffers
        reference = SegmentedReference(p.reference, p.feeds, uses, budget=budget.reference,
                                       spill_dir=self.workdir / SPILL_DIR / f"{job.id}.values", make_room=pool.trim)
        helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reference")
        # The first segment is computed while the collector starts producing.
        ref_future = helper.submit(reference.ensure, 0)
        if not self.broker_url:
            # The kernels load (a tenth of a second) while the device side is
            # still building its session, not when the first pair arrives.
            helper.submit(M.warmup)
        helper.shutdown(wait=False)

        rep = JobReport()
        if isinstance(p.reference, DumpReference):
            rep.reference_overflow = dict(p.reference.overflow)
        # device values of nodes with an error of their own, for the impact re-runs
        injected = None
        if isinstance(p.reference, OnnxReference):
            from layerdiff.analyzer.diagnose.impact import InjectedValues

            injected = InjectedValues(cap_bytes=budget.impact)

        # the kept values are released however the job ends (one may hold its receive buffer)
        try:
            def on_ready(collector: CollectorClient | Collector) -> None:
                if p.golden and isinstance(p.reference, DumpReference) and p.reference.model is None:
                    return      # the golden dump's names and values pair the device's
                graph = dump_graph_alignment(spec, p.reference, collector)
                if graph is not None:
                    p.aligner = make_aligner(p.reference, spec.options, graph)

            try:
                with self._stream(job, collector_request=None, on_ready=on_ready) as stream:
                    job.executor = executor = self.executor(job.id, p.max_cores or None)
                    try:
                        if job.cancelled.is_set():
                            executor.cancel()
                        p.settle_graph(spec.options)     # made while the collector started the device
                        self._consume(job, p, stream, ref_future, executor, rep, total, injected, budget, pool,
                                      details)
                    finally:
                        executor.close()
                        job.executor = None
            finally:
                baseline = reference.graph_outputs()
                reference.close()
            if job.cancelled.is_set():
                raise _Cancelled()
            if p.perf.enabled and perf is None:
                perf = self._capture_perf(job, p)
            job.emit(pb.REPORTING, nodes_done=total, nodes_total=total)
            job_info = self._job_info(job, p, started)
            job_info["memory"] = reference.memory()
            sections = None
            if perf is not None:
                from layerdiff.analyzer.report.perf.report import write_perf_sections

                sections = partial(write_perf_sections, job.report_dir, perf, p.aligner, p.reference.sites, p.perf,
                                   rep, job_info)
            # device values are kept for the impact re-runs of an ONNX reference only
            impact = None
            if injected and isinstance(p.reference, OnnxReference):
                from layerdiff.analyzer.diagnose.impact import ImpactRunner

                impact = ImpactRunner(p.reference.split, p.feeds, injected, p.tolerances.default, baseline=baseline)
            if p.weights_aside is not None:
                p.weights = p.weights_aside.result()
            summary = write_report(job.report_dir, rep, parameters=self._parameters(job, p), job=job_info,
                                   node_runtime=p.reference.node_runtime(), consumers=p.reference.consumers,
                                   all_sites=p.reference.sites, aligner=p.aligner,
                                   node_inputs=p.reference.node_inputs, sections=sections,
                                   min_coverage=p.min_coverage, impact=impact, weights=p.weights,
                                   presumed=getattr(p.reference, "presumed", None),
                                   outputs=getattr(p.reference, "model_outputs", frozenset()),
                                   order=ExecutionOrder(getattr(p.reference, "order_from", ""),
                                                        getattr(p.reference, "order_unknown", "")),
                                   details=details)
            _check_report_quota(job.report_dir)
            return summary
        finally:
            if injected is not None:
                injected.release()

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
            "job_id": job.id, "model": p.reference.name, "device": spec.device or ("device" if p.golden else "cpu"),
            "precision": spec.precision or "fp32",
            "source": "dump" if spec.dump_path else ("device_model" if spec.device_model_artifact else "live"),
            "dump_path": spec.dump_path or None, "collector": spec.collector,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "elapsed_s": round(time.time() - started, 3),
            **({"reference_dump": self._golden_provenance(p)} if p.golden else {}),
        }

    @staticmethod
    def _golden_provenance(p: Prepared) -> dict:
        """Where the reference came from: the golden dump, its collector,
        what it held; the device dump's is the job's dump_path/collector."""
        g = p.reference
        assert isinstance(g, DumpReference)    # p.golden: prepared with a DumpReference
        return {**g.provenance, "records": g.records, "tensors": g.tensors, "bytes": g.bytes,
                "duplicates": len(g.duplicates), "model": p.reference.name if g.model is not None else None,
                "structure": "model" if g.model is not None else "dump"}

    def _capture_perf(self, job: Job, p: Prepared):
        """The collector's performance stream for this job's source: the
        dump's counter files, or the device model profiled on the collector."""
        from layerdiff.analyzer.report.perf.table import receive

        job.emit(pb.COMPARING, nodes_total=len(p.reference.sites), message="capturing performance data")

        def perf_request(request: pb.CaptureRequest) -> None:
            request.stream = pb.CAPTURE_STREAM_PERF
            request.perf.CopyFrom(pb.PerfCapture(runs=p.perf.runs, graph_optimization=p.perf.graph_optimization))

        with self._stream(job, perf_request) as stream:
            try:
                data = receive(stream)
            except LayerdiffError:
                if job.cancelled.is_set():
                    raise _Cancelled() from None
                raise
        if job.cancelled.is_set():
            raise _Cancelled()
        return data

    @contextmanager
    def _stream(self, job: Job, collector_request=None, on_ready=None, golden: bool = False):
        """The job's stream from its collector (``golden``: the reference
        dump's, from its own collector), open and watched for liveness;
        ``collector_request`` may amend the capture request, ``on_ready`` is
        called with the collector once it answers. Closed (connection and
        watchdog released) when the block ends. A dump whose collector
        serves in this process is an ``InProcessStream`` of its records."""
        address = job.spec.reference_dump.collector if golden else job.spec.collector
        local = in_process(address)
        if local is not None and (golden or job.spec.dump_path):
            request = pb.CaptureRequest(job_id=job.id, dump=job.spec.reference_dump.dump) if golden \
                else self._capture_request(job, local)
            if collector_request is not None:
                collector_request(request)
            if InProcessStream.serves(local, request):
                if on_ready is not None:
                    on_ready(local)
                inner = InProcessStream(local, request)
                job.call = inner
                try:
                    yield inner
                finally:
                    job.call = None
                    inner.close()
                return
        from layerdiff.collector.service import CollectorClient  # a collector over the network

        collector = CollectorClient(address)
        stream = None
        try:
            collector.wait_ready(stop=job.cancelled)
            if job.cancelled.is_set():
                raise _Cancelled()
            if on_ready is not None:
                on_ready(collector)
            if golden:
                request = pb.CaptureRequest(job_id=job.id, dump=job.spec.reference_dump.dump)
            else:
                request = self._capture_request(job, collector)
            if collector_request is not None:
                collector_request(request)
            stream = CollectorStream(collector, request)
            job.call = stream
            try:
                stream.open()
            except LayerdiffError:
                if job.cancelled.is_set():
                    raise _Cancelled() from None
                raise
            except pa.ArrowException:     # cancelled before the stream started
                raise _Cancelled() from None
            yield stream
        finally:
            job.call = None
            if stream is not None:
                stream.cancel()
                stream.close()
            collector.close()

    def _receive_golden(self, job: Job, p: Prepared) -> None:
        """Stream the golden dump into the job's spill directory, then fix
        the reference's sites and the aligner the device stream pairs by."""
        golden = p.reference
        assert isinstance(golden, DumpReference)    # p.golden: prepared with a DumpReference
        spec = job.spec
        where = f"reference dump {spec.reference_dump.dump.path!r} on collector {spec.reference_dump.collector}"
        job.emit(pb.REFERENCE, message=f"reading the {where}")
        golden.start(self.workdir / SPILL_DIR / job.id)
        limit = env_limit("LAYERDIFF_REFERENCE_DUMP_BYTES", REFERENCE_DUMP_BYTES_DEFAULT, size=True)
        assembler = TensorAssembler(pool=BufferPool())
        def read_order(collector: CollectorClient | Collector) -> None:
            if spec.reference_dump.dump.watch:
                return      # read as the runtime writes it: no order to ask for yet
            try:
                graph = collector.dump_graph(spec.reference_dump.dump)
            except LayerdiffError as e:    # the stream says what is wrong with the dump itself
                log.warning("the %s's execution order could not be read (%s)", where, e)
                return
            golden.read_order(graph.order_from, graph.order_unknown)

        try:
            with self._stream(job, golden=True, on_ready=read_order) as stream:
                if isinstance(stream, InProcessStream):     # read where it lies, in this process
                    for rec in stream.records():
                        self._take_golden(golden, rec, limit, where)
                else:
                    for batch in stream:
                        if job.cancelled.is_set():
                            break
                        for rec in assembler.feed(batch):
                            self._take_golden(golden, rec, limit, where)
                    if not job.cancelled.is_set():
                        for rec in assembler.finish():
                            self._take_golden(golden, rec, limit, where)
        except LayerdiffError as e:
            if job.cancelled.is_set():
                raise _Cancelled() from None
            raise (e if e.field == "reference_dump" else _about_golden(e, where)) from None
        if job.cancelled.is_set():
            raise _Cancelled()
        golden.seal()
        if not golden.tensors:
            raise LayerdiffError(f"the {where} holds no readable tensor ({golden.records} records): check the "
                                 "path on that collector's host and the reference dump's format",
                                 field="reference_dump")
        p.aligner = make_aligner(golden, spec.options, None)
        job.emit(pb.REFERENCE, nodes_total=len(golden.sites),
                 message=f"{golden.tensors} reference tensors read from the {where}")

    @staticmethod
    def _take_golden(golden: DumpReference, rec, limit: int, where: str) -> None:
        try:
            if rec.array is not None and golden.bytes + rec.array.nbytes > limit:
                raise LimitError(f"the {where} is larger than the analyzer takes, {limit} bytes "
                                 "(LAYERDIFF_REFERENCE_DUMP_BYTES)", field="reference_dump")
            golden.take(rec)
        finally:
            if rec.lease is not None:
                rec.lease.release()

    def _consume(self, job: Job, p: Prepared, stream, ref_future: Future, executor, rep: JobReport,
                 total: int, injected=None, budget: MemoryBudget = DEFAULT_BUDGET,
                 pool: BufferPool | None = None, details: DetailFiles | None = None) -> None:
        assembler = TensorAssembler(pool=pool if pool is not None else BufferPool())

        def progress(done: int, node: str, passed: bool) -> None:
            job.progress(done, total, node, passed)

        def references():
            while True:   # the reference runs on its own thread: a Cancel must not wait for it
                try:
                    return ref_future.result(timeout=0.2)
                except FutureTimeout:
                    if job.cancelled.is_set():
                        raise _Cancelled() from None

        consumer = StreamConsumer(p, executor, references, rep, job.report_dir, progress,
                                  dump_mode=check_dump_mode(job.spec.dump_mode), injected=injected, budget=budget,
                                  details=details)
        try:
            if isinstance(stream, InProcessStream):     # a dump read in this process: its records as read
                for rec in stream.records():
                    if job.state != pb.COMPARING:
                        job.emit(pb.COMPARING, nodes_done=consumer.done, nodes_total=total)
                    consumer.take(rec)
            else:
                for batch in stream:
                    if job.cancelled.is_set():
                        break
                    if not batch.num_rows:     # a heartbeat: the source is quiet, report what is finished
                        consumer.finish_done()
                        continue
                    if job.state != pb.COMPARING:
                        job.emit(pb.COMPARING, nodes_done=consumer.done, nodes_total=total)
                    for rec in assembler.feed(batch):
                        consumer.take(rec)
                if not job.cancelled.is_set():
                    for rec in assembler.finish():
                        consumer.take(rec)
            if not job.cancelled.is_set():
                consumer.finish()
        except BaseException:
            consumer.abandon()
            if job.cancelled.is_set():   # whatever a cancelled wait raised, the job was cancelled
                raise _Cancelled() from None
            raise
        if job.cancelled.is_set():
            consumer.abandon()
            raise _Cancelled()


class _Cancelled(Exception):
    pass


def _about_golden(e: LayerdiffError, where: str) -> LayerdiffError:
    """A collector's error about the golden dump, said of the reference dump
    (its fields are the device dump's names on the wire); the same class, so
    the exit status stays."""
    text = str(e).replace("field 'dump_path': ", "").replace("field 'dump_path'", "")
    out = LayerdiffError.__new__(type(e))
    LayerdiffError.__init__(out, f"{where}: {text}", field="reference_dump")
    return out


def reports_gone(job_id: str, root: Path) -> NotFoundError:
    return NotFoundError(f"the reports of job {job_id!r} are no longer on the analyzer ({root})", field="job_id")


def report_listing(root: Path) -> list[tuple[str, Path]]:
    """(path in the report, file) of every regular file under ``root``, in
    path order (one scandir a directory: a report holds hundreds of files)."""
    found: list[tuple[tuple[str, ...], str]] = []
    todo: list[tuple[str, tuple[str, ...]]] = [(str(root), ())]
    while todo:
        top, parts = todo.pop()
        try:
            with os.scandir(top) as it:
                for e in it:
                    # what each entry is comes with the listing: a look of
                    # its own only for a link (followed, as os.path.isfile)
                    if e.is_dir(follow_symlinks=False):
                        todo.append((e.path, (*parts, e.name)))
                    elif e.is_file():
                        found.append(((*parts, e.name), e.path))
        except OSError:
            continue        # as os.walk: a directory that cannot be listed is passed over
    found.sort(key=lambda item: item[0])
    return [("/".join(key), Path(path)) for key, path in found]
