"""The reference in segments gives exactly what one run exposing every node
output gives, whatever the memory budget cuts it into, and the segment plan
follows the estimated sizes."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import small_cnn
from onnxbuild import opset17

from layerdiff.analyzer.reference.onnxrt import OnnxReference
from layerdiff.analyzer.reference.segments import SegmentedReference
from layerdiff.collector.live.onnxrt import LiveRunner
from layerdiff.common.onnxgraph import cut_segments, estimate_output_bytes, plan_segments


def _feeds():
    return {"input": np.random.default_rng(5).standard_normal((1, 3, 16, 16)).astype(np.float32)}


def test_estimates_match_the_real_sizes():
    ref = OnnxReference(small_cnn().SerializeToString())
    full = ref.run(_feeds())
    est = estimate_output_bytes(ref.model, _feeds())
    assert {t: est.get(t) for t in full} == {t: a.nbytes for t, a in full.items()}


def test_plan_cuts_by_size():
    sizes = {"a": 10, "b": 10, "c": 10, "d": 30, "e": 5}
    assert plan_segments(list(sizes), sizes, min_bytes=20, max_segments=4) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert plan_segments(list(sizes), sizes, min_bytes=1000) == [list(sizes)]
    assert plan_segments(["x", "y"], {}, min_bytes=1) == [["x", "y"]]   # unknown sizes: one segment


def test_segmented_reference_equals_one_full_run():
    """A budget of one byte: every node is a segment of its own, fed with
    what earlier ones computed."""
    ref = OnnxReference(small_cnn().SerializeToString())
    full = ref.run(_feeds())
    seg = SegmentedReference(ref, _feeds(), budget=1)
    assert len(seg.segments) == len({s.order for s in ref.sites}) == 9
    for s in ref.sites:
        got = seg.pop(s.tensor)
        assert got.tobytes() == full[s.tensor].tobytes(), s.tensor
        assert seg.pop(s.tensor) is None          # handed out once, then forgotten
    assert seg.values == {}


def test_room_is_made_before_each_segment_and_the_free_receive_buffers_let_go():
    """The job's free receive buffers go before each segment is computed
    (the largest allocation a job makes), once a segment."""
    from layerdiff.common.schema import BufferPool

    pool = BufferPool()
    calls = []

    def make_room():
        calls.append(pool._free_bytes)
        pool.trim()

    ref = OnnxReference(small_cnn().SerializeToString())
    seg = SegmentedReference(ref, _feeds(), budget=1, make_room=make_room)
    pool.give(np.empty(1 << 20, np.uint8))
    seg.ensure(0)
    assert calls == [1 << 20] and pool._free_bytes == 0 and pool.take(1 << 20).size == 1 << 20
    seg.ensure(len(seg.segments) - 1)
    assert len(calls) == len(seg.segments)


def test_values_waiting_for_the_device_go_to_disk_past_the_budget(tmp_path):
    """Asked for in reverse (the device's last tensor first), every segment
    is computed at once; past the budget the waiting values are spilled and
    still come back exact, and closing deletes them."""
    from test_impact import FEEDS, encoder

    model = encoder(layers=3)
    ref = OnnxReference(model.SerializeToString())
    full = ref.run(FEEDS)
    budget = 4 * max(a.nbytes for a in full.values())
    seg = SegmentedReference(ref, FEEDS, budget=budget, spill_dir=tmp_path / "spill")
    assert len(seg.segments) > 3
    assert any(seg.runner.reads[i] for i in range(2, len(seg.segments)))    # residuals cross segments
    for s in reversed(ref.sites):
        assert seg.pop(s.tensor).tobytes() == full[s.tensor].tobytes(), s.tensor
    assert seg.spilled_bytes > budget
    assert seg._resident() <= budget
    seg.close()
    assert not (tmp_path / "spill").exists()


def test_subgraphs_read_what_earlier_segments_computed():
    """An If whose branches read a tensor of an earlier segment (outer scope)."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    then = helper.make_graph([helper.make_node("Mul", ["a", "a"], ["t"], name="then_mul")], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, [4])])
    other = helper.make_graph([helper.make_node("Neg", ["a"], ["e"], name="else_neg")], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, [4])])
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu"),
             helper.make_node("ReduceSum", ["a"], ["s"], name="sum", keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["c"], name="positive"),
             helper.make_node("If", ["c"], ["y"], name="branch", then_branch=then, else_branch=other),
             helper.make_node("Add", ["y", "a"], ["z"], name="add")]
    graph = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("z", TensorProto.FLOAT, [4])],
                              initializer=[helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])])
    model = opset17(graph)
    ref = OnnxReference(model.SerializeToString())
    feeds = {"x": np.array([1, -2, 3, 0.5], np.float32)}
    full = ref.run(feeds)
    seg = SegmentedReference(ref, feeds, budget=1)
    assert len(seg.segments) == 5 and "a" in seg.runner.reads[3]
    for s in ref.sites:
        assert seg.pop(s.tensor).tobytes() == full[s.tensor].tobytes(), s.tensor


def test_a_budget_cut_keeps_a_node_whole():
    sizes = {"a": 10, "b1": 10, "b2": 10, "c": 30, "d": 5}
    groups = [["a"], ["b1", "b2"], ["c"], ["d"]]
    assert cut_segments(groups, sizes, 20) == [["a"], ["b1", "b2"], ["c"], ["d"]]
    assert cut_segments(groups, sizes, 40) == [["a", "b1", "b2"], ["c", "d"]]
    assert cut_segments(groups, {}, 1) == [["a", "b1", "b2", "c", "d"]]    # unknown sizes: one segment


def test_live_runner_in_segments_sends_every_node(monkeypatch):
    """Each segment is a full device run up to its nodes (the device may fuse
    what a segment does not expose), so values agree to FP16 rounding."""
    import layerdiff.collector.live.onnxrt as live

    model = small_cnn().SerializeToString()
    whole = [(r.name, r.array) for r in LiveRunner(model, _feeds(), precision="fp16").records()]
    monkeypatch.setattr(live, "plan_segments", lambda names, sizes: [[n] for n in names])
    pieces = [(r.name, r.array) for r in LiveRunner(model, _feeds(), precision="fp16").records()]
    assert [n for n, _ in pieces] == [n for n, _ in whole] and len(whole) == 9
    for (name, a), (_, b) in zip(pieces, whole):
        assert a.dtype == b.dtype and np.allclose(a, b, rtol=2e-3, atol=2e-3), name


@pytest.mark.parametrize("name", ["ch_PP-OCRv4_det_infer", "ch_PP-OCRv4_rec_infer", "ch_ppocr_mobile_v2.0_cls_infer"])
def test_real_models_in_small_segments_give_the_whole_runs_values_bit_for_bit(name, tmp_path):
    """The packaged OCR models within a budget of three of their largest
    tensors, asked for last tensor first (spilling): every value as one
    whole run computes it (a weight held by a Constant node goes into each
    segment that reads it: fed as an input instead, a MatMul sums in
    another order)."""
    from layerdiff.client.demo import packaged_model

    model = onnx.load(str(packaged_model().parent / f"{name}.onnx"))
    x = model.graph.input[0]
    shape = [d.dim_value if d.dim_value > 0 else (1, 3, 64, 64)[k] for k, d in enumerate(x.type.tensor_type.shape.dim)]
    feeds = {x.name: np.random.default_rng(0).standard_normal(shape).astype(np.float32)}
    ref = OnnxReference(model.SerializeToString())
    full = ref.run(feeds)
    seg = SegmentedReference(ref, feeds, budget=3 * max(a.nbytes for a in full.values()), spill_dir=tmp_path / "s")
    assert len(seg.segments) > 10
    for s in reversed(ref.sites):
        assert seg.pop(s.tensor).tobytes() == full[s.tensor].tobytes(), s.tensor
    assert seg.spilled_bytes > 0
    seg.close()


def test_a_model_held_in_this_process_is_parsed_once_and_let_go_with_its_last_holder():
    """The embedded analyzer and collector read one device model: whoever
    asks for it while another holds it (or is parsing it) gets the same
    parsed model; once no one holds it, it is gone and the next asker
    parses it anew; a parse that fails fails every asker waiting on it."""
    import gc
    import threading
    import time

    from layerdiff.common.errors import LayerdiffError
    from layerdiff.common.onnxgraph import ParsedModels, load_model

    models = ParsedModels()
    data = small_cnn().SerializeToString()
    parses = []

    def parse():
        parses.append(1)
        time.sleep(0.2)
        return load_model(data, "m.onnx")

    got = []
    askers = [threading.Thread(target=lambda: got.append(models.hold("k", parse))) for _ in range(3)]
    for t in askers:
        t.start()
    for t in askers:
        t.join(10)
    assert len(got) == 3 and len(parses) == 1 and got[0] is got[1] is got[2]
    assert models.hold("k", parse) is got[0] and len(parses) == 1
    got.clear()
    gc.collect()
    again = models.hold("k", parse)
    assert len(parses) == 2 and again.model.graph.node      # parsed anew: no one held it

    def broken():
        time.sleep(0.1)
        return load_model(b"not a model", "bad.onnx")

    errors = []

    def ask():
        try:
            models.hold("bad", broken)
        except LayerdiffError as e:
            errors.append(str(e))

    askers = [threading.Thread(target=ask) for _ in range(2)]
    for t in askers:
        t.start()
    for t in askers:
        t.join(10)
    assert len(errors) == 2 and all("bad.onnx" in e for e in errors)
