"""The reference for TensorFlow models: a TF1 frozen GraphDef, a SavedModel
or a Keras file run in FP32 on the CPU with TensorFlow's graph rewrites off,
every op output that depends on the inputs fetched (see layerdiff.common.tf.graph).

Same interface as OnnxReference, so that segmented computation, alignment,
comparison and the reports treat both alike. ``open_reference`` picks the
one a model file needs; TensorFlow is imported only for TensorFlow files."""
from __future__ import annotations

import numpy as np

from layerdiff.common.errors import LayerdiffError
from layerdiff.common.onnxgraph import TensorSite, plan_segments
from layerdiff.common.tf.format import FORMAT_GRAPHDEF, FORMAT_KERAS, FORMAT_ONNX, model_format
from layerdiff.common.tf.graph import TFGraph
from layerdiff.common.tf.load import load_tf_model


class TFReference:
    # TensorFlow's image ops work in NHWC (axis names of the diagnosis)
    layout = "NHWC"

    def __init__(self, model_bytes: bytes, name: str = "model.pb", *, signature: str = "",
                 graph: TFGraph | None = None) -> None:
        self.name = name
        self.graph = graph if graph is not None else load_tf_model(model_bytes, name, signature=signature)
        self.format = self.graph.format
        self.sites: list[TensorSite] = self.graph.sites
        self.consumers = self.graph.consumers
        # node name -> the tensors it reads, for comparing a node's inputs
        self.node_inputs: dict[str, list[str]] = self.graph.node_inputs

    def constant(self, tensor: str) -> np.ndarray | None:
        """The value of a weight (or of what is computed from weights alone),
        None for computed tensors."""
        return self.graph.constant(tensor)

    def constants_read(self, node: str) -> frozenset:
        """The weights a node reads."""
        return frozenset(t for t in self.node_inputs.get(node, []) if t in self.graph.params)

    def input_uses(self) -> dict[str, int]:
        """How many node inputs read each computed tensor."""
        uses: dict[str, int] = {}
        for ins in self.node_inputs.values():
            for t in ins:
                if t not in self.graph.params:
                    uses[t] = uses.get(t, 0) + 1
        return uses

    def run_isolated(self, site: TensorSite, device_inputs: dict[int, np.ndarray],
                     feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The op re-run alone on the device's own inputs (see
        layerdiff.analyzer.diagnose.isolation): TensorFlow feeds the device values in
        place of the activations the op reads, its weights stay the
        reference's."""
        from layerdiff.analyzer.diagnose.isolation import IsolationUnavailable

        try:
            return self.graph.run_isolated(site.node, device_inputs, feeds)
        except KeyError as e:
            raise IsolationUnavailable(str(e.args[0]) if e.args else "an input is missing") from None
        except Exception as e:   # an op that needs more context than its inputs
            raise IsolationUnavailable(f"the node cannot run alone ({type(e).__name__})") from None

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


def open_reference(model_bytes: bytes, name: str, signature: str = "", key: str = ""):
    """OnnxReference or TFReference, from the file's name and first bytes;
    ``key`` (the file's sha256): an ONNX model is parsed once in this
    process for whoever else reads it (onnxgraph.PARSED: an embedded
    collector running a device model reads the reference's inputs)."""
    if model_format(name, model_bytes) == FORMAT_ONNX:
        from layerdiff.analyzer.reference.onnxrt import OnnxReference
        from layerdiff.common.onnxgraph import PARSED, load_model

        return OnnxReference(PARSED.hold(key, lambda: load_model(model_bytes, name)), name)
    return TFReference(model_bytes, name, signature=signature)
