"""Layout: a device tensor in another layout is brought back by the layout
permutation its shape tells, and where the shape does not tell (C == H ==
W) by the layout the rest of the dump uses; an H/W swap is never taken from
shapes."""
from __future__ import annotations

import csv

import numpy as np
import pytest
from conftest import small_cnn
from test_distributed import cluster  # noqa: F401  (a fixture: Redis, two workers, both analyzers)

from layerdiff.analyzer.align import layout as L
from layerdiff.analyzer.compare.node import SkipNode, compare_node, reconcile
from layerdiff.analyzer.compare.tolerances import Tolerance
from layerdiff.client.api import run
from layerdiff.collector.dumps.directory import write_dump
from layerdiff.collector.live.onnxrt import LiveRunner

NHWC = (0, 3, 1, 2)     # dev.transpose(NHWC) is the NCHW reference


def _nhwc(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1))


def _rand(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ------------------------------------------------------------------ shapes only

@pytest.mark.parametrize("shape", [(1, 8, 8, 16),    # C == H
                                   (1, 16, 8, 16),   # C == W
                                   (1, 16, 8, 8),    # H == W
                                   (1, 8, 16, 8)])   # C == W, H != W
def test_nhwc_is_undone_without_an_hw_swap(shape):
    """Each of these shapes also fits a permutation that swaps H and W (or
    C and H); the layout permutation is the one taken, with or without a
    vote, and the data come back exactly."""
    ref = _rand(shape)
    dev = _nhwc(ref)
    p, note, undecided = L.resolve(ref.shape, dev.shape)
    assert p == NHWC and not undecided
    assert len([q for q in L._all_fitting(dev.shape, ref.shape)]) >= 2   # the shape alone admits others
    out, note = reconcile(ref, dev, False)
    assert np.array_equal(out, ref) and note == f"layout: device axes {NHWC} transposed to the reference"
    assert L.evidence(ref.shape, dev.shape) == NHWC


def test_a_shape_that_fits_every_layout_follows_the_vote():
    ref = _rand((1, 8, 8, 8))
    dev = _nhwc(ref)
    # no vote: compared as sent (and a row would fail); the vote not decided yet: held
    assert L.resolve(ref.shape, dev.shape) == ((0, 1, 2, 3), "", False)
    vote = L.LayoutVote()
    assert L.resolve(ref.shape, dev.shape, vote)[2] is True
    assert L.evidence(ref.shape, dev.shape) is None
    assert vote.note((1, 16, 8, 8), (1, 8, 8, 16)) == NHWC
    assert vote.decided(4) is None            # one vote does not decide while the stream runs ...
    vote.close()
    assert vote.decided(4) == NHWC            # ... but does once it has ended
    out, note = reconcile(ref, dev, False, vote)
    assert np.array_equal(out, ref) and "dominant layout" in note
    # the decided permutation travels as a list (a Celery task item) and gives the same
    m = compare_node(ref, dev, Tolerance(0.005, 0.2), 0, False, list(NHWC))
    assert m.metrics.errors == 0 and m.note.startswith("layout: device axes (0, 3, 1, 2)")
    with pytest.raises(SkipNode):
        reconcile(ref, dev[:, :, :, :4].copy(), False, [0, 3, 1, 2])


def test_the_vote_never_makes_an_hw_swap_from_shapes():
    """Shapes that only an H/W swap explains are undone for their own tensor
    (the one permutation that fits) but never vote; the tensors whose shape
    fits every layout then stay as sent, never H/W swapped."""
    vote = L.LayoutVote()
    for _ in range(5):
        assert vote.note((1, 8, 16, 32), (1, 8, 32, 16)) is None     # fits (0, 1, 3, 2) only
    vote.note((1, 16, 8, 8), (1, 16, 8, 8))                        # NCHW, telling
    vote.note((1, 4, 8, 8), (1, 4, 8, 8))
    vote.close()
    assert vote.decided(4) == (0, 1, 2, 3)
    for ref_shape in [(1, 8, 8, 8), (1, 16, 8, 8), (1, 4, 4, 4)]:
        p, _, _ = L.resolve(ref_shape, ref_shape, vote)
        assert p == (0, 1, 2, 3)
    # a square NHWC tensor: channels moved, H and W kept in order (never (0, 3, 2, 1))
    assert L.resolve((1, 16, 8, 8), (1, 8, 8, 16), vote)[0] == NHWC
    ref = _rand((1, 16, 8, 8))
    assert np.array_equal(reconcile(ref, _nhwc(ref), False, vote)[0], ref)


def test_a_minority_does_not_decide_and_ranks_vote_apart():
    vote = L.LayoutVote()
    vote.note((1, 16, 8, 8), (1, 8, 8, 16))
    vote.note((1, 16, 8, 8), (1, 16, 8, 8))
    vote.close()
    assert vote.decided(4) is None            # a tie: no dominant layout
    assert L.resolve((1, 8, 8, 8), (1, 8, 8, 8), vote)[0] == (0, 1, 2, 3)
    vote.note((2, 3, 5), (2, 5, 3))           # NWC, rank 3
    assert vote.decided(3) == (0, 2, 1) and vote.decided(4) is None
    assert L.resolve((1, 6, 6), (1, 6, 6), vote)[0] == (0, 2, 1)


def test_size_one_axes_move_without_a_transpose():
    ref = _rand((1, 16, 1, 1))
    out, note = reconcile(ref, ref.reshape(1, 1, 1, 16), False)
    assert np.array_equal(out, ref) and note == "shape differs only by axes of size 1"
    assert L.evidence((1, 16, 1, 1), (1, 1, 1, 16)) is None


def test_channels_first_device_against_a_channels_last_reference():
    ref = _rand((1, 8, 8, 16))                # NHWC reference (TensorFlow)
    dev = np.ascontiguousarray(ref.transpose(0, 3, 1, 2))
    p, _, _ = L.resolve(ref.shape, dev.shape)
    assert p == (0, 2, 3, 1)
    assert np.array_equal(reconcile(ref, dev, False)[0], ref)


# ------------------------------------------------------------ real NHWC dumps

def _csv(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _nhwc_dump(tmp_path, name, model, feeds, device=None):
    recs = list(LiveRunner(model.SerializeToString(), feeds,
                           device_model_bytes=device.SerializeToString() if device else None).records())
    for r in recs:
        if r.array is not None and r.array.ndim == 4:
            r.array = _nhwc(r.array)
    return write_dump(tmp_path / name, recs)


@pytest.mark.parametrize("width,side", [(8, 8),     # C == H == W at conv1 .. add; only conv3 tells
                                        (8, 16),    # conv3 has C == H == W; the others tell
                                        (6, 12)])   # every 4-D tensor tells
def test_nhwc_dumps_of_a_real_model(services, tmp_path, width, side):
    collector, analyzer = services
    model = small_cnn(width=width, side=side)
    x = np.random.default_rng(1).standard_normal((1, 3, side, side)).astype(np.float32)
    mpath = tmp_path / "model.onnx"
    mpath.write_bytes(model.SerializeToString())
    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, input=x)

    dump = _nhwc_dump(tmp_path, "ok", model, {"input": x})
    out = tmp_path / "ok-out"
    res = run(mpath, inputs, dump=str(dump), out=out, analyzer=analyzer.address, collector=collector.address,
              progress=False)
    rows = {r["node"]: r for r in _csv(out / "cpu_vs_npu.csv")}
    assert res.first_failing_node is None, {n: r["note"] for n, r in rows.items()}
    assert len(rows) == 9 and all(r["result"] == "pass" for r in rows.values())
    for node in ("conv1", "relu1", "conv2", "relu2", "residual/add", "conv3"):
        assert rows[node]["note"].startswith("layout: device axes (0, 3, 1, 2) transposed"), rows[node]["note"]
    ambiguous = ["conv1", "relu1", "conv2"] if width == side else ["conv3"] if 2 * width == side else []
    for node in ambiguous:
        assert "dominant layout" in rows[node]["note"]

    bug = _nhwc_dump(tmp_path, "bug", model, {"input": x}, small_cnn(bug_in="conv2", width=width, side=side))
    out = tmp_path / "bug-out"
    res = run(mpath, inputs, dump=str(bug), out=out, analyzer=analyzer.address, collector=collector.address,
              progress=False)
    assert res.first_failing_node == "conv2"
    s = res.summary
    first = s["first_computation_error"]
    assert first["node"] == "conv2" and first["cause"] != "layout", first
    # the isolated re-run read the producers' outputs in the reference's layout
    assert first.get("isolated") and first["isolated"]["cosine"] < 0.99
    assert {v["node"]: v["verdict"] for v in s["verdicts"]}.get("conv3") == "accumulated precision error"


def test_celery_workers_compare_in_the_layout_the_vote_decided(cluster, tmp_path):
    """The vote lives in the analyzer; what reaches a worker is already in
    the reference's layout: the Celery and the local pool reports agree."""
    model = small_cnn(width=8, side=8)
    x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)
    mpath = tmp_path / "model.onnx"
    mpath.write_bytes(model.SerializeToString())
    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, input=x)
    dump = _nhwc_dump(tmp_path, "bug", model, {"input": x}, small_cnn(bug_in="conv2", width=8, side=8))
    rows = {}
    for name in ("local", "celery"):
        out = tmp_path / name
        res = run(mpath, inputs, dump=str(dump), out=out, analyzer=cluster[name].address,
                  collector=cluster["collector"].address, progress=False)
        assert res.first_failing_node == "conv2"
        rows[name] = _csv(out / "cpu_vs_npu.csv")
    assert rows["local"] == rows["celery"]
    assert all(r["note"].startswith("layout: device axes (0, 3, 1, 2)") for r in rows["celery"]
               if r["node"] in ("conv1", "relu1", "conv2"))
