"""Workers on another host, made real with a network namespace: a Celery
worker that reaches Redis over a bridge but not the analyzer's tensor
endpoint must fail the job with the endpoint named, not pass over the nodes
it could not read; with the endpoint on the bridge address, the same job
compares every node and counts as the local pool does.

Topology (the root namespace is the analyzer's host):

    root: redis-server on BRIDGE_IP, analyzers and collector on loopback,
          bridge ldbw<pid> with BRIDGE_IP/24 (tests/netns.py)
    ld-w<pid>: the worker, veth to the bridge, WORKER_IP/24, its own loopback
"""
from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest
from conftest import ServiceProcess, small_cnn, wait_for
from netns import Hosts, remove_leftovers, require_netns
from test_distributed import RedisServer, _workers_ready

from layerdiff.client.api import run
from layerdiff.common.errors import LayerdiffError
from layerdiff.v1 import layerdiff_pb2 as pb

# Large enough that every activation goes through the tensor endpoint;
# chunks small enough that the 1-2 MiB activations are cut and merged.
FLIGHT_MIN_BYTES = "4096"
CHUNK = "131072"


def _stop_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        except ProcessLookupError:
            pass
    # pool processes that outlived their parent still sit in the namespace
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    require_netns()
    base = tmp_path_factory.mktemp("hosts")
    remove_leftovers()
    h = Hosts("w")
    procs: list = []
    worker = rs = worker_log = None
    try:
        h.create()
        rs = RedisServer(base, host=h.bridge_ip)
        url = rs.url
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        # the broker is on the bridge: the analyzers, the worker and this test's pings sign their messages
        env.update(LAYERDIFF_TASK_SECRET=SECRET, LAYERDIFF_INSECURE="1")   # a trusted test network: plain text
        os.environ["LAYERDIFF_TASK_SECRET"] = SECRET
        env.update(LAYERDIFF_CHUNK_ELEMENTS=CHUNK, LAYERDIFF_FLIGHT_MIN_BYTES=FLIGHT_MIN_BYTES,
                   LAYERDIFF_VISIBILITY_TIMEOUT_S="10", LAYERDIFF_TASK_TIMEOUT_S="10", LAYERDIFF_JOB_DEADLINE_S="120")
        worker_log = open(base / "worker.log", "w")
        worker = subprocess.Popen(["ip", "netns", "exec", h.ns, sys.executable, "-m", "layerdiff.client.cli", "worker",
                                   "--broker", url, "--max-cores", "2"],
                                  env=env, stdout=worker_log, stderr=subprocess.STDOUT, start_new_session=True)
        collector = ServiceProcess("collector", base / "collector", env=env)
        procs.append(collector)
        local = ServiceProcess("analyzer", base / "analyzer-local", env=env)
        procs.append(local)
        # an endpoint advertised at an address of the bridge where nothing listens
        nowhere = str(ipaddress.ip_address(h.bridge_ip) + 200)
        loopback = ServiceProcess("analyzer", base / "analyzer-loopback",
                                  env=dict(env, LAYERDIFF_BROKER_URL=url, LAYERDIFF_TENSOR_HOST="127.0.0.1",
                                           LAYERDIFF_ADVERTISE_HOST=nowhere))
        procs.append(loopback)
        # nothing set: the endpoint takes this host's address on the route to the broker
        derived = ServiceProcess("analyzer", base / "analyzer-derived", env=dict(env, LAYERDIFF_BROKER_URL=url))
        procs.append(derived)
        bridged = ServiceProcess("analyzer", base / "analyzer-bridged",
                                 env=dict(env, LAYERDIFF_BROKER_URL=url, LAYERDIFF_TENSOR_HOST=h.bridge_ip))
        procs.append(bridged)
        assert wait_for(lambda: _workers_ready(url, 1), 60), \
            f"the worker in {h.ns} did not answer over the bridge: {(base / 'worker.log').read_text()[-2000:]}"
        yield {"hosts": h, "url": url, "collector": collector, "local": local, "loopback": loopback,
               "bridged": bridged, "derived": derived, "base": base, "env": env, "nowhere": nowhere}
    finally:
        for p in procs:
            p.stop()
        if worker is not None:
            _stop_group(worker)
        if worker_log is not None:
            worker_log.close()
        if rs is not None:
            rs.stop()
        os.environ.pop("LAYERDIFF_TASK_SECRET", None)
        problems = h.delete()
        assert not problems and not h.exists(), f"namespaces left behind: {problems}"


SECRET = "worker-hosts-shared-task-secret"


@pytest.fixture(scope="module")
def wide_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("wide")
    # every activation up to the pool is 1 or 2 MiB: all of them go through the tensor endpoint
    for name, bug in (("model.onnx", None), ("device.onnx", "conv2")):
        onnx.save_model(small_cnn(5, bug_in=bug, in_channels=4, width=16, side=128), str(d / name))
    np.savez(d / "inputs.npz",
             input=np.random.default_rng(2).standard_normal((1, 4, 128, 128)).astype(np.float32))
    return d / "model.onnx", d / "inputs.npz", d / "device.onnx"


def test_workers_that_cannot_reach_the_tensor_endpoint_fail_the_job(hosts, wide_files, tmp_path):
    model, inputs, device = wide_files
    events = []
    started = time.monotonic()
    with pytest.raises(LayerdiffError) as ei:
        run(model, inputs, device_model=device, out=tmp_path / "out", analyzer=hosts["loopback"].address,
            collector=hosts["collector"].address, progress=events.append, timeout=90)
    elapsed = time.monotonic() - started
    msg = str(ei.value)
    assert "FAILED" in msg and f"tensor endpoint at {hosts['nowhere']}:" in msg, msg
    assert ("no route to host" in msg or "timed out" in msg) and "LAYERDIFF_TENSOR_HOST" in msg, msg
    assert elapsed < 45, f"the failure took {elapsed:.0f} s"
    assert ei.value.exit_status == 3      # no answer: a component failed, not the user's input
    last = events[-1]
    assert last.state == pb.FAILED and not last.first_failing_node and last.exit_status == 3
    # no verdict anywhere: nothing fetched, nothing written by the analyzer
    assert not (tmp_path / "out" / "summary.json").exists()
    assert not list((hosts["base"] / "analyzer-loopback").rglob("summary.json"))
    assert not list((hosts["base"] / "analyzer-loopback").rglob("compare_skip.log"))


def test_workers_on_another_host_compare_every_node_through_a_reachable_endpoint(hosts, wide_files, tmp_path):
    model, inputs, device = wide_files
    local = run(model, inputs, device_model=device, out=tmp_path / "local", analyzer=hosts["local"].address,
                collector=hosts["collector"].address, diff_cnt=7, progress=False, timeout=90)
    started = time.monotonic()
    dist = run(model, inputs, device_model=device, out=tmp_path / "dist", analyzer=hosts["bridged"].address,
               collector=hosts["collector"].address, diff_cnt=7, progress=False, timeout=90)
    assert time.monotonic() - started < 45
    assert dist.summary["counts"]["skipped"] == 0
    assert dist.summary["counts"] == local.summary["counts"]
    assert dist.summary["nodes"] == local.summary["nodes"]
    assert dist.summary["first_failing_node"]["node"] == "conv2"
    assert not (tmp_path / "dist" / "compare_skip.log").exists() or \
        not (tmp_path / "dist" / "compare_skip.log").read_text().strip()


def test_an_endpoint_the_workers_cannot_reach_is_refused_at_start(hosts, tmp_path):
    """Workers on other hosts (the broker is on the bridge) would be sent to
    the analyzer's own loopback: the analyzer does not start, and says why."""
    with pytest.raises(RuntimeError):
        ServiceProcess("analyzer", tmp_path / "analyzer", env=dict(hosts["env"], LAYERDIFF_BROKER_URL=hosts["url"],
                                                                   LAYERDIFF_TENSOR_HOST="127.0.0.1"))
    log = (tmp_path / "analyzer" / "service.log").read_text()
    assert "their own loopback" in log and "LAYERDIFF_TENSOR_HOST" in log and "Traceback" not in log, log


def test_the_endpoint_address_is_derived_from_the_route_to_the_broker(hosts, wide_files, tmp_path):
    model, inputs, device = wide_files
    local = run(model, inputs, device_model=device, out=tmp_path / "local", analyzer=hosts["local"].address,
                collector=hosts["collector"].address, diff_cnt=7, progress=False, timeout=90)
    dist = run(model, inputs, device_model=device, out=tmp_path / "dist", analyzer=hosts["derived"].address,
               collector=hosts["collector"].address, diff_cnt=7, progress=False, timeout=90)
    assert dist.summary["counts"] == local.summary["counts"] and dist.summary["counts"]["skipped"] == 0
