"""A frozen TensorFlow GraphDef analysed into a TFGraph.

Sites are the outputs of every op whose value depends on the graph inputs,
in execution order (a topological order, ties kept in GraphDef order): the
weights and what is computed from weights alone are parameters, as ONNX
initializers are, and the ops inside a TF1 while-loop frame have no single
value to fetch. Keras layers appear as the name scopes of their ops
(``model/layer/op:0``); ``layer_map`` names the layer an op belongs to.
"""
from __future__ import annotations

import re

import numpy as np

from layerdiff.common.errors import LayerdiffError
from layerdiff.common.onnxgraph import GraphInput, TensorSite
from layerdiff.common.tf.graph import INPUT_OPS, TFGraph
from layerdiff.common.tf.runtime import import_tf, tf_message

# Ops with nothing to compare: no data value, or values that never cross the wire.
_NO_VALUE_OPS = frozenset({"NoOp", "Const", "Assert", "Print", "PrintV2"})
_LOOP_ENTER = frozenset({"Enter", "RefEnter"})
_LOOP_EXIT = frozenset({"Exit", "RefExit"})
# Identity ops function inlining puts at a call's boundary: copies, not computations.
_INLINE_BOUNDARY = re.compile(r"^Func/.+/(?:input|output)/_\d+$")


def analyse(gd, name: str, fmt: str, output_ops: set[str], layer_names: list[str]) -> TFGraph:
    """Inputs, sites in execution order and the consumer map of a frozen graph."""
    tf = import_tf()
    g = tf.Graph()
    try:
        with g.as_default():
            tf.graph_util.import_graph_def(gd, name="")
    except Exception as e:
        raise LayerdiffError(f"is not a valid TensorFlow graph: {tf_message(e)}", file=name, field="model") from e
    ops = g.get_operations()
    index = {op.name: i for i, op in enumerate(ops)}
    inputs: list[GraphInput] = []
    for op in ops:
        if op.type in INPUT_OPS:
            t = op.outputs[0]
            shape = tuple(t.shape.as_list()) if t.shape.rank is not None else None
            inputs.append(GraphInput(op.name, _np_dtype(t.dtype), shape))
    if not inputs:
        raise LayerdiffError("has no inputs (no Placeholder op)", file=name, field="model")

    # Ops in a TF1 while-loop frame run once per iteration: no single value.
    in_loop: set[str] = set()
    for op in ops:
        if op.type in _LOOP_ENTER:
            stack = [op]
            while stack:
                cur = stack.pop()
                if cur.name in in_loop:
                    continue
                in_loop.add(cur.name)
                for out in cur.outputs:
                    stack.extend(c for c in out.consumers() if c.type not in _LOOP_EXIT)

    # Ops whose value depends on the inputs (data edges only).
    reach: set[str] = set()
    stack = [g.get_operation_by_name(i.name) for i in inputs]
    while stack:
        cur = stack.pop()
        for out in cur.outputs:
            for c in out.consumers():
                if c.name not in reach:
                    reach.add(c.name)
                    stack.append(c)

    # Execution order: topological over data and control edges, ties in
    # GraphDef order (Kahn's algorithm on a heap of GraphDef positions).
    import heapq

    preds = {op.name: {t.op.name for t in op.inputs} | {c.name for c in op.control_inputs} for op in ops}
    succs: dict[str, list[str]] = {op.name: [] for op in ops}
    for n, ps in preds.items():
        for p in ps:
            succs[p].append(n)
    indeg = {n: len(ps) for n, ps in preds.items()}
    heap = [index[n] for n, d in indeg.items() if d == 0]
    heapq.heapify(heap)
    order: list = []
    while heap:
        op = ops[heapq.heappop(heap)]
        order.append(op)
        for s in succs[op.name]:
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(heap, index[s])
    if len(order) != len(ops):   # cycles (TF1 loops: NextIteration -> Merge): the rest in GraphDef order
        placed = {op.name for op in order}
        order.extend(op for op in ops if op.name not in placed)

    sites: list[TensorSite] = []
    site_ops: list[str] = []
    for op in order:
        if (op.name not in reach or op.name in in_loop or op.name in output_ops or op.type in INPUT_OPS
                or op.type in _NO_VALUE_OPS or not op.outputs
                or (op.type == "Identity" and _INLINE_BOUNDARY.match(op.name))):
            continue
        kept = [(k, t) for k, t in enumerate(op.outputs) if _np_dtype(t.dtype)]
        if not kept:
            continue
        n = len(site_ops)
        site_ops.append(op.name)
        for k, t in kept:
            sites.append(TensorSite(t.name, op.name, op.type, n, k))
    if not sites:
        raise LayerdiffError("has no op that computes from the inputs", file=name, field="model")

    # What each site op reads. An input coming through the Identity copies
    # that inlining or freezing adds is named by its source, a site or a
    # graph input; inputs computed from weights alone are parameters.
    site_set = set(site_ops)
    dropped_copies = {op.name for op in ops if op.type == "Identity" and op.inputs and op.name not in site_set
                      and (op.name in output_ops or _INLINE_BOUNDARY.match(op.name))}

    def source(t):
        while t.op.name in dropped_copies:
            t = t.op.inputs[0]
        return t

    node_inputs: dict[str, list[str]] = {}
    params: set[str] = set()
    for op_name in site_ops:
        names = []
        for t in g.get_operation_by_name(op_name).inputs:
            src = source(t)
            names.append(src.name)
            if src.op.name not in reach and src.op.type not in INPUT_OPS and _np_dtype(src.dtype):
                params.add(src.name)
        node_inputs[op_name] = names

    keep = site_set | {i.name for i in inputs}
    consumers: dict[str, list[str]] = {}
    for op in order:
        if op.name not in keep:
            continue
        outs: list[str] = []
        for t in op.outputs:
            for c in t.consumers():
                if c.name in keep and c.name not in outs:
                    outs.append(c.name)
        consumers[op.name] = outs
    layers = layer_map(site_ops, layer_names) if layer_names else {}
    optional = frozenset(op.name for op in ops if op.type == "PlaceholderWithDefault")
    return TFGraph(name=name, format=fmt, graph_def=gd, inputs=inputs, sites=sites, consumers=consumers,
                   layers=layers, optional_inputs=optional, node_inputs=node_inputs, params=frozenset(params))


_WIRE_DTYPES = frozenset({"bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                          "float16", "float32", "float64", "bfloat16"})


def _np_dtype(dtype) -> str:
    """numpy dtype name of a TensorFlow dtype, "" for what has no numeric
    value (strings, resources, variants)."""
    try:
        n = np.dtype(dtype.as_numpy_dtype).name
    except TypeError:
        return ""
    return n if n in _WIRE_DTYPES else ""


_UNIQUIFIER = re.compile(r"_\d+$")


def layer_map(op_names: list[str], layer_names: list[str]) -> dict[str, str]:
    """op name -> the innermost Keras layer whose name scope holds it.
    TensorFlow makes a reused scope unique with a ``_N`` suffix, so
    ``model_1/conv1_1/convolution`` belongs to layer ``conv1``."""
    known = set(layer_names)
    out: dict[str, str] = {}
    for op in op_names:
        for seg in reversed(op.split("/")[:-1]):
            if seg in known:
                out[op] = seg
                break
            base = _UNIQUIFIER.sub("", seg)
            if base in known:
                out[op] = base
                break
    return out

