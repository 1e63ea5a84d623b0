"""The precisions a device computes in, and what each rounds to.

A precision is named as users name it (``fp32``, ``tf32``, ``fp16``,
``bf16``, ``fp8_e4m3fn``, ``fp8_e5m2``, ``int8``) and says, for the error
model (layerdiff.analyzer.diagnose.errormodel), the unit roundoff u = 2^-p
of a format with p significand bits (implicit bit included) under
round-to-nearest: the largest relative error of rounding one value.

Three places of a node's arithmetic round, each with its own u:

- ``operand``: what a product's operands are rounded to before multiplying
  (TF32 tensor cores keep 11 bits of an FP32 operand; autocast FP16/BF16
  rounds activations and weights);
- ``accumulate``: the sum a reduction keeps (FP32 on tensor cores, on NPU
  cube units and in autocast; FP16 only where a device says so);
- ``storage``: the type the node's output is written in.

Mixed precision is the norm: under autocast a MatMul multiplies FP16
operands into an FP32 sum and stores FP16, while a Softmax or LayerNorm
computes and stores FP32. A node's precision is therefore decided per node
(``node_precision``): an override for that node, else the type its output
was dumped in where that is narrower than FP32, else the job's precision
for the ops it applies to (TF32 only changes Conv/MatMul/Gemm operands),
else FP32.

``int8`` is not a float format: its error is the quantization step of the
tensor (read from the data or the QDQ scale), handled by the error model;
between quantized ops the float parts compute in FP32.

A tensor a device dumped in a narrow type was stored at that type's
rounding: ``of_dtype`` gives for it a precision of its own (``STORED``,
named as the type is: ``float8_e4m3fn``, ``hifloat8``, ``float4_e2m1``...)
whose unit roundoff is that type's, 2^-(mantissa bits + 1); ``int4`` is a
quantized build's precision as ``int8`` is, its weights coarser.
HiFloat8 keeps 3 mantissa bits near 1 and fewer further out (2 for
exponents 4..7, 1 for 8..15, none in its denormal range): it counts as its
coarsest normal one, 1 bit (u = 2^-2), the bound that holds over the
whole normal range. The element ranges of these types say nothing of the
tensor's (they come scaled, the scales held apart): their largest finite
value is left at FP32's.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from layerdiff.common.errors import LayerdiffError

U_FP32 = 2.0 ** -24
U_TF32 = 2.0 ** -11     # 10 stored significand bits, as FP16
U_FP16 = 2.0 ** -11
U_BF16 = 2.0 ** -8      # 7 stored significand bits
U_E4M3 = 2.0 ** -4      # 3 stored significand bits
U_E5M2 = 2.0 ** -3      # 2 stored significand bits
BF16_MAX = 3.3895313892515355e38
U_INT8_WEIGHT = 2.0 ** -6   # half an INT8 step of a weight, relative to its RMS (see PRECISIONS)
# half an INT4 step of a weight (max/7, its largest value 4 times its RMS): 2/7 of its RMS, about 2^-1.8
U_INT4_WEIGHT = 2.0 ** -2

# the ops whose operands TF32 rounds: the products a tensor core computes
PRODUCT_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm", "Einsum", "ConvInteger", "MatMulInteger",
                         "QLinearConv", "QLinearMatMul", "FusedConv", "FusedGemm", "FusedMatMul", "Attention",
                         "MultiHeadAttention", "conv2d", "conv1d", "conv3d", "linear", "mm", "bmm", "addmm",
                         "matmul", "convolution", "baddbmm", "Conv2d", "Conv1d", "Conv3d", "Linear",
                         "ConvTranspose2d", "MultiheadAttention"})


@dataclass(frozen=True)
class Precision:
    name: str
    operand: float          # unit roundoff of a product's operands
    accumulate: float       # of a reduction's running sum
    storage: float          # of the stored output
    what: str               # one line, for the report
    max_finite: float = 3.4028234663852886e38     # the largest value the stored output can hold

    @property
    def quantized(self) -> bool:
        return self.name in ("int8", "int4")


PRECISIONS: dict[str, Precision] = {p.name: p for p in (
    Precision("fp32", U_FP32, U_FP32, U_FP32, "FP32"),
    Precision("tf32", U_TF32, U_FP32, U_FP32, "TF32 products (11-bit operands, FP32 sums and outputs)"),
    Precision("fp16", U_FP16, U_FP32, U_FP16, "FP16 (FP32 sums)", 65504.0),
    Precision("bf16", U_BF16, U_FP32, U_BF16, "BF16 (FP32 sums)", BF16_MAX),
    # FP8 products (per-tensor scaled operands) with BF16 activations, as FP8 inference runs
    Precision("fp8_e4m3fn", U_E4M3, U_FP32, U_BF16, "FP8 E4M3 products (FP32 sums, BF16 outputs)", BF16_MAX),
    Precision("fp8_e5m2", U_E5M2, U_FP32, U_BF16, "FP8 E5M2 products (FP32 sums, BF16 outputs)", BF16_MAX),
    # a quantized build: products read INT8 weights (per tensor, a step of about
    # max/127: 1/64 of the RMS of a weight whose largest value is 4 times its
    # RMS), sum exactly in INT32, and hand over on their output's grid (its
    # step read from the data); the float parts between them compute in FP32
    Precision("int8", U_INT8_WEIGHT, U_FP32, U_FP32, "INT8 QDQ (weights ~1/64 of their RMS, output steps read "
              "from the data)"),
)}
NAMES = tuple(PRECISIONS)


def _stored(name: str, mantissa_bits: int, what: str) -> Precision:
    """A node whose output a device stored in the narrow float ``name``:
    its products read that type too, sum in FP32, store at its rounding."""
    u = 2.0 ** -(mantissa_bits + 1)
    return Precision(name, u, U_FP32, u, f"{what} outputs (FP32 sums)")


# What a tensor stored in a narrow type was rounded to (of_dtype), apart from
# PRECISIONS: no job or node is set to compute in these.
STORED: dict[str, Precision] = {p.name: p for p in (
    _stored("float8_e4m3fn", 3, "FP8 E4M3"), _stored("float8_e4m3fnuz", 3, "FP8 E4M3 (FNUZ)"),
    _stored("float8_e5m2", 2, "FP8 E5M2"), _stored("float8_e5m2fnuz", 2, "FP8 E5M2 (FNUZ)"),
    _stored("float8_e8m0", 0, "E8M0 (powers of two)"), _stored("hifloat8", 1, "HiFloat8 (1 mantissa bit at worst)"),
    _stored("float6_e3m2", 2, "FP6 E3M2"), _stored("float6_e2m3", 3, "FP6 E2M3"),
    _stored("float4_e2m1", 1, "FP4 E2M1"), _stored("float4_e1m2", 2, "FP4 E1M2"), _stored("hifloat4", 2, "HiFloat4"),
    # as int8 (an output's step is read from the data), with INT4's coarser weights
    Precision("int4", U_INT4_WEIGHT, U_FP32, U_FP32, "INT4 QDQ (weights ~1/4 of their RMS, output steps read from "
              "the data)"),
)}
ALIASES = {"float32": "fp32", "fp32": "fp32", "tf32": "tf32", "float16": "fp16", "half": "fp16", "fp16": "fp16",
           "bfloat16": "bf16", "bf16": "bf16", "float8_e4m3fn": "fp8_e4m3fn", "fp8_e4m3fn": "fp8_e4m3fn",
           "e4m3": "fp8_e4m3fn", "fp8_e4m3": "fp8_e4m3fn", "float8_e5m2": "fp8_e5m2", "fp8_e5m2": "fp8_e5m2",
           "e5m2": "fp8_e5m2", "int8": "int8", "qdq": "int8"}
# Data types a dump may say a tensor was written in (numpy's, torch's and the
# runtimes' names), and the precision that says the node stored in.
DTYPE_PRECISION = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16", "tfloat32": "tf32", "float32": "fp32",
                   "float": "fp32", "float64": "fp32", "double": "fp32",
                   **{name: name for name in STORED}, "float8_e4m3": "float8_e4m3fn", "float8_e8m0fnu": "float8_e8m0",
                   "float6_e3m2fn": "float6_e3m2", "float6_e2m3fn": "float6_e2m3", "float4_e2m1fn": "float4_e2m1"}


def parse(name: str | None, field: str = "precision") -> Precision | None:
    """The precision called ``name`` (any alias), None for '' / 'auto'."""
    key = (name or "").strip().lower().replace("-", "_")
    if key in ("", "auto"):
        return None
    if key not in ALIASES:
        raise LayerdiffError(f"unknown precision {name!r} (one of {', '.join(NAMES)}, or auto: read from the data)",
                             field=field)
    return PRECISIONS[ALIASES[key]]


def of_dtype(dtype: str) -> Precision | None:
    """The precision a tensor stored in ``dtype`` was at least rounded to."""
    name = DTYPE_PRECISION.get((dtype or "").lower())
    return (PRECISIONS.get(name) or STORED[name]) if name else None


def build_of_dtype(dtype: str) -> Precision | None:
    """The precision a build that stores some tensors in ``dtype`` computes
    its other tensors in: a narrow float type's products, with the BF16
    outputs such builds keep between them (its own storage rounding holds
    only for the tensors stored in it)."""
    p = of_dtype(dtype)
    if p is None or p.name not in STORED or p.quantized:
        return p
    return replace(p, storage=U_BF16, max_finite=BF16_MAX,
                   what=f"{p.what.removesuffix(' outputs (FP32 sums)')} products (FP32 sums, BF16 outputs)")


def coarser(a: Precision, b: Precision) -> Precision:
    """The one that rounds more (by storage, then operands)."""
    return a if (a.storage, a.operand) >= (b.storage, b.operand) else b


def node_precision(op_type: str, *, job: Precision | None, stored_dtype: str = "",
                   override: Precision | None = None) -> tuple[Precision, str]:
    """The precision a node computed in, and where that was read from.

    ``override``: set for this node (op_config.csv, --node-precision).
    ``stored_dtype``: the type its output was dumped in (the device's, not
    what it was widened to for the wire). ``job``: the job's precision
    (None: read from the data only). A float32 output says little where the
    job names a narrower precision (dumps are often widened when written),
    so the job's precision stands there; without one, float32 is FP32."""
    if override is not None:
        return override, "set for this node"
    stored = of_dtype(stored_dtype)
    if stored is not None and stored.name != "fp32":
        return stored, f"its output was written in {stored_dtype}"
    if job is None or job.name == "fp32":
        return PRECISIONS["fp32"], ("its output was written in float32" if stored is not None and job is None
                                    else "FP32")
    if job.name == "tf32" or job.quantized:
        base = op_type.split(".")[1] if op_type.startswith("aten.") and "." in op_type[5:] else op_type
        return (job, f"{job.name.upper()} products (the job's precision)") if base in PRODUCT_OPS else \
            (PRECISIONS["fp32"], f"FP32 ({job.name.upper()} changes only products)")
    return job, f"the job's precision ({job.name})"


# Significand bits (implicit bit included) each format keeps.
BITS = {"fp32": 24, "tf32": 11, "fp16": 11, "bf16": 8, "fp8_e4m3fn": 4, "fp8_e5m2": 3}


def round_significand(x, bits: int):
    """``x`` (float32 or float64 array) rounded to ``bits`` significand bits,
    to nearest, ties to even, in its own exponent range (no overflow or
    subnormal handling): TF32 and BF16 are exactly this for float32 input."""
    import numpy as np

    a = np.asarray(x)
    if a.dtype == np.float32 and bits < 24:
        u = a.view(np.uint32).astype(np.uint64)
        drop = 24 - bits
        half = (1 << (drop - 1)) - 1
        keep = np.uint64(0xFFFFFFFF ^ ((1 << drop) - 1))
        u = (u + np.uint64(half) + ((u >> np.uint64(drop)) & np.uint64(1))) & keep
        out = u.astype(np.uint32).view(np.float32)
        # NaN and Inf keep their bits
        return np.where(np.isfinite(a), out, a)
    if bits >= 53:
        return a
    # Veltkamp's split: the high part keeps `bits` bits of a float64
    b = np.asarray(a, np.float64)
    c = b * float(2 ** (53 - bits) + 1)
    with np.errstate(all="ignore"):
        hi = c - (c - b)
    return np.where(np.isfinite(hi), hi, b).astype(a.dtype if a.dtype.kind == "f" else np.float64)
