"""The reference in segments gives exactly what one run exposing every node
output gives, and the segment plan follows the estimated sizes."""
from __future__ import annotations

import numpy as np

from layerdiff.analyzer.reference import OnnxReference, SegmentedReference
from layerdiff.collector.live import LiveRunner
from layerdiff.onnxgraph import estimate_output_bytes, plan_segments

from conftest import small_cnn


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
    ref = OnnxReference(small_cnn().SerializeToString())
    full = ref.run(_feeds())
    seg = SegmentedReference(ref, _feeds(), min_bytes=1, max_segments=4)
    assert len(seg.segments) == 4
    for s in ref.sites:
        got = seg.pop(s.tensor)
        assert got.tobytes() == full[s.tensor].tobytes(), s.tensor
        assert seg.pop(s.tensor) is None          # handed out once, then forgotten
    assert seg.values == {}


def test_live_runner_in_segments_sends_every_node(monkeypatch):
    """Each segment is a full device run up to its nodes (the device may fuse
    what a segment does not expose), so values agree to FP16 rounding."""
    import layerdiff.collector.live as live

    model = small_cnn().SerializeToString()
    whole = [(r.name, r.array) for r in LiveRunner(model, _feeds(), precision="fp16").records()]
    monkeypatch.setattr(live, "plan_segments", lambda names, sizes: [[n] for n in names])
    pieces = [(r.name, r.array) for r in LiveRunner(model, _feeds(), precision="fp16").records()]
    assert [n for n, _ in pieces] == [n for n, _ in whole] and len(whole) == 9
    for (name, a), (_, b) in zip(pieces, whole):
        assert a.dtype == b.dtype and np.allclose(a, b, rtol=2e-3, atol=2e-3), name
