"""The collector service, spoken as Arrow Flight (gRPC) so that tensor bytes
move from the mapped dump file or the runtime's buffer onto the wire without
a Python-side copy.

- ``DoGet(Ticket = layerdiff.v1.CaptureRequest bytes)``: the tensor stream,
  record batches of ``layerdiff.common.schema.TENSOR_SCHEMA``; with
  ``stream = CAPTURE_STREAM_PERF`` the performance stream of the same source,
  record batches of ``layerdiff.common.perfschema.PERF_SCHEMA``.
- ``DoPut(descriptor path ["artifact", NAME])``: upload one file as batches of
  one binary column; the reply's metadata is a ``layerdiff.v1.ArtifactRef``.
- ``DoAction("health")``: a ``layerdiff.v1.HealthReply``.
- ``DoAction("dump_graph", DumpSource bytes)``: the ``layerdiff.v1.DeviceGraph``
  the dump's manifest describes (see ``layerdiff.collector.dumps.graph``).

User errors travel as INVALID_ARGUMENT (or NOT_FOUND) with the message of the
LayerdiffError, which names the file, node or field.
"""
from __future__ import annotations

import logging
import os
import re
import tempfile
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from layerdiff import __version__
from layerdiff.collector.core import Collector, serve_in_process
from layerdiff.collector.dumps.roots import DumpRoots
from layerdiff.collector.stream import DEFAULT_HEARTBEAT_S, OutgoingStream
from layerdiff.common.errors import LayerdiffError, NotFoundError, PermissionDenied, Unauthenticated, UnavailableError
from layerdiff.common.memory import release_freed_tensors_to_system
from layerdiff.common.onnxgraph import runtime_ready
from layerdiff.common.perfschema import PERF_SCHEMA, PerfEncoder
from layerdiff.common.schema import TENSOR_SCHEMA, RecordEncoder
from layerdiff.common.security import ClientSecurity, ServerSecurity, flight_middleware, is_loopback
from layerdiff.common.sizes import DEFAULT_CHUNK_BYTES, MAX_MESSAGE_BYTES
from layerdiff.v1 import layerdiff_pb2 as pb

log = logging.getLogger(__name__)

ARTIFACT_SCHEMA = pa.schema([("data", pa.binary())])
HEALTH = "health"
DUMP_GRAPH = "dump_graph"
HAS_ARTIFACT = "has_artifact"


def _to_flight_error(e: BaseException) -> Exception:
    if isinstance(e, NotFoundError):
        return KeyError(str(e))   # Flight maps KeyError to NOT_FOUND
    if isinstance(e, PermissionDenied):
        return flight.FlightUnauthorizedError(str(e))
    if isinstance(e, LayerdiffError):
        return pa.ArrowInvalid(str(e))
    return flight.FlightServerError(f"internal error: {type(e).__name__}: {e}")


class CollectorFlight(Collector, flight.FlightServerBase):
    def __init__(self, location: str, workdir: Path, security: ServerSecurity | None = None,
                 roots: DumpRoots | None = None, check_runtime: bool = True) -> None:
        """A collector served as Arrow Flight at ``location`` (see Collector
        for ``check_runtime``)."""
        security = security or ServerSecurity()
        flight.FlightServerBase.__init__(self, location, middleware=flight_middleware(security),
                                         **security.flight_kwargs())
        Collector.__init__(self, workdir, roots, check_runtime)

    def do_get(self, context, ticket):
        try:
            request = pb.CaptureRequest.FromString(ticket.ticket)
        except Exception as e:
            raise pa.ArrowInvalid(f"ticket is not a layerdiff.v1.CaptureRequest: {e}") from None
        heartbeat_s = request.heartbeat_ms / 1000.0 if request.heartbeat_ms else DEFAULT_HEARTBEAT_S
        if request.stream == pb.CAPTURE_STREAM_PERF:
            stream = OutgoingStream(f"perf capture {request.job_id}", PERF_SCHEMA, lambda: self.perf_source(request),
                                    PerfEncoder, _to_flight_error, heartbeat_s, context)
        else:
            chunk = min(request.max_chunk_bytes or DEFAULT_CHUNK_BYTES, MAX_MESSAGE_BYTES // 2)
            stream = OutgoingStream(f"capture {request.job_id}", TENSOR_SCHEMA, lambda: self.source(request),
                                    lambda: RecordEncoder(chunk), _to_flight_error, heartbeat_s, context)
        return stream.start()

    # ------------------------------------------------------------ artifacts
    def do_put(self, context, descriptor, reader, writer):
        path = [p.decode("utf-8", "replace") if isinstance(p, bytes) else p for p in (descriptor.path or [])]
        if len(path) != 2 or path[0] != "artifact":
            raise pa.ArrowInvalid("DoPut descriptor must be the path ['artifact', NAME]")
        name = path[1]

        def chunks():
            first = True
            for chunk in reader:
                col = chunk.data.column(0)
                for i in range(len(col)):
                    data = col[i].as_buffer()
                    piece = data.to_pybytes() if data is not None else b""
                    if first:
                        meta = chunk.app_metadata
                        total = int(meta.to_pybytes()) if meta is not None and meta.size else -1
                        yield pb.ArtifactChunk(name=name, total_size=total, data=piece)
                        first = False
                    else:
                        yield pb.ArtifactChunk(data=piece)
            if first:
                yield pb.ArtifactChunk(name=name, total_size=0, data=b"")

        try:
            ref = self.store.receive(chunks())
        except Exception as e:
            raise _to_flight_error(e) from None
        writer.write(pa.py_buffer(ref.SerializeToString()))

    # -------------------------------------------------------------- actions
    def list_actions(self, context):
        return [(HEALTH, "layerdiff.v1.HealthReply of this collector"),
                (DUMP_GRAPH, "layerdiff.v1.DeviceGraph of a dump's manifest (body: layerdiff.v1.DumpSource)"),
                (HAS_ARTIFACT, "b'1' when the artifact (body: its id) is stored here, else b''")]

    def do_action(self, context, action):
        if action.type == DUMP_GRAPH:
            return [flight.Result(self._dump_graph(action.body.to_pybytes()).SerializeToString())]
        if action.type == HAS_ARTIFACT:
            held = self.store.has(action.body.to_pybytes().decode("ascii", "replace"))
            return [flight.Result(b"1" if held else b"")]
        if action.type != HEALTH:
            raise KeyError(f"unknown action {action.type!r}")
        return [flight.Result(pb.HealthReply(service="collector", version=__version__,
                                             status=self.status).SerializeToString())]

    def _dump_graph(self, body: bytes) -> pb.DeviceGraph:
        try:
            source = pb.DumpSource.FromString(body)
        except Exception as e:
            raise pa.ArrowInvalid(f"action body is not a layerdiff.v1.DumpSource: {e}") from None
        try:
            return self.dump_graph(source)
        except Exception as e:
            raise _to_flight_error(e) from None


# how long a collector stopped by an error or Ctrl-C waits for its capture
STOP_GRACE_S = 0.2


class CollectorServer:
    """A running collector; use as a context manager or call stop()."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, workdir: str | Path | None = None,
                 security: ServerSecurity | None = None, dump_roots: str | None = None,
                 health_port: int | None = None, check_runtime: bool = True) -> None:
        """``security`` (default: from LAYERDIFF_TOKEN_FILE, LAYERDIFF_TLS_*):
        TLS and tokens, required on a non-loopback host unless
        LAYERDIFF_INSECURE=1. ``dump_roots`` (default LAYERDIFF_DUMP_ROOTS,
        ``:``-separated): the only directories dumps are read from; without
        any, a collector on loopback reads any path and one on the network none.
        ``health_port`` (default LAYERDIFF_HEALTH_PORT): also serve
        grpc.health.v1 there (a Flight endpoint cannot carry it), with the
        same TLS; ``layerdiff health`` asks either. ``check_runtime``: see
        CollectorFlight (False for one started inside a command)."""
        security = security if security is not None else ServerSecurity.from_env()
        security.check_exposure(host, "collector")
        roots = DumpRoots.from_env(dump_roots, local=is_loopback(host))
        release_freed_tensors_to_system()
        self._tmp = None
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="layerdiff-collector-", ignore_cleanup_errors=True)
            workdir = self._tmp.name
        # A Flight server answers from its construction. Its serve() is not
        # called: it would take SIGINT over, and shut down on Ctrl-C only
        # once the capture under way had ended, before the process saw it.
        self.flight = CollectorFlight(f"{security.flight_scheme()}://{host}:{port}", Path(workdir), security, roots,
                                      check_runtime=check_runtime or health_port is not None)
        self.port = self.flight.port
        self.address = f"{host}:{self.port}"
        serve_in_process(self.address, self.flight)
        self._stopped = threading.Event()
        self.health = None
        if health_port is None and os.environ.get("LAYERDIFF_HEALTH_PORT", "").strip():
            health_port = int(os.environ["LAYERDIFF_HEALTH_PORT"])
        if health_port is not None:
            from grpc_health.v1 import health_pb2

            from layerdiff.common.net import bind, make_server, serve_health

            self._health_server = make_server(max_workers=2)
            self.health = serve_health(self._health_server)
            if runtime_ready():     # no device runs here: not ready
                self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            self.health_port = bind(self._health_server, host, health_port, security)
            self._health_server.start()

    def stop(self, grace: float | None = None) -> None:
        """Stop serving and remove the work directory it made. ``grace``:
        wait that long at most for a capture under way (a device run cannot
        be broken off mid-run) to see its stream closed and end; None: wait
        for it."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        serve_in_process(self.address, None)
        if self.health is not None:
            self.health.enter_graceful_shutdown()
            self._health_server.stop(1.0)
        closing = threading.Thread(target=self.flight.shutdown, name="collector-shutdown", daemon=True)
        closing.start()
        closing.join(grace)
        if self._tmp is not None:
            self._tmp.cleanup()     # what a capture still running reads, it has read already

    def wait(self) -> None:
        while not self._stopped.wait(1.0):
            pass

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        # a command broken off (Ctrl-C, a failed job) does not wait for the
        # device run under way to finish before it answers
        self.stop(grace=None if exc_type is None else STOP_GRACE_S)


_DETAIL = re.compile(r"\.? ?(\n\. )?(Detail|gRPC client debug context|Client context):", re.S)


def flight_message(e: BaseException) -> str:
    """The server's own message, without the transport's debug trailer."""
    text = str(e)
    m = _DETAIL.search(text)
    text = text[:m.start()] if m else text
    # NOT_FOUND travels as a KeyError, whose text is its message quoted
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    return text


class CollectorClient:
    """Client side of the collector; every call carries a deadline."""

    def __init__(self, address: str, timeout: float = 600.0, security: ClientSecurity | None = None) -> None:
        """``security`` (default: LAYERDIFF_TOKEN, LAYERDIFF_TLS_CA...): the
        token sent on every call, and TLS when a CA is known."""
        self.address = address
        self.timeout = timeout
        self.security = security if security is not None else ClientSecurity.from_env()
        self.client = flight.connect(self.security.flight_location(address), **self.security.flight_connect_kwargs())

    def _options(self, timeout: float | None = None) -> flight.FlightCallOptions:
        return flight.FlightCallOptions(timeout=timeout or self.timeout, headers=self.security.flight_headers())

    def health(self, timeout: float = 10.0) -> pb.HealthReply:
        try:
            results = list(self.client.do_action(flight.Action(HEALTH, b""), self._options(timeout)))
        except (flight.FlightUnauthenticatedError, flight.FlightUnauthorizedError) as e:
            raise Unauthenticated(f"collector {self.address} refused this token ({flight_message(e)}); set "
                                  "LAYERDIFF_TOKEN to one the collector accepts", field="collector") from None
        except flight.FlightUnavailableError as e:
            hint = "" if self.security.tls else " (if it serves TLS, give its CA in LAYERDIFF_TLS_CA)"
            raise UnavailableError(f"collector {self.address} is not reachable{hint}", field="collector") from e
        return pb.HealthReply.FromString(results[0].body.to_pybytes())

    def dump_graph(self, source: pb.DumpSource, timeout: float = 60.0) -> pb.DeviceGraph:
        """The graph the dump's manifest describes (empty if none)."""
        try:
            results = list(self.client.do_action(flight.Action(DUMP_GRAPH, source.SerializeToString()),
                                                 self._options(timeout)))
        except flight.FlightUnavailableError as e:
            raise UnavailableError(f"collector {self.address} is not reachable", field="collector") from e
        except pa.ArrowException as e:
            raise LayerdiffError(f"collector could not read the dump's graph: {flight_message(e)}",
                                 field="dump_path") from None
        return pb.DeviceGraph.FromString(results[0].body.to_pybytes()) if results else pb.DeviceGraph()

    def has_artifact(self, artifact_id: str, timeout: float = 10.0) -> bool:
        """Does the collector store this artifact already (a model sent for an
        earlier job)? False also where the collector cannot tell."""
        try:
            results = list(self.client.do_action(flight.Action(HAS_ARTIFACT, artifact_id.encode("ascii")),
                                                 self._options(timeout)))
        except pa.ArrowException:
            return False
        return bool(results) and results[0].body.to_pybytes() == b"1"

    def wait_ready(self, timeout: float = 15.0, stop: threading.Event | None = None) -> None:
        """Wait for the collector to answer its health check; gives up early
        when ``stop`` is set (the job was cancelled)."""
        import time

        end = time.monotonic() + timeout
        while True:
            try:
                self.health(timeout=2.0)
                return
            except (UnavailableError, flight.FlightError):
                if time.monotonic() > end:
                    hint = "" if self.security.tls else " (if it serves TLS, give its CA in LAYERDIFF_TLS_CA)"
                    raise UnavailableError(f"collector {self.address} is not reachable{hint}",
                                           field="collector") from None
                if stop is None:
                    time.sleep(0.1)
                elif stop.wait(0.1):
                    return

    def upload(self, data: bytes, name: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
               timeout: float | None = None) -> str:
        """Send one file; ``timeout`` bounds the whole upload (default: the
        client's timeout)."""
        writer, reader = self.client.do_put(flight.FlightDescriptor.for_path("artifact", name), ARTIFACT_SCHEMA,
                                            self._options(timeout))
        view = memoryview(data)
        try:
            for off in range(0, max(len(data), 1), chunk_bytes):
                piece = pa.py_buffer(view[off:off + chunk_bytes])
                batch = pa.RecordBatch.from_arrays(
                    [pa.Array.from_buffers(pa.binary(), 1, [None, pa.py_buffer(
                        np.array([0, piece.size], np.int32)), piece])], schema=ARTIFACT_SCHEMA)
                if off == 0:
                    writer.write_with_metadata(batch, pa.py_buffer(str(len(data)).encode()))
                else:
                    writer.write_batch(batch)
            writer.done_writing()
            meta = reader.read()
            writer.close()
        except (flight.FlightUnavailableError, flight.FlightTimedOutError) as e:
            raise UnavailableError(f"collector {self.address} did not take the upload: {flight_message(e)}",
                                   file=name, field="collector") from None
        except pa.ArrowException as e:
            raise LayerdiffError(f"collector refused the upload: {flight_message(e)}", file=name) from None
        return pb.ArtifactRef.FromString(meta.to_pybytes()).id

    def capture(self, request: pb.CaptureRequest, timeout: float | None = None) -> flight.FlightStreamReader:
        """The tensor stream; iterate ``read_chunk()`` / the reader, ``cancel()`` stops it.

        No deadline unless ``timeout`` is given: a stream lasts as long as its
        source, and its liveness is watched by the receiver (heartbeats, see
        ``layerdiff.collector.stream``)."""
        headers = self.security.flight_headers()
        options = flight.FlightCallOptions(timeout=timeout, headers=headers) if timeout else \
            flight.FlightCallOptions(headers=headers)
        return self.client.do_get(flight.Ticket(request.SerializeToString()), options)

    def close(self) -> None:
        """Close the connection (idempotent). A stream reader ``capture``
        handed out holds its gRPC call, and the call holds the channel: the
        TCP connection ends only once every such reader is let go as well.
        pyarrow offers no ``close()`` on a reader (``cancel()`` does not
        release it), so whoever keeps a reader must drop it, at the latest
        when closing the client."""
        self.client.close()
