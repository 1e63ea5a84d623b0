"""(e) Small models: the whole `layerdiff run` against a plain script doing
the same work in the same run, on a MiniLM-shaped encoder (414 nodes, about
15 MB of node outputs) and a 3-node model, both built to FP16.

The plain script is what an engineer would write by hand: onnxruntime's
FP16 converter, one session of each model with every node output marked,
one run each, and a comparison of every output (cosine, largest
difference). Both are whole processes, run in turn (A B A B ...), and the
ratio is taken pair by pair, so that a drift of the machine's speed cancels;
the goal is a median ratio of at most 2. The per-node overhead is how the
time beyond the script grows from the 3-node model to the 414-node one
(goal: under 1 ms); what both pay alike is the job's fixed start-up.

A toy model's weights hide the costs that grow with them: MiniLM-L6 at its
real dimensions (22.4 M parameters, 90 MB of FP32 weights, random values)
is run three ways, as a device model with a planted bug, as an FP16 build
and as an INT8 build, each against the script doing the same by hand
(goal: within 1.5x its wall time and its peak memory).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).parent))
from procs import bytecode_ready, timed  # noqa: E402
from smallmodel import minilm, minilm_inputs  # noqa: E402

# The same work by hand, for each way a model is run (a device model, an FP16
# or an INT8 build): the reference and the device, each one session with
# every node output marked, one run each, every output compared.
PLAIN = textwrap.dedent('''
    import sys
    import numpy as np, onnx, onnxruntime as ort

    def every_output(model, feeds):
        names = [t for n in model.graph.node for t in n.output if t]
        del model.graph.output[:]
        model.graph.output.extend(onnx.ValueInfoProto(name=t) for t in names)
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        return dict(zip(names, sess.run(None, feeds)))

    way, path, inputs = sys.argv[1], sys.argv[2], sys.argv[3]
    feeds = dict(np.load(inputs))
    if way == "device":
        device = onnx.load(sys.argv[4])
    elif way == "fp16":
        from onnxruntime.transformers.float16 import convert_float_to_float16
        device = convert_float_to_float16(onnx.load(path), keep_io_types=True)
    else:
        import tempfile
        from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

        class One(CalibrationDataReader):
            def __init__(self):
                self.left = [feeds]

            def get_next(self):
                return self.left.pop() if self.left else None

        with tempfile.TemporaryDirectory() as tmp:
            quantize_static(path, tmp + "/q.onnx", One(), quant_format=QuantFormat.QDQ,
                            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
            device = onnx.load(tmp + "/q.onnx")
    ref = every_output(onnx.load(path), feeds)
    dev = every_output(device, feeds)
    failing = 0
    with np.errstate(all="ignore"):
        for name, r in ref.items():
            d = dev.get(name)
            if d is None or r.dtype.kind != "f" or d.shape != r.shape:
                continue
            r64, d64 = r.astype(np.float64).ravel(), d.astype(np.float64).ravel()
            cos = r64 @ d64 / (np.linalg.norm(r64) * np.linalg.norm(d64))
            failing += not (cos >= 0.99 and np.max(np.abs(d64 - r64), initial=0) < 1)
    print(len(ref), failing)
''')
WAYS = ("device", "fp16", "int8")


def tiny() -> onnx.ModelProto:
    """Conv -> Relu -> Add (3 nodes)."""
    rng = np.random.default_rng(0)
    w = helper.make_tensor("w", TensorProto.FLOAT, [8, 3, 3, 3], rng.standard_normal(216).astype(np.float32))
    b = helper.make_tensor("b", TensorProto.FLOAT, [1], [0.5])
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Add", ["r", "b"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 32, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 32, 32])],
                              initializer=[w, b])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def bench_model(work: Path, name: str, model: onnx.ModelProto, feeds: dict, runs: int) -> dict:
    path, inputs, plain = work / f"{name}.onnx", work / f"{name}.npz", work / "plain.py"
    onnx.save_model(model, str(path))
    np.savez(inputs, **feeds)
    plain.write_text(PLAIN)
    bin_dir = Path(sys.executable).parent
    ours_cmd = [str(bin_dir / "layerdiff"), "run", str(path), "--inputs", str(inputs), "--precision", "fp16",
                "--out", str(work / f"{name}-out"), "--no-progress"]
    plain_cmd = [sys.executable, str(plain), "fp16", str(path), str(inputs)]
    d = _paired(ours_cmd, plain_cmd, runs)
    summary = json.loads((work / f"{name}-out" / "summary.json").read_text())
    return {"model": name, "nodes": summary["counts"]["reference_tensors"],
            "node_output_MB": sum(a.nbytes for a in _all_outputs(model, feeds).values()) / 1e6, **d,
            "graph_nodes": len(model.graph.node), "overhead_s": d["layerdiff_wall_s"] - d["plain_wall_s"],
            "goal": "wall_ratio_median <= 2"}


def _paired(ours_cmd: list[str], plain_cmd: list[str], runs: int) -> dict:
    """Both commands in turn (A B A B ...) after a warm-up of each (file
    caches, compiled kernels): medians and pair-by-pair ratios."""
    timed(ours_cmd), timed(plain_cmd)
    ours, base = [], []
    for _ in range(runs):
        ours.append(timed(ours_cmd))
        base.append(timed(plain_cmd))
    wall = [o[0] / b[0] for o, b in zip(ours, base)]
    return {"layerdiff_wall_s": statistics.median(o[0] for o in ours),
            "plain_wall_s": statistics.median(b[0] for b in base),
            "layerdiff_peak_rss_MiB": statistics.median(o[1] for o in ours) / 2**20,
            "plain_peak_rss_MiB": statistics.median(b[1] for b in base) / 2**20,
            "wall_ratio_median": statistics.median(wall), "wall_ratio_min": min(wall), "wall_ratio_max": max(wall),
            "rss_ratio_median": statistics.median(o[1] / b[1] for o, b in zip(ours, base))}


def bench_real_size(work: Path, runs: int) -> list[dict]:
    """MiniLM-L6's dimensions and weights (random): the whole `layerdiff run`
    against the plain script, as a device model with a planted bug, as an
    FP16 build and as an INT8 build. Goal: within 1.5x the script's wall
    time and peak memory in each way."""
    from onnx import numpy_helper

    model = minilm(layers=6, vocab=30522)
    feeds = minilm_inputs(vocab=30522)
    path, inputs, plain, device = work / "minilm6.onnx", work / "minilm6.npz", work / "ways.py", work / "dev6.onnx"
    onnx.save_model(model, str(path))
    for init in model.graph.initializer:      # a kernel bug: one projection's weights 10 % off
        if init.name == "layer.2/attention/value.w":
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(1.1), init.name))
    onnx.save_model(model, str(device))
    np.savez(inputs, **feeds)
    plain.write_text(PLAIN)
    bin_dir = Path(sys.executable).parent
    out = []
    for way in WAYS:
        extra = ["--device-model", str(device)] if way == "device" else ["--precision", way]
        ours_cmd = [str(bin_dir / "layerdiff"), "run", str(path), "--inputs", str(inputs), *extra,
                    "--out", str(work / f"real-{way}"), "--no-progress"]
        plain_cmd = [sys.executable, str(plain), way, str(path), str(inputs)] + ([str(device)] if way == "device"
                                                                                else [])
        d = _paired(ours_cmd, plain_cmd, runs)
        summary = json.loads((work / f"real-{way}" / "summary.json").read_text())
        out.append({"model": "minilm6", "way": way, "weights_MB": path.stat().st_size / 1e6,
                    "nodes": summary["counts"]["reference_tensors"], "job_elapsed_s": summary.get("elapsed_s"), **d,
                    "goal": "wall_ratio_median <= 1.5 and rss_ratio_median <= 1.5"})
    return out


def _all_outputs(model: onnx.ModelProto, feeds: dict) -> dict:
    from layerdiff.analyzer.reference.onnxrt import OnnxReference

    return OnnxReference(model.SerializeToString()).run(feeds)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--real-size-only", action="store_true", help="only MiniLM-L6 with its real-size weights")
    a = ap.parse_args(argv)
    bytecode_ready()
    out = []
    with tempfile.TemporaryDirectory(prefix="layerdiff-bench-small-") as tmp:
        real = bench_real_size(Path(tmp), a.runs)
        for d in real:
            print(f"(e) MiniLM-L6 ({d['weights_MB']:.0f} MB of weights, {d['nodes']} tensors) as {d['way']}: "
                  f"layerdiff run {d['layerdiff_wall_s']:.2f} s {d['layerdiff_peak_rss_MiB']:.0f} MiB (job "
                  f"{d['job_elapsed_s']} s), plain script {d['plain_wall_s']:.2f} s {d['plain_peak_rss_MiB']:.0f} "
                  f"MiB: ratio wall {d['wall_ratio_median']:.2f}, peak RSS {d['rss_ratio_median']:.2f} (goal <= 1.5)")
        if a.real_size_only:
            print(json.dumps({"real_size": real}))
            return {"real_size": real}
        for name, model, feeds in (("minilm", minilm(), minilm_inputs()),
                                   ("tiny", tiny(), {"x": np.random.default_rng(1).standard_normal(
                                       (1, 3, 32, 32)).astype(np.float32)})):
            d = bench_model(Path(tmp), name, model, feeds, a.runs)
            out.append(d)
            print(f"(e) {name}: {d['nodes']} nodes, {d['node_output_MB']:.1f} MB of node outputs, FP32 vs FP16 build")
            print(f"    layerdiff run {d['layerdiff_wall_s']:6.2f} s {d['layerdiff_peak_rss_MiB']:6.0f} MiB")
            print(f"    plain script  {d['plain_wall_s']:6.2f} s {d['plain_peak_rss_MiB']:6.0f} MiB")
            print(f"    ratio wall {d['wall_ratio_median']:.2f} (min {d['wall_ratio_min']:.2f}, max "
                  f"{d['wall_ratio_max']:.2f}; goal <= 2), peak RSS {d['rss_ratio_median']:.2f}; "
                  f"{d['overhead_s']:.2f} s beyond the script")
    big, small = out
    # The time beyond the script grows with the node count by this much: the
    # per-node cost, apart from what every job pays once (start-up).
    per_node = 1000 * (big["overhead_s"] - small["overhead_s"]) / (big["graph_nodes"] - small["graph_nodes"])
    print(f"(e) per-node overhead beyond the script {per_node:.2f} ms (goal < 1); the rest, "
          f"{small['overhead_s']:.2f} s, is paid once per job")
    result = {"small": out, "real_size": real, "per_node_overhead_ms": per_node, "goal": "per_node_overhead_ms < 1"}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

