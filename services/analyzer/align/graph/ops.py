"""The ONNX op tables graph alignment works from (which ops are reshapes,
commutative, activations, chain heads...), and the small name and layout
helpers every part of it shares."""
from __future__ import annotations

import re

# the float element types, as every part of alignment asks them of this module
from layerdiff.common.onnxgraph import FLOAT_TYPES as FLOAT_TYPES

RESHAPES = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze"})
COMMUTATIVE = frozenset({"Add", "Mul", "Sum", "Max", "Min", "Mean", "And", "Or", "Xor", "Equal"})
VARIADIC = frozenset({"Concat", "Sum", "Max", "Min", "Mean"})
ACTIVATIONS = frozenset({"Relu", "Clip", "LeakyRelu", "Sigmoid", "HardSigmoid", "Tanh", "HardSwish", "Elu",
                         "Softplus", "Selu", "ThresholdedRelu"})
ALIASES = {
    "Upsample": {"Resize"}, "Resize": {"Upsample"}, "Sum": {"Add"}, "Add": {"Sum"},
    "Flatten": {"Reshape"}, "Reshape": {"Flatten", "Squeeze", "Unsqueeze"},
    "Squeeze": {"Reshape"}, "Unsqueeze": {"Reshape"},
}
CHAIN_HEADS = {
    "Conv": {"Conv"}, "FusedConv": {"Conv"}, "NhwcConv": {"Conv"}, "ConvTranspose": {"ConvTranspose"},
    "Gemm": {"Gemm", "MatMul"}, "FusedGemm": {"Gemm", "MatMul"}, "MatMul": {"MatMul", "Gemm"},
}
ELEMENTWISE = ACTIVATIONS | {"Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Exp", "Log", "Abs", "Neg", "Erf",
                             "Max", "Min", "Sum", "Reciprocal", "Floor", "Ceil", "Round", "Sign"}
NCHWC_DOMAIN = "com.microsoft.nchwc"
IGNORED_ATTRS = frozenset({"activation", "activation_params", "channels", "channels_last", "auto_pad"})

# ops a transpose optimizer moves a Transpose past (see rewrites.RewriteFollower.commute)
COMMUTING = frozenset({"Slice", "Squeeze", "Transpose", "ReorderInput"}) | (ELEMENTWISE - COMMUTATIVE
                                                                           - {"Sub", "Div", "Pow"})

_SEP = re.compile(r"[/.:\\ ]+")


def layout_perm(layout: str) -> tuple[int, ...]:
    """The axes of a ``perm:`` layout (device axis a = reference axis p[a]); () for none."""
    return tuple(int(x) for x in layout[5:].split(",")) if layout.startswith("perm:") else ()


def moves_channels_first(perm) -> bool:
    """Is this Transpose NHWC -> NCHW (0, n-1, 1, ..., n-2)?"""
    return perm is not None and len(perm) >= 3 and list(perm) == [0, len(perm) - 1, *range(1, len(perm) - 1)]


def norm_name(name: str) -> str:
    return _SEP.sub("_", name).strip("_").lower()
