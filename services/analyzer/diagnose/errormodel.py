"""The error a node's own arithmetic explains, from its precision.

A verdict compares two numbers: the error a node *adds* (its device output
against the reference node re-run in FP32 on the device's own inputs, or
estimated from what it read) and the error its precision *explains*. This
module gives the second, as a relative RMS error (the RMS of the expected
error over the RMS of the output), with the words that say where it came
from ("bf16 over K=3072").

Model (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed.,
2002, §2.2 and §3.1; Higham & Mary, "A new approach to probabilistic
rounding error analysis", SIAM J. Sci. Comput. 41(5), 2019). Rounding a
value x to a format with unit roundoff u gives fl(x) = x(1 + δ), |δ| <= u;
the probabilistic analysis takes the δ independent, mean zero, here uniform
on [-u, u] (variance u²/3). A node of reduction length K computes
y = Σ_k t_k, t_k = x_k·w_k (a Conv's or MatMul's products; a sum's or
mean's terms with w = 1):

- its operands rounded to u_op: error Σ_k t_k(δx_k + δw_k), variance
  (2/3)·u_op²·Σ_k t_k²;
- its running sum rounded to u_acc after each addition (recursive
  summation): error Σ_j s_j·ε_j over the partial sums s_j, variance
  (1/3)·u_acc²·Σ_j s_j² <= (1/3)·u_acc²·(K/2)·Σ_k t_k² for terms of random
  sign (Σ_j s_j² ≈ K²m²/2 with Σ_k t_k² = K·m²); blocked and pairwise
  summation, which BLAS and GPUs use, do better (log K instead of K);
- its output stored to u_st: variance (1/3)·u_st²·y².

Relative to y, with ρ² = Σ_k t_k² / y² (1 when the terms do not cancel;
the magnitudes involved, where they are known):

    rel² = (2/3)·u_op²·ρ² + (K/6)·u_acc²·ρ² + (1/3)·u_st²        (E1)

The deterministic worst case is Higham's γ_K = K·u / (1 − K·u) times
Σ|t_k| / |y| (Lemma 3.1); Higham & Mary's bound λ·√K·u·Σ|t_k| holds with
probability at least 1 − 2·exp(−λ²(1 − u)²/2) for each element. E1 is the
RMS of those errors: over a tensor of many elements the observed relative
RMS error concentrates near it. A verdict allows FACTOR times it, for what
the model leaves out (kernels that reorder sums, Winograd and FFT
convolutions, flash attention's rescaling, a device's approximate exp).

Element-wise arithmetic (Add, Mul, Sigmoid, Exp, ...) rounds its result
once, and a transcendental function is itself within about one ulp of its
precision: rel² = c²·u_st²/3 with c = 1 (arithmetic) or 2 (functions),
with ρ the operands' RMS over the output's for Add/Sub (cancellation).
Exact ops (Reshape, Transpose, Concat, Slice, Relu, MaxPool, Identity,
casts up) add nothing: their budget is 0 unless they store narrower than
they read. Softmax, LayerNorm and the normalizations are reductions over
their axis (K = that axis's length) followed by element-wise work.

INT8 (QDQ): a quantized tensor's error is its step s: uniform rounding on
the grid gives an RMS of s/√12; a quantized product of reduction length K
adds √K·√(s_w²·rms_x² + s_x²·rms_w²)/√12 (see ``int8_rms``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from layerdiff.analyzer.compare.compiled import kernels
from layerdiff.analyzer.compare.squares import pair_square_sums, square_sums, takes_pair
from layerdiff.common.precision import PRECISIONS, Precision, build_of_dtype, coarser, node_precision, of_dtype

# A node adds a computation error when its own error exceeds FACTOR times
# what its precision explains (E1 as an RMS; the observed RMS of rounding
# stays within 3x of E1 on random data, see tests/test_errormodel.py).
FACTOR = 8.0
# Where the block of a tensor that carries an error is judged on its own.
LOCAL_FACTOR = 8.0
# No device is blamed for a relative error below this, whatever its
# precision (FP32 kernels that reorder or transform sums reach ~1e-6).
FLOOR = 2e-5
# What a node may pass on of the error it read, as a multiple of that
# error, before its own part needs a closer look (the re-run alone): the
# relative error through a product, a sum or an activation grows by a small
# factor at most where its terms do not cancel.
GROWTH = 1.5
# Past this relative error in what it read, growth says nothing: a small
# bug of the node's own hides in what it passes on (INT8 noise of 18 %,
# values after a quantization break). Such a node is always re-run alone.
READ_TOO_FAR = 0.1
# Without a re-run alone (two dumps, no model) the error a node adds can
# only be told from how much its error grew beyond what it read. How much
# a node passes on depends on its op: a product's cancellation can make its
# relative error many times its input's (a classifier's last MatMul: 8.8x on
# a clean FP16 run), an activation's hardly more than once. Per kind, the
# largest growth clean FP16, BF16, TF32 and INT8 runs of the six calibration
# architectures showed (bench/bench_verdicts.py), with margin; for the
# worst block of a tensor against the worst of what it read, the same.
DUMP_GROWTH = {"product": 12.0, "reduction": 10.0, "norm": 4.0}
DUMP_GROWTH_DEFAULT = 3.0
DUMP_BLOCK_GROWTH = {"product": 6.0, "reduction": 10.0}
DUMP_BLOCK_GROWTH_DEFAULT = 4.0
# Rounding spreads over a tensor: no window of a product's output channels
# carries a relative error many times the rest's (clean BF16 and FP16
# captures of seven torchvision models, 600 products: at most 2.6x; on an
# H200, 25 clean BF16, FP16, TF32 and FP32 runs of six: no false call). A
# window past LOCAL_CONTRAST times the rest is the product's own error
# (local_own).
LOCAL_CONTRAST = 4.0
# a tensor too small to cut into blocks may hold all its error in one: a
# block of 1/16 of it then carries 4 times its relative RMS error
UNCUT_BLOCK = 4.0

EXACT_OPS = frozenset({
    "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Concat", "Split", "Slice", "Gather", "GatherND",
    "GatherElements", "ScatterND", "ScatterElements", "Expand", "Tile", "Pad", "Identity", "Dropout", "Relu",
    "MaxPool", "GlobalMaxPool", "Max", "Min", "Clip", "Where", "ReduceMax", "ReduceMin", "ArgMax", "ArgMin",
    "TopK", "DepthToSpace", "SpaceToDepth", "Neg", "Abs", "Sign", "Floor", "Ceil", "Round", "Shape", "Size",
    "ConstantOfShape", "Constant", "Range", "NonZero", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual",
    "Not", "And", "Or", "Xor", "Resize", "Upsample", "Compress", "ReorderInput", "ReorderOutput", "Trilu",
    "OneHot", "ReverseSequence", "Mod", "Cast", "CastLike", "QuantizeLinear", "DequantizeLinear",
    # PyTorch modules and ATen operators
    "ReLU", "ReLU6", "MaxPool2d", "MaxPool1d", "view", "reshape", "permute",
    "transpose", "t", "cat", "stack", "slice", "select", "expand", "clone", "_unsafe_view", "relu", "relu_",
    "max_pool2d_with_indices", "max_pool2d", "hardtanh", "hardtanh_", "contiguous", "unsqueeze", "squeeze",
    "split", "chunk", "index", "embedding", "Embedding", "detach", "_to_copy", "copy_", "alias", "split_with_sizes",
    "unbind", "flatten", "as_strided", "new_zeros", "zeros_like", "constant_pad_nd", "pad", "upsample_nearest2d",
})
FUNCTIONS = frozenset({
    "Exp", "Log", "Sqrt", "Reciprocal", "Sigmoid", "Tanh", "Erf", "Gelu", "FastGelu", "BiasGelu", "Softplus",
    "Softsign", "Elu", "Selu", "Celu", "Mish", "HardSigmoid", "HardSwish", "Sin", "Cos", "Pow", "QuickGelu",
    "GELU", "SiLU", "Hardswish", "Hardsigmoid", "gelu", "silu", "sigmoid", "tanh",
    "exp", "log", "sqrt", "rsqrt", "pow", "erf", "hardswish", "hardsigmoid", "softplus", "elu", "silu_",
})
SUMS = frozenset({"Add", "Sub", "Sum", "add", "add_", "sub", "rsub"})
# Conv-like: K = a weight's fan-in (input channels per group times the kernel)
_CONV_OPS = frozenset({"Conv", "FusedConv", "ConvInteger", "QLinearConv", "ConvTranspose", "Conv1d", "Conv2d",
                       "Conv3d", "ConvTranspose2d", "convolution", "conv2d", "conv1d", "_convolution"})
# Product-like: K = the contracted axis
_MATMUL_OPS = frozenset({"MatMul", "Gemm", "FusedGemm", "FusedMatMul", "MatMulInteger", "QLinearMatMul", "Linear",
                         "linear", "mm", "bmm", "addmm", "matmul", "baddbmm", "addmv", "mv", "Einsum"})
_AXIS_REDUCTIONS = frozenset({"Softmax", "LogSoftmax", "softmax", "_softmax", "log_softmax", "_log_softmax",
                              "LpNormalization", "Softmax2d"})
_MEAN_OPS = frozenset({"ReduceSum", "ReduceMean", "ReduceL1", "ReduceL2", "ReduceSumSquare", "ReduceLogSumExp",
                       "ReduceLogSum", "ReduceProd", "GlobalAveragePool", "AveragePool", "AdaptiveAvgPool2d",
                       "AvgPool2d", "mean", "sum", "avg_pool2d", "adaptive_avg_pool2d", "_adaptive_avg_pool2d",
                       "GlobalLpPool", "LpPool"})
_NORMS = frozenset({"LayerNormalization", "SkipLayerNormalization", "SimplifiedLayerNormalization",
                    "InstanceNormalization", "GroupNormalization", "LayerNorm", "GroupNorm", "RMSNorm",
                    "native_layer_norm", "layer_norm", "group_norm", "native_group_norm", "rms_norm",
                    "InstanceNorm2d", "BatchNormalization", "BatchNorm2d", "BatchNorm1d",
                    "_native_batch_norm_legit_no_training", "batch_norm", "native_batch_norm"})


def op_kind(op_type: str) -> str:
    """'exact', 'function', 'sum', 'elementwise', 'product', 'reduction' or
    'norm' for an ONNX op, a PyTorch module class or an ATen operator
    (``aten.convolution.default`` is read as ``convolution``)."""
    op = aten_name(op_type)
    if op in EXACT_OPS:
        return "exact"
    if op in _CONV_OPS or op in _MATMUL_OPS or op in ("Attention", "MultiHeadAttention", "MultiheadAttention",
                                                      "scaled_dot_product_attention"):
        return "product"
    if op in _AXIS_REDUCTIONS or op in _MEAN_OPS:
        return "reduction"
    if op in _NORMS:
        return "norm"
    if op in FUNCTIONS:
        return "function"
    if op in SUMS:
        return "sum"
    return "elementwise"


def aten_name(op_type: str) -> str:
    """``aten.convolution.default`` -> ``convolution``; anything else as it is."""
    if op_type.startswith("aten."):
        parts = op_type.split(".")
        return parts[1] if len(parts) > 1 else op_type
    return op_type


@dataclass(frozen=True)
class Budget:
    """What a node's own arithmetic explains: a relative RMS error, and how."""
    rel: float
    precision: str
    k: int | None = None
    rho: float = 1.0
    words: str = ""
    kind: str = ""
    step: float = 0.0          # the output grid's step (INT8), absolute
    step_rel: float = 0.0      # the part of ``rel`` that step makes, over the whole tensor

    def explains(self) -> str:
        """'bf16 over K=3072 explains 4e-03', or that the op is exact."""
        if self.kind == "exact":
            return f"{self.words} explains {self.rel:.3g} (an exact op: only the rounding of what it stores)"
        return f"{self.words} explains {self.rel:.3g}"

    @property
    def allowed(self) -> float:
        """The own error a node may add before it is a computation error."""
        return max(FACTOR * self.rel, FLOOR)

    def allowed_in(self, block: Block | None) -> float:
        """The same for a block of its output. A grid's step is absolute:
        over a block of small values it weighs more than over the whole (by
        the tensor's RMS over the block's, at most 4: a block's error is
        taken relative to at least a quarter of the tensor's RMS)."""
        rel = self.rel
        if self.step > 0 and block is not None and block.scale > 0:
            step_rel = self.step / math.sqrt(12.0) / block.scale
            rel = math.sqrt(max(rel * rel - self.step_rel ** 2, 0.0) + step_rel ** 2)
        return max(LOCAL_FACTOR * rel, FLOOR)


def allowed(budget: Budget | None, block: Block | None = None, locally: bool = False) -> float:
    """What a node may add, over the whole or (``locally``) in ``block``
    (``budget`` None: no precision model applies, the floor)."""
    if budget is None:
        return FLOOR
    return budget.allowed_in(block) if locally else budget.allowed


def local_own(block: Block | None, budget: Budget | None, k_unknown: bool = False) -> bool:
    """Whether ``block``, a window of a product's output channels (features),
    holds an error of the product's own: LOCAL_CONTRAST times the rest of
    the tensor's relative error and past what the precision explains in a
    block. Each output channel of a product sums over every channel it read
    (K known and past a kernel's size: a depthwise convolution keeps its
    channels apart), so no error it read can single out some of them;
    rounding spreads over all. Never for an INT8 grid, whose step weighs
    differently over small and large values. Elsewhere a block can come in
    through what the node read (a tile, a broadcast map, the channels of an
    element-wise op): the growth rules judge it. ``k_unknown``: a K not
    known yet (while the stream is under way) may still prove large: worth
    a closer look."""
    if block is None or budget is None or budget.step > 0 or budget.precision in ("int8", "int4"):
        return False
    if budget.kind != "product" or block.key not in ("channels", "features"):
        return False
    if (not budget.k and not k_unknown) or (budget.k and budget.k <= 49):
        return False
    return block.contrast > LOCAL_CONTRAST and block.rel > budget.allowed_in(block)


def relative_rms(precision: Precision, kind: str, k: int | None = None, rho: float = 1.0) -> float:
    """E1 (and its element-wise and exact forms) for one node."""
    u_op, u_acc, u_st = precision.operand, precision.accumulate, precision.storage
    if kind == "exact":
        # its values are what it read, unless it stores them narrower (a
        # weight an FP16 build holds in FP16, read as FP32 by the reference)
        return math.sqrt(1.0 / 3.0) * u_st
    if kind in ("product", "reduction", "norm"):
        n = max(int(k or 1), 1)
        # the normalizations divide by a reduction and scale element-wise
        extra = (1.0 / 3.0) * u_st ** 2 * (4.0 if kind == "norm" else 1.0)
        operands = (2.0 / 3.0) * u_op ** 2 if kind == "product" else (1.0 / 3.0) * u_st ** 2
        return math.sqrt(operands * rho ** 2 + (n / 6.0) * u_acc ** 2 * rho ** 2 + extra)
    c = 2.0 if kind == "function" else 1.0
    return math.sqrt((c * c / 3.0) * u_st ** 2 * max(rho, 1.0) ** 2)


def budget(op_type: str, precision: Precision, k: int | None = None, rho: float | None = None,
           step: float = 0.0, scale: float = 0.0) -> Budget:
    """The node's budget. ``step``: the grid its output is handed over on
    (INT8, read from the device values), whose rounding, uniform over a
    step, adds an RMS of step/√12 to an output of RMS ``scale``."""
    # a job asks for the same few (an op, its precision, its K) twice a
    # tensor, hundreds of times: each made once (the output's RMS counts
    # only with a step, so that it is no part of the question without one)
    return _budget(op_type, precision, k, rho, step, scale if step > 0 else 0.0)


@lru_cache(maxsize=4096)
def _budget(op_type: str, precision: Precision, k: int | None, rho: float | None, step: float,
            scale: float) -> Budget:
    kind = op_kind(op_type)
    r = 1.0 if rho is None or not math.isfinite(rho) or rho <= 0 else float(rho)
    rel = relative_rms(precision, kind, k, r)
    words = precision.name
    if kind in ("product", "reduction", "norm") and k:
        words += f" over K={k}"
    if rho is not None and r > 1.05:
        words += f", terms {r:.3g}x the result"
    step_rel = 0.0
    if step > 0 and scale > 0 and math.isfinite(step) and math.isfinite(scale):
        step_rel = step / math.sqrt(12.0) / scale
        rel = math.sqrt(rel * rel + step_rel ** 2)
        words += f", output step {step:.3g}"
    return Budget(rel, precision.name, k if kind in ("product", "reduction", "norm") else None, r, words, kind,
                  step if step_rel else 0.0, step_rel)


def int8_rms(k: int, s_w: float, s_x: float, rms_x: float, rms_w: float, s_y: float = 0.0) -> float:
    """The RMS error of a quantized product of reduction length k: weight
    step s_w, input step s_x (each rounding uniform, variance s²/12) and
    the output's re-quantization step s_y."""
    return math.sqrt(k * (s_w ** 2 * rms_x ** 2 + s_x ** 2 * rms_w ** 2) / 12.0 + s_y ** 2 / 12.0)


# ------------------------------------------------------------ reduction length

def onnx_reduction_length(node, shapes: dict[str, tuple], weight_shapes: dict[str, tuple]) -> int | None:
    """K of an ONNX node from its weights' and inputs' shapes (None where
    they do not say): a Conv's fan-in, a MatMul/Gemm's contracted axis, the
    reduced axes of a reduction, a normalization's normalized axes."""
    op = node.op_type
    attrs = {a.name: a for a in node.attribute}

    def shape(i: int) -> tuple | None:
        if i >= len(node.input) or not node.input[i]:
            return None
        return weight_shapes.get(node.input[i]) or shapes.get(node.input[i])

    def ints(name: str) -> list[int] | None:
        a = attrs.get(name)
        return list(a.ints) if a is not None and a.ints else (None if a is None else [a.i])

    if op in ("Conv", "FusedConv", "ConvInteger", "QLinearConv"):
        w = shape(3 if op == "QLinearConv" else 1)
        return int(np.prod(w[1:])) if w and len(w) > 1 else None
    if op == "ConvTranspose":
        w = shape(1)
        if not w or len(w) < 3:
            return None
        group = attrs["group"].i if "group" in attrs else 1
        strides = ints("strides") or [1] * (len(w) - 2)
        return max(int(w[0] // max(group, 1) * np.prod(w[2:]) / max(np.prod(strides), 1)), 1)
    if op in ("MatMul", "FusedMatMul", "MatMulInteger", "QLinearMatMul"):
        a = shape(0)
        return int(a[-1]) if a else None
    if op in ("Gemm", "FusedGemm"):
        a = shape(0)
        if not a or len(a) != 2:
            return None
        return int(a[0] if "transA" in attrs and attrs["transA"].i else a[1])
    x = shape(0)
    if not x:
        return None
    rank = len(x)
    if op in ("Softmax", "LogSoftmax", "LpNormalization", "Hardmax"):
        axis = attrs["axis"].i if "axis" in attrs else -1
        return int(x[axis % rank]) if rank else None
    if op in ("LayerNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization"):
        axis = attrs["axis"].i if "axis" in attrs else -1
        return int(np.prod(x[axis % rank:])) if rank else None
    if op in ("GlobalAveragePool", "GlobalLpPool", "InstanceNormalization"):
        return int(np.prod(x[2:])) if rank > 2 else None
    if op == "GroupNormalization":
        groups = attrs["num_groups"].i if "num_groups" in attrs else 1
        return int(np.prod(x[1:]) // max(groups, 1)) if rank > 1 else None
    if op in ("AveragePool", "LpPool"):
        k = ints("kernel_shape")
        return int(np.prod(k)) if k else None
    if op.startswith("Reduce"):
        axes = ints("axes")
        if axes is None and len(node.input) > 1:
            axes = list(weight_shapes.get("__axes__" + node.input[1], ()) or ())
        if not axes:
            keep_empty = "noop_with_empty_axes" in attrs and attrs["noop_with_empty_axes"].i
            return None if keep_empty else int(np.prod(x))
        return int(np.prod([x[a % rank] for a in axes]))
    return None


def torch_reduction_length(op_type: str, input_shapes: list[tuple], attrs: dict) -> int | None:
    """K of a PyTorch module call or ATen operator (or of an ONNX MatMul in a
    dump without its model), from its input shapes and the arguments or
    module attributes a capture recorded (``attrs``)."""
    op = aten_name(op_type)
    cls = attrs.get("class", "")
    x = input_shapes[0] if input_shapes else None
    positional = attrs.get("positional") or []
    if op in ("_softmax", "softmax", "_log_softmax", "log_softmax") and len(positional) > 1 \
            and isinstance(positional[1], int):
        attrs = {**attrs, "dim": positional[1]}
    if op in ("native_layer_norm", "layer_norm") and len(positional) > 1 and isinstance(positional[1], list):
        attrs = {**attrs, "normalized_shape": positional[1]}
    if op in ("mean", "sum") and len(positional) > 1 and isinstance(positional[1], (int, list)):
        attrs = {**attrs, "dim": positional[1]}
    if cls in ("Conv1d", "Conv2d", "Conv3d") or op in ("Conv1d", "Conv2d", "Conv3d"):
        ks = attrs.get("kernel_size") or []
        cin, groups = attrs.get("in_channels"), attrs.get("groups", 1) or 1
        return int(cin // groups * int(np.prod(ks))) if cin and ks else None
    if cls == "Linear" or op == "Linear":
        return int(attrs["in_features"]) if attrs.get("in_features") else (int(x[-1]) if x else None)
    if op in ("convolution", "_convolution", "conv2d", "conv1d"):
        w = input_shapes[1] if len(input_shapes) > 1 else None
        return int(np.prod(w[1:])) if w and len(w) > 1 else None
    if op in ("mm", "bmm", "matmul", "linear", "addmv", "mv", "MatMul"):
        # an ONNX MatMul in a dump without its model too: A's last axis, from the input it recorded
        return int(x[-1]) if x else None
    if op in ("addmm", "baddbmm"):
        m = input_shapes[1] if len(input_shapes) > 1 else None
        return int(m[-1]) if m else None
    if op in ("_softmax", "softmax", "_log_softmax", "log_softmax") or cls in ("Softmax", "LogSoftmax"):
        dim = attrs.get("dim", -1)
        return int(x[int(dim) % len(x)]) if x else None
    if op in ("native_layer_norm", "layer_norm") or cls in ("LayerNorm", "RMSNorm"):
        shape = attrs.get("normalized_shape")
        return int(np.prod(shape)) if shape else (int(x[-1]) if x else None)
    if op in ("mean", "sum") and x:
        dims = attrs.get("dim")
        if dims is None:
            return int(np.prod(x))
        dims = [dims] if isinstance(dims, int) else list(dims)
        return int(np.prod([x[d % len(x)] for d in dims]))
    if (op in ("adaptive_avg_pool2d", "_adaptive_avg_pool2d", "avg_pool2d")
            or cls in ("AdaptiveAvgPool2d", "AvgPool2d")) and x and len(x) >= 3:
        out = attrs.get("output_size")
        if out:
            out = [out, out] if isinstance(out, int) else list(out)
            return max(int(np.prod(x[-2:]) // max(int(np.prod([o or 1 for o in out])), 1)), 1)
        ks = attrs.get("kernel_size")
        return int(np.prod(ks)) if ks else None
    if cls in ("BatchNorm2d", "BatchNorm1d", "GroupNorm", "InstanceNorm2d") and x and len(x) > 2:
        return int(np.prod(x[2:]))
    return None


# ------------------------------------------------------------ observed errors

def rel_rms(err: np.ndarray, ref: np.ndarray) -> float:
    """||err|| / ||ref|| over the finite pairs (0 for an all-zero pair, inf
    for an error against an all-zero reference)."""
    e = np.asarray(err, np.float64).ravel()
    r = np.asarray(ref, np.float64).ravel()
    # two passes where every value is finite (a finite sum of squares says
    # so), the pairs sorted out only where one is not
    num2, den2 = float(np.einsum("i,i->", e, e)), float(np.einsum("i,i->", r, r))     # not BLAS (see evidence)
    if not (math.isfinite(num2) and math.isfinite(den2)):
        ok = np.isfinite(e) & np.isfinite(r)
        if not ok.all():
            e, r = e[ok], r[ok]
        num2, den2 = float(np.sum(e * e)), float(np.sum(r * r))
    num, den = math.sqrt(num2), math.sqrt(den2)
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


@dataclass(frozen=True)
class Block:
    """The worst part of a tensor: where it lies, and its relative RMS error."""
    where: str
    rel: float
    share: float        # its fraction of the tensor's elements
    scale: float = 0.0  # the RMS its error is taken relative to (the reference's there, at least a quarter of all)
    rest: float = -1.0  # the relative RMS error of the rest of the tensor, alike (-1: the block is all of it)
    key: str = ""       # a window along one axis: that axis ("channels"...), and its indices [start, stop)
    start: int = 0
    stop: int = 0

    @property
    def contrast(self) -> float:
        """How many times the rest's relative error the block's is (inf where
        the rest is exact; 0 where there is no rest)."""
        if self.rest < 0:
            return 0.0
        return self.rel / self.rest if self.rest > 0 else (math.inf if self.rel > 0 else 0.0)


def first_cut(shape: tuple, layout: str = "NCHW") -> tuple[int, int]:
    """The axes (first, last) whose squares' sums ``worst_blocks`` takes
    first (``square_sums``' kept axes): the channels of an image tensor
    (its rows and columns for NHWC), else the rows (the last axis before the
    features longer than 1), else the features."""
    nd = len(shape)
    if nd == 4:
        return (1, 2) if layout == "NHWC" else (1, 1)
    rows = next((ax for ax in range(nd - 2, -1, -1) if shape[ax] > 1), None)
    return (nd - 1, nd - 1) if rows is None else (rows, rows)


def worst_blocks(err: np.ndarray | None, ref: np.ndarray, layout: str = "NCHW",
                 min_elements: int = 8, dev: np.ndarray | None = None,
                 first_sums=None) -> tuple[Block | None, Block | None]:
    """The block of a tensor whose relative RMS error is the largest: a
    sixteenth of the channels or a tile of a quarter of the rows by a quarter
    of the columns of an image tensor (NCHW, or NHWC for TensorFlow), a
    sixteenth of the features (last axis) or of the rows (the axis before
    it) of anything else, at every offset (a broken kernel's block need not
    start where a sixteenth does); and the worst window of the channels
    (features), measured without the worst tile (rows) where that stands
    out, whose error would hide theirs (a class token's inherited row). A
    block's error is taken relative to the reference's RMS there, but never
    to less than a quarter of the tensor's RMS, so that near-zero values do
    not read as a large relative error. Marginal sums of the squares
    (float64) and their running sums. (None, None) for a tensor too small to
    cut (under 4 blocks' worth). ``err`` None, ``dev`` given: the error is
    ``dev - ref`` (float32, or float64 for a float64 reference), its sums
    taken from the two tensors without it made whole where their types
    allow. ``first_sums``: what ``pair_square_sums(ref, dev, *first_cut(...))``
    gave, already made by the caller (not taken again)."""
    r = np.asarray(ref)
    d = None if dev is None else np.asarray(dev)
    if err is None and d is not None and not takes_pair(r.dtype, d.dtype):
        err = np.subtract(d, r, dtype=np.float64 if r.dtype == np.float64 else np.float32)
    e = np.asarray(err) if err is not None else None
    if (e is not None and e.shape != r.shape) or (e is None and (d is None or d.shape != r.shape)) \
            or r.size < 4 * min_elements or r.ndim == 0:
        return None, None

    def both(first: int, last: int, region: tuple | None = None):
        """((error², reference²) for each index of axes first..last,
        (error², reference²) for each index of the axes after them)."""
        rr = r if region is None else r[region]
        if e is None:
            assert d is not None      # no error given: the device tensor was (checked above)
            got = pair_square_sums(rr, d if region is None else d[region], first, last)
            assert got is not None    # the types were checked above
            return got
        ee = e if region is None else e[region]
        (se_k, se_q), (sr_k, sr_q) = square_sums(ee, first, last), square_sums(rr, first, last)
        return (se_k, sr_k), (se_q, sr_q)

    shape, elements, nd = r.shape, r.size, r.ndim
    sums: dict[str, tuple[np.ndarray, np.ndarray]] = {}     # axis -> (error², reference²) per index

    # The squares' sums (error², reference²) for each index of the mixed
    # axis (channels, features) and of the other cut (the image's rows and
    # columns, or the rows), both from one pass over each tensor.
    cut = first_cut(shape, layout)
    kept, after = first_sums if first_sums is not None and e is None else both(*cut)
    rows = None
    if nd == 4:
        c_axis, (h_axis, w_axis) = (3, (1, 2)) if layout == "NHWC" else (1, (2, 3))
        mix_axis, mix_key = c_axis, "channels"
        (se_o, sr_o), (se_m, sr_m) = (kept, after) if layout == "NHWC" else (after, kept)
    else:
        mix_axis, mix_key = nd - 1, "features" if nd > 1 else "elements"
        if cut[0] == nd - 1:        # no rows: the features alone
            (se_m, sr_m), (se_o, sr_o) = kept, after
        else:     # the rows; the axes between them and the features are 1s
            rows = cut[0]
            (se_o, sr_o), (se_m, sr_m) = kept, after
            se_m, sr_m = se_m.reshape(-1), sr_m.reshape(-1)
    by_mix = (se_m, sr_m, elements // shape[mix_axis])
    e_all, r_all = float(se_m.sum()), float(sr_m.sum())
    floor = r_all / elements / 16.0

    def consider(se: np.ndarray, sr: np.ndarray, size: tuple[int, ...], n: int, label, span=None,
                 whole=None) -> Block | None:
        """The worst of the windows of ``size`` over the sums ``se``, ``sr``
        (one or two axes), ``n`` elements each (``whole``: the error²,
        reference², elements and floor they are taken out of, the tensor's
        by default). Compiled: the running sums, each window's relative
        error and the largest, as ``_window_sums`` and numpy give them."""
        if n < min_elements:
            return None
        e_tot, r_tot, size_all, fl = whole or (e_all, r_all, elements, floor)
        grid = se.shape if se.ndim == 2 else (1, se.size)
        got = np.empty(4)
        i = kernels()._best_window(np.ascontiguousarray(se, np.float64).reshape(grid),
                                   np.ascontiguousarray(sr, np.float64).reshape(grid),
                                   size[0] if se.ndim == 2 else 1, size[-1], float(n), float(fl), got)
        if i < 0:
            return None
        rel, den, se_w, sr_w = (float(v) for v in got)
        cols_w = grid[1] - size[-1] + 1      # windows along a row
        at = divmod(int(i), cols_w)[2 - se.ndim:]      # (row, column) of the window; (column,) in one dimension
        return Block(label(at), rel, n / elements, math.sqrt(den),
                     _rest_rel(e_tot - se_w, r_tot - sr_w, size_all - n, fl), *(span(at) if span else ("", 0, 0)))

    def windows(axis: int, key: str, given, whole=None) -> Block | None:
        se, sr, per = given
        if whole is None:
            sums[key] = (se, sr)
        w = max(1, round(shape[axis] / 16))
        return consider(se, sr, (w,), per * w,
                        lambda at: f"{key} {at[0]}..{at[0] + w - 1}" if not key.startswith("rows of") else
                        f"rows {at[0]}..{at[0] + w - 1} of{key[len('rows of'):]}",
                        lambda at: (key, int(at[0]), int(at[0]) + w), whole)

    mixed = windows(mix_axis, mix_key, by_mix)
    if nd == 4:
        se, sr, per = se_o, sr_o, elements // (shape[h_axis] * shape[w_axis])
        th, tw = max(1, round(shape[h_axis] / 4)), max(1, round(shape[w_axis] / 4))
        other = consider(se, sr, (th, tw), per * th * tw,
                         lambda at: f"rows {at[0]}..{at[0] + th - 1}, columns {at[1]}..{at[1] + tw - 1}",
                         lambda at: ("tile", int(at[0]) * shape[w_axis] + int(at[1]), 0))
        region = None
        if other is not None:
            h0, w0 = divmod(other.start, shape[w_axis])
            region = tuple(slice(h0, h0 + th) if a == h_axis else slice(w0, w0 + tw) if a == w_axis else slice(None)
                           for a in range(nd))
            other = Block(other.where, other.rel, other.share, other.scale, other.rest)
    else:
        other = windows(rows, f"rows of axis {rows}", (se_o, sr_o, elements // shape[rows])) \
            if rows is not None else None
        region = tuple(slice(other.start, other.stop) if a == rows else slice(None) for a in range(nd)) \
            if other is not None else None
    best = max((b for b in (mixed, other) if b is not None), key=lambda b: b.rel, default=None)
    axis_block = mixed
    if other is not None and region is not None and other.contrast > LOCAL_CONTRAST and mixed is not None:
        # a part that stands out elsewhere (inherited, most often) would hide
        # a block of channels: those are measured without it too
        se_x, sr_x = both(mix_axis, mix_axis, region)[0]
        n_x = int(np.prod([len(range(*sl.indices(shape[a]))) for a, sl in enumerate(region)]))
        se_m, sr_m = sums[mix_key]
        rest_e, rest_r = se_m - se_x, sr_m - sr_x
        left = elements - n_x
        if left > 0:
            without = windows(mix_axis, mix_key, (rest_e, rest_r, left // shape[mix_axis]),
                              (float(rest_e.sum()), float(rest_r.sum()), left, floor))
            if without is not None and without.contrast > mixed.contrast:
                axis_block = Block(f"{without.where} (outside {other.where})", without.rel, without.share,
                                   without.scale, without.rest, without.key, without.start, without.stop)
    return best, axis_block


def _rest_rel(e_rest: float, r_rest: float, m: int, floor: float) -> float:
    """The relative RMS error of what lies outside a block (-1: nothing does)."""
    if m <= 0:
        return -1.0
    den = max(r_rest / m, floor)
    return math.sqrt(max(e_rest, 0.0) / m / den) if den > 0 else -1.0


def _along(ndim: int, axis: int, sl: slice) -> tuple:
    """An index taking ``sl`` of ``axis`` and all of every other axis."""
    return tuple(sl if a == axis else slice(None) for a in range(ndim))


def _window_sums(x: np.ndarray, size: tuple[int, ...]) -> np.ndarray:
    """Sums of ``x`` over every window of ``size`` (running sums, one axis
    at a time): entry i is the sum over x[i : i + size]."""
    for axis, w in enumerate(size):
        c = np.cumsum(x, axis=axis, dtype=np.float64)
        n = c.shape[axis]
        if w > n:      # no window fits
            x = np.zeros(tuple(0 if a == axis else m for a, m in enumerate(c.shape)))
            continue
        # window i ends at i + w - 1; all but the first start after the sum c[i - 1]
        out = c[_along(c.ndim, axis, slice(w - 1, None))].copy()
        out[_along(c.ndim, axis, slice(1, None))] -= c[_along(c.ndim, axis, slice(0, n - w))]
        x = out
    return x


# ------------------------------------------------------------ magnitudes

def product_rho(op_type: str, x: np.ndarray, w: np.ndarray, y: np.ndarray, attrs: dict,
                bias: np.ndarray | None = None) -> float | None:
    """ρ = sqrt(Σ t_k² / Σ y²) of a Conv, MatMul or Gemm over its whole
    output: how large its products t_k = x_k·w_k are against its result
    (cancellation), from the input it read, its weight and its output.
    Padding is not counted (a Conv's border terms are over-counted), which
    errs on the side of a larger budget. None where the shapes do not fit."""
    op = aten_name(op_type)
    x, y = np.asarray(x), np.asarray(y)
    try:
        w2 = np.square(np.asarray(w, np.float64))
        y2 = float(_squares(y.reshape(-1), "i->"))
        if y2 <= 0.0 or not math.isfinite(y2):
            return None
        if op in ("Conv", "FusedConv", "convolution", "Conv2d", "Conv1d") and x.ndim >= 3 and w2.ndim == x.ndim:
            groups = int(attrs.get("group", attrs.get("groups", 1)) or 1)
            cout, cin_g = w2.shape[0], w2.shape[1]
            xc = _squares(x.reshape(x.shape[0], x.shape[1], -1), "ncs->c")      # per input channel
            wk = w2.reshape(cout, cin_g, -1).sum(axis=2)                       # per (out, in) channel
            total = 0.0
            per_group = cout // max(groups, 1)
            for g in range(max(groups, 1)):
                total += float(np.sum(wk[g * per_group:(g + 1) * per_group] @ xc[g * cin_g:(g + 1) * cin_g]))
            positions = float(np.prod(y.shape[2:])) / max(float(np.prod(x.shape[2:])), 1.0)
            terms = total * positions * float(np.prod(w2.shape[2:])) / max(float(np.prod(w2.shape[2:])), 1.0)
        elif op in ("MatMul", "FusedMatMul", "matmul", "mm", "bmm", "linear", "Linear") and x.ndim >= 2:
            wt = w2.T if op in ("linear", "Linear") and w2.ndim == 2 else w2
            if wt.ndim == 1:
                wt = wt[:, None]
            terms = float(np.sum(np.einsum("...k,...k->...", _squares(x, "...mk->...k"), wt.sum(axis=-1))))
        elif op in ("Gemm", "FusedGemm") and x.ndim == 2 and w2.ndim == 2:
            a = _squares(x, "km->k" if attrs.get("transA") else "mk->k")     # per k of A = x (x.T)
            b = w2.T if attrs.get("transB") else w2
            terms = float(a @ b.sum(axis=1)) * float(attrs.get("alpha", 1.0)) ** 2
        else:
            return None
        if bias is not None and bias.size:
            terms += float(np.sum(np.square(np.asarray(bias, np.float64)))) * (y.size / max(bias.size, 1))
    except (ValueError, IndexError):
        return None
    if not math.isfinite(terms) or terms <= 0.0:
        return None
    return math.sqrt(terms / y2)


def _squares(x: np.ndarray, spec: str) -> np.ndarray:
    """Sums of x² in float64 over what ``spec`` (einsum's, one operand)
    sums, without a float64 copy of x (einsum casts a buffer at a time: a
    detector's input read twice as float64 was a third of the analyzer's peak)."""
    ins, out = spec.split("->")
    return np.asarray(np.einsum(f"{ins},{ins}->{out}", x, x, dtype=np.float64))


# ------------------------------------------------------------ a job's policy

@dataclass
class ErrorPolicy:
    """What a job knows of its device's precision: the precision it was
    given (None: read from the data), per-node overrides (op_config.csv's
    precision column, --node-precision), whether it is a quantized build,
    and the reference's layout (NHWC for TensorFlow)."""
    job: Precision | None = None
    overrides: dict[str, Precision] = field(default_factory=dict)     # normalized node name -> precision
    quantized: bool = False
    layout: str = "NCHW"
    # without a job precision: the coarsest precision the device's tensors were
    # stored in so far (an FP16 build keeps its outputs float32; a float32
    # tensor among FP16 ones says little of what computed it)
    inferred: Precision | None = None

    def seen(self, dtype: str) -> None:
        """A device tensor stored in ``dtype`` arrived."""
        if self.job is not None:
            return
        p = build_of_dtype(dtype)
        if p is not None and p.name != "fp32":
            self.inferred = p if self.inferred is None else coarser(self.inferred, p)

    def precision_of(self, node: str, op_type: str, stored_dtype: str, strict: bool = False
                     ) -> tuple[Precision, str]:
        """``strict``: without what was inferred from other tensors (while
        the stream is under way, so that what is examined does not depend
        on the order tensors arrive in)."""
        override = None
        if self.overrides:      # (most jobs name none: no name normalized twice a tensor for nothing)
            from layerdiff.analyzer.align.names import normalize

            override = self.overrides.get(normalize(node))
        stored = of_dtype(stored_dtype)
        if self.job is None and self.quantized and override is None:
            return node_precision(op_type, job=PRECISIONS["int8"], stored_dtype=stored_dtype)
        if not strict and self.job is None and self.inferred is not None and override is None and \
                (stored is None or stored.name == "fp32"):
            p, _ = node_precision(op_type, job=self.inferred)      # TF32 still rounds only products
            return p, (f"the device stores its tensors in {self.inferred.name} (this one "
                       f"{stored_dtype or 'float32'}, as converted builds keep some)")
        return node_precision(op_type, job=self.job, stored_dtype=stored_dtype, override=override)


def quant_break(step: float, rms: float, rel_err: float) -> bool:
    """An INT8 hand-over whose step is coarser than the values it carries
    (half a step above their RMS ``rms``: most of them round to one or two
    levels), and that loses them (relative RMS error above 0.1)."""
    return bool(step) and math.isfinite(rms) and step / 2 > rms > 0 and rel_err > 0.1


# Normalizations over each row (the last axis): what scales a row's error.
# A LayerNorm divides what it read by the row's standard deviation: a row
# whose mean dwarfs its spread (a ViT's class token, a residual stream's
# offset) passes its error on many times over, relative to the output.
ROW_NORMS = {"LayerNormalization": "std", "LayerNorm": "std", "layer_norm": "std", "native_layer_norm": "std",
             "SimplifiedLayerNormalization": "rms", "RMSNorm": "rms", "rms_norm": "rms"}


def row_norm(op_type: str) -> str:
    """'std' or 'rms' for a normalization over each row, else ''."""
    return ROW_NORMS.get(aten_name(op_type), "")


def normalized_read(err: np.ndarray, ref: np.ndarray, by: str, eps: float = 1e-6) -> tuple[float, float] | None:
    """The error a row normalization reads, in the units of its output:
    each row's RMS error over the row's standard deviation (``std``) or RMS
    (``rms``), with ``eps`` added to its square as the normalization does
    (the smallest usual one: the most a row can pass on). Its RMS over the whole tensor, and the largest over a
    sixteenth of the rows (the axis before the last, as worst_blocks cuts).
    None for a tensor with fewer than 2 elements a row."""
    e = np.asarray(err)
    r = np.asarray(ref)
    if e.shape != r.shape or e.ndim == 0 or e.shape[-1] < 2:
        return None
    with np.errstate(all="ignore"):
        r64 = r.astype(np.float64)
        scale2 = np.var(r64, axis=-1) if by == "std" else np.mean(np.square(r64), axis=-1)
        e2 = np.mean(np.square(e, dtype=np.float64), axis=-1)
        a2 = e2 / (scale2 + eps)
    a2 = np.where(np.isfinite(a2), a2, 0.0)
    whole = math.sqrt(float(np.mean(a2)))
    if a2.ndim == 0 or a2.size < 2:
        return whole, whole
    per_row = np.mean(a2.reshape(-1, a2.shape[-1]), axis=0)         # rows of the axis before the last
    w = max(1, round(per_row.size / 16))
    worst = float(np.max(_window_sums(per_row, (w,)))) / w
    return whole, max(whole, math.sqrt(worst))


def scale_ratio(rms_in: float, rms_out: float) -> float:
    """How much larger a relative error of what a node read reads on its
    output's scale (rms_in / rms_out, at least 1): an activation that
    zeroes half its input passes its error on in absolute terms, over a
    smaller output."""
    if not (rms_in > 0 and rms_out > 0 and math.isfinite(rms_in) and math.isfinite(rms_out)):
        return 1.0
    return max(1.0, rms_in / rms_out)


def fmt_rel(v: float) -> str:
    return "inf" if math.isinf(v) else f"{v:.2g}"
