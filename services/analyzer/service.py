"""The analyzer's gRPC service: upload artifacts, submit jobs, watch their
progress as a stream, fetch reports, cancel."""
from __future__ import annotations

import logging
import os
import tempfile
import threading
from pathlib import Path

from layerdiff import __version__
from layerdiff.analyzer.jobs.job import EventCursor
from layerdiff.analyzer.jobs.runner import JobRunner, reports_gone
from layerdiff.common.artifacts import ArtifactStore
from layerdiff.common.errors import LayerdiffError, PermissionDenied, abort_with
from layerdiff.common.memory import leave_loaded_out_of_collection, release_freed_tensors_to_system
from layerdiff.common.net import bind, make_server, serve_health
from layerdiff.common.security import ServerSecurity, grpc_identity, grpc_interceptors
from layerdiff.common.sizes import DEFAULT_CHUNK_BYTES
from layerdiff.v1 import layerdiff_pb2 as pb
from layerdiff.v1 import layerdiff_pb2_grpc as pbg

log = logging.getLogger(__name__)
READINESS_S = 5.0
# the slowest pace of node progress a watcher may ask for
MAX_PROGRESS_EVERY_MS = 60_000


class AnalyzerService(pbg.AnalyzerServicer):
    def __init__(self, workdir: Path, broker_url: str | None = None,
                 security: ServerSecurity | None = None) -> None:
        self.workdir = Path(workdir)
        self.security = security or ServerSecurity()
        self.store = ArtifactStore(self.workdir / "artifacts")
        self.runner = JobRunner(self.store, self.workdir / "jobs", broker_url)

    def _job(self, job_id: str, context):
        """The job, if the caller's token submitted it (or is an admin token)."""
        job = self.runner.get(job_id)
        if not grpc_identity(self.security, context).may_read(job.owner):
            raise PermissionDenied(f"job {job_id} was submitted with another token", field="job_id")
        return job

    def Health(self, request, context):
        return pb.HealthReply(service="analyzer", version=__version__, status="SERVING")

    def PutArtifact(self, request_iterator, context):
        try:
            return self.store.receive(request_iterator)
        except Exception as e:
            abort_with(context, e)

    def Submit(self, request, context):
        try:
            job = self.runner.submit(request, owner=grpc_identity(self.security, context).owner)
        except Exception as e:
            if not isinstance(e, LayerdiffError):
                log.exception("submit failed")
            abort_with(context, e)
        return pb.JobRef(job_id=job.id)

    def Watch(self, request, context):
        try:
            job = self._job(request.job_id, context)
        except Exception as e:
            abort_with(context, e)
        cursor = EventCursor(job, min(request.progress_every_ms, MAX_PROGRESS_EVERY_MS) / 1000)
        while context.is_active():
            got = cursor.next(context.is_active)
            if got is None:
                return
            batch, finished = got
            yield from batch
            if finished:
                return

    def report_files(self, job_id: str, context=None) -> list[tuple[str, Path]]:
        """(path in the report, file) of every file of a DONE job's report
        (``context``: the caller's, whose token must have submitted it; None
        in this process: the embedded client's own job)."""
        if context is not None:
            self._job(job_id, context)
        return self.runner.report_files(job_id)

    def FetchReport(self, request, context):
        try:
            files = self.report_files(request.job_id, context)
        except Exception as e:
            abort_with(context, e)
        for rel, path in files:
            try:
                f = open(path, "rb")
            except FileNotFoundError:   # deleted under retention while being fetched
                abort_with(context, reports_gone(request.job_id, path.parent))
            with f:
                offset = 0
                while True:
                    data = f.read(DEFAULT_CHUNK_BYTES)
                    last = len(data) < DEFAULT_CHUNK_BYTES
                    yield pb.ReportChunk(path=rel, offset=offset, data=data, last=last)
                    offset += len(data)
                    if last:
                        break

    def Cancel(self, request, context):
        try:
            self._job(request.job_id, context)
            job = self.runner.cancel(request.job_id)
        except Exception as e:
            abort_with(context, e)
        return pb.JobEvent(job_id=job.id, state=job.state)


class AnalyzerServer:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, workdir: str | Path | None = None,
                 broker_url: str | None = None, security: ServerSecurity | None = None,
                 readiness: bool = True) -> None:
        """``broker_url`` (default: LAYERDIFF_BROKER_URL) sends comparisons to
        Celery workers; without one they run on the local pool. ``security``
        (default: from LAYERDIFF_TOKEN_FILE, LAYERDIFF_TLS_*): TLS and tokens;
        a non-loopback host without them is refused unless LAYERDIFF_INSECURE=1.
        ``readiness``: keep grpc.health.v1 true (a served analyzer); False for
        one started inside a command, which nobody asks (it then says
        SERVING, and loads no runtime to check)."""
        security = security if security is not None else ServerSecurity.from_env()
        security.check_exposure(host, "analyzer API")
        if broker_url is None:
            broker_url = os.environ.get("LAYERDIFF_BROKER_URL") or None
        if broker_url:       # where workers will fetch large tensors: decided (and checked) now
            from layerdiff.analyzer.execute.store import configure_tensor_endpoint

            configure_tensor_endpoint(broker_url)
        release_freed_tensors_to_system()
        self._tmp = None
        if workdir is None:
            # what a job cancelled at the very end still writes must not fail the stop
            self._tmp = tempfile.TemporaryDirectory(prefix="layerdiff-analyzer-", ignore_cleanup_errors=True)
            workdir = self._tmp.name
        self.service = AnalyzerService(Path(workdir), broker_url, security)
        self.server = make_server(interceptors=grpc_interceptors(security))
        pbg.add_AnalyzerServicer_to_server(self.service, self.server)
        self.health = serve_health(self.server)
        self.port = bind(self.server, host, port, security)
        self.address = f"{host}:{self.port}"
        self.broker_url = broker_url
        self._runtime: str | None = None     # why no model can run here ('' when one can), once known
        self._stopping = threading.Event()
        self.server.start()
        leave_loaded_out_of_collection()
        if readiness:
            threading.Thread(target=self._readiness, name="analyzer-readiness", daemon=True).start()
        else:
            from grpc_health.v1 import health_pb2

            self.health.set("", health_pb2.HealthCheckResponse.SERVING)

    def ready(self) -> str:
        """'' when the analyzer can take jobs, else why not: it can run a
        reference model (checked once: the runtime does not come and go),
        and reach its broker when it has one (checked each time)."""
        if self._runtime is None:
            from layerdiff.common.onnxgraph import runtime_ready

            self._runtime = runtime_ready()
        if self._runtime:
            return self._runtime
        if self.broker_url:
            from layerdiff.analyzer.execute.store import TensorStore

            try:
                with TensorStore(self.broker_url) as store:
                    store.ping()
            except Exception as e:
                return f"broker unreachable ({type(e).__name__})"
        return ""

    def _readiness(self) -> None:
        """Keeps grpc.health.v1 true: NOT_SERVING while not ready (checked
        every READINESS_S seconds)."""
        from grpc_health.v1 import health_pb2

        last = None
        while not self._stopping.is_set():
            why = self.ready()
            status = health_pb2.HealthCheckResponse.NOT_SERVING if why else health_pb2.HealthCheckResponse.SERVING
            if status != last and not self._stopping.is_set():
                self.health.set("", status)
                if why:
                    log.warning("analyzer not ready: %s", why)
                last = status
            self._stopping.wait(READINESS_S)

    def stop(self, grace: float | None = 1.0) -> None:
        self._stopping.set()
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()
        if self._tmp is not None:
            self.service.runner.stop()
            self._tmp.cleanup()

    def wait(self) -> None:
        self.server.wait_for_termination()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
