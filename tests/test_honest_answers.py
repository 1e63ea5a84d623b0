"""Right answers, or a clear refusal: each way the tool used to answer
"every node within tolerance" after comparing nothing, to exit 0 with
failing nodes, or to let NaN pass, run as a user runs it (the command line,
real services), with the exit status asserted: 0 pass, 1 failing nodes,
2 bad input, 3 too little compared to answer."""
from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys

import numpy as np
import onnx
import pytest
from conftest import small_cnn
from onnx import TensorProto, helper
from onnxbuild import opset17
from test_ascend import overflow_files, overflowing_model  # noqa: F401  (a fixture)

from layerdiff.client.api import run
from layerdiff.collector.dumps.directory import write_dump
from layerdiff.collector.live.onnxrt import LiveRunner

NODES = ["conv1", "relu1", "conv2", "relu2", "residual/add", "conv3", "pool", "flatten", "fc"]


def cli(*args, services=None, env=None, timeout=300):
    """``layerdiff run`` as a user types it; warnings are errors, so that
    one reaching the terminal fails the job and the test."""
    extra = []
    if services is not None:
        collector, analyzer = services
        extra = ["--analyzer", analyzer.address, "--collector", collector.address]
    env = dict(os.environ, PYTHONWARNINGS="error::RuntimeWarning", **(env or {}))
    return subprocess.run([sys.executable, "-m", "layerdiff.client.cli", "run", *map(str, args), *extra,
                           "--no-progress"], capture_output=True, text=True, timeout=timeout, env=env)


def _summary(out):
    return json.loads((out / "summary.json").read_text())


def renamed(model: onnx.ModelProto, suffix: str = "_npu") -> onnx.ModelProto:
    """The same network as a converter renames it: every node and every
    intermediate tensor carries a suffix."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    computed = {o for n in m.graph.node for o in n.output} - {o.name for o in m.graph.output}
    for n in m.graph.node:
        n.name += suffix
        n.input[:] = [t + suffix if t in computed else t for t in n.input]
        n.output[:] = [t + suffix if t in computed else t for t in n.output]
    return m


@pytest.fixture
def renamed_files(cnn_files, tmp_path):
    model, inputs, _ = cnn_files
    dev = tmp_path / "renamed.onnx"
    onnx.save_model(renamed(small_cnn()), str(dev))
    return model, inputs, dev


def test_failing_nodes_exit_1(services, cnn_files, tmp_path):
    model, inputs, device = cnn_files
    res = cli(model, "--inputs", inputs, "--device-model", device, "--out", tmp_path / "out", services=services)
    assert res.returncode == 1, res.stderr
    assert res.stdout.startswith("VERDICT: Computation error at conv2")
    assert re.fullmatch(r"layerdiff: job [0-9a-f]{16} on analyzer \S+ \(reattach: layerdiff watch [0-9a-f]{16} "
                        r"--analyzer \S+\)\n", res.stderr), res.stderr   # the job id, nothing else
    assert _summary(tmp_path / "out")["outcome"]["status"] == "fail"


def test_agreement_exits_0_and_says_what_it_compared(services, cnn_files, tmp_path):
    model, inputs, _ = cnn_files
    res = cli(model, "--inputs", inputs, "--out", tmp_path / "out", services=services)
    assert res.returncode == 0, res.stderr
    assert "COVERAGE: 9 of 9 reference tensors compared (100.0 %)" in res.stdout
    cov = _summary(tmp_path / "out")["coverage"]
    assert (cov["compared"], cov["expected"], cov["adequate"]) == (9, 9, True)


def test_renamed_device_model_is_aligned_by_its_graph(services, renamed_files, tmp_path):
    """Every node and tensor renamed by a converter: the two graphs pair
    every tensor, and alignment.csv says how."""
    model, inputs, dev = renamed_files
    res = cli(model, "--inputs", inputs, "--device-model", dev, "--out", tmp_path / "out", services=services)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "COVERAGE: 9 of 9 reference tensors compared (100.0 %)" in res.stdout
    with open(tmp_path / "out" / "alignment.csv", newline="", encoding="utf-8") as f:
        rows = {r["reference_tensor"]: r for r in csv.DictReader(f)}
    for t in ("conv1_out", "relu1_out", "conv2_out", "add_out", "pool_out"):
        assert rows[t]["device_tensor"] == f"{t}_npu" and rows[t]["method"] == "graph", rows[t]
    assert rows["logits"]["device_tensor"] == "logits"


def test_map_node_dict_keyed_by_device_node_names(services, renamed_files, tmp_path):
    """The mapping names the device's nodes, whose tensors are named apart:
    every node is paired; an entry no device tensor met is reported."""
    model, inputs, dev = renamed_files
    mapping = {n: f"{n}_npu" for n in NODES if n != "fc"}
    mapping["conv3"] = "conv3_typo"
    res = cli(model, "--inputs", inputs, "--device-model", dev, "--out", tmp_path / "out",
              "--map-node-dict", json.dumps(mapping), "--exclude-node-list", "pool,no_such_node", services=services)
    assert res.returncode == 0, res.stdout + res.stderr
    s = _summary(tmp_path / "out")
    # conv3 is missing (its mapping is wrong), pool is excluded: 7 of the 8 expected
    assert s["coverage"]["compared"] == 7 and s["coverage"]["expected"] == 8
    assert s["coverage"]["map_node_dict_unused"] == [{"reference": "conv3", "device": "conv3_typo"}]
    assert s["coverage"]["exclude_node_list_unknown"] == ["no_such_node"]
    assert "'conv3' -> 'conv3_typo'" in res.stdout and "'no_such_node'" in res.stdout
    log = (tmp_path / "out" / "options_unmatched.log").read_text()
    assert "conv3_typo" in log and "no_such_node" in log


def test_empty_device_model_is_bad_input(services, cnn_files, tmp_path):
    model, inputs, _ = cnn_files
    empty = tmp_path / "device.onnx"
    empty.write_bytes(b"")
    res = cli(model, "--inputs", inputs, "--device-model", empty, "--out", tmp_path / "out", services=services)
    assert res.returncode == 2
    assert res.stdout == "" and "device.onnx" in res.stderr and "empty" in res.stderr
    assert "Traceback" not in res.stderr


def _dump(cnn_files, tmp_path, fmt="npy"):
    model, inputs, device = cnn_files
    feeds = dict(np.load(inputs))
    return write_dump(tmp_path / f"dump-{fmt}", list(LiveRunner(model.read_bytes(), feeds).records()), fmt=fmt)


def test_empty_dump_directory(services, cnn_files, tmp_path):
    model, inputs, _ = cnn_files
    (tmp_path / "empty").mkdir()
    res = cli(model, "--inputs", inputs, "--dump", tmp_path / "empty", "--out", tmp_path / "out", services=services)
    assert res.returncode == 3
    assert res.stdout.startswith("NO ANSWER: only 0 of 9") and "sent no tensors" in res.stdout


def test_unreadable_dump(services, cnn_files, tmp_path):
    model, inputs, _ = cnn_files
    dump = _dump(cnn_files, tmp_path)
    for f in dump.glob("*.npy"):
        f.write_bytes(b"\x93NUMPY garbage")
    res = cli(model, "--inputs", inputs, "--dump", dump, "--out", tmp_path / "out", services=services)
    assert res.returncode == 3
    assert "9 of 9 device entries could not be read" in res.stdout.splitlines()[0]


def test_wrong_dump_format(services, cnn_files, tmp_path):
    model, inputs, _ = cnn_files
    dump = _dump(cnn_files, tmp_path)
    res = cli(model, "--inputs", inputs, "--dump", dump, "--dump-format", "onnx", "--out", tmp_path / "out",
              services=services)
    assert res.returncode == 3
    assert "could not be read" in res.stdout and "--dump-format" in res.stdout.splitlines()[0]


def test_dump_of_another_model(services, cnn_files, tmp_path):
    model, inputs, _ = cnn_files
    feeds = {"input": np.ones((1, 3, 8, 8), np.float32)}
    other = overflowing_model().SerializeToString()
    dump = write_dump(tmp_path / "other", list(LiveRunner(other, feeds).records()))
    res = cli(model, "--inputs", inputs, "--dump", dump, "--out", tmp_path / "out", services=services)
    assert res.returncode == 3
    assert "another model" in res.stdout.splitlines()[0]


def test_min_coverage_accepts_a_partial_dump(services, cnn_files, tmp_path):
    """A dump of three layers (a dump_list) is a partial answer the user
    can accept explicitly."""
    model, inputs, _ = cnn_files
    feeds = dict(np.load(inputs))
    recs = [r for r in LiveRunner(model.read_bytes(), feeds).records() if r.node in ("conv1", "conv2", "fc")]
    dump = write_dump(tmp_path / "partial", recs)
    res = cli(model, "--inputs", inputs, "--dump", dump, "--out", tmp_path / "a", services=services)
    assert res.returncode == 3 and "3 of 9" in res.stdout and "not dumped" in res.stdout.splitlines()[0]
    res = cli(model, "--inputs", inputs, "--dump", dump, "--out", tmp_path / "b", "--min-coverage", "0.3",
              services=services)
    assert res.returncode == 0, res.stdout
    assert "COVERAGE: 3 of 9 reference tensors compared (33.3 %)" in res.stdout


def test_python_api_gives_the_same_outcome(services, renamed_files, tmp_path):
    model, inputs, dev = renamed_files
    collector, analyzer = services
    res = run(model, inputs, device_model=dev, out=tmp_path / "out", analyzer=analyzer.address,
              collector=collector.address, progress=False)
    assert (res.outcome, res.exit_status) == ("pass", 0)
    res = run(model, inputs, device_model=small_cnn(bug_in="conv2").SerializeToString(), out=tmp_path / "bug",
              analyzer=analyzer.address, collector=collector.address, progress=False)
    assert (res.outcome, res.exit_status, res.first_failing_node) == ("fail", 1, "conv2")


def _nan_where_zero_model() -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """relu(x) on the reference; the device writes NaN where relu gives 0
    (sqrt of a negative) and is exact elsewhere."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])
    ref = helper.make_graph([helper.make_node("Relu", ["x"], ["r"], name="act"),
                             helper.make_node("Identity", ["r"], ["y"], name="out")], "ref", [x], [y])
    # device: act = relu(x) + sqrt(min(x, 0)) * 0 -> NaN where x < 0, relu(x) where x >= 0
    dev = helper.make_graph([
        helper.make_node("Relu", ["x"], ["pos"], name="pos"),
        helper.make_node("Min", ["x", "zero"], ["neg"], name="neg"),
        helper.make_node("Sqrt", ["neg"], ["root"], name="root"),
        helper.make_node("Mul", ["root", "zero"], ["nan0"], name="nan0"),
        helper.make_node("Add", ["pos", "nan0"], ["r"], name="act"),
        helper.make_node("Identity", ["r"], ["y"], name="out")], "dev", [x], [y],
        initializer=[onnx.numpy_helper.from_array(np.zeros((), np.float32), "zero")])
    models = []
    for g in (ref, dev):
        m = opset17(g)
        models.append(m)
    return models[0], models[1]


def test_device_nan_where_the_reference_is_zero_fails(services, tmp_path):
    ref, dev = _nan_where_zero_model()
    onnx.save_model(ref, str(tmp_path / "ref.onnx"))
    onnx.save_model(dev, str(tmp_path / "dev.onnx"))
    np.savez(tmp_path / "in.npz", x=np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64))
    res = cli(tmp_path / "ref.onnx", "--inputs", tmp_path / "in.npz", "--device-model", tmp_path / "dev.onnx",
              "--out", tmp_path / "out", services=services)
    assert res.returncode == 1, res.stdout + res.stderr
    s = _summary(tmp_path / "out")
    act = next(n for n in s["nodes"] if n["node"] == "act")
    assert act["passed"] is False and act["errors"] == 32 and act["dev_nan"] == 32
    assert s["first_failing_node"]["node"] == "act"


def test_fp16_overflow_job_prints_no_warning(tmp_path, overflow_files):
    """The embedded default, as `make demo` runs: warnings are errors here,
    and none may surface; the verdict names the overflowing node."""
    model, inputs = overflow_files
    res = cli(model, "--inputs", inputs, "--precision", "fp16", "--out", tmp_path / "out")
    assert res.returncode == 1, res.stdout + res.stderr
    assert re.fullmatch(r"layerdiff: job [0-9a-f]{16}\n", res.stderr), res.stderr   # the job id, no warning
    assert res.stdout.startswith("VERDICT: Computation error at boost (Mul, execution #2), cause: overflow")


def test_a_bad_option_is_one_line_and_exit_2(tmp_path, cnn_files):
    model, inputs, device = cnn_files
    res = cli(model, "--inputs", inputs, "--device-model", device, "--out", tmp_path / "out", "--atol", "nan")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "atol" in res.stderr
