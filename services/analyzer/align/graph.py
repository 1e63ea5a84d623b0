"""Pair the tensors of a device ONNX graph with those of the reference graph by
structure, not by name.

Accelerator toolchains and onnxruntime's optimizer rename tensors, fuse
chains of nodes into one (``FusedConv``, ``FusedGemm``, Conv+BatchNormalization
folding, LayerNorm / Gelu / attention fusions) and insert helpers of their own
(``Cast``, ``QuantizeLinear``/``DequantizeLinear``, the x86 NCHWc
``ReorderInput``/``ReorderOutput``, Reshapes around a ``Gemm``). Matching
names then compares the wrong tensors or none. :func:`align_graphs` follows
the data flow instead; names only ever break a tie.

Algorithm
---------
1. Both graphs are indexed: producers, readers, constants (initializers,
   ``Constant`` nodes and whatever is computed from constants only), *meta*
   tensors (``Shape``/``Size`` and what is computed from them only) and the
   shapes from ONNX shape inference. A node's *flow inputs* are its inputs
   that are neither constant nor (for a data node) meta.
2. The device graph inputs are bound to the reference inputs: by name, else
   by normalized name, else by position among inputs of compatible shape.
3. The device nodes are visited in topological order. A node whose flow
   inputs are all bound is matched to the reference nodes that read exactly
   the reference tensors bound to them (seeing through Identity, Dropout and
   Reshape-like nodes the device may have dropped):

   * the same op (or an alias: ``Upsample``/``Resize``...), its inputs in the
     same order (as a multiset for commutative ops) → method ``graph``;
   * a device op standing for a *chain*: Conv / ConvTranspose / Gemm / MatMul
     (and ``FusedConv``, ``FusedGemm``, NCHWc ``Conv``) cover their head op,
     then any BatchNormalization or Add/Sub/Mul/Div by a constant (bias and
     BN folding), then the ``Add`` of the device node's residual input
     (``FusedConv`` Z, NCHWc ``Sum``) if it has one, then the op named by its
     ``activation`` attribute if it has one → method ``fused``;
   * a device op standing for a *subgraph* (LayerNormalization and its
     Skip/Simplified forms, Gelu/FastGelu/BiasGelu, Attention, FusedMatMul,
     HardSwish): the reference nodes computable from the bound inputs with
     the ops such a fusion decomposes into, whose result depends on every
     bound input, that contain the characteristic ops (ReduceMean + Sqrt,
     Erf/Tanh, Softmax + MatMul...) and whose intermediates are read nowhere
     else → method ``fused``.

   Every candidate is scored: the op, the attributes both nodes carry, the
   activation parameters, the weights (by value where the shapes agree:
   equal up to FP16/INT8 rounding, equal per output channel up to a scale as
   after BN folding, or different; for a subgraph, whether the device
   node's gamma/beta/bias find equal partners) and the output shape (a
   different element count rules a candidate out). The best-scoring
   candidates survive; a normalized name (case, ``/ . :`` separators) of the
   node or tensor only breaks a remaining tie between reference nodes.
4. How far a chain extends (Conv, Conv→BN, Conv→BN→Add-constant...) is *not*
   decided at the node: its output keeps every acceptable end as an
   alternative, and the device's next nodes decide - a reader matches only
   reference nodes that read one of the alternatives, and only the
   alternatives it used are kept (and, backwards, only what those assumed of
   their own inputs). The same settles parallel branches that look alike.
   What no reader settles is settled last: a device graph output takes the
   alternative that is a reference graph output; alternatives equal in value
   (differing by an Identity) take the first; a chain whose alternatives
   differ by BN/affine folding takes the one whose folded weights equal the
   device's; a QuantizeLinear follows its zero point (below); a reference
   tensor another device tensor has claimed is dropped. Whatever is still
   open is listed as ambiguous, never guessed.
5. Device-only helpers carry the binding on: Identity/Dropout, Cast between
   float types, Reshape-likes (the same elements: paired, the note says so
   where the shape differs), Transposes (paired, the note gives the
   permutation), Q/DQ (the integer view is listed unmatched; as quantizers
   drop a Relu/Clip their range clamps anyway, the dequantized tensor may
   stand for the activation - its readers or its zero point decide) and
   NCHWc reorders (a blocked tensor is paired with the reference tensor it
   holds, ``Pairing.blocked``: the blocks are undone before comparing).
6. The other way round - the *reference* fused what the device computes in
   several nodes (an onnxsim'd or optimized reference): a device
   BatchNormalization / affine-constant node after a Conv/Gemm/MatMul with no
   reference counterpart takes over its input's pairing, and a device
   subgraph that decomposes a reference LayerNormalization/Gelu/... pairs its
   last tensor with that node's output (method ``fused``, the note says
   which side fused); the device's partial results are listed unmatched.

7. Where a device node cannot be reached (its input comes from something
   left unaligned, e.g. a Transpose onnxruntime pushed through Slices), a
   Conv/Gemm/MatMul whose weight equals (or, folded, scales) the weight of
   exactly one reference node of its kind re-anchors the walk there; its
   unaligned inputs are paired with that node's inputs.

Graph inputs and constants are never paired; node outputs that are graph
outputs are. Cost is about linear in the graph: the PP-OCR detector (670
nodes) aligns in a fraction of a second.

Limits
------
* Subgraphs (If/Loop/Scan bodies) are not entered.
* Rewrites that move layout ops (onnxruntime's transpose optimizer pushing
  a Transpose through Slice/Squeeze) and ops outside the tables
  (QLinear*/ConvInteger integer kernels, vendor ops) are not followed: what
  depends on them stays unmatched (with the reason) until the next weighted
  node re-anchors the walk (step 7).
* NCHWc weights are compared as a multiset of values only (so a folded,
  blocked weight is "unknown"); Attention fusions follow the subgraph rule
  but have not been checked against onnxruntime's transformer optimizer.
* Symmetric structures with equal weights (two identical branches read by a
  commutative op) stay ambiguous unless a reader, a name or a graph output
  tells them apart.
"""
from __future__ import annotations

import heapq
import itertools
import re
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from layerdiff.analyzer.align.names import Pairing
from layerdiff.common.onnxgraph import infer_shapes


@dataclass
class GraphAlignment:
    """The outcome of :func:`align_graphs`; every key is a device tensor name
    unless said otherwise."""
    pairs: dict[str, Pairing] = field(default_factory=dict)
    # reference tensor computed inside a device fusion (never dumped) -> device node covering it
    fused: dict[str, str] = field(default_factory=dict)
    # reference tensor that closes a fusion -> the reference nodes the device node covers
    groups: dict[str, list[str]] = field(default_factory=dict)
    # (device tensor, equally good reference candidates, why)
    ambiguous: list[tuple[str, list[str], str]] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)       # unmatched device tensor -> why
    layout_only: dict[str, str] = field(default_factory=dict)   # quantized device tensor -> ref tensor
    # reference tensor computed from constants or shapes only that no device
    # node computes (the device folded it into a constant) -> why
    folded: dict[str, str] = field(default_factory=dict)
    # the weights of each paired node, side by side (layerdiff.analyzer.diagnose.weights)
    weights: list[dict] = field(default_factory=list)
    input_copies: dict[str, str] = field(default_factory=dict)   # device tensor -> the graph input it copies

    @property
    def attributed(self) -> dict[str, tuple[str, str]]:
        """Device tensors not compared that still stand for a reference
        tensor: INT8 views (with why), and the device's own copy
        of each reference weight (a DequantizeLinear output, a cast)."""
        out = {d: (r, self.reasons.get(d, "")) for d, r in {**self.input_copies, **self.layout_only}.items()}
        for w in self.weights:
            d = w.get("device_weight", "")
            if "attribute" not in w and d and d not in self.pairs:
                out.setdefault(d, (w["reference_weight"], "the device's copy of this reference weight "
                                                          "(compared in weights.csv)"))
        return out

    @property
    def lost(self) -> list[str]:
        """Unmatched device tensors the walk lost (what they read, or their
        op, has no reference counterpart), as opposed to those it knows to
        differ from every reference tensor (a fold's partial result, a
        blocked layout, a copy of a graph input)."""
        return [t for t in self.unmatched if "is not aligned" in self.reasons.get(t, "")
                or self.reasons.get(t, "").startswith("no reference node computes")
                or self.reasons.get(t, "") == "not aligned"]


# ---------------------------------------------------------------- op tables

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
FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE,
                         onnx.TensorProto.BFLOAT16})
NCHWC_DOMAIN = "com.microsoft.nchwc"
IGNORED_ATTRS = frozenset({"activation", "activation_params", "channels", "channels_last", "auto_pad"})


@dataclass(frozen=True)
class _Family:
    """A device op standing for a subgraph of the reference."""
    ops: frozenset[str]
    ends: frozenset[str]
    limit: int
    # each inner tuple: at least one of these ops must be in the covered subgraph
    required: tuple[tuple[str, ...], ...]


_LN = _Family(frozenset({"ReduceMean", "Sub", "Pow", "Mul", "Add", "Sqrt", "Div", "Reciprocal", "Cast",
                         "LayerNormalization", "SimplifiedLayerNormalization"}),
              frozenset({"Add", "Mul", "Div", "LayerNormalization", "SimplifiedLayerNormalization", "Cast"}), 40,
              (("ReduceMean", "LayerNormalization", "SimplifiedLayerNormalization"),
               ("Sqrt", "Reciprocal", "Pow", "LayerNormalization", "SimplifiedLayerNormalization")))
_GELU = _Family(frozenset({"Add", "Mul", "Div", "Erf", "Pow", "Tanh", "Sqrt", "Sigmoid", "Gelu", "FastGelu",
                           "BiasGelu"}),
                frozenset({"Mul", "Gelu", "FastGelu", "BiasGelu"}), 12,
                (("Erf", "Tanh", "Sigmoid", "Gelu", "FastGelu", "BiasGelu"),))
_ATTENTION = _Family(frozenset({"MatMul", "Gemm", "Add", "Reshape", "Transpose", "Div", "Mul", "Softmax", "Sqrt",
                                "Slice", "Gather", "Unsqueeze", "Squeeze", "Concat", "Split", "Where", "Cast",
                                "Sub", "Equal", "Expand"}),
                     frozenset({"Reshape", "Transpose", "MatMul"}), 48, (("Softmax",), ("MatMul",)))
FAMILIES = {
    "LayerNormalization": _LN, "SimplifiedLayerNormalization": _LN, "SkipLayerNormalization": _LN,
    "SkipSimplifiedLayerNormalization": _LN, "RMSNormalization": _LN,
    "Gelu": _GELU, "FastGelu": _GELU, "BiasGelu": _GELU, "QuickGelu": _GELU,
    "Attention": _ATTENTION, "MultiHeadAttention": _ATTENTION,
    "FusedMatMul": _Family(frozenset({"Transpose", "MatMul", "Mul", "Div"}), frozenset({"MatMul", "Mul", "Div"}),
                           6, (("MatMul",),)),
    "HardSwish": _Family(frozenset({"Add", "Clip", "Mul", "Div", "HardSigmoid", "Relu", "Min", "Max"}),
                         frozenset({"Mul", "Div"}), 6, (("Clip", "HardSigmoid", "Relu", "Min"),)),
    "BiasAdd": _Family(frozenset({"Add"}), frozenset({"Add"}), 3, (("Add",),)),
}

# ops a transpose optimizer moves a Transpose past (see _Aligner.commute)
COMMUTING = frozenset({"Slice", "Squeeze", "Transpose", "ReorderInput"}) | (ELEMENTWISE - COMMUTATIVE - {"Sub", "Div", "Pow"})

_SEP = re.compile(r"[/.:\\ ]+")


def _perm(layout: str) -> tuple[int, ...]:
    """The axes of a ``perm:`` layout (device axis a = reference axis p[a]); () for none."""
    return tuple(int(x) for x in layout[5:].split(",")) if layout.startswith("perm:") else ()


def _moves_channels_first(perm) -> bool:
    """Is this Transpose NHWC -> NCHW (0, n-1, 1, ..., n-2)?"""
    return perm is not None and len(perm) >= 3 and list(perm) == [0, len(perm) - 1, *range(1, len(perm) - 1)]


def _norm(name: str) -> str:
    return _SEP.sub("_", name).strip("_").lower()


# ------------------------------------------------------------------- graphs

class _Graph:
    """An ONNX graph indexed for alignment (read-only)."""

    def __init__(self, model: onnx.ModelProto, merge_duplicates: bool = False) -> None:
        g = model.graph
        self.inits = {i.name: i for i in g.initializer}
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


def _shapes_agree(a: tuple | None, b: tuple | None) -> bool | None:
    """True / False where both shapes say so, None where unknown."""
    if a is None or b is None:
        return None
    if len(a) != len(b):
        return False
    if any(x is not None and y is not None and x != y for x, y in zip(a, b)):
        return False
    return True if all(x is not None and y is not None for x, y in zip(a, b)) else None


def _shape_fit(dev: tuple | None, ref: tuple | None) -> float | None:
    """1.0 where the shapes agree or are unknown, 0.9 where they differ but
    hold as many elements, None where they cannot be the same tensor."""
    if _shapes_agree(dev, ref) is not False:
        return 1.0
    if None not in dev and None not in ref and int(np.prod(dev)) == int(np.prod(ref)):
        return 0.9
    return None


# ---------------------------------------------------------- weight evidence

def _weights_relation(dev: np.ndarray | None, ref: np.ndarray | None) -> str:
    """'equal' (up to FP16/INT8 rounding), 'scaled' (each output channel a
    multiple of the reference's, as after BN folding), 'different' or
    'unknown' (a value or a comparable shape is missing)."""
    if dev is None or ref is None:
        return "unknown"
    if dev.shape != ref.shape:
        if dev.ndim == 2 and dev.T.shape == ref.shape and dev.shape != dev.T.shape:
            dev = dev.T
        elif dev.size == ref.size and (dev.ndim <= 1 or ref.ndim <= 1):
            dev = dev.reshape(ref.shape)
        else:
            return "unknown"
    if dev.size == 0:
        return "equal"
    scale = float(np.max(np.abs(ref))) or 1.0
    if float(np.max(np.abs(dev - ref))) <= 1e-2 * scale + 1e-7:
        return "equal"
    if scaled_per_channel(dev, ref, 0.999):
        return "scaled"
    return "different"


def scaled_per_channel(dev: np.ndarray, ref: np.ndarray, min_cos: float) -> bool:
    """Is each output channel (first axis) of ``dev`` a multiple of the
    reference's (cosine above ``min_cos``), as after BatchNorm folding?"""
    if ref.ndim < 2 or ref[0].size <= 1:
        return False
    d, r = dev.reshape(len(dev), -1), ref.reshape(len(ref), -1)
    nd, nr = np.linalg.norm(d, axis=1), np.linalg.norm(r, axis=1)
    live = (nd > 0) & (nr > 0)
    if not live.any() or not (nd[~live] == nr[~live]).all():
        return False
    cos = np.abs(np.sum(d[live] * r[live], axis=1)) / (nd[live] * nr[live])
    return float(cos.min()) > min_cos


def _blocked_relation(dev: np.ndarray | None, ref: np.ndarray | None) -> str:
    """For weights stored in a blocked layout (NCHWc): 'equal' where the
    nonzero values are the same multiset, else 'unknown'."""
    if dev is None or ref is None:
        return "unknown"
    d, r = np.sort(dev[dev != 0].ravel()), np.sort(ref[ref != 0].ravel())
    if d.shape == r.shape and (d.size == 0 or float(np.max(np.abs(d - r))) <= 1e-2 * float(np.max(np.abs(r)))):
        return "equal"
    return "unknown"


RELATION_SCORE = {"equal": 1.0, "scaled": 0.9, "unknown": 0.8, "different": 0.6}


# ----------------------------------------------------------- subgraph regions

def _grow(g: _Graph, seeds: set[str], fam: _Family) -> list[int]:
    """The nodes of g computable from the seeds (and constants) with the
    family's ops, in topological order, at most fam.limit of them."""
    avail = set(seeds)
    heap = sorted({j for t in seeds for j, _ in g.data_consumers.get(t, [])})
    done: set[int] = set()
    region = []
    while heap and len(region) < fam.limit:
        j = heapq.heappop(heap)
        if j in done:
            continue
        done.add(j)
        if g.op(j) not in fam.ops and not g.see_through(j):
            continue
        if not all(t in avail for _, t in g.flows[j]) or any(g.c(t) in seeds for t in g.outputs_of(j)):
            continue
        region.append(j)
        for t in map(g.c, g.outputs_of(j)):
            avail.add(t)
            for k, _ in g.data_consumers.get(t, []):
                heapq.heappush(heap, k)
    return region


def _regions(g: _Graph, seeds: set[str], fam: _Family, extras: int) -> list[tuple[int, tuple[int, ...]]]:
    """(end node, its cone) for every node of the grown region whose result
    depends on all the seeds and that a fused op of the family can stand for."""
    cones: dict[int, frozenset[int]] = {}
    used: dict[int, frozenset[str]] = {}
    out = []
    for j in _grow(g, seeds, fam):
        cone, seen = {j}, set()
        for _, t in g.flows[j]:
            if t in seeds:
                seen.add(t)
            elif t in g.producer and g.producer[t][0] in cones:
                p = g.producer[t][0]
                cone |= cones[p]
                seen |= used[p]
        cones[j], used[j] = frozenset(cone), frozenset(seen)
        if used[j] == seeds and _region_ok(g, j, cones[j], fam, extras):
            out.append((j, tuple(sorted(cones[j]))))
    return out


def _region_ok(g: _Graph, end: int, cone: frozenset[int], fam: _Family, extras: int) -> bool:
    """The right ops, and no intermediate read outside the cone (beyond what
    the fused op's extra outputs can carry)."""
    if g.op(end) not in fam.ends:
        return False
    ops = {g.op(j) for j in cone}
    if not all(ops & set(req) for req in fam.required):
        return False
    escapes = 0
    for j in cone - {end}:
        for t in map(g.c, g.outputs_of(j)):
            if t not in g.meta and (t in g.outputs or any(k not in cone for k, _ in g.data_consumers.get(t, []))):
                escapes += 1
    return escapes <= extras


def _params(g: _Graph, nodes) -> list[np.ndarray]:
    """The non-scalar constant inputs of these nodes (gamma, beta, bias...)."""
    return [v for j in nodes for t in g.nodes[j].input if t in g.const
            for v in [g.value(t)] if v is not None and v.size > 1]


def _params_agree(mine: list[np.ndarray], theirs: list[np.ndarray]) -> tuple[float, str]:
    """A score (0.8 per parameter left without an equal partner) and a word."""
    theirs = list(theirs)
    unmatched = 0
    for v in mine:
        k = next((k for k, w in enumerate(theirs) if _weights_relation(v, w) == "equal"), None)
        if k is None:
            unmatched += 1
        else:
            theirs.pop(k)
    unmatched += len(theirs)
    word = "unknown" if not mine else ("equal" if not unmatched else "different")
    return 0.8 ** unmatched, word


# ----------------------------------------------------------------- bindings

@dataclass
class _Alt:
    """One reference tensor a device tensor may stand for."""
    ref: str
    cover: tuple[int, ...]        # reference nodes the device node computes, in order
    head: int | None              # the reference node matched to the device op itself
    score: float
    method: str
    weights: str = "unknown"      # how the device node's weights relate to the head's
    assumed: dict[str, str] = field(default_factory=dict)   # device input -> the reference tensor taken for it


@dataclass(eq=False)
class _Cell:
    """What a device node's output stands for; shared by the device-only
    helpers (Cast, reorders, Q/DQ) that carry it on."""
    node: int                     # device node index
    alts: list[_Alt]
    settled_by: str = ""
    derived: bool = False         # a QuantizeLinear's: may share its input's reference tensor


@dataclass
class _Binding:
    cell: _Cell
    layout: str = ""              # "", "flat" (reshaped), "nchwc", "quantized" or "perm:a,b,c,d"
    via: str = ""                 # device-only helper ops it passed through
    superseded: str = ""          # non-empty: a partial result the reference folds away (why)
    unfused: bool = False         # the reference computes in one node what the device splits
    # its perm: layout comes from a Transpose the device moved down (commute):
    # proven by the graph, so the values are compared with the axes put back
    moved: bool = False


@dataclass
class _Match:
    head: int | None
    ends: list[tuple[str, tuple[int, ...]]]
    score: float
    combo: dict[str, str]         # device flow tensor -> the reference tensor it was taken as
    extras: dict[int, str] = field(default_factory=dict)   # device output slot -> ref tensor
    weights: str = "unknown"


# ---------------------------------------------------------------- the work

class _Aligner:
    def __init__(self, ref: onnx.ModelProto, dev: onnx.ModelProto) -> None:
        self.ref, self.dev = _Graph(ref, merge_duplicates=True), _Graph(dev)
        self.bind: dict[str, _Binding] = {}
        self.notes: dict[str, str] = {}       # device tensor -> why it stays unmatched
        self.inside: set[int] = set()         # device nodes inside a reference fused node (done)
        self._weight_index: dict[frozenset, dict[tuple, list[int]]] = {}
        self._weights_done: set[tuple[int, int]] = set()

    # -- 2. graph inputs
    def bind_inputs(self) -> None:
        ref_in, dev_in = list(self.ref.inputs), list(self.dev.inputs)
        pairs = {}
        for key in (lambda s: s, _norm):
            by_key = {key(r): r for r in ref_in if r not in pairs.values()}
            for d in dev_in:
                if d not in pairs and key(d) in by_key:
                    pairs[d] = by_key[key(d)]
        rest_r = [r for r in ref_in if r not in pairs.values()]
        rest_d = [d for d in dev_in if d not in pairs]
        for d, r in zip(rest_d, rest_r):
            if _shapes_agree(self.dev.shape(d), self.ref.shape(r)) is not False:
                pairs[d] = r
        for d, r in pairs.items():
            self.bind[d] = _Binding(_Cell(-1, [_Alt(r, (), None, 1.0, "input")]))

    # -- 3. device nodes in order
    def run(self) -> None:
        self.bind_inputs()
        for i in range(len(self.dev.nodes)):
            outs = self.dev.outputs_of(i)
            if not outs or all(t in self.dev.const for t in outs) or i in self.inside:
                continue
            flows = self.dev.flows[i]
            missing = [t for _, t in flows if t not in self.bind]
            if not flows or missing:
                if flows and self.anchor(i):
                    continue
                why = "reads no aligned tensor" if not flows else f"input {missing[0]!r} is not aligned"
                for t in outs:
                    self.notes[t] = why
                continue
            if self.commute(i) or self.match(i) or self.passthrough(i) or self.absorb(i) or self.reverse_region(i):
                continue
            for t in outs:
                self.notes[t] = f"no reference node computes {self.dev.op(i)} from the aligned inputs"

    def anchor(self, i: int) -> bool:
        """Resynchronize after what could not be aligned: a device
        Conv/Gemm/MatMul whose weight equals (or, folded, scales) the weight
        of exactly one reference node of its kind is that node, and its
        unaligned inputs are that node's inputs."""
        dev, ref = self.dev, self.ref
        n = dev.nodes[i]
        heads = CHAIN_HEADS.get(dev.op(i))
        if heads is None or len(n.input) < 2 or n.input[1] not in dev.const:
            return False
        w = dev.value(n.input[1])
        if w is None or w.size < 16:
            return False
        found = [j for j in self.weight_index(heads).get(tuple(sorted(w.shape)), [])
                 if _weights_relation(w, ref.value(ref.nodes[j].input[1])) in ("equal", "scaled")]
        if len(found) != 1:
            return False
        j = found[0]
        ref_in = dict(ref.flows[j])
        combo = {}
        for k, t in dev.flows[i]:
            if k not in ref_in or (t in self.bind and ref_in[k] not in {a.ref for a in self.bind[t].cell.alts}):
                return False
            combo[t] = ref_in[k]
        ends = self.walk(i, j, (), combo)
        if not ends:
            return False
        score, weights = self.head_score(i, j)
        for k, t in dev.flows[i]:
            if t not in self.bind:
                producer = dev.producer[t][0] if t in dev.producer else -1
                self.bind[t] = _Binding(_Cell(producer, [_Alt(ref_in[k], (), None, 0.8, "graph")],
                                              f"the weights of its reader {dev.label(i)!r}"))
        self.narrow(i, list(combo), [_Match(j, ends, score, combo)])
        self.record(i, [_Match(j, ends, score, combo, weights=weights)])
        return True

    def weight_index(self, heads: set[str]) -> dict[tuple, list[int]]:
        """Reference nodes with these ops and a constant weight, by the
        sorted shape of that weight."""
        key = frozenset(heads)
        if key not in self._weight_index:
            index: dict[tuple, list[int]] = defaultdict(list)
            for j, rn in enumerate(self.ref.nodes):
                if self.ref.op(j) in heads and len(rn.input) > 1 and rn.input[1] in self.ref.const:
                    shape = self.ref.shape(rn.input[1])
                    if shape is not None:
                        index[tuple(sorted(shape))].append(j)
            self._weight_index[key] = index
        return self._weight_index[key]

    def match(self, i: int) -> bool:
        flows = self.dev.flows[i]
        tensors = list(dict.fromkeys(t for _, t in flows))
        options = [[a.ref for a in self.bind[t].cell.alts] for t in tensors]
        matches: list[_Match] = []
        for combo_vals in itertools.islice(itertools.product(*options), 64):
            combo = dict(zip(tensors, combo_vals))
            found = self.chain_matches(i, combo)
            if not found and self.dev.op(i) in FAMILIES:
                found = self.region_matches(i, combo)
            matches += found
        matches = self.best(i, matches)
        if not matches:
            return False
        self.narrow(i, tensors, matches)
        self.record(i, matches)
        return True

    # ---- chains (same op, or a head op and what it absorbs)
    def chain_matches(self, i: int, combo: dict[str, str]) -> list[_Match]:
        dev, ref = self.dev, self.ref
        op = dev.op(i)
        heads = CHAIN_HEADS.get(op, {op} | ALIASES.get(op, set()))
        residual = self.residual_slot(i)
        main = [(k, combo[t]) for k, t in dev.flows[i] if k != residual]
        if not main:
            return []
        seeds = {r for _, r in main}
        out = []
        seen: set[int] = set()
        for seed in dict.fromkeys(r for _, r in main):
            for j in self.readers_through(seed):
                if j in seen or ref.op(j) not in heads:
                    continue
                seen.add(j)
                roots = [(k, *self.root(t, seeds)) for k, t in ref.flows[j]]
                if not self.same_inputs(i, main, j, [(k, r) for k, r, _ in roots]):
                    continue
                lead = tuple(sorted({n for _, _, passed in roots for n in passed}))
                ends = self.walk(i, j, lead, combo)
                if ends:
                    score, weights = self.head_score(i, j)
                    score *= self.activation_fit(i, ends[-1][1][-1])
                    m = _Match(j, ends, score, combo, weights=weights)
                    m.extras = self.extra_outputs(i, j)
                    out.append(m)
        return out

    def readers_through(self, t: str):
        """The reference readers of t, and those of the Identity/Dropout/
        Reshape-like nodes reading it (which the device may have dropped)."""
        stack = [(t, 0)]
        while stack:
            cur, depth = stack.pop()
            for j, _ in self.ref.data_consumers.get(cur, []):
                yield j
                if self.ref.see_through(j) and depth < 4:
                    stack.append((self.ref.out(j), depth + 1))

    def root(self, t: str, seeds: set[str]) -> tuple[str, tuple[int, ...]]:
        """The seed a reference tensor is read from through see-through
        nodes, and the nodes passed; t itself where it is no such thing."""
        passed: list[int] = []
        cur = t
        while cur not in seeds and cur in self.ref.producer and len(passed) < 4:
            j = self.ref.producer[cur][0]
            if not self.ref.see_through(j) or len(self.ref.flows[j]) != 1:
                break
            passed.append(j)
            cur = self.ref.flows[j][0][1]
        return (cur, tuple(passed)) if cur in seeds else (t, ())

    def same_inputs(self, i: int, main: list[tuple[int, str]], j: int, ref_flow: list[tuple[int, str]]) -> bool:
        """Do device node i and reference node j read the same tensors in the
        same input slots (any order for a commutative op; as many inputs for
        a variadic one)?"""
        dev_in = self.dev.nodes[i].input
        if self.dev.op(i) in VARIADIC and len(dev_in) != len(self.ref.nodes[j].input):
            return False
        # a shape computation the device folded into a constant
        ref_flow = [(k, r) for k, r in ref_flow
                    if not (r in self.ref.meta and k < len(dev_in) and dev_in[k] in self.dev.const)]
        if self.dev.op(i) in COMMUTATIVE or self.ref.op(j) in COMMUTATIVE:
            return sorted(r for _, r in ref_flow) == sorted(r for _, r in main)
        return ref_flow == main

    def residual_slot(self, i: int) -> int | None:
        n = self.dev.nodes[i]
        if self.dev.op(i) in ("FusedConv", "Conv", "NhwcConv") and len(n.input) > 3 and n.input[3] \
                and n.input[3] not in self.dev.const:
            return 3
        return None

    def walk(self, i: int, head: int, lead: tuple[int, ...], combo: dict[str, str]) \
            -> list[tuple[str, tuple[int, ...]]]:
        """The acceptable ends of the reference chain starting at ``head``
        that device node i may stand for."""
        dev, ref = self.dev, self.ref
        op = dev.op(i)
        chain = op in CHAIN_HEADS
        act = dev.attrs(i).get("activation") if chain else None
        res_slot = self.residual_slot(i)
        residual = combo[dev.nodes[i].input[res_slot]] if res_slot is not None else None
        state = {"act": False, "res": False}
        cover = list(lead) + [head]
        cur = ref.out(head)
        ends = []

        def acceptable() -> bool:
            return state["act"] == (act is not None) and state["res"] == (residual is not None)

        if acceptable():
            ends.append((cur, tuple(cover)))
        while cur not in ref.outputs:
            readers = ref.data_consumers.get(cur, [])
            if len(readers) != 1:
                break
            j, slot = readers[0]
            kind = self.chain_step(j, slot, chain, act, residual, state)
            if kind is None:
                break
            if kind in state:
                state[kind] = True
            cover.append(j)
            cur = ref.out(j)
            if acceptable():
                ends.append((cur, tuple(cover)))
        return ends

    def chain_step(self, j: int, slot: int, chain: bool, act: str | None, residual: str | None,
                   state: dict) -> str | None:
        ref = self.ref
        op = ref.op(j)
        if ref.transparent(j):
            return "transparent"
        if not chain or state["act"]:
            return None
        if act is not None and op == act:
            return None if residual is not None and not state["res"] else "act"
        flows = ref.flows[j]
        if op == "Add" and residual is not None and not state["res"] and len(flows) == 2 \
                and {t for _, t in flows} - {ref.c(ref.nodes[j].input[slot])} == {residual}:
            return "res"
        if not state["res"] and len(flows) == 1 and self.affine(j, slot):
            return "affine"
        return None

    def activation_fit(self, i: int, j: int) -> float:
        """0.8 where the device node's fused activation has other parameters
        than the reference activation node j (alpha, beta, clip bounds)."""
        dev, ref = self.dev, self.ref
        params = dev.attrs(i).get("activation_params")
        if not params or dev.attrs(i).get("activation") != ref.op(j):
            return 1.0
        a = ref.attrs(j)
        if ref.op(j) == "Clip":
            bounds = [ref.value(t) if t else None for t in list(ref.nodes[j].input[1:3])]
            theirs = [float(b.ravel()[0]) if b is not None and b.size else None for b in bounds]
            theirs = [x if x is not None else d for x, d in zip(theirs + [None] * 2, (a.get("min"), a.get("max")))]
        elif ref.op(j) == "LeakyRelu":
            theirs = [a.get("alpha", 0.01)]
        elif ref.op(j) == "HardSigmoid":
            theirs = [a.get("alpha", 0.2), a.get("beta", 0.5)]
        else:
            return 1.0
        if any(x is None for x in theirs) or len(theirs) != len(params):
            return 1.0
        return 1.0 if np.allclose(params, theirs, rtol=1e-4, atol=1e-6) else 0.8

    def affine(self, j: int, slot: int) -> bool:
        op = self.ref.op(j)
        if op == "BatchNormalization":
            return slot == 0 and len(self.ref.outputs_of(j)) == 1
        return op in ("Add", "Mul") or (op in ("Sub", "Div") and slot == 0)

    def extra_outputs(self, i: int, j: int) -> dict[int, str]:
        d, r = self.dev.nodes[i].output, self.ref.nodes[j].output
        return {k: r[k] for k in range(1, min(len(d), len(r))) if d[k] and r[k]}

    # ---- subgraph fusions (LayerNorm, Gelu, Attention...)
    def region_matches(self, i: int, combo: dict[str, str]) -> list[_Match]:
        extras = sum(1 for t in self.dev.nodes[i].output[1:] if t)
        mine = _params(self.dev, [i])
        out = []
        for j, cover in _regions(self.ref, set(combo.values()), FAMILIES[self.dev.op(i)], extras):
            score, weights = _params_agree(mine, _params(self.ref, cover))
            out.append(_Match(None, [(self.ref.out(j), cover)], score, combo, weights=weights))
        return out

    # ---- scoring
    def head_score(self, i: int, j: int) -> tuple[float, str]:
        dev, ref = self.dev, self.ref
        op_d, op_r = dev.op(i), ref.op(j)
        designed = op_r in CHAIN_HEADS.get(op_d, ()) and not (op_d == "MatMul" and op_r == "Gemm")
        score = 1.0 if op_d == op_r or designed else 0.9
        da, ra = dev.attrs(i), ref.attrs(j)
        for name in (set(da) & set(ra)) - IGNORED_ATTRS:
            if da[name] != ra[name]:
                score *= 0.8
        relations = self.weight_relations(i, j)
        for rel in relations:
            score *= RELATION_SCORE[rel]
        return score, min(relations, key=RELATION_SCORE.get, default="unknown")

    def weight_slots(self, i: int, j: int) -> list[tuple[int, int]]:
        """(device slot, reference slot) of the weights two paired nodes read."""
        dev, ref = self.dev, self.ref
        dn, rn = dev.nodes[i], ref.nodes[j]
        if dev.op(i) in CHAIN_HEADS:
            slots = [(1, 1)]
        elif dev.op(i) in COMMUTATIVE:
            slots = list(zip([k for k, t in enumerate(dn.input) if t in dev.const],
                             [k for k, t in enumerate(rn.input) if t in ref.const]))
        else:
            slots = [(k, k) for k in range(min(len(dn.input), len(rn.input)))]
        return [(kd, kr) for kd, kr in slots if kd < len(dn.input) and kr < len(rn.input)
                and dn.input[kd] in dev.const and rn.input[kr] in ref.const
                and dn.input[kd] not in dev.meta and rn.input[kr] not in ref.meta]

    def weight_rows(self, out: GraphAlignment, i: int, j: int, folding: bool, stored: bool = False) -> None:
        """The weights (float constants) of device node i and its reference
        node j, side by side, once per pair; ``folding``: the device node
        covers more reference nodes than j (a BN folded into its weights);
        ``stored``: initializers in their stored types, not widened to
        float64 (weights.relation tells an FP16 rounding in one pass so)."""
        key = (i, j)
        if key in self._weights_done:
            return
        self._weights_done.add(key)
        dev, ref = self.dev, self.ref
        for kd, kr in self.weight_slots(i, j):
            td, tr = dev.nodes[i].input[kd], ref.nodes[j].input[kr]
            if ref.types.get(tr) not in FLOAT_TYPES:     # shapes, axes, indices: not weights
                continue
            out.weights.append({"folding": folding, "reference_node": ref.label(j), "reference_weight": tr,
                                "device_node": dev.label(i), "device_weight": td, "slot": kr,
                                "reference": ref.stored(tr) if stored else ref.value(tr),
                                "device": dev.stored(td) if stored else dev.value(td),
                                "blocked": dev.nodes[i].domain == NCHWC_DOMAIN and kd == 1})
        if dev.op(i) == ref.op(j):      # the same op: its attributes are parameters too (epsilon, alpha...)
            da, ra = dev.attrs(i), ref.attrs(j)
            for name in sorted((set(da) & set(ra)) - IGNORED_ATTRS - {"to", "saturate"}):   # Cast: the precision
                if da[name] != ra[name]:
                    out.weights.append({"reference_node": ref.label(j), "reference_weight": f"{name} (attribute)",
                                        "device_node": dev.label(i), "device_weight": f"{name} (attribute)",
                                        "slot": -1, "attribute": (ra[name], da[name])})

    def weight_relations(self, i: int, j: int) -> list[str]:
        dev, ref = self.dev, self.ref
        dn, rn = dev.nodes[i], ref.nodes[j]
        if dev.op(i) in CHAIN_HEADS:   # the weight decides; biases move with folding
            slots = [(1, 1)]
        elif dev.op(i) in COMMUTATIVE:
            dc = [k for k, t in enumerate(dn.input) if t in dev.const]
            rc = [k for k, t in enumerate(rn.input) if t in ref.const]
            slots = list(zip(dc, rc))
        else:
            slots = [(k, k) for k in range(min(len(dn.input), len(rn.input)))]
        out = []
        for kd, kr in slots:
            if kd < len(dn.input) and kr < len(rn.input) and dn.input[kd] in dev.const \
                    and rn.input[kr] in ref.const:
                relation = _blocked_relation if dn.domain == NCHWC_DOMAIN and kd == 1 else _weights_relation
                out.append(relation(dev.value(dn.input[kd]), ref.value(rn.input[kr])))
        return out

    def best(self, i: int, matches: list[_Match]) -> list[_Match]:
        """Drop ends whose shape contradicts the device's, then keep the
        best-scoring matches; a name agreement only breaks a tie."""
        out_shape = self.dev.shape(self.dev.nodes[i].output[0]) if not self.out_layout(i) else None
        kept = []
        for m in matches:
            fits = [(_shape_fit(out_shape, self.ref.shape(t)), (t, c)) for t, c in m.ends]
            exact = [e for f, e in fits if f == 1.0]
            if exact:
                m.ends = exact
            else:     # the same elements in another shape: a reshape the device skipped or added
                m.ends, m.score = [e for f, e in fits if f], m.score * 0.9
            if m.ends:
                kept.append(m)
        if not kept:
            return []
        top = max(m.score for m in kept)
        kept = [m for m in kept if m.score >= top - 1e-9]
        if len({m.head for m in kept}) > 1:
            named = [m for m in kept if self.names_agree(i, m)]
            if len(named) == 1:
                kept = named
        return kept

    def names_agree(self, i: int, m: _Match) -> bool:
        n = self.dev.nodes[i]
        dev_names = {_norm(n.name), _norm(n.output[0])} - {""}
        ref_names = {_norm(t) for t, _ in m.ends}
        if m.head is not None:
            ref_names.add(_norm(self.ref.nodes[m.head].name))
        return bool(dev_names & (ref_names - {""}))

    # ---- consumers decide
    def narrow(self, i: int, tensors: list[str], matches: list[_Match]) -> None:
        for t in tensors:
            used = {m.combo[t] for m in matches}
            cell = self.bind[t].cell
            self.keep(cell, lambda a, used=used: a.ref in used, f"its reader {self.dev.label(i)!r}")

    def keep(self, cell: _Cell, pred, why: str) -> None:
        """Keep the alternatives that pass (never none), and narrow the
        device inputs to what the kept ones assumed of them."""
        work = [(cell, pred)]
        while work:
            cell, pred = work.pop()
            kept = [a for a in cell.alts if pred(a)]
            if not kept or len(kept) == len(cell.alts):
                continue
            cell.alts, cell.settled_by = kept, why
            for t in set.intersection(*(set(a.assumed) for a in kept)):
                if t in self.bind:
                    used = {a.assumed[t] for a in kept}
                    work.append((self.bind[t].cell, lambda a, used=used: a.ref in used))

    def record(self, i: int, matches: list[_Match]) -> None:
        outs = self.dev.nodes[i].output
        alts: dict[str, _Alt] = {}
        for m in matches:
            for t, cover in m.ends:
                method = "fused" if len([j for j in cover if not self.ref.see_through(j)]) > 1 \
                    else "graph"
                if t in alts and alts[t].score >= m.score:   # the same end by another route
                    alts[t].assumed = {k: v for k, v in alts[t].assumed.items() if m.combo.get(k) == v}
                else:
                    alts[t] = _Alt(t, cover, m.head, m.score, method, m.weights, dict(m.combo))
        layout = self.out_layout(i)
        if layout == "flat" and all(_shapes_agree(self.dev.shape(outs[0]), self.ref.shape(t)) for t in alts):
            layout = ""
        self.bind[outs[0]] = _Binding(_Cell(i, list(alts.values())), layout)
        for k, t in enumerate(outs[1:], start=1):
            if not t:
                continue
            refs = list(dict.fromkeys(m.extras[k] for m in matches if k in m.extras))
            if not refs:
                refs = self.escaped(matches) if self.dev.op(i) in FAMILIES else []
            if refs:
                self.bind[t] = _Binding(_Cell(i, [_Alt(r, (), None, min(m.score for m in matches), "graph")
                                                  for r in refs]))
            else:
                self.notes[t] = "no reference tensor for this extra output"

    def out_layout(self, i: int) -> str:
        """The layout of a matched device node's output: NCHWc ops and
        whatever reads a blocked tensor write blocked tensors, Nhwc ops
        channels-last ones, elementwise ops keep their input's."""
        dev = self.dev
        if dev.nodes[i].domain == NCHWC_DOMAIN:
            return "nchwc"
        if dev.op(i).startswith("Nhwc"):
            return "perm:0,2,3,1"
        layouts = {self.bind[t].layout for _, t in dev.flows[i] if t in self.bind}
        if "nchwc" in layouts:      # NCHWc graphs run activations on blocked tensors
            return "nchwc"
        if "flat" in layouts and layouts <= {"", "flat"}:
            return "flat"
        if dev.op(i) in ELEMENTWISE and len(layouts) == 1:
            return layouts.pop()
        return ""

    def escaped(self, matches: list[_Match]) -> list[str]:
        out = []
        for m in matches:
            for t_end, cover in m.ends:
                cone = set(cover)
                for j in cover:
                    for t in map(self.ref.c, self.ref.outputs_of(j)):
                        if t != t_end and t not in self.ref.meta and any(
                                k not in cone for k, _ in self.ref.data_consumers.get(t, [])):
                            out.append(t)
        return list(dict.fromkeys(out))

    # -- 5. device-only helpers
    # ---- a Transpose the device moved down past Slice / Squeeze / elementwise ops
    def commute(self, i: int) -> bool:
        """onnxruntime's transpose optimizer pushes a Transpose down through
        Slice, Squeeze and elementwise nodes and merges it with the next
        Transpose: the device slices in the original axis order and
        transposes after, where the reference transposes first. Such a
        device node stands for the reference node that reads the Transpose
        (or, once its input is already permuted, the one reading that input
        itself), its output holding the reference's axes permuted
        (``perm:`` layout); the device Transpose that restores an order a
        reference Transpose makes stands for that Transpose's output."""
        dev, ref = self.dev, self.ref
        op, flows = dev.op(i), dev.flows[i]
        if op not in COMMUTING or len(flows) != 1 or flows[0][1] not in self.bind:
            return False
        b = self.bind[flows[0][1]]
        if b.layout and not b.layout.startswith("perm:"):
            return False
        before = _perm(b.layout)
        if before and not b.moved:     # a device-only Transpose: match() and the values judge what follows
            return False
        found: list[tuple[str, int, tuple[int, ...]]] = []
        for alt in b.cell.alts:
            if op == "ReorderInput":     # the reference's NHWC -> NCHW Transpose folded into the reorder
                if dev.attrs(i).get("channels_last") and not before:
                    found += [(ref.out(j), j, ()) for j, _ in ref.data_consumers.get(alt.ref, [])
                              if ref.op(j) == "Transpose" and _moves_channels_first(ref.attrs(j).get("perm"))]
                continue
            if op == "Transpose":
                after = self.next_layout(i, b.layout) if before else None
                if after and after.startswith("perm:"):
                    found += [(ref.out(j), j, ()) for j, _ in ref.data_consumers.get(alt.ref, [])
                              if ref.op(j) == "Transpose" and tuple(ref.attrs(j).get("perm", ())) == _perm(after)]
                continue
            if not before and any(ref.op(k) == op for k, _ in ref.data_consumers.get(alt.ref, [])):
                return False      # read directly, as the device does: match() pairs it
            paths = [(alt.ref, ())] if before else []
            paths += [(ref.out(j), tuple(ref.attrs(j).get("perm", ()))) for j, _ in ref.data_consumers.get(alt.ref, [])
                      if ref.op(j) == "Transpose"]
            for y, p in paths:
                rank = len(before or p)
                if not rank or (before and p and len(p) != len(before)):
                    continue
                inv = [0] * rank
                for a, x in enumerate(p or range(rank)):
                    inv[x] = a
                q = tuple(inv[x] for x in (before or range(rank)))     # device input axis -> axis of y
                for k, _ in ref.data_consumers.get(y, []):
                    if ref.op(k) == op and len(ref.flows[k]) == 1:
                        out = self.commuted(i, k, q)
                        if out is not None:
                            found.append((ref.out(k), k, out))
        if len(found) != 1:
            return False
        t, k, out = found[0]
        layout = "" if list(out) == sorted(out) else "perm:" + ",".join(map(str, out))
        if op == "ReorderInput":
            layout = "nchwc"
        via = f"{dev.op(i)} {dev.label(i)!r} before the Transpose the reference does first"
        self.bind[dev.nodes[i].output[0]] = _Binding(_Cell(i, [_Alt(t, (k,), k, 0.9, "graph")]), layout,
                                                     "" if op == "Transpose" else via, moved=True)
        return True

    def commuted(self, i: int, k: int, q: tuple[int, ...]) -> tuple[int, ...] | None:
        """Does device node i compute reference node k on its input with the
        axes permuted by ``q`` (device axis a = reference axis q[a])? The
        permutation of the output, or None."""
        dev, ref = self.dev, self.ref
        op, rank = dev.op(i), len(q)
        if op in ELEMENTWISE:
            same = {n: v for n, v in dev.attrs(i).items() if n not in IGNORED_ATTRS} == \
                {n: v for n, v in ref.attrs(k).items() if n not in IGNORED_ATTRS}
            return q if same else None
        if op == "Slice":
            d, r = self._slice_args(dev, i), self._slice_args(ref, k)
            if d is None or r is None or d[:3] != r[:3]:
                return None
            return q if [q[a % rank] for a in d[3]] == [a % rank for a in r[3]] else None
        if op == "Squeeze":
            d, r = self._squeeze_axes(dev, i), self._squeeze_axes(ref, k)
            if d is None or r is None or {q[a % rank] for a in d} != {a % rank for a in r}:
                return None
            kept_ref = [a for a in range(rank) if a not in {x % rank for x in r}]
            return tuple(kept_ref.index(q[a]) for a in range(rank) if a not in {x % rank for x in d})
        return None

    @staticmethod
    def _slice_args(g: _Graph, j: int) -> tuple | None:
        """(starts, ends, steps, axes) of a Slice, as lists; None where not constant."""
        n = g.nodes[j]
        if len(n.input) < 4 or not n.input[3]:
            return None
        vals = [g.value(t) if t else None for t in list(n.input[1:5]) + [""] * (5 - len(n.input))]
        if any(v is None for v in vals[:3]):
            return None
        steps = vals[3] if vals[3] is not None else np.ones(len(vals[0]))
        return ([int(x) for x in vals[0]], [int(x) for x in vals[1]], [int(x) for x in steps],
                [int(x) for x in vals[2]])

    @staticmethod
    def _squeeze_axes(g: _Graph, j: int) -> list[int] | None:
        n = g.nodes[j]
        if "axes" in g.attrs(j):
            return [int(a) for a in g.attrs(j)["axes"]]
        v = g.value(n.input[1]) if len(n.input) > 1 and n.input[1] else None
        return None if v is None else [int(a) for a in v.ravel()]

    def passthrough(self, i: int) -> bool:
        dev = self.dev
        flows = dev.flows[i]
        if len(flows) != 1:
            return False
        b = self.bind[flows[0][1]]
        layout = self.next_layout(i, b.layout)
        if layout is None:
            return False
        via = f"{b.via} → {dev.op(i)} {dev.label(i)!r}" if b.via else f"{dev.op(i)} {dev.label(i)!r}"
        cell = self.clamping_cell(i, b.cell) if dev.op(i) == "QuantizeLinear" else b.cell
        if layout == "flat" and all(_shapes_agree(self.reshaped_to(i), self.ref.shape(a.ref)) for a in cell.alts):
            layout = ""
        self.bind[dev.nodes[i].output[0]] = _Binding(cell, layout, via, unfused=b.unfused)
        return True

    def reshaped_to(self, i: int) -> tuple | None:
        """The output shape of a device Reshape-like node: inferred, or its
        constant target where that names every dimension."""
        dev = self.dev
        shape = dev.shape(dev.nodes[i].output[0])
        if shape is not None and None not in shape:
            return shape
        n = dev.nodes[i]
        if dev.op(i) == "Reshape" and len(n.input) > 1:
            target = dev.value(n.input[1])
            if target is not None and target.ndim == 1 and (target > 0).all():
                return tuple(int(x) for x in target)
        return shape

    def clamping_cell(self, i: int, cell: _Cell) -> _Cell:
        """Quantizers drop a Relu/Clip that the quantized range clamps anyway:
        a QuantizeLinear may stand for its input or for that activation of it;
        its readers (or, failing them, its zero point) decide."""
        src = self.dev.flows[i][0][1]
        alts = []
        for a in cell.alts:
            alts.append(_Alt(a.ref, a.cover, a.head, a.score, a.method, a.weights, {src: a.ref}))
            readers = self.ref.data_consumers.get(a.ref, [])
            if len(readers) == 1 and self.ref.op(readers[0][0]) in ("Relu", "Clip") and a.ref not in self.ref.outputs:
                j = readers[0][0]
                alts.append(_Alt(self.ref.out(j), (j,), None, a.score, "fused", a.weights, {src: a.ref}))
        if len(alts) == len(cell.alts):
            return cell
        return _Cell(i, alts, derived=True)

    def next_layout(self, i: int, layout: str) -> str | None:
        dev = self.dev
        op, a = dev.op(i), dev.attrs(i)
        if op in ("Identity", "Dropout"):
            return layout
        if op in RESHAPES:     # NCHWc code views blocked tensors in 5-D to add them
            return {"": "flat", "flat": "flat", "nchwc": "nchwc"}.get(layout)
        if op == "Cast":
            src = dev.types.get(dev.nodes[i].input[0])
            return layout if a.get("to") in FLOAT_TYPES and (src is None or src in FLOAT_TYPES) else None
        if op == "QuantizeLinear":
            return "quantized" if layout == "" else None
        if op == "DequantizeLinear":
            return "" if layout == "quantized" else None
        if op == "ReorderInput":
            return "nchwc" if layout == "" and not a.get("channels_last") else None
        if op == "ReorderOutput":
            return ("perm:0,2,3,1" if a.get("channels_last") else "") if layout == "nchwc" else None
        if op == "Transpose" and (layout == "" or layout.startswith("perm:")):
            perm = a.get("perm")
            if perm is None:
                return None
            before = [int(x) for x in layout[5:].split(",")] if layout else list(range(len(perm)))
            if len(before) != len(perm):
                return None
            after = [before[p] for p in perm]
            return "" if after == sorted(after) else "perm:" + ",".join(map(str, after))
        return None

    def absorb(self, i: int) -> bool:
        """A device BN / affine-constant node the reference has folded into the
        Conv/Gemm/MatMul its input is bound to: it carries the pairing on."""
        dev, ref = self.dev, self.ref
        flows = dev.flows[i]
        if len(flows) != 1:
            return False
        slot, t = flows[0]
        b = self.bind[t]
        op = dev.op(i)
        foldable = op == "BatchNormalization" and slot == 0 or op in ("Add", "Mul") \
            or op in ("Sub", "Div") and slot == 0
        if not foldable or b.layout or not b.cell.alts:
            return False
        heads = {a.head for a in b.cell.alts}
        if None in heads or not all(ref.op(j) in ("Conv", "ConvTranspose", "Gemm", "MatMul") for j in heads):
            return False
        b.superseded = (f"a partial result: the reference folds device node {dev.label(i)!r} "
                        f"({op}) into its {ref.op(heads.pop())}")
        self.bind[dev.nodes[i].output[0]] = _Binding(b.cell, b.layout, b.via, unfused=True)
        return True

    def reverse_region(self, i: int) -> bool:
        """The reference computes in one fused node (LayerNormalization,
        Gelu...) what the device decomposes, starting at device node i: the
        device subgraph's result takes that node's pairing, its
        intermediates are listed unmatched."""
        dev, ref = self.dev, self.ref
        by_ref: dict[str, str] = {}
        for _, t in dev.flows[i]:
            for a in self.bind[t].cell.alts:
                by_ref.setdefault(a.ref, t)
        best: tuple[float, int, int, tuple[int, ...]] | None = None
        tied = False
        for j in dict.fromkeys(j for r in list(by_ref) for j in self.readers_through(r)):
            fam = FAMILIES.get(ref.op(j))
            ins = [self.root(t, set(by_ref))[0] for _, t in ref.flows[j]]
            if fam is None or not ins or not all(r in by_ref for r in ins):
                continue
            seeds = {by_ref[r] for r in ins}
            theirs = _params(ref, [j])
            for end, cone in _regions(dev, seeds, fam, 0):
                if i not in cone:
                    continue
                score = _params_agree(_params(dev, cone), theirs)[0] * self.reader_fit(end, j)
                if best is None or score > best[0] + 1e-9:
                    best, tied = (score, j, end, cone), False
                elif abs(score - best[0]) <= 1e-9 and (best[1], best[2]) != (j, end):
                    tied = True
        if best is None or tied:
            return False
        score, j, end, cone = best
        out = dev.nodes[end].output[0]
        self.bind[out] = _Binding(_Cell(end, [_Alt(ref.out(j), (j,), j, score, "fused")]), unfused=True)
        for k in cone:
            self.inside.add(k)
            for t in dev.outputs_of(k):
                if t != out:
                    self.notes[t] = (f"computed inside reference node {ref.label(j)!r} ({ref.op(j)}), "
                                     "which the reference does not split")
        return True

    def reader_fit(self, end: int, j: int) -> float:
        """1.0 where the device end's readers do what the reference node's
        readers do (by op type), else 0.9: which end of a decomposed Gelu
        stands for the Gelu."""
        dev_ops = {self.dev.op(k) for t in self.dev.outputs_of(end) for k, _ in self.dev.data_consumers.get(t, [])}
        ref_ops = {self.ref.op(k) for t in map(self.ref.c, self.ref.outputs_of(j)) for k in self.readers_through(t)}
        fits = all(op in ref_ops or CHAIN_HEADS.get(op, set()) & ref_ops or ALIASES.get(op, set()) & ref_ops
                   for op in dev_ops)
        return 1.0 if fits else 0.9

    # -- 4. what no consumer settled
    def settle(self) -> dict[int, str]:
        """Resolve the cells still open; returns cell id -> why it stays ambiguous."""
        cells = {id(b.cell): b.cell for b in self.bind.values() if b.cell.node >= 0}
        open_reason: dict[int, str] = {}
        for cell in cells.values():
            if len(cell.alts) > 1:
                self.settle_one(cell)
        changed = True
        while changed:        # a reference tensor claimed by one device node is not another's
            changed = False
            claimed = {cell.alts[0].ref for cell in cells.values() if len(cell.alts) == 1}
            for cell in cells.values():
                if len(cell.alts) > 1 and not cell.derived and any(a.ref in claimed for a in cell.alts):
                    before = len(cell.alts)
                    self.keep(cell, lambda a: a.ref not in claimed, "the other device tensors' pairs")
                    changed = changed or len(cell.alts) < before
                    if len(cell.alts) > 1:
                        self.settle_one(cell)
        for cell in cells.values():
            if len(cell.alts) > 1:
                open_reason[id(cell)] = (f"{len(cell.alts)} reference tensors fit device node "
                                         f"{self.dev.label(cell.node)!r} equally (op, inputs, shapes, weights) "
                                         "and no reader tells them apart")
        return open_reason

    def settle_one(self, cell: _Cell) -> None:
        ref = self.ref
        if cell.derived:
            clamps = self.quantizer_clamps(cell.node)
            if clamps is not None:
                self.keep(cell, lambda a: (a.method == "fused") == clamps, "the quantizer's zero point")
            return
        outs = set(self.dev.outputs_of(cell.node))
        if outs & self.dev.outputs:
            final = [a for a in cell.alts if a.ref in ref.outputs]
            if len(final) == 1:
                self.keep(cell, lambda a: a is final[0], "graph outputs")
                return
        heads = {a.head for a in cell.alts}
        if len(heads) == 1:
            cores = {tuple(j for j in a.cover if not ref.see_through(j)) for a in cell.alts}
            if len(cores) == 1:       # the same computation, seen before or after an Identity
                first = min(cell.alts, key=lambda a: len(a.cover))
                self.keep(cell, lambda a: a is first, "value-equal tensors")
                return
            fit = [a for a in cell.alts if self.folding_fits(cell.node, a)]
            if len(fit) == 1:
                self.keep(cell, lambda a: a is fit[0], "its weights (BN/affine folding)")

    def quantizer_clamps(self, i: int) -> bool | None:
        """Does QuantizeLinear i clamp at zero (its zero point the type's minimum)?"""
        n = self.dev.nodes[i]
        if len(n.input) < 3 or not n.input[2]:
            return True       # uint8, zero point 0
        zp = self.dev.value(n.input[2])
        kind = self.dev.types.get(n.input[2])
        low = {onnx.TensorProto.UINT8: 0, onnx.TensorProto.INT8: -128, onnx.TensorProto.UINT16: 0,
               onnx.TensorProto.INT16: -32768}.get(kind)
        if zp is None or low is None:
            return None
        return bool(np.all(zp == low))

    def folding_fits(self, i: int, alt: _Alt) -> bool:
        """Do the device node's weight and bias equal the reference head's
        with the alternative's BN/affine tail folded in?"""
        dev, ref = self.dev, self.ref
        if alt.head is None or dev.op(i) not in CHAIN_HEADS or ref.op(alt.head) not in ("Conv", "ConvTranspose",
                                                                                       "Gemm"):
            return False
        rn, dn = ref.nodes[alt.head], dev.nodes[i]
        w = ref.value(rn.input[1]) if len(rn.input) > 1 else None
        dw = dev.value(dn.input[1]) if len(dn.input) > 1 else None
        if w is None or dw is None:
            return False
        axis = 1 if ref.op(alt.head) == "ConvTranspose" else 0
        c = w.shape[axis]
        b = ref.value(rn.input[2]) if len(rn.input) > 2 and rn.input[2] else np.zeros(c)
        db = dev.value(dn.input[2]) if len(dn.input) > 2 and dn.input[2] else np.zeros(c)
        if b is None or db is None:
            return False
        scale, shift = np.ones(c), np.zeros(c)
        prev = rn.output[0]
        for j in alt.cover[alt.cover.index(alt.head) + 1:]:
            step = self.affine_step(j, prev, c)
            if step is None:      # an activation or the residual Add: nothing more to fold
                break
            s, t = step
            scale, shift = scale * s, shift * s + t
            prev = ref.nodes[j].output[0]
        shape = [1] * w.ndim
        shape[axis] = c
        return (_weights_relation(dw, w * scale.reshape(shape)) == "equal"
                and _weights_relation(db.reshape(-1), b.reshape(-1) * scale + shift) == "equal")

    def affine_step(self, j: int, prev: str, c: int) -> tuple[np.ndarray, np.ndarray] | None:
        ref = self.ref
        n, op = ref.nodes[j], ref.op(j)
        if ref.transparent(j):
            return np.ones(c), np.zeros(c)
        if op not in ("BatchNormalization", "Add", "Sub", "Mul", "Div"):
            return None
        consts = [ref.value(t) for t in n.input if t and ref.c(t) != prev]
        if not consts or any(v is None for v in consts):
            return None
        try:
            if op == "BatchNormalization":
                g, beta, mean, var = (np.broadcast_to(v.reshape(-1), (c,)) for v in consts[:4])
                s = g / np.sqrt(var + ref.attrs(j).get("epsilon", 1e-5))
                return s, beta - mean * s
            v = np.broadcast_to(consts[0].reshape(-1), (c,)) if consts[0].size in (1, c) else None
        except ValueError:
            return None
        if v is None:
            return None
        return {"Add": (np.ones(c), v), "Sub": (np.ones(c), -v), "Mul": (v, np.zeros(c)),
                "Div": (1.0 / v, np.zeros(c))}.get(op)

    # -- results
    def result(self) -> GraphAlignment:
        open_reason = self.settle()
        out = GraphAlignment()
        dev = self.dev
        for i in range(len(dev.nodes)):
            for t in dev.outputs_of(i):
                if t in dev.const:
                    continue
                b = self.bind.get(t)
                if b is None:
                    self.unmatched(out, t, self.notes.get(t, "not aligned"))
                elif b.superseded:
                    self.unmatched(out, t, b.superseded)
                elif id(b.cell) in open_reason:
                    out.ambiguous.append((t, [a.ref for a in b.cell.alts], open_reason[id(b.cell)]))
                elif not b.cell.alts:
                    self.unmatched(out, t, "no reference tensor left for it")
                elif b.cell.node < 0:
                    out.input_copies[t] = b.cell.alts[0].ref
                    self.unmatched(out, t, f"a copy of graph input {b.cell.alts[0].ref!r} (via {b.via}); "
                                           "graph inputs are not compared")
                else:
                    self.emit(out, t, b)
        paired = {p.ref_tensor for p in out.pairs.values()}
        out.fused = {r: d for r, d in out.fused.items() if r not in paired and r not in out.layout_only.values()}
        ref = self.ref
        for j, n in enumerate(ref.nodes):
            if n.op_type in ("Constant", "ConstantOfShape"):
                continue
            for t in n.output:
                if t and (t in ref.const or t in ref.meta) and ref.c(t) not in paired and t not in paired \
                        and t not in out.fused:
                    out.folded[t] = ("computed from constants only" if t in ref.const
                                     else "a shape computation") + "; no device node computes it (folded)"
        return out

    def unmatched(self, out: GraphAlignment, t: str, why: str) -> None:
        out.unmatched.append(t)
        out.reasons[t] = why

    def emit(self, out: GraphAlignment, t: str, b: _Binding) -> None:
        dev, ref = self.dev, self.ref
        alt = self.reshaped_alias(t, b.cell.alts[0])
        label = dev.label(b.cell.node)
        for j in alt.cover:
            for x in ref.outputs_of(j):
                if ref.c(x) != alt.ref and x not in ref.meta:
                    out.fused.setdefault(x, label)
        for x in ref.duplicates_of(alt.ref):   # merged by common-subexpression elimination
            out.fused.setdefault(x, label)
        layout = b.layout
        if layout == "flat" and _shapes_agree(dev.shape(t), ref.shape(alt.ref)):
            layout = ""
        elif layout == "" and _shape_fit(dev.shape(t), ref.shape(alt.ref)) == 0.9:
            layout = "flat"
        if layout == "quantized":
            out.layout_only[t] = alt.ref
            self.unmatched(out, t, f"holds reference tensor {alt.ref!r} in a quantized integer view; not "
                                   "comparable as is")
            return
        method = "fused" if b.unfused else alt.method
        folded = alt.weights == "scaled" and method == "fused" and self.folding_fits(b.cell.node, alt)
        score = alt.score / RELATION_SCORE["scaled"] if folded else alt.score
        if b.cell.settled_by in ("graph outputs", "its weights (BN/affine folding)"):
            score *= 0.8
        if layout.startswith("perm:"):
            score *= 0.9
        note = self.describe(b, alt, folded, layout)
        if alt.head is not None and b.cell.node >= 0 and not b.unfused:
            self.weight_rows(out, b.cell.node, alt.head, len(alt.cover) > 1)
        q = _perm(layout) if b.moved else ()
        perm = tuple(int(a) for a in np.argsort(q)) if q else None     # numpy's: dev.transpose(perm)
        blocked = layout == "nchwc"
        if blocked:     # the consumer undoes the blocks (layout.unblock_nchwc)
            score *= 0.9
            note += "; held in the blocked NCHWc layout, undone before comparing"
        out.pairs[t] = Pairing(self.member(t, alt.ref, out), method, round(min(score, 1.0), 3), note,
                               None if blocked else perm, blocked)
        if method == "fused" and len(alt.cover) > 1:
            out.groups[alt.ref] = [ref.label(j) for j in alt.cover]

    def member(self, t: str, rep: str, out: GraphAlignment) -> str:
        """Of identical reference computations (``rep`` and its duplicates),
        the one to name: the one the device tensor is named after, else the
        first no other device tensor took."""
        members = [rep] + self.ref.duplicates_of(rep)
        if len(members) == 1:
            return rep
        named = [m for m in members if _norm(m) == _norm(t)]
        if named:
            return named[0]
        taken = {p.ref_tensor for p in out.pairs.values()}
        return next((m for m in members if m not in taken), rep)

    def reshaped_alias(self, t: str, alt: _Alt) -> _Alt:
        """Where the device tensor has another shape than the reference
        tensor and a Reshape-like reader of that tensor gives exactly the
        device's shape, that reader's output is the better partner."""
        dev_shape, ref = self.dev.shape(t), self.ref
        if dev_shape is None or None in dev_shape or _shapes_agree(dev_shape, ref.shape(alt.ref)) is not False:
            return alt
        for j, _ in ref.data_consumers.get(alt.ref, []):
            out = ref.out(j)
            if ref.op(j) in RESHAPES and _shapes_agree(dev_shape, ref.shape(out)):
                return _Alt(out, alt.cover + (j,), alt.head, alt.score, alt.method, alt.weights, alt.assumed)
        return alt

    def describe(self, b: _Binding, alt: _Alt, folded: bool, layout: str) -> str:
        dev, ref = self.dev, self.ref
        i = b.cell.node
        parts = []
        if b.unfused:
            parts.append(f"the reference's {ref.op(alt.head) if alt.head is not None else 'node'} folds in what "
                         f"the device computes in several nodes from {dev.label(i)!r}")
        elif alt.method == "fused":
            chain = " → ".join(f"{ref.op(j)} {ref.label(j)!r}" for j in alt.cover)
            parts.append(f"device {dev.op(i)} {dev.label(i)!r} covers {chain}")
        if b.via:
            parts.append(f"via {b.via}")
        if layout.startswith("perm:"):
            parts.append(f"device layout is the reference transposed by ({layout[5:]})")
        elif layout == "flat":
            parts.append("the device holds the same elements in another shape (a reshape)")
        if b.cell.settled_by:
            parts.append(f"chosen by {b.cell.settled_by}")
        if folded:
            parts.append("weights are the reference's with the covered BatchNormalization/affine folded in")
        elif alt.weights == "scaled":
            parts.append("weights are the reference's scaled per output channel")
        elif alt.weights == "different":
            parts.append("weights differ from the reference's")
        return "; ".join(parts)


def weights_by_name(ref: onnx.ModelProto, dev: onnx.ModelProto) -> GraphAlignment:
    """The weights of a build that keeps every node's name and op (the FP16
    build the collector makes from the reference), each device node beside
    its namesake: ``weights`` alone is filled, with none of the search
    ``align_graphs`` makes for a graph of unknown origin."""
    aligner = _Aligner(ref, dev)
    out = GraphAlignment()
    namesake = {aligner.ref.label(j): j for j in range(len(aligner.ref.nodes))}
    for i in range(len(aligner.dev.nodes)):
        outs = aligner.dev.outputs_of(i)
        if not outs or all(t in aligner.dev.const for t in outs):   # weights computed from weights
            continue
        j = namesake.get(aligner.dev.label(i))
        if j is not None and aligner.dev.op(i) == aligner.ref.op(j):
            aligner.weight_rows(out, i, j, folding=False, stored=True)
    return out


def align_graphs(ref: onnx.ModelProto, dev: onnx.ModelProto) -> GraphAlignment:
    """Pair every device node output with the reference tensor it stands
    for, by graph structure (see the module docstring)."""
    aligner = _Aligner(ref, dev)
    aligner.run()
    return aligner.result()
