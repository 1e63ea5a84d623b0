"""(a) Vendor counter files through the performance stream: rows per second
from a collector process to the analyzer's per-node table, against parsing
the same file with csv.reader in this process (the floor: no checks, no
wire, no aggregation).

(b) What onnxruntime's profiler costs a live run: mean time per run of the
packaged detector with and without profiling, in this process.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from procs import serve  # noqa: E402

from layerdiff.analyzer.jobs.receive import CollectorStream  # noqa: E402
from layerdiff.analyzer.report.perf.table import PerfSettings, build_table, receive  # noqa: E402
from layerdiff.collector.service import CollectorClient  # noqa: E402
from layerdiff.common.perfschema import COUNTER_COLUMNS  # noqa: E402
from layerdiff.v1 import layerdiff_pb2 as pb  # noqa: E402


def write_counters(path: Path, nodes: int, runs: int) -> int:
    rng = np.random.default_rng(0)
    values = rng.integers(0, 10**9, size=(nodes * runs, len(COUNTER_COLUMNS)))
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["name", "op_type", "stream_id"] + list(COUNTER_COLUMNS))
        for i, row in enumerate(values):
            w.writerow([f"node_{i % nodes}", "Conv", str(i % 2)] + row.tolist())
    return nodes * runs


def bench_counters(nodes: int, runs: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="layerdiff-bench-perf-") as tmp:
        dump = Path(tmp) / "dump"
        dump.mkdir()
        rows = write_counters(dump / "op_perf.csv", nodes, runs)
        t_csv = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            with open(dump / "op_perf.csv", newline="") as f:
                for _row in csv.reader(f):
                    pass
            t_csv = min(t_csv, time.perf_counter() - t)
        proc, address = serve("collector", Path(tmp) / "collector")
        try:
            client = CollectorClient(address)
            client.wait_ready()
            t_stream = float("inf")
            for _ in range(repeats):
                t = time.perf_counter()
                stream = CollectorStream(client, pb.CaptureRequest(job_id="bench", dump=pb.DumpSource(path=str(dump)),
                                                                   stream=pb.CAPTURE_STREAM_PERF)).open()
                try:
                    data = receive(stream)
                finally:
                    stream.close()
                table = build_table(data, None, PerfSettings())
                t_stream = min(t_stream, time.perf_counter() - t)
            assert len(table.nodes) == nodes and not data.errors
            client.close()
        finally:
            proc.terminate()
            proc.wait()
    return {"rows": rows, "counters_per_row": len(COUNTER_COLUMNS), "stream_and_table_s": round(t_stream, 3),
            "rows_per_s": round(rows / t_stream), "csv_reader_s": round(t_csv, 3),
            "csv_reader_rows_per_s": round(rows / t_csv), "vs_csv_reader": round(t_stream / t_csv, 2)}


def bench_profiling(runs: int) -> dict:
    import onnxruntime as ort

    from layerdiff.client.demo import det_input, packaged_model

    model = str(packaged_model())
    feeds = {"x": det_input(320, 320)}
    with tempfile.TemporaryDirectory() as tmp:
        sessions = {}
        for profiled in (False, True):
            so = ort.SessionOptions()
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
            so.enable_profiling = profiled
            so.profile_file_prefix = str(Path(tmp) / "p")
            # Two sessions take turns: the idle one's threads must not spin
            # on the cores the other is being timed on.
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
            sessions[profiled] = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
            sessions[profiled].run(None, feeds)
        times: dict[bool, list[float]] = {False: [], True: []}
        # Interleaved, so that whatever else loads the machine weighs on both alike.
        for _ in range(runs):
            for profiled, sess in sessions.items():
                t = time.perf_counter()
                sess.run(None, feeds)
                times[profiled].append(time.perf_counter() - t)
        sessions[True].end_profiling()
    out = {"plain_ms": round(1000 * float(np.median(times[False])), 2),
           "profiled_ms": round(1000 * float(np.median(times[True])), 2)}
    out["overhead_pct"] = round(100 * (out["profiled_ms"] / out["plain_ms"] - 1), 1)
    out["runs"] = runs
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nodes", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile-runs", type=int, default=20)
    a = ap.parse_args(argv)
    res = {"counters": bench_counters(a.nodes, a.runs, a.repeats), "profiling": bench_profiling(a.profile_runs)}
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
