"""Whole jobs on the builds converters make: a device model optimized by
onnxruntime (EXTENDED, ALL), with BatchNorm folded, with its tensors renamed
to numbers, or a second Keras instance of the architecture. Each answers as
the plain device model does: coverage close to full, 0 failures for an
equivalent build, the planted bug named at the fused node that holds it."""
from __future__ import annotations

import csv

import numpy as np
import onnx
import pytest
from test_graphalign import bn_cnn, fold_bn, ort_optimized, planted_bug, renamed

from layerdiff.client.api import run

SIDE = 16


@pytest.fixture(scope="module")
def cnn_job(tmp_path_factory):
    d = tmp_path_factory.mktemp("aligned")
    model = bn_cnn(side=SIDE)
    onnx.save_model(model, str(d / "model.onnx"))
    np.savez(d / "inputs.npz", input=np.random.default_rng(4).standard_normal((1, 3, SIDE, SIDE)).astype(np.float32))
    return d, model


def _device(kind: str, model: onnx.ModelProto, tmp_path) -> onnx.ModelProto:
    if kind in ("extended", "all"):
        return ort_optimized(model, kind, tmp_path)
    if kind == "folded":
        return fold_bn(model)
    if kind == "numbers":   # every tensor a number, the model's input too: bound by position
        device, names = renamed(model)
        assert names["input"] != "input"
        return device
    raise AssertionError(kind)


def _job(services, d, device: onnx.ModelProto, out):
    collector, analyzer = services
    onnx.save_model(device, str(out.parent / f"{out.name}.onnx"))
    return run(d / "model.onnx", d / "inputs.npz", device_model=out.parent / f"{out.name}.onnx", out=out,
               analyzer=analyzer.address, collector=collector.address, progress=False)


def _alignment(out) -> list[dict]:
    with open(out / "alignment.csv", newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("kind", ["extended", "all", "folded", "numbers"])
def test_an_equivalent_build_answers_pass_with_full_coverage(services, cnn_job, kind, tmp_path):
    d, model = cnn_job
    res = _job(services, d, _device(kind, model, tmp_path), tmp_path / kind)
    cov = res.summary["coverage"]
    assert (res.outcome, res.exit_status) == ("pass", 0), (res.summary["outcome"], cov["text"])
    assert cov["ratio"] >= 0.9, cov["text"]
    rows = _alignment(tmp_path / kind)
    methods = {r["method"] for r in rows}
    if kind != "numbers":     # a fusion or a fold: what it covers is listed, not counted missing
        assert res.summary["counts"]["fused"] >= 1 and "fused into" in methods, methods
    assert not [r for r in rows if r["method"] == "unmatched" and r["device_tensor"] in
                {s["tensor"] for s in res.summary["nodes"]}]


@pytest.mark.parametrize("kind", ["extended", "folded"])
def test_a_planted_bug_in_a_fused_build_is_named_at_its_fused_node(services, cnn_job, kind, tmp_path):
    d, model = cnn_job
    device = _device(kind, planted_bug(model, 1), tmp_path)        # conv2's weights scaled
    res = _job(services, d, device, tmp_path / kind)
    assert res.outcome == "fail"
    first = res.summary["first_computation_error"]
    # the device computes conv2 -> BN (-> Relu) as one node: the reference node compared is the last it covers
    assert first["node"] in ("conv2", "conv2_bn", "relu2"), first
    assert res.summary["first_failing_node"]["node"] == first["node"]
    # the fused group is re-run alone on the device's input: its own error, not an inherited one
    iso = first["isolated"]
    assert iso is not None and iso["errors"] > iso["total"] // 4, first


def test_the_packaged_detector_optimized_by_onnxruntime(services, tmp_path):
    from layerdiff.client.demo import det_input, packaged_model

    collector, analyzer = services
    model = onnx.load(str(packaged_model()))
    np.savez(tmp_path / "page.npz", x=det_input(320, 320))
    device = ort_optimized(model, "extended", tmp_path)
    onnx.save_model(device, str(tmp_path / "device.onnx"))
    res = run(packaged_model(), tmp_path / "page.npz", device_model=tmp_path / "device.onnx", out=tmp_path / "out",
              analyzer=analyzer.address, collector=collector.address, progress=False)
    cov = res.summary["coverage"]
    assert (res.outcome, res.exit_status) == ("pass", 0), (res.summary["outcome"], cov["text"])
    assert cov["ratio"] >= 0.9, cov["text"]


def test_the_packaged_recognizer_with_its_transposes_moved(services, tmp_path):
    """At BASIC onnxruntime moves the attention's Transposes past Slice and
    Squeeze: those tensors are compared in the reference's axis order, and
    the job passes with every computed tensor compared."""
    from layerdiff.client.demo import packaged_model

    collector, analyzer = services
    model = packaged_model("ch_PP-OCRv4_rec_infer.onnx")
    np.savez(tmp_path / "line.npz", x=np.random.default_rng(3).uniform(-1, 1, (1, 3, 48, 160)).astype(np.float32))
    onnx.save_model(ort_optimized(onnx.load(str(model)), "basic", tmp_path), str(tmp_path / "device.onnx"))
    res = run(model, tmp_path / "line.npz", device_model=tmp_path / "device.onnx", out=tmp_path / "out",
              analyzer=analyzer.address, collector=collector.address, progress=False)
    cov = res.summary["coverage"]
    assert (res.outcome, res.exit_status) == ("pass", 0), (res.summary["outcome"], cov["text"])
    assert cov["ratio"] >= 0.97, cov["text"]
    moved = [r for r in _alignment(tmp_path / "out") if "before the Transpose" in r["note"]]
    assert len(moved) >= 4, moved


@pytest.mark.parametrize("named", [True, False])
def test_a_second_keras_instance_pairs_every_layer(services, tmp_path, named):
    """Two instances of one architecture in one session: the model scope is
    numbered apart (functional vs functional_1); the layer names are the
    user's, or Keras numbers them apart too (conv2d vs conv2d_3)."""
    keras = pytest.importorskip("keras")
    from keras import layers

    def net():
        def name(n):
            return n if named else None

        inp = keras.Input((16, 16, 3), name="image")
        x = layers.Conv2D(8, 3, padding="same", activation="relu", name=name("conv_in"))(inp)
        a = layers.Conv2D(8, 3, padding="same", name=name("branch"))(x)
        p = layers.GlobalAveragePooling2D(name=name("pool"))(layers.Add(name=name("residual"))([a, x]))
        return keras.Model(inp, layers.Dense(4, name=name("fc"))(p))

    keras.utils.set_random_seed(5)
    ref, dev = net(), net()
    assert ref.name != dev.name
    dev.set_weights(ref.get_weights())
    branch = [la for la in dev.layers if isinstance(la, layers.Conv2D)][1]
    kernel, bias = branch.get_weights()
    branch.set_weights([kernel * 1.7, bias])
    ref_branch = [la for la in ref.layers if isinstance(la, layers.Conv2D)][1].name
    ref.save(tmp_path / "ref.keras")
    dev.save(tmp_path / "dev.keras")
    np.savez(tmp_path / "in.npz", image=np.random.default_rng(1).standard_normal((1, 16, 16, 3)).astype(np.float32))
    collector, analyzer = services
    res = run(tmp_path / "ref.keras", tmp_path / "in.npz", device_model=tmp_path / "dev.keras", out=tmp_path / "out",
              analyzer=analyzer.address, collector=collector.address, progress=False)
    cov = res.summary["coverage"]
    assert cov["ratio"] == 1.0, cov["text"]
    assert f"/{ref_branch}_" in res.first_failing_node, (ref_branch, res.first_failing_node)
    assert res.first_failing_node.endswith("/convolution")


def test_a_folded_reference_that_kept_the_conv_names_against_the_unfolded_device(services, cnn_job, tmp_path):
    """onnxsim folds BatchNorm into the Conv, which keeps its own output
    name: that reference tensor is the BN's output, and the unfolded device's
    tensor of the same name (the Conv before its BN) must not be compared
    with it."""
    d, model = cnn_job
    bn_input = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "BatchNormalization"}
    reference = fold_bn(model, rename=lambda bn_out: bn_input[bn_out])
    onnx.save_model(reference, str(tmp_path / "folded.onnx"))
    onnx.save_model(model, str(tmp_path / "device.onnx"))
    collector, analyzer = services
    res = run(tmp_path / "folded.onnx", d / "inputs.npz", device_model=tmp_path / "device.onnx", out=tmp_path / "out",
              analyzer=analyzer.address, collector=collector.address, progress=False)
    assert (res.outcome, res.exit_status) == ("pass", 0), (res.summary["outcome"], res.summary["failing_nodes"])
    rows = {r["reference_tensor"]: r for r in _alignment(tmp_path / "out") if r["reference_tensor"]}
    assert rows["conv1_out"]["device_tensor"] == "bn1_out", rows["conv1_out"]
