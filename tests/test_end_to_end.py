"""The whole path over real gRPC: collector and analyzer as separate
processes in separate directories, jobs submitted from this process."""
from __future__ import annotations

import csv
import json
import time

import numpy as np
import onnx
import pytest

from layerdiff.client.analyzer_client import AnalyzerClient
from layerdiff.client.api import compare, run
from layerdiff.collector.dumps.directory import write_dump
from layerdiff.collector.live.onnxrt import LiveRunner
from layerdiff.common.schema import NodeRecord
from layerdiff.v1 import layerdiff_pb2 as pb


def _csv(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_planted_bug_is_the_first_failing_node(services, cnn_files, tmp_path):
    collector, analyzer = services
    model, inputs, device = cnn_files
    out = tmp_path / "out"
    res = run(model, inputs, device_model=device, out=out, analyzer=analyzer.address,
              collector=collector.address, progress=False)
    assert res.first_failing_node == "conv2"
    rows = _csv(out / "cpu_vs_npu.csv")
    # every node of the model in execution order, the seed's columns first
    assert [r["node"] for r in rows] == ["conv1", "relu1", "conv2", "relu2", "residual/add", "conv3", "pool",
                                         "flatten", "fc"]
    assert list(rows[0])[:4] == ["op_name", "nan/inf", "errors/total", "1st_diff_offset/offset_dim/data_shape"]
    by = {r["node"]: r for r in rows}
    assert by["conv1"]["result"] == "pass" and by["relu1"]["result"] == "pass"
    assert by["conv2"]["result"] == "fail"
    errors, total = map(int, by["conv2"]["errors/total"].split("/"))
    assert total == 8 * 16 * 16 and errors > 0
    assert by["conv2"]["op_name"].startswith("conv2(atol=0.005,rtol=0.2)")
    # the failing node's detail file: worst first, at most diff_cnt rows
    detail = _csv(out / "conv2.csv")
    assert 0 < len(detail) <= 128
    diffs = [float(r["abs_diff"]) for r in detail]
    assert diffs == sorted(diffs, reverse=True)
    text = (out / "summary.json").read_text()
    summary = json.loads(text)
    assert summary["first_failing_node"]["node"] == "conv2"
    # one line a node, found with grep
    nodes = text[text.index('"nodes": [\n'):].split("\n")[1:len(summary["nodes"]) + 1]
    assert [json.loads(line.strip().rstrip(","))["node"] for line in nodes] == [r["node"] for r in rows]
    assert summary["counts"]["compared"] == 9 and summary["counts"]["failed"] >= 1
    assert summary["parameters"]["atol"] == 0.005 and summary["parameters"]["rtol"] == 0.2
    assert summary["version"]
    for name in ("compare_skip.log", "invalid_out_nodename.log", "op_config.csv", "node_runtime.json",
                 "consumer_map.json", "dump_memory_nodename.log"):
        assert (out / name).exists(), name
    assert json.loads((out / "consumer_map.json").read_text())["relu1"] == ["conv2", "residual/add"]


def test_inputs_given_as_a_dict_may_be_named_anything(services, tmp_path):
    """A graph input named ``file`` (numpy's savez took the name as its own
    argument and the run failed with a traceback) is fed like any other."""
    from onnx import TensorProto, helper
    from onnxbuild import opset17

    graph = helper.make_graph([helper.make_node("Relu", ["file"], ["y"], name="relu")], "named",
                              [helper.make_tensor_value_info("file", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    model = tmp_path / "named.onnx"
    onnx.save_model(opset17(graph), str(model))
    x = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    collector, analyzer = services
    res = run(model, {"file": x}, out=tmp_path / "out", analyzer=analyzer.address, collector=collector.address,
              progress=False)
    assert res.outcome == "pass"
    with open(tmp_path / "out" / "cpu_vs_npu.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["node"], r["tensor"], r["result"]) for r in rows] == [("relu", "y", "pass")], rows


def test_dump_on_the_collector_host_with_bad_entries(services, cnn_files, tmp_path):
    """A dump directory read where it lies; corrupt, truncated, missing and
    hostile entries are skipped with a reason, every other node is compared."""
    collector, analyzer = services
    model, inputs, device = cnn_files
    feeds = dict(np.load(inputs))
    records = list(LiveRunner(model.read_bytes(), feeds, device_model_bytes=device.read_bytes()).records())
    dump = write_dump(tmp_path / "dump", records)
    manifest = json.loads((dump / "manifest.json").read_text())
    by_name = {n["name"]: n for n in manifest["nodes"]}
    # relu2: truncated file; pool: corrupt header; a missing file; a hostile name; an unknown node
    f = dump / by_name["relu2_out"]["file"]
    f.write_bytes(f.read_bytes()[:-40])
    (dump / by_name["pool_out"]["file"]).write_bytes(b"\x93NUMPY\x01\x00garbage")
    manifest["nodes"].append({"name": "ghost", "op_type": "Conv", "file": "nope.npy"})
    manifest["nodes"].append({"name": "../../etc/passwd", "op_type": "Relu", "file": by_name["conv1_out"]["file"]})
    manifest["nodes"].append({"name": "conv_unknown", "op_type": "Conv", "file": by_name["conv1_out"]["file"]})
    (dump / "manifest.json").write_text(json.dumps(manifest))

    out = tmp_path / "out"
    res = run(model, inputs, dump=str(dump), out=out, analyzer=analyzer.address, collector=collector.address,
              progress=False)
    assert res.first_failing_node == "conv2"
    skip = (out / "compare_skip.log").read_text()
    assert "relu2_out" in skip and "truncated" in skip
    assert "pool_out" in skip and "corrupt" in skip
    invalid = (out / "invalid_out_nodename.log").read_text()
    assert "ghost" in invalid and "missing file" in invalid
    assert "../../etc/passwd" in invalid and "'..' path segment" in invalid
    assert "conv_unknown: not found in the reference model" in invalid
    compared = [r["tensor"] for r in _csv(out / "cpu_vs_npu.csv")]
    assert compared == ["conv1_out", "relu1_out", "conv2_out", "add_out", "conv3_out", "flat_out", "logits"]
    assert collector.alive() and analyzer.alive()


def test_options_map_skip_exclude_and_op_config(services, cnn_files, tmp_path):
    collector, analyzer = services
    model, inputs, device = cnn_files
    op_config = tmp_path / "op_config.csv"
    op_config.write_text("op_name,atol,rtol\nconv2,100,NA\n")
    out = tmp_path / "out"
    res = run(model, inputs, device_model=device, out=out, analyzer=analyzer.address, collector=collector.address,
              op_config=op_config, skip_keys=["pool"], exclude_node_list="flatten", diff_cnt=5, progress=False)
    rows = {r["node"]: r for r in _csv(out / "cpu_vs_npu.csv")}
    assert rows["conv2"]["result"] == "pass" and rows["conv2"]["atol"] == "100"
    assert res.first_failing_node == "relu2"   # the next node carrying the error
    assert "pool" not in rows and "flatten" not in rows
    skip = (out / "compare_skip.log").read_text()
    assert "skip key 'pool'" in skip and "exclude_node_list" in skip
    assert len(_csv(out / "relu2.csv")) == 5


def test_live_fp16_and_int8_of_the_small_model(services, cnn_files, tmp_path):
    collector, analyzer = services
    model, inputs, _ = cnn_files
    r16 = run(model, inputs, precision="fp16", out=tmp_path / "fp16", analyzer=analyzer.address,
              collector=collector.address, progress=False)
    assert r16.summary["counts"]["compared"] == 9
    assert r16.summary["precision"] == "fp16"
    nodes = {n["node"]: n for n in r16.summary["nodes"]}
    assert 0 < nodes["conv1"]["max_abs_diff"] < 0.01      # fp16 rounding, not a bug
    r8 = run(model, inputs, precision="int8", out=tmp_path / "int8", analyzer=analyzer.address,
             collector=collector.address, progress=False)
    n8 = {n["node"]: n for n in r8.summary["nodes"]}
    # the quantizer folds each Relu into the Conv before it: the Conv outputs are
    # fused away (not dumped), the Relu outputs carry the quantized values
    assert r8.summary["counts"]["compared"] == 7 and r8.summary["counts"]["not_dumped"] == 2
    assert "conv1_out: not dumped" in (tmp_path / "int8" / "compare_skip.log").read_text()
    assert n8["relu1"]["max_abs_diff"] > nodes["relu1"]["max_abs_diff"]   # int8 is coarser than fp16
    assert n8["relu1"]["cosine"] > 0.99                                  # yet close: quantization, not a bug
    assert n8["fc"]["cosine"] > 0.9


def test_fused_nodes_are_listed_as_fused_not_failures(services, cnn_files, tmp_path):
    """A device export where onnxruntime fused Conv+Relu: the fused-away
    tensors are listed as fused into the device node, not expected."""
    import onnxruntime as ort

    collector, analyzer = services
    model, inputs, _ = cnn_files
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    optimized = tmp_path / "optimized.onnx"
    so.optimized_model_filepath = str(optimized)
    ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
    produced = {o for n in onnx.load(str(optimized)).graph.node for o in n.output}
    assert "conv1_out" not in produced   # fused into conv1+relu1
    res = run(model, inputs, device_model=optimized, out=tmp_path / "out", analyzer=analyzer.address,
              collector=collector.address, progress=False)
    assert res.first_failing_node is None and res.exit_status == 0
    assert res.summary["counts"]["fused"] >= 1 and res.summary["counts"]["not_dumped"] == 0
    assert res.summary["coverage"]["ratio"] == 1.0
    skip = (tmp_path / "out" / "compare_skip.log").read_text()
    assert "conv1_out: fused into device node" in skip


def test_progress_streams_while_the_job_runs(services, cnn_files, tmp_path):
    collector, analyzer = services
    model, inputs, device = cnn_files
    events = []
    run(model, inputs, device_model=device, out=tmp_path / "out", analyzer=analyzer.address,
        collector=collector.address, progress=events.append)
    states = [e.state for e in events]
    assert states[0] == pb.QUEUED and states[-1] == pb.DONE
    done = [e.nodes_done for e in events if e.state == pb.COMPARING]
    assert done == sorted(done) and max(done) == 9
    assert events[-1].first_failing_node == "conv2"


def test_progress_events_are_paced_but_never_hide_a_failing_node(tmp_path):
    """A thousand passing nodes in a blink make a handful of events (each
    carrying the count), while every failing node and the last one get
    their own at once."""
    from layerdiff.analyzer.jobs.job import PROGRESS_EVERY_S, Job

    job = Job("j", pb.JobSpec(), tmp_path)
    failing = {10, 500, 501}
    start = time.monotonic()
    for done in range(1, 1001):
        job.progress(done, 1000, f"n{done}", done not in failing)
    took = time.monotonic() - start
    events = job.events
    assert [e.nodes_done for e in events] == sorted(e.nodes_done for e in events)
    assert {e.nodes_done for e in events if not e.node_passed} == failing
    assert all(e.node == f"n{e.nodes_done}" for e in events)
    assert events[-1].nodes_done == 1000 and events[-1].node_passed
    assert len(events) <= len(failing) + 2 + took / PROGRESS_EVERY_S
    time.sleep(PROGRESS_EVERY_S)
    job.progress(1, 0, "again", True)        # a passing node after a pause: sent (total unknown)
    assert job.events[-1].node == "again"


def test_a_paced_watcher_gets_changes_of_state_at_once_and_progress_thinned():
    """A watcher that asks for node progress at most every 5 s is sent the
    first events at once, then nothing for the failing nodes that follow
    (not even woken), but a change of state ends the wait at once and
    brings the latest count; a watcher that asks for every event gets
    each failing node's."""
    import threading

    from layerdiff.analyzer.jobs.job import EventCursor, Job

    job = Job("j", pb.JobSpec(), None)
    paced, every = EventCursor(job, every_s=5.0), EventCursor(job)
    job.emit(pb.COMPARING, nodes_total=300)
    batch, ended = paced.next(lambda: True)
    assert [e.state for e in batch] == [pb.COMPARING] and not ended
    for done in range(1, 201):
        job.progress(done, 300, f"n{done}", False)
    woken = []
    orig_wait = job.changed.wait

    def counted(timeout=None):
        woken.append(timeout)
        return orig_wait(timeout)

    job.changed.wait = counted
    timer = threading.Timer(0.5, lambda: job.emit(pb.REPORTING, nodes_done=300, nodes_total=300))
    start = time.monotonic()
    timer.start()
    batch, ended = paced.next(lambda: True, poll_s=10.0)
    took = time.monotonic() - start
    assert 0.4 < took < 4.0, took           # woken by the change of state, not by the quiet time's end
    assert len(woken) == 1                  # the 200 failing nodes woke nobody
    assert [(e.state, e.nodes_done) for e in batch] == [(pb.COMPARING, 200), (pb.REPORTING, 300)]
    assert batch[0].node == "n200" and not ended
    job.emit(pb.DONE)
    batch, ended = paced.next(lambda: True)     # the end: at once, quiet time or not
    assert [e.state for e in batch] == [pb.DONE] and ended
    got = []
    while True:
        batch, ended = every.next(lambda: True)
        got += batch
        if ended:
            break
    assert [e.nodes_done for e in got if e.node] == list(range(1, 201))
    assert got[-1].state == pb.DONE


def test_watch_over_the_wire_paced_or_not(services, tmp_path):
    """Watch of a finished job with 40 failing nodes: every event asked
    for, every failing node's; progress at most every 100 ms asked for, the
    changes of state and the last count only."""
    collector, analyzer = services
    rng = np.random.default_rng(4)
    gold = {f"t{i}": rng.standard_normal(32).astype(np.float32) for i in range(40)}
    write_dump(tmp_path / "gold", [NodeRecord(name=n, array=v) for n, v in gold.items()])
    write_dump(tmp_path / "dev", [NodeRecord(name=n, array=v * 2) for n, v in gold.items()])
    jobs = []
    compare(tmp_path / "gold", tmp_path / "dev", out=tmp_path / "out", collector=collector.address,
            analyzer=analyzer.address, progress=False, on_job=jobs.append)
    client = AnalyzerClient(analyzer.address)
    try:
        every = list(client.watch(jobs[0], timeout=30))
        paced = list(client.watch(jobs[0], timeout=30, progress_every_s=0.1))
    finally:
        client.close()
    assert sorted(e.node for e in every if e.node and not e.node_passed) == sorted(gold)
    assert [e for e in paced if e.node] == [e for e in every if e.node][-1:]
    assert [e.state for e in paced if not e.node] == [e.state for e in every if not e.node]
    assert paced[-1].state == every[-1].state == pb.DONE


def test_fp16_run_of_the_demo_model(services, tmp_path):
    """A real pretrained detector (PP-OCRv4 det) on a rendered page, FP16 vs FP32."""
    from layerdiff.client.demo import det_input, packaged_model

    collector, analyzer = services
    np.savez(tmp_path / "page.npz", x=det_input(160, 224))
    model = packaged_model()
    res = run(model, tmp_path / "page.npz", precision="fp16", out=tmp_path / "out", analyzer=analyzer.address,
              collector=collector.address, progress=False)
    s = res.summary
    assert s["counts"]["compared"] == len(onnx.load(str(model)).graph.node) == 672
    first = s["first_failing_node"]
    assert first is not None and first["op_type"] != "Constant"
    orders = [n["order"] for n in s["nodes"]]
    assert orders == sorted(orders)
    assert all(n["passed"] for n in s["nodes"] if n["order"] < first["order"] and not n["constant"])
    # The head's BatchNorm running variance (~1e7) cannot be held in FP16: the
    # constant is named with its overflow count, and the BatchNorm that reads
    # it is where the output map stops agreeing (cosine falls below 0.9),
    # while every computation before it still agrees closely.
    overflowing = [k for k in s["failing_constants"] if k["fp16_overflow"] > 0]
    assert [k["tensor"] for k in overflowing] == ["batch_norm_0.w_2"]
    computations = [n for n in s["nodes"] if not n["constant"]]
    broken = next(n for n in computations if n["cosine"] < 0.9)
    assert broken["node"] == "p2o.BatchNormalization.1"
    assert all(n["cosine"] > 0.99 for n in computations if n["order"] < broken["order"])


def test_cancel_stops_a_running_job(services, tmp_path):
    from layerdiff.client.demo import det_input, packaged_model

    collector, analyzer = services
    client = AnalyzerClient(analyzer.address)
    np.savez(tmp_path / "page.npz", x=det_input(640, 640))
    spec = pb.JobSpec(model_artifact=client.upload(packaged_model().read_bytes(), "det.onnx"),
                      inputs_artifact=client.upload((tmp_path / "page.npz").read_bytes(), "page.npz"),
                      collector=collector.address, precision="fp16")
    job = client.submit(spec)
    client.cancel(job)
    events = list(client.watch(job, timeout=120))
    assert events[-1].state == pb.CANCELLED
    import grpc

    with pytest.raises(grpc.RpcError) as ei:
        client.fetch(job, tmp_path / "out")
    assert "CANCELLED" in ei.value.details()
    with pytest.raises(grpc.RpcError) as ei:
        list(client.watch("nosuchjob", timeout=10))
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND
    client.close()
