"""Which computation error breaks the output: each node with an error of its
own is re-run into the outputs (its device value put into the FP32
reference). A two-layer MiniLM-like encoder with a -3.4e38 attention mask,
built to FP16 by onnxruntime's converter (which holds the mask at the
FP16 range): the clamped sentinels are no error of the node's, and a bug
planted in layer 2 under the same FP16 noise is the headline."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxbuild import GraphBuilder

from layerdiff.analyzer.compare.tolerances import Tolerances
from layerdiff.analyzer.diagnose.impact import ImpactRunner, InjectedValues
from layerdiff.client.api import run
from layerdiff.collector.live.onnxrt import to_fp16

HIDDEN, HEADS, SEQ = 32, 4, 16
MASK_VALUE = -3.4e38     # torch.finfo(float32).min, as BERT exports write it


def encoder(seed: int = 0, layers: int = 2) -> onnx.ModelProto:
    """Token embeddings in, per-token logits out: an extended attention
    mask ((1 - mask) * -3.4e38), then per layer self-attention (Q, K, V,
    scaled scores + mask, Softmax, context, output projection), a residual
    Add and a LayerNormalization; a classifier head."""
    rng = np.random.default_rng(seed)
    d = HIDDEN // HEADS
    b = GraphBuilder()
    const, node = b.const, b.node

    m = node("Sub", [const("one", 1.0), node("Cast", ["mask"], "mask/cast", to=TensorProto.FLOAT)], "mask/sub")
    m = node("Mul", [m, const("mask_min", MASK_VALUE)], "mask/mul")
    m = node("Unsqueeze", [m, const("mask_axes", [1, 2], np.int64)], "mask/unsqueeze")
    split = const("heads_shape", [1, SEQ, HEADS, d], np.int64)
    merge = const("merge_shape", [1, SEQ, HIDDEN], np.int64)
    x = "x"
    for layer in range(1, layers + 1):
        p = f"l{layer}"
        heads = {}
        for k in "qkv":
            h = node("MatMul", [x, const(f"{p}.{k}.w", rng.standard_normal((HIDDEN, HIDDEN)) / np.sqrt(HIDDEN))],
                     f"{p}/{k}/matmul")
            h = node("Add", [h, const(f"{p}.{k}.b", rng.standard_normal(HIDDEN) * .1)], f"{p}/{k}/add")
            h = node("Reshape", [h, split], f"{p}/{k}/reshape")
            heads[k] = node("Transpose", [h], f"{p}/{k}/transpose", perm=[0, 2, 3, 1] if k == "k" else [0, 2, 1, 3])
        s = node("MatMul", [heads["q"], heads["k"]], f"{p}/scores")
        s = node("Div", [s, const(f"{p}.scale", np.sqrt(d))], f"{p}/scaled")
        s = node("Add", [s, m], f"{p}/masked")
        pr = node("Softmax", [s], f"{p}/softmax", axis=-1)
        c = node("MatMul", [pr, heads["v"]], f"{p}/context")
        c = node("Reshape", [node("Transpose", [c], f"{p}/context/transpose", perm=[0, 2, 1, 3]), merge],
                 f"{p}/context/reshape")
        o = node("MatMul", [c, const(f"{p}.o.w", rng.standard_normal((HIDDEN, HIDDEN)) / np.sqrt(HIDDEN))],
                 f"{p}/o/matmul")
        o = node("Add", [o, const(f"{p}.o.b", rng.standard_normal(HIDDEN) * .1)], f"{p}/o/add")
        r = node("Add", [o, x], f"{p}/residual")
        x = node("LayerNormalization", [r, const(f"{p}.ln.g", rng.uniform(.8, 1.2, HIDDEN)),
                                        const(f"{p}.ln.b", rng.uniform(-.1, .1, HIDDEN))], f"{p}/ln", axis=-1,
                 epsilon=1e-5)
    node("MatMul", [x, const("head.w", rng.standard_normal((HIDDEN, 6)) / np.sqrt(HIDDEN))], "head")
    return b.model("encoder", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, SEQ, HIDDEN]),
                               helper.make_tensor_value_info("mask", TensorProto.INT64, [1, SEQ])],
                   [helper.make_tensor_value_info("head_out", TensorProto.FLOAT, [1, SEQ, 6])])


def scaled(model: onnx.ModelProto, weight: str, factor: float) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for t in m.graph.initializer:
        if t.name == weight:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * np.float32(factor), weight))
    return m


FEEDS = {"x": np.random.default_rng(7).standard_normal((1, SEQ, HIDDEN)).astype(np.float32),
         "mask": np.array([[1] * 11 + [0] * 5], np.int64)}


def _job(services, tmp_path, device_model=None, **kw):
    collector, analyzer = services
    onnx.save_model(encoder(), str(tmp_path / "model.onnx"))
    np.savez(tmp_path / "inputs.npz", **FEEDS)
    if device_model is not None:
        onnx.save_model(device_model, str(tmp_path / "device.onnx"))
        kw["device_model"] = tmp_path / "device.onnx"
    return run(tmp_path / "model.onnx", tmp_path / "inputs.npz", out=tmp_path / "out", analyzer=analyzer.address,
               collector=collector.address, progress=False, **kw).summary


def test_the_mask_clamped_by_the_fp16_converter_is_no_computation_error(services, tmp_path):
    """-3.4e38 does not fit FP16: the converter holds the mask at -65504,
    which the Softmax reads alike. The sentinels are left out of the error
    model's figures; what is left is exact, so the clamp is no error of the
    node's, and the run answers that every node is within its precision."""
    s = _job(services, tmp_path, precision="fp16")
    comp = {v["node"] for v in s["verdicts"] if v["verdict"] == "computation error"}
    assert "mask/mul" not in comp and s["first_computation_error"] is None, s["diagnosis"]["headline"]
    assert not s["benign_computation_errors"]
    assert s["outcome"]["exit_status"] == 0 and s["diagnosis"]["headline"].startswith(
        "Every compared node is within what its precision explains"), s["diagnosis"]["headline"]
    mask = next(v for v in s["verdicts"] if v["node"] == "mask/mul")
    assert mask["verdict"] == "accumulated precision error" and "mask-like reference values" in mask["evidence"][0]
    # the converter's clamp is named from the two models' weights
    weights = _weights_csv(tmp_path / "out")
    assert weights["mask_min"]["relation"] == "clamped" and "-3.4e+38" not in weights["mask_min"]["device_weight"]
    assert weights["l1.q.w"]["relation"] == "rounded"
    assert {w["relation"] for n, w in weights.items() if n != "mask_min"} <= {"rounded", "equal"}


def _weights_csv(out) -> dict[str, dict]:
    import csv

    with open(out / "weights.csv", newline="", encoding="utf-8") as f:
        return {r["reference_weight"]: r for r in csv.DictReader(f)}


def test_a_bug_under_fp16_noise_heads_the_report(services, tmp_path):
    device = to_fp16(scaled(encoder(), "l2.v.w", 1.8))
    s = _job(services, tmp_path, device_model=device)
    first = s["first_computation_error"]
    assert first is not None and first["node"].startswith("l2/v/"), (s["diagnosis"]["headline"], first)
    assert first["impact"]["harmful"] is True
    assert s["diagnosis"]["headline"].startswith(f"Computation error at {first['node']}")
    assert not s["benign_computation_errors"]         # the clamped mask is no error of its node
    assert s["outcome"]["status"] == "fail"
    assert first["cause"] == "weight" and any("l2.v.w different" in e for e in first["evidence"]), first
    weights = _weights_csv(tmp_path / "out")
    assert weights["l2.v.w"]["relation"] == "different" and int(weights["l2.v.w"]["differing"]) > 900


def test_a_variance_beyond_fp16_is_a_weight_cause(services, tmp_path):
    """A BatchNormalization variance of 1e7, which the FP16 converter clamps:
    named at that BatchNormalization, cause weight, without the node's inputs."""
    from test_graphalign import bn_cnn

    collector, analyzer = services
    model = bn_cnn(side=16)
    for t in model.graph.initializer:
        if t.name == "conv2_bn.var":
            t.CopyFrom(numpy_helper.from_array(np.full(8, 1e7, np.float32), t.name))
        if t.name == "conv2_bn.gamma":      # keep the BN's output in a useful range
            t.CopyFrom(numpy_helper.from_array(np.full(8, 3e3, np.float32), t.name))
    onnx.save_model(model, str(tmp_path / "model.onnx"))
    np.savez(tmp_path / "inputs.npz", input=np.random.default_rng(4).standard_normal((1, 3, 16, 16)).astype(np.float32))
    s = run(tmp_path / "model.onnx", tmp_path / "inputs.npz", precision="fp16", out=tmp_path / "out",
            analyzer=analyzer.address, collector=collector.address, progress=False).summary
    first = s["first_computation_error"]
    assert first is not None and first["node"] == "conv2_bn" and first["cause"] == "weight", \
        (s["diagnosis"]["headline"], first)
    assert any("conv2_bn.var clamped" in e for e in first["evidence"])
    assert _weights_csv(tmp_path / "out")["conv2_bn.var"]["relation"] == "clamped"


def test_the_impact_re_run_equals_a_re_run_made_by_hand():
    """The device value put in by hand: the producer replaced by a Constant
    holding it, everything else the reference's."""
    import onnxruntime as ort

    model = encoder()
    value = np.random.default_rng(3).standard_normal((1, HEADS, SEQ, SEQ)).astype(np.float32)
    values = InjectedValues()
    values.keep("l2/softmax_out", value)
    runner = ImpactRunner(model, FEEDS, values, Tolerances().default)
    got = runner.outputs_with("l2/softmax_out", value)
    by_hand = onnx.ModelProto()
    by_hand.CopyFrom(model)
    producer = next(n for n in by_hand.graph.node if n.output[0] == "l2/softmax_out")
    producer.CopyFrom(helper.make_node("Constant", [], ["l2/softmax_out"], value=numpy_helper.from_array(value)))
    want = ort.InferenceSession(by_hand.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, FEEDS)[0]
    np.testing.assert_allclose(got["head_out"], want, rtol=1e-5, atol=1e-6)
    impact = runner.measure("l2/softmax_out")
    assert impact.harmful is True and impact.worst_output == "head_out" and impact.failing_outputs == 1
    # the reference's own value changes nothing
    values.values["l2/softmax_out"] = _reference_value(model, "l2/softmax_out")
    assert runner.measure("l2/softmax_out").harmful is False
    assert runner.runs == 2


def test_one_session_for_several_re_runs_gives_each_re_runs_outputs():
    """Several computation errors re-run on one session (each tensor switched
    in by a Where): the outputs of each, bit for bit, are those of a session
    made for it alone; a value kept after the session was made still goes in."""
    model = encoder()
    rng = np.random.default_rng(4)
    tensors = ["l1/softmax_out", "l1/scores_out", "l2/softmax_out", "l2/ln_out"]
    values = InjectedValues()
    for t in tensors:
        ref = _reference_value(model, t)
        values.keep(t, ref + rng.standard_normal(ref.shape).astype(np.float32) * np.float32(0.05))
    shared = ImpactRunner(model, FEEDS, values, Tolerances().default)
    shared.prepare(tensors)
    assert shared._switched is not None
    alone = ImpactRunner(model, FEEDS, values, Tolerances().default)
    for t in tensors:
        got, want = shared.outputs_with(t, values.values[t]), alone.outputs_with(t, values.values[t])
        assert got.keys() == want.keys()
        for k in got:
            assert got[k].tobytes() == want[k].tobytes(), (t, k)
    values.values["l2/softmax_out"] = _reference_value(model, "l2/softmax_out")
    assert shared.measure("l2/softmax_out").harmful is False


def _reference_value(model: onnx.ModelProto, tensor: str) -> np.ndarray:
    import onnxruntime as ort

    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.graph.output.append(onnx.ValueInfoProto(name=tensor))
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run([tensor], FEEDS)[0]


def test_the_budget_says_what_it_did_not_measure():
    model = encoder()
    values = InjectedValues(cap_bytes=1 << 12)
    values.keep("l1/softmax_out", _reference_value(model, "l1/softmax_out"))      # 4 KiB: kept
    values.keep("l1/scores_out", np.zeros((1, HEADS, SEQ, SEQ), np.float32))       # over the cap: dropped
    runner = ImpactRunner(model, FEEDS, values, Tolerances().default, max_runs=1)
    assert runner.measure("l1/scores_out").note.startswith("its device value was not kept")
    assert runner.measure("l1/softmax_out").harmful is False
    over = runner.measure("l1/softmax_out")
    assert over.harmful is None and "budget of 1 re-runs" in over.note
    assert "not measured" in over.sentence()


@pytest.fixture(autouse=True)
def _quiet_numpy():
    with np.errstate(all="ignore"):
        yield


def test_nan_from_a_negative_epsilon_is_an_invalid_operation_not_an_overflow(services, tmp_path):
    """An FP32 device model whose first LayerNormalization has a negative
    epsilon: NaN from finite inputs. Named there as an invalid operation,
    the attribute named as the cause, and no word of FP16."""
    device = encoder()
    ln = next(n for n in device.graph.node if n.name == "l1/ln")
    next(a for a in ln.attribute if a.name == "epsilon").f = -10.0
    s = _job(services, tmp_path, device_model=device)
    first = s["first_computation_error"]
    assert first["node"] == "l1/ln" and first["cause"] == "invalid operation", (s["diagnosis"]["headline"], first)
    assert any("inputs that were all finite" in e for e in first["evidence"]), first["evidence"]
    assert any("epsilon (attribute) different" in e and "-10" in e for e in first["evidence"]), first["evidence"]
    diagnosis = s["diagnosis"]
    assert "invalid operation" in diagnosis["nan"]["text"] and diagnosis["overflow"] is None
    assert "FP16" not in json_text(s)
    assert _weights_csv(tmp_path / "out")["epsilon (attribute)"]["relation"] == "different"


def json_text(summary: dict) -> str:
    import json

    return json.dumps({k: summary[k] for k in ("diagnosis", "verdicts", "first_computation_error")})


def test_a_softmax_bug_in_layer_2_is_named_over_the_clamped_mask(services, tmp_path):
    """The FP16 build with layer 2's Softmax taken over the wrong axis: the
    answer is that Softmax (a parameter of it differs), not the clamped
    mask that heads the execution order."""
    model = encoder()
    softmax = next(n for n in model.graph.node if n.name == "l2/softmax")
    next(a for a in softmax.attribute if a.name == "axis").i = 2
    s = _job(services, tmp_path, device_model=to_fp16(model))
    first = s["first_computation_error"]
    assert first["node"] == "l2/softmax" and first["cause"] == "parameter", (s["diagnosis"]["headline"], first)
    assert any("axis (attribute) different" in e for e in first["evidence"])
    assert first["impact"]["harmful"] is True
    assert s["diagnosis"]["impact"]["runs"] >= 1 and not s["diagnosis"]["impact"]["not_measured"]
