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

from collections.abc import Iterator

import numpy as np

from layerdiff.collector.live.onnxrt import node_records
from layerdiff.common.errors import LayerdiffError
from layerdiff.common.onnxgraph import plan_segments
from layerdiff.common.schema import NodeRecord
from layerdiff.common.tf.load import load_tf_model
from layerdiff.common.tf.runtime import import_tf, on_tf_thread

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
        sites = self.graph.sites
        if nodes is not None:
            sites = [s for s in sites if s.node in nodes or s.tensor in nodes]
        # TensorFlow fetches any tensor, weights included: only the graph
        # inputs (the feeds) are known without a run.
        position = {s.tensor: i for i, s in enumerate(self.graph.sites)}
        return node_records(
            sites, self.graph.node_inputs, dump_mode,
            fixed=lambda t: np.asarray(self.feeds[t]) if t in self.feeds else None,
            computed=lambda t: t not in self.feeds, source=lambda t: t, order_key=lambda t: position.get(t, -1),
            plan=lambda names: plan_segments(names, self.graph.estimate_output_bytes(self.feeds, names)),
            run_segment=lambda names: self.graph.run(self.feeds, names, optimize=True, device=self.device,
                                                     field_name=self.field),
            weight=lambda t: self.graph.constant(t) if t in self.graph.params else None,
            no_value="the device run produced no value (a branch not taken)")
