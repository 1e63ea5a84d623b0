"""Writing an ONNX model op by op in the tests: ``const`` adds an
initializer, ``node`` a node whose one output is ``NAME_out``; ``model``
closes the graph (opset 17, checked). ``opset17`` makes any graph a model
the same way."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper


class GraphBuilder:
    def __init__(self) -> None:
        self.inits: list[onnx.TensorProto] = []
        self.nodes: list[onnx.NodeProto] = []

    def const(self, name: str, arr, dtype=np.float32) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(arr, dtype), name))
        return name

    def node(self, op: str, ins: list[str], name: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op, ins, [name + "_out"], name=name, **attrs))
        return name + "_out"

    def model(self, name: str, inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto]) \
            -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, inputs, outputs, initializer=self.inits)
        model = opset17(graph)
        onnx.checker.check_model(model)
        return model


def opset17(graph: onnx.GraphProto) -> onnx.ModelProto:
    """The model of a graph at opset 17 and IR version 8, as every test model is."""
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model
