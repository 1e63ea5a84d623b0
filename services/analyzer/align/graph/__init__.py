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

Modules
-------
This package's entry points are here; its modules hold the parts:
``index`` (an ONNX graph indexed for the walk), ``ops`` (the op
tables), ``matching`` (steps 2, 3 and 7), ``fusions`` (the
subgraph families), ``rewrites`` (steps 5 and 6), ``aligner``
(the walk put together, step 4, the outcome), ``weights`` (weights as
evidence, and the weights of paired nodes), ``bindings`` (what a
device tensor is bound to) and ``alignment`` (the outcome).

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

from typing import TYPE_CHECKING

from layerdiff.analyzer.align.graph.aligner import GraphAligner
from layerdiff.analyzer.align.graph.alignment import GraphAlignment
from layerdiff.analyzer.align.graph.weights import WeightPairing

if TYPE_CHECKING:
    import onnx
else:
    from layerdiff.common.lazy import onnx

__all__ = ["GraphAlignment", "align_graphs", "weights_by_name"]


def weights_by_name(ref: onnx.ModelProto, dev: onnx.ModelProto) -> GraphAlignment:
    """The weights of a build that keeps every node's name and op (the FP16
    build the collector makes from the reference), each device node beside
    its namesake: ``weights`` alone is filled, with none of the search
    ``align_graphs`` makes for a graph of unknown origin."""
    aligner = WeightPairing(ref, dev)
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
    aligner = GraphAligner(ref, dev)
    aligner.run()
    return aligner.result()
