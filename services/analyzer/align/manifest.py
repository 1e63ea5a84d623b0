"""A dump's device graph (``layerdiff.v1.DeviceGraph``, from its manifest) as
an ONNX model without weights, so that the structural alignment pairs it
with the reference as it pairs a device model.

Runtimes name ops their own way: the op types are read case-insensitively
against ONNX's, through the vendor spellings in ``ALIASES``; an op type none
of them knows is kept as it is (the node then pairs only through what
follows it). The tensors the nodes read that no node produces are the
graph's inputs where the manifest lists them, or where they carry a
reference input's name, or else the first ones read as a node's first input
(as many as the reference has inputs); the others are weights, whose values
the dump does not hold.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

import numpy as np

from layerdiff.v1 import layerdiff_pb2 as pb

if TYPE_CHECKING:
    import onnx
    from onnx import helper
else:
    from layerdiff.common.lazy import helper, onnx

# Vendor op types (TensorFlow, Ascend, TensorRT, QNN, RKNN spellings) -> ONNX.
ALIASES = {
    "conv2d": "Conv", "convolution": "Conv", "conv2dv2": "Conv", "depthwiseconv2d": "Conv",
    "depthwiseconv2dnative": "Conv", "conv2d_depthwise": "Conv", "conv3d": "Conv",
    "conv2dbackpropinput": "ConvTranspose", "deconvolution": "ConvTranspose", "conv2dtranspose": "ConvTranspose",
    "batchnorm": "BatchNormalization", "fusedbatchnorm": "BatchNormalization",
    "fusedbatchnormv2": "BatchNormalization", "fusedbatchnormv3": "BatchNormalization",
    "bninference": "BatchNormalization", "bninferenced": "BatchNormalization", "batchnorm2d": "BatchNormalization",
    "fullyconnection": "Gemm", "fullyconnected": "Gemm", "innerproduct": "Gemm", "dense": "Gemm",
    "matmulv2": "MatMul", "batchmatmul": "MatMul", "batchmatmulv2": "MatMul", "batchmatmulv3": "MatMul",
    "relu6": "Clip", "clippedrelu": "Clip", "clipbyvalue": "Clip", "reluv2": "Relu",
    "maxpoolv3": "MaxPool", "maxpoolwithargmax": "MaxPool", "avgpool": "AveragePool", "avgpoolv2": "AveragePool",
    "averagepool2d": "AveragePool", "maxpool2d": "MaxPool",
    "concatd": "Concat", "concatv2": "Concat", "concatv2d": "Concat", "concatenation": "Concat",
    "addv2": "Add", "biasadd": "Add", "addn": "Sum", "eltwise_add": "Add", "elementwiseadd": "Add",
    "realdiv": "Div", "elementwisemul": "Mul", "eltwise_mul": "Mul", "mean": "ReduceMean",
    "softmaxv2": "Softmax", "transposed": "Transpose", "reshaped": "Reshape", "squeezev2": "Squeeze",
    "resizebilinearv2": "Resize", "resizenearestneighbor": "Resize", "resizenearestneighborv2": "Resize",
    "upsample": "Resize", "stridedslice": "Slice", "stridedsliced": "Slice", "gatherv2": "Gather",
    "leakyrelu": "LeakyRelu", "prelu": "PRelu", "hardswish": "HardSwish", "hardsigmoid": "HardSigmoid",
    "layernorm": "LayerNormalization", "fusedconv": "FusedConv", "fusedgemm": "FusedGemm",
    "fusedmatmul": "FusedMatMul", "skiplayernorm": "SkipLayerNormalization",
    "skiplayernormalization": "SkipLayerNormalization", "fastgelu": "FastGelu", "biasgelu": "BiasGelu",
}
_CONTRIB = {"FusedConv", "FusedGemm", "FusedMatMul", "SkipLayerNormalization", "FastGelu", "BiasGelu",
            "Attention", "SkipSimplifiedLayerNormalization"}


def _onnx_ops() -> dict[str, str]:
    ops = {s.name.lower(): s.name for s in onnx.defs.get_all_schemas() if s.domain in ("", "ai.onnx")}
    ops.update(ALIASES)
    return ops


_OPS = _onnx_ops()


def onnx_op(op_type: str) -> str:
    """The ONNX spelling of a runtime's op type (itself where unknown)."""
    return _OPS.get(op_type.strip().lower().replace("-", "_"), op_type.strip())


def skeleton(graph: pb.DeviceGraph, reference: onnx.ModelProto) -> onnx.ModelProto:
    """The device graph as an ONNX model: nodes, declared shapes, no weights."""
    produced = {t.name for n in graph.nodes for t in n.outputs if t.name}
    free: dict[str, int] = {}      # read, produced by no node -> the lowest slot it is read at
    for n in graph.nodes:
        for k, t in enumerate(n.inputs):
            if t and t not in produced:
                free[t] = min(free.get(t, k), k)
    inputs = _graph_inputs(graph, free, reference)
    nodes = [_weight(t) for t in free if t not in inputs]
    value_info = []
    for n in graph.nodes:
        op = onnx_op(n.op_type or "Unknown")
        node = helper.make_node(op, list(n.inputs), [t.name for t in n.outputs], name=n.name,
                                domain="com.microsoft" if op in _CONTRIB else "")
        for key, text in sorted(n.attributes.items()):
            attr = _attribute(key, text)
            if attr is not None:
                node.attribute.append(attr)
        nodes.append(node)
        value_info += [_value_info(t) for t in n.outputs if t.name]
    # a graph input's shape is not in the dump: none is declared
    g = helper.make_graph(nodes, graph.source or "dump",
                          [helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None) for t in inputs], [],
                          value_info=value_info)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return model


def _weight(name: str) -> onnx.NodeProto:
    """A weight the dump names but does not hold: a constant of no known value."""
    node = helper.make_node("Constant", [], [name], name=f"weight:{name}")
    node.attribute.append(helper.make_attribute("value_floats", [], attr_type=onnx.AttributeProto.FLOATS))
    return node


def _graph_inputs(graph: pb.DeviceGraph, free: dict[str, int], reference: onnx.ModelProto) -> list[str]:
    if graph.inputs:
        return [t for t in graph.inputs if t in free]
    inits = {i.name for i in reference.graph.initializer}
    ref_in = [v.name for v in reference.graph.input if v.name not in inits]
    keys = {_key(r) for r in ref_in}
    named = [t for t in free if t in ref_in or _key(t) in keys]
    rest = [t for t, slot in free.items() if slot == 0 and t not in named]
    return named + rest[:max(len(ref_in) - len(named), 0)]


def _key(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def _attribute(key: str, text: str) -> onnx.AttributeProto | None:
    try:
        value = json.loads(text)
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, list) and value and all(isinstance(v, bool) for v in value):
            value = [int(v) for v in value]
        if value is None or value == [] or isinstance(value, dict):
            return None
        return helper.make_attribute(key, value)
    except (ValueError, TypeError):
        return None


def _elem_type(dtype: str) -> int:
    try:
        return helper.np_dtype_to_tensor_dtype(np.dtype(dtype)) if dtype else onnx.TensorProto.UNDEFINED
    except (TypeError, KeyError, ValueError):
        return onnx.TensorProto.UNDEFINED


def _value_info(t: pb.DeviceTensor) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(t.name, _elem_type(t.dtype), list(t.shape) if t.has_shape else None)

