"""The reference: the original ONNX model run in FP32 on the CPU with every
node output exposed and graph optimizations off, so that no node is fused
away and every node has a value to compare against."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort

from layerdiff.errors import LayerdiffError
from layerdiff.onnxgraph import (TensorSite, check_inputs, consumer_map, expose_all_outputs, load_model,
                                 tensor_sites)


class OnnxReference:
    def __init__(self, model_bytes: bytes, name: str = "model.onnx") -> None:
        self.name = name
        self.model = load_model(model_bytes, name)
        self.sites: list[TensorSite] = tensor_sites(self.model)
        self.consumers = consumer_map(self.model)

    def check_inputs(self, feeds: dict[str, np.ndarray], inputs_name: str) -> dict[str, np.ndarray]:
        return check_inputs(self.model, feeds, inputs_name)

    def node_runtime(self) -> list[dict]:
        """Nodes in execution order with their outputs (node_runtime.json)."""
        out: list[dict] = []
        for s in self.sites:
            if out and out[-1]["node"] == s.node:
                out[-1]["outputs"].append(s.tensor)
            else:
                out.append({"order": s.order, "node": s.node, "op_type": s.op_type, "outputs": [s.tensor]})
        return out

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every node output by tensor name."""
        model = onnx.ModelProto()
        model.CopyFrom(self.model)
        expose_all_outputs(model)
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        so.log_severity_level = 3
        # Without the arena every output returns to the system as soon as its
        # node is compared, instead of the whole run staying resident.
        so.enable_cpu_mem_arena = False
        try:
            sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        except Exception as e:
            raise LayerdiffError(f"onnxruntime cannot load the model: {e}", file=self.name) from e
        names = [o.name for o in sess.get_outputs()]
        try:
            values = sess.run(None, feeds)
        except Exception as e:
            raise LayerdiffError(f"reference run failed: {e}", file=self.name) from e
        return {n: np.asarray(v) for n, v in zip(names, values)}
