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

from layerdiff.errors import LayerdiffError
from layerdiff.onnxgraph import plan_segments
from layerdiff.schema import NodeRecord
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

    def records(self) -> Iterator[NodeRecord]:
        """Every op output in execution order, about one segment resident at a
        time (each segment a full run up to its ops, TensorFlow's own graph
        rewrites on, as a deployed graph runs)."""
        sites = self.graph.sites
        segments = plan_segments([s.tensor for s in sites], self.graph.estimate_output_bytes(self.feeds))
        segment_of = {n: i for i, seg in enumerate(segments) for n in seg}
        values: dict[str, np.ndarray] = {}
        computed = 0
        for s in sites:
            while computed <= segment_of[s.tensor]:
                values.update(self.graph.run(self.feeds, segments[computed], optimize=True, device=self.device,
                                             field_name=self.field))
                computed += 1
            arr = values.pop(s.tensor, None)
            if arr is None:
                yield NodeRecord.error(s.tensor, "the device run produced no value (a branch not taken)",
                                       s.op_type, s.order, s.node)
                continue
            yield NodeRecord(name=s.tensor, op_type=s.op_type, order=s.order, array=arr, node=s.node)
