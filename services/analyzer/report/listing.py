"""The terminal listing of a job, one line per compared tensor in execution
order, in the layout of the vendor's per-layer debug script::

    3.conv1                                 OP_TYPE:Conv        MSE:0.000046    COS:0.999898    RMSE:0.014310
    4.relu1                                 OP_TYPE:Relu        MSE:0.000057    COS:0.999931    RMSE:0.011018  FAIL computation error (weight)  <- first failing node

The op-type column widens to the longest op type, and the MSE and COS
columns to their longest number, so the metric columns always line up.
Numbers print with 6 decimals between 1e-5 and 1e6 in magnitude (and 0),
in scientific notation with 6 significant digits outside that range (an MSE
of 1e70 as ``1e+70``, not 77 digits; 3.2e-9 as ``3.2e-09``, not
``0.000000``), and NaN as ``nan``.  ``index`` is the node's execution
order; a node input reads ``{order}.{node}.input{N}``, and a node with several outputs names the
output tensor as ``{order}.{node}:{tensor}``.  Failing tensors carry
``FAIL`` with the diagnosis' verdict and cause where the summary has them.
Names are printed with control characters escaped, so a hostile node name
cannot move the cursor or recolour the terminal.
"""  # noqa: E501 - the example lines above are as wide as the listing itself
from __future__ import annotations

import math
from collections import Counter

NAME_WIDTH_MIN = 40
NAME_WIDTH_MAX = 72
OP_WIDTH = 12
NUM_WIDTH = 11
# Magnitudes printed with 6 decimals; outside, 6 significant digits.
FIXED_MIN = 1e-5
FIXED_MAX = 1e6


def _num(v: object) -> str:
    """A summary number (float, null for NaN, "inf"/"-inf") in the listing's format."""
    if v is None:
        return "nan"
    if isinstance(v, str):
        return v
    try:
        f = float(v)  # type: ignore[arg-type]  # any JSON value; what float() refuses is caught
    except (TypeError, ValueError):
        return "nan"
    if math.isnan(f):
        return "nan"
    if math.isinf(f):
        return "inf" if f > 0 else "-inf"
    if f == 0.0 or FIXED_MIN <= abs(f) < FIXED_MAX:
        return f"{f:.6f}"
    return f"{f:.6g}"


def printable(text: object) -> str:
    """Text with every non-printable character written as an escape."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def node_label(n: dict, several_outputs: bool = False) -> str:
    """``{order}.{name}`` of a summary node dict."""
    name = str(n.get("node") or n.get("tensor") or "?")
    if n.get("role") == "input":
        name = f"{name}.input{n.get('input_index', 0)}"
    elif several_outputs and n.get("tensor") and n.get("tensor") != name:
        name = f"{name}:{n['tensor']}"
    return f"{n.get('order', '?')}.{name}"


def format_listing(summary: dict) -> str:
    """The listing of ``summary["nodes"]`` (one line each, no trailing newline)."""
    nodes = [n for n in summary.get("nodes") or [] if isinstance(n, dict)]
    outputs = Counter(n.get("node") for n in nodes if n.get("role") != "input")
    first = summary.get("first_failing_node") or {}
    first_key = (first.get("node"), first.get("tensor"), first.get("role", "output")) if first else None
    labels = [printable(node_label(n, outputs[n.get("node")] > 1)) for n in nodes]
    width = min(NAME_WIDTH_MAX, max([NAME_WIDTH_MIN - 2] + [len(s) for s in labels]) + 2)
    ops = [printable(n.get("op_type") or "?") for n in nodes]
    op_width = max([OP_WIDTH] + [len(o) for o in ops])  # the metric columns stay aligned
    mses = [_num(n.get("mse")) for n in nodes]
    coss = [_num(n.get("cosine")) for n in nodes]
    mse_width = max([NUM_WIDTH] + [len(v) for v in mses])
    cos_width = max([NUM_WIDTH] + [len(v) for v in coss])
    lines = []
    for n, label, op, mse, cos in zip(nodes, labels, ops, mses, coss):
        if len(label) > width - 1:
            label = label[:width - 4] + "..."
        line = (f"{label:<{width}}OP_TYPE:{op:<{op_width}} MSE:{mse:<{mse_width}} "
                f"COS:{cos:<{cos_width}} RMSE:{_num(n.get('rmse'))}")
        if n.get("passed") is False:
            line += "  FAIL"
            if n.get("constant"):
                line += " (constant)"
            if n.get("verdict"):
                line += f" {printable(n['verdict'])}"
                if n.get("cause"):
                    line += f" ({printable(n['cause'])})"
        if first_key and (n.get("node"), n.get("tensor"), n.get("role", "output")) == first_key:
            line += "  <- first failing node"
        lines.append(line)
    return "\n".join(lines)
