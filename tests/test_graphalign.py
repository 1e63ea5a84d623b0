"""Structural pairing of a device ONNX graph with its reference
(layerdiff.analyzer.align.graph): renamed copies, onnxruntime-optimized copies
(BASIC / EXTENDED / ALL: BN folding, FusedConv, FusedGemm, NCHWc), a
BatchNormalization folded by hand, LayerNorm / Gelu fusions, FP16 and INT8
builds, onnxsim, and a planted weight bug. Every pairing is checked against
the values both models compute in onnxruntime."""
from __future__ import annotations

import random

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from onnxbuild import GraphBuilder, opset17

from layerdiff.analyzer.align.graph import GraphAlignment, align_graphs
from layerdiff.analyzer.align.layout import unblock_nchwc
from layerdiff.analyzer.align.names import Pairing
from layerdiff.client.demo import det_input, packaged_model

LEVELS = {"basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
          "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
          "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}


# ------------------------------------------------------------------ models

def bn_cnn(seed: int = 0, width: int = 8, side: int = 16) -> onnx.ModelProto:
    """Conv→BN→Relu blocks, a residual Add, two parallel 1x1 Conv→BN branches
    of equal shape (Clip / LeakyRelu) concatenated, pooled, and a
    MatMul→Add→Sigmoid head."""
    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def const(name, arr):
        inits.append(numpy_helper.from_array(np.asarray(arr, np.float32), name))
        return name

    def conv_bn(name, x, cin, cout, out, k=3):
        w = const(f"{name}.weight", rng.standard_normal((cout, cin, k, k)) / np.sqrt(cin * k * k))
        nodes.append(helper.make_node("Conv", [x, w], [f"{name}_out"], name=name, pads=[k // 2] * 4))
        bn = f"{name}_bn"
        params = [const(f"{bn}.gamma", rng.uniform(0.5, 1.5, cout)), const(f"{bn}.beta", rng.uniform(-.2, .2, cout)),
                  const(f"{bn}.mean", rng.uniform(-.1, .1, cout)), const(f"{bn}.var", rng.uniform(.5, 1.5, cout))]
        nodes.append(helper.make_node("BatchNormalization", [f"{name}_out", *params], [out], name=bn, epsilon=1e-5))

    c = width
    conv_bn("conv1", "input", 3, c, "bn1_out")
    nodes.append(helper.make_node("Relu", ["bn1_out"], ["relu1_out"], name="relu1"))
    conv_bn("conv2", "relu1_out", c, c, "bn2_out")
    nodes.append(helper.make_node("Relu", ["bn2_out"], ["relu2_out"], name="relu2"))
    conv_bn("conv3", "relu2_out", c, c, "bn3_out")
    nodes.append(helper.make_node("Add", ["bn3_out", "relu1_out"], ["res_out"], name="residual"))
    nodes.append(helper.make_node("Relu", ["res_out"], ["relu3_out"], name="relu3"))
    conv_bn("conv4a", "relu3_out", c, c, "bn4a_out", k=1)
    nodes.append(helper.make_node("Clip", ["bn4a_out", const("clip.lo", 0.0), const("clip.hi", 6.0)], ["clip4a_out"],
                                  name="clip4a"))
    conv_bn("conv4b", "relu3_out", c, c, "bn4b_out", k=1)
    nodes.append(helper.make_node("LeakyRelu", ["bn4b_out"], ["leaky4b_out"], name="leaky4b", alpha=0.1))
    nodes.append(helper.make_node("Concat", ["clip4a_out", "leaky4b_out"], ["cat_out"], name="concat", axis=1))
    nodes.append(helper.make_node("GlobalAveragePool", ["cat_out"], ["pool_out"], name="pool"))
    nodes.append(helper.make_node("Flatten", ["pool_out"], ["flat_out"], name="flatten"))
    nodes.append(helper.make_node("MatMul", ["flat_out", const("fc.weight", rng.standard_normal((2 * c, 10)) * .3)],
                                  ["fc_mm"], name="fc/matmul"))
    nodes.append(helper.make_node("Add", ["fc_mm", const("fc.bias", rng.standard_normal(10) * .1)], ["logits"],
                                  name="fc/add"))
    nodes.append(helper.make_node("Sigmoid", ["logits"], ["probs"], name="sigmoid"))
    graph = helper.make_graph(nodes, "bn_cnn",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, side, side])],
                              [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [1, 10])], initializer=inits)
    model = opset17(graph)
    onnx.checker.check_model(model)
    return model


def mlp_block(seed: int = 0, hidden: int = 16, inner: int = 32, seq: int = 8) -> onnx.ModelProto:
    """A transformer MLP block with LayerNorm and Gelu written out op by op,
    as exporters emit them: LN → MatMul+Add → Gelu → MatMul+Add → residual
    Add → LN → MatMul."""
    rng = np.random.default_rng(seed)
    b = GraphBuilder()
    const, node = b.const, b.node

    def layer_norm(x, p):
        d = node("Sub", [x, node("ReduceMean", [x], f"{p}/mean", axes=[-1])], f"{p}/sub")
        var = node("ReduceMean", [node("Pow", [d, const(f"{p}.two", 2.0)], f"{p}/pow")], f"{p}/var", axes=[-1])
        sd = node("Sqrt", [node("Add", [var, const(f"{p}.eps", 1e-5)], f"{p}/add_eps")], f"{p}/sqrt")
        g = node("Mul", [node("Div", [d, sd], f"{p}/div"), const(f"{p}.gamma", rng.uniform(.5, 1.5, hidden))],
                 f"{p}/mul")
        return node("Add", [g, const(f"{p}.beta", rng.uniform(-.2, .2, hidden))], f"{p}/add")

    def gelu(x, p):
        e = node("Erf", [node("Div", [x, const(f"{p}.sqrt2", np.sqrt(2.0))], f"{p}/div")], f"{p}/erf")
        m = node("Mul", [x, node("Add", [e, const(f"{p}.one", 1.0)], f"{p}/add")], f"{p}/mul")
        return node("Mul", [m, const(f"{p}.half", 0.5)], f"{p}/mul_half")

    h = layer_norm("x", "ln1")
    h = node("MatMul", [h, const("fc1.w", rng.standard_normal((hidden, inner)) * .3)], "fc1/matmul")
    h = gelu(node("Add", [h, const("fc1.b", rng.standard_normal(inner) * .1)], "fc1/add"), "gelu")
    h = node("MatMul", [h, const("fc2.w", rng.standard_normal((inner, hidden)) * .2)], "fc2/matmul")
    h = node("Add", [h, const("fc2.b", rng.standard_normal(hidden) * .1)], "fc2/add")
    h = layer_norm(node("Add", ["x", h], "residual"), "ln2")
    node("MatMul", [h, const("head.w", rng.standard_normal((hidden, 4)) * .3)], "head")
    return b.model("mlp_block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, seq, hidden])],
                   [helper.make_tensor_value_info("head_out", TensorProto.FLOAT, [1, seq, 4])])


# ------------------------------------------------------- model surgery

def copy(model: onnx.ModelProto) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    return m


def renamed(model: onnx.ModelProto, rng: random.Random | None = None,
            nodes: bool = False) -> tuple[onnx.ModelProto, dict[str, str]]:
    """Every tensor renamed (to a number, or randomly with ``rng``), node
    names kept unless ``nodes``; returns the copy and old -> new."""
    m, names = copy(model), {}

    def new(t):
        if t and t not in names:
            names[t] = str(len(names)) if rng is None else f"t{rng.getrandbits(48):x}"
        return names.get(t, t)

    g = m.graph
    for vi in [*g.input, *g.output, *g.value_info]:
        vi.name = new(vi.name)
    for init in g.initializer:
        init.name = new(init.name)
    for n in g.node:
        n.input[:] = [new(t) for t in n.input]
        n.output[:] = [new(t) for t in n.output]
        if nodes:
            n.name = f"n{rng.getrandbits(48):x}" if rng else ""
    return m, names


def attention_block(seed: int = 0, hidden: int = 16, heads: int = 2, seq: int = 8,
                    mask_value: float = -10000.0) -> onnx.ModelProto:
    """BERT self-attention written out op by op, as exporters emit it: Q, K,
    V projections, heads split by Reshape/Transpose, scaled scores plus the
    additive mask ((1 - mask) * mask_value), Softmax, context merged back,
    output projection. Inputs ``x`` (1, seq, hidden) and ``mask`` (1, seq)."""
    rng = np.random.default_rng(seed)
    d = hidden // heads
    b = GraphBuilder()
    const, node = b.const, b.node
    split = const("heads_shape", [1, seq, heads, d], np.int64)
    for p in "qkv":
        h = node("MatMul", ["x", const(f"{p}.w", rng.standard_normal((hidden, hidden)) * .3)], f"{p}/matmul")
        h = node("Add", [h, const(f"{p}.b", rng.standard_normal(hidden) * .1)], f"{p}/add")
        h = node("Reshape", [h, split], f"{p}/reshape")
        node("Transpose", [h], f"{p}/transpose", perm=[0, 2, 3, 1] if p == "k" else [0, 2, 1, 3])
    m = node("Sub", [const("one", 1.0), node("Cast", ["mask"], "mask/cast", to=TensorProto.FLOAT)], "mask/sub")
    m = node("Mul", [m, const("mask_value", mask_value)], "mask/mul")
    m = node("Unsqueeze", [m, const("mask_axes", [1, 2], np.int64)], "mask/unsqueeze")
    s = node("MatMul", ["q/transpose_out", "k/transpose_out"], "scores/matmul")
    s = node("Div", [s, const("scale", np.sqrt(d))], "scores/div")
    s = node("Add", [s, m], "scores/add_mask")
    pr = node("Softmax", [s], "softmax", axis=-1)
    c = node("MatMul", [pr, "v/transpose_out"], "context/matmul")
    c = node("Transpose", [c], "context/transpose", perm=[0, 2, 1, 3])
    c = node("Reshape", [c, const("merge_shape", [1, seq, hidden], np.int64)], "context/reshape")
    o = node("MatMul", [c, const("out.w", rng.standard_normal((hidden, hidden)) * .3)], "out/matmul")
    node("Add", [o, const("out.b", rng.standard_normal(hidden) * .1)], "out/add")
    return b.model("attention_block",
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, seq, hidden]),
                    helper.make_tensor_value_info("mask", TensorProto.INT64, [1, seq])],
                   [helper.make_tensor_value_info("out/add_out", TensorProto.FLOAT, [1, seq, hidden])])


def fuse_attention(model: onnx.ModelProto, heads: int = 2) -> onnx.ModelProto:
    """The self-attention of attention_block as one com.microsoft Attention
    node (QKV weights packed, the raw mask as its mask_index), as
    onnxruntime's transformer optimizer writes it."""
    vals = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    keep = [n for n in model.graph.node if n.name in ("out/matmul", "out/add")]
    inits = [i for i in model.graph.initializer if i.name in ("out.w", "out.b")]
    inits += [numpy_helper.from_array(np.concatenate([vals[f"{p}.w"] for p in "qkv"], axis=1), "qkv.w"),
              numpy_helper.from_array(np.concatenate([vals[f"{p}.b"] for p in "qkv"]), "qkv.b")]
    cast = helper.make_node("Cast", ["mask"], ["mask_index"], name="mask_index", to=TensorProto.INT32)
    att = helper.make_node("Attention", ["x", "qkv.w", "qkv.b", "mask_index"], ["context/reshape_out"],
                           name="Attention_0", domain="com.microsoft", num_heads=heads)
    graph = helper.make_graph([cast, att, *keep], "attention_fused", list(model.graph.input),
                              list(model.graph.output), initializer=inits)
    fused = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    fused.ir_version = 8
    return fused


def constants(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    vals = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    vals.update({n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in model.graph.node
                 if n.op_type == "Constant" and n.attribute[0].name == "value"})
    return vals


def fold_bn(model: onnx.ModelProto, rename=None) -> onnx.ModelProto:
    """Fold every Conv→BatchNormalization: W' = W·γ/√(σ²+ε),
    b' = (b−μ)·γ/√(σ²+ε)+β; the BN goes, the Conv writes the BN's output
    (or ``rename(bn_output)``)."""
    m = copy(model)
    g, vals = m.graph, constants(model)
    producer = {t: n for n in g.node for t in n.output}
    readers: dict[str, int] = {}
    for n in g.node:
        for t in n.input:
            readers[t] = readers.get(t, 0) + 1
    for bn in [n for n in g.node if n.op_type == "BatchNormalization"]:
        conv = producer.get(bn.input[0])
        if conv is None or conv.op_type != "Conv" or readers[bn.input[0]] != 1:
            continue
        gamma, beta, mean, var = (vals[t].astype(np.float64) for t in bn.input[1:5])
        eps = next((a.f for a in bn.attribute if a.name == "epsilon"), 1e-5)
        s = gamma / np.sqrt(var + eps)
        w = vals[conv.input[1]].astype(np.float64)
        b = vals[conv.input[2]].astype(np.float64) if len(conv.input) > 2 and conv.input[2] else np.zeros(len(s))
        wn, bname = f"{conv.name}.folded_w", f"{conv.name}.folded_b"
        g.initializer.extend([numpy_helper.from_array((w * s[:, None, None, None]).astype(np.float32), wn),
                              numpy_helper.from_array(((b - mean) * s + beta).astype(np.float32), bname)])
        out = rename(bn.output[0]) if rename else bn.output[0]
        conv.input[:] = [conv.input[0], wn, bname]
        conv.output[0] = out
        for n in g.node:
            n.input[:] = [out if t == bn.output[0] else t for t in n.input]
        for o in g.output:
            if o.name == bn.output[0]:
                o.name = out
        g.node.remove(bn)
    onnx.checker.check_model(m)
    return m


def planted_bug(model: onnx.ModelProto, conv_index: int, scale: float = 1.8, shift: float = 0.0) -> onnx.ModelProto:
    """The weights of the conv_index-th Conv / FusedConv scaled (a kernel bug)."""
    m = copy(model)
    conv = [n for n in m.graph.node if n.op_type in ("Conv", "FusedConv")][conv_index]
    for t in m.graph.initializer:
        if t.name == conv.input[1]:
            a = numpy_helper.to_array(t)
            t.CopyFrom(numpy_helper.from_array((a * scale + shift).astype(a.dtype), t.name))
            return m
    for n in m.graph.node:
        if n.op_type == "Constant" and n.output[0] == conv.input[1]:
            a = numpy_helper.to_array(n.attribute[0].t)
            n.attribute[0].t.CopyFrom(numpy_helper.from_array((a * scale + shift).astype(a.dtype)))
            return m
    raise AssertionError("the conv's weight is not a constant")


# bn_cnn's Convs as onnxruntime's x86 NCHWc transformer writes them: (conv,
# what it reads, its residual Sum input, activation, attributes, the
# reference tensor its output holds once the BN is folded in); the nodes
# they cover, and the NCHWc domain.
_NCHWC_CONVS = [
    ("conv1", "input", None, "Relu", {}, "relu1_out"),
    ("conv2", "relu1_out", None, "Relu", {}, "relu2_out"),
    ("conv3", "relu2_out", "relu1_out", "Relu", {}, "relu3_out"),
    ("conv4a", "relu3_out", None, "Clip", {"activation_params": [0.0, 6.0]}, "clip4a_out"),
    ("conv4b", "relu3_out", None, "LeakyRelu", {"activation_params": [0.1]}, "leaky4b_out"),
]
_NCHWC_COVERED = {"conv1", "conv2", "conv3", "conv4a", "conv4b", "relu1", "relu2", "relu3", "residual", "clip4a",
                  "leaky4b"}
NCHWC = "com.microsoft.nchwc"


def to_blocks(x: np.ndarray, block: int) -> np.ndarray:
    """An NCHW tensor as an NCHWc kernel holds it: channels padded with
    zeros to a multiple of ``block``, memory [N, C/block, H, W, block],
    declared [N, Cpad, H, W] (what a dump of it holds)."""
    n, c, h, w = x.shape
    cpad = -(-c // block) * block
    x = np.concatenate([x, np.zeros((n, cpad - c, h, w), x.dtype)], axis=1)
    return np.ascontiguousarray(x.reshape(n, cpad // block, block, h, w).transpose(0, 1, 3, 4, 2)).reshape(x.shape)


def _blocked_filter(w: np.ndarray, block: int, blocked_input: bool) -> np.ndarray:
    """OIHW weights padded to the block and reordered as NCHWc filters are
    (OIHWBiBo for a blocked input, OIHWBo for a plain one), in their
    declared [Opad, Ipad, H, W] shape."""
    cout, cin, kh, kw = w.shape
    opad = -(-cout // block) * block
    ipad = -(-cin // block) * block if blocked_input else cin
    wp = np.zeros((opad, ipad, kh, kw), np.float32)
    wp[:cout, :cin] = w
    if blocked_input:
        wp = wp.reshape(opad // block, block, ipad // block, block, kh, kw).transpose(0, 2, 4, 5, 3, 1)
    else:
        wp = wp.reshape(opad // block, block, ipad, kh, kw).transpose(0, 2, 3, 4, 1)
    return np.ascontiguousarray(wp).reshape(opad, ipad, kh, kw)


def _topological(nodes: list[onnx.NodeProto], inputs: set[str]) -> list[onnx.NodeProto]:
    made, out, left = set(inputs), [], list(nodes)
    while left:
        ready = [n for n in left if all(t in made for t in n.input if t)]
        assert ready, "the hand-built graph has a cycle"
        for n in ready:
            out.append(n)
            made.update(n.output)
            left.remove(n)
    return out


def nchwc_by_hand(model: onnx.ModelProto, block: int, reads: str) \
        -> tuple[onnx.ModelProto, dict[str, str], set[str]]:
    """bn_cnn (``model``) as onnxruntime's NCHWc transformer writes it for
    channel blocks of ``block`` (8 on AVX2 hosts, 16 on AVX-512 ones),
    built here so that every host tests both: each BN folded into its Conv,
    each Conv an NCHWc Conv with its activation fused (conv3 with the
    residual as its Sum input), outputs blocked and padded to the block,
    filters reordered into blocks, ReorderOutput where a plain op reads a
    blocked tensor. A Conv reads ``reads``: 'nchw' the plain tensor,
    'blocked' its producer's blocked output (the plain tensor then never
    exists on the device), 'reorder' a ReorderInput of the plain tensor.
    Returns the device model, the reference tensor each device tensor
    holds, and the blocked ones."""
    folded = fold_bn(model)
    vals = constants(folded)
    inits = [i for i in folded.graph.initializer if not i.name.endswith(("folded_w", "folded_b"))]
    nodes, truth, blocked = [], {}, set()
    held: dict[str, tuple[str, int]] = {}      # plain reference tensor -> (its blocked device tensor, channels)
    for conv, src, addend, act, attrs, out in _NCHWC_CONVS:
        w, b = vals[f"{conv}.folded_w"], vals[f"{conv}.folded_b"]
        x = src
        if src in held and reads == "blocked":
            x = held[src][0]
        elif src in held and reads == "reorder":
            x = f"{src}_reordered"
            if x not in truth:
                nodes.append(helper.make_node("ReorderInput", [src], [x], name=f"ReorderInput_{src}", domain=NCHWC))
                truth[x] = src
                blocked.add(x)
        opad = -(-len(b) // block) * block
        inits += [numpy_helper.from_array(_blocked_filter(w, block, x != src), f"{conv}_w_blocked"),
                  numpy_helper.from_array(np.pad(b, (0, opad - len(b))).astype(np.float32), f"{conv}_b_blocked")]
        y = f"{conv}_nchwc_out"
        nodes.append(helper.make_node(
            "Conv", [x, f"{conv}_w_blocked", f"{conv}_b_blocked"] + ([held[addend][0]] if addend else []), [y],
            name=f"{out}_nchwc", domain=NCHWC, pads=[w.shape[2] // 2] * 4, activation=act, **attrs))
        truth[y], held[out] = out, (y, len(b))
        blocked.add(y)
    rest = [n for n in folded.graph.node if n.name not in _NCHWC_COVERED]
    plain_reads = {t for n in rest for t in n.input}
    if reads != "blocked":
        plain_reads |= {src for _, src, _, _, _, _ in _NCHWC_CONVS}
    for plain, (y, channels) in held.items():
        if plain in plain_reads:
            nodes.append(helper.make_node("ReorderOutput", [y], [plain], name=f"ReorderOutput_{plain}",
                                          domain=NCHWC, channels=channels, channels_last=0))
            truth[plain] = plain
    truth.update({t: t for n in rest for t in n.output})
    given = {i.name for i in [*folded.graph.input, *inits]}
    graph = helper.make_graph(_topological(nodes + rest, given), "bn_cnn_nchwc", list(folded.graph.input),
                              list(folded.graph.output), initializer=inits)
    dev = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(NCHWC, 1)])
    dev.ir_version = 8
    return dev, truth, blocked


def ort_optimized(model: onnx.ModelProto, level: str, tmp_path) -> onnx.ModelProto:
    path = tmp_path / f"optimized_{level}.onnx"
    so = ort.SessionOptions()
    so.graph_optimization_level = LEVELS[level]
    so.optimized_model_filepath = str(path)
    so.log_severity_level = 3
    ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return onnx.load(str(path))


def all_outputs(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every node output, computed as the graph stands (no further optimization)."""
    m = copy(model)
    have = {o.name for o in m.graph.output}
    for n in m.graph.node:
        for t in n.output:
            if t and t not in have:
                m.graph.output.append(onnx.ValueInfoProto(name=t))
                have.add(t)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    if a.shape != b.shape:
        return -2.0
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0 or nb == 0:
        return 1.0 if na == nb else 0.0
    return float(a @ b / (na * nb))


def node_outputs(model: onnx.ModelProto) -> set[str]:
    return {t for n in model.graph.node if n.op_type != "Constant" for t in n.output if t}


def check_values(al: GraphAlignment, ref_vals: dict, dev_vals: dict, min_cos: float = 0.999) -> None:
    """Every pair holds the same values (up to a reshape the note names)."""
    def dev(d):      # in the reference's axis order where the graphs say the device moved them
        p = al.pairs[d]
        if p.blocked:    # in NCHW where the graphs say the device holds NCHWc blocks
            x, note = unblock_nchwc(dev_vals[d], ref_vals[p.ref_tensor])
            assert x is not None, (d, note)
            return x
        return dev_vals[d].transpose(p.perm) if p.perm else dev_vals[d]

    bad = {d: (p.ref_tensor, round(cosine(dev(d), ref_vals[p.ref_tensor]), 5))
           for d, p in al.pairs.items() if cosine(dev(d), ref_vals[p.ref_tensor]) <= min_cos}
    assert not bad, bad


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def detector() -> tuple[onnx.ModelProto, dict, dict]:
    model = onnx.load(str(packaged_model()))
    feeds = {"x": det_input(96, 128)}
    return model, feeds, all_outputs(model, feeds)


@pytest.fixture(scope="module")
def cnn() -> tuple[onnx.ModelProto, dict, dict]:
    model = bn_cnn()
    feeds = {"input": np.random.default_rng(1).standard_normal((1, 3, 16, 16)).astype(np.float32)}
    return model, feeds, all_outputs(model, feeds)


@pytest.fixture(params=["cnn", "detector"])
def subject(request):
    return request.getfixturevalue(request.param)


# ------------------------------------------------------------------ tests

def test_an_identical_copy_pairs_every_node_output_with_itself(subject):
    model, _, _ = subject
    al = align_graphs(model, model)
    assert isinstance(al, GraphAlignment) and all(isinstance(p, Pairing) for p in al.pairs.values())
    assert {d: p.ref_tensor for d, p in al.pairs.items()} == {t: t for t in node_outputs(model)}
    assert {p.method for p in al.pairs.values()} == {"graph"}
    assert min(p.confidence for p in al.pairs.values()) == 1.0
    assert not (al.fused or al.groups or al.ambiguous or al.unmatched)
    # graph inputs and constants are never paired
    assert not {i.name for i in model.graph.input} & set(al.pairs)


def test_tensors_renamed_to_numbers_pair_back_to_their_names(subject):
    model, _, _ = subject
    dev, names = renamed(model)
    al = align_graphs(model, dev)
    back = {new: old for old, new in names.items()}
    assert {back[d]: p.ref_tensor for d, p in al.pairs.items()} == {t: t for t in node_outputs(model)}
    assert not (al.ambiguous or al.unmatched)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_nodes_and_tensors_renamed_at_random_pair_back_exactly(seed, cnn, detector):
    for model, _, _ in (cnn, detector):
        dev, names = renamed(model, random.Random(seed), nodes=True)
        al = align_graphs(model, dev)
        back = {new: old for old, new in names.items()}
        got = {back[d]: p.ref_tensor for d, p in al.pairs.items()}
        wrong = {d: r for d, r in got.items() if d != r}
        assert not wrong and set(got) == node_outputs(model) and not al.ambiguous


@pytest.mark.parametrize("level", ["basic", "extended", "all"])
def test_onnxruntime_optimized_copies_pair_by_value(subject, level, tmp_path):
    """onnxruntime keeps the name of the tensor a fusion ends in, so the
    names are the ground truth here; the values confirm every pair, and a
    renamed copy of the optimized graph pairs the same way. What onnxruntime
    fuses, and whether and how it blocks channels (NCHWc), depends on the
    CPU: the NCHWc layouts themselves are built below, for every host."""
    model, feeds, ref_vals = subject
    dev = ort_optimized(model, level, tmp_path)
    al = align_graphs(model, dev)
    dev_vals = all_outputs(dev, feeds)
    check_values(al, ref_vals, dev_vals)
    ref_names = node_outputs(model)
    for d in node_outputs(dev) & ref_names:
        assert d in al.pairs and al.pairs[d].ref_tensor == d, (d, al.pairs.get(d), al.reasons.get(d))
    assert not al.ambiguous
    # every reference tensor is paired (NCHWc blocks too: check_values undid them) or fused away
    paired = {p.ref_tensor for p in al.pairs.values()}
    assert ref_names <= paired | set(al.fused)
    assert not set(al.fused) & paired
    for ref_t, nodes in al.groups.items():
        assert ref_t in paired and len(nodes) > 1
    for p in al.pairs.values():
        if p.method == "fused":
            assert p.ref_tensor in al.groups and "covers" in p.note
    # nothing is left unpaired; blocked tensors are paired as such, and said so
    assert not al.unmatched, {d: al.reasons[d] for d in al.unmatched}
    assert all("NCHWc" in p.note for p in al.pairs.values() if p.blocked)
    # structure, not names: the same graph with its tensors renamed pairs alike
    dev2, names = renamed(dev)
    al2 = align_graphs(model, dev2)
    assert {d: p.ref_tensor for d, p in al2.pairs.items()} == {names[d]: p.ref_tensor for d, p in al.pairs.items()}
    assert sorted(al2.unmatched) == sorted(names[d] for d in al.unmatched)


@pytest.mark.parametrize("reads", ["nchw", "blocked", "reorder"])
@pytest.mark.parametrize("block", [8, 16], ids=["avx2-block8", "avx512-block16"])
def test_nchwc_layouts_pair_every_blocked_tensor_on_any_host(cnn, block, reads):
    """onnxruntime's x86 NCHWc graphs for both channel blocks, whatever CPU
    runs the test: every blocked tensor (Conv outputs padded to the block,
    ReorderInput outputs) is paired with the reference tensor it holds, is
    marked blocked and said so, and its values, in the block's memory
    order, come back to the reference's NCHW; the Conv whose Sum input is
    the residual covers the Add and the Relu after it."""
    model, _, ref_vals = cnn
    dev, truth, blocked = nchwc_by_hand(model, block, reads)
    al = align_graphs(model, dev)
    assert {d: al.pairs[d].ref_tensor for d in truth if d in al.pairs} == truth
    assert {d for d, p in al.pairs.items() if p.blocked} == blocked
    assert all("NCHWc" in al.pairs[d].note for d in blocked)
    assert not (al.unmatched or al.ambiguous)
    dev_vals = {d: to_blocks(ref_vals[t], block) if d in blocked else ref_vals[t] for d, t in truth.items()}
    check_values(al, ref_vals, dev_vals, min_cos=1 - 1e-6)
    assert all(unblock_nchwc(dev_vals[d], ref_vals[truth[d]])[1].endswith(f"(block {block}) undone")
               for d in blocked)
    assert al.groups["relu3_out"] == ["conv3", "conv3_bn", "residual", "relu3"]
    assert {"conv3_out", "bn3_out", "res_out"} <= set(al.fused)
    dev2, names = renamed(dev)
    al2 = align_graphs(model, dev2)
    assert {d: p.ref_tensor for d, p in al2.pairs.items()} == {names[d]: p.ref_tensor for d, p in al.pairs.items()}


def test_extended_fusions_list_what_they_cover(cnn, tmp_path):
    model, _, _ = cnn
    al = align_graphs(model, ort_optimized(model, "extended", tmp_path))
    # FusedConv(Relu) over Conv→BN→Relu: the intermediates are never dumped
    assert al.pairs["relu1_out"].method == "fused"
    assert al.groups["relu1_out"] == ["conv1", "conv1_bn", "relu1"]
    assert al.fused["conv1_out"] == al.fused["bn1_out"] == "conv1"
    # the parallel branches are told apart by their activations
    assert al.pairs["clip4a_out"].ref_tensor == "clip4a_out"
    assert al.pairs["leaky4b_out"].ref_tensor == "leaky4b_out"
    # FusedGemm(Sigmoid) over MatMul→Add→Sigmoid
    assert al.groups["probs"] == ["fc/matmul", "fc/add", "sigmoid"]
    assert {al.fused["fc_mm"], al.fused["logits"]} == {al.fused["fc_mm"]}


@pytest.mark.parametrize("rename", [None, lambda t: "folded/" + t], ids=["keep-name", "rename"])
def test_batchnorm_folded_into_conv_pairs_with_the_bn_output(subject, rename):
    model, feeds, ref_vals = subject
    dev = fold_bn(model, rename)
    al = align_graphs(model, dev)
    check_values(al, ref_vals, all_outputs(dev, feeds))
    kept = {n.name for n in dev.graph.node}
    bns = [n for n in model.graph.node if n.op_type == "BatchNormalization" and n.name not in kept]
    assert bns
    for bn in bns:
        conv_out = bn.input[0]
        p = al.pairs[rename(bn.output[0]) if rename else bn.output[0]]
        assert p.ref_tensor == bn.output[0] and p.method == "fused" and p.confidence == 1.0, p
        assert "BatchNormalization" in p.note and "folded" in p.note
        assert al.fused[conv_out] and al.groups[bn.output[0]][-1] == bn.name
        assert all(q.ref_tensor != conv_out for q in al.pairs.values())


def test_a_folded_reference_pairs_with_the_unfolded_device(cnn):
    """The other way round (an onnxsim'd reference): the device BN's output
    is what the reference's folded Conv computes; the device Conv's is a
    partial result."""
    model, feeds, _ = cnn
    ref = fold_bn(model)
    al = align_graphs(ref, model)
    check_values(al, all_outputs(ref, feeds), all_outputs(model, feeds))
    assert al.pairs["bn1_out"].ref_tensor == "bn1_out" and al.pairs["bn1_out"].method == "fused"
    assert "conv1_out" in al.unmatched and "partial result" in al.reasons["conv1_out"]
    assert not al.ambiguous


@pytest.mark.parametrize("level", [None, "extended"])
def test_a_planted_weight_bug_does_not_move_any_pair(subject, level, tmp_path):
    model, _, _ = subject
    dev = ort_optimized(model, level, tmp_path) if level else model
    base = {d: p.ref_tensor for d, p in align_graphs(model, dev).pairs.items()}
    n_conv = sum(n.op_type in ("Conv", "FusedConv") for n in dev.graph.node)
    for k in sorted({0, n_conv // 2, n_conv - 1}):
        for scale, shift in ((1.8, 0.0), (1.8, 0.05)):
            buggy = planted_bug(dev, k, scale, shift)
            al = align_graphs(model, buggy)
            assert {d: p.ref_tensor for d, p in al.pairs.items()} == base
            conv = [n for n in buggy.graph.node if n.op_type in ("Conv", "FusedConv")][k]
            p = al.pairs[conv.output[0]]
            assert p.confidence < 1.0 and "weights" in p.note, p


def test_layernorm_gelu_and_skip_layernorm_fusions(tmp_path):
    model = mlp_block()
    feeds = {"x": np.random.default_rng(2).standard_normal((1, 8, 16)).astype(np.float32)}
    ref_vals = all_outputs(model, feeds)
    dev = ort_optimized(model, "extended", tmp_path)
    ops = {n.op_type for n in dev.graph.node}
    assert {"LayerNormalization", "Gelu", "SkipLayerNormalization"} <= ops
    al = align_graphs(model, dev)
    check_values(al, ref_vals, all_outputs(dev, feeds))
    assert not (al.ambiguous or al.unmatched)
    ln1 = al.pairs["ln1/add_out"]
    assert ln1.ref_tensor == "ln1/add_out" and ln1.method == "fused" and ln1.confidence == 1.0
    assert al.groups["ln1/add_out"][0] == "ln1/mean" and "ln1/div_out" in al.fused
    assert al.pairs["gelu/mul_half_out"].ref_tensor == "gelu/mul_half_out"
    assert al.groups["gelu/mul_half_out"] == ["gelu/div", "gelu/erf", "gelu/add", "gelu/mul", "gelu/mul_half"]
    assert al.groups["ln2/add_out"][0] == "residual" and "residual_out" in al.fused
    # MatMul+Add became Reshape→Gemm→Reshape: the 2-D Gemm output is the same elements
    flat = [p for p in al.pairs.values() if "another shape" in p.note]
    assert flat and all(p.ref_tensor in ("fc1/add_out", "fc2/add_out", "ln1/add_out", "gelu/mul_half_out")
                        for p in flat)


def test_attention_fusion_covers_the_self_attention():
    """One com.microsoft Attention node for Q/K/V, scores, mask, Softmax and
    context: compared with the merged context, everything inside listed as
    fused into it; the output projection pairs as itself."""
    model = attention_block()
    feeds = {"x": np.random.default_rng(2).standard_normal((1, 8, 16)).astype(np.float32),
             "mask": np.array([[1, 1, 1, 1, 1, 1, 0, 0]], np.int64)}
    dev, names = renamed(fuse_attention(model))
    back = {new: old for old, new in names.items()}
    dev_vals = {back.get(k, k): v for k, v in all_outputs(dev, {names[k]: v for k, v in feeds.items()}).items()}
    al = align_graphs(model, dev)
    pairs = {back[d]: p for d, p in al.pairs.items()}
    # the merged context: the heads' Transpose or the Reshape after it (the same elements)
    context = pairs["context/reshape_out"]
    assert context.ref_tensor in ("context/reshape_out", "context/transpose_out") and context.method == "fused"
    assert pairs["out/add_out"].ref_tensor == "out/add_out"
    assert {"softmax_out", "scores/add_mask_out", "q/transpose_out", "mask/unsqueeze_out"} <= set(al.fused)
    assert "softmax" in al.groups[context.ref_tensor]
    ref_vals = all_outputs(model, feeds)
    for d, p in pairs.items():
        assert cosine(dev_vals[d], ref_vals[p.ref_tensor]) > 0.9999, (d, p)


def test_fp16_and_int8_builds_pair_through_casts_and_quantizers(cnn):
    from layerdiff.collector.live.int8 import to_int8_qdq
    from layerdiff.collector.live.onnxrt import to_fp16

    model, feeds, ref_vals = cnn
    fp16 = to_fp16(model)
    al = align_graphs(model, fp16)
    check_values(al, ref_vals, all_outputs(fp16, feeds))
    assert set(al.pairs) >= node_outputs(model) - {"input"} and not al.ambiguous
    assert al.unmatched == [n.output[0] for n in fp16.graph.node if n.op_type == "Cast" and n.input[0] == "input"]

    int8 = to_int8_qdq(model, feeds)
    al = align_graphs(model, int8)
    check_values(al, ref_vals, all_outputs(int8, feeds), min_cos=0.99)
    assert not al.ambiguous
    # the quantizer drops the Relu its unsigned range clamps anyway: the
    # dequantized tensor stands for the Relu, the BN's for the BN
    bn = next(n for n in int8.graph.node if n.op_type == "BatchNormalization" and n.name == "conv1_bn")
    dq = next(n for n in int8.graph.node if n.op_type == "DequantizeLinear" and n.input[0].startswith(bn.output[0]))
    assert al.pairs[bn.output[0]].ref_tensor == "bn1_out"
    assert al.pairs[dq.output[0]].ref_tensor == "relu1_out"
    quantized = [d for d in al.unmatched if "quantized" in al.reasons[d]]
    assert quantized and all(d in al.layout_only for d in quantized)


def _dense_model(planted: str) -> onnx.ModelProto:
    """x -> MatMul(w1) + b -> mask Add -> Softmax -> MatMul(w2): weights large
    enough to travel without their data (64x64); ``planted``: w1 holds values
    below FP16's smallest subnormal ("tiny"), and beyond its largest too
    ("beyond")."""
    rng = np.random.default_rng(3)
    w1 = (rng.standard_normal((64, 64)) / 8).astype(np.float32)
    if planted in ("tiny", "beyond"):
        w1.ravel()[:4] = [1e-9, -2e-8, 3e-8, 0.0]
    if planted == "beyond":
        w1.ravel()[4:6] = [7e4, -1e6]
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array((rng.standard_normal(64) / 8).astype(
        np.float32), "b"), numpy_helper.from_array(np.full((1, 64), -3.4e38, np.float32), "mask"),
             numpy_helper.from_array((rng.standard_normal((64, 64)) / 8).astype(np.float32), "w2")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="dense1"),
             helper.make_node("Add", ["h", "b"], ["hb"], name="bias"),
             helper.make_node("Add", ["hb", "mask"], ["hm"], name="masked"),
             helper.make_node("Softmax", ["hm"], ["p"], name="softmax", axis=-1),
             helper.make_node("MatMul", ["p", "w2"], ["y"], name="dense2")]
    graph = helper.make_graph(nodes, "dense", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 64])], initializer=inits)
    return opset17(graph)


@pytest.mark.parametrize("planted", ["none", "tiny", "beyond"])
def test_the_fp16_build_is_onnxruntimes_and_its_weights_pair_by_name(planted):
    """The FP16 build cast here is onnxruntime's converter's byte for byte
    (weights below FP16's smallest subnormal, beyond its largest, a -3.4e38
    mask); the weights.csv rows made by pairing its nodes by name are those
    of the full alignment; and sessions handed the weights in memory compute
    what sessions of the serialized models compute."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    from layerdiff.analyzer.align.graph import weights_by_name
    from layerdiff.analyzer.diagnose import weights
    from layerdiff.collector.live.onnxrt import to_fp16
    from layerdiff.common.onnxgraph import expose_all_outputs, lean_session

    model = _dense_model(planted)
    theirs = convert_float_to_float16(onnx.ModelProto.FromString(model.SerializeToString()), keep_io_types=True)
    ours = to_fp16(model)
    assert ours.SerializeToString() == theirs.SerializeToString()
    key = lambda r: (r["reference_node"], r["reference_weight"])   # noqa: E731
    by_name = sorted(weights.compare(weights_by_name(model, ours).weights), key=key)
    aligned = sorted(weights.compare(align_graphs(model, ours).weights), key=key)
    assert [str(r) for r in by_name] == [str(r) for r in aligned]
    relations = {r["reference_weight"]: r["relation"] for r in by_name}
    assert relations["mask"] == "clamped" and relations["w2"] == "rounded"
    assert relations["w1"] == ("clamped" if planted == "beyond" else "rounded")
    feeds = {"x": np.random.default_rng(4).standard_normal((1, 8, 64)).astype(np.float32)}
    for m in (model, ours):
        exposed = expose_all_outputs(onnx.ModelProto.FromString(m.SerializeToString()))
        plain = ort.InferenceSession(exposed.SerializeToString(), providers=["CPUExecutionProvider"])
        lean = lean_session(m, ort.SessionOptions(), ["CPUExecutionProvider"], edit=expose_all_outputs)
        assert len(lean.layerdiff_weights) == 2      # w1 and w2 handed over in memory
        for a, b in zip(plain.run(None, feeds), lean.run(None, feeds)):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize("values", [
    [1e-9, -1e-9, 3e-8, -3e-8, 1e-30, 0.0, -0.0, 1.0],     # flushed to zero, kept at the smallest subnormal
    [7e4, -7e4, 65519.0, 65521.0, 3.4e38, -3.4e38, 1.0],    # beyond FP16's range, clamped
    [np.nan, np.inf, -np.inf, 1e-9, 7e4, 2.0],              # kept as they are, beside values to fix
    [np.nan, 1.0], [-0.0, 0.5], [],
])
def test_the_fp16_weight_cast_is_the_converters_on_edge_values(values):
    """The fast cast's shortcut (no fix when the counts of non-zeros and the
    range say none is needed) gives onnxruntime's converter's bytes."""
    from onnxruntime.transformers.float16 import convert_np_to_float16

    from layerdiff.collector.live.onnxrt import fp16_weight

    rng = np.random.default_rng(7)
    for dtype in (np.float32, np.float64):
        w = np.concatenate([rng.standard_normal(300), np.asarray(values, np.float64)]).astype(dtype)
        rng.shuffle(w)
        with np.errstate(all="ignore"):
            theirs = convert_np_to_float16(w)
        assert fp16_weight(w).tobytes() == theirs.tobytes()


@pytest.mark.parametrize("which", ["cnn", "mlp", "detector"])
def test_onnxsim_either_side(which, request):
    onnxsim = pytest.importorskip("onnxsim")
    if which == "mlp":
        model = mlp_block()
        feeds = {"x": np.random.default_rng(2).standard_normal((1, 8, 16)).astype(np.float32)}
    else:
        model, feeds, _ = request.getfixturevalue(which)
    sim, ok = onnxsim.simplify(model)
    assert ok
    for ref, dev in ((model, sim), (sim, model)):
        al = align_graphs(ref, dev)
        check_values(al, all_outputs(ref, feeds), all_outputs(dev, feeds))
        assert not al.ambiguous
        paired = {p.ref_tensor for p in al.pairs.values()}
        assert node_outputs(ref) <= paired | set(al.fused)
        for d in al.unmatched:      # only device tensors the reference computes inside one node
            assert "partial result" in al.reasons[d] or "inside reference node" in al.reasons[d], al.reasons[d]


def twin_branches(join: str) -> onnx.ModelProto:
    """x → Conv → Relu twice, with equal weights, joined by ``join``."""
    w = np.full((4, 3, 3, 3), 0.1, np.float32)
    inits = [numpy_helper.from_array(w, "wa"), numpy_helper.from_array(w.copy(), "wb")]
    nodes = [helper.make_node("Conv", ["x", "wa"], ["a"], name="conv_a", pads=[1] * 4),
             helper.make_node("Relu", ["a"], ["ra"], name="relu_a"),
             helper.make_node("Conv", ["x", "wb"], ["b"], name="conv_b", pads=[1] * 4),
             helper.make_node("Relu", ["b"], ["rb"], name="relu_b"),
             helper.make_node(join, ["ra", "rb"], ["y"], name="join", **({"axis": 1} if join == "Concat" else {}))]
    graph = helper.make_graph(nodes, "twins", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_identical_branches_stay_ambiguous_unless_something_tells_them_apart():
    model = twin_branches("Add")
    dev, names = renamed(model, random.Random(1), nodes=True)
    al = align_graphs(model, dev)
    back = {new: old for old, new in names.items()}
    assert {back[d]: p.ref_tensor for d, p in al.pairs.items()} == {"y": "y"}
    assert sorted((back[d], sorted(c)) for d, c, _ in al.ambiguous) == [
        ("a", ["a", "b"]), ("b", ["a", "b"]), ("ra", ["ra", "rb"]), ("rb", ["ra", "rb"])]
    assert all("equally" in why for _, _, why in al.ambiguous)
    # the node names break the tie (tensors still renamed)
    dev, names = renamed(model)
    al = align_graphs(model, dev)
    assert {names[t]: t for t in ("a", "b", "ra", "rb", "y")} == {d: p.ref_tensor for d, p in al.pairs.items()}
    # an ordered reader (Concat) tells them apart, back to the Convs
    model = twin_branches("Concat")
    dev, names = renamed(model, random.Random(2), nodes=True)
    al = align_graphs(model, dev)
    back = {new: old for old, new in names.items()}
    assert {back[d]: p.ref_tensor for d, p in al.pairs.items()} == {t: t for t in ("a", "b", "ra", "rb", "y")}
    assert not al.ambiguous


def test_a_weighted_node_re_anchors_after_what_cannot_be_followed(cnn):
    """A vendor op the walk cannot follow (relu1 run as a custom kernel):
    the next Conv, whose weight is unique, takes the walk up again; nothing
    is paired wrongly on the way, and the anchored pair says how sure it is."""
    model, _, _ = cnn
    dev, names = renamed(model)
    relu = next(n for n in dev.graph.node if n.op_type == "Relu")
    relu.op_type, relu.domain = "NpuActivation", "vendor.npu"
    dev.opset_import.append(helper.make_opsetid("vendor.npu", 1))
    al = align_graphs(model, dev)
    back = {new: old for old, new in names.items()}
    got = {back[d]: p.ref_tensor for d, p in al.pairs.items()}
    assert not {d: r for d, r in got.items() if d != r}
    assert set(got) == node_outputs(model)
    # the custom op's output is what conv2 reads: paired through conv2's weights, less sure
    anchored = [d for d, p in al.pairs.items() if "weights of its reader" in p.note]
    assert [back[d] for d in anchored] == ["relu1_out"]
    assert al.pairs[names["relu1_out"]].confidence < 1.0


@pytest.mark.parametrize("level", ["basic", "extended", "all"])
def test_transposes_moved_past_slices_are_followed(tmp_path, level):
    """The PP-OCR recognizer: onnxruntime's transpose optimizer pushes the
    attention's Transposes down through Slice and Squeeze and merges them
    with the next one. The walk follows: the moved tensors pair with the
    reference tensors they hold with their axes permuted (and say how), and
    everything after them pairs as before."""
    model = onnx.load(str(packaged_model("ch_PP-OCRv4_rec_infer.onnx")))
    feeds = {"x": np.random.default_rng(3).standard_normal((1, 3, 48, 160)).astype(np.float32)}
    dev = ort_optimized(model, level, tmp_path)
    al = align_graphs(model, dev)
    check_values(al, all_outputs(model, feeds), all_outputs(dev, feeds))
    assert not al.ambiguous
    moved = {d: p for d, p in al.pairs.items() if p.perm and "before the Transpose" in p.note}
    assert len(moved) >= 4, moved
    assert not al.unmatched, {d: al.reasons[d] for d in al.unmatched}   # NCHWc blocks (ALL on x86) are paired
    ref_computed = {t for t in node_outputs(model) if t not in _meta_tensors(model)}
    paired = {p.ref_tensor for p in al.pairs.values()}
    assert ref_computed <= paired | set(al.fused)


def _meta_tensors(model: onnx.ModelProto) -> set[str]:
    """Constants and shape computations (what Shape and Size feed), which a
    device folds into constants."""
    const = {i.name for i in model.graph.initializer}
    meta: set[str] = set()
    for _ in range(len(model.graph.node)):        # the file's node order need not be topological
        before = len(const) + len(meta)
        for n in model.graph.node:
            ins = [t for t in n.input if t]
            if n.op_type == "Constant" or (ins and all(t in const for t in ins)):
                const.update(n.output)
            elif n.op_type in ("Shape", "Size") or (ins and all(t in meta or t in const for t in ins)):
                meta.update(n.output)
        if len(const) + len(meta) == before:
            break
    return meta | const


def test_weights_kept_as_stored_are_equal_rows_and_one_changed_value_is_not():
    """A device model that keeps most weights byte for byte (renamed or not)
    and changes one value of another: weights.csv says ``equal`` with the
    element count for the kept ones, and ``different`` with one element
    differing for the changed one, whatever the device calls its weights."""
    from layerdiff.analyzer.diagnose import weights

    model = _dense_model("none")
    for rename in (False, True):
        dev = onnx.ModelProto.FromString(model.SerializeToString())
        w2 = next(i for i in dev.graph.initializer if i.name == "w2")
        changed = numpy_helper.to_array(w2).copy()
        changed.flat[5] += 1.0
        w2.CopyFrom(numpy_helper.from_array(changed, "w2"))
        if rename:
            for init in dev.graph.initializer:
                for n in dev.graph.node:
                    n.input[:] = [f"dev_{t}" if t == init.name else t for t in n.input]
                init.name = f"dev_{init.name}"
        rows = {r["reference_weight"]: r for r in weights.compare(align_graphs(model, dev).weights)}
        assert rows["w1"]["relation"] == "equal" and rows["w1"]["elements"] == 64 * 64, rows["w1"]
        assert rows["w1"]["device_weight"] == ("dev_w1" if rename else "w1")
        assert rows["w2"]["relation"] == "different" and rows["w2"]["differing"] == 1, rows["w2"]
