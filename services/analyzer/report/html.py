"""``report.html``: one self-contained page a person opens to read a job.

What it shows, top to bottom: the verdict (the diagnosis' headline
sentence), the first failing node and the first computation error, the
NaN and overflow diagnosis, the error-along-the-graph chart (1 - cosine,
log scale, by execution order; the first failing node marked by a red
dashed line, computation errors marked harmful or benign), the sortable per-node table, the
verdict of every failing node with its evidence, the analysis plots of the
failing nodes, the quantization advice, the overflowing nodes, the counts
and the job's parameters.

Guarantees:

- nothing is fetched: CSS and the script are inline, the plots are embedded
  as base64 ``data:`` URIs, and the page's Content-Security-Policy forbids
  every other source (the only links are to the CSV files beside it);
- every string taken from the summary is HTML-escaped, and no summary
  string is ever placed inside the script; the script runs only with the
  page's per-report nonce, so even markup that slipped through could not
  run;
- the chart is inline SVG drawn here (no plotting library in the page), its
  points carry their node in a tooltip;
- a plot file named in ``summary["plots"]`` is embedded only if it is a
  plain file name inside the report directory, a PNG, and at most
  ``MAX_PLOT_BYTES``; otherwise the page says why it is missing.  The plots
  of the first ``MAX_PLOT_NODES`` failing nodes are embedded, the others'
  files are named (they lie beside the page).

The table sorts on a click on a column header (again: the other direction);
``report.html#sort=cosine`` (or ``#sort=-cosine``, descending) opens it
sorted, through the same click handler, and ``#failing`` shows only the
failing rows.

The page's static CSS and script are in ``html_assets``. The rest stays in
this one module: every section is a small function over the same summary
dict with the same escaping and number formatting (``esc``, ``fmt``), and
``render`` puts them together in page order.
"""
from __future__ import annotations

import base64
import json
import math
import secrets
from pathlib import Path
from urllib.parse import quote

from layerdiff import __version__
from layerdiff.analyzer.report.html_assets import CSS, SCRIPT
from layerdiff.analyzer.report.jsontext import summary_number as num
from layerdiff.common.tf.format import shown_model

MAX_PLOT_BYTES = 16 << 20
# The plots of the first failing nodes (in execution order) are embedded; a
# page with hundreds of them would weigh tens of megabytes.
MAX_PLOT_NODES = 40
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# (key, header, kind): kind "num" sorts numerically, "text" alphabetically.
COLUMNS = [
    ("order", "#", "num"), ("node", "node", "text"), ("op_type", "op type", "text"),
    ("result", "result", "text"), ("verdict", "verdict", "text"), ("cause", "cause", "text"),
    ("errors", "errors", "num"), ("error_ratio", "errors/total", "num"), ("max_abs_err", "max abs err", "num"),
    ("mean_rel_err", "mean rel err", "num"), ("cosine", "cosine", "num"), ("mse", "MSE", "num"),
    ("rmse", "RMSE", "num"), ("pearson", "pearson", "num"), ("sqnr_db", "SQNR dB", "num"),
    ("nan_inf", "NPU nan/inf", "num"), ("overflow", "overflow", "text"), ("time_us", "time µs", "num"),
    ("note", "note", "text"),
]


def esc(v: object) -> str:
    """``v`` as text safe in an element or an attribute: html.escape's
    replacements (the html package itself loads its table of two thousand
    named entities to import, a hundredth of a two-dump job)."""
    s = "" if v is None else str(v)
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;") \
        .replace("'", "&#x27;")


def fmt(v: object) -> str:
    f = num(v)
    if math.isnan(f):
        return "nan" if v is not None else "—"
    if math.isinf(f):
        return "inf" if f > 0 else "-inf"
    if isinstance(v, int) or f.is_integer() and abs(f) < 1e15 and not isinstance(v, float):
        return str(int(f))
    return f"{f:.6g}"


def _num_cell(v: object) -> tuple[str, str]:
    """(fmt(v), _sort_value(v)), the number read once: the cells of a node table."""
    if type(v) is float and v - v == 0.0:       # finite: most cells
        return f"{v:.6g}", repr(v)
    f = num(v)
    if math.isnan(f):
        return ("nan" if v is not None else "—"), ""
    if math.isinf(f):
        return ("inf", "Infinity") if f > 0 else ("-inf", "-Infinity")
    if isinstance(v, int) or f.is_integer() and abs(f) < 1e15 and not isinstance(v, float):
        return str(int(f)), repr(f)
    return f"{f:.6g}", repr(f)


def _sort_value(v: object) -> str:
    """The data-v attribute of a numeric cell: JS parses it (NaN stays last)."""
    f = num(v)
    if math.isnan(f):
        return ""
    if math.isinf(f):
        return "Infinity" if f > 0 else "-Infinity"
    return repr(f)


def label_of(n: dict) -> str:
    """The tensor label a node dict goes by in ``detail_files`` and ``plots``."""
    if n.get("role") == "input":
        return f"{n.get('node')}.input.{n.get('input_index', 0)}"
    return str(n.get("tensor") or n.get("node"))


def _plain_file(name: object) -> str | None:
    if not isinstance(name, str) or not name or name in (".", "..") or name.startswith("."):
        return None
    if "/" in name or "\\" in name or "\x00" in name or Path(name).name != name:
        return None
    return name


def embed_png(out_dir: Path, name: object) -> tuple[str | None, str]:
    """(data URI, "") for a plot file in ``out_dir``, or (None, why not)."""
    fname = _plain_file(name)
    if fname is None:
        return None, f"{name!r} is not a plain file name in the report directory"
    path = out_dir / fname
    try:
        if path.is_symlink() or out_dir.resolve() not in path.resolve().parents:
            return None, f"{fname} is not inside the report directory"
        size = path.stat().st_size
        if size > MAX_PLOT_BYTES:
            return None, f"{fname} is {size} bytes, over {MAX_PLOT_BYTES}"
        data = path.read_bytes()
    except FileNotFoundError:
        return None, f"{fname} was not written"
    except OSError as e:
        return None, f"{fname} cannot be read: {e.strerror}"
    if not data.startswith(_PNG_MAGIC):
        return None, f"{fname} is not a PNG"
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii"), ""


def _mapping(v: object) -> dict:
    """A summary field that should be an object: itself, or {} if it is not one."""
    return v if isinstance(v, dict) else {}


def _items(v: object) -> list:
    """A summary field that should be a list: itself, or [] if it is not one."""
    return v if isinstance(v, list) else []


def headline(summary: dict) -> str:
    """The verdict sentence: the diagnosis' headline, else one from the counts."""
    diag = _mapping(summary.get("diagnosis"))
    if diag.get("headline"):
        return str(diag["headline"])
    first = summary.get("first_failing_node")
    counts = summary.get("counts") or {}
    if isinstance(first, dict):
        return (f"First failing node: {first.get('node')} ({first.get('op_type')}, execution order "
                f"{first.get('order')}); {counts.get('failed', '?')} of {counts.get('compared', '?')} "
                "compared node outputs fail.")
    return f"All {counts.get('compared', len(summary.get('nodes') or []))} compared node outputs agree with " \
           "the reference within tolerance."


def _verdict_class(summary: dict, failed: bool) -> str:
    """The verdict's colour, as the answer says it (the exit status), not as
    the seed's statistic: nodes past atol/rtol that the precision explains
    are a pass."""
    outcome = _mapping(summary.get("outcome"))
    if outcome.get("status") == "no_answer":
        return "noanswer"
    if outcome.get("status") in ("pass", "fail"):
        return str(outcome["status"])
    return "fail" if failed else "pass"


def _coverage(summary: dict) -> str:
    """One line under the verdict: how much of the reference the answer rests on."""
    cov = summary.get("coverage")
    if not isinstance(cov, dict) or not cov.get("text"):
        return ""
    return f'<p class="coverage" id="coverage">{esc(cov["text"])}</p>'


def _failed(summary: dict) -> bool:
    return isinstance(summary.get("first_failing_node"), dict) or bool(summary.get("failing_nodes"))


# ------------------------------------------------------------------ pieces

def _answer_node(summary: dict, nodes: list[dict]) -> dict | None:
    """The row of the node the answer names (summary.json's ``answer``; a
    report written before it: the first computation error)."""
    a = _mapping(summary.get("answer"))
    if not a:
        comp = summary.get("first_computation_error")
        return comp if isinstance(comp, dict) else None
    if not a.get("node"):
        return None
    return next((n for n in nodes if (n.get("node"), n.get("tensor")) == (a.get("node"), a.get("tensor"))
                 and n.get("role", "output") == "output"), None)


def _node_card(title: str, n: object, row_of: dict, plots_of: dict, empty: str) -> str:
    if not isinstance(n, dict):
        return f'<div class="card"><h3>{esc(title)}</h3><p class="muted">{esc(empty)}</p></div>'
    key = (n.get("node"), n.get("tensor"), n.get("role", "output"))
    links = []
    if key in row_of:
        links.append(f'<a href="#row-{row_of[key]}">row in the table</a>')
    if label_of(n) in plots_of:
        links.append(f'<a href="#plots-{plots_of[label_of(n)]}">plots</a>')
    facts = [("node", n.get("node")), ("tensor", n.get("tensor")), ("op type", n.get("op_type")),
             ("execution order", n.get("order")), ("device name", n.get("device_name"))]
    if n.get("verdict"):
        facts.append(("verdict", n.get("verdict")))
    if n.get("cause"):
        facts.append(("cause", n.get("cause")))
    metrics = [("errors/total", f"{fmt(n.get('errors'))}/{fmt(n.get('total'))}"),
               ("max abs err", fmt(n.get("max_abs_err"))), ("mean rel err", fmt(n.get("mean_rel_err"))),
               ("cosine", fmt(n.get("cosine"))), ("pearson", fmt(n.get("pearson"))),
               ("RMSE", fmt(n.get("rmse"))), ("NPU nan/inf", f"{fmt(n.get('dev_nan'))}/{fmt(n.get('dev_inf'))}")]
    iso = n.get("isolated")
    if isinstance(iso, dict):
        # the node re-run alone on the device's own inputs: its own error, not what it inherited
        metrics.append(("re-run alone on the device's inputs",
                        f"errors {fmt(iso.get('errors'))}/{fmt(iso.get('total'))}, cosine {fmt(iso.get('cosine'))}, "
                        f"mean rel err {fmt(iso.get('mean_rel_err'))}"))
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in facts + metrics if v is not None)
    ev = n.get("evidence") or []
    evidence = ""
    if isinstance(ev, list) and ev:
        evidence = "<h4>evidence</h4><ul>" + "".join(f"<li>{esc(e)}</li>" for e in ev) + "</ul>"
    return (f'<div class="card"><h3>{esc(title)}</h3><p class="name">{esc(n.get("node"))}</p>'
            f'<table class="kv">{rows}</table>{evidence}<p>{" · ".join(links)}</p></div>')


def _diagnosis(summary: dict) -> str:
    diag = _mapping(summary.get("diagnosis"))
    parts = []
    nan = diag.get("nan")
    if isinstance(nan, dict):
        where = {"both": "NaN on both sides (model or input problem)",
                 "reference": "NaN in the reference (model or input problem)",
                 "device": "NaN on the device only (FP16 overflow)"}.get(str(nan.get("where")), nan.get("where"))
        parts.append(f'<div class="diag nan"><h3>NaN</h3><p><b>{esc(where)}</b>, first at node '
                     f'<code>{esc(nan.get("node"))}</code></p><p>{esc(nan.get("text"))}</p></div>')
    ovf = diag.get("overflow")
    if isinstance(ovf, dict):
        parts.append(f'<div class="diag overflow"><h3>Overflow</h3><p>first at node '
                     f'<code>{esc(ovf.get("node"))}</code></p><p>{esc(ovf.get("text"))}</p></div>')
    if not parts:
        return ""
    return '<section id="diagnosis"><h2>Diagnosis</h2>' + "".join(parts) + "</section>"


COS_DIST_FLOOR = 1e-12   # 1 - cosine below this (or exactly 0) is drawn at the floor


def chart_svg(nodes: list[dict], first: object, width: int = 960, height: int = 340,
              verdicts: list[dict] | None = None, answer: object = None) -> str:
    """Inline SVG: the cosine distance (1 - cosine, log scale) of each node
    output by execution order, so that where the error grows shows as a
    climb whatever the values' scale (a relative error is dominated by
    near-zero references); failing points filled, the first failing node
    marked by a red dashed line, computation errors marked by impact
    (harmful: a black diamond, benign: a hollow one). The node the answer
    names (``answer``) is marked in red, the first node past the seed's
    tolerance in grey where it is another. A cosine that is undefined (a
    zero tensor) is a grey cross in a band of its own above the plot, not a
    point at its worst."""
    pts = [n for n in nodes if n.get("role") != "input"]
    if not pts:
        return '<p class="muted">No node output was compared.</p>'
    ml, mr, mt, mb = 70, 20, 34, 44
    band = mt - 16        # the undefined ones' row
    pw, ph = width - ml - mr, height - mt - mb
    orders = [num(n.get("order")) for n in pts]
    orders = [o if math.isfinite(o) else float(i) for i, o in enumerate(orders)]
    x0, x1 = min(orders), max(orders)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1

    def X(o: float) -> float:
        return ml + (o - x0) / (x1 - x0) * pw

    dist = []
    for n in pts:
        c = num(n.get("cosine"))
        dist.append(max(1.0 - c, 0.0) if math.isfinite(c) else math.nan)
    pos = [d for d in dist if math.isfinite(d) and d > COS_DIST_FLOOR]
    lo_dec = math.floor(math.log10(min(pos))) if pos else -6
    hi_dec = max(math.ceil(math.log10(max(pos))) if pos else 0, lo_dec + 1)
    lo_dec -= 1  # room for the floor (cosine 1)

    def Y(d: float) -> float:
        v = math.log10(d) if d > COS_DIST_FLOOR else lo_dec
        v = max(lo_dec, min(hi_dec, v))
        return mt + (hi_dec - v) / (hi_dec - lo_dec) * ph

    out = [f'<svg id="error-chart" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="error along the graph">',
           f'<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" fill="#fff" stroke="#999"/>']
    every = max(1, math.ceil((hi_dec - lo_dec) / 10))  # at most ~10 labelled decades
    for dec in range(lo_dec, hi_dec + 1):
        y = Y(10.0 ** dec) if dec > lo_dec else Y(0.0)
        tick = "0" if dec == lo_dec else f"1e{dec}" if (dec - lo_dec) % every == 0 or dec == hi_dec else ""
        out.append(f'<line x1="{ml}" x2="{ml + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>'
                   f'<text x="{ml - 6}" y="{y + 4:.1f}" text-anchor="end" class="ax">{tick}</text>')
    step = max(1, round((x1 - x0) / 10))
    t = math.ceil(x0)
    while t <= x1:
        out.append(f'<text x="{X(t):.1f}" y="{mt + ph + 16}" text-anchor="middle" class="ax">{int(t)}</text>')
        t += step
    out.append(f'<text x="{ml + pw / 2}" y="{height - 6}" text-anchor="middle" class="ax">execution order</text>'
               f'<text x="14" y="{mt + ph / 2}" text-anchor="middle" class="ax rel" '
               f'transform="rotate(-90 14 {mt + ph / 2})">1 − cosine</text>')
    marks = []
    if isinstance(answer, dict):
        marks.append(("answer-mark", "#d00", "answer", answer))
    if isinstance(first, dict) and not (isinstance(answer, dict) and first.get("node") == answer.get("node")):
        marks.append(("first-failing-mark", "#888", "first past atol/rtol", first))
    for i, (mark_id, color, word, n) in enumerate(marks):
        fo = num(n.get("order"))
        if math.isfinite(fo):
            fx = X(fo)
            out.append(f'<line id="{mark_id}" x1="{fx:.1f}" x2="{fx:.1f}" y1="{mt}" y2="{mt + ph}" '
                       f'stroke="{color}" stroke-width="1.5" stroke-dasharray="6 4"/>'
                       f'<text x="{fx + 4:.1f}" y="{mt + 12 + 14 * i}" fill="{color}" class="ax" paint-order="stroke" '
                       f'stroke="#fff" stroke-width="3">{word}: {esc(n.get("node"))}</text>')
    if any(math.isnan(d) for d in dist):
        out.append(f'<text x="{ml - 6}" y="{band + 4}" text-anchor="end" class="ax">undefined</text>')
    seg: list[str] = []
    for o, d in zip(orders, dist):
        if math.isnan(d):
            if len(seg) > 1:
                out.append(f'<polyline fill="none" stroke="#d62728" stroke-width="1.2" points="{" ".join(seg)}"/>')
            seg = []
        else:
            seg.append(f"{X(o):.1f},{Y(d):.1f}")
    if len(seg) > 1:
        out.append(f'<polyline fill="none" stroke="#d62728" stroke-width="1.2" points="{" ".join(seg)}"/>')
    impact = {(v.get("tensor")): (v.get("impact") or {}).get("harmful") for v in verdicts or []
              if v.get("verdict") == "computation error"}
    for n, o, d in zip(pts, orders, dist):
        failing = n.get("passed") is False
        tip = esc(f"{n.get('order')}. {n.get('node')} [{n.get('op_type')}]: cosine {fmt(n.get('cosine'))}, "
                  f"mean rel err {fmt(n.get('mean_rel_err'))}" + (", FAIL" if failing else ""))
        if math.isnan(d):       # no cosine to draw: a cross in the band, whatever passed
            y = band
            out.append(f'<path class="pt undefined" d="M{X(o) - 3:.1f},{y - 3:.1f} l6,6 m0,-6 l-6,6" stroke="#888" '
                       f'stroke-width="1.3"><title>{tip} (undefined: a zero tensor on a side)</title></path>')
        else:
            y = Y(d)
            fill = "#d62728" if failing else "#fff"
            out.append(f'<circle cx="{X(o):.1f}" cy="{y:.1f}" r="3.2" class="pt rel" fill="{fill}" '
                       f'stroke="#d62728"><title>{tip}</title></circle>')
        if n.get("tensor") in impact:
            harmful = impact[n.get("tensor")]
            kind = "harmful" if harmful is not False else "benign"
            out.append(f'<path class="mark {kind}" d="M{X(o):.1f},{y - 13:.1f} l5,6 l-5,6 l-5,-6 Z" '
                       f'fill="{"#000" if kind == "harmful" else "#fff"}" stroke="#000">'
                       f'<title>{esc(n.get("node"))}: computation error, {kind}</title></path>')
    out.append("</svg>")
    legend = ('<p class="legend"><span class="sw rel"></span> 1 − cosine of each node output (log scale; cosine 1 '
              'at the floor); filled points fail; × cosine undefined (a zero tensor), above the plot; ◆ a '
              'computation error that breaks the outputs, ◇ one the outputs absorb'
              + ('; <span class="sw first"></span> the node the answer names' if isinstance(answer, dict) else "")
              + ('; grey: the first node past the seed\'s atol/rtol' if any(m[0] == "first-failing-mark"
                                                                              for m in marks) else "")
              + "</p>")
    return "".join(out) + legend


def _cells(n: dict) -> list[tuple[str, str, str]]:
    """(key, display, sort value) per column of a node row."""
    total = num(n.get("total"))
    errors = num(n.get("errors"))
    ratio = errors / total if total and math.isfinite(total) and total > 0 else math.nan
    result = "pass" if n.get("passed") else "FAIL"
    if n.get("constant"):
        result += " (constant)"
    nan_inf = f"{fmt(n.get('dev_nan'))}/{fmt(n.get('dev_inf'))}"
    name = str(n.get("node"))
    if n.get("role") == "input":
        name += f" (input {n.get('input_index', 0)})"
    elif n.get("tensor") and n.get("tensor") != n.get("node"):
        name += f" → {n.get('tensor')}"
    values = {
        "order": (fmt(n.get("order")), _sort_value(n.get("order"))),
        "node": (name, name),
        "op_type": (str(n.get("op_type") or ""), str(n.get("op_type") or "")),
        "result": (result, result),
        "verdict": (str(n.get("verdict") or ""), str(n.get("verdict") or "")),
        "cause": (str(n.get("cause") or ""), str(n.get("cause") or "")),
        "errors": (f"{fmt(n.get('errors'))}/{fmt(n.get('total'))}", _sort_value(n.get("errors"))),
        "error_ratio": (f"{ratio:.4g}" if math.isfinite(ratio) else "—", _sort_value(ratio)),
        "nan_inf": (nan_inf, _sort_value(num(n.get("dev_nan")) + num(n.get("dev_inf")))),
        "overflow": (str(n.get("overflow") or ""), str(n.get("overflow") or "")),
        "note": (str(n.get("note") or ""), str(n.get("note") or "")),
    }
    out = []
    for key, _, _ in COLUMNS:
        shown, sv = values[key] if key in values else _num_cell(n.get(key))
        out.append((key, shown, sv))
    return out


_WRAPPED = frozenset({"node", "note", "overflow"})
# cells of numbers alone (fmt's and _sort_value's words, "/" between two):
# nothing in them to escape, thousands of cells a report
_NUMERIC = frozenset(k for k, _, t in COLUMNS if t == "num")
_WRAP = ' class="wrap"'


def _text_cell(key: str, shown: str, sort: str) -> str:
    text = esc(shown)
    return f'<td data-v="{text if sort == shown else esc(sort)}"{_WRAP if key in _WRAPPED else ""}>{text}</td>'


def _table(nodes: list[dict], first_key: tuple | None) -> str:
    head = "".join(f'<th data-key="{k}" data-type="{t}" tabindex="0" aria-sort="none">{esc(h)}</th>'
                   for k, h, t in COLUMNS)
    rows = []
    for i, n in enumerate(nodes):
        cls = ["fail" if n.get("passed") is False else "pass"]
        if n.get("role") == "input":
            cls.append("input")
        if first_key and (n.get("node"), n.get("tensor"), n.get("role", "output")) == first_key:
            cls.append("first")
        tds = "".join(f'<td data-v="{sv}">{shown}</td>' if key in _NUMERIC else _text_cell(key, shown, sv)
                      for key, shown, sv in _cells(n))
        rows.append(f'<tr id="row-{i}" data-i="{i}" class="{" ".join(cls)}">{tds}</tr>')
    return (f'<p><label><input type="checkbox" id="only-failing"> failing rows only</label> '
            f'<span class="muted">Click a column header to sort; click again to reverse.</span></p>'
            f'<div class="scroll"><table id="nodes" class="grid"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table></div>')


def _verdicts(summary: dict, row_of: dict, detail_files: dict) -> str:
    items = summary.get("verdicts")
    if not isinstance(items, list) or not items:
        return ""
    rows = []
    for v in items:
        if not isinstance(v, dict):
            continue
        key = (v.get("node"), v.get("tensor"), "output")
        node_cell = esc(v.get("node"))
        if key in row_of:
            node_cell = f'<a href="#row-{row_of[key]}">{node_cell}</a>'
        ev = _items(v.get("evidence"))
        detail = (_plain_file(detail_files.get(str(v.get("tensor"))))
                  or _plain_file(detail_files.get(str(v.get("node")))))
        link = f'<a href="{esc(quote(detail))}">{esc(detail)}</a>' if detail else ""
        cls = "comp" if v.get("verdict") == "computation error" else "acc"
        rows.append(f'<tr><td>{esc(v.get("order"))}</td><td>{node_cell}</td><td>{esc(v.get("op_type"))}</td>'
                    f'<td><span class="badge {cls}">{esc(v.get("verdict"))}</span></td><td>{esc(v.get("cause"))}</td>'
                    f'<td><ul>{"".join(f"<li>{esc(e)}</li>" for e in ev)}</ul></td><td>{link}</td></tr>')
    return ('<section id="verdicts"><h2>Failing nodes: verdicts</h2><table class="grid"><thead><tr><th>#</th>'
            '<th>node</th><th>op type</th><th>verdict</th><th>cause</th><th>evidence</th><th>worst elements</th>'
            f'</tr></thead><tbody>{"".join(rows)}</tbody></table></section>')


def _plots(out_dir: Path, summary: dict, nodes: list[dict]) -> tuple[str, dict]:
    plots = summary.get("plots")
    if not isinstance(plots, dict) or not plots:
        return "", {}
    by_label = {label_of(n): n for n in nodes}
    order = sorted(plots, key=lambda k: (num((by_label.get(k) or {}).get("order")), str(k)))
    index: dict[str, int] = {}
    blocks = []
    for i, label in enumerate(order[:MAX_PLOT_NODES]):
        files = plots[label] if isinstance(plots[label], dict) else {}
        index[label] = i
        n = by_label.get(label) or {}
        figs = []
        for kind, caption in (("diff", "absolute and relative error of the failing elements"),
                              ("diff_hist", "error histograms"), ("hist", "CPU and NPU value histograms")):
            if kind not in files:
                continue
            uri, why = embed_png(out_dir, files[kind])
            body = (f'<img src="{uri}" width="800" height="600" alt="{esc(caption)}">' if uri else
                    f'<p class="muted">plot missing: {esc(why)}</p>')
            figs.append(f"<figure>{body}<figcaption>{esc(files[kind])}: {esc(caption)}</figcaption></figure>")
        title = f"{n.get('order', '?')}. {n.get('node', label)}" if n else str(label)
        blocks.append(f'<div class="plots" id="plots-{i}"><h3>{esc(title)} <span class="muted">'
                      f'{esc(n.get("op_type", ""))}</span></h3><div class="row">{"".join(figs)}</div></div>')
    rest = ""
    if len(order) > MAX_PLOT_NODES:
        rest = (f'<p class="muted">Plots of {len(order) - MAX_PLOT_NODES} further nodes are not embedded, to keep '
                'this page light; their PNG files lie beside it: '
                + ", ".join(esc(f) for k in order[MAX_PLOT_NODES:] if isinstance(plots[k], dict)
                            for f in plots[k].values()) + "</p>")
    return ('<section id="plots"><h2>Plots of the failing nodes</h2><p class="muted">Click a plot to enlarge it.'
            '</p>' + "".join(blocks) + rest + "</section>", index)


def _quantization(summary: dict) -> str:
    q = summary.get("quantization")
    if not isinstance(q, list) or not q:
        return ""
    rows = "".join(
        f'<tr><td>{esc(a.get("node"))}</td><td>{esc(a.get("input"))}</td><td>{esc(fmt(a.get("min")))}</td>'
        f'<td>{esc(fmt(a.get("max")))}</td><td>{esc(fmt(a.get("range")))}</td><td>{esc(fmt(a.get("rmse")))}</td>'
        f'<td>{esc(fmt(a.get("sqnr_db")))}</td><td>{esc(a.get("advice"))}</td></tr>' for a in q if isinstance(a, dict))
    return ('<section id="quantization"><h2>Quantization advice</h2><p class="muted">A convolution input whose '
            'range (max − min) is above 30, or whose own error (re-run alone) has an RMSE above 0.5, is better '
            'quantized to INT16. SQNR: the output\'s quantization error, 10 log10(|ref|² / |ref − device|²).</p>'
            '<table class="grid"><thead><tr><th>node</th><th>input</th><th>min</th><th>max</th><th>range</th>'
            f'<th>own RMSE</th><th>SQNR dB</th><th>advice</th></tr></thead><tbody>{rows}</tbody></table></section>')


def _overflow(summary: dict) -> str:
    o = summary.get("overflow_nodes")
    if not isinstance(o, list) or not o:
        return ""
    rows = "".join(f'<tr><td>{esc(a.get("node"))}</td><td>{esc(a.get("why"))}</td></tr>'
                   for a in o if isinstance(a, dict))
    return ('<section id="overflow"><h2>Nodes the device flagged as overflowing</h2><table class="grid"><thead>'
            f'<tr><th>node</th><th>why</th></tr></thead><tbody>{rows}</tbody></table></section>')


def _others(summary: dict) -> str:
    parts = []
    consts = summary.get("failing_constants")
    if isinstance(consts, list) and consts:
        parts.append("<h3>Constants that differ</h3><ul>" + "".join(
            f'<li><code>{esc(c.get("node"))}</code>: max abs err {esc(fmt(c.get("max_abs_err")))}, '
            f'NPU FP16 overflow {esc(fmt(c.get("dev_fp16_overflow")))}</li>' for c in consts if isinstance(c, dict))
            + "</ul>")
    inputs = summary.get("failing_inputs")
    if isinstance(inputs, list) and inputs:
        parts.append("<h3>Node inputs that differ</h3><ul>" + "".join(f"<li><code>{esc(x)}</code></li>"
                                                                      for x in inputs) + "</ul>")
    counts = summary.get("counts")
    if isinstance(counts, dict) and counts:
        parts.append('<h3>Counts</h3><table class="kv">' + "".join(
            f"<tr><th>{esc(k.replace('_', ' '))}</th><td>{esc(fmt(v))}</td></tr>" for k, v in counts.items())
            + "</table>")
    params = summary.get("parameters")
    if isinstance(params, dict) and params:
        parts.append('<h3>Parameters</h3><table class="kv">' + "".join(
            f"<tr><th>{esc(k)}</th><td><code>{esc(json.dumps(v, ensure_ascii=False))}</code></td></tr>"
            for k, v in params.items()) + "</table>")
    return '<section id="job"><h2>Job</h2>' + "".join(parts) + "</section>" if parts else ""


def _join_time(nodes: list[dict], summary: dict) -> None:
    """Time per node (a job with performance data) beside its accuracy."""
    view = summary.get("node_view")
    if not isinstance(view, list):
        return
    mean_us = {v.get("node"): (v.get("perf") or {}).get("mean_us") for v in view if isinstance(v, dict)}
    for n in nodes:
        if n.get("role", "output") == "output" and mean_us.get(n.get("node")) is not None:
            n.setdefault("time_us", mean_us[n.get("node")])


def _slow_and_wrong(summary: dict) -> str:
    view = summary.get("node_view")
    hits = [v for v in view if isinstance(v, dict) and v.get("slow_and_wrong")] if isinstance(view, list) else []
    if not hits:
        return ""
    rows = "".join(f"<tr><td>{esc(v.get('order'))}</td><td class=\"wrap\">{esc(v.get('node'))}</td>"
                   f"<td>{esc(v.get('op_type'))}</td><td>{esc(fmt((v.get('perf') or {}).get('mean_us')))}</td>"
                   f"<td>{esc((v.get('perf') or {}).get('slow_rank'))}</td>"
                   f"<td>{esc((v.get('accuracy') or {}).get('verdict') or '')}</td></tr>" for v in hits)
    return ('<section id="slow-and-wrong"><h2>Slow and wrong</h2><p>Failing nodes among the slowest.</p>'
            '<table class="grid"><thead><tr><th>#</th><th>node</th><th>op type</th><th>mean µs</th>'
            f'<th>slow rank</th><th>verdict</th></tr></thead><tbody>{rows}</tbody></table></section>')


def render(out_dir: Path, summary: dict) -> str:
    """The page as a string (write_html writes it)."""
    if not isinstance(summary, dict):
        from layerdiff.common.errors import LayerdiffError

        raise LayerdiffError("the summary must be a JSON object", field="summary")
    nodes = [n for n in summary.get("nodes") or [] if isinstance(n, dict)]
    _join_time(nodes, summary)
    first = summary.get("first_failing_node")
    first_key = (first.get("node"), first.get("tensor"), first.get("role", "output")) \
        if isinstance(first, dict) else None
    row_of = {(n.get("node"), n.get("tensor"), n.get("role", "output")): i for i, n in enumerate(nodes)}
    detail_files = _mapping(summary.get("detail_files"))
    plots_html, plots_of = _plots(out_dir, summary, nodes)
    nonce = secrets.token_urlsafe(18)
    failed = _failed(summary)
    shown = dict(summary, precision=summary.get("device_precision") or summary.get("precision"),
                 model=shown_model(summary.get("model")) if summary.get("model") is not None else None)
    meta = " · ".join(f"{k} <b>{esc(shown.get(k))}</b>" for k in ("model", "device", "precision", "source",
                                                                     "job_id") if summary.get(k) is not None)
    comp = summary.get("first_computation_error")
    answer = _answer_node(summary, nodes)
    same = isinstance(first, dict) and isinstance(answer, dict) and \
        (first.get("node"), first.get("tensor")) == (answer.get("node"), answer.get("tensor"))
    # without an execution order no node is called first: the cards show the first by name
    unordered = _mapping(summary.get("execution_order")).get("known") is False
    first_word = "A" if unordered else "First"
    verdict = str(_mapping(summary.get("answer")).get("verdict") or ("computation error" if comp else ""))
    if same:
        if verdict == "computation error":
            title = "A failing node, and a computation error" if unordered else \
                "First failing node, and the first computation error"
        else:
            title = f"A failing node: the answer ({verdict})" if unordered else \
                f"The answer ({verdict}), and the first failing node"
        cards = _node_card(title, first, row_of, plots_of, "")
    else:
        cards = (_node_card(f"The answer: {verdict}" if verdict else "The answer", answer, row_of, plots_of,
                            "No node is named: every compared node is within what its precision explains."
                            if "first_computation_error" in summary else "No diagnosis in this summary.")
                 + _node_card(f"{first_word} node past the seed's atol/rtol (a detail)", first, row_of, plots_of,
                              "No node is past the seed's atol/rtol."))
    body = [
        f'<header><h1>layerdiff report</h1><p class="meta">{meta}</p></header>',
        f'<section id="verdict" class="verdict {_verdict_class(summary, failed)}">{esc(headline(summary))}'
        f'{_coverage(summary)}</section>',
        f'<section id="first"><div class="cards">{cards}</div></section>',
        _diagnosis(summary),
        f'<section id="chart"><h2>Error along the graph</h2>'
        f'{chart_svg(nodes, first, verdicts=summary.get("verdicts"), answer=answer)}</section>',
        f'<section id="table"><h2>Every compared tensor ({len(nodes)})</h2>{_table(nodes, first_key)}</section>',
        _verdicts(summary, row_of, detail_files),
        plots_html,
        _quantization(summary),
        _overflow(summary),
        _slow_and_wrong(summary),
        _others(summary),
        f'<footer>Written by {esc(summary.get("tool") or "layerdiff")} '
        f'{esc(summary.get("version") or __version__)}. The CSV files named here lie beside this page.</footer>',
    ]
    csp = (f"default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'nonce-{nonce}'; "
           "base-uri 'none'; form-action 'none'")
    title = f"layerdiff: {summary.get('model') or 'report'}"
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f'<meta http-equiv="Content-Security-Policy" content="{esc(csp)}">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{esc(title)}</title><style>{CSS}</style></head>\n<body>\n"
            + "\n".join(b for b in body if b)
            + f'\n<script nonce="{nonce}">{SCRIPT}</script>\n</body></html>\n')


def write_html(out_dir: Path, summary: dict) -> Path:
    """Write ``report.html`` into ``out_dir`` (plots named in
    ``summary["plots"]`` are read from there) and return its path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "report.html"
    tmp = out_dir / ".report.html.tmp"
    tmp.write_text(render(out_dir, summary), encoding="utf-8")
    tmp.replace(path)  # a reader never sees half a page
    return path
