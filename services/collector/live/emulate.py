"""Device precisions onnxruntime's CPU provider has no kernels for, emulated
in the graph: BF16, TF32 and FP8 (E4M3FN, E5M2) builds of an FP32 model.

Each build rounds where such a device rounds and computes the rest in FP32,
so that a live run on the CPU reads as a run on that device would:

- ``bf16``: the weights are stored rounded, the model's inputs and every
  float output a node writes are rounded before anything reads them (the
  tensor a device stores); products sum in FP32, as tensor cores and NPU
  cube units do.
- ``tf32``: the operands of every Conv, MatMul and Gemm are rounded to
  11 significand bits (the weights once, the activations as they enter),
  everything else is FP32, as with cuDNN's and cuBLAS's TF32 modes.
- ``fp8_e4m3fn``, ``fp8_e5m2``: as ``bf16``, and the operands of every
  product are scaled per tensor so that their largest magnitude is the
  format's largest value, rounded to FP8 and scaled back (what FP8
  inference on H100-class GPUs does with per-tensor scales); sums in FP32,
  outputs in BF16.

Rounding is Veltkamp's splitting in FP32 (hi = (x - c) + c with
c = x·(2^s + 1) keeps 24 - s bits, to nearest), which any opset runs (a Cast
to bfloat16 needs opset 13, to FP8 opset 19); values too large for the
split (|x| > 1e30: masks of -3.4e38) are kept as they are. FP8 also
saturates at its largest finite value (448 for E4M3FN, 57344 for E5M2) and
rounds below its smallest normal on its subnormal grid.

``emulated(model, precision)`` returns the build and, for each original
tensor whose device value is its rounded copy, that copy's name: the
capture sends the rounded value under the original name.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from layerdiff.common.precision import BITS, PRECISIONS, round_significand

if TYPE_CHECKING:
    import onnx
    from onnx import helper, numpy_helper
else:
    from layerdiff.common.lazy import helper, numpy_helper, onnx

EMULATED = ("bf16", "tf32", "fp8_e4m3fn", "fp8_e5m2")
_PRODUCTS = {"Conv": (0, 1), "ConvTranspose": (0, 1), "MatMul": (0, 1), "Gemm": (0, 1)}
# largest finite value and smallest normal of each FP8 format
_FP8 = {"fp8_e4m3fn": (448.0, 2.0 ** -6, 2.0 ** -9), "fp8_e5m2": (57344.0, 2.0 ** -14, 2.0 ** -16)}
_SPLIT_LIMIT = 1e30       # beyond this x·(2^s + 1) may overflow: kept as is


def round_like_device(x: np.ndarray, precision: str) -> np.ndarray:
    """A float32 array rounded to ``precision``'s format (FP8: unscaled,
    saturating), as the build rounds a value (weights, and the tests)."""
    a = np.asarray(x, np.float32)
    if precision not in _FP8:
        r = round_significand(a, BITS[precision])
        # a weight beyond the format's range is held at its largest value (an
        # FP32 mask of -3.4e38 in BF16), as converters store it, never Inf
        top = PRECISIONS[precision].max_finite
        return np.where(np.isinf(r) & np.isfinite(a), np.copysign(np.float32(top), a), r).astype(np.float32)
    top, normal, step = _FP8[precision]
    with np.errstate(all="ignore"):
        r = round_significand(a, BITS[precision])
        r = np.where(np.abs(a) < normal, np.round(a / step) * step, r)
    return np.clip(r, -top, top).astype(np.float32)


def fp8_scaled(x: np.ndarray, precision: str) -> np.ndarray:
    """An operand in FP8 with one scale for the tensor (its largest
    magnitude on the format's largest value), scaled back."""
    a = np.asarray(x, np.float32)
    amax = float(np.max(np.abs(a))) if a.size else 0.0
    if not np.isfinite(amax) or amax == 0.0:
        return a
    scale = np.float32(amax / _FP8[precision][0])
    return (round_like_device(a / scale, precision) * scale).astype(np.float32)


def _storage(precision: str) -> str:
    """What a build stores outputs in: FP8 builds keep BF16 activations."""
    return "bf16" if precision in _FP8 else precision


class _Builder:
    def __init__(self, model: onnx.ModelProto, precision: str) -> None:
        self.model = model
        self.precision = precision
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.consts: dict[str, str] = {}
        self.count = 0

    def const(self, value: float) -> str:
        key = repr(float(value))
        if key not in self.consts:
            name = f"layerdiff_emulate_c{len(self.consts)}"
            self.inits.append(numpy_helper.from_array(np.asarray(value, np.float32), name))
            self.consts[key] = name
        return self.consts[key]

    def fresh(self, base: str) -> str:
        self.count += 1
        return f"{base}__{self.precision}_{self.count}"

    def node(self, op: str, ins: list[str], **attrs) -> str:
        out = self.fresh(ins[0] if ins else op)
        self.nodes.append(helper.make_node(op, ins, [out], name=out, **attrs))
        return out

    def rounded(self, x: str, precision: str) -> str:
        """Nodes that round float tensor x to ``precision``'s significand
        (BF16, TF32) or, for FP8, scale it per tensor into the format,
        round and scale back; the result's name."""
        if precision in _FP8:
            top, normal, step = _FP8[precision]
            amax = self.node("ReduceMax", [self.node("Abs", [x])], keepdims=0)
            scale = self.node("Div", [self.node("Max", [amax, self.const(1e-30)]), self.const(top)])
            y = self.node("Div", [x, scale])
            r = self._split(y, BITS[precision])
            on_grid = self.node("Mul", [self.node("Round", [self.node("Div", [y, self.const(step)])]),
                                        self.const(step)])
            sub = self.node("Less", [self.node("Abs", [y]), self.const(normal)])
            r = self.node("Clip", [self.node("Where", [sub, on_grid, r]), self.const(-top), self.const(top)])
            return self.node("Mul", [r, scale])
        return self._split(x, BITS[precision])

    def _split(self, x: str, bits: int) -> str:
        c = self.node("Mul", [x, self.const(2.0 ** (24 - bits) + 1.0)])
        hi = self.node("Add", [self.node("Sub", [x, c]), c])
        big = self.node("Greater", [self.node("Abs", [x]), self.const(_SPLIT_LIMIT)])
        return self.node("Where", [big, x, hi])


def _float_tensors(model: onnx.ModelProto) -> set[str]:
    shaped = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in [*shaped.graph.value_info, *shaped.graph.input,
                                                               *shaped.graph.output]}
    return {t for t, ty in types.items() if ty == onnx.TensorProto.FLOAT}


def emulated(model: onnx.ModelProto, precision: str) -> tuple[onnx.ModelProto, dict[str, str]]:
    """The build of ``model`` that computes as a ``precision`` device does,
    and original tensor -> the tensor carrying its device value."""
    if precision not in EMULATED:
        raise ValueError(f"no emulated build for {precision!r}")
    b = _Builder(model, precision)
    g = model.graph
    floats = _float_tensors(model)
    weights = {i.name for i in g.initializer}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    og = out.graph
    store = _storage(precision)
    for init in og.initializer:
        if init.data_type != onnx.TensorProto.FLOAT:
            continue
        product = _product_weight(g, init.name)
        if precision == "tf32" and not product:
            continue
        w = numpy_helper.to_array(init)
        w = fp8_scaled(w, precision) if precision in _FP8 and product else round_like_device(w, store)
        init.CopyFrom(numpy_helper.from_array(w, init.name))
    view: dict[str, str] = {}
    renamed: dict[str, str] = {}       # tensor -> what its readers read instead (graph outputs keep the raw
    #                                    value under their name; the capture reads the view)

    def read(t: str) -> str:
        return renamed.get(t, t)

    new_nodes: list[onnx.NodeProto] = []
    if precision != "tf32":
        for i in og.input:
            if i.name in floats and i.name not in weights:
                b.nodes = []
                renamed[i.name] = b.rounded(i.name, store)
                new_nodes += b.nodes
    for n in og.node:
        n.input[:] = [read(t) if t else t for t in n.input]
        if precision in ("tf32", *_FP8) and n.op_type in _PRODUCTS and not n.domain:
            b.nodes = []
            for k in _PRODUCTS[n.op_type]:
                if k < len(n.input) and n.input[k] and n.input[k] not in weights:
                    n.input[k] = b.rounded(n.input[k], precision)
            new_nodes += b.nodes
        new_nodes.append(n)
        if precision != "tf32" and n.op_type != "Constant":
            for t in n.output:
                if t and t in floats:
                    b.nodes = []
                    renamed[t] = view[t] = b.rounded(t, store)
                    new_nodes += b.nodes
    del og.node[:]
    og.node.extend(new_nodes)
    og.initializer.extend(b.inits)
    return out, view


def _product_weight(g: onnx.GraphProto, name: str) -> bool:
    return any(n.op_type in _PRODUCTS and name in [n.input[k] for k in _PRODUCTS[n.op_type] if k < len(n.input)]
               for n in g.node)
