"""Baseline comparison of two performance runs (``layerdiff perf-diff``).

Each side is a report directory (its ``op_perf.csv``), a dump directory
(``op_perf.csv`` or ``perf/*.csv``) or one such CSV file. Nodes are matched
by name; for each node the time per run (``mean_us``, else the mean of
``dur_us``) and every counter of the seed's ``op_perf.csv`` are compared,
averaged over the node's rows. A metric has changed when it moved by more
than ``threshold`` of its base value (and, for time, by more than
``min_us``). Other columns are not compared.

What the seed tells to look for (5.7.2.2) is flagged on the nodes where it
grew: more ``mte_pld_byte`` (data moved again: adjust the schedule or the
tiling) and more ``l1_conflict_cycle`` / ``im_conflict_cycle`` (L1 / IMB bank
conflicts: make the tiling's L1 / IMB split smaller). For a new network, the
nodes with the most ``mcu_cycle`` (or time) come with a data-bound or
compute-bound hint from their counters.

Unreadable cells are left out with a reason (``skipped``), never fatal.
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from layerdiff.analyzer.report.perf.table import bound_hint
from layerdiff.common.errors import LayerdiffError
from layerdiff.common.perfschema import COUNTER_COLUMNS

TIME = "time_us"
FLAGS = {
    "mte_pld_byte": "repeated moves: pld moved more bytes; adjust the schedule or the tiling",
    "l1_conflict_cycle": "L1 bank conflicts got worse; make the tiling's L1 split smaller",
    "im_conflict_cycle": "IMB bank conflicts got worse; make the tiling's IMB split smaller",
}


@dataclass
class NodeStats:
    name: str
    op_type: str = ""
    order: int = 1 << 30
    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, metric: str, value: float) -> None:
        self.sums[metric] = self.sums.get(metric, 0.0) + value
        self.counts[metric] = self.counts.get(metric, 0) + 1

    def get(self, metric: str) -> float | None:
        n = self.counts.get(metric)
        return self.sums[metric] / n if n else None


@dataclass
class Side:
    path: str
    files: list[str]
    nodes: dict[str, NodeStats]
    skipped: list[tuple[str, str]]


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise LayerdiffError("is neither a report directory nor an op_perf.csv", file=str(path))
    if (path / "op_perf.csv").is_file():
        return [path / "op_perf.csv"]
    per_node = sorted(p for p in (path / "perf").glob("*.csv")) if (path / "perf").is_dir() else []
    if per_node:
        return per_node
    raise LayerdiffError("holds no op_perf.csv and no perf/*.csv", file=str(path))


def _float(text: str) -> float | None:
    t = (text or "").strip()
    if t.lower() in ("", "na", "n/a", "none", "null", "-"):
        return None
    v = float(int(t, 16)) if t.lower().startswith("0x") else float(t)
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{t!r} is not a non-negative finite number")
    return v


def load_side(path: str | Path) -> Side:
    root = Path(path)
    nodes: dict[str, NodeStats] = {}
    skipped: list[tuple[str, str]] = []
    files = _files(root)
    for f in files:
        shown = str(f)
        try:
            handle = open(f, newline="", encoding="utf-8-sig")
        except OSError as e:
            raise LayerdiffError(f"cannot be read: {e.strerror}", file=shown) from e
        with handle:
            reader = csv.reader(handle)
            try:
                header = [h.strip() for h in (next(reader, None) or [])]
                if not header:
                    skipped.append((shown, "empty file"))
                    continue
                per_node_file = "name" not in header
                if per_node_file and f.parent.name != "perf":
                    skipped.append((shown, "no 'name' column"))
                    continue
                time_col = "mean_us" if "mean_us" in header else ("dur_us" if "dur_us" in header else None)
                metrics = [c for c in header if c in COUNTER_COLUMNS]
                for cells in reader:
                    where = f"{shown}:{reader.line_num}"
                    if not cells or all(not c.strip() for c in cells):
                        continue
                    if len(cells) != len(header):
                        skipped.append((where, f"row has {len(cells)} cells, the header {len(header)}"))
                        continue
                    row = dict(zip(header, cells))
                    name = f.stem if per_node_file else row["name"].strip()
                    if not name:
                        skipped.append((where, "row has no node name"))
                        continue
                    node = nodes.setdefault(name, NodeStats(name))
                    node.op_type = node.op_type or row.get("op_type", "").strip()
                    try:
                        node.order = min(node.order, int(row.get("order") or 1 << 30))
                    except ValueError:
                        pass
                    for col in metrics + ([time_col] if time_col else []):
                        try:
                            v = _float(row[col])
                        except ValueError as e:
                            skipped.append((f"{where} ({name})", f"column {col!r}: {e}"))
                            continue
                        if v is not None:
                            node.add(TIME if col == time_col else col, v)
            except (csv.Error, UnicodeDecodeError) as e:
                skipped.append((shown, f"unreadable at line {reader.line_num}: {e}; the rest is left out"))
    return Side(str(root), [str(f) for f in files], nodes, skipped)


def _change(base: float, new: float, threshold: float, floor: float) -> float | None:
    """Relative change when it is beyond the threshold, else None."""
    delta = new - base
    if abs(delta) <= floor:
        return None
    if base == 0:
        return math.inf if delta > 0 else None
    rel = delta / base
    return rel if abs(rel) > threshold else None


def perf_diff(base_path, new_path, *, threshold: float = 0.10, min_us: float = 1.0, top: int = 5) -> dict:
    if not (threshold >= 0 and math.isfinite(threshold)):
        raise LayerdiffError("must be a non-negative fraction (0.1 = 10%)", field="threshold")
    base, new = load_side(base_path), load_side(new_path)
    changed: list[dict[str, Any]] = []
    for name, b in base.nodes.items():
        n = new.nodes.get(name)
        if n is None:
            continue
        changes = []
        for metric in [TIME] + list(COUNTER_COLUMNS):
            bv, nv = b.get(metric), n.get(metric)
            if bv is None or nv is None:
                continue
            rel = _change(bv, nv, threshold, min_us if metric == TIME else 0.0)
            if rel is not None:
                changes.append({"metric": metric, "base": bv, "new": nv,
                                "change_pct": None if math.isinf(rel) else round(100.0 * rel, 3),
                                "direction": "up" if nv > bv else "down"})
        if changes:
            flags = [FLAGS[c["metric"]] for c in changes if c["metric"] in FLAGS and c["direction"] == "up"]
            ups = {c["metric"] for c in changes if c["direction"] == "up"}
            verdict = "slower" if TIME in ups or "mcu_cycle" in ups else (
                "faster" if any(c["metric"] in (TIME, "mcu_cycle") for c in changes) else "counters changed")
            changed.append({"node": name, "op_type": n.op_type or b.op_type, "order": n.order, "verdict": verdict,
                            "changes": changes, "flags": flags})
    changed.sort(key=lambda c: (c["order"], c["node"]))
    by = "mcu_cycle" if any(s.get("mcu_cycle") is not None for s in new.nodes.values()) else TIME
    valued = [(s, v) for s in new.nodes.values() if (v := s.get(by)) is not None]
    ranked = sorted(valued, key=lambda sv: -sv[1])
    total = sum(v for _, v in ranked)
    tops = []
    for s, value in ranked[:max(0, top)]:
        hint = bound_hint(s.get)
        tops.append({"node": s.name, "op_type": s.op_type, "metric": by, "value": value,
                     "share_pct": round(100.0 * value / total, 3) if total > 0 else None,
                     "bound": hint["bound"] if hint else None, "why": hint["why"] if hint else
                     "no unit counters: time only"})
    return {
        "base": base.path, "new": new.path, "threshold": threshold, "min_us": min_us,
        "compared": len(set(base.nodes) & set(new.nodes)),
        "changed": changed,
        "only_in_base": sorted(set(base.nodes) - set(new.nodes)),
        "only_in_new": sorted(set(new.nodes) - set(base.nodes)),
        "top_by": by, "top": tops,
        "skipped": [{"where": w, "why": y} for w, y in base.skipped + new.skipped],
        "regressed": any(ch["direction"] == "up" for c in changed for ch in c["changes"]),
    }


def _v(v) -> str:
    if v is None:
        return "-"
    return str(int(v)) if v == int(v) and abs(v) < 1e15 else f"{v:.3f}"


def format_diff(d: dict) -> str:
    slower = sum(1 for c in d["changed"] if c["verdict"] == "slower")
    faster = sum(1 for c in d["changed"] if c["verdict"] == "faster")
    lines = [f"perf-diff {d['base']} -> {d['new']}: {d['compared']} nodes compared, {len(d['changed'])} changed "
             f"beyond {100 * d['threshold']:g}% ({slower} slower, {faster} faster), {len(d['only_in_base'])} only "
             f"in base, {len(d['only_in_new'])} only in new"]
    if d["changed"]:
        lines.append(f"  {'node':32.32}  {'metric':20.20}  {'base':>14}  {'new':>14}  {'change':>9}")
        for c in d["changed"]:
            for k, ch in enumerate(c["changes"]):
                pct = "new" if ch["change_pct"] is None else f"{ch['change_pct']:+.1f}%"
                lines.append(f"  {(c['node'] if k == 0 else ''):32.32}  {ch['metric']:20.20}  {_v(ch['base']):>14}  "
                             f"{_v(ch['new']):>14}  {pct:>9}")
            for flag in c["flags"]:
                lines.append(f"  {'':32}  ! {flag}")
    for key, label in (("only_in_base", "only in base"), ("only_in_new", "only in new")):
        if d[key]:
            lines.append(f"{label}: " + ", ".join(d[key][:20]) + (" ..." if len(d[key]) > 20 else ""))
    if d["top"]:
        lines.append(f"top nodes by {d['top_by']} in {d['new']}:")
        for i, t in enumerate(d["top"], 1):
            share = f" ({t['share_pct']:.1f}%)" if t["share_pct"] is not None else ""
            bound = f"{t['bound']}: {t['why']}" if t["bound"] else t["why"]
            lines.append(f"  {i}. {t['node']} [{t['op_type']}] {t['metric']} {_v(t['value'])}{share} - {bound}")
    if d["skipped"]:
        lines.append(f"{len(d['skipped'])} cells or rows left out, first: {d['skipped'][0]['where']}: "
                     f"{d['skipped'][0]['why']}")
    return "\n".join(lines)
