"""Soak: many small jobs against one collector and one analyzer (each its own
process), and what the services hold afterwards.

For each service: open descriptors (all, and sockets), threads and resident
memory at idle (before the first job), after job 1, after the last job and
the most seen after any job, each also as a ratio to the idle figure of the
same run; the analyzer's established connections to the collector after
each job; the jobs' median wall time. A service that keeps something per job
shows it as a last-job figure above the job-1 figure (goal: descriptors,
sockets and threads after the last job equal to after job 1, RSS within a
few percent of it, no connection to the collector left once a job is done).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).parent))

from procs import connections_to, serve, socket_inodes  # noqa: E402

from layerdiff.client.api import run  # noqa: E402

METRICS = ("fds", "sockets", "threads", "rss_MiB")


def small_cnn(bug: bool = False, side: int = 16, width: int = 8) -> onnx.ModelProto:
    """conv -> relu -> conv -> relu -> add -> conv -> pool -> flatten -> gemm
    (conftest's small CNN); ``bug`` perturbs the second conv's weights."""
    rng = np.random.default_rng(0)
    inits, c = [], width

    def w(name, shape, scale):
        a = (rng.standard_normal(shape) * scale).astype(np.float32)
        if bug and name.startswith("conv2."):
            a = a * 1.8 + 0.05
        inits.append(numpy_helper.from_array(a, name))
        return name

    def conv(name, x, cin, cout, out):
        weight, bias = w(f"{name}.weight", (cout, cin, 3, 3), 0.2), w(f"{name}.bias", (cout,), 0.1)
        return helper.make_node("Conv", [x, weight, bias],
                                [out], name=name, pads=[1, 1, 1, 1])

    nodes = [conv("conv1", "input", 3, c, "c1"), helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             conv("conv2", "r1", c, c, "c2"), helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
             helper.make_node("Add", ["r2", "r1"], ["a"], name="add"), conv("conv3", "a", c, 2 * c, "c3"),
             helper.make_node("GlobalAveragePool", ["c3"], ["p"], name="pool"),
             helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", w("fc.weight", (10, 2 * c), 0.3), w("fc.bias", (10,), 0.1)], ["logits"],
                              name="fc", transB=1)]
    graph = helper.make_graph(nodes, "soak_cnn",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, side, side])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def sample(pid: int) -> dict:
    status = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        status[key] = value.split()
    return {"fds": len(os.listdir(f"/proc/{pid}/fd")), "sockets": len(socket_inodes(pid)),
            "threads": int(status["Threads"][0]), "rss_MiB": round(int(status["VmRSS"][0]) / 1024, 1)}


def _summary(rows: list[dict]) -> dict:
    idle, first, last = rows[0], rows[1], rows[-1]
    out = {}
    for k in METRICS:
        most = max(r[k] for r in rows[1:])
        out[k] = {"idle": idle[k], "job1": first[k], "last": last[k], "max": most,
                  "job1_ratio": round(first[k] / idle[k], 3), "last_ratio": round(last[k] / idle[k], 3),
                  "max_ratio": round(most / idle[k], 3)}
    return out


def bench_soak(work: Path, jobs: int, settle_s: float) -> dict:
    model, device, inputs = work / "model.onnx", work / "device.onnx", work / "inputs.npz"
    onnx.save_model(small_cnn(), str(model))
    onnx.save_model(small_cnn(bug=True), str(device))
    np.savez(inputs, input=np.random.default_rng(1).standard_normal((1, 3, 16, 16)).astype(np.float32))
    collector, caddr = serve("collector", work / "collector")
    procs = [collector]
    try:
        analyzer, aaddr = serve("analyzer", work / "analyzer")
        procs.append(analyzer)
        cport = int(caddr.rsplit(":", 1)[1])
        pids = {"collector": collector.pid, "analyzer": analyzer.pid}
        rows = {name: [sample(pid)] for name, pid in pids.items()}
        conns, walls, first_node = [], [], None
        for _ in range(jobs):
            t = time.perf_counter()
            res = run(model, inputs, device_model=device, analyzer=aaddr, collector=caddr, out=work / "out",
                      progress=False)
            walls.append(time.perf_counter() - t)
            first_node = res.first_failing_node
            time.sleep(settle_s)   # a closed connection's far end sees the FIN a moment later
            for name, pid in pids.items():
                rows[name].append(sample(pid))
            conns.append(connections_to(analyzer.pid, cport))
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            p.wait()
    return {"jobs": jobs, "first_failing_node": first_node, "job_wall_s_median": round(float(np.median(walls)), 3),
            "job1_wall_s": round(walls[0], 3), "collector": _summary(rows["collector"]),
            "analyzer": _summary(rows["analyzer"]), "analyzer_to_collector_connections_after_job": conns,
            "per_job": {name: [{k: r[k] for k in METRICS} for r in rs] for name, rs in rows.items()},
            "goal": "fds, sockets and threads after the last job == after job 1; RSS last/job1 <= 1.05; "
                    "no analyzer -> collector connection left after a job"}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--jobs", type=int, default=50)
    ap.add_argument("--settle", type=float, default=0.2, help="seconds between a job's end and the sample")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="layerdiff-bench-soak-") as tmp:
        res = bench_soak(Path(tmp), a.jobs, a.settle)
    print(f"soak: {res['jobs']} jobs (small CNN vs a buggy build, first failing {res['first_failing_node']}), "
          f"median job {res['job_wall_s_median']:.2f} s (job 1: {res['job1_wall_s']:.2f} s)")
    for name in ("collector", "analyzer"):
        for k in METRICS:
            m = res[name][k]
            print(f"    {name:9} {k:8} idle {m['idle']:>7}  job1 {m['job1']:>7} ({m['job1_ratio']:.2f}x)  "
                  f"last {m['last']:>7} ({m['last_ratio']:.2f}x)  max {m['max']:>7} ({m['max_ratio']:.2f}x)")
    c = res["analyzer_to_collector_connections_after_job"]
    print(f"    analyzer -> collector connections after a job: max {max(c)}, after the last {c[-1]}")
    print(json.dumps({"soak": {k: v for k, v in res.items() if k != "per_job"}}))
    return res


if __name__ == "__main__":
    main()
