"""Faults an operator meets, made for real: Redis killed (restarted, or
gone), a job cancelled while its workers hang, the collector killed, the
network to the collector cut. Every one ends the job within a stated bound
with a reason naming the component; a quiet but healthy stream is never cut.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import ServiceProcess, wait_for
from netns import Hosts, remove_leftovers, require_netns
from test_distributed import RedisServer, _workers_ready, frozen, start_worker

from layerdiff.client.analyzer_client import AnalyzerClient
from layerdiff.client.api import run
from layerdiff.collector.live.onnxrt import LiveRunner
from layerdiff.common.errors import JobFailed
from layerdiff.v1 import layerdiff_pb2 as pb

GRACE_S = 4          # LAYERDIFF_STORE_GRACE_S of the tests' analyzer
LIVENESS_S = 3       # LAYERDIFF_COLLECTOR_LIVENESS_S of the tests' analyzers
SILENCE_S = 6        # LAYERDIFF_WORKER_SILENCE_S of the tests' analyzer


# ------------------------------------------------------------ the fan-out alone

def _big_node(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """1 MiB a side: its tensors go to the analyzer's tensor endpoint, so
    sending its task is the first thing that needs the broker."""
    ref = np.random.default_rng(seed).standard_normal(1 << 18).astype(np.float32)
    return ref, ref.copy()


@contextlib.contextmanager
def _pool_without_broker(tmp_path, job: str, grace_s: float):
    """A Celery pool whose Redis has just been killed; yields the Redis (to
    start again), the pool and ``submit(seed)`` of a 1 MiB node."""
    from layerdiff.analyzer.compare.tolerances import Tolerances
    from layerdiff.analyzer.execute.fanout import CeleryPool

    rs = RedisServer(tmp_path)
    try:
        pool = CeleryPool(rs.url, job, batch_bytes=1, store_grace_s=grace_s, deadline_s=600)
        rs.stop()
        yield rs, pool, lambda seed: pool.submit(*_big_node(seed), Tolerances().default, 8, False)
    finally:
        rs.stop()


def test_a_broker_refusing_tasks_fails_the_node_and_the_pool_closes(tmp_path):
    """The hang that was: sending a task failed inside submit, the items
    stayed registered with no task, and close() waited for the deadline."""
    with _pool_without_broker(tmp_path, "refused", GRACE_S) as (rs, pool, submit):
        started = time.monotonic()
        fut = submit(0)
        with pytest.raises(Exception) as ei:
            fut.result(timeout=GRACE_S + 15)
        assert rs.url in str(ei.value) and "unreachable" in str(ei.value), str(ei.value)
        pool.close()
        assert time.monotonic() - started < GRACE_S + 15
        assert not pool._poller.is_alive()


def test_a_broker_back_without_the_job_fails_it_at_once(tmp_path):
    with _pool_without_broker(tmp_path, "restarted", 60) as (rs, pool, submit):
        fut = submit(1)
        time.sleep(1.0)
        rs.start()                       # empty: the job's marker is gone
        started = time.monotonic()
        with pytest.raises(Exception) as ei:
            fut.result(timeout=20)
        assert "restarted" in str(ei.value) and rs.url in str(ei.value), str(ei.value)
        assert time.monotonic() - started < 10       # not the 60 s grace: the broker answered
        pool.close()


def test_cancel_ends_every_wait_of_the_pool_during_an_outage(tmp_path):
    from layerdiff.analyzer.execute.fanout import PoolCancelled

    with _pool_without_broker(tmp_path, "cancelled", 60) as (rs, pool, submit):
        futs = [submit(i) for i in range(3)]
        started = time.monotonic()
        pool.cancel()
        for f in futs:
            with pytest.raises(PoolCancelled):
                f.result(timeout=5)
        pool.close()
        assert time.monotonic() - started < 5


# ------------------------------------------------------------- whole services

@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    """Redis, one worker, an analyzer on it with short fault bounds, a
    collector: each its own process."""
    base = tmp_path_factory.mktemp("faulty")
    rs = RedisServer(base)
    env = dict(os.environ, LAYERDIFF_VISIBILITY_TIMEOUT_S="5", LAYERDIFF_TASK_TIMEOUT_S="4",
               LAYERDIFF_JOB_DEADLINE_S="300", LAYERDIFF_STORE_GRACE_S=str(GRACE_S),
               LAYERDIFF_COLLECTOR_LIVENESS_S=str(LIVENESS_S), LAYERDIFF_WORKER_SILENCE_S=str(SILENCE_S))
    worker = start_worker(rs.url, env)
    procs = []
    try:
        assert wait_for(lambda: _workers_ready(rs.url, 1), 60), "the worker did not come up"
        procs.append(ServiceProcess("collector", base / "collector", env=env))
        procs.append(ServiceProcess("analyzer", base / "analyzer", env=dict(env, LAYERDIFF_BROKER_URL=rs.url)))
        yield {"redis": rs, "worker": worker, "collector": procs[0], "analyzer": procs[1], "env": env}
    finally:
        for p in procs:
            p.stop()
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
        rs.stop()


def _det_job(client: AnalyzerClient, collector: str, tmp_path) -> str:
    from layerdiff.client.demo import det_input, packaged_model

    np.savez(tmp_path / "page.npz", x=det_input(320, 320))
    spec = pb.JobSpec(model_artifact=client.upload(packaged_model().read_bytes(), "det.onnx"),
                      inputs_artifact=client.upload((tmp_path / "page.npz").read_bytes(), "page.npz"),
                      collector=collector, precision="fp16")
    return client.submit(spec)


def _events_until(client, job, action, when, timeout=120):
    """Watch a job; run ``action`` once ``when(event)`` holds. Returns the
    last event and the time from the action to the end."""
    acted = None
    last = None
    for ev in client.watch(job, timeout=timeout):
        last = ev
        if acted is None and when(ev):
            action()
            acted = time.monotonic()
    assert acted is not None, f"the job ended before the fault: {last}"
    return last, time.monotonic() - acted


@pytest.mark.parametrize("down_s", [1.0, GRACE_S + 4.0])
def test_redis_killed_mid_job_ends_it_with_the_broker_named(faulty, tmp_path, down_s):
    """Restarted within the grace: its data is gone, the job fails as soon
    as it answers; down longer: the job fails once the grace has passed."""
    rs = faulty["redis"]
    client = AnalyzerClient(faulty["analyzer"].address)

    def outage():
        rs.stop()
        threading.Timer(down_s, rs.start).start()

    job = _det_job(client, faulty["collector"].address, tmp_path)
    last, took = _events_until(client, job, outage, lambda ev: ev.nodes_done >= 20)
    assert last.state == pb.FAILED, last
    assert rs.url in last.message and last.exit_status == 3, last.message
    if down_s < GRACE_S:
        assert "restarted" in last.message, last.message
    else:
        assert f"unreachable for {GRACE_S} s" in last.message, last.message
    # bound: the outage, the grace, the task timeout, a poll
    assert took < down_s + GRACE_S + 4 + 6, f"the job took {took:.1f} s to end"
    assert wait_for(lambda: rs.proc.poll() is None and _workers_ready(rs.url, 1), 60)
    assert faulty["analyzer"].alive()


def test_cancel_ends_a_job_whose_workers_hang(faulty, tmp_path):
    client = AnalyzerClient(faulty["analyzer"].address)
    job = _det_job(client, faulty["collector"].address, tmp_path)
    with contextlib.ExitStack() as stack:
        def hang_then_cancel():
            stack.enter_context(frozen([faulty["worker"]]))
            time.sleep(2.0)
            client.cancel(job)

        last, took = _events_until(client, job, hang_then_cancel, lambda ev: ev.nodes_done >= 10)
    assert last.state == pb.CANCELLED and took < 2.0 + 5, (last, took)


def test_workers_that_all_hang_fail_the_job_naming_them(faulty, tmp_path):
    client = AnalyzerClient(faulty["analyzer"].address)
    job = _det_job(client, faulty["collector"].address, tmp_path)
    with contextlib.ExitStack() as stack:
        last, took = _events_until(client, job, lambda: stack.enter_context(frozen([faulty["worker"]])),
                                   lambda ev: ev.nodes_done >= 10)
    assert last.state == pb.FAILED and last.exit_status == 3, last
    assert f"no worker has answered for {SILENCE_S} s on broker {faulty['redis'].url}" in last.message, last.message
    assert took < SILENCE_S + 4 + 8, f"the job took {took:.1f} s to end"


def test_the_collector_killed_mid_stream_fails_the_job_naming_it(tmp_path, cnn_files):
    from layerdiff.client.demo import det_input, packaged_model

    collector = ServiceProcess("collector", tmp_path / "collector")
    analyzer = ServiceProcess("analyzer", tmp_path / "analyzer")
    try:
        np.savez(tmp_path / "page.npz", x=det_input(320, 320))
        client = AnalyzerClient(analyzer.address)
        spec = pb.JobSpec(model_artifact=client.upload(packaged_model().read_bytes(), "det.onnx"),
                          inputs_artifact=client.upload((tmp_path / "page.npz").read_bytes(), "page.npz"),
                          collector=collector.address, precision="fp16")
        job = client.submit(spec)
        last, took = _events_until(client, job, collector.proc.kill, lambda ev: ev.nodes_done >= 5)
        assert last.state == pb.FAILED and f"collector {collector.address}" in last.message, last
        assert last.exit_status == 3 and took < 10, (last, took)
        assert analyzer.alive()
    finally:
        analyzer.stop()
        collector.stop()


# -------------------------------------------------------------- the stream

def _write_npy(path, arr) -> None:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    tmp = path.with_suffix(".part")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, path)


def _device_records(cnn_files):
    model, inputs, device = cnn_files
    return list(LiveRunner(model.read_bytes(), dict(np.load(inputs)), device_model_bytes=device.read_bytes())
                .records())


def test_a_quiet_healthy_stream_outlives_the_liveness_interval(tmp_path, cnn_files):
    """The runtime pauses for several liveness intervals mid-dump (a long
    kernel, a slow device): heartbeats keep the stream, every node is
    compared."""
    model, inputs, _ = cnn_files
    env = dict(os.environ, LAYERDIFF_COLLECTOR_LIVENESS_S="1")
    collector = ServiceProcess("collector", tmp_path / "collector", env=env)
    analyzer = ServiceProcess("analyzer", tmp_path / "analyzer", env=env)
    records = _device_records(cnn_files)
    dump = tmp_path / "dump"
    dump.mkdir()

    def runtime():
        for i, r in enumerate(records):
            if i == 3:
                time.sleep(5.0)       # five liveness intervals without a file
            _write_npy(dump / f"{r.name}.npy", r.array)
        (dump / "manifest.json").write_text(json.dumps(
            {"nodes": [{"name": r.name, "file": f"{r.name}.npy"} for r in records]}))

    writer = threading.Thread(target=runtime, daemon=True)
    try:
        writer.start()
        started = time.monotonic()
        res = run(model, inputs, dump=str(dump), watch=True, out=tmp_path / "out", analyzer=analyzer.address,
                  collector=collector.address, progress=False)
        assert time.monotonic() - started > 5
        assert res.summary["counts"]["compared"] == len(records) and res.first_failing_node == "conv2"
    finally:
        writer.join(timeout=30)
        analyzer.stop()
        collector.stop()


@pytest.fixture
def collector_host(tmp_path):
    """A collector on a host of its own (a network namespace joined to this
    one by a veth pair on a bridge)."""
    require_netns()
    remove_leftovers()
    h = Hosts("c")
    proc = log = None
    try:
        h.create()
        log = open(tmp_path / "collector.log", "w")
        # a trusted test network: plain text, no tokens; dumps only below tmp_path
        env = dict(os.environ, LAYERDIFF_INSECURE="1", LAYERDIFF_DUMP_ROOTS=str(tmp_path))
        proc = subprocess.Popen(h.in_ns(sys.executable, "-m", "layerdiff.client.cli", "collector", "serve", "--host",
                                        h.peer_ip, "--port", "0", "--workdir", str(tmp_path / "collector-state")),
                                stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True, env=env)
        m = re.search(r"listening on (\S+)", proc.stdout.readline())
        assert m, f"the collector did not start: {(tmp_path / 'collector.log').read_text()}"
        yield h, m.group(1)
    finally:
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        if log is not None:
            log.close()
        problems = h.delete()
        assert not problems and not h.exists(), f"namespaces left behind: {problems}"


def test_a_cut_link_to_the_collector_fails_the_job_naming_it(collector_host, tmp_path, cnn_files):
    h, address = collector_host
    model, inputs, _ = cnn_files
    analyzer = ServiceProcess("analyzer", tmp_path / "analyzer",
                              env=dict(os.environ, LAYERDIFF_COLLECTOR_LIVENESS_S=str(LIVENESS_S),
                                       LAYERDIFF_COLLECTOR_ALLOW=address.rpartition(":")[0]))
    records = _device_records(cnn_files)
    dump = tmp_path / "dump"        # the namespace shares this filesystem: the runtime writes, the collector reads
    dump.mkdir()
    for r in records[:3]:
        _write_npy(dump / f"{r.name}.npy", r.array)
    cut = []

    def on_event(ev):
        if not cut and ev.nodes_done >= 1:
            h.cut()
            cut.append(time.monotonic())

    try:
        with pytest.raises(JobFailed) as ei:
            run(model, inputs, dump=str(dump), watch=True, out=tmp_path / "out", analyzer=analyzer.address,
                collector=address, progress=on_event, timeout=60)
        took = time.monotonic() - cut[0]
        msg = str(ei.value)
        assert f"collector {address} unreachable for {LIVENESS_S} s" in msg, msg
        assert ei.value.exit_status == 3
        assert LIVENESS_S - 0.5 < took < LIVENESS_S + 6, f"noticed after {took:.1f} s"
        # mended, the same analyzer and collector answer the next job in full
        h.mend()
        for r in records[3:]:
            _write_npy(dump / f"{r.name}.npy", r.array)
        (dump / "manifest.json").write_text(json.dumps(
            {"nodes": [{"name": r.name, "file": f"{r.name}.npy"} for r in records]}))
        res = run(model, inputs, dump=str(dump), watch=True, out=tmp_path / "out2", analyzer=analyzer.address,
                  collector=address, progress=False, timeout=60)
        assert res.summary["counts"]["compared"] == len(records)
    finally:
        analyzer.stop()
