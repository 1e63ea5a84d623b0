"""A dump whose manifest carries op types and inputs is aligned by its graph:
tensors renamed to numbers, nodes renamed, op types in a runtime's own
spelling, fused nodes (onnxruntime EXTENDED) - each pairs back with the
reference by structure, and a whole job answers as it does for the
unrenamed dump; a planted bug is named at its node even though its values
no longer resemble the reference's."""
from __future__ import annotations

import csv
import json
import random

import numpy as np
import onnx
import pytest
from onnx import helper
from test_graphalign import all_outputs, bn_cnn, node_outputs, ort_optimized, planted_bug

from layerdiff.analyzer.align.graph import align_graphs
from layerdiff.analyzer.align.manifest import onnx_op, skeleton
from layerdiff.client.api import run
from layerdiff.collector.dumps.graph import dump_graph
from layerdiff.v1 import layerdiff_pb2 as pb

# How a TensorFlow-flavoured runtime spells the ONNX ops of the models below.
VENDOR = {"Conv": "Conv2D", "BatchNormalization": "FusedBatchNormV3", "Concat": "ConcatV2", "MatMul": "MatMulV2",
          "Add": "AddV2", "Clip": "ClipByValue", "GlobalAveragePool": "GlobalAveragePool", "Resize": "Resize"}


def manifest_dump(model: onnx.ModelProto, feeds: dict, root, *, seed: int = 0, vendor: bool = False,
                  top_inputs: bool = True, weights: bool = True, graph: bool = True) -> dict[str, str]:
    """Run ``model`` and write every node output as a renamed .npy dump whose
    manifest describes the graph: tensors are numbers, nodes random names,
    op types optionally in VENDOR spelling, weights named in the inputs or
    left out. Returns {original tensor: dumped name}."""
    values = {**all_outputs(model, feeds), **feeds}
    rng = random.Random(seed)
    inits = {i.name for i in model.graph.initializer}
    const = set(inits) | {t for n in model.graph.node if n.op_type == "Constant" for t in n.output}
    order = list(values)
    rng.shuffle(order)
    names = {t: f"{k}" for k, t in enumerate(order)}
    root.mkdir(parents=True, exist_ok=True)
    entries = []
    for n in model.graph.node:
        if n.op_type == "Constant":
            continue
        node = f"n{rng.getrandbits(32):x}"
        ins = [names.get(t, f"w{abs(hash(t)) % 10**8}") for t in n.input if t and (weights or t not in const)]
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute
                 if a.type in (onnx.AttributeProto.INT, onnx.AttributeProto.INTS, onnx.AttributeProto.FLOAT,
                               onnx.AttributeProto.FLOATS, onnx.AttributeProto.STRING)}
        attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
        for slot, t in enumerate(n.output):
            if not t or t not in values:
                continue
            np.save(root / f"{names[t]}.npy", values[t])
            e = {"name": names[t], "file": f"{names[t]}.npy", "node": node, "slot": slot,
                 "op_type": VENDOR.get(n.op_type, n.op_type) if vendor else n.op_type}
            if graph:
                e.update(inputs=ins, attrs=attrs)
            entries.append(e)
    doc: dict = {"nodes": entries}
    if top_inputs and graph:
        doc["inputs"] = [names[i.name] for i in model.graph.input if i.name not in inits]
    (root / "manifest.json").write_text(json.dumps(doc), encoding="utf-8")
    return names


@pytest.fixture(scope="module")
def cnn():
    model = bn_cnn(side=16)
    feeds = {"input": np.random.default_rng(4).standard_normal((1, 3, 16, 16)).astype(np.float32)}
    return model, feeds


def _aligned(model, root):
    graph = dump_graph(pb.DumpSource(path=str(root)))
    return graph, align_graphs(model, skeleton(graph, model))


def test_op_types_read_in_a_runtimes_spelling():
    assert [onnx_op(t) for t in ("Conv2D", "conv", "FusedBatchNormV3", "RELU", "FullyConnection", "ConcatV2",
                                 "MaxPoolV3", "AddN", "SomethingNew")] == \
        ["Conv", "Conv", "BatchNormalization", "Relu", "Gemm", "Concat", "MaxPool", "Sum", "SomethingNew"]


@pytest.mark.parametrize("vendor,top_inputs,weights", [(False, True, True), (True, False, True),
                                                       (True, False, False), (False, True, False)])
def test_a_renamed_dump_pairs_back_through_its_graph(cnn, tmp_path, vendor, top_inputs, weights):
    model, feeds = cnn
    names = manifest_dump(model, feeds, tmp_path, vendor=vendor, top_inputs=top_inputs, weights=weights, seed=3)
    graph, al = _aligned(model, tmp_path)
    assert len(graph.nodes) == len([n for n in model.graph.node if n.op_type != "Constant"])
    back = {new: old for old, new in names.items()}
    assert {back[d]: p.ref_tensor for d, p in al.pairs.items()} == {t: t for t in node_outputs(model)}
    assert not (al.ambiguous or al.unmatched)


def test_fused_nodes_spelled_as_plain_convs_cover_what_they_fuse(cnn, tmp_path):
    """onnxruntime's FusedConv dumped as a runtime names it (``Conv2D`` with
    an ``activation`` attribute): each covers Conv → BN → activation and is
    compared with the activation's output."""
    model, feeds = cnn
    device = ort_optimized(model, "extended", tmp_path)
    names = manifest_dump(device, feeds, tmp_path / "dump", seed=2)
    doc = json.loads((tmp_path / "dump" / "manifest.json").read_text())
    spelled = [e for e in doc["nodes"] if e["op_type"] == "FusedConv"]
    for e in spelled:
        e["op_type"] = "Conv2D"
    (tmp_path / "dump" / "manifest.json").write_text(json.dumps(doc))
    _, al = _aligned(model, tmp_path / "dump")
    back = {new: old for old, new in names.items()}
    assert {back[d]: p.ref_tensor for d, p in al.pairs.items()} == {t: t for t in node_outputs(device)}
    assert {p.method for d, p in al.pairs.items() if d in {e["name"] for e in spelled}} == {"fused"}
    assert {"bn1_out", "conv1_out", "bn2_out"} <= set(al.fused)
    assert not (al.ambiguous or al.unmatched)


def test_the_packaged_detector_dumped_with_its_graph(tmp_path):
    from layerdiff.client.demo import det_input, packaged_model

    model = onnx.load(str(packaged_model()))
    names = manifest_dump(model, {"x": det_input(64, 64)}, tmp_path, vendor=True, top_inputs=False, seed=8)
    _, al = _aligned(model, tmp_path)
    back = {new: old for old, new in names.items()}
    got = {back[d]: p.ref_tensor for d, p in al.pairs.items()}
    assert not {d: r for d, r in got.items() if d != r}
    assert len(got) >= 0.98 * len(node_outputs(model)), (len(got), len(node_outputs(model)))


def test_bad_graph_fields_drop_only_their_node(cnn, tmp_path):
    """The tensors still stream; the graph goes on without those nodes, and
    what they alone could settle is listed as ambiguous, never guessed."""
    model, feeds = cnn
    names = manifest_dump(model, feeds, tmp_path)
    doc = json.loads((tmp_path / "manifest.json").read_text())
    doc["nodes"][-1]["inputs"] = "not a list"
    doc["nodes"][-2]["attrs"] = ["not", "an", "object"]
    (tmp_path / "manifest.json").write_text(json.dumps(doc))
    graph, al = _aligned(model, tmp_path)
    dropped = {doc["nodes"][-1]["name"], doc["nodes"][-2]["name"]}
    assert len(graph.nodes) == len(doc["nodes"]) - 2
    back = {new: old for old, new in names.items()}
    assert all(back[d] == p.ref_tensor for d, p in al.pairs.items())
    assert not dropped & set(al.pairs)
    left = {e["name"] for e in doc["nodes"]} - dropped - set(al.pairs)
    assert left == {d for d, _, _ in al.ambiguous} and len(left) <= 1, (left, al.ambiguous)


def test_a_manifest_without_inputs_describes_no_graph(cnn, tmp_path):
    model, feeds = cnn
    manifest_dump(model, feeds, tmp_path, graph=False)
    assert not dump_graph(pb.DumpSource(path=str(tmp_path))).nodes
    (tmp_path / "manifest.json").unlink()
    assert not dump_graph(pb.DumpSource(path=str(tmp_path))).nodes


# ---------------------------------------------------------------- whole jobs

def _job(services, model, feeds, dump, out):
    collector, analyzer = services
    onnx.save_model(model, str(out.parent / "model.onnx"))
    np.savez(out.parent / "inputs.npz", **feeds)
    return run(out.parent / "model.onnx", out.parent / "inputs.npz", dump=str(dump), out=out,
               analyzer=analyzer.address, collector=collector.address, progress=False)


def _alignment(out) -> list[dict]:
    with open(out / "alignment.csv", newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_a_fused_renamed_dump_with_its_graph_passes_with_full_coverage(services, cnn, tmp_path):
    model, feeds = cnn
    device = ort_optimized(model, "extended", tmp_path)
    assert any(n.op_type == "FusedConv" for n in device.graph.node)
    manifest_dump(device, feeds, tmp_path / "dump", vendor=True, top_inputs=False, seed=5)
    res = _job(services, model, feeds, tmp_path / "dump", tmp_path / "out")
    cov = res.summary["coverage"]
    assert (res.outcome, res.exit_status) == ("pass", 0), (res.summary["outcome"], cov["text"])
    assert cov["ratio"] >= 0.9, cov["text"]
    methods = {row["method"] for row in _alignment(tmp_path / "out")}
    assert {"graph", "fused"} <= methods, methods


def test_a_planted_bug_in_a_renamed_dump_is_named_at_its_node(services, cnn, tmp_path):
    """The bug's values resemble no reference tensor, so only the graph can
    say which node the dumped tensor is."""
    model, feeds = cnn
    device = ort_optimized(planted_bug(model, 1), "extended", tmp_path)      # conv2's weights scaled
    manifest_dump(device, feeds, tmp_path / "dump", seed=6)
    res = _job(services, model, feeds, tmp_path / "dump", tmp_path / "out")
    assert (res.outcome, res.exit_status) == ("fail", 1), res.summary["outcome"]
    first = res.summary["first_computation_error"]
    assert first["node"] in ("conv2", "conv2_bn", "relu2"), first
    assert res.summary["coverage"]["ratio"] >= 0.9, res.summary["coverage"]["text"]
