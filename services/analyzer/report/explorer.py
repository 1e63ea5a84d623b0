"""Per-node errors as node data for Model Explorer (the graph viewer), so the
errors can be laid over the model's graph.

Two files are written, each in the viewer's single-graph node-data format::

    {"results": {"<node id>": {"value": <number>}, ...},
     "thresholds": [{"value": <upper bound>, "bgColor": "<css colour>"}, ...]}

- ``model_explorer_rel_err.json``: each node's mean relative error (the
  seed's per-node ranking figure), coloured green (< 1e-3) through yellow
  and orange to red (> 1);
- ``model_explorer_cosine.json``: each node's cosine similarity, red
  (<= 0.9) through orange and yellow to green (> 0.9999).

A node's id is its ONNX node name, which is the id the viewer's ONNX adapter
gives it (unnamed nodes are named ``{op_type}_{index}`` by layerdiff and may
go by another id in the viewer).  A node with several outputs gets the worst
figure over them (largest relative error, smallest cosine); node inputs
(``dump_mode`` input) are not exported, as they belong to the producing
node.  An infinite relative error is written as the largest float (the
viewer reads numbers only); a node whose figure is undefined (an empty
tensor: NaN) gets ``value`` -1 and a grey ``bgColor`` of its own, so it is
present but not mistaken for a good or a bad node.

Load: open the model in Model Explorer, then in the side panel choose
"Upload node data" (custom node data) and pick one of the files; node
backgrounds take the threshold colours, and a node's value shows in its
info panel.  Each file holds numbers only and can be loaded on its own.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

from layerdiff.analyzer.report.jsontext import json_text, summary_number

REL_ERR_FILE = "model_explorer_rel_err.json"
COSINE_FILE = "model_explorer_cosine.json"
UNDEFINED_VALUE = -1
UNDEFINED_COLOUR = "#bdbdbd"
_BIG = sys.float_info.max

# Upper bounds (value <= bound takes the colour), as the viewer reads them.
REL_ERR_THRESHOLDS = [
    {"value": 1e-3, "bgColor": "#a5d6a7"},
    {"value": 1e-2, "bgColor": "#e6ee9c"},
    {"value": 1e-1, "bgColor": "#fff59d"},
    {"value": 1.0, "bgColor": "#ffcc80"},
    {"value": _BIG, "bgColor": "#ef9a9a"},
]
COSINE_THRESHOLDS = [
    {"value": 0.9, "bgColor": "#ef9a9a"},
    {"value": 0.99, "bgColor": "#ffcc80"},
    {"value": 0.999, "bgColor": "#fff59d"},
    {"value": 0.9999, "bgColor": "#e6ee9c"},
    {"value": 2.0, "bgColor": "#a5d6a7"},  # cosine can round a hair above 1
]


def _worst(summary: dict, key: str, worse) -> dict[str, float]:
    out: dict[str, float] = {}
    for n in summary.get("nodes") or []:
        if not isinstance(n, dict) or n.get("role") == "input" or not isinstance(n.get("node"), str):
            continue
        v = summary_number(n.get(key))
        name = n["node"]
        if name not in out or math.isnan(out[name]) or (not math.isnan(v) and worse(v, out[name])):
            out[name] = v
    return out


def _results(values: dict[str, float]) -> dict[str, dict]:
    res: dict[str, dict] = {}
    for name, v in values.items():
        if math.isnan(v):
            res[name] = {"value": UNDEFINED_VALUE, "bgColor": UNDEFINED_COLOUR}
        else:
            res[name] = {"value": max(-_BIG, min(_BIG, v))}
    return res


def node_data(summary: dict) -> tuple[dict, dict]:
    """The two node-data documents (relative error, cosine)."""
    rel = _worst(summary, "mean_rel_err", lambda a, b: a > b)
    cos = _worst(summary, "cosine", lambda a, b: a < b)
    return ({"results": _results(rel), "thresholds": REL_ERR_THRESHOLDS},
            {"results": _results(cos), "thresholds": COSINE_THRESHOLDS})


def write_node_data(out_dir: Path, summary: dict) -> Path:
    """Write ``model_explorer_rel_err.json`` and ``model_explorer_cosine.json``
    into ``out_dir``; returns the path of the first (the second lies beside it)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rel, cos = node_data(summary)
    path = out_dir / REL_ERR_FILE
    path.write_text(json_text(rel, allow_nan=False), encoding="utf-8")
    (out_dir / COSINE_FILE).write_text(json_text(cos, allow_nan=False), encoding="utf-8")
    return path
