"""An ONNX graph indexed for alignment: producers, readers, constants, shape
computations, the flow inputs of each node, inferred shapes, constant values;
and whether two shapes can hold the same tensor."""
from __future__ import annotations

import heapq
import itertools
from collections import defaultdict
from typing import TYPE_CHECKING

import numpy as np

from layerdiff.analyzer.align.graph.ops import RESHAPES
from layerdiff.common.onnxgraph import infer_shapes

if TYPE_CHECKING:
    import onnx
    from onnx import helper, numpy_helper
else:
    from layerdiff.common.lazy import helper, numpy_helper, onnx


class IndexedGraph:
    """An ONNX graph indexed for alignment (read-only)."""

    def __init__(self, model: onnx.ModelProto, merge_duplicates: bool = False) -> None:
        g = model.graph
        self.inits = {i.name: i for i in g.initializer}
        self._same: dict[tuple, bool] = {}      # same_bytes, once per pair
        self.nodes = _topological(list(g.node))
        self.producer = {t: (i, k) for i, n in enumerate(self.nodes) for k, t in enumerate(n.output) if t}
        self.inputs = [v.name for v in g.input if v.name not in self.inits]
        self.outputs = {v.name for v in g.output}
        self.const = self._constants()
        self.meta = self._meta()
        # tensor -> the first of the identical computations it is one of
        # (what common-subexpression elimination merges); flows name that one
        self.canon = self._duplicates() if merge_duplicates else {}
        self.outputs |= {self.c(t) for t in self.outputs}
        self.flows = [[(k, self.c(t)) for k, t in self._flow_inputs(i)] for i in range(len(self.nodes))]
        self.data_consumers: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for i, fl in enumerate(self.flows):
            for k, t in fl:
                self.data_consumers[t].append((i, k))
        self.shapes, self.types = _shapes(model)
        self._values: dict[str, np.ndarray | None] = {}
        self._attrs: dict[int, dict] = {}

    def _constants(self) -> set[str]:
        const = set(self.inits)
        for n in self.nodes:
            ins = [t for t in n.input if t]
            if (n.op_type == "Constant" and not ins) or (ins and all(t in const for t in ins)):
                const.update(t for t in n.output if t)
        return const

    def _meta(self) -> set[str]:
        meta: set[str] = set()
        for n in self.nodes:
            live = [t for t in n.input if t and t not in self.const]
            if n.op_type in ("Shape", "Size") or (live and all(t in meta for t in live)):
                meta.update(t for t in n.output if t and t not in self.const)
        return meta

    def _duplicates(self) -> dict[str, str]:
        canon: dict[str, str] = {}
        first: dict[tuple, int] = {}
        for i, n in enumerate(self.nodes):
            if not n.input or all(t in self.const for t in n.output if t):
                continue
            attrs = tuple(sorted(a.SerializeToString() for a in n.attribute))
            key = (n.domain, n.op_type, tuple(canon.get(t, t) for t in n.input), attrs, len(n.output))
            if key in first:
                for t, rep in zip(n.output, self.nodes[first[key]].output):
                    if t and rep:
                        canon[t] = rep
            else:
                first[key] = i
        return canon

    def duplicates_of(self, t: str) -> list[str]:
        return [d for d, rep in self.canon.items() if rep == t] if t in self.canon.values() else []

    def c(self, t: str) -> str:
        """The canonical name of a tensor (itself unless a duplicate)."""
        return self.canon.get(t, t)

    def out(self, j: int) -> str:
        """Node j's first output, by its canonical name."""
        return self.c(self.nodes[j].output[0])

    def _flow_inputs(self, i: int) -> list[tuple[int, str]]:
        n = self.nodes[i]
        is_meta = any(t in self.meta for t in n.output)
        return [(k, t) for k, t in enumerate(n.input)
                if t and t not in self.const and (is_meta or t not in self.meta)]

    def op(self, i: int) -> str:
        return self.nodes[i].op_type

    def label(self, i: int) -> str:
        n = self.nodes[i]
        return n.name or next((t for t in n.output if t), f"{n.op_type}_{i}")

    def attrs(self, i: int) -> dict:
        if i not in self._attrs:
            out = {}
            for a in self.nodes[i].attribute:
                if a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS, onnx.AttributeProto.TENSOR,
                              onnx.AttributeProto.SPARSE_TENSOR):
                    continue
                v = helper.get_attribute_value(a)
                out[a.name] = v.decode() if isinstance(v, bytes) else (list(v) if isinstance(v, (list, tuple))
                                                                       else v)
            self._attrs[i] = out
        return self._attrs[i]

    def outputs_of(self, i: int) -> list[str]:
        return [t for t in self.nodes[i].output if t]

    def value(self, t: str) -> np.ndarray | None:
        """The value of a constant tensor, as float64 where it can be had cheaply."""
        if t not in self._values:
            self._values[t] = self._evaluate(t)
        return self._values[t]

    def same_bytes(self, t: str, other: IndexedGraph, u: str) -> bool:
        """Are initializer ``t`` here and ``u`` in ``other`` the same stored
        tensor (type, shape, bytes)? Settles most weights of a device model
        without widening either (a build keeps most of them as they were)."""
        key = (t, id(other), u)     # the search and the weight rows ask of the same pairs
        if key not in self._same:
            a, b = self.inits.get(t), other.inits.get(u)
            self._same[key] = a is not None and b is not None and a.data_type == b.data_type \
                and a.dims == b.dims and (
                    (a.name == b.name and a == b)   # in place: reading raw_data copies it (90 MB a model, twice)
                    or (bool(a.raw_data) and a.raw_data == b.raw_data))
        return self._same[key]

    def stored(self, t: str) -> np.ndarray | None:
        """An initializer as stored (its own type), else ``value``."""
        init = self.inits.get(t)
        return numpy_helper.to_array(init) if init is not None else self.value(t)

    def _evaluate(self, t: str) -> np.ndarray | None:
        if not t or t not in self.const:
            return None
        if t in self.inits:
            return _as_float(numpy_helper.to_array(self.inits[t]))
        i, _ = self.producer[t]
        n = self.nodes[i]
        if n.op_type not in ("Constant", "Identity", "Cast", "DequantizeLinear", "Transpose"):
            return None
        ins = [self.value(x) if x else None for x in n.input]
        try:
            if n.op_type == "Constant":
                a = n.attribute[0]
                if a.name == "value":
                    return _as_float(numpy_helper.to_array(a.t))
                v = helper.get_attribute_value(a)
                return _as_float(np.asarray(v)) if a.name in ("value_float", "value_floats", "value_int",
                                                               "value_ints") else None
            if n.op_type in ("Identity", "Cast"):
                return ins[0]
            if n.op_type == "DequantizeLinear" and ins[0] is not None and ins[1] is not None:
                return _dequantize(ins[0], ins[1], ins[2] if len(ins) > 2 else None, self.attrs(i).get("axis", 1))
            if n.op_type == "Transpose" and ins[0] is not None:
                return np.transpose(ins[0], self.attrs(i).get("perm"))
        except (ValueError, IndexError):
            return None
        return None

    def shape(self, t: str) -> tuple | None:
        return self.shapes.get(t)

    def transparent(self, j: int) -> bool:
        """Does node j pass its input on unchanged (Identity, Dropout, a Cast
        to the same type, x*1, x/1, x+0, x-0)? Optimizers drop such nodes."""
        n, op = self.nodes[j], self.op(j)
        if op in ("Identity", "Dropout"):
            return True
        if op == "Cast":
            src = self.types.get(n.input[0])
            return src is not None and src == self.attrs(j).get("to")
        if op in ("Mul", "Div", "Add", "Sub") and len(self.flows[j]) == 1 and len(n.input) == 2:
            slot = self.flows[j][0][0]
            other = self.value(n.input[1 - slot])
            neutral = 1.0 if op in ("Mul", "Div") else 0.0
            return (other is not None and other.size == 1 and float(other.ravel()[0]) == neutral
                    and (slot == 0 or op in ("Mul", "Add")))
        return False

    def see_through(self, j: int) -> bool:
        """Does node j keep its input's elements in order (transparent or a
        Reshape-like)?"""
        return self.op(j) in RESHAPES or self.transparent(j)


def _as_float(a: np.ndarray) -> np.ndarray | None:
    return a.astype(np.float64) if a.dtype.kind in "fiub" else None


def _dequantize(x, scale, zero, axis) -> np.ndarray:
    if scale.ndim == 1 and scale.size > 1:
        shape = [1] * x.ndim
        shape[axis] = scale.size
        scale = scale.reshape(shape)
        zero = zero.reshape(shape) if zero is not None else None
    return (x - (zero if zero is not None else 0.0)) * scale


def _topological(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """Kahn's order, stable with respect to the stored order (which ONNX
    already requires to be topological)."""
    produced = {t: i for i, n in enumerate(nodes) for t in n.output if t}
    deps = [{produced[t] for t in n.input if t in produced and produced[t] != i} for i, n in enumerate(nodes)]
    users = defaultdict(list)
    for i, d in enumerate(deps):
        for j in d:
            users[j].append(i)
    waiting = [len(d) for d in deps]
    ready = [i for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for j in users[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(ready, j)
    placed = set(order)
    order += [i for i in range(len(nodes)) if i not in placed]  # a cycle: the stored order
    return [nodes[i] for i in order]


def _shapes(model: onnx.ModelProto) -> tuple[dict[str, tuple], dict[str, int]]:
    try:
        inferred = infer_shapes(model, strict_mode=False)
    except Exception:  # contrib ops or a malformed graph: what the file declares
        inferred = model
    shapes, types = {}, {}
    g = inferred.graph
    for vi in itertools.chain(g.input, g.value_info, g.output):
        tt = vi.type.tensor_type
        if tt.elem_type:
            types[vi.name] = tt.elem_type
        if tt.HasField("shape"):
            shapes[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim)
    for init in g.initializer:
        shapes[init.name] = tuple(init.dims)
        types[init.name] = init.data_type
    return shapes, types


def shapes_agree(a: tuple | None, b: tuple | None) -> bool | None:
    """True / False where both shapes say so, None where unknown."""
    if a is None or b is None:
        return None
    if len(a) != len(b):
        return False
    if any(x is not None and y is not None and x != y for x, y in zip(a, b)):
        return False
    return True if all(x is not None and y is not None for x, y in zip(a, b)) else None


def shape_fit(dev: tuple | None, ref: tuple | None) -> float | None:
    """1.0 where the shapes agree or are unknown, 0.9 where they differ but
    hold as many elements, None where they cannot be the same tensor."""
    if shapes_agree(dev, ref) is not False:
        return 1.0
    assert dev is not None and ref is not None     # shapes_agree says None (not False) where one is unknown
    if None not in dev and None not in ref and int(np.prod(dev)) == int(np.prod(ref)):
        return 0.9
    return None

