"""Performance data beside accuracy (DUMP_OP_PERF): live onnxruntime
profiles, vendor counter files, timelines, summaries and perf-diff, over the
real services."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import small_cnn

from layerdiff.client.analyzer_client import AnalyzerClient
from layerdiff.client.api import run
from layerdiff.collector.live.profile import parse_profile
from layerdiff.collector.perf.counters import dump_perf_records
from layerdiff.common.errors import LayerdiffError
from layerdiff.common.perfschema import COUNTER_COLUMNS, PerfRecord, decode_perf, encode_perf
from layerdiff.v1 import layerdiff_pb2 as pb


def _csv(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def check_trace_events(doc) -> dict[int, list[dict]]:
    """The JSON object form of the Trace Event Format as Perfetto UI and
    chrome://tracing read it: typed fields, complete events with a duration,
    named tracks, and slices on one track that nest and never partly overlap.
    Returns the complete events by track."""
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list)
    named: set[tuple[int, int]] = set()
    tracks: dict[int, list[dict]] = {}
    for e in doc["traceEvents"]:
        assert e["ph"] in ("X", "M"), e
        assert isinstance(e["name"], str) and e["name"]
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name", "thread_sort_index", "process_sort_index")
            assert isinstance(e["args"], dict)
            if e["name"] == "thread_name":
                assert isinstance(e["args"]["name"], str)
                named.add((e["pid"], e["tid"]))
            continue
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
        assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0
        assert isinstance(e.get("cat", ""), str) and isinstance(e.get("args", {}), dict)
        tracks.setdefault(e["tid"], []).append(e)
    for tid, events in tracks.items():
        assert (1, tid) in named, f"track {tid} has no thread_name"
        stack: list[float] = []
        for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1] <= e["ts"] + 1e-6:     # microseconds, 3 decimals: float sums may not
                stack.pop()
            end = e["ts"] + e["dur"]
            assert not stack or end <= stack[-1] + 1e-6, f"{e['name']} partly overlaps its neighbour on track {tid}"
            stack.append(end)
    json.dumps(doc, allow_nan=False)
    return tracks


def _track_names(doc) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}


def _optimized_nodes(model: onnx.ModelProto, level) -> list[str]:
    """The nodes onnxruntime executes at this optimization level."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        so = ort.SessionOptions()
        so.graph_optimization_level = level
        so.optimized_model_filepath = str(Path(tmp) / "opt.onnx")
        ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        return [n.name for n in onnx.load(str(Path(tmp) / "opt.onnx")).graph.node]


# ------------------------------------------------------------------ live runs

@pytest.mark.parametrize("perf_mode", ["accuracy", "both", "perf"])
def test_a_run_in_this_process_hands_over_its_summary_as_its_summary_json_reads(cnn_files, tmp_path, perf_mode):
    """Services started in the command's own process: the client is handed
    the job's summary, not summary.json parsed again; the same, types and
    all, with or without the performance sections (a performance-only job
    writes its summary elsewhere)."""
    model, inputs, device = cnn_files
    out = tmp_path / "out"
    res = run(model, inputs, device_model=device, out=out, progress=False, perf_mode=perf_mode, perf_runs=2)
    read = json.loads((out / "summary.json").read_text())
    assert res.summary == read
    assert ("perf" in read) == (perf_mode != "accuracy")
    assert read["counts"]["compared"] == (0 if perf_mode == "perf" else len(onnx.load(str(model)).graph.node))



def test_live_profile_times_every_executed_node(services, cnn_files, tmp_path):
    collector, analyzer = services
    model, inputs, _ = cnn_files
    out = tmp_path / "none"
    res = run(model, inputs, out=out, analyzer=analyzer.address, collector=collector.address, progress=False,
              perf_mode="perf", perf_runs=4, perf_graph_optimization="none")
    names = [n.name for n in onnx.load(str(model)).graph.node]
    rows = _csv(out / "op_perf.csv")
    # every node of the model, in execution order, each timed on every run
    assert [r["name"] for r in rows] == names
    assert all(r["runs"] == "4" and float(r["mean_us"]) > 0 for r in rows)
    assert all(r["provider"] == "CPUExecutionProvider" for r in rows)
    by = {r["name"]: r for r in rows}
    assert json.loads(by["conv1"]["input_shapes"])[0] == ["float", [1, 3, 16, 16]]
    assert json.loads(by["conv3"]["output_shapes"]) == [["float", [1, 16, 16, 16]]]
    assert abs(sum(float(r["share_pct"]) for r in rows) - 100.0) < 0.01
    waits = {r["name"]: r["wait_us"] for r in _csv(out / "op_summary.csv")}
    assert waits["conv1"] == "" and all(float(waits[n]) >= 0 for n in names[1:])   # idle before each node
    for r in rows:
        per_run = _csv(out / "perf" / f"{r['name'].replace('/', '_')}.csv")
        assert [p["run"] for p in per_run] == ["0", "1", "2", "3"]
        assert all(float(p["dur_us"]) >= 0 for p in per_run)
    stats = {s["op_type"]: s for s in _csv(out / "op_statistic.csv")}
    assert stats["Conv"]["count"] == "12" and stats["Conv"]["nodes"] == "3"
    assert sum(int(s["count"]) for s in stats.values()) == 4 * len(names)
    # performance only: nothing was compared, and no accuracy file pretends otherwise
    assert not (out / "cpu_vs_npu.csv").exists()
    assert res.summary["perf"]["perf_mode"] == "perf" and res.summary["counts"]["compared"] == 0
    assert res.summary["perf"]["time_from"] == "measured"

    doc = json.loads((out / "timeline.json").read_text())
    tracks = check_trace_events(doc)
    by_name = {_track_names(doc)[tid]: evs for tid, evs in tracks.items()}
    assert [e["name"] for e in by_name.pop("runs")] == ["run 0", "run 1", "run 2", "run 3"]
    [thread] = by_name       # onnxruntime's sequential executor: one thread
    assert thread.startswith("thread ") and len(by_name[thread]) == 4 * len(names)
    assert {e["name"] for e in by_name[thread]} == set(names)

    # The default level fuses as onnxruntime does: the timed nodes are the
    # nodes of the optimized graph, named after the first node they fuse.
    res = run(model, inputs, out=tmp_path / "extended", analyzer=analyzer.address, collector=collector.address,
              progress=False, perf_mode="perf", perf_runs=2)
    timed = [r["name"] for r in _csv(tmp_path / "extended" / "op_perf.csv")]
    assert timed == _optimized_nodes(onnx.load(str(model)), ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED)
    assert {r["name"]: r["op_type"] for r in _csv(tmp_path / "extended" / "op_perf.csv")}["conv1"] == "FusedConv"


def test_accuracy_and_time_side_by_side(services, cnn_files, tmp_path):
    """DUMP_OP_PERF=2 from the command line: the planted bug is found and
    every node carries its time beside its verdict."""
    collector, analyzer = services
    model, inputs, device = cnn_files
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "layerdiff.client.cli", "run", str(model), "--inputs", str(inputs),
                           "--device-model", str(device), "--perf-mode", "2", "--perf-runs", "3", "--dump-mode", "all",
                           "--analyzer", analyzer.address, "--collector", collector.address, "--out", str(out),
                           "--no-progress"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr   # failing nodes found
    assert "FIRST FAILING NODE: conv2" in proc.stdout and "performance (both)" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["first_failing_node"]["node"] == "conv2" and summary["perf"]["perf_mode"] == "both"
    view = {v["node"]: v for v in summary["node_view"]}
    assert view["conv2"]["accuracy"]["passed"] is False and view["conv2"]["accuracy"]["first_failing"]
    # the node's verdict is what it computed; the inputs it read are reported on their own
    assert summary["counts"]["inputs_compared"] > 0 and view["conv2"]["accuracy"]["tensors"] == ["conv2_out"]
    assert view["conv2"]["perf"]["runs"] == 3 and view["conv2"]["perf"]["mean_us"] > 0
    assert view["conv1"]["accuracy"]["passed"] and view["conv1"]["perf"]["device_op_type"] == "FusedConv"
    # relu1 ran fused into conv1: compared, but never timed on its own
    assert view["relu1"]["accuracy"] is not None and view["relu1"]["perf"] is None
    assert [v["node"] for v in summary["node_view"]] == [n.name for n in onnx.load(str(model)).graph.node]
    summary_rows = {r["name"]: r for r in _csv(out / "op_summary.csv")}
    assert summary_rows["conv2"]["accuracy"] == "fail" and float(summary_rows["conv2"]["mean_us"]) > 0
    assert summary_rows["conv2"]["verdict"] == view["conv2"]["accuracy"]["verdict"] == "computation error"
    assert summary_rows["conv1"]["accuracy"] == "pass"
    assert (out / "cpu_vs_npu.csv").exists() and (out / "conv2.csv").exists()
    tracks = check_trace_events(json.loads((out / "timeline.json").read_text()))
    conv2 = [e for evs in tracks.values() for e in evs if e["name"] == "conv2"]
    assert len(conv2) == 3 and all(e["args"]["accuracy"] == "fail" and "accuracy_fail" in e["cat"] for e in conv2)


# ------------------------------------------------------------ vendor counters

def _known_table(seed=5):
    """(node, op_type, stream) and per-run counter rows, every seed column."""
    rng = np.random.default_rng(seed)
    nodes = [("conv1", "Conv", "0"), ("relu1", "Relu", "0"), ("conv2", "Conv", "1"),
             ("fused_span_3", "Conv", "1"), ("fc", "Gemm", "0")]
    rows = []
    for k in range(3):
        for name, op, stream in nodes:
            counters = {c: int(rng.integers(0, 10**6)) for c in COUNTER_COLUMNS}
            counters["mcu_cycle"] = int(rng.integers(10**5, 10**6))
            if name == "conv2":
                counters["dma1_c1_byte"] = 2**62 + k    # large counters stay exact
            rows.append({"name": name, "op_type": op, "stream_id": stream, **counters, "core_id": f"c{k}"})
    return nodes, rows


def _write_counter_csv(path: Path, rows: list[dict], columns: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for r in rows:
            w.writerow([r.get(c, "") for c in columns])


def test_vendor_counter_file_reads_back_exactly(services, cnn_files, tmp_path):
    collector, analyzer = services
    model, inputs, _ = cnn_files
    nodes, rows = _known_table()
    dump = tmp_path / "dump"
    columns = ["name", "op_type", "stream_id"] + list(COUNTER_COLUMNS) + ["core_id"]
    _write_counter_csv(dump / "op_perf.csv", rows, columns)
    out = tmp_path / "out"
    res = run(model, inputs, dump=str(dump), out=out, analyzer=analyzer.address, collector=collector.address,
              progress=False, perf_mode="perf", clock_mhz=500)
    # one row per node, in the order the nodes ran, counters averaged over runs
    agg = _csv(out / "op_perf.csv")
    assert [r["name"] for r in agg] == [n for n, _, _ in nodes]
    assert list(agg[0])[:len(COUNTER_COLUMNS) + 1] == ["name"] + list(COUNTER_COLUMNS)   # the seed's columns first
    for r in agg:
        mine = [x for x in rows if x["name"] == r["name"]]
        assert r["runs"] == "3" and r["op_type"] == mine[0]["op_type"]
        for c in COUNTER_COLUMNS:
            assert float(r[c]) == pytest.approx(sum(x[c] for x in mine) / 3, rel=1e-12, abs=1e-6)
        assert float(r["mean_us"]) == pytest.approx(sum(x["mcu_cycle"] for x in mine) / 3 / 500, abs=1e-3)
    # one row per run, every counter exactly as written, unknown columns passed through
    for name, _, _ in nodes:
        per_run = _csv(out / "perf" / f"{name}.csv")
        mine = [x for x in rows if x["name"] == name]
        assert [int(p["run"]) for p in per_run] == [0, 1, 2]
        for p, x in zip(per_run, mine):
            assert {c: int(p[c]) for c in COUNTER_COLUMNS} == {c: x[c] for c in COUNTER_COLUMNS}
            assert p["core_id"] == x["core_id"] and p["stream"] == x["stream_id"]
    assert res.summary["perf"]["time_from"] == "mcu_cycle at 500 MHz"
    assert res.summary["perf"]["extra_columns"] == ["core_id"]
    # one track per stream; counters ride along on each slice
    doc = json.loads((out / "timeline.json").read_text())
    tracks = check_trace_events(doc)
    on = {_track_names(doc)[tid]: {e["name"] for e in evs} for tid, evs in tracks.items()}
    assert on == {"0": {"conv1", "relu1", "fc"}, "1": {"conv2", "fused_span_3"}}
    first_conv2 = next(e for evs in tracks.values() for e in evs if e["name"] == "conv2" and e["args"]["run"] == 0)
    assert first_conv2["args"]["mcu_cycle"] == rows[2]["mcu_cycle"]
    assert first_conv2["dur"] == pytest.approx(rows[2]["mcu_cycle"] / 500, abs=1e-3)

    # perf_all_nodes=False hides _span nodes; skip_keys and exclude_node_list apply too
    out2 = tmp_path / "hidden"
    run(model, inputs, dump=str(dump), out=out2, analyzer=analyzer.address, collector=collector.address,
        progress=False, perf_mode="perf", perf_all_nodes=False, skip_keys=["relu"], exclude_node_list="fc")
    assert [r["name"] for r in _csv(out2 / "op_perf.csv")] == ["conv1", "conv2"]
    log = (out2 / "perf_skip.log").read_text()
    assert "fused_span_3: name contains '_span'" in log
    assert "relu1: name contains skip key 'relu'" in log and "fc: listed in exclude_node_list" in log


def test_per_node_counter_files_and_missing_columns(tmp_path):
    """perf/{op}.csv files, a vendor that counts only a few columns, and
    op_perf.csv beside them not read twice."""
    dump = tmp_path / "dump"
    _write_counter_csv(dump / "perf" / "conv1.csv", [{"mcu_cycle": 10, "l1_conflict_cycle": 2},
                                                    {"mcu_cycle": 12, "l1_conflict_cycle": 3}],
                       ["mcu_cycle", "l1_conflict_cycle"])
    _write_counter_csv(dump / "perf" / "fc.csv", [{"name": "fc", "mcu_cycle": 7, "dur_us": "1.5"}],
                       ["name", "mcu_cycle", "dur_us"])
    _write_counter_csv(dump / "op_perf.csv", [{"name": "conv1", "mcu_cycle": 999}], ["name", "mcu_cycle"])
    recs = list(dump_perf_records(str(dump)))
    assert [(r.name, r.run, r.counters, r.dur_us) for r in recs] == [
        ("conv1", 0, {"mcu_cycle": 10, "l1_conflict_cycle": 2}, None),
        ("conv1", 1, {"mcu_cycle": 12, "l1_conflict_cycle": 3}, None),
        ("fc", 0, {"mcu_cycle": 7}, 1.5)]


def test_bad_counter_rows_are_skipped_with_a_reason(services, cnn_files, tmp_path):
    collector, analyzer = services
    model, inputs, _ = cnn_files
    dump = tmp_path / "dump"
    dump.mkdir()
    lines = [
        "name,mcu_cycle,mte_pld_byte,vendor_note",          # line 1: few counters, one unknown column
        "conv1,100,2000,fine",                               # 2 ok
        "conv2,abc,2000,x",                                  # 3 non-numeric
        "relu1,-5,10,x",                                     # 4 negative
        "relu2,18446744073709551615,10,x",                   # 5 overflows
        "pool,12.5,10,x",                                    # 6 not a whole count
        "flatten,100",                                       # 7 cells missing
        "fc,100,10,x,surplus",                               # 8 cells extra
        "conv3,nan,10,x",                                    # 9 not finite
        "conv3,0x1f4,,\"quoted, note\"",                     # 10 ok: hex counter, empty = not measured
    ]
    (dump / "op_perf.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    res = run(model, inputs, dump=str(dump), out=out, analyzer=analyzer.address, collector=collector.address,
              progress=False, perf_mode="perf")
    rows = {r["name"]: r for r in _csv(out / "op_perf.csv")}
    assert set(rows) == {"conv1", "conv3"}
    assert rows["conv1"]["mcu_cycle"] == "100" and rows["conv1"]["vendor_note"] == "fine"
    assert rows["conv3"]["mcu_cycle"] == "500" and rows["conv3"]["mte_pld_byte"] == ""
    assert rows["conv3"]["vendor_note"] == "quoted, note"
    log = (out / "perf_skip.log").read_text().splitlines()
    expect = {3: "column 'mcu_cycle': 'abc' is not a number", 4: "negative count -5",
              5: "overflows a 64-bit counter", 6: "'12.5' is not a whole count", 7: "row has 2 cells, the header 4",
              8: "row has 5 cells, the header 4", 9: "'nan' is not a finite number"}
    for line_no, why in expect.items():
        assert any(ln.startswith(f"op_perf.csv:{line_no} ") and why in ln for ln in log), (line_no, log)
    assert res.summary["perf"]["skipped_rows"] == len(expect)
    assert collector.alive() and analyzer.alive()


def test_broken_counter_files(tmp_path):
    dump = tmp_path / "dump"
    (dump / "perf").mkdir(parents=True)
    (dump / "perf" / "a.csv").write_bytes(b"")                                  # no header
    (dump / "perf" / "b.csv").write_text("name,mcu_cycle,mcu_cycle\nb,1,2\n")    # duplicate column
    (dump / "perf" / "c.csv").write_bytes(b"name,mcu_cycle\nc,1\n\xff\xfe,2\n")  # not UTF-8 after one good row
    (dump / "perf" / "d.csv").write_text("mcu_cycle\n5\n")                       # named by its file
    recs = list(dump_perf_records(str(dump)))
    errors = {r.source.split(":")[0]: r.message for r in recs if not r.ok}
    assert "empty file" in errors["perf/a.csv"]
    assert "'mcu_cycle' appears twice" in errors["perf/b.csv"]
    assert errors["perf/c.csv"].startswith("line is not UTF-8")
    assert [(r.name, r.counters) for r in recs if r.ok] == [("c", {"mcu_cycle": 1}), ("d", {"mcu_cycle": 5})]
    with pytest.raises(LayerdiffError, match="no performance data"):
        list(dump_perf_records(str(tmp_path)))


def _real_profile(tmp_path: Path, runs: int) -> Path:
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.profile_file_prefix = str(tmp_path / "ort")
    sess = ort.InferenceSession(small_cnn().SerializeToString(), so, providers=["CPUExecutionProvider"])
    for _ in range(runs):
        sess.run(None, {"input": np.ones((1, 3, 16, 16), np.float32)})
    return Path(sess.end_profiling())


def test_profile_cut_short_keeps_what_came_before(services, cnn_files, tmp_path):
    whole = _real_profile(tmp_path, runs=3)
    text = whole.read_text()
    full = [r for r in parse_profile(whole, "p.json") if r.ok]
    assert len(full) == 27 and {r.run for r in full} == {0, 1, 2}
    # cut inside an event of the third run: two whole runs remain, the third
    # run's earlier events are left out with its end never written
    at = [i for i in range(len(text)) if text.startswith("conv3_kernel_time", i)][2]
    cut = text[:at]
    recs = list(parse_profile(_write(tmp_path / "cut.json", cut), "cut.json"))
    ok = [r for r in recs if r.ok]
    assert {r.run for r in ok} == {0, 1} and len(ok) == 18
    errors = [r.message for r in recs if not r.ok]
    assert errors[0] == "5 node events outside any complete run left out"
    assert errors[1].startswith("cut short after") and len(errors) == 2
    # without its closing bracket only
    recs = list(parse_profile(_write(tmp_path / "nobracket.json", text.rstrip().rstrip("]")), "x.json"))
    assert len([r for r in recs if r.ok]) == 27 and any("cut short" in r.message for r in recs if not r.ok)
    assert [r.message for r in parse_profile(_write(tmp_path / "junk.json", "hello"), "junk.json")] == \
        ["not a JSON trace (no event list)"]

    # the same through a dump: the job finishes and says what it left out
    collector, analyzer = services
    model, inputs, _ = cnn_files
    dump = tmp_path / "dump"
    (dump / "perf").mkdir(parents=True)
    (dump / "perf" / "profile.json").write_text(cut)
    out = tmp_path / "out"
    run(model, inputs, dump=str(dump), out=out, analyzer=analyzer.address, collector=collector.address,
        progress=False, perf_mode="perf")
    assert all(r["runs"] == "2" for r in _csv(out / "op_perf.csv"))
    assert "perf/profile.json: cut short" in (out / "perf_skip.log").read_text()
    check_trace_events(json.loads((out / "timeline.json").read_text()))


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_perf_records_are_checked_on_receipt():
    good = PerfRecord("n", counters={"mcu_cycle": 5}, dur_us=1.0)
    [batch] = list(encode_perf([good, PerfRecord.error("m", "why", "f.csv:3"),
                                PerfRecord("bad", counters={"mcu_cycle": -1}),
                                PerfRecord("late", counters={"not_a_counter": 1}),
                                PerfRecord("t", dur_us=-2.0)]))
    got = decode_perf(batch)
    assert got[0] == PerfRecord("n", counters={"mcu_cycle": 5}, dur_us=1.0)
    assert [(r.name, r.ok) for r in got] == [("n", True), ("m", False), ("bad", False), ("late", False),
                                             ("t", False)]
    assert got[1].source == "f.csv:3" and got[1].message == "why"


def test_bad_perf_options_fail_the_submit(services, cnn_files):
    collector, analyzer = services
    model, inputs, _ = cnn_files
    client = AnalyzerClient(analyzer.address)
    base = dict(model_artifact=client.upload(model.read_bytes(), "model.onnx"),
                inputs_artifact=client.upload(inputs.read_bytes(), "inputs.npz"), collector=collector.address)
    for perf, field in ((pb.PerfOptions(mode=pb.PERF_MODE_PERF, runs=5000), "perf_runs"),
                        (pb.PerfOptions(mode=pb.PERF_MODE_BOTH, graph_optimization="fast"), "graph_optimization"),
                        (pb.PerfOptions(mode=pb.PERF_MODE_PERF, clock_mhz=-1), "clock_mhz"),
                        (pb.PerfOptions(mode=pb.PERF_MODE_PERF), "watch")):
        with pytest.raises(grpc.RpcError) as ei:
            client.submit(pb.JobSpec(perf=perf, watch=field == "watch", dump_path=str(model.parent), **base))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in ei.value.details()
    # a dump with no performance data: the job fails and says where it looked
    job = client.submit(pb.JobSpec(perf=pb.PerfOptions(mode=pb.PERF_MODE_PERF), dump_path=str(model.parent),
                                   **base))
    last = list(client.watch(job, timeout=120))[-1]
    assert last.state == pb.FAILED and "no performance data" in last.message
    client.close()


# ------------------------------------------------------------------ perf-diff

def _perf_report(services, cnn_files, tmp_path, name, rows):
    collector, analyzer = services
    model, inputs, _ = cnn_files
    dump = tmp_path / f"{name}-dump"
    _write_counter_csv(dump / "op_perf.csv", rows, ["name", "op_type"] + list(COUNTER_COLUMNS))
    out = tmp_path / name
    run(model, inputs, dump=str(dump), out=out, analyzer=analyzer.address, collector=collector.address,
        progress=False, perf_mode="perf")
    return out


def test_perf_diff_flags_the_planted_regressions_and_nothing_else(services, cnn_files, tmp_path):
    rng = np.random.default_rng(11)
    names = [f"node{i}" for i in range(12)]
    base = []
    for _ in range(2):
        for i, n in enumerate(names):
            c = {k: int(rng.integers(1000, 10**6)) for k in COUNTER_COLUMNS}
            c["mcu_cycle"] = 10**6 + 1000 * i
            base.append({"name": n, "op_type": "Conv" if i % 2 else "Add", **c})
    new = []
    for r in base:
        # every counter jitters by at most 3%, well inside the 10% threshold
        r2 = {k: (int(v * rng.uniform(0.97, 1.03)) if k in COUNTER_COLUMNS else v) for k, v in r.items()}
        if r["name"] == "node2":
            r2["mte_pld_byte"] = r["mte_pld_byte"] * 2                 # repeated moves
        if r["name"] == "node5":
            r2["l1_conflict_cycle"] = r["l1_conflict_cycle"] * 3       # L1 bank conflicts
        if r["name"] == "node7":
            r2["im_conflict_cycle"] = r["im_conflict_cycle"] + 10**6   # IMB bank conflicts
        if r["name"] == "node9":
            r2["mcu_cycle"] = int(r["mcu_cycle"] * 1.5)               # slower, nothing the seed names
            r2["mte_total_cycle"] = r2["mcu_cycle"]                     # and now waits on data
            r2.update(vme_cycle=10, mme_cycle=10, vec_cycle=10)
        new.append(r2)
    base_dir = _perf_report(services, cnn_files, tmp_path, "base", base)
    new_dir = _perf_report(services, cnn_files, tmp_path, "new", new)

    proc = subprocess.run([sys.executable, "-m", "layerdiff.client.cli", "perf-diff", str(base_dir), str(new_dir),
                           "--json", str(tmp_path / "diff.json"), "--top", "3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr        # nodes changed
    d = json.loads((tmp_path / "diff.json").read_text())
    changed = {c["node"]: c for c in d["changed"]}
    assert set(changed) == {"node2", "node5", "node7", "node9"}
    metrics = {n: {ch["metric"] for ch in c["changes"]} for n, c in changed.items()}
    assert metrics["node2"] == {"mte_pld_byte"} and metrics["node5"] == {"l1_conflict_cycle"}
    assert metrics["node7"] == {"im_conflict_cycle"}
    assert {"mcu_cycle", "time_us"} <= metrics["node9"]
    assert [f.split(":")[0] for f in changed["node2"]["flags"]] == ["repeated moves"]
    assert "L1 bank conflicts" in changed["node5"]["flags"][0]
    assert "IMB bank conflicts" in changed["node7"]["flags"][0]
    assert changed["node9"]["flags"] == [] and changed["node9"]["verdict"] == "slower"
    # the new run's heaviest node by mcu_cycle, and why
    assert d["top_by"] == "mcu_cycle" and d["top"][0]["node"] == "node9"
    assert d["top"][0]["bound"] == "data-bound"
    assert "repeated moves" in proc.stdout and "top nodes by mcu_cycle" in proc.stdout
    assert d["only_in_base"] == [] and d["only_in_new"] == [] and d["skipped"] == []

    # a run against itself: nothing to report, exit status 0
    same = subprocess.run([sys.executable, "-m", "layerdiff.client.cli", "perf-diff", str(base_dir), str(base_dir)],
                          capture_output=True, text=True, timeout=120)
    assert same.returncode == 0 and "0 changed" in same.stdout


def test_perf_diff_faster_is_listed_but_not_a_regression(tmp_path):
    from layerdiff.analyzer.report.perf.diff import perf_diff

    _write_counter_csv(tmp_path / "a.csv", [{"name": "n", "mcu_cycle": 1000, "dur_us": 10}],
                       ["name", "mcu_cycle", "dur_us"])
    _write_counter_csv(tmp_path / "b.csv", [{"name": "n", "mcu_cycle": 500, "dur_us": 5},
                                            {"name": "m", "mcu_cycle": 5, "dur_us": "oops"}],
                       ["name", "mcu_cycle", "dur_us"])
    d = perf_diff(tmp_path / "a.csv", tmp_path / "b.csv")
    assert [(c["node"], c["verdict"]) for c in d["changed"]] == [("n", "faster")] and not d["regressed"]
    assert d["only_in_new"] == ["m"] and "'oops'" in d["skipped"][0]["why"]


def test_watched_dump_counters_are_read_when_the_runtime_is_done(services, cnn_files, tmp_path):
    """With --watch the runtime writes its counters last, after the tensors:
    the job reads them once the watch has ended."""
    import threading
    import time

    from layerdiff.collector.live.onnxrt import LiveRunner

    collector, analyzer = services
    model, inputs, device = cnn_files
    records = list(LiveRunner(model.read_bytes(), dict(np.load(inputs)),
                              device_model_bytes=device.read_bytes()).records())
    dump = tmp_path / "dump"
    dump.mkdir()

    def runtime():
        for r in records:
            np.save(dump / f"{r.name}.npy", r.array, allow_pickle=False)
            time.sleep(0.1)
        _write_counter_csv(dump / "op_perf.csv", [{"name": r.node, "mcu_cycle": 1000 * (i + 1)}
                                                  for i, r in enumerate(records)], ["name", "mcu_cycle"])
        (dump / "manifest.json").write_text(json.dumps({"nodes": [{"name": r.name, "file": f"{r.name}.npy"}
                                                                  for r in records]}))

    writer = threading.Thread(target=runtime, daemon=True)
    writer.start()
    res = run(model, inputs, dump=str(dump), watch=True, out=tmp_path / "out", analyzer=analyzer.address,
              collector=collector.address, progress=False, perf_mode="both")
    writer.join()
    assert res.first_failing_node == "conv2" and res.summary["perf"]["nodes"] == 9
    view = {v["node"]: v for v in res.summary["node_view"]}
    assert view["conv2"]["perf"]["mcu_cycle"] == 3000 and view["conv2"]["accuracy"]["passed"] is False


def test_timeline_keeps_overlapping_slices_apart():
    """A source whose start times overlap on one stream: the slice that would
    partly overlap goes to a second lane, never moved, never mis-nested."""
    from layerdiff.analyzer.report.perf.table import PerfData, PerfSettings, build_table
    from layerdiff.analyzer.report.perf.timeline import timeline

    recs = [PerfRecord("a", start_us=0.0, dur_us=10.0, stream="s0"), PerfRecord("b", start_us=5.0, dur_us=10.0,
                                                                                 stream="s0"),
            PerfRecord("c", start_us=15.0, dur_us=1.0, stream="s0")]
    doc = timeline(build_table(PerfData(recs), None, PerfSettings()), {}, "t")
    tracks = check_trace_events(doc)
    lanes = {_track_names(doc)[tid]: [(e["name"], e["ts"]) for e in evs] for tid, evs in tracks.items()}
    assert lanes == {"runs": [("run 0", 0.0)], "s0": [("a", 0.0), ("c", 15.0)], "s0 (overlap 1)": [("b", 5.0)]}


def test_counter_files_read_through_the_embedded_services(cnn_files, tmp_path):
    """With the embedded services the dump's tensors are read in this
    process, its performance records still stream: the counters read back."""
    model, inputs, _ = cnn_files
    nodes, rows = _known_table()
    dump = tmp_path / "dump"
    _write_counter_csv(dump / "op_perf.csv", rows, ["name", "op_type", "stream_id"] + list(COUNTER_COLUMNS))
    res = run(model, inputs, dump=str(dump), out=tmp_path / "out", progress=False, perf_mode="perf", clock_mhz=500)
    agg = _csv(tmp_path / "out" / "op_perf.csv")
    assert [r["name"] for r in agg] == [n for n, _, _ in nodes] and all(r["runs"] == "3" for r in agg)
    assert res.summary["perf"]["perf_mode"] == "perf"
