"""Steps 5 and 6 of graph alignment (layerdiff.analyzer.align.graph): what
the device rewrote. Device-only helpers carry a binding on (Identity, Cast,
Reshape-likes, Transposes, Q/DQ, NCHWc reorders), a Transpose the device
moved down is followed, and where the reference fused what the device
computes in several nodes, the device's last node takes the pairing."""
from __future__ import annotations

import numpy as np

from layerdiff.analyzer.align.graph.bindings import Alt, Binding, Cell
from layerdiff.analyzer.align.graph.fusions import FAMILIES, const_params, fusion_regions, params_agree
from layerdiff.analyzer.align.graph.index import IndexedGraph, shapes_agree
from layerdiff.analyzer.align.graph.matching import NodeMatcher
from layerdiff.analyzer.align.graph.ops import (
    ALIASES,
    CHAIN_HEADS,
    COMMUTING,
    ELEMENTWISE,
    FLOAT_TYPES,
    IGNORED_ATTRS,
    RESHAPES,
    layout_perm,
    moves_channels_first,
)


class RewriteFollower(NodeMatcher):
    """Follows the device's own helper ops and the folds either side made."""

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
        before = layout_perm(b.layout)
        if before and not b.moved:     # a device-only Transpose: match() and the values judge what follows
            return False
        found: list[tuple[str, int, tuple[int, ...]]] = []
        for alt in b.cell.alts:
            if op == "ReorderInput":     # the reference's NHWC -> NCHW Transpose folded into the reorder
                if dev.attrs(i).get("channels_last") and not before:
                    found += [(ref.out(j), j, ()) for j, _ in ref.data_consumers.get(alt.ref, [])
                              if ref.op(j) == "Transpose" and moves_channels_first(ref.attrs(j).get("perm"))]
                continue
            if op == "Transpose":
                after = self.next_layout(i, b.layout) if before else None
                if after and after.startswith("perm:"):
                    found += [(ref.out(j), j, ()) for j, _ in ref.data_consumers.get(alt.ref, [])
                              if ref.op(j) == "Transpose" and tuple(ref.attrs(j).get("perm", ())) == layout_perm(after)]
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
        self.bind[dev.nodes[i].output[0]] = Binding(Cell(i, [Alt(t, (k,), k, 0.9, "graph")]), layout,
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
            d_axes, r_axes = self._squeeze_axes(dev, i), self._squeeze_axes(ref, k)
            if d_axes is None or r_axes is None or {q[a % rank] for a in d_axes} != {a % rank for a in r_axes}:
                return None
            kept_ref = [a for a in range(rank) if a not in {x % rank for x in r_axes}]
            return tuple(kept_ref.index(q[a]) for a in range(rank) if a not in {x % rank for x in d_axes})
        return None

    @staticmethod
    def _slice_args(g: IndexedGraph, j: int) -> tuple | None:
        """(starts, ends, steps, axes) of a Slice, as lists; None where not constant."""
        n = g.nodes[j]
        if len(n.input) < 4 or not n.input[3]:
            return None
        vals = [g.value(t) if t else None for t in list(n.input[1:5]) + [""] * (5 - len(n.input))]
        starts, ends, axes, steps = vals
        if starts is None or ends is None or axes is None:
            return None
        if steps is None:
            steps = np.ones(len(starts))
        return ([int(x) for x in starts], [int(x) for x in ends], [int(x) for x in steps],
                [int(x) for x in axes])

    @staticmethod
    def _squeeze_axes(g: IndexedGraph, j: int) -> list[int] | None:
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
        if layout == "flat" and all(shapes_agree(self.reshaped_to(i), self.ref.shape(a.ref)) for a in cell.alts):
            layout = ""
        self.bind[dev.nodes[i].output[0]] = Binding(cell, layout, via, unfused=b.unfused)
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

    def clamping_cell(self, i: int, cell: Cell) -> Cell:
        """Quantizers drop a Relu/Clip that the quantized range clamps anyway:
        a QuantizeLinear may stand for its input or for that activation of it;
        its readers (or, failing them, its zero point) decide."""
        src = self.dev.flows[i][0][1]
        alts = []
        for a in cell.alts:
            alts.append(Alt(a.ref, a.cover, a.head, a.score, a.method, a.weights, {src: a.ref}))
            readers = self.ref.data_consumers.get(a.ref, [])
            if len(readers) == 1 and self.ref.op(readers[0][0]) in ("Relu", "Clip") and a.ref not in self.ref.outputs:
                j = readers[0][0]
                alts.append(Alt(self.ref.out(j), (j,), None, a.score, "fused", a.weights, {src: a.ref}))
        if len(alts) == len(cell.alts):
            return cell
        return Cell(i, alts, derived=True)

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
        if any(a.head is None for a in b.cell.alts):
            return False
        heads = {a.head for a in b.cell.alts if a.head is not None}
        if not all(ref.op(j) in ("Conv", "ConvTranspose", "Gemm", "MatMul") for j in heads):
            return False
        b.superseded = (f"a partial result: the reference folds device node {dev.label(i)!r} "
                        f"({op}) into its {ref.op(heads.pop())}")
        self.bind[dev.nodes[i].output[0]] = Binding(b.cell, b.layout, b.via, unfused=True)
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
            theirs = const_params(ref, [j])
            for end, cone in fusion_regions(dev, seeds, fam, 0):
                if i not in cone:
                    continue
                score = params_agree(const_params(dev, cone), theirs)[0] * self.reader_fit(end, j)
                if best is None or score > best[0] + 1e-9:
                    best, tied = (score, j, end, cone), False
                elif abs(score - best[0]) <= 1e-9 and (best[1], best[2]) != (j, end):
                    tied = True
        if best is None or tied:
            return False
        score, j, end, cone = best
        out = dev.nodes[end].output[0]
        self.bind[out] = Binding(Cell(end, [Alt(ref.out(j), (j,), j, score, "fused")]), unfused=True)
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
