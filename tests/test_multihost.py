"""Five hosts of their own, as a deployment has them: the collector, the
analyzer, Redis and two workers, each in its own network namespace on one
bridge with a private /tmp, mutual TLS and tokens on every endpoint, a
password on Redis and signed task messages. A user on the bridge's host runs
a real job through them; its reports are those of the embedded default."""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from netns import Network, remove_leftovers, require_netns
from test_distributed import _reports
from test_security import ADMIN, ALICE, SERVICE, _openssl

HOSTS = {"collector": "p", "analyzer": "q", "redis": "r", "worker1": "s", "worker2": "t"}
PASSWORD = "redis-password-0123456789"
TASK_SECRET = "task-secret-0123456789abcdef"


def _pki(d: Path, ips: list[str]) -> dict[str, Path]:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
             "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=layerdiff hosts CA", cwd=d)
    for name, san in (("server", ",".join(f"IP:{i}" for i in ips)), ("client", None)):
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
                 f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        (d / f"{name}.ext").write_text((f"subjectAltName={san}\n" if san else "") + "basicConstraints=CA:FALSE\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", str(d / f"{name}.ext"), cwd=d)
    (d / "tokens").write_text(f"{ALICE}\nadmin:{ADMIN}\n{SERVICE}\n")
    return {"ca": d / "ca.pem", "cert": d / "server.pem", "key": d / "server.key", "client_cert": d / "client.pem",
            "client_key": d / "client.key", "tokens": d / "tokens"}


def _env(**kw) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERDIFF_") and "proxy" not in k.lower()}
    env.update({k: str(v) for k, v in kw.items()})
    return env


class _Procs:
    """The started processes, stopped (with their process groups) at the end."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[tuple[str, subprocess.Popen, object]] = []

    def start(self, name: str, argv: list[str], env: dict, address: bool = False) -> str:
        log = open(self.logs / f"{name}.log", "w")
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE if address else log, stderr=log, text=True,
                                start_new_session=True)
        self.procs.append((name, proc, log))
        if not address:
            return ""
        line = proc.stdout.readline()
        m = re.search(r"listening on (\S+)", line)
        assert m, f"{name} did not start: {line!r} {(self.logs / f'{name}.log').read_text()[-2000:]}"
        return m.group(1)

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text()[-3000:]

    def stop(self) -> None:
        for _, proc, log in reversed(self.procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)
            log.close()


def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "layerdiff.client.cli", *map(str, args)]


def test_a_job_across_five_hosts_with_tls_tokens_and_signed_tasks(cnn_files):
    require_netns()
    remove_leftovers()
    model, inputs, device = cnn_files
    # outside /tmp: every service has a private one
    base = Path(tempfile.mkdtemp(prefix="layerdiff-hosts-", dir="/var/tmp"))
    net = Network("x", HOSTS)
    procs = _Procs(base)
    try:
        net.create()
        ip = net.ip
        (base / "pki").mkdir()
        pki = _pki(base / "pki", [ip["collector"], ip["analyzer"]])
        tls = dict(LAYERDIFF_TLS_CERT=pki["cert"], LAYERDIFF_TLS_KEY=pki["key"], LAYERDIFF_TLS_CA=pki["ca"])
        broker = f"redis://:{PASSWORD}@{ip['redis']}:6390/0"
        (base / "redis").mkdir()
        procs.start("redis", net.run("redis", "redis-server", "--port", "6390", "--bind", ip["redis"],
                                     "--requirepass", PASSWORD, "--save", "", "--appendonly", "no",
                                     "--dir", str(base / "redis")), _env())
        collector = procs.start("collector", net.run("collector", *_cli(
            "collector", "serve", "--host", ip["collector"], "--port", "0", "--workdir", base / "collector")),
            _env(**tls, LAYERDIFF_TOKEN_FILE=pki["tokens"]), address=True)
        analyzer = procs.start("analyzer", net.run("analyzer", *_cli(
            "analyzer", "serve", "--host", ip["analyzer"], "--port", "0", "--workdir", base / "analyzer")),
            _env(**tls, LAYERDIFF_TOKEN_FILE=pki["tokens"], LAYERDIFF_TOKEN=SERVICE,
                 LAYERDIFF_COLLECTOR_ALLOW=ip["collector"], LAYERDIFF_BROKER_URL=broker,
                 LAYERDIFF_TENSOR_HOST=ip["analyzer"], LAYERDIFF_TASK_SECRET=TASK_SECRET,
                 LAYERDIFF_FLIGHT_MIN_BYTES=1024), address=True)
        worker_env = _env(LAYERDIFF_TLS_CA=pki["ca"], LAYERDIFF_TLS_CERT=pki["client_cert"],
                          LAYERDIFF_TLS_KEY=pki["client_key"], LAYERDIFF_TOKEN=SERVICE,
                          LAYERDIFF_TASK_SECRET=TASK_SECRET)
        for w in ("worker1", "worker2"):
            procs.start(w, net.run(w, *_cli("worker", "--broker", broker, "--max-cores", "1")), worker_env)
        deadline = time.monotonic() + 90
        while not all("[queues]" in procs.log(w) for w in ("worker1", "worker2")):     # connected to the broker
            assert time.monotonic() < deadline, f"workers not ready: {procs.log('worker1')} {procs.log('worker2')}"
            for name, proc, _ in procs.procs:
                assert proc.poll() is None, f"{name} exited: {procs.log(name)}"
            time.sleep(0.5)
        user = _env(LAYERDIFF_TLS_CA=pki["ca"], LAYERDIFF_TLS_CERT=pki["client_cert"],
                    LAYERDIFF_TLS_KEY=pki["client_key"], LAYERDIFF_TOKEN=ALICE)
        res = subprocess.run(_cli("run", model, "--inputs", inputs, "--device-model", device, "--analyzer", analyzer,
                                  "--collector", collector, "--out", base / "out", "--no-progress", "--diff-cnt", 7),
                             env=user, capture_output=True, text=True, timeout=300)
        assert res.returncode == 1, (res.stderr, procs.log("analyzer"), procs.log("worker1"))
        embedded = subprocess.run(_cli("run", model, "--inputs", inputs, "--device-model", device, "--out",
                                       base / "embedded", "--no-progress", "--diff-cnt", 7),
                                  env=_env(), capture_output=True, text=True, timeout=300)
        assert embedded.returncode == 1, embedded.stderr
        files, summary = _reports(base / "out")
        want_files, want = _reports(base / "embedded")
        for s in (summary, want):
            for k in ("collector", "analyzer", "broker"):
                s.pop(k, None)
            s["parameters"].pop("max_cores", None)
        # the analyzer has a broker: every comparison ran on the workers
        assert files == want_files
        assert summary == want
    finally:
        procs.stop()
        problems = net.delete()
        shutil.rmtree(base, ignore_errors=True)
        assert not problems and not net.exists(), f"namespaces left behind: {problems}"
