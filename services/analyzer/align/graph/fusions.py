"""Subgraph fusions in graph alignment: the families of ops a fused node
(LayerNormalization, Gelu, Attention, FusedMatMul, HardSwish...) stands for,
the regions of a graph such a node can cover, and whether their parameters
(gamma, beta, bias) agree."""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from layerdiff.analyzer.align.graph.index import IndexedGraph
from layerdiff.analyzer.align.graph.weights import weights_relation


@dataclass(frozen=True)
class Family:
    """A device op standing for a subgraph of the reference."""
    ops: frozenset[str]
    ends: frozenset[str]
    limit: int
    # each inner tuple: at least one of these ops must be in the covered subgraph
    required: tuple[tuple[str, ...], ...]


_LN = Family(frozenset({"ReduceMean", "Sub", "Pow", "Mul", "Add", "Sqrt", "Div", "Reciprocal", "Cast",
                         "LayerNormalization", "SimplifiedLayerNormalization"}),
              frozenset({"Add", "Mul", "Div", "LayerNormalization", "SimplifiedLayerNormalization", "Cast"}), 40,
              (("ReduceMean", "LayerNormalization", "SimplifiedLayerNormalization"),
               ("Sqrt", "Reciprocal", "Pow", "LayerNormalization", "SimplifiedLayerNormalization")))
_GELU = Family(frozenset({"Add", "Mul", "Div", "Erf", "Pow", "Tanh", "Sqrt", "Sigmoid", "Gelu", "FastGelu",
                           "BiasGelu"}),
                frozenset({"Mul", "Gelu", "FastGelu", "BiasGelu"}), 12,
                (("Erf", "Tanh", "Sigmoid", "Gelu", "FastGelu", "BiasGelu"),))
_ATTENTION = Family(frozenset({"MatMul", "Gemm", "Add", "Reshape", "Transpose", "Div", "Mul", "Softmax", "Sqrt",
                                "Slice", "Gather", "Unsqueeze", "Squeeze", "Concat", "Split", "Where", "Cast",
                                "Sub", "Equal", "Expand"}),
                     frozenset({"Reshape", "Transpose", "MatMul"}), 48, (("Softmax",), ("MatMul",)))
FAMILIES = {
    "LayerNormalization": _LN, "SimplifiedLayerNormalization": _LN, "SkipLayerNormalization": _LN,
    "SkipSimplifiedLayerNormalization": _LN, "RMSNormalization": _LN,
    "Gelu": _GELU, "FastGelu": _GELU, "BiasGelu": _GELU, "QuickGelu": _GELU,
    "Attention": _ATTENTION, "MultiHeadAttention": _ATTENTION,
    "FusedMatMul": Family(frozenset({"Transpose", "MatMul", "Mul", "Div"}), frozenset({"MatMul", "Mul", "Div"}),
                           6, (("MatMul",),)),
    "HardSwish": Family(frozenset({"Add", "Clip", "Mul", "Div", "HardSigmoid", "Relu", "Min", "Max"}),
                         frozenset({"Mul", "Div"}), 6, (("Clip", "HardSigmoid", "Relu", "Min"),)),
    "BiasAdd": Family(frozenset({"Add"}), frozenset({"Add"}), 3, (("Add",),)),
}


def _grow(g: IndexedGraph, seeds: set[str], fam: Family) -> list[int]:
    """The nodes of g computable from the seeds (and constants) with the
    family's ops, in topological order, at most fam.limit of them."""
    avail = set(seeds)
    heap = sorted({j for t in seeds for j, _ in g.data_consumers.get(t, [])})
    done: set[int] = set()
    region: list[int] = []
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


def fusion_regions(g: IndexedGraph, seeds: set[str], fam: Family, extras: int) -> list[tuple[int, tuple[int, ...]]]:
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


def _region_ok(g: IndexedGraph, end: int, cone: frozenset[int], fam: Family, extras: int) -> bool:
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


def const_params(g: IndexedGraph, nodes) -> list[np.ndarray]:
    """The non-scalar constant inputs of these nodes (gamma, beta, bias...)."""
    return [v for j in nodes for t in g.nodes[j].input if t in g.const
            for v in [g.value(t)] if v is not None and v.size > 1]


def params_agree(mine: list[np.ndarray], theirs: list[np.ndarray]) -> tuple[float, str]:
    """A score (0.8 per parameter left without an equal partner) and a word."""
    theirs = list(theirs)
    unmatched = 0
    for v in mine:
        k = next((k for k, w in enumerate(theirs) if weights_relation(v, w) == "equal"), None)
        if k is None:
            unmatched += 1
        else:
            theirs.pop(k)
    unmatched += len(theirs)
    word = "unknown" if not mine else ("equal" if not unmatched else "different")
    return 0.8 ** unmatched, word
