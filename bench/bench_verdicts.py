"""(h) Calibration of the verdicts: clean runs must not be called broken,
planted bugs must be named at the node that has them.

Six architectures, each run as a device in FP32 (the model itself), FP16
(onnxruntime's converter), BF16, TF32 (emulated builds) and INT8 (static
QDQ):

- ``cnn``: a ResNet-style network (Conv-BN-Relu blocks, residual Adds),
  random weights, 64x64;
- ``depthwise``: PP-OCR's text direction classifier (MobileNet-style
  depthwise convolutions), its shipped weights;
- ``detector``: PP-OCRv4's text detector (a segmentation head over an
  FPN), its shipped weights, 96x128;
- ``transformer``: a MiniLM-shaped encoder with an attention mask that
  hides a third of the tokens, random weights;
- ``layernorm``: PP-OCRv4's text recognizer (SVTR blocks: LayerNorm,
  attention, MLP), its shipped weights;
- ``mlp``: an MLP of GELU and LayerNorm blocks, random weights.

For each (architecture, precision): the clean device, then bugs planted at
random sites (tests/planted.py: a block of channels scaled by 1.02 to 2,
a tile zeroed, a tile transposed, a bias permuted, an epsilon changed).
Every device is dumped once and judged twice: by ``layerdiff run`` with the
model (isolated re-runs), by ``layerdiff compare`` against the FP32 golden
dump with the model lending its graph (isolated re-runs too) and without
it (growth beyond what each node read). Reported: false "Computation error" headlines on
clean devices, and for bugs the share named at the right node, by kind and
magnitude (goals: none false; >= 95 % of bugs of at least 5 % on at least
1/16 of a tensor named, in every kind of job; on FP32 devices every bug of
1 % or more).

    .venv/bin/python bench/bench_verdicts.py [--bugs N] [--quick] [--arch cnn,...] [--precision fp16,...]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from planted import KINDS, build, device_dump, eligible, plant, reference_shapes  # noqa: E402
from smallmodel import minilm, minilm_inputs  # noqa: E402

from layerdiff.client.api import compare, run  # noqa: E402
from layerdiff.client.demo import DET_MODEL, REC_MODEL, det_input, packaged_model  # noqa: E402

CLS_MODEL = "ch_ppocr_mobile_v2.0_cls_infer.onnx"

PRECISIONS = ("fp32", "fp16", "bf16", "tf32", "int8")
FACTORS = (1.02, 1.05, 1.1, 1.2, 1.5, 2.0)
SOURCE_DTYPE = {"bf16": "bfloat16"}


def _cnn(seed: int = 0, width: int = 32, side: int = 64) -> tuple[onnx.ModelProto, dict]:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def const(name, arr):
        inits.append(numpy_helper.from_array(np.asarray(arr, np.float32), name))
        return name

    def conv_bn_relu(x, cin, cout, name, stride=1, relu=True):
        w = const(f"{name}.w", rng.standard_normal((cout, cin, 3, 3)) * np.sqrt(2.0 / (cin * 9)))
        nodes.append(helper.make_node("Conv", [x, w], [f"{name}_conv"], name=f"{name}/conv", pads=[1] * 4,
                                      strides=[stride] * 2))
        stats = (("g", rng.uniform(.5, 1.5, cout)), ("b", rng.uniform(-.2, .2, cout)),
                 ("m", rng.uniform(-.1, .1, cout)), ("v", rng.uniform(.5, 1.5, cout)))
        bn = [const(f"{name}.{k}", v) for k, v in stats]
        nodes.append(helper.make_node("BatchNormalization", [f"{name}_conv", *bn], [f"{name}_bn"], name=f"{name}/bn",
                                      epsilon=1e-5))
        if not relu:
            return f"{name}_bn"
        nodes.append(helper.make_node("Relu", [f"{name}_bn"], [f"{name}_relu"], name=f"{name}/relu"))
        return f"{name}_relu"

    x = conv_bn_relu("input", 3, width, "stem")
    c = width
    for stage in range(3):
        out_c = c * (2 if stage else 1)
        stride = 2 if stage else 1
        h = conv_bn_relu(x, c, out_c, f"s{stage}/a", stride)
        h = conv_bn_relu(h, out_c, out_c, f"s{stage}/b", relu=False)
        skip = x if stride == 1 and out_c == c else conv_bn_relu(x, c, out_c, f"s{stage}/down", stride, relu=False)
        nodes.append(helper.make_node("Add", [h, skip], [f"s{stage}_sum"], name=f"s{stage}/add"))
        nodes.append(helper.make_node("Relu", [f"s{stage}_sum"], [f"s{stage}_out"], name=f"s{stage}/relu"))
        x, c = f"s{stage}_out", out_c
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["pooled"], name="pool"))
    nodes.append(helper.make_node("Flatten", ["pooled"], ["flat"], name="flatten"))
    nodes.append(helper.make_node("Gemm", ["flat", const("fc.w", rng.standard_normal((10, c)) / np.sqrt(c)),
                                           const("fc.b", rng.standard_normal(10) * .1)], ["logits"], name="fc",
                                  transB=1))
    g = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, side, side])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    feeds = {"input": np.random.default_rng(seed + 1).standard_normal((1, 3, side, side)).astype(np.float32)}
    return m, feeds


def _mlp(seed: int = 0, hidden: int = 256, layers: int = 4, batch: int = 32) -> tuple[onnx.ModelProto, dict]:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def const(name, arr):
        inits.append(numpy_helper.from_array(np.asarray(arr, np.float32), name))
        return name

    def node(op, ins, name, **kw):
        nodes.append(helper.make_node(op, ins, [name + "_out"], name=name, **kw))
        return name + "_out"

    x = "x"
    for k in range(layers):
        h = node("LayerNormalization", [x, const(f"l{k}.g", rng.uniform(.8, 1.2, hidden)),
                                        const(f"l{k}.b", rng.uniform(-.1, .1, hidden))], f"l{k}/ln", axis=-1,
                 epsilon=1e-5)
        h = node("MatMul", [h, const(f"l{k}.w1", rng.standard_normal((hidden, 4 * hidden)) / np.sqrt(hidden))],
                 f"l{k}/fc1")
        h = node("Add", [h, const(f"l{k}.b1", rng.standard_normal(4 * hidden) * .1)], f"l{k}/fc1/add")
        e = node("Erf", [node("Div", [h, const(f"l{k}.sqrt2", np.sqrt(2.0))], f"l{k}/gelu/div")], f"l{k}/gelu/erf")
        h = node("Mul", [node("Mul", [h, node("Add", [e, const(f"l{k}.one", 1.0)], f"l{k}/gelu/add")],
                              f"l{k}/gelu/mul"), const(f"l{k}.half", 0.5)], f"l{k}/gelu")
        h = node("MatMul", [h, const(f"l{k}.w2", rng.standard_normal((4 * hidden, hidden)) / np.sqrt(4 * hidden))],
                 f"l{k}/fc2")
        x = node("Add", [x, h], f"l{k}/residual")
    node("MatMul", [x, const("head.w", rng.standard_normal((hidden, 16)) / np.sqrt(hidden))], "head")
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, hidden])],
                          [helper.make_tensor_value_info("head_out", TensorProto.FLOAT, [batch, 16])],
                          initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m, {"x": np.random.default_rng(seed + 1).standard_normal((batch, hidden)).astype(np.float32)}


def _transformer() -> tuple[onnx.ModelProto, dict]:
    m = minilm(layers=4, seq=32)
    feeds = minilm_inputs(seq=32)
    mask = np.ones_like(feeds["mask"])
    mask[..., 22:] = 0          # a third of the tokens is padding
    return m, {**feeds, "mask": mask}


def _packaged(name: str, shape: tuple) -> tuple[onnx.ModelProto, dict]:
    m = onnx.load(str(packaged_model(name)))
    x = det_input(*shape[2:]) if name == DET_MODEL else \
        np.random.default_rng(3).uniform(-1, 1, shape).astype(np.float32)
    return m, {m.graph.input[0].name: x}


ARCHS = {
    "cnn": lambda: _cnn(),
    "depthwise": lambda: _packaged(CLS_MODEL, (1, 3, 48, 192)),
    "detector": lambda: _packaged(DET_MODEL, (1, 3, 96, 128)),
    "transformer": _transformer,
    "layernorm": lambda: _packaged(REC_MODEL, (1, 3, 48, 320)),
    "mlp": lambda: _mlp(),
}


def _judge(kind: str, model_path: Path, inputs: Path, golden: Path, device: Path, precision: str, out: Path) -> dict:
    t0 = time.perf_counter()
    if kind == "run":
        r = run(model_path, inputs, dump=str(device), precision=precision, out=out, progress=False, dump_mode="all")
    else:
        r = compare(str(golden), str(device), precision=precision, out=out, progress=False, dump_mode="all",
                    model=model_path if kind == "compare+model" else None)
    s = r.summary
    # every computation error, harmful or absorbed, in execution order
    errors = [(v["tensor"], v["node"], v["cause"]) for v in s["verdicts"] if v["verdict"] == "computation error"]
    return {"exit": r.exit_status, "headline": s["diagnosis"]["headline"], "errors": errors,
            "seconds": round(time.perf_counter() - t0, 2)}


def bug_size(model: onnx.ModelProto, tensor: str, kind: str, shape: tuple, rng: np.random.Generator,
             factor: float, feeds: dict) -> float:
    """How large a bug is where it is planted: the relative RMS error of
    the tensor's worst block of 1/16 (or of the whole, where it is too
    small to cut), the bug planted in the FP32 model against its clean
    value."""
    import onnxruntime as ort

    from layerdiff.analyzer.diagnose.errormodel import rel_rms, worst_blocks

    buggy, _ = plant(model, tensor, kind, shape, rng, factor=factor)
    values = []
    for m in (model, buggy):
        c = onnx.ModelProto()
        c.CopyFrom(m)
        c.graph.output.extend([onnx.ValueInfoProto(name=tensor)])
        so = ort.SessionOptions()
        so.log_severity_level = 3
        values.append(ort.InferenceSession(c.SerializeToString(), so, providers=["CPUExecutionProvider"])
                      .run([tensor], feeds)[0].astype(np.float64))
    clean, bug = values
    block = worst_blocks(bug - clean, clean)[0]
    return max(rel_rms(bug - clean, clean), block.rel if block is not None else 0.0)


def changed_by_the_build(model: onnx.ModelProto, device: onnx.ModelProto, precision: str) -> set[str]:
    """Nodes whose weights the build holds beyond the format's rounding
    (clamped into range, lifted from zero): what the build itself changes,
    which a verdict rightly names on a clean device."""
    from onnx import numpy_helper

    from layerdiff.collector.live.emulate import round_like_device

    if precision not in ("fp16", "bf16"):
        return set()
    def weights(m: onnx.ModelProto) -> dict[str, np.ndarray]:
        out = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
        out.update({n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in m.graph.node
                    if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"})
        return out

    ref = weights(model)
    out = set()
    for name, d in weights(device).items():
        w = ref.get(name)
        if w is None or w.dtype != np.float32:
            continue
        with np.errstate(over="ignore"):      # a weight beyond FP16's range: the build's clamp is what is asked
            plain = w.astype(np.float16).astype(np.float32) if precision == "fp16" else round_like_device(w, "bf16")
        if d.shape == plain.shape and not np.array_equal(d.astype(np.float32), plain, equal_nan=True):
            out |= {n.name for n in model.graph.node if name in n.input}
    return out


JOBS = ("run", "compare+model", "compare")


def calibrate(archs: list[str], precisions: list[str], bugs: int, seed: int, work: Path,
              jobs: tuple[str, ...] = JOBS) -> list[dict]:
    rows: list[dict] = []
    for arch in archs:
        model, feeds = ARCHS[arch]()
        shapes = reference_shapes(model, feeds)
        model_path, inputs = work / f"{arch}.onnx", work / f"{arch}.npz"
        onnx.save(model, str(model_path))
        np.savez(inputs, **feeds)
        golden = device_dump(model, model, {}, feeds, work / f"{arch}-golden", inputs=True)
        sites = {k: eligible(model, shapes, k) for k in KINDS}
        for precision in precisions:
            dev, view = build(model, precision, feeds)
            changed = changed_by_the_build(model, dev, precision)
            baseline: dict[str, set] = {}     # job -> the computation errors the clean device already has
            rng = np.random.default_rng(seed)
            cases = [("clean", None, 1.0, "")]
            for i in range(bugs):
                kinds = [k for k in KINDS if sites[k]]
                kind = kinds[i % len(kinds)]
                tensor = sites[kind][int(rng.integers(len(sites[kind])))]
                factor = float(FACTORS[int(rng.integers(len(FACTORS)))]) if kind == "block" else 1.0
                cases.append((kind, tensor, factor, ""))
            for n, (kind, tensor, factor, _) in enumerate(cases):
                size = None
                if kind == "clean":
                    device, what = dev, "clean"
                else:
                    try:
                        # the same bug (the same draws) in the FP32 model measures its size
                        device, what = plant(dev, tensor, kind, shapes[tensor], np.random.default_rng([seed, n]),
                                             factor=factor)
                        size = bug_size(model, tensor, kind, shapes[tensor], np.random.default_rng([seed, n]),
                                        factor, feeds)
                    except Exception as e:      # a build that renamed the tensor: skipped, said so
                        rows.append({"arch": arch, "precision": precision, "kind": kind, "tensor": tensor,
                                     "skipped": f"{type(e).__name__}: {e}"})
                        continue
                where = work / f"{arch}-{precision}-{n}"
                try:
                    dump = device_dump(model, device, view, feeds, where / "dump",
                                       source_dtype=SOURCE_DTYPE.get(precision, ""), inputs=True)
                except Exception as e:
                    rows.append({"arch": arch, "precision": precision, "kind": kind, "tensor": tensor,
                                 "skipped": f"device run: {type(e).__name__}: {e}"})
                    continue
                for job in jobs:
                    got = _judge(job, model_path, inputs, golden, dump, precision, where / job)
                    row = {"arch": arch, "precision": precision, "kind": kind, "tensor": tensor, "factor": factor,
                           "what": what, "job": job, "size": size, **got}
                    if kind == "clean":
                        # a clean device's computation errors: the build's own breaks (an INT8 step
                        # coarser than the values it carries, weights the build changed) or false
                        baseline[job] = {t for t, _, _ in got["errors"]}
                        row["build_breaks"] = [f"{n} ({c})" for _, n, c in got["errors"]
                                               if c == "quantization" or n in changed]
                        row["false"] = [f"{n} ({c})" for _, n, c in got["errors"]
                                        if not (c == "quantization" or n in changed)]
                        row["right"] = not row["false"]
                    else:
                        new_errors = [t for t, _, _ in got["errors"] if t not in baseline.get(job, set())]
                        row["named"] = new_errors[0] if new_errors else None
                        row["right"] = row["named"] == tensor
                    rows.append(row)
                    print(f"{arch:11s} {precision:5s} {job:13s} {kind:9s} {str(tensor)[:40]:40s} x{factor:<5g} -> "
                          f"{'ok ' if row['right'] else 'BAD'} {got['headline'][:110]}", flush=True)
    return rows


def summarize(rows: list[dict]) -> dict:
    judged = [r for r in rows if "skipped" not in r]
    clean = [r for r in judged if r["kind"] == "clean"]
    bugs = [r for r in judged if r["kind"] != "clean"]
    by: dict = defaultdict(lambda: [0, 0])
    for r in bugs:
        key = (r["job"], r["kind"] if r["kind"] != "block" else f"block x{r['factor']:g}")
        by[key][0] += r["right"]
        by[key][1] += 1
    # the goals: every bug of 5 % or more on 1/16 of a tensor (its size measured on the FP32 model: the
    # relative error of its worst block); on an FP32 device every bug of 1 % or more
    goal = [r for r in bugs if (r["size"] or 0.0) >= (0.01 if r["precision"] == "fp32" else 0.05)]
    per_job = {}
    for job in sorted({r["job"] for r in judged}):
        g = [r for r in goal if r["job"] == job]
        per_job[job] = f"{sum(r['right'] for r in g)}/{len(g)}"
    return {"clean_devices": len(clean), "false_computation_errors": sum(bool(r["false"]) for r in clean),
            "false": [f"{r['arch']} {r['precision']} {r['job']}: {', '.join(r['false'])}" for r in clean if r["false"]],
            "build_breaks": sorted({f"{r['arch']} {r['precision']}: {b}" for r in clean for b in r["build_breaks"]}),
            "bugs": len(bugs), "named_right": sum(r["right"] for r in bugs),
            "goal_bugs": len(goal), "goal_named": sum(r["right"] for r in goal), "goal_named_by_job": per_job,
            "by_kind": {f"{j} {k}": f"{a}/{n}" for (j, k), (a, n) in sorted(by.items())},
            "skipped": [f"{r['arch']} {r['precision']} {r['kind']} {r['tensor']}: {r['skipped']}"
                        for r in rows if "skipped" in r]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default=",".join(ARCHS))
    ap.add_argument("--precision", default=",".join(PRECISIONS))
    ap.add_argument("--bugs", type=int, default=10, help="planted bugs per architecture and precision")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="3 bugs each, FP16 and BF16 only")
    ap.add_argument("--jobs", default=",".join(JOBS), help="run (a model job on the device's dump), compare+model "
                    "(two dumps, the model lending its graph), compare (two dumps alone)")
    ap.add_argument("--json", help="write every case here")
    a = ap.parse_args(argv)
    precisions = ["fp16", "bf16"] if a.quick else a.precision.split(",")
    bugs = 3 if a.quick else a.bugs
    with tempfile.TemporaryDirectory(prefix="layerdiff-calibrate-") as tmp:
        t0 = time.perf_counter()
        rows = calibrate(a.arch.split(","), precisions, bugs, a.seed, Path(tmp), tuple(a.jobs.split(",")))
        summary = summarize(rows)
        summary["seconds"] = round(time.perf_counter() - t0, 1)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
