"""A MiniLM-shaped encoder (random weights): embeddings in, per-token logits
out; per layer multi-head self-attention with a mask, a GELU feed-forward
block and two LayerNorms. The shapes of MiniLM-L12 (hidden 384, 12 heads,
intermediate 1536) with 16 tokens: about 15 MB of node outputs.

With ``vocab`` (30522: MiniLM's), token ids come in and a word-embedding
table (plus position embeddings) makes the first activations: with 6
layers, MiniLM-L6's 22.7 M parameters, 90 MB of FP32 weights."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def minilm(layers: int = 12, hidden: int = 384, heads: int = 12, seq: int = 16, ffn: int = 1536,
           seed: int = 0, vocab: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []

    def const(name, arr, dtype=np.float32):
        inits.append(numpy_helper.from_array(np.asarray(arr, dtype), name))
        return name

    def node(op, ins, name, **attrs):
        nodes.append(helper.make_node(op, ins, [name + "_out"], name=name, **attrs))
        return name + "_out"

    def dense(x, n_in, n_out, name):
        w = const(f"{name}.w", rng.standard_normal((n_in, n_out)) / np.sqrt(n_in))
        bias = const(f"{name}.b", rng.standard_normal(n_out) * .1)
        return node("Add", [node("MatMul", [x, w], f"{name}/matmul"), bias],
                    f"{name}/add")

    def norm(x, name):
        return node("LayerNormalization", [x, const(f"{name}.g", rng.uniform(.8, 1.2, hidden)),
                                           const(f"{name}.b", rng.uniform(-.1, .1, hidden))], name, axis=-1,
                    epsilon=1e-12)

    d = hidden // heads
    m = node("Sub", [const("one", 1.0), node("Cast", ["mask"], "mask/cast", to=TensorProto.FLOAT)], "mask/sub")
    m = node("Mul", [m, const("mask_min", -3.4e38)], "mask/mul")
    m = node("Unsqueeze", [m, const("mask_axes", [1, 2], np.int64)], "mask/unsqueeze")
    split = const("heads_shape", [1, seq, heads, d], np.int64)
    merge = const("merge_shape", [1, seq, hidden], np.int64)
    first = "x"
    if vocab:
        words = node("Gather", [const("embeddings/word.w", rng.standard_normal((vocab, hidden)) * .05),
                                "input_ids"], "embeddings/word")
        first = node("Add", [words, const("embeddings/position.w", rng.standard_normal((seq, hidden)) * .05)],
                     "embeddings/position")
    x = norm(first, "embeddings/ln")
    for layer in range(layers):
        p = f"layer.{layer}"
        hs = {}
        for k in ("query", "key", "value"):
            h = node("Reshape", [dense(x, hidden, hidden, f"{p}/attention/{k}"), split], f"{p}/attention/{k}/reshape")
            hs[k] = node("Transpose", [h], f"{p}/attention/{k}/transpose",
                         perm=[0, 2, 3, 1] if k == "key" else [0, 2, 1, 3])
        s = node("MatMul", [hs["query"], hs["key"]], f"{p}/attention/scores")
        s = node("Div", [s, const(f"{p}.scale", np.sqrt(d))], f"{p}/attention/scaled")
        s = node("Add", [s, m], f"{p}/attention/masked")
        c = node("MatMul", [node("Softmax", [s], f"{p}/attention/softmax", axis=-1), hs["value"]],
                 f"{p}/attention/context")
        c = node("Reshape", [node("Transpose", [c], f"{p}/attention/context/transpose", perm=[0, 2, 1, 3]), merge],
                 f"{p}/attention/context/reshape")
        x = norm(node("Add", [dense(c, hidden, hidden, f"{p}/attention/output"), x], f"{p}/attention/residual"),
                 f"{p}/attention/ln")
        h = dense(x, hidden, ffn, f"{p}/intermediate")
        # GELU, erf form: 0.5 * h * (1 + erf(h / sqrt(2)))
        g = node("Erf", [node("Div", [h, const(f"{p}.sqrt2", np.sqrt(2.0))], f"{p}/gelu/div")], f"{p}/gelu/erf")
        g = node("Mul", [node("Mul", [h, node("Add", [g, const(f"{p}.one", 1.0)], f"{p}/gelu/add")], f"{p}/gelu/mul"),
                         const(f"{p}.half", 0.5)], f"{p}/gelu/half")
        x = norm(node("Add", [dense(g, ffn, hidden, f"{p}/output"), x], f"{p}/output/residual"), f"{p}/output/ln")
    node("MatMul", [x, const("head.w", rng.standard_normal((hidden, 6)) / np.sqrt(hidden))], "head")
    entry = helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, seq]) if vocab else \
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, seq, hidden])
    graph = helper.make_graph(nodes, "minilm",
                              [entry, helper.make_tensor_value_info("mask", TensorProto.INT64, [1, seq])],
                              [helper.make_tensor_value_info("head_out", TensorProto.FLOAT, [1, seq, 6])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def minilm_inputs(hidden: int = 384, seq: int = 16, seed: int = 7, vocab: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.ones((1, seq), np.int64)
    mask[0, seq - seq // 8:] = 0
    if vocab:
        return {"input_ids": rng.integers(0, vocab, (1, seq), dtype=np.int64), "mask": mask}
    return {"x": rng.standard_normal((1, seq, hidden)).astype(np.float32), "mask": mask}
