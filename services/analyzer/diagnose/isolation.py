"""Isolated re-runs: a reference node (or the group of reference nodes a fused
device kernel stands for) computed alone in FP32 on the CPU from the
device's own values for what it reads, and the device values kept for it
while a job streams (layerdiff.analyzer.diagnose.verdicts says what the
re-run proves)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from layerdiff.common.onnxgraph import WeightSplit, lean_session

if TYPE_CHECKING:
    import onnx
    import onnxruntime as ort
else:
    from layerdiff.common.lazy import onnx, ort

if TYPE_CHECKING:
    from layerdiff.common.schema import BufferLease


class DeviceValues:
    """Device tensors kept for the isolated re-run of failing nodes: a node
    output until every node that reads it has been examined, a node input
    until its node has. Each kept value holds its receive buffer (a
    ``BufferLease``) and releases it when forgotten. Bounded: past
    ``cap_bytes`` nothing more is kept and the nodes concerned fall back to
    the vendor's rules."""

    def __init__(self, node_inputs: dict[str, list[str]], cap_bytes: int = 1 << 30) -> None:
        self.node_inputs = node_inputs
        self.readers: dict[str, int] = {}
        for ins in node_inputs.values():
            for t in set(ins):
                if t:
                    self.readers[t] = self.readers.get(t, 0) + 1
        self.cap = cap_bytes
        self.used = 0
        self.outputs: dict[str, tuple[np.ndarray, BufferLease | None]] = {}
        self.inputs: dict[tuple[str, int], tuple[np.ndarray, BufferLease | None]] = {}

    def _take(self, arr: np.ndarray, lease: BufferLease | None) -> tuple[np.ndarray, BufferLease | None] | None:
        if self.used + arr.nbytes > self.cap:
            return None
        self.used += arr.nbytes
        return arr, (lease.retain() if lease is not None else None)

    def _drop(self, held: tuple[np.ndarray, BufferLease | None] | None) -> None:
        if held is None:
            return
        self.used -= held[0].nbytes
        if held[1] is not None:
            held[1].release()

    def keep_output(self, tensor: str, arr: np.ndarray, lease: BufferLease | None = None) -> bool:
        """True when kept (the value then holds its own reference to the buffer)."""
        if self.readers.get(tensor, 0) <= 0 or tensor in self.outputs:
            return False
        held = self._take(arr, lease)
        if held is None:
            return False
        self.outputs[tensor] = held
        return True

    def keep_input(self, node: str, slot: int, arr: np.ndarray, lease: BufferLease | None = None) -> bool:
        if (node, slot) in self.inputs:
            return False
        held = self._take(arr, lease)
        if held is None:
            return False
        self.inputs[(node, slot)] = held
        return True

    def inputs_of(self, node: str) -> dict[int, np.ndarray]:
        """slot -> device value, for every slot whose value is known."""
        out = {}
        for k, t in enumerate(self.node_inputs.get(node, [])):
            if (node, k) in self.inputs:
                out[k] = self.inputs[(node, k)][0]
            elif t in self.outputs:
                out[k] = self.outputs[t][0]
        return out

    def node_done(self, node: str) -> None:
        """The node has been examined: forget what only it needed."""
        for k, _ in enumerate(self.node_inputs.get(node, [])):
            self._drop(self.inputs.pop((node, k), None))
        for t in set(self.node_inputs.get(node, [])):
            if not t or t not in self.readers:
                continue
            self.readers[t] -= 1
            if self.readers[t] <= 0:
                self._drop(self.outputs.pop(t, None))

    def release(self) -> None:
        for held in list(self.outputs.values()) + list(self.inputs.values()):
            self._drop(held)
        self.outputs.clear()
        self.inputs.clear()
        self.used = 0


class IsolationUnavailable(Exception):
    pass


def run_isolated(model: onnx.ModelProto | WeightSplit, node_index: int, device_inputs: dict[int, np.ndarray],
                 feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Outputs of reference node ``node_index`` computed alone in FP32 on the
    CPU, reading the device's values for its activations and the reference's
    own weights (so a wrong device weight shows as the node's own error).
    ``model``: the reference, or its ``WeightSplit`` (its weights then go to
    the re-run in place, not copied into a graph and parsed back)."""
    graph = model.parts()[0].graph if isinstance(model, WeightSplit) else model.graph
    node = graph.node[node_index]
    values: dict[str, np.ndarray] = {}
    for k, t in enumerate(node.input):
        if t and t not in values and k in device_inputs:
            values[t] = device_inputs[k]
    outs = run_group_isolated(model, [node_index], values, feeds)
    return [outs[o] for o in node.output if o in outs]


def run_group_isolated(model: onnx.ModelProto | WeightSplit, node_indices: list[int],
                       device_values: dict[str, np.ndarray], feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The reference nodes ``node_indices`` (in execution order) computed
    alone in FP32 on the CPU, as one unit: what they read from outside the
    unit comes from the device (``device_values`` by tensor name) or the
    model inputs, their weights are the reference's. A fused device node
    (Conv+BN+Relu as one kernel) is re-run as the group it stands for.
    Returns every output of the unit's nodes by name."""
    held: dict[str, bytes] = {}
    if isinstance(model, WeightSplit):
        model, held = model.parts()
    nodes = [model.graph.node[i] for i in node_indices]
    for node in nodes:
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            raise IsolationUnavailable("the node holds subgraphs")
    inits = {i.name: i for i in model.graph.initializer}
    # Weights held by Constant nodes are weights too: the reference's own
    # Constant node goes into the isolated graph.
    constant_nodes = {n.output[0]: n for n in model.graph.node if n.op_type == "Constant" and n.output}
    produced = {o for n in nodes for o in n.output if o}
    graph_inputs, values, used_inits, used_consts = [], {}, {}, []
    for node in nodes:
        for k, t in enumerate(node.input):
            if not t or t in produced or t in values or t in used_inits:
                continue
            if t in inits:
                used_inits[t] = inits[t]
                continue
            if t in constant_nodes:
                if constant_nodes[t] not in used_consts:
                    used_consts.append(constant_nodes[t])
                continue
            v = feeds.get(t) if t in feeds else device_values.get(t)
            if v is None:
                where = f"input {k} ({t!r})" if len(nodes) == 1 else f"{t!r}, read by {node.name or node.op_type}"
                raise IsolationUnavailable(f"the device value of {where} is not available")
            v = np.asarray(v)
            if v.dtype == np.float16:      # the reference computes in FP32
                v = v.astype(np.float32)
            values[t] = v
            graph_inputs.append(onnx.helper.make_tensor_value_info(
                t, onnx.helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape)))
    out_names = [o for n in nodes for o in n.output if o]
    outputs = [onnx.ValueInfoProto(name=o) for o in out_names]
    graph = onnx.helper.make_graph(used_consts + nodes, "isolated", graph_inputs, outputs,
                                   initializer=list(used_inits.values()))
    m = onnx.helper.make_model(graph, opset_imports=list(model.opset_import))
    m.ir_version = model.ir_version
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 4
    so.intra_op_num_threads = 1     # a node or a few: a thread pool of its own costs more than it saves
    try:
        sess = lean_session(WeightSplit.from_parts(m, {t: held[t] for t in used_inits if t in held}), so,
                            ["CPUExecutionProvider"])
        return dict(zip(out_names, (np.asarray(v) for v in sess.run(None, values))))
    except Exception as e:  # an op that needs more context than its unit
        raise IsolationUnavailable(f"the node cannot run alone ({type(e).__name__})") from None

