"""The reference: the original ONNX model run in FP32 on the CPU with every
node output exposed and graph optimizations off, so that no node is fused
away and every node has a value to compare against.

A large network's node outputs can outweigh the analyzer's memory (a
detector at 1088x1088 produces about 2 GB), so the reference is computed in
segments (``layerdiff.analyzer.reference.segments``) on demand, and each value is
forgotten once compared."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from layerdiff.common.errors import LayerdiffError
from layerdiff.common.onnxgraph import (
    ParsedModel,
    TensorSite,
    WeightSplit,
    check_inputs,
    consumer_map,
    estimate_output_bytes,
    expose_all_outputs,
    expose_only,
    lean_session,
    load_model,
    node_runtime,
    plan_segments,
    tensor_sites,
)

if TYPE_CHECKING:
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper
else:
    from layerdiff.common.lazy import numpy_helper, onnx, ort


def reference_session(model: onnx.ModelProto | WeightSplit, edit=None, quiet: bool = False) -> ort.InferenceSession:
    """A session computing as the reference does: FP32 on the CPU, graph
    optimizations off (no node fused away), the weights handed over in
    memory (``lean_session``; ``edit`` changes the graph's copy); ``quiet``:
    onnxruntime logs nothing short of fatal (runs expected to fail now and
    then, whose failure is reported otherwise); ``model`` may be its
    ``WeightSplit``, made once."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 4 if quiet else 3
    # Without the arena every output returns to the system as soon as its
    # node is compared, instead of the whole run staying resident.
    so.enable_cpu_mem_arena = False
    # Every session runs once: packing the weights for repeated MatMuls
    # would cost more than it saves (a third of a transformer's session).
    so.add_session_config_entry("session.disable_prepacking", "1")
    return lean_session(model, so, ["CPUExecutionProvider"], edit=edit)


class OnnxReference:
    # computed in segments of its own nodes (layerdiff.analyzer.reference.segments)
    chainable = True

    @property
    def model_outputs(self) -> frozenset:
        """The graph's outputs: what the run's outcome is judged by."""
        return frozenset(o.name for o in self.model.graph.output)

    def __init__(self, model_bytes: bytes | ParsedModel, name: str = "model.onnx") -> None:
        """``model_bytes``: the file, or its parsed model held for others
        too (onnxgraph.PARSED), held here as long as this reference lives."""
        self.name = name
        self._held = model_bytes if isinstance(model_bytes, ParsedModel) else ParsedModel(load_model(model_bytes, name))
        self.model = self._held.model
        self.sites: list[TensorSite] = tensor_sites(self.model)
        self.consumers = consumer_map(self.model)
        # node name -> the tensors it reads, for comparing a node's inputs
        self.node_inputs: dict[str, list[str]] = {}
        for s in self.sites:
            self.node_inputs.setdefault(s.node, list(self.model.graph.node[s.order].input))
        self._constants = {i.name: i for i in self.model.graph.initializer}
        self._const_nodes = {s.tensor for s in self.sites if s.is_constant}
        # the weights copied out once for the run, the FP16 build and the impact re-runs
        self.split = WeightSplit(self.model)

    def constant(self, tensor: str) -> np.ndarray | None:
        """The value of an initializer (a weight), None for computed tensors."""
        init = self._constants.get(tensor)
        return None if init is None else numpy_helper.to_array(init)

    def constants_read(self, node: str) -> frozenset:
        """The weights a node reads: initializers and Constant node outputs."""
        return frozenset(t for t in self.node_inputs.get(node, []) if t in self._constants or t in self._const_nodes)

    def input_uses(self) -> dict[str, int]:
        """How many node inputs read each computed tensor."""
        uses: dict[str, int] = {}
        for ins in self.node_inputs.values():
            for t in ins:
                if t and t not in self._constants:
                    uses[t] = uses.get(t, 0) + 1
        return uses

    def check_inputs(self, feeds: dict[str, np.ndarray], inputs_name: str) -> dict[str, np.ndarray]:
        return check_inputs(self.model, feeds, inputs_name)

    def node_runtime(self) -> list[dict]:
        return node_runtime(self.sites)

    def plan(self, feeds: dict[str, np.ndarray], **limits) -> list[list[str]]:
        """Consecutive tensors in execution order, cut into segments
        (``limits``: min_bytes, max_segments of plan_segments)."""
        return plan_segments([s.tensor for s in self.sites], estimate_output_bytes(self.model, feeds), **limits)

    def run(self, feeds: dict[str, np.ndarray], only: list[str] | None = None) -> dict[str, np.ndarray]:
        """Every node output (or those in ``only``) by tensor name."""
        def exposed(model: onnx.ModelProto) -> None:
            if only is not None:
                expose_only(model, only)
            else:
                expose_all_outputs(model)

        # The session (which owns onnxruntime's threads) ends here, also
        # when this raises: an exception keeps the frames it passed through
        # for as long as it lives (a failed segment's, in the future of the
        # job that asked for it), so neither this frame nor onnxruntime's
        # (the cause's traceback) may hold it.
        try:
            sess = reference_session(self.split, edit=exposed)
        except Exception as e:
            raise LayerdiffError(f"onnxruntime cannot load the model: {e}",
                                 file=self.name) from e.with_traceback(None)
        names = [o.name for o in sess.get_outputs()]
        try:
            values = sess.run(None, feeds)
        except Exception as e:
            raise LayerdiffError(f"reference run failed: {e}", file=self.name) from e.with_traceback(None)
        finally:
            del sess
        return {n: np.asarray(v) for n, v in zip(names, values)}
