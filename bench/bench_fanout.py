"""Celery fan-out against the local pool, from one run on this machine:

- wall time of a job the size of a real OCR recognizer (PP-OCRv4 rec, 860
  nodes, a dump of about 1 GB) through Celery with 2 workers, against the
  local pool (goal: ratio <= 2 on 2 cores);
- per-task overhead: the round trip of an empty comparison task, in ms;
- bytes the broker carries per node (goal <= 1 KiB), read off the broker
  itself (MONITOR of the task pushes);
- worker fetch throughput from the Redis store and from the analyzer's Flight
  endpoint, measured in a separate process as a worker does.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import redis
from procs import TaskPushes, serve, wait

from layerdiff.client.api import run
from layerdiff.client.demo import REC_MODEL, packaged_model
from layerdiff.collector.dumps.directory import write_dump
from layerdiff.collector.live.onnxrt import LiveRunner
from layerdiff.common.net import free_port

_FETCH = r"""
import json, sys, time
from layerdiff.analyzer.execute.store import TensorStore
url, refs = sys.argv[1], json.loads(sys.argv[2])
s = TensorStore(url)
out = {}
for name, ref in refs.items():
    best = 1e9
    for _ in range(3):
        t = time.perf_counter(); s.get(ref); best = min(best, time.perf_counter() - t)
    out[name] = ref["nbytes"] / best / 1e9
print(json.dumps(out))
"""


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=10, help="recognizer batch (10 x 48x320 gives ~1 GB of FP16 dump)")
    ap.add_argument("--empty-tasks", type=int, default=200)
    a = ap.parse_args(argv)
    procs = []
    with tempfile.TemporaryDirectory(prefix="layerdiff-bench-fanout-") as tmp:
        tmp = Path(tmp)
        port = free_port()
        url = f"redis://127.0.0.1:{port}/0"
        procs.append(subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                       "--appendonly", "no", "--dir", str(tmp)], stdout=subprocess.DEVNULL))
        r = redis.Redis(port=port)
        wait(r.ping)
        env = dict(os.environ)
        for _ in range(2):
            procs.append(subprocess.Popen([sys.executable, "-m", "layerdiff.client.cli", "worker", "--broker", url,
                                           "--max-cores", "1"], env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
        model = packaged_model(REC_MODEL)
        rng = np.random.default_rng(0)
        feeds = {"x": rng.uniform(-1, 1, (a.batch, 3, 48, 320)).astype(np.float32)}
        np.savez(tmp / "in.npz", **feeds)
        dump = write_dump(tmp / "dump", list(LiveRunner(model.read_bytes(), feeds, precision="fp16").records()))
        dump_bytes = sum(p.stat().st_size for p in dump.glob("*.npy"))
        collector, caddr = serve("collector", tmp / "c", env)
        local, laddr = serve("analyzer", tmp / "l", env)
        celery, daddr = serve("analyzer", tmp / "d", dict(env, LAYERDIFF_BROKER_URL=url))
        procs += [collector, local, celery]
        from layerdiff.analyzer.execute.celery_app import QUEUE, TASK, make_app

        app = make_app(url)
        wait(lambda: len(app.control.ping(timeout=1.0)) >= 2)

        walls = {}
        for name, addr in (("local", laddr), ("celery", daddr), ("local2", laddr), ("celery2", daddr)):
            t0 = time.perf_counter()
            res = run(model, tmp / "in.npz", dump=str(dump), out=tmp / name, analyzer=addr, collector=caddr,
                      progress=False)
            walls[name] = time.perf_counter() - t0
            nodes = res.summary["counts"]["compared"]

        # One more run, not timed, to read the size of every task message pushed.
        with TaskPushes(port) as monitored:
            run(model, tmp / "in.npz", dump=str(dump), out=tmp / "monitored", analyzer=daddr, collector=caddr,
                progress=False)
        pushes = monitored.sizes

        from layerdiff.analyzer.execute.store import TensorStore, tensor_endpoint

        store = TensorStore(url)
        store.open_job("bench")
        rtts = []
        for _ in range(a.empty_tasks):
            t0 = time.perf_counter()
            app.send_task(TASK, args=["bench", []], queue=QUEUE).get(timeout=30)
            rtts.append(time.perf_counter() - t0)
        big = rng.standard_normal(64 * 2**20 // 4).astype(np.float32)
        refs = {"redis": store.put("bench", "big", big), "flight": tensor_endpoint().put("layerdiff:job:bench:f", big)}
        fetch = json.loads(subprocess.run([sys.executable, "-c", _FETCH, url, json.dumps(refs)], capture_output=True,
                                          text=True, check=True).stdout)
        store.drop_job("bench")
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()

    local_wall = min(walls["local"], walls["local2"])
    celery_wall = min(walls["celery"], walls["celery2"])
    res = {
        "dump_MiB": dump_bytes / 2**20, "nodes": nodes, "local_wall_s": local_wall, "celery_wall_s": celery_wall,
        "wall_ratio": celery_wall / local_wall, "empty_task_ms": 1000 * float(np.median(rtts)),
        "tasks": len(pushes), "broker_bytes_per_node": sum(pushes) / max(nodes, 1),
        "fetch_redis_GBps": fetch["redis"], "fetch_flight_GBps": fetch["flight"],
        "goal": "wall_ratio <= 2, broker_bytes_per_node <= 1024",
    }
    print(f"(e) OCR recognizer dump {res['dump_MiB']:.0f} MiB, {nodes} nodes")
    print(f"    local pool          {local_wall:7.2f} s")
    print(f"    Celery, 2 workers   {celery_wall:7.2f} s   ratio {res['wall_ratio']:.2f} (goal <= 2)")
    print(f"    empty task round trip {res['empty_task_ms']:.2f} ms;  {res['tasks']} tasks for {nodes} nodes")
    print(f"    broker bytes per node {res['broker_bytes_per_node']:.0f} B (goal <= 1024)")
    print(f"    worker fetch: Redis {fetch['redis']:.2f} GB/s, analyzer Flight endpoint {fetch['flight']:.2f} GB/s")
    print(json.dumps({"fanout": res}))
    return res


if __name__ == "__main__":
    main()
