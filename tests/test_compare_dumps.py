"""`layerdiff compare REFERENCE_DUMP DEVICE_DUMP`: a golden dump as the
reference, no model run. What a user notices: the planted bug named in every
pair of dump formats (with and without a model lending the graph), a clean
FP16 build passing, renamed / partial device dumps, HDF5 calls paired call by
call, the two dumps on two collectors through the command line, PyTorch
captures, node inputs with dump_mode all, and bad reference dumps answered in
one line."""
from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import ServiceProcess, small_cnn
from onnx import TensorProto, numpy_helper

from layerdiff.analyzer.reference.onnxrt import OnnxReference
from layerdiff.client.api import compare
from layerdiff.collector.dumps.directory import FORMATS, write_dump
from layerdiff.common.errors import JobFailed
from layerdiff.common.schema import ROLE_INPUT, NodeRecord

X = np.random.default_rng(1).standard_normal((1, 3, 16, 16)).astype(np.float32)
# small_cnn's node outputs, in execution order
NODES = ["conv1", "relu1", "conv2", "relu2", "residual/add", "conv3", "pool", "flatten", "fc"]
CALL_TIMEOUT = 120


# ------------------------------------------------------------------ helpers

def fp16_build(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model converted to FP16 (weights, input, output): run by
    onnxruntime in FP16, every node computes and stores FP16."""
    for init in model.graph.initializer:
        init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float16), init.name))
    for v in list(model.graph.input) + list(model.graph.output):
        v.type.tensor_type.elem_type = TensorProto.FLOAT16
    return model


def scaled(model: onnx.ModelProto, node: str, factor: float) -> onnx.ModelProto:
    """A kernel bug that scales one conv's output by ``factor`` (its weight
    and bias scaled): a relative error of factor - 1 everywhere."""
    for init in model.graph.initializer:
        if init.name.startswith(node + "."):
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(factor), init.name))
    return model


def records(model: onnx.ModelProto, feed: np.ndarray, inputs: bool = False) -> list[NodeRecord]:
    """Every node output of ``model`` run on ``feed`` (and, with ``inputs``,
    every activation each node read, as role=input records)."""
    ref = OnnxReference(model.SerializeToString())
    vals = ref.run({"input": feed})
    vals["input"] = feed
    out = []
    for s in ref.sites:
        if inputs:
            for k, t in enumerate(ref.node_inputs[s.node]):
                if t in vals:      # activations (weights are not dumped)
                    out.append(NodeRecord(name=f"{s.node}.in{k}", op_type=s.op_type, order=s.order, array=vals[t],
                                          node=s.node, slot=k, role=ROLE_INPUT))
        out.append(NodeRecord(name=s.tensor, op_type=s.op_type, order=s.order, array=vals[s.tensor], node=s.node,
                              slot=s.output_index))
    return out


def golden_records(inputs: bool = False) -> list[NodeRecord]:
    return records(small_cnn(), X, inputs)


def device_records(model: onnx.ModelProto, inputs: bool = False) -> list[NodeRecord]:
    return records(fp16_build(model), X.astype(np.float16), inputs)


def run_compare(services, golden, device, out, **kw):
    """compare() in-process against the session's collector and analyzer.
    A refusal for the per-client job bound (other jobs still ending) is
    retried."""
    collector, analyzer = services
    for attempt in range(20):
        try:
            return compare(str(golden), str(device), out=out, collector=collector.address,
                           analyzer=analyzer.address, progress=False, timeout=CALL_TIMEOUT, **kw)
        except JobFailed as e:
            if "LAYERDIFF_MAX_JOBS_PER_CLIENT" not in str(e) or attempt == 19:
                raise
            time.sleep(0.2)


def first_comp(summary: dict) -> str | None:
    """The node of the first computation error, None when none is named."""
    comp = summary.get("first_computation_error")
    return comp["node"] if comp else None


def headline(summary: dict) -> str:
    return (summary.get("diagnosis") or {}).get("headline") or ""


def node_rows(summary: dict, role: str = "output") -> dict:
    return {n["node"]: n for n in summary["nodes"] if n.get("role", "output") == role}


def cli(*args: str, timeout: float = CALL_TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "layerdiff.client.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


# ------------------------------------------- 1. every format pair, FP16 build

PAIRS = list(itertools.product(FORMATS, FORMATS))


@pytest.fixture(scope="module")
def matrix(services, tmp_path_factory):
    """Every golden format x device format, with and without the model, for
    the FP16 build with conv2's planted bug and for the clean FP16 build:
    144 jobs on the session's services, three at a time."""
    base = tmp_path_factory.mktemp("matrix")
    model = base / "model.onnx"
    onnx.save(small_cnn(), str(model))
    gold, bug = golden_records(), device_records(small_cnn(bug_in="conv2"))
    clean = device_records(small_cnn())
    dumps = {}
    for fmt in FORMATS:
        dumps["gold", fmt] = write_dump(base / f"gold_{fmt}", gold, fmt)
        dumps["bug", fmt] = write_dump(base / f"bug_{fmt}", bug, fmt)
        dumps["clean", fmt] = write_dump(base / f"clean_{fmt}", clean, fmt)
    jobs = [(kind, gf, df, with_model) for kind in ("bug", "clean") for gf, df in PAIRS
            for with_model in (False, True)]

    def one(job):
        kind, gf, df, with_model = job
        try:
            return run_compare(services, dumps["gold", gf], dumps[kind, df],
                               base / "out" / f"{kind}-{gf}-{df}-{'model' if with_model else 'dump'}",
                               model=model if with_model else None, precision="fp16")
        except Exception as e:   # reported by the test of that pair
            return e

    with ThreadPoolExecutor(3) as ex:
        results = dict(zip(jobs, ex.map(one, jobs)))
    return {"results": results, "dumps": dumps, "model": model}


def _result(matrix, kind, gf, df, with_model):
    r = matrix["results"][kind, gf, df, with_model]
    if isinstance(r, BaseException):
        raise AssertionError(f"compare {kind} golden {gf} x device {df} (model: {with_model}) raised: {r!r}")
    return r


@pytest.mark.parametrize("with_model", [False, True], ids=["no-model", "model"])
@pytest.mark.parametrize("gf,df", PAIRS, ids=[f"{g}-{d}" for g, d in PAIRS])
def test_planted_bug_is_named_in_every_format_pair(matrix, gf, df, with_model):
    r = _result(matrix, "bug", gf, df, with_model)
    s = r.summary
    assert r.exit_status == 1, s["outcome"]
    comp = s["first_computation_error"]
    assert first_comp(s) == "conv2", (headline(s), comp)
    assert headline(s).startswith("Computation error at conv2 "), headline(s)
    assert s["first_failing_node"]["node"] == "conv2"
    evidence = " ".join(comp["evidence"])
    if with_model:
        assert "re-run alone on its device inputs" in evidence, evidence
        assert "presumed" not in evidence
    else:
        assert "what it read is presumed from the execution order" in evidence, evidence
    # nothing before the bug fails; everything after it is inherited, never a second cause
    rows = node_rows(s)
    assert rows["conv1"]["passed"] and rows["relu1"]["passed"]
    assert rows["relu2"]["verdict"] == "accumulated precision error"
    assert [n for n, row in rows.items() if row.get("verdict") == "computation error"] == ["conv2"]
    golden = s["reference_dump"]
    assert golden["dump_path"] == str(matrix["dumps"]["gold", gf])
    assert golden["records"] == golden["tensors"] == 9 and golden["duplicates"] == 0
    assert golden["structure"] == ("model" if with_model else "dump")
    assert golden["model"] == ("model.onnx" if with_model else None)
    assert s["dump_path"] == str(matrix["dumps"]["bug", df]) and s["source"] == "dump"
    for f in ("summary.json", "cpu_vs_npu.csv", "report.html", "alignment.csv", "overflow_nodename.log",
              "compare_skip.log", "conv2.csv"):
        assert (r.out / f).is_file(), f
    assert "conv2" in (r.out / "cpu_vs_npu.csv").read_text()


def _pairing_params():
    return [pytest.param(gf, df, with_model, id=f"{gf}-{df}-{'model' if with_model else 'no-model'}")
            for (gf, df), with_model in itertools.product(PAIRS, (False, True))]


@pytest.mark.parametrize("gf,df,with_model", _pairing_params())
def test_every_tensor_pairs_in_every_format_pair(matrix, gf, df, with_model):
    """h5 renames 'residual/add' to 'residual_add', h5 and ascend name
    tensors by their node: each of the 9 golden tensors still finds its
    device tensor, in the buggy build as in the clean one."""
    for kind in ("bug", "clean"):
        s = _result(matrix, kind, gf, df, with_model).summary
        c = s["counts"]
        unpaired = s["coverage"].get("unmatched_examples")
        assert (c["compared"], c["not_dumped"], c["invalid_out"], c["skipped"]) == (9, 0, 0, 0), \
            (kind, c, unpaired, s["coverage"]["text"])


@pytest.mark.parametrize("with_model", [False, True], ids=["no-model", "model"])
@pytest.mark.parametrize("gf,df", PAIRS, ids=[f"{g}-{d}" for g, d in PAIRS])
def test_clean_fp16_build_passes_in_every_format_pair(matrix, gf, df, with_model):
    r = _result(matrix, "clean", gf, df, with_model)
    s = r.summary
    assert r.exit_status == 0, (headline(s), s["outcome"])
    assert s["first_computation_error"] is None and not s["failing_nodes"]
    assert headline(s) == "Every compared node is within tolerance"
    assert s["counts"]["compared"] == 9


def test_clean_fp16_build_with_a_model_names_no_computation_error_under_tight_tolerances(matrix, services,
                                                                                        tmp_path):
    """Tolerances tight enough for FP16 rounding to fail nodes: with the
    model, the isolated re-runs show every node computes faithfully. The
    seed's statistic still lists those nodes; the verdict, the headline and
    the exit status say that FP16 explains them."""
    r = run_compare(services, matrix["dumps"]["gold", "npy"], matrix["dumps"]["clean", "h5"], tmp_path / "out",
                    model=matrix["model"], precision="fp16", atol=1e-3, rtol=1e-2)
    s = r.summary
    assert r.exit_status == 0 and s["failing_nodes"], s["outcome"]
    assert s["first_computation_error"] is None, headline(s)
    assert headline(s).startswith("Every compared node is within what its precision explains"), headline(s)


def test_clean_fp16_build_without_a_model_names_no_computation_error_under_tight_tolerances(matrix, services,
                                                                                           tmp_path):
    r = run_compare(services, matrix["dumps"]["gold", "npy"], matrix["dumps"]["clean", "npy"], tmp_path / "out",
                    precision="fp16", atol=1e-3, rtol=1e-2)
    s = r.summary
    assert r.exit_status == 0 and s["failing_nodes"], s["outcome"]
    comp = s["first_computation_error"]
    assert comp is None, (comp["node"], comp["evidence"])


# ------------------------------------------ 2. renamed, shuffled, partial dumps

@pytest.fixture(scope="module")
def npy_pair(tmp_path_factory):
    base = tmp_path_factory.mktemp("npy_pair")
    return base, write_dump(base / "golden", golden_records(), "npy"), device_records(small_cnn(bug_in="conv2"))


@pytest.mark.parametrize("names,fmt", [("tensor", "npy"), ("node", "ascend"), ("node", "h5")])
def test_converter_prefix_and_shuffled_files_still_pair(services, npy_pair, names, fmt):
    """npu_model/conv2_out (or npu_model/conv2, h5: npu_model_conv2) against
    the golden conv2_out, the device's records in a shuffled order with no
    execution order of their own."""
    base, golden, bug = npy_pair
    renamed = [NodeRecord(name=f"npu_model/{r.name if names == 'tensor' else r.node}", op_type=r.op_type,
                          order=-1, array=r.array) for r in bug]
    random.Random(7).shuffle(renamed)
    device = write_dump(base / f"prefixed_{names}_{fmt}", renamed, fmt)
    r = run_compare(services, golden, device, base / f"out_prefixed_{names}_{fmt}", precision="fp16")
    s = r.summary
    assert r.exit_status == 1
    assert first_comp(s) == "conv2", headline(s)
    c = s["counts"]
    assert (c["compared"], c["invalid_out"], c["not_dumped"]) == (9, 0, 0), s["coverage"]["text"]
    rows = {row["reference_tensor"]: row["device_tensor"] for row in _csv(r.out / "alignment.csv")}
    assert sorted(rows) == sorted(r.name for r in bug), rows
    assert all(d.startswith(("npu_model/", "npu_model_")) for d in rows.values()), rows
    assert rows["conv2_out"] in ("npu_model/conv2_out", "npu_model/conv2", "npu_model_conv2")
    # the golden dump's execution order stands: failing rows in it
    assert [n["node"] for n in s["nodes"] if not n["passed"]] == NODES[2:]


def _csv(path: Path) -> list[dict]:
    import csv

    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_device_dump_missing_half_the_tensors_is_no_answer(services, npy_pair):
    base, golden, bug = npy_pair
    half = write_dump(base / "half", bug[1::2], "npy")          # 4 of 9: relu1, relu2, conv3, flatten
    r = run_compare(services, golden, half, base / "out_half", precision="fp16")
    s = r.summary
    assert r.exit_status == 3 and r.outcome == "no_answer", s["outcome"]
    assert "4 of 9 reference tensors" in s["outcome"]["reason"]
    assert "not dumped by the device" in (r.out / "compare_skip.log").read_text()
    # the user may accept the partial dump: then it is judged, and every
    # failing node read a tensor the device did not dump: no verdict, said so
    r = run_compare(services, golden, half, base / "out_half_accepted", precision="fp16", min_coverage=0.0)
    assert r.exit_status == 3 and "could not be judged" in r.summary["outcome"]["reason"], r.summary["outcome"]
    assert {v["node"] for v in r.summary["verdicts"] if v["verdict"] == "no verdict"} >= {"relu2", "conv3"}
    # 5 of 9 is judged by default, and refused under a stricter bound
    five = write_dump(base / "five", bug[::2], "npy")
    r = run_compare(services, golden, five, base / "out_five", precision="fp16")
    assert r.exit_status == 3 and "could not be judged" in r.summary["outcome"]["reason"]
    r = run_compare(services, golden, five, base / "out_five_strict", precision="fp16", min_coverage=0.6)
    assert r.exit_status == 3 and "5 of 9" in r.summary["outcome"]["reason"]


def test_partial_dump_headline_claims_nothing_it_could_not_judge(services, npy_pair):
    base, golden, bug = npy_pair
    five = write_dump(base / "five_judged", bug[::2], "npy")     # conv1, conv2, add, pool, fc
    s = run_compare(services, golden, five, base / "out_five_judged", precision="fp16").summary
    rows = node_rows(s)
    assert rows["conv2"]["verdict"] == "no verdict", rows["conv2"]     # relu1, what it read, is not dumped
    assert "no node computes wrongly on its own" not in headline(s), headline(s)


# ----------------------------------------------- 3. HDF5: repeated op calls

def _write_h5(directory: Path, calls: list[tuple[str, np.ndarray, np.ndarray]], seqids: list[int]) -> Path:
    """The seed's layout /op/seqid/{input,output}/N, one group per call."""
    import h5py

    directory.mkdir(parents=True)
    with h5py.File(directory / "dump.h5", "w", track_order=True) as f:
        for (op, x, y), seq in zip(calls, seqids):
            g = f.require_group(op).create_group(str(seq))
            g.create_dataset("input/0", data=x)
            g.create_dataset("output/0", data=y)
    return directory


_W = (np.random.default_rng(3).standard_normal((16, 16)) * 0.3).astype(np.float32)
_H0 = np.random.default_rng(4).standard_normal((4, 16)).astype(np.float32)


def _cell_calls(bug_call: int | None = None, dtype=np.float32, with_tanh: bool = False) -> list:
    """A recurrent cell called 3 times (h = tanh(h @ W), one op 'cell'), or
    with_tanh: 'linear' and 'tanh' ops called in turn, 3 times each."""
    calls, h = [], _H0
    for k in range(3):
        w = _W * 1.5 + 0.05 if k == bug_call else _W
        x = h.astype(dtype)
        y = (x @ w.astype(dtype)).astype(dtype)
        if with_tanh:
            z = np.tanh(y.astype(np.float32)).astype(dtype)
            calls += [("linear", x, y), ("tanh", y, z)]
        else:
            z = np.tanh(y.astype(np.float32)).astype(dtype)
            calls.append(("cell", x, z))
        h = z.astype(np.float32)
    return calls


@pytest.mark.parametrize("dump_mode", ["output", "all"])
def test_hdf5_repeated_calls_pair_call_by_call(services, tmp_path, dump_mode):
    golden = _write_h5(tmp_path / "golden", _cell_calls(), [0, 1, 2])
    device = _write_h5(tmp_path / "device", _cell_calls(bug_call=2, dtype=np.float16), [5, 9, 12])
    r = run_compare(services, golden, device, tmp_path / "out", dump_mode=dump_mode, precision="fp16")
    s = r.summary
    assert r.exit_status == 1
    assert first_comp(s) == "cell@2", headline(s)
    assert headline(s).startswith("Computation error at cell@2 ")
    rows = node_rows(s)
    assert rows["cell"]["passed"] and rows["cell@1"]["passed"] and not rows["cell@2"]["passed"]
    pairs = {row["device_tensor"]: row["reference_tensor"] for row in _csv(r.out / "alignment.csv")}
    assert pairs == {"cell": "cell", "cell@1": "cell@1", "cell@2": "cell@2"}
    assert s["counts"]["compared"] == 3 and s["reference_dump"]["tensors"] == 3


# dump_mode output: HDF5 streams op by op (every call of 'linear', then of 'tanh'), so the device's
# input record 'linear@1 (input 0)' asks for the golden 'tanh' before the device's 'tanh' output arrives;
# both must get it (a golden value is handed out once per reader)
@pytest.mark.parametrize("dump_mode", ["output", "all"])
def test_hdf5_interleaved_ops_compare_every_output(services, tmp_path, dump_mode):
    # golden: linear 0, 2, 4 and tanh 1, 3, 5; device: linear 5, 9, 12 and tanh 7, 10, 14
    golden = _write_h5(tmp_path / "golden", _cell_calls(with_tanh=True), [0, 1, 2, 3, 4, 5])
    device = _write_h5(tmp_path / "device", _cell_calls(bug_call=2, dtype=np.float16, with_tanh=True),
                       [5, 7, 9, 10, 12, 14])
    r = run_compare(services, golden, device, tmp_path / "out", dump_mode=dump_mode, precision="fp16")
    s = r.summary
    assert first_comp(s) == "linear@2", headline(s)
    rows = node_rows(s)
    assert sorted(rows) == ["linear", "linear@1", "linear@2", "tanh", "tanh@1", "tanh@2"], \
        (r.out / "compare_skip.log").read_text()
    assert rows["tanh@2"]["verdict"] == "accumulated precision error"
    assert "produced no value" not in (r.out / "compare_skip.log").read_text()
    assert s["counts"]["compared"] == 6, s["counts"]


# ---------------------------------- 4. two collectors, two hosts, the command line

def test_two_collectors_each_reading_its_own_dump_through_the_cli(services, tmp_path):
    host_a, host_b = tmp_path / "host_a", tmp_path / "host_b"
    golden = write_dump(host_a / "dumps" / "golden", golden_records(), "h5")          # e.g. PyTorch on a GPU
    device = write_dump(host_b / "dumps" / "device", device_records(small_cnn(bug_in="conv2")), "ascend")
    # each collector reads only below its own directory tree
    a = ServiceProcess("collector", host_a, env={**os.environ, "LAYERDIFF_DUMP_ROOTS": str(host_a / "dumps")})
    try:
        b = ServiceProcess("collector", host_b, env={**os.environ, "LAYERDIFF_DUMP_ROOTS": str(host_b / "dumps")})
        try:
            analyzer = services[1].address
            out = tmp_path / "out"
            p = cli("compare", str(golden), str(device), "--reference-collector", a.address, "--collector",
                    b.address, "--analyzer", analyzer, "--out", str(out), "--precision", "fp16", "--no-progress")
            assert p.returncode == 1, p.stdout + p.stderr
            lines = p.stdout.splitlines()
            assert lines[0].startswith("VERDICT: Computation error at conv2 "), p.stdout
            assert any(ln.startswith("FIRST COMPUTATION ERROR: conv2 ") for ln in lines), p.stdout
            assert any(ln.startswith("FIRST FAILING NODE: conv2 ") for ln in lines), p.stdout
            assert f"reference: dump {golden} on collector {a.address} (9 tensors" in p.stdout
            assert f"device: dump {device} on collector {b.address}" in p.stdout
            assert lines[-1] == f"reports: {out}"
            assert "Traceback" not in p.stderr
            assert f"on analyzer {analyzer} (reattach: layerdiff watch" in p.stderr
            s = json.loads((out / "summary.json").read_text())
            assert s["reference_dump"]["collector"] == a.address
            assert s["reference_dump"]["dump_path"] == str(golden)
            assert s["collector"] == b.address and s["dump_path"] == str(device)
            assert s["counts"]["compared"] == 9

            # forgetting --reference-collector: the device's collector is asked for the golden dump and
            # refuses a path outside its roots, in one line
            p = cli("compare", str(golden), str(device), "--collector", b.address, "--analyzer", analyzer,
                    "--out", str(tmp_path / "out2"), "--no-progress")
            assert p.returncode == 2, p.stdout + p.stderr
            errors = [ln for ln in p.stderr.splitlines() if ln.startswith("layerdiff: error:")]
            assert len(errors) == 1 and str(golden) in errors[0] and b.address in errors[0], p.stderr
            assert "Traceback" not in p.stderr and p.stdout == ""
        finally:
            b.stop()
    finally:
        a.stop()


# ------------------------------------------------------------- 5. PyTorch

def _torch_net(torch, shared_activation: bool = False):
    from collections import OrderedDict

    torch.manual_seed(0)
    if shared_activation:
        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
                self.act = torch.nn.ReLU()         # called twice: act, act@1
                self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1)
                self.fc = torch.nn.Linear(8, 4)

            def forward(self, x):
                x = self.act(self.conv2(self.act(self.conv(x))))
                return self.fc(x.mean(dim=(2, 3)))
        return Net().eval()
    return torch.nn.Sequential(OrderedDict(
        conv=torch.nn.Conv2d(3, 8, 3, padding=1), relu=torch.nn.ReLU(), conv2=torch.nn.Conv2d(8, 8, 3, padding=1),
        relu2=torch.nn.ReLU(), pool=torch.nn.AdaptiveAvgPool2d(1), flat=torch.nn.Flatten(),
        fc=torch.nn.Linear(8, 4))).eval()


def _capture(torch, model, x, path: Path) -> Path:
    from layerdiff.torch import capture

    path.mkdir(parents=True)
    with capture(model, path / "run.h5"):
        model(x)
    return path


def test_torch_captures_on_two_devices_name_the_perturbed_layer(services, tmp_path):
    torch = pytest.importorskip("torch")
    x = torch.randn(1, 3, 12, 12, generator=torch.Generator().manual_seed(1))
    golden = _capture(torch, _torch_net(torch), x, tmp_path / "cpu_fp32")
    device = _torch_net(torch).to(torch.bfloat16)           # a bfloat16 device ...
    with torch.no_grad():
        device.conv2.weight.mul_(1.5).add_(0.05)            # ... with a kernel bug in conv2
    buggy = _capture(torch, device, x.to(torch.bfloat16), tmp_path / "device_bf16")
    clean = _capture(torch, _torch_net(torch).to(torch.bfloat16), x.to(torch.bfloat16), tmp_path / "clean_bf16")

    r = run_compare(services, golden, buggy, tmp_path / "out")
    s = r.summary
    assert r.exit_status == 1
    assert first_comp(s) == "conv2", headline(s)
    rows = node_rows(s)
    assert rows["conv"]["passed"] and rows["relu"]["passed"]
    assert rows["relu2"]["verdict"] == "accumulated precision error"
    assert s["counts"]["compared"] == 7 and s["reference_dump"]["tensors"] == 7

    r = run_compare(services, golden, clean, tmp_path / "out_clean")
    assert r.exit_status == 0, headline(r.summary)
    assert r.summary["first_computation_error"] is None and r.summary["counts"]["compared"] == 7


# a module called twice ('act', 'act@1'): the HDF5 stream leaves execution order ('act@1 (input 0)',
# conv2's output, comes before conv2's own record); conv2 must still be compared and named
@pytest.mark.parametrize("dump_mode", ["output", "all"])
def test_torch_module_called_twice_still_names_the_perturbed_layer(services, tmp_path, dump_mode):
    torch = pytest.importorskip("torch")
    x = torch.randn(1, 3, 12, 12, generator=torch.Generator().manual_seed(1))
    golden = _capture(torch, _torch_net(torch, shared_activation=True), x, tmp_path / "cpu")
    device = _torch_net(torch, shared_activation=True)
    with torch.no_grad():
        device.conv2.weight.mul_(1.5).add_(0.05)
    buggy = _capture(torch, device, x, tmp_path / "device")
    r = run_compare(services, golden, buggy, tmp_path / "out", dump_mode=dump_mode)
    s = r.summary
    assert first_comp(s) == "conv2", headline(s)
    assert "conv2" in node_rows(s), (r.out / "compare_skip.log").read_text()
    assert s["counts"]["compared"] == 5 and "accumulated" in node_rows(s)["act@1"]["verdict"], s["counts"]


# ------------------------------------------- 6. dump_mode all: node inputs

@pytest.mark.parametrize("fmt", ["npy", "h5"])
def test_dump_mode_all_inputs_agree_output_does_not(services, tmp_path, fmt):
    golden = write_dump(tmp_path / "golden", golden_records(inputs=True), fmt)
    # conv2's kernel scales its output by 1.3: what it reads agrees, what it writes does not
    device = write_dump(tmp_path / "device", device_records(scaled(small_cnn(), "conv2", 1.3), inputs=True), fmt)
    r = run_compare(services, golden, device, tmp_path / "out", dump_mode="all", precision="fp16")
    s = r.summary
    assert r.exit_status == 1
    comp = s["first_computation_error"]
    assert first_comp(s) == "conv2", headline(s)
    # what it read carries FP16 rounding only; its output is 30 % off
    assert any("relative RMS error 0.3 here against" in e and "more than a Conv passes on" in e
               for e in comp["evidence"]), comp["evidence"]
    assert not any("presumed" in e for e in comp["evidence"])
    outputs, inputs = node_rows(s), node_rows(s, "input")
    assert outputs["relu2"]["verdict"] == "accumulated precision error"
    assert outputs["conv3"]["verdict"] == "accumulated precision error"
    # the inputs were found by content: conv2 read relu1's output, which agrees; relu2 read conv2's, which does not
    relu1_out = outputs["relu1"]["tensor"]
    assert inputs["conv2"]["tensor"] == relu1_out and inputs["conv2"]["passed"]
    assert inputs["relu2"]["tensor"] == outputs["conv2"]["tensor"] and not inputs["relu2"]["passed"]
    assert s["counts"]["inputs_compared"] == 10 and s["counts"]["compared"] == 9


# ---------------------------------------------------------- 7. bad input

@pytest.mark.parametrize("content", ["missing", "junk"])
def test_bad_reference_dump_is_one_line_on_the_cli(services, tmp_path, content):
    collector, analyzer = services
    device = write_dump(tmp_path / "device", golden_records(), "npy")
    golden = tmp_path / "golden_dir"
    if content == "junk":
        golden.mkdir()
        (golden / "notes.txt").write_text("not a tensor")
    p = cli("compare", str(golden), str(device), "--collector", collector.address, "--analyzer",
            analyzer.address, "--out", str(tmp_path / "out"), "--no-progress")
    assert p.returncode in (2, 3), p.stdout + p.stderr
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("layerdiff: error:")]
    assert len(errors) == 1 and str(golden) in errors[0], p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""
    assert not (tmp_path / "out" / "summary.json").exists()


def test_missing_reference_dump_is_named_as_the_reference(services, tmp_path):
    device = write_dump(tmp_path / "device", golden_records(), "npy")
    missing = tmp_path / "nowhere"
    with pytest.raises(JobFailed) as e:
        run_compare(services, missing, device, tmp_path / "out")
    text = str(e.value).replace(str(missing), "<path>")
    assert "reference" in text and "dump_path" not in text, text


@pytest.mark.parametrize("content", ["empty", "junk"])
def test_reference_dump_holding_nothing_readable(services, tmp_path, content):
    golden = tmp_path / "golden_dir"
    golden.mkdir()
    if content == "junk":
        (golden / "notes.txt").write_text("not a tensor")
        (golden / "weights.npy").write_bytes(b"\x93NUMPY garbage")
    device = write_dump(tmp_path / "device", golden_records(), "npy")
    with pytest.raises(JobFailed) as e:
        run_compare(services, golden, device, tmp_path / "out")
    assert e.value.exit_status in (2, 3)
    text = str(e.value)
    assert "\n" not in text and f"reference dump {str(golden)!r}" in text and "holds no readable tensor" in text, \
        text


def test_unreadable_golden_record_is_skipped_and_the_job_goes_on(services, tmp_path):
    gold = golden_records()
    for r in gold:
        if r.name == "relu2_out":
            r.overflow = "AI Core overflow (status 0x20)"     # the golden runtime flagged it
    golden = write_dump(tmp_path / "golden", gold, "npy")
    manifest = json.loads((golden / "manifest.json").read_text())
    entry = next(n for n in manifest["nodes"] if n["name"] == "conv3_out")
    (golden / entry["file"]).write_bytes(b"this is no .npy file")
    device = write_dump(tmp_path / "device", device_records(small_cnn(bug_in="conv2")), "npy")
    r = run_compare(services, golden, device, tmp_path / "out", precision="fp16")
    s = r.summary
    assert r.exit_status == 1 and first_comp(s) == "conv2", headline(s)
    skips = (r.out / "compare_skip.log").read_text()
    assert f"conv3_out: the reference dump's record of it is unreadable: file {entry['file']!r}" in skips, skips
    assert s["counts"]["compared"] == 8 and s["counts"]["skipped"] == 1
    assert s["reference_dump"]["records"] == 9 and s["reference_dump"]["tensors"] == 8
    assert {"node": "relu2", "why": "AI Core overflow (status 0x20)", "side": "reference"} in s["overflow_nodes"]
    assert "relu2 (reference dump)" in (r.out / "overflow_nodename.log").read_text()


def test_golden_tensors_named_like_spill_files_keep_their_own_values(tmp_path):
    """Golden tensor names are anything a runtime wrote: names that look
    like the analyzer's own spill keys still read back their own values."""
    from layerdiff.analyzer.reference.dump import DumpReference
    from layerdiff.common.schema import NodeRecord

    ref = DumpReference("golden")
    ref.start(tmp_path / "spill")
    names = ["out1", "in0", "out0", "x"]
    for i, name in enumerate(names):
        ref.take(NodeRecord(name=name, op_type="Relu", order=i, array=np.full(3, float(i), np.float32)))
    ref.take(NodeRecord(name="x", node="x", role="input", slot=0, array=np.full(3, 9.0, np.float32)))
    ref.seal()
    assert [s.tensor for s in ref.sites] == names
    for i, name in enumerate(names):
        assert np.array_equal(ref.value(name), np.full(3, float(i), np.float32)), name
    assert np.array_equal(ref.value(ref.node_inputs["x"][0]), np.full(3, 9.0, np.float32))
    ref.close()
    assert not (tmp_path / "spill").exists()


def test_a_golden_dump_read_in_this_process_is_mapped_where_it_lies(tmp_path):
    """The embedded collector hands the analyzer its records directly: each
    .npy file it maps whole is used where it lies (no copy of a 500 MB
    golden dump written into the spill directory); what it cannot map so (a
    Fortran-ordered file, a tensor received over the wire) is spilled, and
    every value reads back the same either way."""
    from layerdiff.analyzer.reference.dump import DumpReference
    from layerdiff.collector.dumps.directory import DumpDirectory

    gold = tmp_path / "gold"
    gold.mkdir()
    rng = np.random.default_rng(0)
    values = {"a": rng.standard_normal((2, 3, 4)).astype(np.float32), "b": rng.standard_normal(7).astype(np.float16),
              "c": np.asfortranarray(rng.standard_normal((3, 5)).astype(np.float32))}
    for i, (name, v) in enumerate(values.items()):
        np.save(gold / f"{name}.npy", v)
        os.utime(gold / f"{name}.npy", ns=(10**9 * (i + 1),) * 2)
    ref = DumpReference("gold")
    ref.start(tmp_path / "spill")
    for rec in DumpDirectory(str(gold)).records():
        ref.take(rec)
    ref.take(NodeRecord(name="wire", array=np.arange(6, dtype=np.float32)))
    ref.seal()
    spilled = sorted(p.name for p in (tmp_path / "spill").iterdir())
    assert len(spilled) == 2, spilled          # the Fortran-ordered file and the received tensor
    for name, v in values.items():
        assert np.array_equal(ref.value(name), v), name
        assert np.array_equal(ref.value(name), v), name       # read again once the first reading is handed over
    assert np.array_equal(ref.value("wire"), np.arange(6, dtype=np.float32))
    ref.close()
    assert all((gold / f"{n}.npy").exists() for n in values), "the user's files stay"


def test_two_dumps_through_a_collector_of_this_process_answer_as_through_one_of_another(tmp_path):
    """The golden dump read in this process (mapped where it lies) or
    streamed from a collector process: the same comparison, row for row."""
    model = small_cnn()
    feeds = {"input": np.random.default_rng(3).standard_normal((1, 3, 16, 16)).astype(np.float32)}
    ref_vals = OnnxReference(model.SerializeToString()).run(feeds)
    gold, dev = tmp_path / "gold", tmp_path / "dev"
    write_dump(gold, [NodeRecord(name=k, array=v) for k, v in ref_vals.items()])
    write_dump(dev, [NodeRecord(name=k, array=(v * np.float32(1.001) if k.endswith("2") else v))
                     for k, v in ref_vals.items()])
    here = compare(str(gold), str(dev), out=tmp_path / "here", progress=False)
    other = ServiceProcess("collector", tmp_path / "collector")
    try:
        there = compare(str(gold), str(dev), out=tmp_path / "there", progress=False, collector=other.address)
    finally:
        other.stop()
    rows = lambda r: [(n["tensor"], n["errors"], n["cosine"], n["verdict"]) for n in r.summary["nodes"]]  # noqa: E731
    assert rows(here) == rows(there) and len(rows(here)) == len(ref_vals)


def test_reports_fetched_in_this_process_replace_links_in_out_and_never_write_through(tmp_path, npy_pair):
    """An embedded job's reports are linked into --out: a link already
    there under a report's name (to a file elsewhere) is replaced by the
    report, and the file it pointed at stays as it was."""
    base, golden, device = npy_pair
    dev = write_dump(tmp_path / "device", device, "npy")
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text("keep me")
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").symlink_to(elsewhere)
    (out / "cpu_vs_npu.csv").symlink_to(elsewhere)
    r = compare(str(golden), str(dev), out=out, progress=False)
    assert elsewhere.read_text() == "keep me"
    for name in ("summary.json", "cpu_vs_npu.csv"):
        assert not (out / name).is_symlink() and (out / name).stat().st_size > 100, name
    assert r.summary["counts"]["compared"] == 9
    assert {"report.html", "nodes.parquet", "conv2.csv"} <= {p.name for p in out.iterdir()}


def test_a_job_of_this_process_hands_over_its_summary_as_its_summary_json_reads(tmp_path, npy_pair):
    """A job run in the command's own process hands the client its summary
    instead of summary.json being parsed again: the same values, types and
    all (lists, not tuples; NaN and the infinities as the file writes them),
    for a failing comparison with non-finite values on the device."""
    base, golden, device = npy_pair
    broken = []
    for r in device:
        a = np.array(r.array, copy=True)
        if r.name.startswith("relu1"):
            a.reshape(-1)[:3] = [np.nan, np.inf, -np.inf]
        broken.append(NodeRecord(name=r.name, node=r.node, op_type=r.op_type, order=r.order, array=a))
    dev = write_dump(tmp_path / "device", broken, "npy")
    res = compare(str(golden), str(dev), out=tmp_path / "out", progress=False)
    read = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert res.summary == read
    assert res.summary["counts"]["failed"] >= 2 and read["nodes"][0]["shape"] == res.summary["nodes"][0]["shape"]
    assert any(n["dev_nan"] and n["dev_inf"] for n in read["nodes"]), [n["tensor"] for n in read["nodes"]]


def test_two_dumps_compared_without_a_model_never_load_onnx_or_onnxruntime(tmp_path, npy_pair):
    """A tenth of a second of every command's start: a comparison of two
    dumps without a model runs no model, so neither onnx nor onnxruntime
    is loaded (the embedded services check the runtime only when asked);
    the element types written down for that are onnx's own. Nor is gRPC or
    Flight: both dumps are read in this process, and nothing is served. And
    pyarrow (40 ms) is not loaded before the job starts: the Parquet tables
    are the only part that needs it, and they are written all the same."""
    import onnx as onnx_module

    from layerdiff.common import onnxgraph

    for name in ("FLOAT", "UINT8", "INT8", "UINT16", "INT16", "INT32", "INT64", "BOOL", "FLOAT16", "DOUBLE",
                 "UINT32", "UINT64", "BFLOAT16"):
        assert getattr(onnxgraph, name) == getattr(onnx_module.TensorProto, name), name
    base, golden, device = npy_pair
    dev = write_dump(tmp_path / "device", device, "npy")
    script = f"""
import sys
from layerdiff.client.api import compare
import layerdiff.analyzer.local, layerdiff.client.local_client, layerdiff.collector.core, layerdiff.client.cli
before = "pyarrow" in sys.modules
r = compare({str(golden)!r}, {str(dev)!r}, out={str(tmp_path / 'out')!r}, progress=False)
print(r.summary["counts"]["compared"], [m for m in ("onnx", "onnxruntime", "grpc", "pyarrow.flight", "asyncio")
                                        if m in sys.modules], before)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=CALL_TIMEOUT)
    assert out.returncode in (0, 1), out.stderr
    assert out.stdout.split("\n")[-2] == "9 [] False", out.stdout
    assert sorted(p.name for p in (tmp_path / "out").glob("*.parquet")) == \
        ["alignment.parquet", "elements.parquet", "nodes.parquet"]


def test_two_dumps_compared_in_this_process_fail_as_through_served_services(tmp_path, npy_pair, services):
    """The analyzer in the command's own process (no server) answers bad
    input and a job past its timeout with the one-line errors and exit
    statuses of the served one."""
    base, golden, device = npy_pair
    dev = write_dump(tmp_path / "device", device, "npy")
    collector, analyzer = services
    missing = tmp_path / "nowhere"
    answers = []
    for addresses in ({}, {"collector": collector.address, "analyzer": analyzer.address}):
        with pytest.raises(JobFailed) as bad:
            compare(str(golden), str(missing), out=tmp_path / "bad", progress=False, timeout=CALL_TIMEOUT,
                    **addresses)
        answers.append((bad.value.exit_status, str(bad.value).replace(str(missing), "PATH")))
    here, there = answers
    said = "field 'dump_path': dump file or directory 'PATH' does not exist on the collector host"
    assert here[0] == there[0] == 2 and here[1].endswith(said) and there[1].endswith(said), answers
    with pytest.raises(JobFailed) as late:
        compare(str(golden), str(dev), out=tmp_path / "late", progress=False, timeout=1e-9)
    assert late.value.exit_status == 3 and "did not end within" in str(late.value), late.value
    r = compare(str(golden), str(dev), out=tmp_path / "fine", progress=False)
    assert r.exit_status == 1 and r.summary["answer"]["node"] == "conv2", r.summary["answer"]


def test_the_command_pauses_the_cyclic_collector_only_while_its_job_runs(tmp_path, npy_pair, monkeypatch):
    """The command runs one job, which makes next to no reference cycles:
    the cyclic collector is off while it runs, and on again after (a caller
    of main in its own process gets it back)."""
    import gc

    from layerdiff.client import api, cli

    base, golden, device = npy_pair
    dev = write_dump(tmp_path / "device", device, "npy")
    seen = []

    def compare_seen(*args, **kw):
        seen.append(gc.isenabled())
        return compare(*args, **kw)

    monkeypatch.setattr(api, "compare", compare_seen)
    assert gc.isenabled()
    code = cli.main(["compare", str(golden), str(dev), "--out", str(tmp_path / "out"), "--no-progress"])
    assert code == 1 and seen == [False] and gc.isenabled()
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["answer"]["node"] == "conv2"
