"""Dumps without names or a graph: device tensors paired with reference
tensors by their values, every pairing right or none made."""
from __future__ import annotations

import csv

import numpy as np
import pytest
from conftest import small_cnn
from onnx import TensorProto, helper, numpy_helper
from onnxbuild import opset17

from layerdiff.analyzer.align.layout import LayoutVote
from layerdiff.analyzer.align.values import ValueMatcher
from layerdiff.analyzer.reference.onnxrt import OnnxReference
from layerdiff.client.api import run
from layerdiff.client.demo import det_input, packaged_model
from layerdiff.collector.live.onnxrt import LiveRunner

CNN_X = np.random.default_rng(1).standard_normal((1, 3, 16, 16)).astype(np.float32)


def _records(model: bytes, feeds, device: bytes | None = None, precision: str = "fp32", nhwc: bool = False):
    recs = [r for r in LiveRunner(model, feeds, precision=precision, device_model_bytes=device).records()
            if r.array is not None]
    if nhwc:
        for r in recs:
            if r.array.ndim == 4:
                r.array = np.ascontiguousarray(r.array.transpose(0, 2, 3, 1))
    return recs


def _match(model: bytes, feeds, recs, claimed=(), cap_bytes=256 << 20, layout=None):
    """Every record offered to a matcher as an unmatched device tensor, in
    order, then the end of the stream: {device name: verdict}."""
    ref = OnnxReference(model)
    segments = ref.plan(feeds, max_segments=4, min_bytes=1)
    vm = ValueMatcher(ref.sites, lambda: (ref.run(feeds, only=s) for s in segments), cap_bytes=cap_bytes,
                      layout=layout)
    claimed = set(claimed)
    out = {}

    def take(decided):
        for name, v, lease in decided:
            assert lease is None or lease.holders >= 1
            out[name] = v
            if v.kind == "match":
                assert v.tensor not in claimed, f"{name}: {v.tensor} paired twice"
                claimed.add(v.tensor)

    for r in recs:
        if r.name in claimed:
            continue     # paired by its name
        take(vm.offer(r.name, r.array, claimed, keep=r.name))
    take(vm.settle(claimed))
    assert not vm.held and vm.held_bytes == 0
    return out


def _tally(verdicts):
    right = [n for n, v in verdicts.items() if v.kind == "match" and v.tensor == n]
    wrong = {n: v.tensor for n, v in verdicts.items() if v.kind == "match" and v.tensor != n}
    unmatched = {n: v.note for n, v in verdicts.items() if v.kind != "match"}
    return right, wrong, unmatched


# ------------------------------------------------------------------ matcher

@pytest.mark.parametrize("precision,nhwc", [("fp32", False), ("fp16", False), ("fp16", True)])
def test_detector_tensors_pair_by_value(precision, nhwc):
    """PP-OCRv4 det at 320x320 (672 tensors, 342 of them Constant node
    outputs, many of those equal scalars): most pair, every pairing is
    right, and what is ambiguous stays unmatched."""
    model = packaged_model().read_bytes()
    feeds = {"x": det_input(320, 320)}
    recs = _records(model, feeds, precision=precision, nhwc=nhwc)
    right, wrong, unmatched = _tally(_match(model, feeds, recs, layout=LayoutVote()))
    assert not wrong
    assert len(right) >= 0.7 * len(recs), (len(right), len(recs))
    computed = {r.name for r in recs if r.op_type != "Constant"}
    assert len(computed & set(right)) >= 0.9 * len(computed)
    # equal constants (the same scalar written many times), and computed
    # tensors equal but for rounding, are left unmatched, never guessed
    assert sum("ambiguous by value" in why for why in unmatched.values()) >= 100
    assert any("ambiguous by value" in unmatched.get(n, "") for n in computed)
    assert all("empty tensor" in why for n, why in unmatched.items() if not next(
        r.array.size for r in recs if r.name == n))


def test_a_few_device_only_tensors_read_only_their_candidates(monkeypatch):
    """A user's dump of an FP16 build: every name pairs but a few of its own
    (the casts the conversion put in). At the end of the stream only the
    reference tensors with their element counts are read and fingerprinted,
    not the whole reference once more, and they pair as they did."""
    from layerdiff.analyzer.align import values

    model = packaged_model().read_bytes()
    feeds = {"x": det_input(128, 128)}
    recs = _records(model, feeds, precision="fp16")
    sizes = {r.array.size for r in recs if r.array.size}
    # three computed tensors, each of an element count some others share
    held = [r for r in recs if r.op_type not in ("Constant", "") and r.array.size > 1024][:3]
    assert len(held) == 3 and len({r.array.size for r in held}) < len(sizes)
    read = []

    def counted(arr):
        read.append(arr.size)
        return real(arr)

    real = values.fingerprint
    monkeypatch.setattr(values, "fingerprint", counted)
    named = {r.name for r in recs} - {r.name for r in held}
    got = _match(model, feeds, held, claimed=named, layout=LayoutVote())
    assert read and set(read) <= {r.array.size for r in held}
    assert len(read) < 0.25 * len(recs), (len(read), len(recs))
    for r in held:
        assert got[r.name].kind == "match" and got[r.name].tensor == r.name, (r.name, got[r.name])


def _copies_model() -> bytes:
    """conv -> relu_a -> relu_b (relu of a relu: the same values) -> a
    Reshape that keeps the shape -> Sigmoid."""
    rng = np.random.default_rng(3)
    w = numpy_helper.from_array((rng.standard_normal((4, 3, 3, 3)) * 0.3).astype(np.float32), "w")
    shape = numpy_helper.from_array(np.array([1, 4, 8, 8], np.int64), "shape")
    nodes = [helper.make_node("Conv", ["x", "w"], ["conv"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["conv"], ["relu_a"], name="relu_a"),
             helper.make_node("Relu", ["relu_a"], ["relu_b"], name="relu_b"),
             helper.make_node("Reshape", ["relu_b", "shape"], ["same"], name="reshape"),
             helper.make_node("Sigmoid", ["same"], ["y"], name="sigmoid")]
    g = helper.make_graph(nodes, "copies", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=[w, shape])
    m = opset17(g)
    return m.SerializeToString()


def test_equal_tensors_stay_unmatched_until_the_others_are_claimed():
    model = _copies_model()
    feeds = {"x": np.random.default_rng(4).standard_normal((1, 3, 8, 8)).astype(np.float32)}
    recs = _records(model, feeds)
    v = _match(model, feeds, recs)
    assert v["conv"].kind == v["y"].kind == "match" and v["conv"].tensor == "conv" and v["y"].tensor == "y"
    for n in ("relu_a", "relu_b", "same"):
        assert v[n].kind == "unmatched" and "ambiguous by value" in v[n].note, v[n]
        assert all(t in v[n].note for t in ("'relu_a'", "'relu_b'", "'same'"))
    # names paired two of the three: the third pairs by elimination
    v = _match(model, feeds, recs, claimed={"relu_a", "same"})
    assert v["relu_b"].kind == "match" and v["relu_b"].tensor == "relu_b"
    assert v["relu_b"].note.startswith("by elimination") and v["relu_b"].confidence < 0.9
    # one left by name, two device tensors for the two others: still ambiguous
    v = _match(model, feeds, recs, claimed={"relu_a"})
    assert v["relu_b"].kind == v["same"].kind == "unmatched"


def test_a_device_only_copy_never_takes_the_place_of_a_named_tensor():
    """A device tensor with the values of one the device also sends under
    its name (a layout copy, a fused op's intermediate) arrives first: the
    name still wins, whatever the order."""
    model = small_cnn().SerializeToString()
    feeds = {"input": CNN_X}
    recs = _records(model, feeds)
    conv3 = next(r for r in recs if r.name == "conv3_out")
    copy = type(conv3)(name="conv3_raw", array=conv3.array.copy())
    v = _match(model, feeds, [copy], claimed={"conv3_out"})
    assert v["conv3_raw"].kind == "unmatched" and "already paired" in v["conv3_raw"].note


def test_a_planted_bug_still_pairs_and_its_neighbours_are_not_confused():
    """conv2's weights are wrong: conv2, and every node after it, differ
    from the reference. conv2 pairs by pattern (correlation 0.97 with its
    own reference, 0.05 with conv1's; the ReLU outputs, of another kind,
    do not count); relu2 pairs with relu2 although its values correlate with
    conv2's more than with its own (0.90 against 0.90 for relu2, but conv2
    has no zeros); add pairs by elimination; nothing pairs wrongly."""
    model = small_cnn().SerializeToString()
    feeds = {"input": CNN_X}
    recs = _records(model, feeds, device=small_cnn(bug_in="conv2").SerializeToString())
    v = _match(model, feeds, recs)
    right, wrong, unmatched = _tally(v)
    assert not wrong
    assert v["conv2_out"].kind == "match" and "keep the reference's pattern" in v["conv2_out"].note
    assert v["conv1_out"].confidence > v["conv2_out"].confidence
    assert {"conv1_out", "relu1_out", "conv2_out", "relu2_out", "add_out", "conv3_out"} <= set(right)
    # logits (10 values): too few to tell a pattern from chance, and far off
    assert set(unmatched) <= {"logits"}


def test_nhwc_values_choose_the_layout_where_the_shape_does_not():
    model = small_cnn(width=8, side=8).SerializeToString()     # C == H == W
    x = np.random.default_rng(2).standard_normal((1, 3, 8, 8)).astype(np.float32)
    recs = _records(model, {"input": x}, nhwc=True)
    v = _match(model, {"input": x}, recs, layout=LayoutVote())
    right, wrong, unmatched = _tally(v)
    assert not wrong and len(right) == len(recs)
    assert v["conv1_out"].perm == (0, 3, 1, 2)


def test_the_cap_decides_held_tensors_early():
    model = _copies_model()
    feeds = {"x": np.random.default_rng(4).standard_normal((1, 3, 8, 8)).astype(np.float32)}
    recs = _records(model, feeds)
    v = _match(model, feeds, recs, cap_bytes=1024)     # one 4x8x8 float tensor
    assert v["conv"].kind == "match" and v["conv"].tensor == "conv"
    assert v["relu_a"].kind == "unmatched" and "reached" in v["relu_a"].note


# ------------------------------------------------------------ a whole job

def _opaque_dump(directory, recs):
    """Files named by opaque ids, no manifest: names match nothing."""
    directory.mkdir(parents=True)
    truth = {}
    for i, r in enumerate(recs, 1):
        np.save(directory / f"t{i:04d}.npy", r.array, allow_pickle=False)
        truth[f"t{i:04d}"] = r.name
    return directory, truth


def _csv(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _job(services, tmp_path, model: bytes, feeds, recs, name):
    collector, analyzer = services
    mpath = tmp_path / f"{name}.onnx"
    mpath.write_bytes(model)
    inputs = tmp_path / f"{name}.npz"
    np.savez(inputs, **feeds)
    dump, truth = _opaque_dump(tmp_path / name, recs)
    out = tmp_path / f"{name}-out"
    res = run(mpath, inputs, dump=str(dump), out=out, analyzer=analyzer.address, collector=collector.address,
              min_coverage=0.5, progress=False)
    rows = _csv(out / "cpu_vs_npu.csv")
    for r in rows:
        assert truth[r["device_name"]] == r["tensor"], r
    return res, rows, truth, (out / "invalid_out_nodename.log").read_text()


def test_opaque_dump_with_a_planted_bug(services, tmp_path):
    model = small_cnn().SerializeToString()
    feeds = {"input": CNN_X}
    recs = _records(model, feeds, device=small_cnn(bug_in="conv2").SerializeToString())
    res, rows, truth, invalid = _job(services, tmp_path, model, feeds, recs, "bug")
    assert res.first_failing_node == "conv2"
    assert len(rows) == 8 and "not found in the reference model" in invalid
    assert res.summary["first_computation_error"]["node"] == "conv2"


def test_opaque_dump_of_the_detector(services, tmp_path):
    model = packaged_model().read_bytes()
    feeds = {"x": det_input(320, 320)}
    recs = _records(model, feeds, precision="fp16")
    res, rows, truth, invalid = _job(services, tmp_path, model, feeds, recs, "det")
    assert len(rows) >= 0.7 * len(recs)
    assert "ambiguous by value" in invalid


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_a_narrow_tensor_fingerprints_as_its_widened_values(dtype):
    """A float32 or float16 tensor is looked at in its own type: its
    fingerprint is the one its float64 copy has (NaN, Inf, zeros, extremes
    and sums alike), across the pieces it is read in."""
    from layerdiff.analyzer.align.values import _CHUNK, stats

    x = (np.random.default_rng(7).standard_normal(2 * _CHUNK + 77) * 300).astype(dtype)
    x[[3, _CHUNK + 1]] = np.nan
    x[[5, 2 * _CHUNK + 9]] = [np.inf, -np.inf]
    x[100:140] = 0
    narrow, wide = stats(x), stats(x.astype(np.float64))
    assert (narrow.mean, narrow.std, narrow.lo, narrow.hi, narrow.zeros, narrow.nonfinite) == \
        (wide.mean, wide.std, wide.lo, wide.hi, wide.zeros, wide.nonfinite)
    assert narrow.nonfinite == 4 / x.size and narrow.zeros > 0 and narrow.lo < 0 < narrow.hi
