"""INT8 builds: a quantize/dequantize hand-over that destroys its tensor is
named (the -3.4e38 attention mask sets the Add's INT8 scale to 1.3e36),
INT8 rounding is precision and not a kernel bug, a wrong weight under INT8
noise is still a weight, and the device's Q/DQ tensors are attributed to the
reference tensors they quantize instead of "matching no reference tensor"."""
from __future__ import annotations

import csv

import numpy as np
from test_impact import FEEDS, _job, encoder, scaled

from layerdiff.client.api import run
from layerdiff.collector.live.int8 import to_int8_qdq


def _alignment(out) -> list[dict]:
    with open(out / "alignment.csv", newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_an_int8_hand_over_that_destroys_the_scores_is_the_answer(services, tmp_path):
    s = _job(services, tmp_path, precision="int8")
    first = s["first_computation_error"]
    assert first is not None and first["node"] == "l1/masked", (s["diagnosis"]["headline"], first)
    assert first["cause"] == "quantization" and first["impact"]["harmful"] is True
    # the break shows in what the hand-over feeds: named too
    assert s["diagnosis"]["headline"].endswith("cause: quantization (its INT8 hand-over to l1/softmax)")
    evidence = " ".join(first["evidence"])
    assert "levels" in evidence and "mask-like values" in evidence
    assert s["device_precision"] == "int8"
    # INT16 advice from a node's own error: l2/scores reads the broken scores and adds little of its own
    advice = {q["node"]: q for q in s["quantization"]}
    assert advice["l2/scores"]["rmse"] < 0.1 and "RMSE" not in advice["l2/scores"]["advice"]
    by = {v["node"]: v for v in s["verdicts"]}
    assert by["l2/scores"]["verdict"] != "computation error", by["l2/scores"]


def test_a_wrong_weight_under_int8_noise_is_still_a_weight(services, tmp_path):
    device = to_int8_qdq(scaled(encoder(), "l2.v.w", 1.8), FEEDS)
    s = _job(services, tmp_path, device_model=device)
    by = {v["node"]: v for v in s["verdicts"]}
    assert by["l2/v/matmul"]["verdict"] == "computation error" and by["l2/v/matmul"]["cause"] == "weight", \
        by["l2/v/matmul"]
    # the other weights are INT8-rounded copies: none is called wrong
    for node, v in by.items():
        if v["verdict"] == "computation error" and node != "l2/v/matmul":
            assert v["cause"] == "quantization", (node, v)
    # every Q/DQ tensor of the device stands for the reference tensor it quantizes
    cov = s["coverage"]
    assert cov["device_unmatched"] == 0 and cov["device_attributed"] > 100, cov["text"]
    rows = _alignment(tmp_path / "out")
    weights = {r["device_tensor"]: r["reference_tensor"] for r in rows if r["method"] == "attributed"}
    assert weights["l1.q.w_DequantizeLinear_Output"] == "l1.q.w"
    assert weights["x_QuantizeLinear_Output"] == "x"


def test_int8_rounding_of_the_detector_is_never_a_kernel_or_weight_bug(services, tmp_path):
    """The packaged detector quantized per tensor: its depthwise and
    pointwise Convs lose precision, some beyond tolerance; none of it is
    blamed on a kernel or a wrong weight."""
    from layerdiff.client.demo import det_input, packaged_model

    collector, analyzer = services
    np.savez(tmp_path / "page.npz", x=det_input(160, 160))
    s = run(packaged_model(), tmp_path / "page.npz", precision="int8", out=tmp_path / "out",
            analyzer=analyzer.address, collector=collector.address, progress=False).summary
    comp = [v for v in s["verdicts"] if v["verdict"] == "computation error"]
    assert all(v["cause"] == "quantization" for v in comp), [(v["node"], v["cause"]) for v in comp]
    assert "cause: quantization" in s["diagnosis"]["headline"] or not comp
    # the bound used is stated: the rounding INT8 gives over the node's reduction length
    bounded = [v for v in s["verdicts"] if any("over its reduction of" in e for e in v["evidence"])]
    assert bounded and all(v["verdict"] == "accumulated precision error" for v in bounded)
