"""The reference for TensorFlow models: a TF1 frozen GraphDef, a SavedModel
or a Keras file run in FP32 on the CPU with TensorFlow's graph rewrites off,
every op output that depends on the inputs fetched (see layerdiff.tfgraph).

Same interface as OnnxReference, so that segmented computation, alignment,
comparison and the reports treat both alike. ``open_reference`` picks the
one a model file needs; TensorFlow is imported only for TensorFlow files."""
from __future__ import annotations

import numpy as np

from layerdiff.errors import LayerdiffError
from layerdiff.onnxgraph import TensorSite, plan_segments
from layerdiff.tfgraph import FORMAT_GRAPHDEF, FORMAT_KERAS, FORMAT_ONNX, TFGraph, load_tf_model, model_format


class TFReference:
    def __init__(self, model_bytes: bytes, name: str = "model.pb", *, signature: str = "",
                 graph: TFGraph | None = None) -> None:
        self.name = name
        self.graph = graph if graph is not None else load_tf_model(model_bytes, name, signature=signature)
        self.format = self.graph.format
        self.sites: list[TensorSite] = self.graph.sites
        self.consumers = self.graph.consumers

    def check_device_precision(self, precision: str) -> None:
        """A live run without a device model needs a precision this file can
        be run in: fp32 always, fp16 for a Keras model (mixed_float16)."""
        p = (precision or "fp32").lower()
        if p == "fp32" or (p == "fp16" and self.format == FORMAT_KERAS):
            return
        if p == "fp16":
            kind = "frozen GraphDef" if self.format == FORMAT_GRAPHDEF else "SavedModel"
            raise LayerdiffError(f"precision fp16 rebuilds a Keras model under the mixed_float16 policy; for a {kind} "
                                 "give its mixed-precision export as the device model", file=self.name,
                                 field="precision")
        raise LayerdiffError(f"precision {p!r} is not available for TensorFlow models (fp32, or fp16 for Keras "
                             "models; give a quantized export as the device model)", file=self.name, field="precision")

    def check_inputs(self, feeds: dict[str, np.ndarray], inputs_name: str) -> dict[str, np.ndarray]:
        return self.graph.check_inputs(feeds, inputs_name)

    def node_runtime(self) -> list[dict]:
        return self.graph.node_runtime()

    def plan(self, feeds: dict[str, np.ndarray], **limits) -> list[list[str]]:
        return plan_segments([s.tensor for s in self.sites], self.graph.estimate_output_bytes(feeds), **limits)

    def run(self, feeds: dict[str, np.ndarray], only: list[str] | None = None) -> dict[str, np.ndarray]:
        return self.graph.run(feeds, only, optimize=False, device="cpu", field_name="model")


def open_reference(model_bytes: bytes, name: str, signature: str = ""):
    """OnnxReference or TFReference, from the file's name and first bytes."""
    if model_format(name, model_bytes) == FORMAT_ONNX:
        from layerdiff.analyzer.reference import OnnxReference

        return OnnxReference(model_bytes, name)
    return TFReference(model_bytes, name, signature=signature)
