"""Steps 2, 3 and 7 of graph alignment (layerdiff.analyzer.align.graph): bind
the graph inputs, match a device node to the reference nodes that read what
its inputs are bound to (the same op, a chain it fuses, a subgraph it
stands for), score the candidates, let readers narrow their inputs'
alternatives, and re-anchor by weights where the walk was lost."""
from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from layerdiff.analyzer.align.graph.bindings import Alt, Binding, Cell, Match
from layerdiff.analyzer.align.graph.fusions import FAMILIES, const_params, fusion_regions, params_agree
from layerdiff.analyzer.align.graph.index import shape_fit, shapes_agree
from layerdiff.analyzer.align.graph.ops import (
    ALIASES,
    CHAIN_HEADS,
    COMMUTATIVE,
    ELEMENTWISE,
    IGNORED_ATTRS,
    NCHWC_DOMAIN,
    VARIADIC,
    norm_name,
)
from layerdiff.analyzer.align.graph.weights import RELATION_SCORE, WeightPairing, weights_relation

if TYPE_CHECKING:
    import onnx
else:
    from layerdiff.common.lazy import onnx


class NodeMatcher(WeightPairing):
    """Matches device nodes to reference nodes and keeps what each device
    tensor is bound to."""

    def __init__(self, ref: onnx.ModelProto, dev: onnx.ModelProto) -> None:
        super().__init__(ref, dev)
        self.bind: dict[str, Binding] = {}
        self.notes: dict[str, str] = {}       # device tensor -> why it stays unmatched
        self.inside: set[int] = set()         # device nodes inside a reference fused node (done)
        self._weight_index: dict[frozenset, dict[tuple, list[int]]] = {}

    # -- 2. graph inputs
    def bind_inputs(self) -> None:
        ref_in, dev_in = list(self.ref.inputs), list(self.dev.inputs)
        pairs: dict[str, str] = {}
        for key in (lambda s: s, norm_name):
            by_key = {key(r): r for r in ref_in if r not in pairs.values()}
            for d in dev_in:
                if d not in pairs and key(d) in by_key:
                    pairs[d] = by_key[key(d)]
        rest_r = [r for r in ref_in if r not in pairs.values()]
        rest_d = [d for d in dev_in if d not in pairs]
        for d, r in zip(rest_d, rest_r):
            if shapes_agree(self.dev.shape(d), self.ref.shape(r)) is not False:
                pairs[d] = r
        for d, r in pairs.items():
            self.bind[d] = Binding(Cell(-1, [Alt(r, (), None, 1.0, "input")]))

    # -- 7. re-anchoring where the walk was lost
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
                 if weights_relation(w, ref.value(ref.nodes[j].input[1])) in ("equal", "scaled")]
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
                self.bind[t] = Binding(Cell(producer, [Alt(ref_in[k], (), None, 0.8, "graph")],
                                              f"the weights of its reader {dev.label(i)!r}"))
        self.narrow(i, list(combo), [Match(j, ends, score, combo)])
        self.record(i, [Match(j, ends, score, combo, weights=weights)])
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

    # -- 3. a device node whose inputs are bound
    def match(self, i: int) -> bool:
        flows = self.dev.flows[i]
        tensors = list(dict.fromkeys(t for _, t in flows))
        options = [[a.ref for a in self.bind[t].cell.alts] for t in tensors]
        matches: list[Match] = []
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
    def chain_matches(self, i: int, combo: dict[str, str]) -> list[Match]:
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
                    m = Match(j, ends, score, combo, weights=weights)
                    m.extras = self.extra_outputs(i, j)
                    out.append(m)
        return out

    def readers_through(self, t: str) -> Iterator[int]:
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
        known = [x for x in theirs if x is not None]
        if len(known) != len(theirs) or len(theirs) != len(params):
            return 1.0
        return 1.0 if np.allclose(params, known, rtol=1e-4, atol=1e-6) else 0.8

    def affine(self, j: int, slot: int) -> bool:
        op = self.ref.op(j)
        if op == "BatchNormalization":
            return slot == 0 and len(self.ref.outputs_of(j)) == 1
        return op in ("Add", "Mul") or (op in ("Sub", "Div") and slot == 0)

    def extra_outputs(self, i: int, j: int) -> dict[int, str]:
        d, r = self.dev.nodes[i].output, self.ref.nodes[j].output
        return {k: r[k] for k in range(1, min(len(d), len(r))) if d[k] and r[k]}

    # ---- subgraph fusions (LayerNorm, Gelu, Attention...)
    def region_matches(self, i: int, combo: dict[str, str]) -> list[Match]:
        extras = sum(1 for t in self.dev.nodes[i].output[1:] if t)
        mine = const_params(self.dev, [i])
        out = []
        for j, cover in fusion_regions(self.ref, set(combo.values()), FAMILIES[self.dev.op(i)], extras):
            score, weights = params_agree(mine, const_params(self.ref, cover))
            out.append(Match(None, [(self.ref.out(j), cover)], score, combo, weights=weights))
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
        return score, min(relations, key=RELATION_SCORE.__getitem__, default="unknown")

    def best(self, i: int, matches: list[Match]) -> list[Match]:
        """Drop ends whose shape contradicts the device's, then keep the
        best-scoring matches; a name agreement only breaks a tie."""
        out_shape = self.dev.shape(self.dev.nodes[i].output[0]) if not self.out_layout(i) else None
        kept = []
        for m in matches:
            fits = [(shape_fit(out_shape, self.ref.shape(t)), (t, c)) for t, c in m.ends]
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

    def names_agree(self, i: int, m: Match) -> bool:
        n = self.dev.nodes[i]
        dev_names = {norm_name(n.name), norm_name(n.output[0])} - {""}
        ref_names = {norm_name(t) for t, _ in m.ends}
        if m.head is not None:
            ref_names.add(norm_name(self.ref.nodes[m.head].name))
        return bool(dev_names & (ref_names - {""}))

    # ---- consumers decide
    def narrow(self, i: int, tensors: list[str], matches: list[Match]) -> None:
        for t in tensors:
            used = {m.combo[t] for m in matches}
            cell = self.bind[t].cell
            self.keep(cell, lambda a, used=used: a.ref in used, f"its reader {self.dev.label(i)!r}")

    def keep(self, cell: Cell, pred, why: str) -> None:
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

    def record(self, i: int, matches: list[Match]) -> None:
        outs = self.dev.nodes[i].output
        alts: dict[str, Alt] = {}
        for m in matches:
            for t, cover in m.ends:
                method = "fused" if len([j for j in cover if not self.ref.see_through(j)]) > 1 \
                    else "graph"
                if t in alts and alts[t].score >= m.score:   # the same end by another route
                    alts[t].assumed = {k: v for k, v in alts[t].assumed.items() if m.combo.get(k) == v}
                else:
                    alts[t] = Alt(t, cover, m.head, m.score, method, m.weights, dict(m.combo))
        layout = self.out_layout(i)
        if layout == "flat" and all(shapes_agree(self.dev.shape(outs[0]), self.ref.shape(t)) for t in alts):
            layout = ""
        self.bind[outs[0]] = Binding(Cell(i, list(alts.values())), layout)
        for k, t in enumerate(outs[1:], start=1):
            if not t:
                continue
            refs = list(dict.fromkeys(m.extras[k] for m in matches if k in m.extras))
            if not refs:
                refs = self.escaped(matches) if self.dev.op(i) in FAMILIES else []
            if refs:
                self.bind[t] = Binding(Cell(i, [Alt(r, (), None, min(m.score for m in matches), "graph")
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

    def escaped(self, matches: list[Match]) -> list[str]:
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
