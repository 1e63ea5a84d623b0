"""The collector's side of a capture, apart from how it is served: a dump
read, or a model run as the device, as records; the graph a dump's manifest
describes; the artifacts uploaded to it. Its Flight server
(``layerdiff.collector.service``) speaks for it over the network; a command
that compares two dumps reads them through one in its own process, with no
socket (``in_process``).
"""
from __future__ import annotations

import itertools
import logging
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from layerdiff.collector.dumps.directory import DumpDirectory
from layerdiff.collector.dumps.roots import DumpRoots
from layerdiff.common.artifacts import ArtifactStore
from layerdiff.common.errors import LayerdiffError
from layerdiff.common.onnxgraph import PARSED, load_inputs, load_model, runtime_ready, without_weight_data
from layerdiff.common.schema import NodeRecord
from layerdiff.common.tf.format import is_tensorflow, onnx_by_name
from layerdiff.v1 import layerdiff_pb2 as pb

if TYPE_CHECKING:
    import onnx

    from layerdiff.common.perfschema import PerfRecord
else:
    from layerdiff.common.lazy import onnx

log = logging.getLogger(__name__)


class Collector:
    """A collector's captures and artifacts (its Flight server, when it has
    one, is ``service.CollectorFlight``)."""

    def __init__(self, workdir: Path, roots: DumpRoots | None = None, check_runtime: bool = True) -> None:
        """``check_runtime``: whether onnxruntime can run a model here is
        checked now (a served collector says so as it starts), else when
        its health is first asked (one started inside a command: a dump
        read needs no runtime, and loading it costs a tenth of a second)."""
        self.store = ArtifactStore(Path(workdir) / "artifacts")
        self.roots = roots or DumpRoots(None, local=True)
        self._status: str | None = None
        self._status_lock = threading.Lock()
        if check_runtime:
            _ = self.status

    @property
    def status(self) -> str:
        """SERVING, or NOT_SERVING where no model can run (checked once)."""
        with self._status_lock:
            if self._status is None:
                why = runtime_ready()
                self._status = "NOT_SERVING" if why else "SERVING"
                if why:
                    log.warning("collector not ready: %s", why)
            return self._status

    def _confined(self, d: pb.DumpSource) -> pb.DumpSource:
        """The dump source with its path checked against the dump roots."""
        confined = pb.DumpSource()
        confined.CopyFrom(d)
        confined.path = self.roots.check(d.path)
        return confined

    # -------------------------------------------------------------- capture
    def source(self, request: pb.CaptureRequest) -> Iterator[NodeRecord]:
        kind = request.WhichOneof("source")
        if kind == "dump":
            d = self._confined(request.dump)
            if d.watch:
                from layerdiff.collector.dumps.watch import watch_records

                return watch_records(d.path, fmt=d.format, default_concat_dim=d.default_concat_dim,
                                     idle_s=d.idle_timeout_s or 10.0)
            return self._listing(d).records()
        if kind == "live":
            return self._live_runner(request.live).records(request.live.dump_mode or "output")
        raise LayerdiffError("capture request names no source (live or dump)", field="source")

    def _live_runner(self, live: pb.LiveSource):
        feeds = load_inputs(self.store.read(live.inputs_artifact, "inputs_artifact"),
                            self.store.name(live.inputs_artifact))
        model_name = self.store.name(live.model_artifact)
        device_model_name = self.store.name(live.device_model_artifact) if live.device_model_artifact \
            else "device.onnx"
        device_onnx = bool(live.device_model_artifact) and onnx_by_name(device_model_name)
        # ONNX models as an embedded analyzer parsed them (onnxgraph.PARSED:
        # read, never changed), else parsed here
        model: bytes | onnx.ModelProto
        ref = None
        if onnx_by_name(model_name):
            ref = PARSED.hold(live.model_artifact, lambda: load_model(
                self.store.read(live.model_artifact, "model_artifact"), model_name))
            if device_onnx:
                # of the reference, only its inputs are read: its weights go
                # before the device model's are read
                model, ref = without_weight_data(ref.model, keep=False)[0], None
            else:
                model = ref.model
        else:
            data = self.store.read(live.model_artifact, "model_artifact")
            model = data
            if device_onnx and not is_tensorflow(model_name, data):
                model = without_weight_data(load_model(data, model_name), keep=False)[0]
            del data
        device_model: bytes | onnx.ModelProto | None = None
        held = None     # until the runner has taken the device model's weights
        if device_onnx:
            held = PARSED.hold(live.device_model_artifact, lambda: load_model(
                self.store.read(live.device_model_artifact, "device_model_artifact"), device_model_name))
            device_model = held.model
        elif live.device_model_artifact:
            device_model = self.store.read(live.device_model_artifact, "device_model_artifact")
        runner = _live_runner(model, feeds, live, model_name, device_model, device_model_name, live.model_artifact)
        del held, ref       # the runner holds what it runs
        return runner

    def perf_source(self, request: pb.CaptureRequest) -> Iterator[PerfRecord]:
        """Performance records: the dump's counter files, or the device model
        run whole under onnxruntime's profiler."""
        from layerdiff.collector.live.onnxrt import LiveRunner
        from layerdiff.collector.live.profile import profile_model
        from layerdiff.collector.perf.counters import dump_perf_records

        kind = request.WhichOneof("source")
        if kind == "dump":
            return dump_perf_records(self._confined(request.dump).path)
        if kind == "live":
            runner = self._live_runner(request.live)
            if not isinstance(runner, LiveRunner):
                raise LayerdiffError("performance data of a live run comes from onnxruntime's profiler; for a "
                                     "TensorFlow model give the runtime's counter files as a dump", field="perf")
            return profile_model(runner.weights, runner.feeds, runner.providers, runs=request.perf.runs,
                                 graph_optimization=request.perf.graph_optimization)
        raise LayerdiffError("capture request names no source (live or dump)", field="source")

    def dump_graph(self, source: pb.DumpSource) -> pb.DeviceGraph:
        """The graph the dump's manifest describes (empty if none)."""
        from layerdiff.collector.dumps.graph import dump_graph

        d = self._confined(source)
        return dump_graph(d, self._listing(d, keep=True))

    def _listing(self, d: pb.DumpSource, keep: bool = False) -> DumpDirectory:
        """The dump ``d`` (confined) listed, and its order read. A served
        collector lists it for each call: its files may change between two
        (a dump written again between two jobs)."""
        return DumpDirectory(d.path, fmt=d.format, default_concat_dim=d.default_concat_dim)


def _live_runner(model: bytes | onnx.ModelProto, feeds, live: pb.LiveSource, model_name: str,
                 device_model: bytes | onnx.ModelProto | None, device_model_name: str, model_key: str = ""):
    """The runner for the file that runs as the device: TensorFlow models on
    TensorFlow (imported only then), ONNX ones on onnxruntime. A device model
    is run whatever the reference is (a TensorFlow network converted to ONNX,
    say). ``model``: the reference's bytes, or its parsed ONNX graph."""
    precision, device = live.precision or "fp32", live.device or "cpu"
    ref_tf = isinstance(model, bytes) and is_tensorflow(model_name, model)
    runs_tf = isinstance(device_model, bytes) and is_tensorflow(device_model_name, device_model) \
        if device_model is not None else ref_tf
    if runs_tf:
        from layerdiff.collector.live.tf import TFLiveRunner

        assert isinstance(model, bytes) and not isinstance(device_model, onnx.ModelProto)  # parsed: ONNX only
        return TFLiveRunner(model, feeds, precision=precision, device=device, device_model_bytes=device_model,
                            model_name=model_name, device_model_name=device_model_name, signature=live.signature)
    if device_model is not None and ref_tf:
        # The reference is TensorFlow: the ONNX device model stands in for it.
        model, model_name = device_model, device_model_name
    from layerdiff.collector.live.onnxrt import LiveRunner

    return LiveRunner(model, feeds, precision=precision, device=device, device_model_bytes=device_model,
                      model_name=model_name, device_model_name=device_model_name, model_key=model_key)


# The collectors serving in this process, by address (from their start to
# their stop): an analyzer of this process reads a dump through the one it
# names directly (``in_process``), not through its own socket.
_IN_PROCESS: dict[str, Collector] = {}
_IN_PROCESS_LOCK = threading.Lock()


def in_process(address: str) -> Collector | None:
    """The collector serving ``address`` in this process, if one does."""
    with _IN_PROCESS_LOCK:
        return _IN_PROCESS.get(address)


def serve_in_process(address: str, collector: Collector | None) -> None:
    """``collector`` answers for ``address`` in this process (None: it no
    longer does)."""
    with _IN_PROCESS_LOCK:
        if collector is None:
            _IN_PROCESS.pop(address, None)
        else:
            _IN_PROCESS[address] = collector


_SERIAL = itertools.count(1)


class InProcessCollector(Collector):
    """A collector that only this process reads, through ``in_process``
    (no server: a command comparing two dumps, whose records it hands over),
    in a work directory of its own; its address names it there alone.
    Registered from its start to ``stop``; use as a context manager."""

    def __init__(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="layerdiff-collector-", ignore_cleanup_errors=True)
        super().__init__(Path(self._tmp.name), DumpRoots(None, local=True), check_runtime=False)
        self.address = f"in-process:{next(_SERIAL)}"
        # a dump listed for its graph (its execution order), kept for its
        # records: a job asks for the one, then the other, and a listing of
        # a dump without a manifest looks at every file's time (two would
        # cost a thousand system calls more, and could disagree)
        self._listed: dict[bytes, DumpDirectory] = {}
        serve_in_process(self.address, self)

    def _listing(self, d: pb.DumpSource, keep: bool = False) -> DumpDirectory:
        key = d.SerializeToString(deterministic=True)
        listed = self._listed.pop(key, None)
        if listed is None:
            listed = super()._listing(d)
        if keep:
            self._listed[key] = listed
        return listed

    def stop(self) -> None:
        serve_in_process(self.address, None)
        self._listed.clear()
        self._tmp.cleanup()

    def __enter__(self) -> InProcessCollector:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
