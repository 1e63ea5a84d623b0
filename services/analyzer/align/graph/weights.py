"""Weights as evidence in graph alignment: how a device weight relates to a
reference weight (equal up to rounding, scaled per channel as after BN
folding, blocked, different), and the weights of paired nodes side by side
(``GraphAlignment.weights``, read by layerdiff.analyzer.diagnose.weights)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from layerdiff.analyzer.align.graph.alignment import GraphAlignment
from layerdiff.analyzer.align.graph.index import IndexedGraph
from layerdiff.analyzer.align.graph.ops import CHAIN_HEADS, COMMUTATIVE, FLOAT_TYPES, IGNORED_ATTRS, NCHWC_DOMAIN

if TYPE_CHECKING:
    import onnx
else:
    from layerdiff.common.lazy import onnx


def weights_relation(dev: np.ndarray | None, ref: np.ndarray | None) -> str:
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
    scale = max(float(np.max(ref)), -float(np.min(ref))) or 1.0
    tol = 1e-2 * scale + 1e-7
    # most pairs the search tries are different weights of the same shape:
    # their first elements already say so, before a pass over the rest
    head = min(dev.size, 4096)
    if float(np.max(np.abs(dev.reshape(-1)[:head] - ref.reshape(-1)[:head]))) <= tol \
            and float(np.max(np.abs(dev - ref))) <= tol:
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
    # the first channel alone rules most pairs out (every live channel must pass)
    n0d, n0r = float(np.linalg.norm(d[0])), float(np.linalg.norm(r[0]))
    if n0d > 0 and n0r > 0 and not abs(float(d[0] @ r[0])) / (n0d * n0r) > min_cos:
        return False
    nd, nr = np.linalg.norm(d, axis=1), np.linalg.norm(r, axis=1)
    live = (nd > 0) & (nr > 0)
    if not live.any() or not (nd[~live] == nr[~live]).all():
        return False
    cos = np.abs(np.sum(d[live] * r[live], axis=1)) / (nd[live] * nr[live])
    return float(cos.min()) > min_cos


def blocked_relation(dev: np.ndarray | None, ref: np.ndarray | None) -> str:
    """For weights stored in a blocked layout (NCHWc): 'equal' where the
    nonzero values are the same multiset, else 'unknown'."""
    if dev is None or ref is None:
        return "unknown"
    d, r = np.sort(dev[dev != 0].ravel()), np.sort(ref[ref != 0].ravel())
    if d.shape == r.shape and (d.size == 0 or float(np.max(np.abs(d - r))) <= 1e-2 * float(np.max(np.abs(r)))):
        return "equal"
    return "unknown"


RELATION_SCORE = {"equal": 1.0, "scaled": 0.9, "unknown": 0.8, "different": 0.6}


class WeightPairing:
    """The two graphs, indexed, and the weights of their paired nodes; the
    base of the aligner, and all that ``weights_by_name`` needs."""

    def __init__(self, ref: onnx.ModelProto, dev: onnx.ModelProto) -> None:
        self.ref, self.dev = IndexedGraph(ref, merge_duplicates=True), IndexedGraph(dev)
        self._weights_done: set[tuple[int, int]] = set()

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
            row = {"folding": folding, "reference_node": ref.label(j), "reference_weight": tr,
                   "device_node": dev.label(i), "device_weight": td, "slot": kr,
                   "blocked": dev.nodes[i].domain == NCHWC_DOMAIN and kd == 1}
            if stored and dev.same_bytes(td, ref, tr):
                # most weights of a build: settled here, and neither is held as an array till the report
                row["same_elements"] = int(np.prod(ref.inits[tr].dims, dtype=np.int64))
            else:
                row["reference"] = ref.stored(tr) if stored else ref.value(tr)
                row["device"] = dev.stored(td) if stored else dev.value(td)
            out.weights.append(row)
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
                if dev.same_bytes(dn.input[kd], ref, rn.input[kr]):
                    out.append("equal")
                    continue
                relation = blocked_relation if dn.domain == NCHWC_DOMAIN and kd == 1 else weights_relation
                out.append(relation(dev.value(dn.input[kd]), ref.value(rn.input[kr])))
        return out
