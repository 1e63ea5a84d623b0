"""The graph walk of graph alignment (layerdiff.analyzer.align.graph) put
together: the device nodes visited in order (step 3), what no reader
settled resolved at the end (step 4), and the outcome written as a
GraphAlignment."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from layerdiff.analyzer.align.graph.alignment import GraphAlignment
from layerdiff.analyzer.align.graph.bindings import Alt, Binding, Cell
from layerdiff.analyzer.align.graph.index import shape_fit, shapes_agree
from layerdiff.analyzer.align.graph.ops import CHAIN_HEADS, RESHAPES, layout_perm, norm_name
from layerdiff.analyzer.align.graph.rewrites import RewriteFollower
from layerdiff.analyzer.align.graph.weights import RELATION_SCORE, weights_relation
from layerdiff.analyzer.align.names import Pairing

if TYPE_CHECKING:
    import onnx
else:
    from layerdiff.common.lazy import onnx


class GraphAligner(RewriteFollower):
    """Aligns a device graph with the reference graph: ``run``, then ``result``."""

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
                    self.keep(cell, lambda a, claimed=claimed: a.ref not in claimed, "the other device tensors' pairs")
                    changed = changed or len(cell.alts) < before
                    if len(cell.alts) > 1:
                        self.settle_one(cell)
        for cell in cells.values():
            if len(cell.alts) > 1:
                open_reason[id(cell)] = (f"{len(cell.alts)} reference tensors fit device node "
                                         f"{self.dev.label(cell.node)!r} equally (op, inputs, shapes, weights) "
                                         "and no reader tells them apart")
        return open_reason

    def settle_one(self, cell: Cell) -> None:
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
        lows: dict[int, int] = {onnx.TensorProto.UINT8: 0, onnx.TensorProto.INT8: -128, onnx.TensorProto.UINT16: 0,
                                onnx.TensorProto.INT16: -32768}
        low = lows.get(kind) if kind is not None else None
        if zp is None or low is None:
            return None
        return bool(np.all(zp == low))

    def folding_fits(self, i: int, alt: Alt) -> bool:
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
        return (weights_relation(dw, w * scale.reshape(shape)) == "equal"
                and weights_relation(db.reshape(-1), b.reshape(-1) * scale + shift) == "equal")

    def affine_step(self, j: int, prev: str, c: int) -> tuple[np.ndarray, np.ndarray] | None:
        ref = self.ref
        n, op = ref.nodes[j], ref.op(j)
        if ref.transparent(j):
            return np.ones(c), np.zeros(c)
        if op not in ("BatchNormalization", "Add", "Sub", "Mul", "Div"):
            return None
        consts = [ref.value(t) for t in n.input if t and ref.c(t) != prev]
        known = [v for v in consts if v is not None]
        if not consts or len(known) != len(consts):
            return None
        try:
            if op == "BatchNormalization":
                g, beta, mean, var = (np.broadcast_to(v.reshape(-1), (c,)) for v in known[:4])
                s = g / np.sqrt(var + ref.attrs(j).get("epsilon", 1e-5))
                return s, beta - mean * s
            v = np.broadcast_to(known[0].reshape(-1), (c,)) if known[0].size in (1, c) else None
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
        for n in ref.nodes:
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

    def emit(self, out: GraphAlignment, t: str, b: Binding) -> None:
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
        if layout == "flat" and shapes_agree(dev.shape(t), ref.shape(alt.ref)):
            layout = ""
        elif layout == "" and shape_fit(dev.shape(t), ref.shape(alt.ref)) == 0.9:
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
            self.weight_rows(out, b.cell.node, alt.head, len(alt.cover) > 1, stored=True)
        q = layout_perm(layout) if b.moved else ()
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
        named = [m for m in members if norm_name(m) == norm_name(t)]
        if named:
            return named[0]
        taken = {p.ref_tensor for p in out.pairs.values()}
        return next((m for m in members if m not in taken), rep)

    def reshaped_alias(self, t: str, alt: Alt) -> Alt:
        """Where the device tensor has another shape than the reference
        tensor and a Reshape-like reader of that tensor gives exactly the
        device's shape, that reader's output is the better partner."""
        dev_shape, ref = self.dev.shape(t), self.ref
        if dev_shape is None or None in dev_shape or shapes_agree(dev_shape, ref.shape(alt.ref)) is not False:
            return alt
        for j, _ in ref.data_consumers.get(alt.ref, []):
            out = ref.out(j)
            if ref.op(j) in RESHAPES and shapes_agree(dev_shape, ref.shape(out)):
                return Alt(out, alt.cover + (j,), alt.head, alt.score, alt.method, alt.weights, alt.assumed)
        return alt

    def describe(self, b: Binding, alt: Alt, folded: bool, layout: str) -> str:
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
