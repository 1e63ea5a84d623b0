"""report.html read in a real headless Chromium, the Model Explorer export and
the terminal listing, all from a summary built out of a real comparison: the
small CNN run on the CPU as reference and, as the device, the same CNN with
a planted weight bug in conv2, one node named like a script tag, and a NaN
planted in the logits."""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from conftest import small_cnn

from layerdiff.analyzer.compare.node import compare_node
from layerdiff.analyzer.compare.tolerances import Tolerance
from layerdiff.analyzer.report import explorer, listing, plots
from layerdiff.analyzer.report import html as htmlreport
from layerdiff.analyzer.report.files import Row, node_summary
from layerdiff.collector.live.onnxrt import LiveRunner
from layerdiff.common.names import safe_filename
from layerdiff.common.onnxgraph import tensor_sites

HOSTILE = "<script>alert(1)</script>"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _rename(model, old: str, new: str):
    for n in model.graph.node:
        if n.name == old:
            n.name = new
    return model


def build_summary(out: Path) -> dict:
    """A summary with exactly the keys the job writes, from real tensors."""
    model = _rename(small_cnn(), "relu1", HOSTILE)
    device = _rename(small_cnn(bug_in="conv2"), "relu1", HOSTILE)
    feeds = {"input": np.random.default_rng(1).standard_normal((1, 3, 16, 16)).astype(np.float32)}
    ref = {r.name: r.array for r in LiveRunner(model.SerializeToString(), feeds).records()}
    dev = {r.name: r.array for r in LiveRunner(model.SerializeToString(), feeds,
                                               device_model_bytes=device.SerializeToString()).records()}
    dev["logits"] = dev["logits"].copy()
    dev["logits"][0, 3] = np.nan
    tol = Tolerance(0.005, 0.2)
    rows = [Row(s, s.tensor, compare_node(ref[s.tensor], dev[s.tensor], tol, 128)) for s in tensor_sites(model)]
    nodes = [node_summary(r) for r in rows]
    failing = [n for n in nodes if not n["passed"]]
    assert failing and failing[0]["node"] == "conv2"
    verdicts = []
    for n in nodes:
        if n["passed"]:
            n.update(verdict=None, evidence=[], cause="")
            continue
        if n["node"] == "conv2":
            n["isolated"] = {"errors": n["errors"], "total": n["total"], "cosine": n["cosine"],
                             "mean_rel_err": n["mean_rel_err"], "max_abs_diff": n["max_abs_diff"]}
            n.update(verdict="computation error", cause="weight",
                     evidence=[f"mean relative error 0.0 on the inputs, {n['max_rel_err']:.3g} on the output",
                               "re-running conv2 alone on the device's inputs reproduces the error"])
        elif n["node"] == "fc":
            n.update(verdict="accumulated precision error", cause="nan",
                     evidence=["NaN on the device only", "inherited from conv2"])
        else:
            n.update(verdict="accumulated precision error", cause="",
                     evidence=["error inherited from conv2, not grown here"])
        verdicts.append({k: n[k] for k in ("node", "tensor", "op_type", "order", "verdict", "cause", "evidence")})
    taken: set[str] = set()
    plot_files = {}
    for n in failing:
        plot_files[n["tensor"]] = plots.node_plots(out, safe_filename(n["node"], taken), ref[n["tensor"]],
                                                   dev[n["tensor"]], title=n["node"])
    first = failing[0]
    return {
        "tool": "layerdiff", "version": "0.1.0", "job_id": "job-1", "model": "small_cnn.onnx", "device": "cpu",
        "precision": "fp32", "source": "device_model",
        "parameters": {"atol": 0.005, "rtol": 0.2, "diff_cnt": 128},
        "first_failing_node": first,
        "counts": {"reference_tensors": len(nodes), "compared": len(nodes), "failed": len(failing),
                   "failed_constants": 0, "passed": len(nodes) - len(failing), "inputs_compared": 0,
                   "inputs_failed": 0, "overflowing_nodes": 1, "skipped": 0, "not_dumped": 0, "invalid_out": 0,
                   "device_tensors": len(nodes)},
        "failing_nodes": [n["tensor"] for n in failing],
        "failing_constants": [],
        "failing_inputs": [],
        "overflow_nodes": [{"node": "conv3", "why": "AI Core status 0x20: float overflow <b>"}],
        "detail_files": {n["tensor"]: safe_filename(n["node"], set()) + ".csv" for n in failing},
        "nodes": nodes,
        "first_computation_error": first,
        "diagnosis": {
            "headline": "conv2 (Conv) is the first failing node: a computation error, its weights differ.",
            "nan": {"node": "fc", "where": "device", "text": "NaN only on the device: FP16 overflow past 65504."},
            "overflow": {"node": "conv3", "text": "conv3 exceeds the FP16 range first."},
        },
        "verdicts": verdicts,
        "quantization": [{"node": "conv3", "input": "add_out", "min": -1.5, "max": 40.0, "range": 41.5,
                          "rmse": 0.7, "advice": "use INT16 for this convolution's input"}],
        "plots": plot_files,
    }


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    summary = build_summary(out)
    (out / "summary.json").write_text(json.dumps(summary, allow_nan=False), encoding="utf-8")
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))  # as the job hands it over
    path = htmlreport.write_html(out, summary)
    return out, summary, path


# ------------------------------------------------------------------ helpers

def need_chromium() -> str:
    if CHROMIUM:
        return CHROMIUM
    if os.environ.get("CI") == "true":
        pytest.fail("chromium is not installed: `make setup` installs it, and CI must run these tests")
    pytest.skip("chromium is not installed (run `make setup`)")


def chromium(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    exe = need_chromium()
    return subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           "--disable-dev-shm-usage", f"--user-data-dir={tmp / 'profile'}", *args],
                          capture_output=True, text=True, timeout=120)


def dom(tmp: Path, page: Path, fragment: str = "") -> str:
    res = chromium(tmp, "--dump-dom", page.as_uri() + fragment)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


class Rows(HTMLParser):
    """Rows of the node table in DOM order: [(row id, {column: data-v})]."""

    def __init__(self, keys: list[str]) -> None:
        super().__init__()
        self.keys, self.rows, self.cur, self.col = keys, [], None, 0
        self.in_nodes = False
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table" and a.get("id") == "nodes":
            self.in_nodes = True
        elif self.in_nodes and tag == "tr" and a.get("id", "").startswith("row-"):
            self.cur = (a["id"], {}, a.get("class", ""))
            self.rows.append(self.cur)
            self.col = 0
        elif self.in_nodes and tag == "td" and self.cur is not None:
            self.cur[1][self.keys[self.col]] = a.get("data-v", "")
            self.col += 1

    def handle_endtag(self, tag):
        if tag == "table":
            self.in_nodes = False


def table_rows(page_dom: str) -> list:
    p = Rows([k for k, _, _ in htmlreport.COLUMNS])
    p.feed(page_dom)
    return p.rows


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


# -------------------------------------------------------------------- tests

def test_page_is_self_contained_and_escapes_names(report):
    out, summary, path = report
    text = path.read_text(encoding="utf-8")
    assert path.name == "report.html"
    # nothing from the network: no http(s) sources, plots embedded
    assert "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "") and "https://" not in text
    assert text.count("data:image/png;base64,") == 3 * len(summary["plots"])
    assert "<script>alert(1)" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "float overflow &lt;b&gt;" in text


def test_chromium_renders_verdict_table_and_hostile_name_as_text(report, tmp_path):
    out, summary, path = report
    page = dom(tmp_path, path)
    assert 'data-ready="1"' in page, "the page's script did not run"
    assert summary["diagnosis"]["headline"] in page
    assert 'class="verdict fail"' in page
    rows = table_rows(page)
    assert len(rows) == len(summary["nodes"])
    assert [r[0] for r in rows] == [f"row-{i}" for i in range(len(summary["nodes"]))]
    assert sum("fail" in r[2].split() for r in rows) == len(summary["failing_nodes"])
    assert sum("first" in r[2].split() for r in rows) == 1
    # the hostile node name is text in the DOM, and no script element came of it
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert page.count("<script") == 1
    # first failing node, first computation error, NaN and overflow diagnosis, chart mark
    assert "First failing node, and the first computation error" in page  # one node: one card
    assert "NaN on the device only" in page and "exceeds the FP16 range" in page
    # the chart marks the node the answer names (here also the first past atol/rtol: one mark)
    assert 'id="answer-mark"' in page and "answer: conv2" in page and 'id="first-failing-mark"' not in page
    assert "use INT16 for this convolution" in page
    assert "re-run alone on the device's inputs" in page


@pytest.mark.parametrize("key,descending", [("cosine", False), ("mean_rel_err", True), ("node", False)])
def test_chromium_sorts_the_table_by_a_header_click(report, tmp_path, key, descending):
    out, summary, path = report
    page = dom(tmp_path, path, f"#sort={'-' if descending else ''}{key}")
    assert f'data-sorted="{"-" if descending else ""}{key}"' in page
    rows = table_rows(page)
    assert len(rows) == len(summary["nodes"])
    vals = [r[1][key] for r in rows]
    if key == "node":
        # these names sort the same by the browser's collation and by lower-cased code points
        assert vals[0] == f"{HOSTILE} → relu1_out"
        assert [v.lower() for v in vals] == sorted(v.lower() for v in vals)
        return
    present = [float(v) for v in vals if v != ""]
    missing = [v for v in vals if v == ""]
    assert vals[len(present):] == missing, "undefined values sort last"
    assert present == sorted(present, reverse=descending)
    assert len(set(present)) > 3
    unsorted = table_rows(dom(tmp_path, path))
    assert [r[0] for r in unsorted] != [r[0] for r in rows]


def test_the_table_scrolls_inside_a_1400_pixel_window_with_its_first_columns_kept(report, tmp_path):
    out, summary, path = report
    res = chromium(tmp_path, "--dump-dom", "--window-size=1400,900", path.as_uri())
    assert res.returncode == 0, res.stderr[-2000:]
    layout = re.search(r'data-table-layout="([a-z ]+)"', res.stdout)
    assert layout, "the page's script did not measure the table"
    fits, sticky, _ = layout.group(1).split()
    assert (fits, sticky) == ("fits", "sticky")


def test_undefined_cosines_are_drawn_apart_not_at_the_worst(tmp_path):
    """Zero tensors (cosine undefined) are crosses in a band above the
    plot, named as undefined; the answer's node is marked in red and the
    first node past atol/rtol, another one, in grey."""
    nodes = [{"node": f"n{i}", "tensor": f"t{i}", "order": i, "op_type": "Conv", "passed": i != 3,
              "cosine": None if i in (1, 2) else 1 - 10.0 ** -(6 - i), "mean_rel_err": 0.1} for i in range(6)]
    svg = htmlreport.chart_svg(nodes, nodes[3], answer=nodes[4])
    assert svg.count('class="pt undefined"') == 2 and svg.count('class="pt rel"') == 4
    band = [float(m) for m in re.findall(r'class="pt undefined" d="M[0-9.]+,([0-9.]+)', svg)]
    tops = [float(m) for m in re.findall(r'<circle cx="[0-9.]+" cy="([0-9.]+)"', svg)]
    assert max(band) < min(tops), "undefined points lie above the plot, not on its top"
    assert "undefined" in svg and "answer: n4" in svg and "first past atol/rtol: n3" in svg
    assert 'id="answer-mark"' in svg and 'stroke="#888"' in svg


def test_chromium_failing_filter_and_screenshot(report, tmp_path):
    out, summary, path = report
    page = dom(tmp_path, path, "#failing")
    assert "only-failing" in page.split("<body", 1)[1].split(">", 1)[0]
    shot = tmp_path / "shot.png"
    res = chromium(tmp_path, f"--screenshot={shot}", "--window-size=1280,2400", path.as_uri())
    assert res.returncode == 0, res.stderr[-2000:]
    assert shot.stat().st_size > 20_000
    assert png_size(shot) == (1280, 2400)


def test_missing_and_foreign_plot_files_are_named_not_embedded(report, tmp_path):
    out, summary, _ = report
    s = dict(summary)
    label = next(iter(s["plots"]))
    (tmp_path / "fake.png").write_text("not a png")
    s["plots"] = {label: {"diff": "../" + s["plots"][label]["diff"], "diff_hist": "absent.png",
                          "hist": "fake.png"}}
    text = htmlreport.render(tmp_path, s)
    assert "data:image/png" not in text
    assert "is not a plain file name" in text and "absent.png was not written" in text
    assert "fake.png is not a PNG" in text


def test_passing_job_headline_without_diagnosis(tmp_path):
    s = {"tool": "layerdiff", "version": "0.1.0", "first_failing_node": None, "counts": {"compared": 2},
         "failing_nodes": [], "nodes": [
             {"node": "a", "tensor": "a_out", "op_type": "Relu", "order": 0, "passed": True, "cosine": 1.0,
              "mean_rel_err": 0.0, "mse": 0.0, "rmse": 0.0, "role": "output"},
             {"node": "b", "tensor": "b_out", "op_type": "Relu", "order": 1, "passed": True, "cosine": None,
              "mean_rel_err": "inf", "mse": None, "rmse": None, "role": "output"}]}
    text = htmlreport.write_html(tmp_path, s).read_text(encoding="utf-8")
    assert 'class="verdict pass"' in text
    assert "All 2 compared node outputs agree" in text
    assert "No node is past the seed&#x27;s atol/rtol." in text and "No diagnosis in this summary." in text


def test_explorer_node_data_covers_every_compared_node(report):
    out, summary, _ = report
    path = explorer.write_node_data(out, summary)
    rel = json.loads(path.read_text(encoding="utf-8"))
    cos = json.loads((out / explorer.COSINE_FILE).read_text(encoding="utf-8"))
    names = {n["node"] for n in summary["nodes"] if n.get("role") != "input"}
    for doc in (rel, cos):
        assert set(doc) == {"results", "thresholds"}
        assert set(doc["results"]) == names
        assert all(isinstance(r["value"], (int, float)) for r in doc["results"].values())
        bounds = [t["value"] for t in doc["thresholds"]]
        assert bounds == sorted(bounds) and all(isinstance(t["bgColor"], str) for t in doc["thresholds"])
    by = {n["node"]: n for n in summary["nodes"]}
    assert rel["results"]["conv2"]["value"] == pytest.approx(by["conv2"]["mean_rel_err"])
    assert cos["results"]["conv2"]["value"] == pytest.approx(by["conv2"]["cosine"])
    assert HOSTILE in rel["results"]
    # a node whose figure is undefined is present, greyed
    s = {"nodes": [{"node": "e", "role": "output", "mean_rel_err": None, "cosine": None},
                   {"node": "f", "role": "output", "mean_rel_err": "inf", "cosine": 0.5}]}
    r, c = explorer.node_data(s)
    assert r["results"]["e"] == {"value": explorer.UNDEFINED_VALUE, "bgColor": explorer.UNDEFINED_COLOUR}
    assert r["results"]["f"]["value"] > 1e300
    json.dumps(r, allow_nan=False)


def test_listing_in_the_debug_script_layout(report):
    _, summary, _ = report
    text = listing.format_listing(summary)
    lines = text.splitlines()
    assert len(lines) == len(summary["nodes"])
    conv1 = next(line for line in lines if line.startswith("0.conv1 "))
    n = summary["nodes"][0]
    assert "OP_TYPE:Conv" in conv1
    assert f"MSE:{n['mse']:.6f}" in conv1 and f"COS:{n['cosine']:.6f}" in conv1 and f"RMSE:{n['rmse']:.6f}" in conv1
    first = next(line for line in lines if "<- first failing node" in line)
    assert first.startswith("2.conv2 ") and "FAIL computation error (weight)" in first
    # columns line up
    assert len({line.index("OP_TYPE:") for line in lines}) == 1
    assert len({line.index(" MSE:") for line in lines}) == 1 and len({line.index(" COS:") for line in lines}) == 1
    evil = listing.format_listing({"nodes": [{"node": "a\x1b[31mb\nc", "op_type": "Relu", "order": 0,
                                              "mse": None, "cosine": "inf", "rmse": 1.0, "passed": True}]})
    assert "\x1b" not in evil and "\n" not in evil and "MSE:nan" in evil and "COS:inf" in evil


def test_escaping_is_the_standard_librarys():
    """Every name and text the page shows is escaped as html.escape escapes
    it (an element's text and an attribute's value alike): the markup's
    characters, both quotes, and nothing else."""
    import html
    import random

    from layerdiff.analyzer.report.html import esc

    rnd = random.Random(5)
    alphabet = "&<>\"'ab/.:0é\u2028\x00 ;#"
    for _ in range(2000):
        s = "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 24)))
        assert esc(s) == html.escape(s, quote=True), s
    assert esc(None) == "" and esc(1.5) == "1.5"
