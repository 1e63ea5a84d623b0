"""What the graph walk binds to a device tensor: the reference tensors it may
stand for (alternatives, kept open until a reader decides), the cell they
share along device-only helpers, and a candidate match of a device node."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Alt:
    """One reference tensor a device tensor may stand for."""
    ref: str
    cover: tuple[int, ...]        # reference nodes the device node computes, in order
    head: int | None              # the reference node matched to the device op itself
    score: float
    method: str
    weights: str = "unknown"      # how the device node's weights relate to the head's
    assumed: dict[str, str] = field(default_factory=dict)   # device input -> the reference tensor taken for it


@dataclass(eq=False)
class Cell:
    """What a device node's output stands for; shared by the device-only
    helpers (Cast, reorders, Q/DQ) that carry it on."""
    node: int                     # device node index
    alts: list[Alt]
    settled_by: str = ""
    derived: bool = False         # a QuantizeLinear's: may share its input's reference tensor


@dataclass
class Binding:
    cell: Cell
    layout: str = ""              # "", "flat" (reshaped), "nchwc", "quantized" or "perm:a,b,c,d"
    via: str = ""                 # device-only helper ops it passed through
    superseded: str = ""          # non-empty: a partial result the reference folds away (why)
    unfused: bool = False         # the reference computes in one node what the device splits
    # its perm: layout comes from a Transpose the device moved down (commute):
    # proven by the graph, so the values are compared with the axes put back
    moved: bool = False


@dataclass
class Match:
    head: int | None
    ends: list[tuple[str, tuple[int, ...]]]
    score: float
    combo: dict[str, str]         # device flow tensor -> the reference tensor it was taken as
    extras: dict[int, str] = field(default_factory=dict)   # device output slot -> ref tensor
    weights: str = "unknown"
