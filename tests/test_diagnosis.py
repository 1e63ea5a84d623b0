"""Verdicts on planted faults in real models, over the real services: the
right node, the right verdict, the right cause, and the evidence a user
reads in the report."""
from __future__ import annotations

import csv
import json

import numpy as np
import onnx
import pytest
from conftest import small_cnn
from onnx import TensorProto, helper, numpy_helper
from onnxbuild import opset17
from test_ascend import overflowing_model

from layerdiff.analyzer.diagnose import verdicts as diagnose
from layerdiff.client.api import run
from layerdiff.client.summary_text import format_summary


def _rows(out):
    with open(out / "cpu_vs_npu.csv", newline="", encoding="utf-8") as f:
        return {r["node"] + ("" if r["role"] == "output" else f".input{r['tensor']}"): r for r in csv.DictReader(f)}


def _go(services, tmp_path, model, inputs, **kw):
    collector, analyzer = services
    mpath, ipath = tmp_path / "model.onnx", tmp_path / "inputs.npz"
    onnx.save_model(model, str(mpath))
    np.savez(ipath, **inputs)
    for key in ("device_model",):
        if isinstance(kw.get(key), onnx.ModelProto):
            p = tmp_path / "device.onnx"
            onnx.save_model(kw[key], str(p))
            kw[key] = p
    out = tmp_path / "out"
    res = run(mpath, ipath, out=out, analyzer=analyzer.address, collector=collector.address, progress=False, **kw)
    return res.summary, out


CNN_INPUT = {"input": np.random.default_rng(1).standard_normal((1, 3, 16, 16)).astype(np.float32)}


def test_wrong_weight_is_a_computation_error_at_that_conv(services, tmp_path):
    s, out = _go(services, tmp_path, small_cnn(), CNN_INPUT, device_model=small_cnn(bug_in="conv2"),
                 dump_mode="all")
    first = s["first_computation_error"]
    assert first["node"] == "conv2" and first["verdict"] == diagnose.COMPUTATION and first["cause"] == "weight"
    assert any("re-run alone on its device inputs" in e for e in first["evidence"])
    assert any("conv2.weight" in e for e in first["evidence"])
    by = {v["node"]: v for v in s["verdicts"]}
    # everything downstream inherits the error and computes correctly itself
    for node in ("relu2", "residual/add", "conv3", "pool", "fc"):
        assert by[node]["verdict"] == diagnose.ACCUMULATED, (node, by[node])
    assert s["diagnosis"]["headline"].startswith("Computation error at conv2")
    rows = _rows(out)
    assert rows["conv2"]["verdict"] == "computation error" and "conv2.weight" in rows["conv2"]["evidence"]
    assert rows["conv3"]["verdict"] == "accumulated precision error"
    text = format_summary(s, out, width=100)
    assert text.splitlines()[0].startswith("VERDICT: Computation error at conv2")
    assert text.splitlines()[1].startswith("FIRST COMPUTATION ERROR: conv2")
    # sentences wrap at the width (the table's rows excepted), the evidence kept to its first sentences
    table = text.index("failing nodes in execution order:")
    assert all(len(line) <= 100 for line in text[:table].splitlines()), text
    shown = [line for line in text.splitlines() if line.startswith("  - ")]
    assert 0 < len(shown) <= 2 and (len(first["evidence"]) <= 2 or "more in report.html" in text)
    # the answer, the same in summary.json and the Python API
    assert s["answer"]["node"] == "conv2" and s["answer"]["verdict"] == "computation error"
    from layerdiff.client.follow import Answer

    a = Answer.of(s)
    assert (a.node, a.verdict, a.cause, a.status, a.exit_status) == ("conv2", "computation error",
                                                                      first["cause"], "fail", 1)
    assert a.evidence == tuple(first["evidence"]) and a.coverage == 1.0 and a.adequate
    # where the first node past atol/rtol is not the answer, it is named as a detail
    other = dict(s, first_failing_node=dict(s["first_failing_node"], node="conv1", tensor="conv1_out"))
    assert "FIRST NODE PAST ATOL/RTOL (a detail: the answer is conv2): conv1" in \
        format_summary(other, out, width=1000)


def test_wrong_weight_without_device_inputs_uses_the_producers_outputs(services, tmp_path):
    s, _ = _go(services, tmp_path, small_cnn(), CNN_INPUT, device_model=small_cnn(bug_in="conv2"))
    first = s["first_computation_error"]
    assert first["node"] == "conv2" and first["isolated"]["cosine"] < 0.99
    assert {v["node"]: v["verdict"] for v in s["verdicts"]}["conv3"] == diagnose.ACCUMULATED


def _transposed(node: str) -> onnx.ModelProto:
    """The device writes ``node``'s output with H and W swapped."""
    m = small_cnn()
    nodes = list(m.graph.node)
    i = next(k for k, n in enumerate(nodes) if n.name == node)
    out = nodes[i].output[0]
    nodes[i].output[0] = f"{node}_raw"
    nodes.insert(i + 1, helper.make_node("Transpose", [f"{node}_raw"], [out], name=f"{node}_layout",
                                         perm=[0, 1, 3, 2]))
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    return m


def test_transposed_layout_in_one_node(services, tmp_path):
    """conv2's output swapped: the residual Add then mixes it with an
    unswapped tensor, and the outputs break."""
    s, out = _go(services, tmp_path, small_cnn(), CNN_INPUT, device_model=_transposed("conv2"))
    first = s["first_computation_error"]
    assert first["node"] == "conv2" and first["cause"] == "layout"
    assert any("axes 2 and 3 swapped" in e for e in first["evidence"])
    assert first["impact"]["harmful"] is True
    assert s["first_failing_node"]["node"] == "conv2"


def test_a_swap_the_pooling_averages_away_is_benign(services, tmp_path):
    """conv3's output swapped, then globally pooled: the outputs do not
    change, so the swap is listed as benign, not as the answer."""
    s, out = _go(services, tmp_path, small_cnn(), CNN_INPUT, device_model=_transposed("conv3"))
    assert s["first_computation_error"] is None
    benign = {b["node"]: b for b in s["benign_computation_errors"]}
    assert benign["conv3"]["cause"] == "layout" and benign["conv3"]["impact"]["harmful"] is False
    assert s["diagnosis"]["headline"].startswith("No node's own error changes the outputs")


def test_activation_saturating_in_fp16(services, tmp_path):
    inputs = {"input": (np.random.default_rng(1).random((1, 3, 8, 8)) * 4).astype(np.float32)}
    s, out = _go(services, tmp_path, overflowing_model(), inputs, precision="fp16")
    first = s["first_computation_error"]
    assert first["node"] == "boost" and first["cause"] == "overflow"
    assert s["diagnosis"]["overflow"]["node"] == "boost"
    assert "first node whose reference exceeds 65504" in s["diagnosis"]["overflow"]["text"]
    # the live FP16 run flags the overflow itself, shown beside the node
    assert [o["node"] for o in s["overflow_nodes"]] == ["boost"]
    assert any("the device flagged this node: floating-point overflow" in e for e in first["evidence"])
    assert {v["node"]: v["verdict"] for v in s["verdicts"]}.get("relu") in (diagnose.ACCUMULATED, None)


def _nan_model() -> onnx.ModelProto:
    """conv1 -> log (of values that go negative: NaN in any precision) -> relu -> conv2."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array((rng.standard_normal((4, 3, 3, 3)) * 0.4).astype(np.float32), "w1")
    w2 = numpy_helper.from_array((rng.standard_normal((4, 4, 3, 3)) * 0.2).astype(np.float32), "w2")
    nodes = [helper.make_node("Conv", ["input", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Log", ["c1"], ["l"], name="log"),
             helper.make_node("Relu", ["l"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "w2"], ["output"], name="conv2", pads=[1, 1, 1, 1])]
    g = helper.make_graph(nodes, "nan", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, 8, 8])],
                          [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 4, 8, 8])],
                          initializer=[w1, w2])
    return opset17(g)


def test_nan_on_both_sides_is_a_model_or_input_problem(services, tmp_path):
    inputs = {"input": np.random.default_rng(2).standard_normal((1, 3, 8, 8)).astype(np.float32)}
    s, out = _go(services, tmp_path, _nan_model(), inputs, precision="fp16")
    nan = s["diagnosis"]["nan"]
    assert nan["node"] == "log" and nan["where"] == "both"
    assert "model or its input is at fault" in nan["text"]
    assert s["first_computation_error"] is None
    assert "NaN first appears at log" in s["diagnosis"]["headline"]


def test_uneven_error_along_an_axis_is_found():
    ref = np.random.default_rng(0).standard_normal((1, 4, 8, 8)).astype(np.float32)
    dev = ref.copy()
    dev[:, :, 4:, :] += 1.0                 # only the second half of H is wrong
    text = diagnose.uneven_axis(ref, dev, "NCHW")
    assert "second half of axis 2 (H)" in text
    assert diagnose.uneven_axis(ref, ref + 0.001, "NCHW") == ""


def test_uneven_error_read_a_block_at_a_time_is_the_whole_tensors(monkeypatch):
    """The halves' errors summed a block of elements at a time (no float64
    copy of a large activation) give the sentence of the whole tensor's
    means, NaN and Inf pairs left out, for blocks that cut across every axis."""
    from layerdiff.analyzer.diagnose import evidence

    def whole(ref, dev, names):
        bad = ~(np.isfinite(ref) & np.isfinite(dev))
        r, d = np.where(bad, 0, ref).astype(np.float64), np.where(bad, 0, dev).astype(np.float64)
        err, scale = np.abs(d - r), float(np.sqrt(np.mean(r * r))) or 1.0
        found = []
        for ax, size in enumerate(ref.shape):
            if size < 2:
                continue
            cut = (slice(None),) * ax
            a = err[cut + (slice(0, size // 2),)].mean() / scale
            b = err[cut + (slice(size // 2, size),)].mean() / scale
            if max(a, b) >= evidence.UNEVEN_MIN_REL and max(a, b) / max(min(a, b), 1e-12) >= 10:
                found.append((max(a, b) / max(min(a, b), 1e-12), ax, "second" if b > a else "first"))
        return max(found)[1:] if found else None

    rng = np.random.default_rng(1)
    monkeypatch.setattr(evidence, "PROFILE_BLOCK", 37)
    seen = 0
    for k in range(200):
        shape = tuple(int(x) for x in rng.integers(1, 9, rng.integers(1, 5)))
        ref = rng.standard_normal(shape).astype(np.float32)
        dev = ref.copy()
        ax = int(rng.integers(0, len(shape)))
        dev[(slice(None),) * ax + (slice(shape[ax] // 2, None),)] += np.float32(rng.standard_normal() * 3)
        if k % 5 == 0 and ref.size > 2:
            dev.reshape(-1)[0], ref.reshape(-1)[1] = np.nan, np.inf
        text = diagnose.uneven_axis(ref, dev, "NCHW"[:len(shape)])
        want = whole(ref, dev, "NCHW"[:len(shape)])
        if want is None or ref.size < 8:        # nothing uneven, or too small to say
            assert text == "", (shape, text)
            continue
        seen += 1
        assert f"{want[1]} half of axis {want[0]}" in text, (shape, text, want)
    assert seen > 50


@pytest.mark.parametrize("types", [(np.float32, np.float16), (np.float16, np.float32), (np.float32, np.float32),
                                   (np.float64, np.float64), (np.int32, np.int32), (np.float32, np.float64)])
def test_error_profiles_are_the_sums_of_the_finite_pairs_errors(types):
    """Each axis's profile (the |d - r| at each of its indices, summed over
    the others) and the sum of r², over the pairs finite on both sides,
    whatever the types (compiled for float32, float16 and float64 as they
    are stored, numpy otherwise), for a view that is not contiguous too."""
    from layerdiff.analyzer.diagnose import evidence

    rng = np.random.default_rng(3)
    ref = (rng.standard_normal((2, 6, 5, 7)) * 40).astype(types[0])
    dev = (ref.astype(np.float64) + rng.standard_normal(ref.shape) * 3).astype(types[1])
    if np.dtype(types[0]).kind == "f":
        ref.flat[5], dev.flat[9], ref.flat[11], dev.flat[11] = np.nan, np.inf, np.inf, np.inf
    for r, d in ((ref, dev), (ref.transpose(0, 2, 1, 3), dev.transpose(0, 2, 1, 3))):
        bad = ~(np.isfinite(r) & np.isfinite(d))
        r64, d64 = np.where(bad, 0, r).astype(np.float64), np.where(bad, 0, d).astype(np.float64)
        err = np.abs(d64 - r64)
        profiles, sum_r2 = evidence._error_profiles(r, d)
        assert sum_r2 == pytest.approx(float(np.sum(r64 * r64)), rel=1e-12)
        for ax in range(4):
            others = tuple(a for a in range(4) if a != ax)
            np.testing.assert_allclose(profiles[ax], err.sum(axis=others), rtol=1e-12)


def test_int8_build_gets_range_advice(services, tmp_path):
    """A fixed-point build: per quantized-op input range from the reference,
    INT16 advice where the range exceeds 30."""
    m = small_cnn()
    inputs = {"input": (np.random.default_rng(1).standard_normal((1, 3, 16, 16)) * 40).astype(np.float32)}
    s, _ = _go(services, tmp_path, m, inputs, precision="int8")
    advice = {a["node"]: a for a in s["quantization"]}
    assert advice["conv1"]["input"] == "input" and advice["conv1"]["range"] > 30
    assert "INT16" in advice["conv1"]["advice"]
    json.dumps(s["quantization"])


def test_calibrator_ranges_replace_the_reference_ranges(services, tmp_path):
    collector, analyzer = services
    inputs = {"input": (np.random.default_rng(1).standard_normal((1, 3, 16, 16)) * 40).astype(np.float32)}
    mpath, ipath, mm = tmp_path / "m.onnx", tmp_path / "in.npz", tmp_path / "tensor_min_max.txt"
    onnx.save_model(small_cnn(), str(mpath))
    np.savez(ipath, **inputs)
    mm.write_text("input -1.5 1.5\nrelu1_out: 0, 45\nthis line is not a range\n")
    res = run(mpath, ipath, out=tmp_path / "out", precision="int8", min_max=mm, analyzer=analyzer.address,
              collector=collector.address, progress=False)
    advice = {a["node"]: a for a in res.summary["quantization"]}
    assert advice["conv1"]["range"] == 3.0 and "input range" not in advice["conv1"]["advice"]
    assert advice["conv2"]["range"] == 45.0 and "INT16" in advice["conv2"]["advice"]
    assert "tensor_min_max.txt:3: not 'name min max'" in (tmp_path / "out" / "min_max_skip.log").read_text()


def test_show_graph_plots_and_the_page_reach_the_client(services, tmp_path):
    import struct

    s, out = _go(services, tmp_path, small_cnn(), CNN_INPUT, device_model=small_cnn(bug_in="conv2"),
                 show_graph=True, max_bins=64, min_bins=4)
    plots = s["plots"]["conv2_out"]
    assert set(plots) == {"diff", "diff_hist", "hist"}
    for name in plots.values():
        png = (out / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (800, 600)
    page = (out / "report.html").read_text(encoding="utf-8")
    assert "Computation error at conv2" in page and 'id="nodes"' in page and "data:image/png;base64," in page
    explorer = json.loads((out / "model_explorer_rel_err.json").read_text())
    assert "conv2" in json.dumps(explorer)


def test_plots_are_drawn_for_the_first_failing_nodes_only_unless_asked(services, tmp_path):
    """--show-graph draws the first failing nodes in execution order, as many
    as max_plots (default 20), counts the rest and says so in the terminal;
    -1 ('all' on the command line) draws every one."""
    from layerdiff.client.summary_text import format_summary

    (tmp_path / "two").mkdir()
    (tmp_path / "all").mkdir()
    s, out = _go(services, tmp_path / "two", small_cnn(), CNN_INPUT, device_model=small_cnn(bug_in="conv1"),
                 show_graph=True, max_plots=2)
    failing = [n for n in s["nodes"] if not n["passed"] and n.get("role") != "input"]
    assert len(failing) > 3
    assert list(s["plots"]) == [n["tensor"] for n in failing[:2]], (list(s["plots"]), failing[:3])
    assert s["plots_not_drawn"] == len(failing) - 2
    assert len(list(out.glob("*.png"))) == 2 * 3
    assert f"{len(failing) - 2} more not (--max-plots N or all" in format_summary(s, out, width=1000)
    s, out = _go(services, tmp_path / "all", small_cnn(), CNN_INPUT, device_model=small_cnn(bug_in="conv1"),
                 show_graph=True, max_plots=-1)
    assert len(s["plots"]) == len(failing) and s["plots_not_drawn"] == 0


def test_the_page_of_a_real_job_in_headless_chromium(services, tmp_path):
    from test_report_html import chromium

    s, out = _go(services, tmp_path, small_cnn(), CNN_INPUT, device_model=_transposed("conv2"))
    res = chromium(tmp_path, "--dump-dom", (out / "report.html").as_uri())
    dom = res.stdout
    assert "Computation error at conv2" in dom and "cause: layout" in dom
    assert 'class="mark harmful"' in dom
    assert dom.count('<tr id="row-') == len(s["nodes"]) == 9
    assert "axes 2 and 3 swapped" in dom


def _layout_by_definition(ref: np.ndarray, dev: np.ndarray) -> str:
    """The first candidate layout whose mean |d - r| over the whole tensor
    is under 1 % of the reference's RMS (every value finite)."""
    r, d = ref.astype(np.float64), dev.astype(np.float64)
    scale = float(np.sqrt(np.mean(r * r))) or 1.0
    if np.mean(np.abs(d - r)) / scale < 0.01:
        return ""
    cands = [(f"axes {i} and {j} swapped", np.swapaxes(r, i, j)) for i in range(r.ndim)
             for j in range(i + 1, r.ndim) if r.shape[i] == r.shape[j] and r.shape[i] > 1]
    if r.ndim == 4:
        n, c, h, w = r.shape
        cands += [("NHWC data read as NCHW", r.transpose(0, 2, 3, 1)),
                  ("NCHW data read as NHWC", r.reshape(n, h, w, c).transpose(0, 3, 1, 2))]
    for label, view in cands:
        if np.mean(np.abs(d - view.reshape(r.shape))) / scale < 0.01:
            return f"layout: the device output is the expected output with {label}"
    return ""


def test_a_layout_is_named_as_its_definition_names_it():
    """The layout evidence looks at a part of each candidate before the
    whole: on smooth, sparse, random and swapped tensors (and ones a
    swap brings within the 1 % only in part) it names what comparing every
    value names."""
    from layerdiff.analyzer.compare import metrics as M
    from layerdiff.analyzer.diagnose.evidence import layout_match

    rng = np.random.default_rng(7)
    yy, xx = np.meshgrid(np.linspace(0, 1, 24), np.linspace(0, 1, 24), indexing="ij")
    smooth = np.broadcast_to((np.sin(3 * yy) + xx)[None, None], (1, 8, 24, 24)).astype(np.float32)
    relu = np.maximum(rng.standard_normal((1, 16, 12, 12)), 0).astype(np.float32)
    cases = []
    for ref in (smooth, relu, rng.standard_normal((2, 6, 6, 6)).astype(np.float32)):
        noise = rng.standard_normal(ref.shape).astype(np.float32) * np.float32(0.008 * np.sqrt(np.mean(ref ** 2)))
        cases += [(ref, ref + np.float32(0.5)), (ref, np.ascontiguousarray(np.swapaxes(ref, 2, 3))),
                  (ref, np.ascontiguousarray(np.swapaxes(ref, 2, 3)) + noise)]      # a swap, rounded
        # a swap whose first values are off by a tenth of the RMS: the part
        # looked at first is no reason to rule it out
        off = np.ascontiguousarray(np.swapaxes(ref, 2, 3))
        off.reshape(-1)[:ref.size // 32] += np.float32(0.1 * np.sqrt(np.mean(ref ** 2)))
        cases += [(ref, off),
                  (ref, np.ascontiguousarray(ref.transpose(0, 2, 3, 1)).reshape(ref.shape))]
        # swapped only in the tensor's last part: its first parts rule nothing out
        part = ref.copy()
        part[-1:] = np.swapaxes(ref, 2, 3)[-1:] if ref.shape[2] == ref.shape[3] else ref[-1:] * 3
        cases.append((ref, part))
    named = 0
    for ref, dev in cases:
        want = _layout_by_definition(ref, dev)
        assert layout_match(ref, dev, M.compare(ref, dev)) == want
        assert layout_match(ref, dev) == want
        named += bool(want)
    assert named >= 12       # the swaps and NHWC reads are named, not only the misses
