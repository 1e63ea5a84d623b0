"""Devices with planted bugs, as a broken kernel would make them: the
precision build of a model (FP16, BF16, TF32, FP8, INT8), with one node's
output changed right where it is computed, so that everything after it
computes on the wrong value. Used by the verdict tests and by
bench/bench_verdicts.py.

Bugs (``plant``):

- ``block``: a block of channels (NCHW) or features (the last axis) scaled
  by a factor (a wrong scale in one tile of a kernel);
- ``tile``: a spatial tile (or a block of rows of a sequence) zeroed (a
  tile the kernel never wrote);
- ``transpose``: a square spatial tile transposed (a tile written in the
  wrong order);
- ``bias``: a Conv's or Gemm's bias permuted (a bias loaded for the wrong
  channels);
- ``epsilon``: a normalization's epsilon made 1e-1.

``device_dump`` runs the device and writes every tensor the reference
has, named as the reference names it, in execution order: what a device's
dump tool writes.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from layerdiff.collector.dumps.directory import write_dump
from layerdiff.collector.live.emulate import EMULATED, emulated
from layerdiff.collector.live.int8 import to_int8_qdq
from layerdiff.collector.live.onnxrt import dequantized_views, to_fp16
from layerdiff.common.onnxgraph import tensor_sites
from layerdiff.common.schema import NodeRecord

KINDS = ("block", "tile", "transpose", "bias", "epsilon")
_NP = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}


def build(model: onnx.ModelProto, precision: str, feeds: dict[str, np.ndarray]
          ) -> tuple[onnx.ModelProto, dict[str, str]]:
    """The device build of ``model`` in ``precision``, and tensor -> the
    tensor carrying its device value (rounded copies, dequantized views)."""
    if precision == "fp32":
        return _copy(model), {}
    if precision == "fp16":
        return to_fp16(model), {}
    if precision == "int8":
        q = to_int8_qdq(model, feeds)
        return q, dequantized_views(q)
    if precision in EMULATED:
        return emulated(model, precision)
    raise ValueError(precision)


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    return m


def _types(model: onnx.ModelProto) -> dict[str, int]:
    shaped = onnx.shape_inference.infer_shapes(model)
    return {v.name: v.type.tensor_type.elem_type
            for v in [*shaped.graph.value_info, *shaped.graph.input, *shaped.graph.output]}


def eligible(model: onnx.ModelProto, shapes: dict[str, tuple], kind: str) -> list[str]:
    """The reference tensors a bug of ``kind`` can be planted on: float
    node outputs of a usable shape (``shapes``: the reference's values')."""
    out = []
    for n in model.graph.node:
        if n.op_type in ("Constant", "Shape", "Cast") or not n.output or not n.output[0]:
            continue
        t = n.output[0]
        shape = shapes.get(t)
        if shape is None:
            continue
        if kind == "bias" and not (n.op_type in ("Conv", "Gemm") and len(n.input) > 2 and n.input[2]):
            continue
        if kind == "epsilon" and n.op_type not in ("LayerNormalization", "BatchNormalization",
                                                   "InstanceNormalization"):
            continue
        if kind in ("block", "tile", "transpose") and (len(shape) < 2 or int(np.prod(shape)) < 512):
            continue
        if kind == "block" and shape[1 if len(shape) == 4 else -1] < 16:
            continue
        if kind in ("tile", "transpose") and len(shape) == 4 and min(shape[2:]) < 8:
            continue
        if kind in ("tile", "transpose") and len(shape) == 3 and shape[1] < 8:
            continue
        if kind in ("tile", "transpose") and len(shape) == 2:
            continue
        out.append(t)
    return out


def plant(device: onnx.ModelProto, tensor: str, kind: str, shape: tuple, rng: np.random.Generator,
          factor: float = 1.2, share: float = 1 / 16) -> tuple[onnx.ModelProto, str]:
    """``device`` with a bug of ``kind`` on ``tensor`` (the reference's name,
    which the build keeps), and a line saying what was planted."""
    m = _copy(device)
    g = m.graph
    producer = next(n for n in g.node if tensor in n.output)
    while kind in ("bias", "epsilon") and producer.op_type == "Cast":    # a converter's cast back to FP32
        producer = next(n for n in g.node if producer.input[0] in n.output)
    if kind == "bias":
        name = producer.input[2]
        init = next(i for i in g.initializer if i.name == name)
        b = numpy_helper.to_array(init)
        init.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(b[rng.permutation(b.size)]), name))
        return m, f"{producer.name}: its bias permuted"
    if kind == "epsilon":
        eps = next((a for a in producer.attribute if a.name == "epsilon"), None)
        if eps is None:
            producer.attribute.append(helper.make_attribute("epsilon", 0.1))
        else:
            eps.f = 0.1
        return m, f"{producer.name}: epsilon 0.1"
    elem = _types(m).get(tensor, TensorProto.FLOAT)
    dt = _NP.get(elem, np.float32)
    raw = tensor + "__raw"
    producer.output[list(producer.output).index(tensor)] = raw
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []

    def const(name: str, arr) -> str:
        inits.append(numpy_helper.from_array(np.asarray(arr), f"{tensor}__{name}"))
        return f"{tensor}__{name}"

    nd = len(shape)
    if kind in ("block", "tile"):
        mask = np.ones([1] * nd, dt)
        if kind == "block":
            axis = 1 if nd == 4 else nd - 1
            size = shape[axis]
            width = max(1, int(round(size * share)))
            start = int(rng.integers(0, size - width + 1))
            scale = np.ones(size, dt)
            scale[start:start + width] = factor
            shaped = [1] * nd
            shaped[axis] = size
            mask = scale.reshape(shaped).astype(dt)
            what = f"{'channels' if nd == 4 else 'features'} {start}..{start + width - 1} scaled by {factor:g}"
        else:
            axes = (2, 3) if nd == 4 else (1,)
            shaped = [1] * nd
            for a in axes:
                shaped[a] = shape[a]
            mask = np.ones(shaped, dt)
            side = max(1, int(round((share ** (1 / len(axes))) * min(shape[a] for a in axes))))
            starts = [int(rng.integers(0, shape[a] - side + 1)) for a in axes]
            idx = [slice(None)] * nd
            for a, s0 in zip(axes, starts):
                idx[a] = slice(s0, s0 + side)
            mask[tuple(idx)] = 0
            what = f"a tile of {side}{'x' + str(side) if nd == 4 else ''} at {starts} zeroed"
        nodes.append(helper.make_node("Mul", [raw, const("bug", mask)], [tensor], name=f"{tensor}__bug"))
    elif kind == "transpose":
        if nd == 4:
            perm, back, a0, a1 = [2, 3, 0, 1], [2, 3, 0, 1], 2, 3
        else:
            perm, back, a0, a1 = [1, 2, 0], [2, 0, 1], 1, 2
        side = max(2, int(round(np.sqrt(share * shape[a0] * shape[a1]))))
        side = min(side, shape[a0], shape[a1])
        r0 = int(rng.integers(0, shape[a0] - side + 1))
        c0 = int(rng.integers(0, shape[a1] - side + 1))
        moved = tensor + "__moved"
        tile, flipped, scattered = tensor + "__tile", tensor + "__flipped", tensor + "__scattered"
        idx = np.stack(np.meshgrid(np.arange(r0, r0 + side), np.arange(c0, c0 + side), indexing="ij"), -1)
        nodes += [
            helper.make_node("Transpose", [raw], [moved], perm=perm, name=moved),
            helper.make_node("Slice", [moved, const("starts", np.array([r0, c0], np.int64)),
                                       const("ends", np.array([r0 + side, c0 + side], np.int64)),
                                       const("axes", np.array([0, 1], np.int64))], [tile], name=tile),
            helper.make_node("Transpose", [tile], [flipped], perm=[1, 0] + list(range(2, nd)), name=flipped),
            helper.make_node("ScatterND", [moved, const("indices", idx.astype(np.int64)), flipped], [scattered],
                             name=scattered),
            helper.make_node("Transpose", [scattered], [tensor], perm=back, name=f"{tensor}__bug"),
        ]
        what = f"a tile of {side}x{side} at ({r0}, {c0}) transposed"
    else:
        raise ValueError(kind)
    at = list(g.node).index(producer) + 1
    for k, n in enumerate(nodes):
        g.node.insert(at + k, n)
    g.initializer.extend(inits)
    return m, f"{producer.name or tensor}: {what}"


def device_dump(reference: onnx.ModelProto, device: onnx.ModelProto, view: dict[str, str],
                feeds: dict[str, np.ndarray], out: Path, fmt: str = "npy", source_dtype: str = "",
                inputs: bool = False) -> Path:
    """Run ``device`` once and write every tensor the reference has (the
    device's value of it: ``view``'s rounded or dequantized copy where there
    is one), named as the reference names it, in the reference's
    execution order. ``source_dtype``: what an emulated build stores in.
    ``inputs``: each node's inputs too (dump_mode all), the tensors it read
    from other nodes."""
    sites = [s for s in tensor_sites(reference) if s.op_type != "Constant"]
    have = {t for n in device.graph.node for t in n.output}
    wanted = [s for s in sites if view.get(s.tensor, s.tensor) in have]
    given = {i.name for i in reference.graph.input} - {i.name for i in reference.graph.initializer}
    produced = {s.tensor for s in wanted} | given      # what a node reads that a dump of inputs holds
    m = _copy(device)
    names = list(dict.fromkeys(view.get(s.tensor, s.tensor) for s in wanted))
    del m.graph.output[:]
    m.graph.output.extend(onnx.ValueInfoProto(name=t) for t in names)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    values = dict(zip(names, sess.run(names, {k: v for k, v in feeds.items()
                                              if k in {i.name for i in m.graph.input}})))
    records = []
    nodes = {n.name: n for n in reference.graph.node}
    for s in wanted:
        if inputs and s.output_index == 0:
            for k, t in enumerate(nodes[s.node].input):
                if t in produced:
                    v = np.asarray(values[view.get(t, t)] if t not in given else feeds[t])
                    records.append(NodeRecord(name=s.node, op_type=s.op_type, order=s.order, array=v, node=s.node,
                                              role="input", slot=k,
                                              source_dtype=source_dtype if v.dtype == np.float32 else ""))
        v = np.asarray(values[view.get(s.tensor, s.tensor)])
        records.append(NodeRecord(name=s.tensor, op_type=s.op_type, order=s.order, array=v, node=s.node,
                                  slot=s.output_index, source_dtype=source_dtype if v.dtype == np.float32 else ""))
    return write_dump(out, records, fmt)


def reference_shapes(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, tuple]:
    """The shape of every node output, from one FP32 run."""
    m = _copy(model)
    names = [t for n in m.graph.node for t in n.output if t and n.op_type != "Constant"]
    del m.graph.output[:]
    m.graph.output.extend(onnx.ValueInfoProto(name=t) for t in names)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return {t: tuple(np.shape(v)) for t, v in zip(names, sess.run(names, feeds))}
