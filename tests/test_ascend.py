"""Ascend runtime dumps: vendor-named files in the runtime's own format
(length-prefixed DumpData header, then the tensor bytes), written from a live
FP16 run as an acl.json asks, read back through the collector, overflow
records decoded and carried into the report."""
from __future__ import annotations

import csv
import json
import struct
import subprocess
import sys

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from onnxbuild import opset17

from layerdiff.client.api import run
from layerdiff.collector.dumps import ascend, overflow
from layerdiff.collector.dumps.config import DumpConfig
from layerdiff.collector.dumps.directory import DumpDirectory
from layerdiff.common.errors import LayerdiffError
from layerdiff.vendor import ascend_dump_pb2 as dd

# The record printed in the vendor's overflow guide.
SEED_AI_CORE = {"model_id": 514, "stream_id": 563, "task_id": 57, "task_type": 0, "pc_start": "0x1008005b0000",
                "para_base": "0x100800297000", "kernel_code": "0x1008005ae000", "block_idx": 1, "status": 32}
ZERO_BLOCK = {"model_id": 0, "stream_id": 0, "task_id": 0, "task_type": 0, "pc_start": "0x0", "para_base": "0x0",
              "status": 0}


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "layerdiff.client.cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def overflowing_model():
    """conv1 -> scale (x600) -> boost (x600) -> relu -> conv2: in FP16 `boost`
    leaves the representable range while its input is still finite."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array((rng.standard_normal((4, 3, 3, 3)) * 0.4).astype(np.float32), "conv1.weight")
    w2 = numpy_helper.from_array((rng.standard_normal((4, 4, 3, 3)) * 0.2).astype(np.float32), "conv2.weight")
    k = numpy_helper.from_array(np.array(600.0, np.float32), "k")
    nodes = [helper.make_node("Conv", ["input", "conv1.weight"], ["conv1_out"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Mul", ["conv1_out", "k"], ["scale_out"], name="scale"),
             helper.make_node("Mul", ["scale_out", "k"], ["boost_out"], name="boost"),
             helper.make_node("Relu", ["boost_out"], ["relu_out"], name="relu"),
             helper.make_node("Conv", ["relu_out", "conv2.weight"], ["output"], name="conv2", pads=[1, 1, 1, 1])]
    graph = helper.make_graph(nodes, "overflowing", [helper.make_tensor_value_info("input", TensorProto.FLOAT,
                                                                                   [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 4, 8, 8])],
                              initializer=[w1, w2, k])
    return opset17(graph)


@pytest.fixture
def overflow_files(tmp_path):
    model = tmp_path / "overflowing.onnx"
    onnx.save_model(overflowing_model(), str(model))
    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, input=(np.random.default_rng(1).random((1, 3, 8, 8)) * 4).astype(np.float32))
    return model, inputs


# ------------------------------------------------------------------ overflow

def test_overflow_record_prints_the_vendor_json_and_its_causes(tmp_path):
    path = tmp_path / "Opdebug.Node_OpDebug.59.1.1597922031178434"
    ascend.write_op_debug_file(path, overflow.encode_classic(SEED_AI_CORE))
    res = _cli("overflow", str(path), "--json")
    assert res.returncode == 0, res.stderr
    rec = json.loads(res.stdout)["records"][0]
    assert rec["record"] == {"DHA Atomic Add": ZERO_BLOCK, "L2 Atomic Add": ZERO_BLOCK, "AI Core": SEED_AI_CORE}
    assert rec["flagged"][0]["causes"] == ["0x00000020: floating-point computation overflowed"]
    text = _cli("overflow", str(path)).stdout
    assert '"kernel_code": "0x1008005ae000"' in text and "stream 563 task 57 status 32 = 0x00000020" in text


def test_status_bits_decode_into_every_documented_cause():
    assert overflow.causes(272) == ["0x00000010: integer add, subtract, multiply or multiply-add overflowed",
                                    "0x00000100: FP32 or INT32 to FP16 conversion overflowed"]
    assert [c[:10] for c in overflow.causes(0x08 | 0x10 | 0x20 | 0x80 | 0x100 | 0x400)] == \
        ["0x00000008", "0x00000010", "0x00000020", "0x00000080", "0x00000100", "0x00000400"]
    assert overflow.causes(0x2) == ["0x00000002: undocumented status bit"]


def test_newer_overflow_layout_with_magic_and_accelerator_record():
    fields = [7, 3, 91, 0, 0, 0, 0x10080000, 0x20000, 5, 2, 0x400, 0, 0, 0]   # version 1: status is 4 words
    payload = struct.pack("<6I", overflow.MAGIC, 1, 1, 0, 0, 8 * len(fields)) + struct.pack(f"<{len(fields)}Q",
                                                                                          *fields)
    rec = overflow.decode(payload)
    assert rec["magic"] == "0x5a5a5a5a" and rec["acc_list"]["acc_type"] == "AIC"
    data = rec["acc_list"]["data"]
    assert data["task_id"] == 91 and data["pc_start"] == "0x10080000" and data["status"] == [0x400, 0, 0, 0]
    assert overflow.flagged_tasks(rec) == [{"unit": "AIC", "stream_id": 3, "task_id": 91, "status": 0x400}]
    with pytest.raises(LayerdiffError, match="data_len"):
        overflow.decode(payload[:40])


# ------------------------------------------------------------------ layouts

def _write_raw(path, tensors):
    """A dump file with hand-made headers: tensors = [(role, dtype code, format, dims, original, bytes)]."""
    header = dd.DumpData(version="2.0", dump_time=1, op_name=path.name.split(".")[1])
    for role, code, fmt, dims, original, raw in tensors:
        t = header.input.add() if role == "input" else header.output.add()
        t.data_type, t.format, t.size = code, fmt, len(raw)
        t.shape.dim.extend(dims)
        if original:
            t.original_shape.dim.extend(original)
    data = header.SerializeToString()
    path.write_bytes(struct.pack("<Q", len(data)) + data + b"".join(t[-1] for t in tensors))
    return path


def test_tiled_device_layouts_are_restored_to_the_original_shape(tmp_path):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 20, 3, 5)).astype(np.float16)                    # NCHW, C not a multiple of 16
    padded = np.zeros((1, 32, 3, 5), np.float16)
    padded[:, :20] = x
    nc1hwc0 = padded.reshape(1, 2, 16, 3, 5).transpose(0, 1, 3, 4, 2)             # N C1 H W C0
    m = rng.standard_normal((2, 20, 33)).astype(np.float32)                      # batch of 20x33 matrices
    mp = np.zeros((2, 32, 48), np.float32)
    mp[:, :20, :33] = m
    nz = mp.reshape(2, 2, 16, 3, 16).transpose(0, 3, 1, 2, 4)                     # batch W1 H1 H0 W0
    bf = rng.standard_normal(6).astype(np.float32)
    bf16 = (bf.view(np.uint32) >> 16).astype(np.uint16)
    path = _write_raw(tmp_path / "Conv.op.1.0.10", [
        ("output", 2, 3, list(nc1hwc0.shape), [1, 20, 3, 5], nc1hwc0.tobytes()),
        ("output", 1, 29, list(nz.shape), [2, 20, 33], np.ascontiguousarray(nz).tobytes()),
        ("output", 27, 2, [6], [], bf16.tobytes()),
        ("output", 2, 4, [2, 16, 16], [], bytes(1024)),                         # FRACTAL_Z: not restored
    ])
    _, got = ascend.read_dump_file(path)
    assert np.array_equal(got[0][2], x) and got[0][2].dtype == np.float16
    assert np.array_equal(got[1][2], m)
    assert np.array_equal(got[2][2], (bf16.astype(np.uint32) << 16).view(np.float32))
    assert isinstance(got[3][2], LayerdiffError) and "FORMAT_FRACTAL_Z is not restored" in str(got[3][2])


def test_broken_vendor_files_are_skipped_with_a_reason(tmp_path):
    leaf = tmp_path / "20261122101010" / "0" / "1" / "0"
    leaf.mkdir(parents=True)
    good = np.arange(12, dtype=np.float32).reshape(3, 4)
    ascend.write_dump_file(leaf / "Relu.good.1.0.100", "good", [], [good])
    ascend.write_dump_file(leaf / "Relu.cut.2.0.101", "cut", [], [good])
    (leaf / "Relu.cut.2.0.101").write_bytes((leaf / "Relu.cut.2.0.101").read_bytes()[:-8])
    (leaf / "Relu.liar.3.0.102").write_bytes(struct.pack("<Q", 10**15) + b"\0" * 64)
    (leaf / "Relu.garbage.4.0.103").write_bytes(struct.pack("<Q", 16) + b"\xff" * 40)
    _write_raw(leaf / "Relu.sizes.5.0.104", [("output", 1, 2, [3, 4], [], bytes(40))])          # 48 declared
    _write_raw(leaf / "Relu.strings.6.0.105", [("output", 13, 2, [2], [], bytes(16))])
    _write_raw(leaf / "Relu.huge.7.0.106", [("output", 1, 2, [10**6, 10**6], [], b"")])
    header = dd.DumpData(op_name="../../etc/passwd")
    header.output.add(data_type=1, format=2, size=4).shape.dim.append(1)
    raw = header.SerializeToString()
    (leaf / "Relu.escape.8.0.107").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(4))
    ascend.write_dump_file(leaf / "Relu.after.9.0.108", "after", [], [good])
    (leaf / "Relu.nothing.10.0.109").write_bytes(struct.pack("<Q", 0))            # an empty header

    recs = {r.name: r for r in DumpDirectory(str(tmp_path)).records()}
    assert recs["good"].status == "ok" and np.array_equal(recs["good"].array, good)
    assert recs["after"].status == "ok"
    reasons = {n: r.message for n, r in recs.items() if r.status != "ok"}
    assert "declares 48 bytes of data, the file holds 40" in reasons["cut"]
    assert "header length 1000000000000000 does not fit" in reasons["liar"]
    assert "not an Ascend DumpData protobuf" in reasons["garbage"]
    assert "is 48 bytes, the header says 40" in reasons["sizes"]
    assert "data type 13 is not a plain numeric type" in reasons["strings"]
    assert "shape [1000000, 1000000]" in reasons["huge"]
    assert "'..' path segment" in reasons["escape"]
    assert "holds no input or output tensor" in reasons["nothing"]
    for name, why in reasons.items():
        assert "0/1/0/Relu." in why, (name, why)        # the file is named


def _valid_file_bytes() -> bytes:
    header = dd.DumpData(version="2.0", dump_time=5, op_name="conv")
    for role in ("input", "output"):
        t = header.input.add() if role == "input" else header.output.add()
        t.data_type, t.format, t.size = 2, 2, 32
        t.shape.dim.extend([4, 4])
    raw = header.SerializeToString()
    return struct.pack("<Q", len(raw)) + raw + bytes(range(64))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(st.binary(max_size=600), st.builds(
    lambda flips, cut: bytes(b ^ flips.get(i, 0) for i, b in enumerate(_valid_file_bytes()))[:cut],
    st.dictionaries(st.integers(0, 140), st.integers(1, 255), max_size=6), st.integers(0, 200))))
def test_random_and_mutated_vendor_files_never_crash(tmp_path, data):
    path = tmp_path / "Conv.conv.1.0.1"
    path.write_bytes(data)
    try:
        _, tensors = ascend.read_dump_file(path, max_bytes=1 << 20)
    except LayerdiffError:
        return
    for _, _, arr in tensors:
        assert isinstance(arr, (np.ndarray, LayerdiffError))
    recs = list(DumpDirectory(str(tmp_path), fmt="ascend").records())
    assert recs and all(r.status in ("ok", "error") for r in recs)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=2100))
def test_random_overflow_payloads_never_crash(payload):
    try:
        rec = overflow.decode(payload)
    except LayerdiffError:
        return
    assert isinstance(overflow.flagged_tasks(rec), list)


# ------------------------------------------------------------------ acl.json

def test_dump_configuration_is_checked_and_selects_layers():
    names = {"resnet", "graph"}
    cfg = DumpConfig.parse(json.dumps({"dump": {"dump_path": "out", "dump_mode": "all", "dump_list": [
        {"model_name": "resnet", "layer": ["conv1", "fc"]}, {"model_name": "other", "layer": ["x"]}]}}), names)
    assert cfg.dump_mode == "all" and cfg.layers == {"conv1", "fc"}
    assert DumpConfig.parse('{"dump": {"dump_path": "o", "dump_list": [{"model_name": "other"}]}}',
                            names).layers == set()
    assert DumpConfig.parse('{"dump": {"dump_path": "o", "dump_list": [{"model_name": "other"}], '
                            '"dump_op_switch": "on"}}', names).layers is None
    only = DumpConfig.parse('{"dump": {"dump_path": "o", "dump_debug": "on"}}', names)
    assert only.overflow_only and only.dump_mode == "all"
    for bad, field in [('{"dump": {"dump_path": "o", "dump_mode": "both"}}', "dump_mode"),
                       ('{"dump": {"dump_path": "o", "dump_op_switch": "yes"}}', "dump_op_switch"),
                       ('{"dump": {"dump_path": "o", "dump_paht": "p"}}', "dump_paht"),
                       ('{"dump": {"dump_list": []}}', "dump_path"),
                       ('{"dump": {"dump_path": "o", "dump_list": [{"layer": "conv1"}]}}', "layer"),
                       ('{"dmp": {}}', "dump")]:
        with pytest.raises(LayerdiffError) as ei:
            DumpConfig.parse(bad, names, "acl.json")
        assert "'acl.json'" in str(ei.value) and field in str(ei.value), bad


def test_overflow_only_configuration_dumps_only_the_overflowing_node(overflow_files, tmp_path):
    model, inputs = overflow_files
    (tmp_path / "acl.json").write_text(json.dumps({"dump": {"dump_path": "only", "dump_debug": "on"}}))
    res = _cli("dump", str(model), "--inputs", str(inputs), "--config", "acl.json", "--precision", "fp16",
               cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "overflowing nodes: boost" in res.stdout
    files = sorted(p.name.split(".")[0:2][1] for p in ascend.dump_files(tmp_path / "only"))
    assert files == ["Node_OpDebug", "boost"]


def test_unknown_layer_in_the_configuration_is_named(overflow_files, tmp_path):
    model, inputs = overflow_files
    (tmp_path / "acl.json").write_text(json.dumps({"dump": {"dump_path": "o", "dump_list": [
        {"model_name": "overflowing", "layer": ["conv1", "cnov2"]}]}}))
    res = _cli("dump", str(model), "--inputs", str(inputs), "--config", "acl.json", cwd=tmp_path)
    assert res.returncode == 2 and "cnov2" in res.stderr and "'layer'" in res.stderr


# ------------------------------------------------------------------ end to end

def test_fp16_overflow_dumped_as_the_runtime_would_and_reported(services, overflow_files, tmp_path):
    """acl.json -> live FP16 run -> Ascend dump (inputs and outputs, overflow
    records) -> collector reads it where it lies -> the report names the
    overflowing node, compares each node's inputs, and finds the first
    failing node."""
    collector, analyzer = services
    model, inputs = overflow_files
    (tmp_path / "acl.json").write_text(json.dumps({"dump": {
        "dump_path": "dump", "dump_mode": "all", "dump_op_switch": "off", "dump_debug": "on",
        "dump_list": [{"model_name": "overflowing", "layer": ["conv1", "scale", "boost", "relu", "conv2"]}]}}))
    res = _cli("dump", str(model), "--inputs", str(inputs), "--config", "acl.json", "--precision", "fp16",
               cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    files = ascend.dump_files(tmp_path / "dump")
    leaf = files[0].parent
    assert leaf.relative_to(tmp_path / "dump").parts[1:] == ("0", "1", "0")       # {time}/{device}/{model}/{index}
    names = [ascend.parse_name(p.name) for p in files]
    assert [n.op_name for n in names if not n.is_op_debug] == ["conv1", "scale", "boost", "relu", "conv2"]
    assert all(n.stream_id == 0 and n.timestamp > 0 for n in names)

    scan = json.loads(_cli("overflow", str(tmp_path / "dump"), "--json").stdout)
    assert [op.split("/")[-1].split(".")[1] for r in scan["records"] for f in r["flagged"] for op in f["operators"]] \
        == ["boost"]

    out = tmp_path / "out"
    result = run(model, inputs, dump=str(tmp_path / "dump"), dump_mode="all", out=out, analyzer=analyzer.address,
                 collector=collector.address, progress=False)
    s = result.summary
    assert result.first_failing_node == "boost"
    assert [o["node"] for o in s["overflow_nodes"]] == ["boost"]
    assert "floating-point computation overflowed" in s["overflow_nodes"][0]["why"]
    assert "boost: AI Core status 0x20" in (out / "overflow_nodename.log").read_text()
    with open(out / "cpu_vs_npu.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    inputs_rows = [(r["node"], r["tensor"]) for r in rows if r["role"] == "input"]
    # every input of every node, weights and the multiplier constant included
    assert inputs_rows == [("conv1", "input"), ("conv1", "conv1.weight"), ("scale", "conv1_out"), ("scale", "k"),
                           ("boost", "scale_out"), ("boost", "k"), ("relu", "boost_out"), ("conv2", "relu_out"),
                           ("conv2", "conv2.weight")]
    by = {(r["node"], r["role"], r["tensor"]): r for r in rows}
    assert by[("boost", "input", "scale_out")]["result"] == "pass"      # what boost read was right
    assert by[("boost", "output", "boost_out")]["result"] == "fail"     # what it wrote overflowed
    assert by[("boost", "output", "boost_out")]["overflow"].startswith("AI Core status 0x20")
    assert s["counts"]["inputs_compared"] == 9 and s["counts"]["compared"] == 5
    assert "boost_out" not in (out / "compare_skip.log").read_text()


def test_live_capture_streams_node_inputs_when_asked(services, cnn_files, tmp_path):
    collector, analyzer = services
    model, inputs, device = cnn_files
    result = run(model, inputs, device_model=device, dump_mode="all", out=tmp_path / "out",
                 analyzer=analyzer.address, collector=collector.address, progress=False)
    s = result.summary
    assert result.first_failing_node == "conv2"
    # conv2's weight is the planted bug: its input rows show it, what it read does not
    failing_inputs = set(s["failing_inputs"])
    assert "conv2.input.1" in failing_inputs and "conv2.input.0" not in failing_inputs
    assert s["counts"]["inputs_compared"] == 18 and s["parameters"]["dump_mode"] == "all"


def test_hostile_op_names_never_leave_the_dump_directory(tmp_path):
    from layerdiff.collector.dumps.directory import write_dump
    from layerdiff.common.schema import NodeRecord

    arr = np.ones((2, 2), np.float32)
    names = ["../../escape", "a/b\\c d", "nul\x00here", "x" * 400]
    write_dump(tmp_path / "d", [NodeRecord(name=n, node=n, op_type="Relu", array=arr) for n in names], "ascend")
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(written) == 4 and all((tmp_path / "d") in p.parents for p in written)
    recs = {r.name: r for r in DumpDirectory(str(tmp_path / "d")).records()}
    assert recs["a/b\\c d"].status == "ok" and recs["x" * 400].status == "ok"
    bad = [r for r in recs.values() if r.status != "ok"]
    assert len(bad) == 2 and all("'op_name'" in r.message for r in bad)


@pytest.mark.parametrize("name, reference", [("float8_e4m3fn", "float8_e4m3fn"), ("float8_e5m2", "float8_e5m2"),
                                             ("float8_e8m0", "float8_e8m0fnu")])
def test_every_fp8_code_point_decodes_as_the_reference_decoder_does(name, reference):
    """FP8 E4M3FN, E5M2 and the E8M0 block scale, every one of the 256
    codes, bit for bit against ml_dtypes (NaN where it has NaN, Inf where it
    has Inf, signed zeros and subnormals)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from layerdiff.collector.dumps import narrow

    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(getattr(ml_dtypes, reference)).astype(np.float32)
    got = narrow.decode(name, codes)
    assert got.dtype == np.float32
    assert np.array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    assert np.array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32))     # -0.0 is -0.0


def test_an_ascend_dump_of_fp8_tensors_is_read_with_its_type(tmp_path):
    """A runtime dump file whose tensors are FP8 (OutputDataType 35 and 34,
    the vendor proto's numbers) is read exactly, widened to float32, and
    says what the device wrote it in; a COMPLEX32 tensor (32) is refused on
    its own with its type named, and the file's other tensors still read."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 8)).astype(np.float32)
    e4 = x.astype(ml_dtypes.float8_e4m3fn)
    e5 = (x * 100).astype(ml_dtypes.float8_e5m2)
    header = dd.DumpData(version="2.0", dump_time=1, op_name="mm")
    blobs = []
    for code, arr in ((35, e4), (34, e5), (32, e4)):
        t = header.output.add()
        t.data_type, t.format, t.size = code, 2, arr.nbytes
        t.shape.dim.extend(arr.shape)
        blobs.append(arr.view(np.uint8).tobytes())
    raw = header.SerializeToString()
    leaf = tmp_path / "dump"
    leaf.mkdir()
    path = leaf / ascend.file_name("MatMul", "mm", 3, 1, 1_700_000_000_000_000)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))
    recs = {r.name: r for r in DumpDirectory(str(leaf)).records()}
    assert np.array_equal(recs["mm"].array, e4.astype(np.float32)) and recs["mm"].source_dtype == "float8_e4m3fn"
    assert np.array_equal(recs["mm:1"].array, e5.astype(np.float32)) and recs["mm:1"].source_dtype == "float8_e5m2"
    assert recs["mm:2"].array is None and "complex32 (32) is not decoded" in recs["mm:2"].message


def _fused_device_dump(directory, values: dict, with_original: bool):
    """The device's dump of small_cnn as a fusing runtime writes it: conv1
    and relu1 run as one op named after neither, conv2 and relu2 as one op
    named after the conv (its output is relu2's), the rest one op each; each
    output's ``original_op`` names the framework op it stands for."""
    ops = [("Conv2D", "fused_conv1_relu1", "relu1_out", "relu1"), ("Conv2D", "conv2", "relu2_out", "relu2"),
           ("Add", "residual/add", "add_out", "residual/add"), ("Conv2D", "conv3", "conv3_out", "conv3"),
           ("GlobalAveragePool", "pool", "pool_out", "pool"), ("Flatten", "flatten", "flat_out", "flatten"),
           ("MatMulV2", "fc", "logits", "fc")]
    leaf = ascend.leaf_dir(directory)
    leaf.mkdir(parents=True)
    for task, (op_type, name, tensor, original) in enumerate(ops, start=1):
        stamp = 1_700_000_000_000_000 + task
        ascend.write_dump_file(leaf / ascend.file_name(op_type, name, task, 0, stamp), name, [], [values[tensor]],
                               stamp, original_ops=[(original, 0)] if with_original else None)
    return directory


def test_original_op_pairs_a_fused_device_op_with_the_framework_op_it_stands_for(services, tmp_path):
    """The runtime's original_op is alignment evidence: a fused op's output
    pairs with the framework op it names (relu1's, relu2's) whatever the
    device op is called, recorded as such in alignment.csv, and the planted
    bug in conv3 is named. Without it, the device op named 'conv2' (its
    output relu2's) would pair with conv2 by name and be blamed."""
    from conftest import small_cnn

    from layerdiff.analyzer.reference.onnxrt import OnnxReference

    collector, analyzer = services
    x = np.random.default_rng(1).standard_normal((1, 3, 16, 16)).astype(np.float32)
    model, inputs = tmp_path / "model.onnx", tmp_path / "inputs.npz"
    onnx.save_model(small_cnn(), str(model))
    np.savez(inputs, input=x)
    bug = OnnxReference(small_cnn(bug_in="conv3", bug_scale=1.3).SerializeToString())
    values = bug.run({"input": x})
    outcomes = {}
    for with_original in (True, False):
        dump = _fused_device_dump(tmp_path / f"dump_{with_original}", values, with_original)
        out = tmp_path / f"out_{with_original}"
        outcomes[with_original] = run(model, inputs, dump=str(dump), out=out, analyzer=analyzer.address,
                                      collector=collector.address, progress=False)
    r = outcomes[True]
    with open(r.out / "alignment.csv", newline="") as f:
        rows = {row["device_tensor"]: row for row in csv.DictReader(f)}
    assert rows["fused_conv1_relu1"]["reference_tensor"] == "relu1_out"
    assert rows["fused_conv1_relu1"]["method"] == "original_op"
    assert "original_op 'relu1' output 0" in rows["fused_conv1_relu1"]["note"]
    assert rows["conv2"]["reference_tensor"] == "relu2_out" and rows["conv2"]["method"] == "original_op"
    s = r.summary
    assert r.exit_status == 1 and s["first_computation_error"]["node"] == "conv3", s["diagnosis"]["headline"]
    by_node = {n["node"]: n for n in s["nodes"]}
    assert by_node["relu2"]["passed"] and "conv2" not in by_node
    # the same dump without the runtime's word: 'conv2' is taken by its name, and its relu'd values fail there
    s = outcomes[False].summary
    assert {n["node"]: n for n in s["nodes"]}["conv2"]["passed"] is False
