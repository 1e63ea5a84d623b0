"""TensorFlow models as the reference, over real gRPC: a small Keras conv net
with two branches and a residual add, saved as a Keras file, a SavedModel and
a frozen GraphDef, each compared against its mixed_float16 run (a real FP16
execution on TensorFlow); a planted bug in one layer of the device side is
named as the first failing node whatever the format."""
from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import tarfile

import grpc
import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from layerdiff import CUR_NPU_NODENAME_FILENAME, onnx_dump_fmap, tf_dump_fmap  # noqa: E402
from layerdiff.client.analyzer_client import AnalyzerClient  # noqa: E402
from layerdiff.client.api import run  # noqa: E402
from layerdiff.client.cli import main as cli_main  # noqa: E402
from layerdiff.collector.dumps.directory import DumpDirectory, write_dump  # noqa: E402
from layerdiff.collector.live.tf import TFLiveRunner  # noqa: E402
from layerdiff.collector.service import CollectorClient  # noqa: E402
from layerdiff.common.errors import LayerdiffError  # noqa: E402
from layerdiff.common.tf.archive import pack_directory, unpack_archive  # noqa: E402
from layerdiff.v1 import layerdiff_pb2 as pb  # noqa: E402

BUGGY_LAYER = "branch_b"


def tiny_net(policy: str = "float32"):
    """conv1 -> (branch_a 3x3 | branch_b 1x1) -> concat -> mix -> + conv1 -> relu -> pool -> fc."""
    from keras import layers

    inp = keras.Input((32, 32, 3), name="image")
    x = layers.Conv2D(8, 3, padding="same", activation="relu", name="conv1", dtype=policy)(inp)
    a = layers.Conv2D(8, 3, padding="same", name="branch_a", dtype=policy)(x)
    b = layers.Conv2D(8, 1, name="branch_b", dtype=policy)(x)
    c = layers.Concatenate(name="concat", dtype=policy)([a, b])
    c = layers.Conv2D(8, 1, name="mix", dtype=policy)(c)
    r = layers.Add(name="residual", dtype=policy)([c, x])
    r = layers.ReLU(name="relu", dtype=policy)(r)
    p = layers.GlobalAveragePooling2D(name="pool", dtype=policy)(r)
    out = layers.Dense(10, name="fc", dtype=policy)(p)
    return keras.Model(inp, out, name="tiny")


def freeze(model, path) -> None:
    """A TF1-style frozen GraphDef of a Keras model, as users make one."""
    from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2

    fn = tf.function(lambda x: model(x)).get_concrete_function(tf.TensorSpec((None, 32, 32, 3), tf.float32,
                                                                              name="image"))
    path.write_bytes(convert_variables_to_constants_v2(fn).graph.as_graph_def().SerializeToString())


@pytest.fixture(scope="module")
def nets(tmp_path_factory):
    """The FP32 network and its buggy mixed_float16 device twin, in each format."""
    d = tmp_path_factory.mktemp("tf")
    keras.utils.set_random_seed(3)
    ref = tiny_net()
    dev = tiny_net("mixed_float16")
    dev.set_weights(ref.get_weights())
    kernel, bias = dev.get_layer(BUGGY_LAYER).get_weights()
    dev.get_layer(BUGGY_LAYER).set_weights([kernel * 1.6 + 0.05, bias])   # the planted kernel bug
    files = {}
    for tag, model in (("ref", ref), ("dev", dev)):
        model.save(d / f"{tag}.keras")
        model.export(d / f"{tag}_savedmodel", verbose=False)
        freeze(model, d / f"{tag}.pb")
        files[tag] = {"keras": d / f"{tag}.keras", "savedmodel": d / f"{tag}_savedmodel", "pb": d / f"{tag}.pb"}
    x = np.random.default_rng(1).standard_normal((1, 32, 32, 3)).astype(np.float32)
    np.savez(d / "inputs.npz", image=x)
    return {"dir": d, "files": files, "inputs": d / "inputs.npz", "x": x, "model": ref}


def _csv(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("fmt", ["keras", "savedmodel", "pb"])
def test_planted_bug_is_the_first_failing_node_in_every_format(services, nets, fmt, tmp_path):
    collector, analyzer = services
    ref, dev = nets["files"]["ref"][fmt], nets["files"]["dev"][fmt]
    out = tmp_path / "out"
    res = run(ref, nets["inputs"], device_model=dev, out=out, analyzer=analyzer.address,
              collector=collector.address, progress=False, dump_mode="all")
    first = res.summary["first_failing_node"]
    # The scope names the layer: TensorFlow's own op name, as every format spells it.
    assert res.first_failing_node == f"tiny_1/{BUGGY_LAYER}_1/convolution", res.summary["failing_nodes"]
    assert first["op_type"] == "Conv2D"
    # The op re-run alone on the device's own inputs still disagrees, and the
    # weight it reads differs on the device: a kernel bug, named as such.
    headline = res.summary["diagnosis"]["headline"]
    assert headline.startswith(f"Computation error at tiny_1/{BUGGY_LAYER}_1/convolution (Conv2D"), headline
    assert headline.endswith("cause: weight"), headline
    rows = _csv(out / "cpu_vs_npu.csv")
    by = {r["node"]: r for r in rows}
    # everything before the bug agrees within FP16 rounding, the other branch included
    for name in ("tiny_1/conv1_1/convolution", "tiny_1/conv1_1/Relu", "tiny_1/branch_a_1/BiasAdd"):
        assert by[name]["result"] == "pass", name
        assert 0 < float(by[name]["max_abs_diff"]) < 0.01, name     # FP16 rounding: a real FP16 run
    assert [r["node"] for r in rows][0] == "tiny_1/conv1_1/convolution"
    assert by["tiny_1/fc_1/BiasAdd"]["result"] == "fail"              # the bug reaches the output
    # the mixed-precision casts are device tensors without a reference node
    invalid = (out / "invalid_out_nodename.log").read_text()
    assert "tiny_1/Cast:0: not found in the reference model" in invalid
    assert collector.alive() and analyzer.alive()


@pytest.mark.parametrize("ref_fmt,dev_fmt", [("keras", "pb"), ("savedmodel", "keras")])
def test_a_model_against_another_export_of_it_pairs_every_layer(services, nets, ref_fmt, dev_fmt, tmp_path):
    """A .keras reference against its frozen GraphDef (and a SavedModel against
    a .keras): the TF op names inside each Keras layer pair the two."""
    collector, analyzer = services
    res = run(nets["files"]["ref"][ref_fmt], nets["inputs"], device_model=nets["files"]["dev"][dev_fmt],
              out=tmp_path / "out", analyzer=analyzer.address, collector=collector.address, progress=False)
    cov = res.summary["coverage"]
    assert cov["compared"] >= cov["expected"] - 1, cov["text"]      # a SavedModel adds its output Identity
    assert res.first_failing_node == f"tiny_1/{BUGGY_LAYER}_1/convolution", res.summary["failing_nodes"]


def test_keras_fp16_is_a_mixed_float16_run(services, nets, tmp_path):
    """precision=fp16 on a Keras model: the collector rebuilds it under the
    mixed_float16 policy; FP16 rounding everywhere, no failing node."""
    collector, analyzer = services
    out = tmp_path / "out"
    res = run(nets["files"]["ref"]["keras"], nets["inputs"], precision="fp16", out=out, analyzer=analyzer.address,
              collector=collector.address, progress=False)
    s = res.summary
    assert res.first_failing_node is None
    assert s["precision"] == "fp16" and s["counts"]["compared"] == s["counts"]["reference_tensors"] == 15
    diffs = [n["max_abs_diff"] for n in s["nodes"]]
    assert all(0 < d < 0.02 for d in diffs)
    # the reference is the model itself: its last op is what Keras predicts
    logits = nets["model"](nets["x"]).numpy()
    last = s["nodes"][-1]
    assert last["node"] == "tiny_1/fc_1/BiasAdd"
    assert np.isclose(last["ref_mean"], logits.mean(), atol=1e-6)
    # node order and graph edges as JSON, with the Keras layer of each op
    runtime = json.loads((out / "node_runtime.json").read_text())
    assert [e["order"] for e in runtime] == list(range(len(runtime)))
    assert [e["layer"] for e in runtime[:3]] == ["conv1", "conv1", "conv1"]
    cmap = json.loads((out / "consumer_map.json").read_text())
    assert cmap["image"] == ["tiny_1/conv1_1/convolution"]
    assert sorted(cmap["tiny_1/conv1_1/Relu"]) == ["tiny_1/branch_a_1/convolution", "tiny_1/branch_b_1/convolution",
                                                   "tiny_1/residual_1/Add"]


def test_nchw_device_dump_against_the_nhwc_reference(services, nets, tmp_path):
    """A device that works in NCHW dumps its tensors transposed; the layout is
    detected from the shapes (H == W here) and recorded per node."""
    collector, analyzer = services
    model = nets["files"]["ref"]["keras"]
    records = list(TFLiveRunner(model.read_bytes(), {"image": nets["x"]}, precision="fp16",
                                model_name="ref.keras").records())
    for r in records:
        if r.array is not None and r.array.ndim == 4:
            r.array = np.ascontiguousarray(r.array.transpose(0, 3, 1, 2))
    dump = write_dump(tmp_path / "dump", records)
    out = tmp_path / "out"
    res = run(model, nets["inputs"], dump=str(dump), out=out, analyzer=analyzer.address, collector=collector.address,
              progress=False)
    assert res.first_failing_node is None and res.summary["counts"]["skipped"] == 0
    by = {r["node"]: r for r in _csv(out / "cpu_vs_npu.csv")}
    assert by["tiny_1/conv1_1/convolution"]["note"].startswith("layout: device axes (0, 2, 3, 1) transposed")
    assert by["tiny_1/fc_1/BiasAdd"]["note"] == ""


def test_cli_takes_a_savedmodel_directory_and_a_device_model(services, nets, tmp_path, capsys):
    collector, analyzer = services
    files = nets["files"]
    code = cli_main(["run", str(files["ref"]["savedmodel"]), "--inputs", str(nets["inputs"]), "--device-model",
                     str(files["dev"]["savedmodel"]), "--signature", "serving_default", "--out",
                     str(tmp_path / "out"), "--analyzer", analyzer.address, "--collector", collector.address,
                     "--no-progress"])
    text = capsys.readouterr().out
    assert code == 1   # failing nodes found
    assert text.startswith(f"VERDICT: Computation error at tiny_1/{BUGGY_LAYER}_1/convolution (Conv2D")
    assert f"FIRST FAILING NODE: tiny_1/{BUGGY_LAYER}_1/convolution (Conv2D" in text
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["model"] == "ref_savedmodel.tar"
    assert "ref_savedmodel (SavedModel) on cpu" in text and "savedmodel.tar" not in text   # the directory given


# ------------------------------------------------------------------ bad input

def _npz(**arrays) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _refused(client, services, model: bytes, model_name: str, inputs: bytes, **kw) -> str:
    spec = pb.JobSpec(model_artifact=client.upload(model, model_name), inputs_artifact=client.upload(inputs,
                      "inputs.npz"), collector=services[0].address, model_name=model_name, **kw)
    with pytest.raises(grpc.RpcError) as ei:
        client.submit(spec)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return ei.value.details()


def _graphdef(*extra_nodes) -> bytes:
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (1, 4), name="x")
        tf.identity(x * 2.0, name="y")
    gd = g.as_graph_def()
    for name, op, inputs in extra_nodes:
        n = gd.node.add()
        n.name, n.op = name, op
        n.input.extend(inputs)
    return gd.SerializeToString()


def _tar(members: dict) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for name, spec in members.items():
            info = tarfile.TarInfo(name)
            if spec == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
                t.addfile(info)
            else:
                info.size = len(spec)
                t.addfile(info, io.BytesIO(spec))
    return buf.getvalue()


def test_bad_tensorflow_models_are_refused_by_name_and_services_stay_up(services, nets):
    client = AnalyzerClient(services[1].address)
    x = _npz(image=nets["x"])
    try:
        msg = _refused(client, services, b"this is a text file\n", "model.pb", x)
        assert "'model.pb'" in msg and "is not a TensorFlow GraphDef" in msg

        saved = pack_directory(nets["files"]["ref"]["savedmodel"])
        msg = _refused(client, services, saved, "ref_savedmodel.tar", x, signature="classify")
        assert "'ref_savedmodel.tar'" in msg and "no signature 'classify'" in msg and "serving_default" in msg

        msg = _refused(client, services, nets["files"]["ref"]["keras"].read_bytes(), "ref.keras",
                       _npz(images=nets["x"]))
        assert "'images' is not an input of the model" in msg and "['image']" in msg

        msg = _refused(client, services, _graphdef(("custom/op", "LayerdiffNoSuchOp", ["y"])), "custom.pb",
                       _npz(x=np.zeros((1, 4), np.float32)))
        assert "'custom.pb'" in msg and "node 'custom/op'" in msg and "'LayerdiffNoSuchOp' is not registered" in msg

        msg = _refused(client, services, _graphdef(("filename", "Const", []), ("steal", "ReadFile", ["filename"])),
                       "reader.pb", _npz(x=np.zeros((1, 4), np.float32)))
        assert "node 'steal'" in msg and "'ReadFile' reads or writes files" in msg

        msg = _refused(client, services, _tar({"../evil/saved_model.pb": b"x"}), "evil.tar", x)
        assert "'evil.tar'" in msg and "'..' path segment" in msg
        msg = _refused(client, services, _tar({"sm/saved_model.pb": b"x", "sm/link": "symlink"}), "link.tar", x)
        assert "'link.tar'" in msg and "is a link" in msg

        msg = _refused(client, services, _graphdef(), "small.pb", _npz(x=np.zeros((1, 4), np.float64)))
        assert "dtype float64, the model expects float32" in msg

        # a Lambda layer is code: safe_mode refuses to deserialize it
        lam = keras.Sequential([keras.Input((4,)), keras.layers.Lambda(lambda t: t * 2, name="double")])
        path = nets["dir"] / "lambda.keras"
        lam.save(path)
        msg = _refused(client, services, path.read_bytes(), "lambda.keras", _npz(x=np.zeros((1, 4), np.float32)))
        assert "'lambda.keras'" in msg and "safe_mode" in msg

        # fp16 needs a Keras model to rebuild: a frozen graph says what to do instead
        msg = _refused(client, services, _graphdef(), "small.pb", _npz(x=np.zeros((1, 4), np.float32)),
                       precision="fp16")
        assert "'small.pb'" in msg and "mixed-precision export as the device model" in msg

        # live performance data is onnxruntime's profiler: refused up front for a TensorFlow device
        msg = _refused(client, services, nets["files"]["ref"]["keras"].read_bytes(), "ref.keras", x,
                       perf=pb.PerfOptions(mode=pb.PERF_MODE_BOTH))
        assert "'ref.keras'" in msg and "onnxruntime's profiler" in msg and "'perf'" in msg
    finally:
        client.close()
    assert services[0].alive() and services[1].alive()
    assert CollectorClient(services[0].address).health().status == "SERVING"


def test_a_failing_tensorflow_run_names_the_model_file():
    """A run that fails (here a numerics check on a NaN input) names the
    model's file, not one of the graph's ops."""
    from layerdiff.common.tf.load import load_tf_model

    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (1, 4), name="x")
        y = tf.debugging.check_numerics(x * 2.0, "NaN in")
        tf.identity(y + 1.0, name="out")
    graph = load_tf_model(g.as_graph_def().SerializeToString(), "checked.pb")
    with pytest.raises(LayerdiffError) as ei:
        graph.run({"x": np.full((1, 4), np.nan, np.float32)})
    assert "'checked.pb'" in str(ei.value) and "run failed" in str(ei.value), str(ei.value)


def test_archives_unpack_only_inside_their_directory(tmp_path):
    for members, needle in [({"/abs/saved_model.pb": b"x"}, "absolute path"),
                            ({"a/../../saved_model.pb": b"x"}, "'..' path segment"),
                            ({"saved_model.pb": b"x", "l": "symlink"}, "is a link")]:
        with pytest.raises(LayerdiffError) as ei:
            unpack_archive(_tar(members), tmp_path / "u", "m.tar")
        assert needle in str(ei.value) and "'m.tar'" in str(ei.value)
    with pytest.raises(LayerdiffError) as ei:
        unpack_archive(_tar({"saved_model.pb": b"x" * 5000}), tmp_path / "big", "big.tar", max_bytes=4096)
    assert "more than 4096 bytes" in str(ei.value)
    assert not (tmp_path.parent / "abs").exists() and not (tmp_path / "saved_model.pb").exists()


# ------------------------------------------------------------------ seed API

def _tf1_graph(tmp_path):
    """A TF1 graph as the seed's users have them: placeholders, a conv with
    frozen weights, and a v1 cond whose untaken branch has no value."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (1, 8, 8, 3), name="input_tensor")
        w = tf.constant(np.random.default_rng(0).standard_normal((3, 3, 3, 4)).astype(np.float32), name="w")
        y = tf.nn.relu(tf.nn.conv2d(x, w, 1, "SAME", name="conv/Conv2D"), name="conv/Relu")
        tf.compat.v1.disable_control_flow_v2()
        z = tf.compat.v1.cond(tf.reduce_mean(y) > -1.0, lambda: y * 2.0, lambda: y - 1.0, name="gate")
        tf.reduce_sum(z, axis=[1, 2], name="out")
        tf.compat.v1.enable_control_flow_v2()
    path = tmp_path / "tf1.pb"
    path.write_bytes(g.as_graph_def().SerializeToString())
    return path, g.as_graph_def()


def test_tf_dump_fmap_with_the_seed_parameters(tmp_path, monkeypatch):
    path, graph_def = _tf1_graph(tmp_path)
    x = np.random.default_rng(2).standard_normal((1, 8, 8, 3)).astype(np.float32)
    monkeypatch.setenv("DUMP_MEMORY_PATH", str(tmp_path / "dump"))
    with tf.Graph().as_default():
        input_maps = {"input_tensor": tf.compat.v1.placeholder(tf.float32, (1, 8, 8, 3), name="input_tensor")}
    feed_dicts = {"input_tensor:0": x}
    (tmp_path / "dump" / "result").mkdir(parents=True)
    (tmp_path / "dump" / "result" / CUR_NPU_NODENAME_FILENAME).write_text("conv_Relu\nout\nnot_in_the_model\n")
    out = tf_dump_fmap(str(path), input_maps, feed_dicts, CUR_NPU_NODENAME_FILENAME,
                       str(tmp_path / "dump" / "result" / "consumer_map_dict.file"), dump_shape_flag=True)
    assert out == tmp_path / "dump" / "cpu"
    manifest = json.loads((out / "manifest.json").read_text())
    assert [(n["name"], n["file"]) for n in manifest["nodes"]] == [("conv/Relu:0", "conv_Relu_1x8x8x4.npy"),
                                                                    ("out:0", "out_1x4.npy")]
    relu = np.load(out / "conv_Relu_1x8x8x4.npy")
    expect = tf.nn.relu(tf.nn.conv2d(x, graph_def_weight(graph_def), 1, "SAME")).numpy()
    assert np.allclose(relu, expect, atol=1e-5)
    assert np.allclose(np.load(out / "out_1x4.npy"), (expect * 2).sum(axis=(1, 2)), rtol=1e-5)
    # JSON, not pickle: the graph's edges and the node order
    result = tmp_path / "dump" / "result"
    cmap = json.loads((result / "consumer_map_dict.file").read_text())
    assert "conv/Conv2D" in cmap["input_tensor"] and cmap["conv/Conv2D"] == ["conv/Relu"]
    order = [e["node"] for e in json.loads((result / "node_runtime.json").read_text())]
    assert order.index("conv/Conv2D") < order.index("conv/Relu") < order.index("out")
    # every node, read back by layerdiff's own dump reader; the untaken branch has no value
    every = tf_dump_fmap(str(path), input_maps, feed_dicts, None, str(result / "all.json"), graph_def=graph_def,
                         out_dir=tmp_path / "every")
    names = [r.name for r in DumpDirectory(str(every)).records()]
    assert names[:2] == ["conv/Conv2D:0", "conv/Relu:0"] and "out:0" in names
    assert "gate/mul:0" in names and "gate/sub:0" not in names
    with pytest.raises(LayerdiffError) as ei:
        tf_dump_fmap(str(path), {"input_tensor": (1, 8, 8, 3)}, {"image:0": x}, None, str(tmp_path / "c.json"))
    assert "'image:0'" in str(ei.value) and "feed_dict" in str(ei.value)


def graph_def_weight(graph_def):
    node = next(n for n in graph_def.node if n.name == "w")
    return tf.make_ndarray(node.attr["value"].tensor)


def test_onnx_dump_fmap_with_the_seed_parameters(tmp_path, cnn_files):
    model, inputs, _ = cnn_files
    x = dict(np.load(inputs))
    out = onnx_dump_fmap(str(model), x, None, str(tmp_path / "result" / "consumer_map_dict.file"),
                         out_dir=tmp_path / "cpu")
    files = {n["name"]: n["file"] for n in json.loads((out / "manifest.json").read_text())["nodes"]}
    assert files["add_out"] == "residual_add.npy" and files["logits"] == "fc.npy"
    cmap = json.loads((tmp_path / "result" / "consumer_map_dict.file").read_text())
    assert cmap["relu1"] == ["conv2", "residual/add"]
    assert [e["node"] for e in json.loads((tmp_path / "result" / "node_runtime.json").read_text())][:2] == \
        ["conv1", "relu1"]


def test_tensorflow_is_imported_only_for_tensorflow_models():
    code = ("import sys\n"
            "import layerdiff, layerdiff.client.api, layerdiff.client.fmap, layerdiff.common.tf.graph\n"
            "import layerdiff.collector.service, layerdiff.collector.live.tf\n"
            "import layerdiff.analyzer.jobs.runner, layerdiff.analyzer.reference.tf\n"
            "assert 'tensorflow' not in sys.modules and 'keras' not in sys.modules, 'imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
