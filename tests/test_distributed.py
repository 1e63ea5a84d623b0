"""Comparisons fanned out to Celery workers on a real Redis: identical
reports to the local pool, no tensor bytes in messages, survival of a killed
worker, a clear failure when Redis restarts, clear errors for bad tasks, and
nodes the system kept from being compared retried, then failing the job,
never passed over as skips."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest
import redis
from conftest import ServiceProcess, wait_for
from ports import free_port

from layerdiff.client.analyzer_client import AnalyzerClient
from layerdiff.client.api import run
from layerdiff.v1 import layerdiff_pb2 as pb

CHUNK = "4096"   # small chunks so that the tests' nodes are split and merged


class RedisServer:
    """A redis-server of the test's own on a free port of ``host`` (loopback,
    or an address of a test network that other namespaces reach)."""

    def __init__(self, workdir, host: str = "127.0.0.1") -> None:
        self.port = free_port()
        self.host = host
        self.workdir = workdir
        self.url = f"redis://{host}:{self.port}/0"
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", self.host,
                                      "--protected-mode", "no", "--save", "", "--appendonly", "no",
                                      "--dir", str(self.workdir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        r = redis.Redis(host=self.host, port=self.port, socket_timeout=2)
        assert wait_for(lambda: _pings(r), 10), f"redis-server did not start on {self.host}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _pings(r) -> bool:
    try:
        return r.ping()
    except redis.RedisError:
        return False


def start_worker(url: str, env: dict) -> subprocess.Popen:
    # its own process group: a test can freeze the worker with its pool processes
    return subprocess.Popen([sys.executable, "-m", "layerdiff.client.cli", "worker", "--broker", url,
                             "--max-cores", "1"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


@contextlib.contextmanager
def frozen(workers):
    """Workers stopped (SIGSTOP) for the block: what is sent meanwhile waits
    in the queue, so a test can change the store before any worker reads it."""
    stopped = []
    try:
        for w in workers:
            if w.poll() is None:
                os.killpg(w.pid, signal.SIGSTOP)
                stopped.append(w)
        yield
    finally:
        for w in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.pid, signal.SIGCONT)


def _workers_ready(url: str, n: int) -> bool:
    from layerdiff.analyzer.execute.celery_app import make_app

    try:
        return len(make_app(url).control.ping(timeout=1.0)) >= n
    except Exception:
        return False


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Redis, two workers, a Celery analyzer and a local-pool analyzer (same
    chunking), a collector: every one its own process, stopped by PID."""
    base = tmp_path_factory.mktemp("cluster")
    rs = RedisServer(base)
    env = dict(os.environ, LAYERDIFF_CHUNK_ELEMENTS=CHUNK, LAYERDIFF_VISIBILITY_TIMEOUT_S="5",
               LAYERDIFF_TASK_TIMEOUT_S="4", LAYERDIFF_JOB_DEADLINE_S="240")
    workers = [start_worker(rs.url, env) for _ in range(2)]
    procs = []
    try:
        assert wait_for(lambda: _workers_ready(rs.url, 2), 60), "workers did not come up"
        collector = ServiceProcess("collector", base / "collector")
        procs.append(collector)
        celery_analyzer = ServiceProcess("analyzer", base / "analyzer-celery",
                                         env=dict(env, LAYERDIFF_BROKER_URL=rs.url))
        procs.append(celery_analyzer)
        local_analyzer = ServiceProcess("analyzer", base / "analyzer-local", env=env)
        procs.append(local_analyzer)
        yield {"redis": rs, "workers": workers, "collector": collector, "celery": celery_analyzer,
               "local": local_analyzer, "env": env}
    finally:
        for p in procs:
            p.stop()
        for w in workers:
            if w.poll() is None:
                os.kill(w.pid, signal.SIGTERM)
                try:
                    w.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    w.kill()
        rs.stop()


def _reports(out):
    files = {}
    for p in sorted(out.rglob("*")):
        if p.is_file():
            files[p.relative_to(out).as_posix()] = p.read_bytes()
    summary = json.loads(files.pop("summary.json"))
    for k in ("job_id", "started_at", "elapsed_s"):
        summary.pop(k)
    # the page is the summary rendered, with the job id and a fresh script nonce
    page = files.pop("report.html").decode()
    assert summary["diagnosis"]["headline"] in page
    return files, summary


def test_celery_and_local_pool_give_identical_reports(cluster, cnn_files, tmp_path):
    model, inputs, device = cnn_files
    outs = {}
    for name in ("local", "celery"):
        outs[name] = tmp_path / name
        run(model, inputs, device_model=device, out=outs[name], analyzer=cluster[name].address,
            collector=cluster["collector"].address, diff_cnt=7, progress=False)
    local_files, local_summary = _reports(outs["local"])
    celery_files, celery_summary = _reports(outs["celery"])
    assert local_files.keys() == celery_files.keys()
    for name in local_files:
        assert local_files[name] == celery_files[name], name
    assert local_summary == celery_summary
    assert celery_summary["first_failing_node"]["node"] == "conv2"


@contextlib.contextmanager
def monitored(url: str):
    """Every command the Redis at ``url`` runs while the block runs (MONITOR), as a list filled as they come,
    complete when the block ends: MONITOR reports commands in the order they ran, so the block ends by running
    a marker and reading up to it (a huge command, echoed whole, leaves the monitor seconds behind)."""
    seen: list[str] = []
    marker = f"monitored-until-{uuid.uuid4().hex}"
    # the block starts once the monitor has reported a probe run after it
    # was asked for: a fixed wait let a loaded machine start the block (and
    # run its commands) before MONITOR was on
    probe = f"monitored-from-{uuid.uuid4().hex}"
    on = threading.Event()

    def watch():
        with redis.Redis.from_url(url).monitor() as m:
            for cmd in m.listen():
                if not on.is_set():
                    if probe in cmd["command"]:
                        on.set()
                    continue
                if marker in cmd["command"]:
                    return
                seen.append(cmd["command"])

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    with redis.Redis.from_url(url) as c:
        for _ in range(600):        # 30 s at most
            c.echo(probe)
            if on.wait(0.05):
                break
        assert on.is_set(), "the monitor did not start within 30 s"
    try:
        yield seen
    finally:
        with redis.Redis.from_url(url) as c:
            c.echo(marker)      # the last command the monitor reports
        t.join(timeout=60)
        assert not t.is_alive(), "the monitor did not catch up with Redis within 60 s"


def test_no_tensor_bytes_in_broker_messages_and_store_cleaned(cluster, cnn_files, tmp_path):
    """Every message on the broker is small (references only) and the job's
    tensors are deleted when it ends."""
    r = redis.Redis.from_url(cluster["redis"].url)
    model, inputs, device = cnn_files
    with monitored(cluster["redis"].url) as seen:
        run(model, inputs, device_model=device, out=tmp_path / "out", analyzer=cluster["celery"].address,
            collector=cluster["collector"].address, progress=False)
    pushes = [len(c) for c in seen if c.upper().startswith("LPUSH")]
    assert pushes, "no task was published"
    # the conv outputs alone are 8 KiB each, twice per node: only references travel
    assert max(pushes) < 16 * 1024
    assert not list(r.scan_iter(match="layerdiff:job:*"))


def test_a_killed_worker_does_not_lose_the_job(cluster, tmp_path):
    from layerdiff.client.demo import det_input, packaged_model

    np.savez(tmp_path / "page.npz", x=det_input(320, 320))
    local = run(packaged_model(), tmp_path / "page.npz", precision="fp16", out=tmp_path / "local",
                analyzer=cluster["local"].address, collector=cluster["collector"].address, progress=False)
    victim = cluster["workers"][0]
    killed = []

    def progress(ev):
        if not killed and ev.nodes_done >= 40:
            os.kill(victim.pid, signal.SIGKILL)
            killed.append(ev.nodes_done)

    dist = run(packaged_model(), tmp_path / "page.npz", precision="fp16", out=tmp_path / "dist",
               analyzer=cluster["celery"].address, collector=cluster["collector"].address, progress=progress)
    assert killed and victim.wait(timeout=10) == -signal.SIGKILL
    assert dist.summary["counts"] == local.summary["counts"]
    assert dist.summary["nodes"] == local.summary["nodes"]
    # the worker is replaced for the next tests
    cluster["workers"][0] = start_worker(cluster["redis"].url, cluster["env"])
    assert wait_for(lambda: _workers_ready(cluster["redis"].url, 2), 60)


def test_bad_tasks_get_clear_errors(cluster):
    from layerdiff.analyzer.execute.celery_app import make_app, send_compare
    from layerdiff.analyzer.execute.store import TensorStore, tensor_endpoint

    app = make_app(cluster["redis"].url)
    endpoint = tensor_endpoint()
    endpoint.open_job("j1", "nonce-j1")
    ticket = {"nonce": "nonce-j1", "at": endpoint.address, "ttl_s": 600}
    store = TensorStore(cluster["redis"].url)
    item = {"id": 1, "atol": 0.005, "rtol": 0.2, "diff_cnt": 4,
            "ref": {"key": "layerdiff:job:ghost:1:r", "dtype": "float32", "shape": [2], "nbytes": 8, "parts": 1},
            "dev": {"key": "layerdiff:job:ghost:1:d", "dtype": "float32", "shape": [2], "nbytes": 8, "parts": 1}}
    res = send_compare(app, "ghost", [item], **ticket).get(timeout=30)    # a job the analyzer does not run
    assert "job ghost no longer exists" in res[0]["error"] and res[0]["kind"] == "job"
    assert "not running on the analyzer" in res[0]["error"]

    store.open_job("j1")
    good_r = store.put("j1", "ok:r", np.arange(4, dtype=np.float32))
    good_d = store.put("j1", "ok:d", np.arange(4, dtype=np.float32) + 1)
    cut = store.put("j1", "cut:r", np.arange(4, dtype=np.float32))
    store.r.set(cut["key"] + ":0", b"\x00" * 6)       # truncated payload
    gone = dict(cut, key="layerdiff:job:j1:gone:r")    # missing payload
    nowhere = dict(good_r, flight=f"127.0.0.1:{free_port()}")    # an analyzer endpoint nobody listens on
    odd = dict(good_r, dtype="object")                 # a reference no worker may read
    short = store.put("j1", "short:d", np.arange(3, dtype=np.float32))
    base = {"atol": 0.005, "rtol": 0.2, "diff_cnt": 4, "force_compare": False}
    items = [dict(base, id=1, ref=good_r, dev=good_d), dict(base, id=2, ref=cut, dev=good_d),
             dict(base, id=3, ref=gone, dev=good_d), dict(base, id=4, ref=nowhere, dev=good_d),
             dict(base, id=5, ref=odd, dev=good_d), dict(base, id=6, ref=good_r, dev=short)]
    res = {r["id"]: r for r in send_compare(app, "j1", items, **ticket).get(timeout=30)}
    assert res[1]["metrics"]["errors"] == 4
    # the system's failures are errors that say which component and why, never skips
    assert "payload truncated: 6 of 16 bytes" in res[2]["error"] and "cut:r" in res[2]["error"]
    assert (res[2]["kind"], res[2]["source"]) == ("payload", "store") and "truncated" in res[2]["cause"]
    assert "payload missing" in res[3]["error"] and "gone:r" in res[3]["error"]
    assert (res[3]["kind"], res[3]["source"]) == ("payload", "store") and "missing" in res[3]["cause"]
    assert (res[4]["kind"], res[4]["source"], res[4]["at"]) == ("payload", "endpoint", nowhere["flight"])
    assert res[4]["cause"] == "connection refused"
    assert res[5]["kind"] == "task" and "'object' is not allowed" in res[5]["error"]
    assert all(res[i]["worker"] and "skip" not in res[i] for i in (2, 3, 4, 5))
    # the node's own data is a skip: 3 elements against 4
    assert "error" not in res[6] and "differs from the reference" in res[6]["skip"]
    store.drop_job("j1")
    endpoint.close_job("j1")


def _payload_keys(r, job_id: str, item_id: int, side: str = "r") -> list[bytes]:
    return sorted(r.scan_iter(match=f"layerdiff:job:{job_id}:{item_id}:{side}:*"))


def test_a_payload_unreadable_on_every_attempt_fails_the_job(cluster):
    """A node whose payload is gone from the store is sent again, then fails
    with the store named; the job's other nodes fail with it at once."""
    from layerdiff.analyzer.compare.tolerances import Tolerance
    from layerdiff.analyzer.execute.fanout import CeleryPool
    from layerdiff.common.errors import UnavailableError

    url = cluster["redis"].url
    r = redis.Redis.from_url(url)
    tol = Tolerance(0.005, 0.2)
    ref = np.linspace(-1, 1, 512, dtype=np.float32)   # 2 KiB: held in Redis
    pool = CeleryPool(url, "lostpayload", task_timeout_s=30, retry_delay_s=0.2)
    try:
        with frozen(cluster["workers"]):
            good = pool.submit(ref, ref + 1e-4, tol, 4, False)
            lost = [pool.submit(ref, ref * 1.5, tol, 4, False) for _ in range(2)]
            for item_id in (1, 2):
                keys = _payload_keys(r, "lostpayload", item_id)
                assert keys and r.delete(*keys) == len(keys)
        started = time.monotonic()
        with pytest.raises(UnavailableError) as ei:
            lost[0].result(timeout=60)
        assert time.monotonic() - started < 30
        msg = str(ei.value)
        assert "\n" not in msg
        assert f"tensor store at {url}" in msg and "payload missing" in msg and "after 3 attempts" in msg, msg
        assert "layerdiff:job:lostpayload:1:r" in msg or "layerdiff:job:lostpayload:2:r" in msg, msg
        assert lost[1].exception(timeout=0) is ei.value
        assert pool.stats["retried"] >= 2
        # what was compared stays compared; what comes after fails at once
        assert good.result(timeout=0).metrics.passed
        late = pool.submit(ref, ref, tol, 4, False)
        assert late.exception(timeout=0) is ei.value
    finally:
        pool.close()
    assert not list(r.scan_iter(match="layerdiff:job:lostpayload*"))


def test_a_payload_readable_again_is_retried_and_compared(cluster):
    """A transient failure (the payload back on a later attempt) costs an
    attempt, not the node: every node is compared, as the local pool would."""
    from layerdiff.analyzer.compare.node import compare_node
    from layerdiff.analyzer.compare.tolerances import Tolerance
    from layerdiff.analyzer.execute.fanout import CeleryPool

    url = cluster["redis"].url
    r = redis.Redis.from_url(url)
    tol = Tolerance(0.005, 0.2)
    rng = np.random.default_rng(3)
    pairs = []
    for n in (300, 700, 1500):
        ref = rng.standard_normal(n).astype(np.float32)
        pairs.append((ref, ref + rng.standard_normal(n).astype(np.float32) * np.float32(0.01)))
    pool = CeleryPool(url, "latepayload", task_timeout_s=30, retry_delay_s=1.0)
    try:
        with frozen(cluster["workers"]):
            futs = [pool.submit(a, b, tol, 5, False) for a, b in pairs]
            keys = _payload_keys(r, "latepayload", 1)
            saved = {k: (r.get(k), r.pttl(k)) for k in keys}
            assert keys and r.delete(*keys) == len(keys)
        # the first attempt fails; the payload is back before the next one
        assert wait_for(lambda: pool.stats["retried"] >= 1, 30, every=0.005)
        with frozen(cluster["workers"]):
            for k, (v, ttl) in saved.items():
                r.set(k, v, px=ttl)
        outcomes = [f.result(timeout=60) for f in futs]
    finally:
        pool.close()
    assert pool.stats["retried"] >= 1
    for (a, b), got in zip(pairs, outcomes):
        want = compare_node(a, b, tol, 5, False)
        assert got.metrics.as_dict() == want.metrics.as_dict()
        assert [list(w) for w in got.worst] == [list(w) for w in want.worst]


def test_broker_refusing_connections_fails_the_submit(cnn_files, tmp_path):
    dead = f"redis://127.0.0.1:{free_port()}/0"
    analyzer = ServiceProcess("analyzer", tmp_path / "analyzer", env=dict(os.environ, LAYERDIFF_BROKER_URL=dead))
    try:
        import grpc

        client = AnalyzerClient(analyzer.address)
        model, inputs, _ = cnn_files
        spec = pb.JobSpec(model_artifact=client.upload(model.read_bytes(), "model.onnx"),
                          inputs_artifact=client.upload(inputs.read_bytes(), "inputs.npz"), collector="127.0.0.1:1")
        with pytest.raises(grpc.RpcError) as ei:
            client.submit(spec)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        assert dead in ei.value.details() and "refuses connections" in ei.value.details()
        assert analyzer.alive()
    finally:
        analyzer.stop()


def test_redis_restart_fails_the_job_clearly(cluster, tmp_path):
    """Redis keeps nothing across a restart: the job must not wait forever."""
    from layerdiff.client.demo import det_input, packaged_model

    np.savez(tmp_path / "page.npz", x=det_input(320, 320))
    client = AnalyzerClient(cluster["celery"].address)
    spec = pb.JobSpec(model_artifact=client.upload(packaged_model().read_bytes(), "det.onnx"),
                      inputs_artifact=client.upload((tmp_path / "page.npz").read_bytes(), "page.npz"),
                      collector=cluster["collector"].address, precision="fp16")
    job = client.submit(spec)
    restarted = False
    started = time.monotonic()
    last = None
    for ev in client.watch(job, timeout=180):
        last = ev
        if not restarted and ev.nodes_done >= 20:
            cluster["redis"].stop()
            time.sleep(1.0)
            cluster["redis"].start()
            restarted = True
    assert restarted
    assert last.state in (pb.FAILED, pb.DONE)
    if last.state == pb.FAILED:   # the reason names the broker and what happened to it
        assert cluster["redis"].url in last.message
        assert any(w in last.message for w in ("restarted", "unreachable", "refuses"))
    assert time.monotonic() - started < 150
    assert wait_for(lambda: _workers_ready(cluster["redis"].url, 2), 60)
