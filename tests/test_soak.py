"""Long-running services stay level: job after job against one collector and
one analyzer (separate processes), their open descriptors (all, and
sockets), threads and the analyzer's connections to the collector return to
the level the first job left, instead of growing by one connection a job;
with comparisons on the local pool and on Celery workers (the analyzer's
connections to Redis stay level too)."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

import numpy as np
import onnx
import pytest
from conftest import ROOT, ServiceProcess, small_cnn, wait_for
from test_distributed import RedisServer, _workers_ready, start_worker

from layerdiff.client.api import run

sys.path.insert(0, str(ROOT / "bench"))
from procs import connections_to, socket_inodes  # noqa: E402  (what bench/soak.py samples, job after job)

JOBS = 10
SLACK = 2           # a gRPC worker thread or a socket closing a moment late, never one per job
SETTLE_S = 2.0      # a closed connection's far end sees the FIN asynchronously


def _threads(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def _sample(pid: int, peer_port: int | None) -> dict:
    return {"fds": len(os.listdir(f"/proc/{pid}/fd")), "sockets": len(socket_inodes(pid)), "threads": _threads(pid),
            "conns": connections_to(pid, peer_port) if peer_port else 0}


def _settled(pid: int, peer_port: int | None, level: dict | None) -> dict:
    """A sample once descriptors and connections are back to ``level`` (or
    after SETTLE_S: a leak never settles, a connection closing a moment late
    does)."""
    end = time.monotonic() + SETTLE_S
    while True:
        s = _sample(pid, peer_port)
        if level is None or all(s[k] <= level[k] for k in ("fds", "sockets", "conns")) or time.monotonic() > end:
            return s
        time.sleep(0.05)


@pytest.fixture(params=["local", "celery"])
def pair(request, tmp_path):
    """A collector and an analyzer: comparing on its own pool, or on a Celery
    worker through a Redis of the test's own."""
    with contextlib.ExitStack() as stack:
        env = None
        if request.param == "celery":
            rs = RedisServer(tmp_path)
            stack.callback(rs.stop)
            env = dict(os.environ, LAYERDIFF_BROKER_URL=rs.url, LAYERDIFF_FLIGHT_MIN_BYTES="2048")
            worker = start_worker(rs.url, env)
            stack.callback(_stop_worker, worker)
            assert wait_for(lambda: _workers_ready(rs.url, 1), 60), "the worker did not come up"
        collector = ServiceProcess("collector", tmp_path / "collector")
        stack.callback(collector.stop)
        analyzer = ServiceProcess("analyzer", tmp_path / "analyzer", env=env)
        stack.callback(analyzer.stop)
        yield collector, analyzer


def _stop_worker(worker) -> None:
    if worker.poll() is None:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()


@pytest.mark.timeout(120)
def test_descriptors_threads_and_connections_stay_level(pair, tmp_path):
    collector, analyzer = pair
    model, device, inputs = tmp_path / "model.onnx", tmp_path / "device.onnx", tmp_path / "inputs.npz"
    onnx.save_model(small_cnn(), str(model))
    onnx.save_model(small_cnn(bug_in="conv2"), str(device))
    np.savez(inputs, input=np.random.default_rng(1).standard_normal((1, 3, 16, 16)).astype(np.float32))
    cport = int(collector.address.rsplit(":", 1)[1])
    procs = {"collector": (collector.proc.pid, None), "analyzer": (analyzer.proc.pid, cport)}
    seen: dict[str, list[dict]] = {name: [] for name in procs}
    for i in range(JOBS):
        res = run(model, inputs, device_model=device, analyzer=analyzer.address, collector=collector.address,
                  out=tmp_path / f"out{i}", progress=False)
        assert res.first_failing_node == "conv2"
        if i == 0:
            time.sleep(0.5)   # the level every later job is held to: let the first job's closes land
        for name, (pid, peer) in procs.items():
            first = seen[name][0] if seen[name] else None
            seen[name].append(_settled(pid, peer, first))
    assert collector.alive() and analyzer.alive()
    report = "\n".join(f"{name}: " + "  ".join(f"{k}=" + ",".join(str(s[k]) for s in rows) for k in rows[0])
                       for name, rows in seen.items())
    for name, rows in seen.items():
        first, second, last = rows[0], rows[1], rows[-1]
        for k in ("fds", "sockets", "threads"):
            assert max(s[k] for s in rows) <= first[k] + SLACK, f"{name} {k} grow job after job\n{report}"
            assert last[k] <= second[k] + SLACK, f"{name} {k} grow job after job\n{report}"
    # every job closes its connection to the collector: none outlives its job
    conns = [s["conns"] for s in seen["analyzer"]]
    assert conns[-1] <= conns[0] and max(conns) <= 1, f"analyzer -> collector connections left open\n{report}"
