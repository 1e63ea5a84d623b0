"""Live capture of TensorFlow models: the same records() contract as
LiveRunner (every op output in execution order, computed segment by
segment), on TensorFlow.

Precisions: ``fp32`` runs the model as given; ``fp16`` rebuilds a Keras
model under the ``mixed_float16`` policy (FP16 compute with FP32 variables,
a real FP16 execution, not a simulation). With a device model (a modified,
converted or mixed-precision export of the same network: frozen GraphDef,
SavedModel or Keras file) that file is run as it is and every op output it
has is sent; ops it lacks never appear, ops it adds (the casts of a mixed
precision graph) reach the report as device names without a reference node.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from layerdiff.collector.live import _all_finite
from layerdiff.errors import LayerdiffError
from layerdiff.onnxgraph import plan_segments
from layerdiff.schema import ROLE_INPUT, NodeRecord, check_dump_mode
from layerdiff.tfgraph import import_tf, load_tf_model, on_tf_thread

PRECISIONS = ("fp32", "fp16")


@on_tf_thread
def resolve_tf_device(device: str) -> str:
    """``cpu``, or ``gpu`` where TensorFlow sees one (``cuda`` means the same)."""
    d = (device or "cpu").lower()
    if d in ("cpu", "cpuexecutionprovider"):
        return "cpu"
    if d in ("gpu", "cuda", "cudaexecutionprovider"):
        tf = import_tf()
        if tf.config.list_physical_devices("GPU"):
            return "gpu"
    tf = import_tf()
    available = ["cpu"] + (["gpu"] if tf.config.list_physical_devices("GPU") else [])
    raise LayerdiffError(f"device {device!r} is not available to TensorFlow here (available: {', '.join(available)})",
                         field="device")


class TFLiveRunner:
    """Loads the device graph once and runs it, yielding NodeRecords."""

    def __init__(self, model_bytes: bytes, feeds: dict[str, np.ndarray], *, precision: str = "fp32",
                 device: str = "cpu", device_model_bytes: bytes | None = None, model_name: str = "model.pb",
                 device_model_name: str = "device.pb", signature: str = "") -> None:
        precision = (precision or "fp32").lower()
        self.device = resolve_tf_device(device)
        self.field = "device_model" if device_model_bytes else "model"
        if device_model_bytes:
            self.graph = load_tf_model(device_model_bytes, device_model_name, signature=signature)
        else:
            if precision not in PRECISIONS:
                raise LayerdiffError(f"precision {precision!r} is not available for TensorFlow models (one of "
                                     f"{', '.join(PRECISIONS)}; int8 is for ONNX models)", field="precision")
            self.graph = load_tf_model(model_bytes, model_name, signature=signature, precision=precision)
        self.feeds = self.graph.check_inputs(feeds, "inputs")

    def records(self, dump_mode: str = "output", nodes: set[str] | None = None) -> Iterator[NodeRecord]:
        """Every op's outputs (``dump_mode`` "output"), inputs ("input") or
        both ("all", inputs first), in execution order, for every op or the
        ``nodes`` named; about one segment resident at a time (each segment a
        full run up to its tensors, TensorFlow's own graph rewrites on, as a
        deployed graph runs). A float output holding Inf/NaN that none of its
        inputs held is marked as an overflow, as LiveRunner marks it."""
        dump_mode = check_dump_mode(dump_mode)
        want_in, want_out = dump_mode in ("input", "all"), dump_mode in ("output", "all")
        sites = self.graph.sites
        if nodes is not None:
            sites = [s for s in sites if s.node in nodes or s.tensor in nodes]
        reads = {s.node: self.graph.node_inputs.get(s.node, []) for s in sites}
        # Tensors to fetch, each with its number of uses: what is sent as an
        # output and what sent ops read (weights and activations alike:
        # TensorFlow fetches any tensor; the graph inputs are the feeds).
        uses: dict[str, int] = {}
        if want_out:
            for s in sites:
                uses[s.tensor] = uses.get(s.tensor, 0) + 1
        if want_in:
            for node in dict.fromkeys(s.node for s in sites):
                for t in reads[node]:
                    if t not in self.feeds:
                        uses[t] = uses.get(t, 0) + 1
        position = {s.tensor: i for i, s in enumerate(self.graph.sites)}
        names = sorted(uses, key=lambda t: position.get(t, -1))
        segments = plan_segments(names, self.graph.estimate_output_bytes(self.feeds, names)) if names else []
        segment_of = {n: i for i, seg in enumerate(segments) for n in seg}
        values: dict[str, np.ndarray] = {}
        finite: dict[str, bool] = {t: _all_finite(np.asarray(v)) for t, v in self.feeds.items()}
        computed = 0

        def ensure(t: str) -> None:
            nonlocal computed
            while t in segment_of and computed <= segment_of[t]:
                got = self.graph.run(self.feeds, segments[computed], optimize=True, device=self.device,
                                     field_name=self.field)
                for n, v in got.items():
                    finite[n] = _all_finite(v)
                values.update(got)
                computed += 1

        def known_finite(t: str) -> bool:
            """False when t held Inf/NaN, or when its value was never seen
            (a node is named as the origin only when it provably is)."""
            if t not in finite and t in self.graph.params:
                value = self.graph.constant(t)
                finite[t] = value is not None and _all_finite(value)
            return finite.get(t, False)

        def take(t: str) -> np.ndarray | None:
            """The value of t for one use; forgotten after its last use."""
            if t in self.feeds:
                return np.asarray(self.feeds[t])
            ensure(t)
            left = uses.get(t, 0) - 1
            uses[t] = left
            return values.pop(t, None) if left <= 0 else values.get(t)

        done_inputs: set[str] = set()
        for s in sites:
            if want_in and s.node not in done_inputs:
                done_inputs.add(s.node)
                for k, t in enumerate(reads[s.node]):
                    arr = take(t)
                    if arr is None:
                        yield NodeRecord.error(s.node, f"the device run produced no value for input {k} ({t!r})",
                                               s.op_type, s.order, s.node, role=ROLE_INPUT, slot=k)
                    else:
                        yield NodeRecord(name=s.node, op_type=s.op_type, order=s.order, array=arr, node=s.node,
                                         role=ROLE_INPUT, slot=k)
            if not want_out:
                continue
            arr = take(s.tensor)
            if arr is None:
                yield NodeRecord.error(s.tensor, "the device run produced no value (a branch not taken)",
                                       s.op_type, s.order, s.node, slot=s.output_index)
                continue
            rec = NodeRecord(name=s.tensor, op_type=s.op_type, order=s.order, array=arr, node=s.node,
                             slot=s.output_index)
            if not finite.get(s.tensor, True) and all(known_finite(t) for t in reads[s.node]):
                bad = int(arr.size - np.count_nonzero(np.isfinite(arr)))
                rec.overflow = (f"floating-point overflow: {bad} of {arr.size} values are Inf/NaN while every "
                                f"input of the node is finite")
            yield rec
