"""The outcome of graph alignment (layerdiff.analyzer.align.graph): which
reference tensor each device tensor stands for, and why the others stand
for none."""
from __future__ import annotations

from dataclasses import dataclass, field

from layerdiff.analyzer.align.names import Pairing


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
