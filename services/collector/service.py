"""The collector's gRPC service: health, artifact upload, and Capture, which
streams every node tensor of a live run or of a dump on this host."""
from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Iterator

import grpc

from layerdiff import __version__
from layerdiff.artifacts import ArtifactStore
from layerdiff.collector.dumpdir import DumpDirectory
from layerdiff.collector.live import LiveRunner
from layerdiff.errors import LayerdiffError, abort_with
from layerdiff.net import DEFAULT_CHUNK_BYTES, MAX_MESSAGE_BYTES, bind, make_server
from layerdiff.onnxgraph import load_inputs
from layerdiff.schema import NodeRecord, encode_records
from layerdiff.v1 import layerdiff_pb2 as pb

log = logging.getLogger(__name__)
SERVICE = "layerdiff.v1.Collector"


def _identity(b: bytes) -> bytes:
    return b


class CollectorService:
    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        self.store = ArtifactStore(self.workdir / "artifacts")

    def Health(self, request, context):
        return pb.HealthReply(service="collector", version=__version__, status="SERVING")

    def PutArtifact(self, request_iterator, context):
        try:
            return self.store.receive(request_iterator)
        except Exception as e:
            abort_with(context, e)

    def source(self, request: pb.CaptureRequest) -> Iterator[NodeRecord]:
        kind = request.WhichOneof("source")
        if kind == "dump":
            return DumpDirectory(request.dump.path).records()
        if kind == "live":
            live = request.live
            model = self.store.read(live.model_artifact, "model_artifact")
            feeds = load_inputs(self.store.read(live.inputs_artifact, "inputs_artifact"),
                                self.store.name(live.inputs_artifact))
            device_model = self.store.read(live.device_model_artifact, "device_model_artifact") \
                if live.device_model_artifact else None
            runner = LiveRunner(model, feeds, precision=live.precision or "fp32", device=live.device or "cpu",
                                device_model_bytes=device_model,
                                model_name=self.store.name(live.model_artifact),
                                device_model_name=self.store.name(live.device_model_artifact)
                                if live.device_model_artifact else "device.onnx")
            return runner.records()
        raise LayerdiffError("capture request names no source (live or dump)", field="source")

    def Capture(self, request, context):
        chunk = request.max_chunk_bytes or DEFAULT_CHUNK_BYTES
        if chunk > MAX_MESSAGE_BYTES // 2:
            chunk = MAX_MESSAGE_BYTES // 2
        try:
            records = self.source(request)
            # Pull the first record eagerly so that set-up errors (bad model,
            # bad inputs) become the RPC's status, not a half-open stream.
            first = next(records, None)
        except Exception as e:
            log.warning("capture %s refused: %s", request.job_id, e)
            abort_with(context, e)
            return

        def chained():
            if first is not None:
                yield first
            yield from records

        try:
            yield from encode_records(chained(), chunk)
        except Exception as e:
            log.exception("capture %s failed", request.job_id)
            abort_with(context, e)


def add_to_server(server: grpc.Server, svc: CollectorService) -> None:
    handlers = {
        "Health": grpc.unary_unary_rpc_method_handler(
            svc.Health, request_deserializer=pb.HealthRequest.FromString,
            response_serializer=pb.HealthReply.SerializeToString),
        "PutArtifact": grpc.stream_unary_rpc_method_handler(
            svc.PutArtifact, request_deserializer=pb.ArtifactChunk.FromString,
            response_serializer=pb.ArtifactRef.SerializeToString),
        # TensorBatch messages are framed by layerdiff.schema, already in wire format.
        "Capture": grpc.unary_stream_rpc_method_handler(
            svc.Capture, request_deserializer=pb.CaptureRequest.FromString, response_serializer=_identity),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


class CollectorServer:
    """A running collector; use as a context manager or call stop()."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, workdir: str | Path | None = None) -> None:
        self._tmp = None
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="layerdiff-collector-")
            workdir = self._tmp.name
        self.service = CollectorService(Path(workdir))
        self.server = make_server()
        add_to_server(self.server, self.service)
        self.port = bind(self.server, host, port)
        self.address = f"{host}:{self.port}"
        self.server.start()

    def stop(self, grace: float | None = 1.0) -> None:
        self.server.stop(grace).wait()
        if self._tmp is not None:
            self._tmp.cleanup()

    def wait(self) -> None:
        self.server.wait_for_termination()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class CollectorClient:
    """Client side of the collector API."""

    def __init__(self, channel: grpc.Channel) -> None:
        from layerdiff.v1 import layerdiff_pb2_grpc as pbg

        self.channel = channel
        self.stub = pbg.CollectorStub(channel)
        self._capture = channel.unary_stream(f"/{SERVICE}/Capture",
                                             request_serializer=pb.CaptureRequest.SerializeToString,
                                             response_deserializer=_identity)

    def capture(self, request: pb.CaptureRequest, timeout: float | None = None):
        """Returns the call: iterate it for raw TensorBatch messages; cancel() stops it."""
        return self._capture(request, timeout=timeout)


