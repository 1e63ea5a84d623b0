"""``layerdiff diff OLD NEW``: two reports of the same model compared node by
node from their nodes.parquet (yesterday's build against today's, one
runtime version against the next), as a regression gate: the nodes whose
verdict got worse, whose error grew past a factor, or that are no longer
compared, and those that got better. Exit status 1 where anything got
worse."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from layerdiff.client.results import read_report

# how bad a verdict is (no finding: the node needed no closer look)
_SEVERITY = {None: 0, "accumulated precision error": 1, "no verdict": 2, "computation error": 3}
ERROR_FACTOR = 2.0


@dataclass
class Change:
    tensor: str
    node: str
    what: str          # verdict, relative error, coverage
    old: str
    new: str
    worse: bool
    weight: int = 0    # how bad the new verdict is (the worst first)
    order: int = 0     # the row in the new report (execution order)

    def as_dict(self) -> dict:
        return {"tensor": self.tensor, "node": self.node, "what": self.what, "old": self.old, "new": self.new,
                "worse": self.worse}


@dataclass
class ReportDiff:
    old: str
    new: str
    common: int
    changes: list[Change] = field(default_factory=list)

    @property
    def worse(self) -> list[Change]:
        return [c for c in self.changes if c.worse]

    @property
    def better(self) -> list[Change]:
        return [c for c in self.changes if not c.worse]

    def as_dict(self) -> dict:
        return {"old": self.old, "new": self.new, "tensors_in_both": self.common, "worse": len(self.worse),
                "better": len(self.better), "changes": [c.as_dict() for c in self.changes]}


def _verdict(row: dict) -> str | None:
    v = row.get("verdict")
    if v == "computation error" and row.get("impact_harmful") is False:
        return "accumulated precision error"     # a computation error the outputs absorb weighs as rounding
    return v


def _error(row: dict) -> float:
    """Its relative RMS error (the error model's, else ||d - r|| / ||r||)."""
    v = row.get("rel_err")
    if v is None:
        v = row.get("rel_euclidean")
    return math.nan if v is None else float(v)


def _fmt(v: float) -> str:
    return f"{v:.3g}" if not math.isnan(v) else "undefined"


def diff_reports(old: str | Path, new: str | Path, *, error_factor: float = ERROR_FACTOR) -> ReportDiff:
    """The changes from report ``old`` to report ``new`` (directories or
    their nodes.parquet), tensor by tensor (a node's inputs by input index).
    An error counts as grown when it is more than ``error_factor`` times the
    old one and past what the node may add (its allowed_rel_err, where the
    error model gave one)."""
    key = ("tensor", "role", "input_index")
    before = {tuple(r[k] for k in key): r for r in read_report(old).to_pylist()}
    after = {tuple(r[k] for k in key): r for r in read_report(new).to_pylist()}
    common = [k for k in after if k in before]
    out = ReportDiff(str(old), str(new), len(common))
    for k in common:
        a, b = before[k], after[k]
        label = k[0] if k[1] != "input" else f"{b['node']} (input {k[2]})"
        va, vb = _verdict(a), _verdict(b)
        if va != vb:
            sa, sb = _SEVERITY.get(va, 2), _SEVERITY.get(vb, 2)
            words = lambda v, row: (v or "no finding") + (f" ({row['cause']})" if v and row.get("cause") else "")  # noqa: E731
            out.changes.append(Change(label, b["node"], "verdict", words(va, a), words(vb, b), sb > sa, sb,
                                      b["index"]))
        ea, eb = _error(a), _error(b)
        allowed = b.get("allowed_rel_err")
        floor = float(allowed) if allowed is not None else 0.0
        if math.isnan(eb) != math.isnan(ea) or math.isinf(eb) != math.isinf(ea):
            grew = math.isinf(eb) or (math.isnan(eb) and not math.isnan(ea))
            out.changes.append(Change(label, b["node"], "relative error", _fmt(ea), _fmt(eb), grew, 0, b["index"]))
        elif not math.isnan(eb) and eb > floor and eb > error_factor * ea:
            out.changes.append(Change(label, b["node"], "relative error", _fmt(ea), _fmt(eb), True, 0, b["index"]))
        elif not math.isnan(ea) and ea > floor and ea > error_factor * eb:
            out.changes.append(Change(label, b["node"], "relative error", _fmt(ea), _fmt(eb), False, 0, b["index"]))
    for k in before:
        if k not in after:
            out.changes.append(Change(k[0], before[k]["node"], "coverage", "compared", "not compared", True, 0,
                                      before[k]["index"]))
    for k in after:
        if k not in before:
            out.changes.append(Change(k[0], after[k]["node"], "coverage", "not compared", "compared", False, 0,
                                      after[k]["index"]))
    # what got worse first, the worst verdict first, then in execution order
    out.changes.sort(key=lambda c: (not c.worse, c.what != "verdict", -c.weight, c.order, c.tensor))
    return out


def format_diff(d: ReportDiff, limit: int = 40) -> str:
    """The terminal's view: a line a tensor, what got worse first."""
    by_tensor: dict[tuple[bool, str], list[Change]] = {}
    for c in d.changes:
        by_tensor.setdefault((c.worse, c.tensor), []).append(c)
    worse = sum(1 for w, _ in by_tensor if w)
    lines = [f"{d.common} tensors in both reports: {worse} worse, {len(by_tensor) - worse} better "
             f"(old {d.old}, new {d.new})"]
    for (is_worse, tensor), changes in list(by_tensor.items())[:limit]:
        what = "; ".join(f"{c.what} {c.old} -> {c.new}" for c in changes)
        lines.append(f"  {'WORSE ' if is_worse else 'better'} {tensor}: {what}")
    if len(by_tensor) > limit:
        lines.append(f"  ... {len(by_tensor) - limit} more (--json FILE lists them all)")
    return "\n".join(lines)
