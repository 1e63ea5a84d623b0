"""Golden dumps as users write them with their own scripts, compared with
the device's dump in every format layerdiff reads (and the other way round):
one .npy per tensor, named after the tensor with its signs written as '_',
no manifest. The execution order comes from the files' modification times,
else a sequence number in every name, else a model; where none can be read
(files copied with equal times) no node is called first.

The model is small_cnn named as torch.onnx.export names things
(``/blk.0/conv2/Conv``, ``/blk.0/conv2/Conv_output_0``), its device side an
FP16 build with a planted bug in conv2.
"""
from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import small_cnn
from onnx import TensorProto, numpy_helper

from layerdiff.analyzer.align.names import canonical, plain
from layerdiff.analyzer.reference.onnxrt import OnnxReference
from layerdiff.client.api import compare
from layerdiff.collector.dumps.directory import FORMATS, write_dump
from layerdiff.common.errors import JobFailed
from layerdiff.common.schema import NodeRecord

X = np.random.default_rng(1).standard_normal((1, 3, 16, 16)).astype(np.float32)
BUG = "/blk.0/conv2/Conv"
BEFORE_BUG = ("/blk.0/conv1/Conv", "/blk.0/relu1/Relu")
CALL_TIMEOUT = 120
T0 = 1_700_000_000_000_000_000      # ns


def exported(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with torch.onnx.export's names: node ``/blk.0/{name}/{Op}``,
    its outputs ``{node}_output_{k}`` (the graph's input and output keep theirs)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    rename = {}
    for n in m.graph.node:
        n.name = f"/blk.0/{n.name.split('/')[-1]}/{n.op_type}"
        for k, o in enumerate(n.output):
            if o != "logits":
                rename[o] = f"{n.name}_output_{k}"
    for n in m.graph.node:
        ins, outs = [rename.get(t, t) for t in n.input], [rename.get(t, t) for t in n.output]
        del n.input[:], n.output[:]
        n.input.extend(ins)
        n.output.extend(outs)
    return m


def fp16_build(model: onnx.ModelProto) -> onnx.ModelProto:
    for init in model.graph.initializer:
        init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float16), init.name))
    for v in list(model.graph.input) + list(model.graph.output):
        v.type.tensor_type.elem_type = TensorProto.FLOAT16
    return model


def tensors(model: onnx.ModelProto, feed: np.ndarray) -> list[tuple[str, str, str, np.ndarray]]:
    """(tensor, node, op type, value) of every node output, in execution order."""
    ref = OnnxReference(model.SerializeToString())
    vals = ref.run({"input": feed})
    return [(s.tensor, s.node, s.op_type, vals[s.tensor]) for s in ref.sites]


def sanitized(name: str) -> str:
    """What users' scripts make of a tensor name for a file name."""
    return re.sub(r"[/:.]", "_", name)


# ------------------------------------------------------- users' own scripts

def user_script(directory: Path, values, style: str) -> Path:
    """A dump as a user's script writes it: one .npy per tensor, no manifest.

    - ``plain``: written in execution order (distinct modification times);
    - ``indexed``: ``{i:03d}_{name}.npy``, then copied (every time equal);
    - ``nhwc``: as plain, 4-D tensors saved channels-last;
    - ``copied``: as plain, then copied (every time equal): no order;
    - ``shuffled``: written in a random order (times that lie)."""
    directory.mkdir(parents=True)
    order = list(range(len(values)))
    if style == "shuffled":
        random.Random(3).shuffle(order)
    for rank, i in enumerate(order):
        name, _, _, value = values[i]
        if style == "nhwc" and value.ndim == 4:
            value = value.transpose(0, 2, 3, 1)
        fname = f"{i:03d}_{sanitized(name)}.npy" if style == "indexed" else f"{sanitized(name)}.npy"
        np.save(directory / fname, value)
        # a script writes one tensor after the other; the clock's grain is the file system's
        when = T0 if style in ("indexed", "copied") else T0 + rank * 1_000_000
        os.utime(directory / fname, ns=(when, when))
    return directory


def device_records(values) -> list[NodeRecord]:
    return [NodeRecord(name=t, node=n, op_type=op, order=i, array=v) for i, (t, n, op, v) in enumerate(values)]


def run_compare(services, golden, device, out, **kw):
    collector, analyzer = services
    for attempt in range(20):
        try:
            return compare(str(golden), str(device), out=out, collector=collector.address,
                           analyzer=analyzer.address, progress=False, timeout=CALL_TIMEOUT, **kw)
        except JobFailed as e:       # the per-client job bound, while other jobs end
            if "LAYERDIFF_MAX_JOBS_PER_CLIENT" not in str(e) or attempt == 19:
                raise
            time.sleep(0.2)


def is_bug(name: str | None) -> bool:
    """The planted bug's node or tensor, in any spelling a dump gives it."""
    return name is not None and plain(canonical(name)) in {plain(canonical(BUG)), plain(canonical(BUG + "_output_0"))}


def headline(summary: dict) -> str:
    return (summary.get("diagnosis") or {}).get("headline") or ""


STYLES = ("plain", "indexed", "nhwc", "copied", "shuffled")
ORDER_WORDS = {"plain": "by the files' modification times", "nhwc": "by the files' modification times",
               "indexed": "by the sequence numbers in the file names"}


@pytest.fixture(scope="module")
def world(services, tmp_path_factory):
    """Every user script as the golden side against every device format,
    and the device side written by a user's script against every golden
    format; the unordered ones also with the model. Four jobs at a time."""
    base = tmp_path_factory.mktemp("user_dumps")
    model = exported(small_cnn())
    (base / "model.onnx").write_bytes(model.SerializeToString())
    gold = tensors(model, X)
    bug = tensors(fp16_build(exported(small_cnn(bug_in="conv2"))), X.astype(np.float16))
    golden_user = {style: user_script(base / f"gold_{style}", gold, style) for style in STYLES}
    device_user = {style: user_script(base / f"dev_{style}", bug, style) for style in ("plain", "nhwc", "shuffled")}
    golden_fmt = {fmt: write_dump(base / f"gold_{fmt}", device_records(gold), fmt) for fmt in FORMATS}
    device_fmt = {fmt: write_dump(base / f"dev_{fmt}", device_records(bug), fmt) for fmt in FORMATS}
    jobs = {}
    for style, g in golden_user.items():
        for fmt, d in device_fmt.items():
            jobs["golden", style, fmt, False] = (g, d)
            if style in ("copied", "shuffled"):
                jobs["golden", style, fmt, True] = (g, d)
    for style, d in device_user.items():
        for fmt, g in golden_fmt.items():
            jobs["device", style, fmt, False] = (g, d)

    def one(item):
        (side, style, fmt, with_model), (g, d) = item
        try:
            return run_compare(services, g, d, base / "out" / f"{side}-{style}-{fmt}-{with_model}",
                               model=base / "model.onnx" if with_model else None, precision="fp16")
        except Exception as e:   # reported by the test of that case
            return e

    with ThreadPoolExecutor(4) as ex:
        results = dict(zip(jobs, ex.map(one, jobs.items())))
    return {"results": results, "base": base, "gold": gold, "bug": bug}


def result(world, *key):
    r = world["results"][key]
    if isinstance(r, BaseException):
        raise AssertionError(f"compare {key} raised: {r!r}")
    return r


def unnamed(fmt: str) -> int:
    """Tensors a dump in ``fmt`` cannot pair by name with a user's golden
    dump: formats that name nodes (HDF5, Ascend) hold the model's output
    as ``/blk.0/fc/Gemm``, the user's script as ``logits``; only a model
    ties the two."""
    return 1 if fmt in ("h5", "ascend") else 0


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("style", ["plain", "indexed", "nhwc"])
def test_a_users_golden_dump_names_the_bug_by_its_own_order(world, style, fmt):
    """Ordered golden scripts against every device format: every tensor is
    compared, the bug is named where it is, and the headline says where the
    order came from."""
    r = result(world, "golden", style, fmt, False)
    s = r.summary
    assert r.exit_status == 1, s["outcome"]
    assert s["counts"]["compared"] == 9 - unnamed(fmt) and s["counts"]["invalid_out"] == unnamed(fmt), \
        s["coverage"]["text"]
    comp = s["first_computation_error"]
    assert comp and is_bug(comp["node"]), headline(s)
    assert ORDER_WORDS[style] in headline(s), headline(s)
    assert s["execution_order"]["known"] is True
    assert s["execution_order"]["from"] == ORDER_WORDS[style].removeprefix("by ")
    rows = {n["node"]: n for n in s["nodes"]}
    assert all(rows[sanitized(f"{b}_output_0")]["passed"] for b in BEFORE_BUG)
    verdicts = [n for n, row in rows.items() if row.get("verdict") == "computation error"]
    assert len(verdicts) == 1 and is_bug(verdicts[0]), verdicts


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_copied_golden_dump_calls_no_node_first(world, fmt):
    """Copied files (every modification time equal, no sequence number): no
    order; the answer lists what fails and calls nothing first, in the
    headline, the terminal and the report; a model then gives the order
    and the bug is named first again."""
    from layerdiff.client.summary_text import format_summary

    r = result(world, "golden", "copied", fmt, False)
    s = r.summary
    # nothing says what a failing node read: no verdict, and the way to one
    assert r.exit_status == 3 and "no execution order" in s["outcome"]["reason"], s["outcome"]
    assert "--model" in s["outcome"]["reason"]
    text = headline(s)
    order = s["execution_order"]
    assert order["from"] == "the file names" and order["known"] is False
    assert "equal modification times" in order["why_unknown"]
    assert "execution #" not in text and "first" not in text.replace("called first", ""), text
    failing = [n["node"] for n in s["nodes"] if not n["passed"]]
    assert sanitized(f"{BUG}_output_0") in failing and all(v["verdict"] == "no verdict" for v in s["verdicts"]
                                                           if v["node"] in failing), s["verdicts"]
    terminal = format_summary(s, r.out, width=1000)
    assert "FIRST" not in terminal and "in execution order" not in terminal, terminal
    assert "execution #" not in terminal, terminal
    assert "no execution order" in terminal
    html = (r.out / "report.html").read_text()
    assert "First failing node" not in html and "A failing node" in html
    r = result(world, "golden", "copied", fmt, True)
    s = r.summary
    assert r.exit_status == 1 and is_bug(s["first_computation_error"]["node"]), headline(s)
    assert "by the model's graph" in headline(s) and s["execution_order"]["known"] is True


@pytest.mark.parametrize("fmt", FORMATS)
def test_times_that_lie_give_way_to_a_model(world, fmt):
    """A script that wrote its tensors in a random order: its times are
    taken (nothing tells them from the truth without a model), and said; a
    model given puts its own order in their place."""
    r = result(world, "golden", "shuffled", fmt, False)
    assert "by the files' modification times" in headline(r.summary) or r.exit_status == 3, headline(r.summary)
    r = result(world, "golden", "shuffled", fmt, True)
    s = r.summary
    assert r.exit_status == 1 and is_bug(s["first_computation_error"]["node"]), headline(s)
    assert "by the model's graph" in headline(s)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("style", ["plain", "nhwc", "shuffled"])
def test_a_users_device_dump_against_every_golden_format(world, style, fmt):
    """The device side written by a user's script (sanitized names,
    channels-last, any order of its own) pairs with every golden format;
    the golden dump's order stands."""
    r = result(world, "device", style, fmt, False)
    s = r.summary
    assert r.exit_status == 1, s["outcome"]
    assert s["counts"]["compared"] == 9 - unnamed(fmt) and s["counts"]["invalid_out"] == unnamed(fmt), \
        s["coverage"]["text"]
    assert is_bug(s["first_computation_error"]["node"]), headline(s)
    import csv

    with open(r.out / "alignment.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    paired = [row for row in rows if row["reference_tensor"] and row["device_tensor"]]
    assert len(paired) == 9 - unnamed(fmt), rows
    assert all(row["method"] == "name" and float(row["confidence"]) > 0.8 for row in paired), rows


def test_single_files_are_dumps_on_either_side(world, services):
    """A single .h5 or .npz file, and a single .npy tensor, as either side."""
    base = world["base"]
    h5 = write_dump(base / "single_h5", device_records(world["gold"]), "h5") / "dump.h5"
    npz = write_dump(base / "single_npz", device_records(world["bug"]), "npz") / "dump.npz"
    r = run_compare(services, h5, npz, base / "out_single", precision="fp16")
    assert r.exit_status == 1 and is_bug(r.summary["first_computation_error"]["node"]), headline(r.summary)
    assert "by the HDF5 calls' order" in headline(r.summary)
    r = run_compare(services, npz, h5, base / "out_single_swapped", precision="fp16")
    assert r.summary["counts"]["compared"] == 9 - unnamed("h5"), r.summary["coverage"]["text"]
    assert is_bug(r.summary["first_computation_error"]["node"]) and "by the archive's order" in headline(r.summary)
    logits_gold, logits_dev = base / "logits_gold.npy", base / "logits_fp16.npy"    # one tensor each: paired
    np.save(logits_gold, world["gold"][-1][3])
    np.save(logits_dev, world["bug"][-1][3])
    r = run_compare(services, logits_gold, logits_dev, base / "out_single_npy", precision="fp16")
    assert r.summary["counts"]["compared"] == 1 and r.exit_status in (1, 3), r.summary["outcome"]


def test_the_terminal_says_where_the_order_came_from(world):
    """`layerdiff compare` on a user's golden dump: the VERDICT line names
    the order's source; on a copied one it lists and calls nothing first."""
    base = world["base"]
    out = base / "cli_summary"
    from layerdiff.client.summary_text import format_summary

    r = result(world, "golden", "plain", "ascend", False)
    text = format_summary(r.summary, out, width=1000)
    assert "FIRST COMPUTATION ERROR" in text and "order from the files' modification times" in text, text
    assert "VERDICT: Computation error at" in text


def test_cli_compare_of_user_dumps_exits_with_the_answer(world, services):
    collector, analyzer = services
    base = world["base"]
    proc = subprocess.run([sys.executable, "-m", "layerdiff.client.cli", "compare", str(base / "gold_plain"),
                           str(base / "dev_npy"), "--precision", "fp16", "--collector", collector.address,
                           "--analyzer", analyzer.address, "--out", str(base / "cli_out"), "--no-progress"],
                          capture_output=True, text=True, timeout=CALL_TIMEOUT)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "by the files' modification times" in proc.stdout and "Traceback" not in proc.stderr


def test_numbered_files_written_in_turn_pair_by_name_across_builds(services, tmp_path):
    """The usual script: every tensor saved as it comes, named after its
    place in the run (``0007_conv.npy``, distinct modification times). The
    device build numbers its tensors one further (a cast ahead of them), so
    the numbers leave the names on both sides: every tensor pairs by its
    name, and the bug is named without its number."""
    model = exported(small_cnn())
    gold = tensors(model, X)
    bug = tensors(fp16_build(exported(small_cnn(bug_in="conv2"))), X.astype(np.float16))
    cast = ("input_fp16", "input_cast", "Cast", X.astype(np.float16))
    for side, values in (("gold", gold), ("dev", [cast, *bug])):
        (tmp_path / side).mkdir()
        for i, (name, _, _, value) in enumerate(values):
            path = tmp_path / side / f"{i:04d}_{sanitized(name)}.npy"
            np.save(path, value)
            os.utime(path, ns=(T0 + i * 1_000_000, T0 + i * 1_000_000))
    r = run_compare(services, tmp_path / "gold", tmp_path / "dev", tmp_path / "out", precision="fp16")
    s = r.summary
    assert s["counts"]["compared"] == len(gold), s["coverage"]["text"]
    assert s["execution_order"]["from"] == "the files' modification times"
    comp = s["first_computation_error"]
    assert comp and is_bug(comp["node"]) and not comp["node"][:1].isdigit(), headline(s)
    import csv

    with open(tmp_path / "out" / "alignment.csv", newline="", encoding="utf-8") as f:
        methods = {r["reference_tensor"]: r["method"] for r in csv.DictReader(f) if r["reference_tensor"]}
    assert set(methods.values()) == {"name"}, methods


def test_a_tensor_renamed_by_the_build_pairs_by_value_reading_only_its_candidates(tmp_path, monkeypatch):
    """A user's device build renames a tensor of its own (a converter's
    cast, a fused node's output): at the end of the stream it pairs by its
    values, and of the golden dump only the files of the tensors it can be
    (its element count) are read again, not the whole dump."""
    from layerdiff.analyzer.reference import dump

    model = exported(small_cnn())
    gold = tensors(model, X)
    bug = tensors(fp16_build(exported(small_cnn(bug_in="conv2"))), X.astype(np.float16))
    renamed = "/blk.0/relu1/Relu_output_0"
    user_script(tmp_path / "gold", gold, "plain")
    user_script(tmp_path / "dev", [("converted_7" if t == renamed else t, n, op, v) for t, n, op, v in bug], "plain")
    read = []
    real = dump.read_npy

    def counted(path, *a, **kw):
        read.append(Path(path).stem)
        return real(path, *a, **kw)

    monkeypatch.setattr(dump, "read_npy", counted)
    r = compare(str(tmp_path / "gold"), str(tmp_path / "dev"), out=tmp_path / "out", progress=False,
                precision="fp16", timeout=CALL_TIMEOUT)
    import csv

    with open(tmp_path / "out" / "alignment.csv", newline="", encoding="utf-8") as f:
        paired = {row["device_tensor"]: row for row in csv.DictReader(f)}
    assert paired["converted_7"]["reference_tensor"] == sanitized(renamed), paired["converted_7"]
    assert paired["converted_7"]["method"].startswith("value"), paired["converted_7"]
    size = next(v.size for t, _, _, v in gold if t == renamed)
    alike = {sanitized(t) for t, _, _, v in gold if v.size == size}
    assert read and set(read) <= alike and len(alike) < len(gold), (read, alike)
    assert is_bug(r.summary["first_computation_error"]["node"]), headline(r.summary)
