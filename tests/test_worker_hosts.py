"""Workers on another host, made real with a network namespace: a Celery
worker that reaches Redis over a bridge but not the analyzer's tensor
endpoint must fail the job with the endpoint named, not pass over the nodes
it could not read; with the endpoint on the bridge address, the same job
compares every node and counts as the local pool does.

Topology (the root namespace is the analyzer's host):

    root: redis-server on BRIDGE_IP, analyzers and collector on loopback,
          bridge ldbr<pid> with BRIDGE_IP/24
    ld-w<pid>: the worker, veth to the bridge, WORKER_IP/24, its own loopback
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest

from layerdiff.client.api import run
from layerdiff.errors import LayerdiffError
from layerdiff.v1 import layerdiff_pb2 as pb

from conftest import ServiceProcess, small_cnn, wait_for
from test_distributed import RedisServer, _workers_ready

# Large enough that every activation goes through the tensor endpoint;
# chunks small enough that the 1-2 MiB activations are cut and merged.
FLIGHT_MIN_BYTES = "4096"
CHUNK = "131072"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


def _netns_usable() -> str | None:
    """Why this test cannot build its namespaces here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    try:
        _ip("netns", "list")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        return f"`ip netns` is unavailable: {getattr(e, 'stderr', '') or e}"
    return None


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 under 10.231.0.0/16 that no address or route here uses."""
    used = []
    for link in json.loads(_ip("-j", "-4", "addr", "show").stdout or "[]"):
        for a in link.get("addr_info", []):
            used.append(ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False))
    for route in json.loads(_ip("-j", "-4", "route", "show", "table", "all").stdout or "[]"):
        if route.get("dst") not in (None, "default"):
            used.append(ipaddress.ip_network(route["dst"], strict=False))
    start = 40 + os.getpid() % 200
    for i in range(256):
        net = ipaddress.ip_network(f"10.231.{(start + i) % 256}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free /24 under 10.231.0.0/16")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _remove_leftovers() -> None:
    """Namespaces and bridges of runs that were killed before their teardown
    (each name carries its run's process id, which no longer exists)."""
    for line in _ip("netns", "list").stdout.splitlines():
        m = re.fullmatch(r"ld-w(\d+)", line.split()[0]) if line.split() else None
        if m and not _pid_alive(int(m.group(1))):
            _ip("netns", "delete", m.group(0), check=False)
    for link in json.loads(_ip("-j", "link", "show").stdout or "[]"):
        m = re.fullmatch(r"ld(?:br|v)(\d+)h?", link.get("ifname", ""))
        if m and not _pid_alive(int(m.group(1))):
            _ip("link", "delete", link["ifname"], check=False)


class Hosts:
    """A bridge in the root namespace and one namespace, the worker's host,
    joined by a veth pair. Every name carries this process's id; ``delete``
    removes whatever of it exists."""

    def __init__(self) -> None:
        tag = str(os.getpid())
        self.bridge = f"ldbr{tag}"
        self.ns = f"ld-w{tag}"
        self.veth_host, self.veth_ns = f"ldv{tag}h", f"ldv{tag}w"
        net = _free_subnet()
        self.prefix = net.prefixlen
        self.bridge_ip, self.worker_ip = str(net.network_address + 1), str(net.network_address + 2)

    def create(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.bridge_ip}/{self.prefix}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        _ip("netns", "add", self.ns)
        _ip("link", "add", self.veth_host, "type", "veth", "peer", "name", self.veth_ns)
        _ip("link", "set", self.veth_host, "master", self.bridge)
        _ip("link", "set", self.veth_host, "up")
        _ip("link", "set", self.veth_ns, "netns", self.ns)
        _ip("-n", self.ns, "addr", "add", f"{self.worker_ip}/{self.prefix}", "dev", self.veth_ns)
        _ip("-n", self.ns, "link", "set", self.veth_ns, "up")
        _ip("-n", self.ns, "link", "set", "lo", "up")   # a host of its own: 127.0.0.1 answers, and refuses
        ping = subprocess.run(["ip", "netns", "exec", self.ns, "ping", "-c", "1", "-W", "2", self.bridge_ip],
                              capture_output=True, text=True, timeout=20) if shutil.which("ping") else None
        assert ping is None or ping.returncode == 0, f"the worker's namespace cannot reach the bridge: {ping.stdout}"

    def delete(self) -> list[str]:
        """Remove the namespace (and with it the veth pair) and the bridge;
        the problems met, if any."""
        problems = []
        for args in (("netns", "delete", self.ns), ("link", "delete", self.veth_host),
                     ("link", "delete", self.bridge)):
            res = _ip(*args, check=False)
            if res.returncode != 0 and "No such file" not in res.stderr and "Cannot find device" not in res.stderr \
                    and "does not exist" not in res.stderr:
                problems.append(f"ip {' '.join(args)}: {res.stderr.strip()}")
        return problems

    def exists(self) -> bool:
        return (self.ns in _ip("netns", "list").stdout
                or _ip("link", "show", self.bridge, check=False).returncode == 0
                or _ip("link", "show", self.veth_host, check=False).returncode == 0)


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
    why = _netns_usable()
    if why is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI runs as root with iproute2, yet: {why}")
        pytest.skip(why)
    base = tmp_path_factory.mktemp("hosts")
    _remove_leftovers()
    h = Hosts()
    procs: list = []
    worker = rs = worker_log = None
    try:
        h.create()
        rs = RedisServer(base, host=h.bridge_ip)
        url = rs.url
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
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
        # the default: the endpoint listens on 127.0.0.1, which on the worker's host is the worker itself
        loopback = ServiceProcess("analyzer", base / "analyzer-loopback", env=dict(env, LAYERDIFF_BROKER_URL=url))
        procs.append(loopback)
        bridged = ServiceProcess("analyzer", base / "analyzer-bridged",
                                 env=dict(env, LAYERDIFF_BROKER_URL=url, LAYERDIFF_TENSOR_HOST=h.bridge_ip))
        procs.append(bridged)
        assert wait_for(lambda: _workers_ready(url, 1), 60), \
            f"the worker in {h.ns} did not answer over the bridge: {(base / 'worker.log').read_text()[-2000:]}"
        yield {"hosts": h, "url": url, "collector": collector, "local": local, "loopback": loopback,
               "bridged": bridged, "base": base}
    finally:
        for p in procs:
            p.stop()
        if worker is not None:
            _stop_group(worker)
        if worker_log is not None:
            worker_log.close()
        if rs is not None:
            rs.stop()
        problems = h.delete()
        assert not problems and not h.exists(), f"namespaces left behind: {problems}"


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
    assert "FAILED" in msg and "tensor endpoint at 127.0.0.1:" in msg, msg
    assert "connection refused" in msg and "LAYERDIFF_TENSOR_HOST" in msg, msg
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
