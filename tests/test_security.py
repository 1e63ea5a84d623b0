"""A deployment an operator can defend, over real servers: mutual TLS and
bearer tokens on the analyzer and the collector, each job readable only by
the token that submitted it, dump paths confined to the collector's roots,
collectors confined to the analyzer's allow-list, inputs that inflate past
the limit refused before decompression, quotas, the standard health service
and `layerdiff health`."""
from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from conftest import INTERRUPTIBLE, ServiceProcess, small_cnn

ALICE, BOB, ADMIN, SERVICE = ("alice-token-0123456789", "bob-token-0123456789abc", "admin-token-0123456789",
                              "service-token-0123456789")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _cert(d: Path, name: str, cn: str, san: str | None) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
             f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}", cwd=d)
    ext = d / f"{name}.ext"
    ext.write_text((f"subjectAltName={san}\n" if san else "") + "basicConstraints=CA:FALSE\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "2", "-extfile", str(ext), cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 (also used by the analyzer
    as its client certificate towards collectors) and a user's client
    certificate; a second CA that signed nothing here."""
    d = tmp_path_factory.mktemp("pki")
    for ca in ("ca", "other-ca"):
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                 "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "2", "-subj", f"/CN=layerdiff {ca}", cwd=d)
    _cert(d, "server", "127.0.0.1", "IP:127.0.0.1,DNS:localhost")
    _cert(d, "user", "a user", None)
    tokens = d / "tokens"
    tokens.write_text(f"# accepted tokens\n{ALICE}\n{BOB}\nadmin:{ADMIN}\n{SERVICE}\n")
    return {"dir": d, "ca": d / "ca.pem", "other_ca": d / "other-ca.pem", "cert": d / "server.pem",
            "key": d / "server.key", "user_cert": d / "user.pem", "user_key": d / "user.key", "tokens": tokens}


def _env(**kw) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERDIFF_")}
    env.update({k: str(v) for k, v in kw.items()})
    return env


@pytest.fixture(scope="module")
def secured(tmp_path_factory, pki):
    """A collector and an analyzer over mutual TLS with tokens; the collector
    reads dumps only below one root; inputs may inflate to 1 MB."""
    base = tmp_path_factory.mktemp("secured")
    root = base / "dumps"
    root.mkdir()
    server = dict(LAYERDIFF_TLS_CERT=pki["cert"], LAYERDIFF_TLS_KEY=pki["key"], LAYERDIFF_TLS_CA=pki["ca"],
                  LAYERDIFF_TOKEN_FILE=pki["tokens"])
    collector = ServiceProcess("collector", base / "collector", env=_env(**server, LAYERDIFF_DUMP_ROOTS=root))
    analyzer = ServiceProcess("analyzer", base / "analyzer",
                              env=_env(**server, LAYERDIFF_TOKEN=SERVICE, LAYERDIFF_MAX_INPUTS_BYTES=1_000_000,
                                       LAYERDIFF_MAX_JOBS_PER_CLIENT=8))
    try:
        yield {"collector": collector, "analyzer": analyzer, "root": root, "base": base}
    finally:
        analyzer.stop()
        collector.stop()


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    import onnx

    d = tmp_path_factory.mktemp("model")
    onnx.save_model(small_cnn(), str(d / "model.onnx"))
    np.savez(d / "inputs.npz", input=np.random.default_rng(1).standard_normal((1, 3, 16, 16)).astype(np.float32))
    return d / "model.onnx", d / "inputs.npz"


def cli(*args, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "layerdiff.client.cli", *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=timeout)


def user(pki, token: str | None = ALICE, **kw) -> dict:
    """A user's environment: the CA, their client certificate, their token."""
    env = dict(LAYERDIFF_TLS_CA=pki["ca"], LAYERDIFF_TLS_CERT=pki["user_cert"], LAYERDIFF_TLS_KEY=pki["user_key"],
               LAYERDIFF_CONNECT_TIMEOUT_S=3)
    if token:
        env["LAYERDIFF_TOKEN"] = token
    env.update(kw)
    return _env(**env)


def _run(secured, model_files, env, out, *extra):
    model, inputs = model_files
    return cli("run", model, "--inputs", inputs, "--analyzer", secured["analyzer"].address, "--collector",
               secured["collector"].address, "--out", out, "--no-progress", *extra, env=env)


def _job_id(stderr: str) -> str:
    line = next(x for x in stderr.splitlines() if x.startswith("layerdiff: job "))
    return line.split()[2]


def test_a_job_over_mutual_tls_with_a_token(secured, model_files, pki, tmp_path):
    res = _run(secured, model_files, user(pki), tmp_path / "out")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "out" / "summary.json").is_file()


def test_missing_and_wrong_tokens_are_refused_before_any_work(secured, model_files, pki, tmp_path):
    for token in (None, "not-a-token-0123456789"):
        res = _run(secured, model_files, user(pki, token), tmp_path / f"out-{token}")
        assert res.returncode == 2, res.stderr
        assert "token" in res.stderr and res.stderr.count("\n") == 1, res.stderr
        assert not (tmp_path / f"out-{token}").exists()


def test_a_job_is_readable_only_with_the_token_that_submitted_it(secured, model_files, pki, tmp_path):
    res = _run(secured, model_files, user(pki, ALICE), tmp_path / "alice")
    assert res.returncode == 0, res.stderr
    job = _job_id(res.stderr)
    analyzer = secured["analyzer"].address
    bob = cli("fetch", job, "--analyzer", analyzer, "--out", tmp_path / "bob", env=user(pki, BOB))
    assert bob.returncode == 2 and "submitted with another token" in bob.stderr, bob.stderr
    assert not (tmp_path / "bob" / "summary.json").exists()
    watch = cli("watch", job, "--analyzer", analyzer, "--no-progress", "--out", tmp_path / "bob2",
                env=user(pki, BOB))
    assert watch.returncode == 2 and "another token" in watch.stderr, watch.stderr
    admin = cli("fetch", job, "--analyzer", analyzer, "--out", tmp_path / "admin", env=user(pki, ADMIN))
    assert admin.returncode == 0, admin.stderr
    assert (tmp_path / "admin" / "summary.json").read_bytes() == (tmp_path / "alice" / "summary.json").read_bytes()


def test_clients_that_cannot_speak_tls_or_show_no_certificate_are_refused(secured, model_files, pki, tmp_path):
    plain = _env(LAYERDIFF_TOKEN=ALICE, LAYERDIFF_CONNECT_TIMEOUT_S=2)
    res = _run(secured, model_files, plain, tmp_path / "plain")
    assert res.returncode == 3 and "LAYERDIFF_TLS_CA" in res.stderr, res.stderr
    no_cert = _env(LAYERDIFF_TOKEN=ALICE, LAYERDIFF_TLS_CA=pki["ca"], LAYERDIFF_CONNECT_TIMEOUT_S=2)
    res = _run(secured, model_files, no_cert, tmp_path / "no-cert")
    assert res.returncode == 3, res.stderr
    wrong_ca = user(pki, ALICE, LAYERDIFF_TLS_CA=pki["other_ca"])     # cannot verify the server
    res = _run(secured, model_files, wrong_ca, tmp_path / "wrong-ca")
    assert res.returncode == 3, res.stderr
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr


def test_dump_paths_outside_the_roots_are_refused(secured, model_files, pki, tmp_path):
    from layerdiff.collector.dumps.directory import write_dump
    from layerdiff.collector.live.onnxrt import LiveRunner

    model, inputs = model_files
    records = list(LiveRunner(model.read_bytes(), {"input": np.load(inputs)["input"]}).records())
    inside = write_dump(secured["root"] / "run1", records)
    outside = write_dump(tmp_path / "elsewhere", records)
    link = secured["root"] / "link"
    link.symlink_to(outside, target_is_directory=True)
    analyzer, collector = secured["analyzer"].address, secured["collector"].address
    env = user(pki)

    def job(dump, out):
        return cli("run", model, "--inputs", inputs, "--dump", dump, "--analyzer", analyzer, "--collector",
                   collector, "--out", out, "--no-progress", env=env)

    ok = job(inside, tmp_path / "ok")
    assert ok.returncode == 0, ok.stderr
    for dump, why in ((outside, "outside the collector's dump roots"), (link, "leads to"),
                      (f"{secured['root']}/run1/../../elsewhere", "'..'")):
        res = job(dump, tmp_path / "refused")
        assert res.returncode == 2 and why in res.stderr, (dump, res.stderr)
        assert res.stderr.count("\n") <= 2 and "Traceback" not in res.stderr


@contextlib.contextmanager
def plain_services(tmp_path, **analyzer_env):
    """A plain collector and an analyzer on loopback, the analyzer with
    ``analyzer_env``; stopped at the end."""
    collector = ServiceProcess("collector", tmp_path / "collector", env=_env())
    try:
        analyzer = ServiceProcess("analyzer", tmp_path / "analyzer", env=_env(**analyzer_env))
        try:
            yield analyzer, collector
        finally:
            analyzer.stop()
    finally:
        collector.stop()


def _plain_run(model_files, analyzer, collector, out, env=None, *extra):
    model, inputs = model_files
    return cli("run", model, "--inputs", inputs, "--analyzer", analyzer.address, "--collector", collector.address,
               "--out", out, "--no-progress", *extra, env=env or _env())


def test_a_collector_off_the_allow_list_is_refused(model_files, tmp_path):
    with plain_services(tmp_path, LAYERDIFF_COLLECTOR_ALLOW="10.9.8.7") as (analyzer, collector):
        res = _plain_run(model_files, analyzer, collector, tmp_path / "out")
    assert res.returncode == 2 and "not on the analyzer's allow-list" in res.stderr, res.stderr


def test_an_inputs_file_that_inflates_past_the_limit_is_refused_unopened(secured, model_files, pki, tmp_path):
    bomb = io.BytesIO()
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as z:
        header = b"\x93NUMPY\x01\x00v\x00{'descr': '<f4', 'fortran_order': False, 'shape': (1, 3, 16, 16), }"
        z.writestr("input.npy", header.ljust(127, b" ") + b"\n" + bytes(8_000_000))
    (tmp_path / "bomb.npz").write_bytes(bomb.getvalue())
    assert (tmp_path / "bomb.npz").stat().st_size < 20_000
    model, _ = model_files
    res = cli("run", model, "--inputs", tmp_path / "bomb.npz", "--analyzer", secured["analyzer"].address,
              "--collector", secured["collector"].address, "--out", tmp_path / "out", "--no-progress",
              env=user(pki))
    assert res.returncode == 2 and "LAYERDIFF_MAX_INPUTS_BYTES" in res.stderr and "1000000" in res.stderr, res.stderr


def test_an_upload_past_the_quota_is_refused_by_the_analyzer(model_files, tmp_path):
    with plain_services(tmp_path, LAYERDIFF_ARTIFACT_QUOTA_BYTES="2K") as (analyzer, collector):
        res = _plain_run(model_files, analyzer, collector, tmp_path / "out")
    assert res.returncode == 2 and "LAYERDIFF_ARTIFACT_QUOTA_BYTES" in res.stderr, res.stderr
    assert res.stderr.count("\n") == 1, res.stderr


def test_reports_past_the_per_job_quota_fail_the_job_and_are_deleted(model_files, tmp_path):
    with plain_services(tmp_path, LAYERDIFF_REPORT_QUOTA_BYTES="4K") as (analyzer, collector):
        res = _plain_run(model_files, analyzer, collector, tmp_path / "out")
    assert res.returncode == 2 and "LAYERDIFF_REPORT_QUOTA_BYTES" in res.stderr, res.stderr
    assert not list((tmp_path / "analyzer").rglob("summary.json"))


def _started(args, out, token):
    """A `layerdiff run` in the background, once it has printed its job id."""
    proc = subprocess.Popen([sys.executable, "-m", "layerdiff.client.cli", *map(str, args), "--out", out],
                            env=_env(LAYERDIFF_TOKEN=token), stderr=subprocess.PIPE, text=True, **INTERRUPTIBLE)
    return proc, proc.stderr.readline().startswith("layerdiff: job ")


def _interrupted(proc) -> None:
    proc.send_signal(signal.SIGINT)      # cancels its job
    proc.wait(timeout=30)


def test_one_client_cannot_run_more_jobs_at_once_than_the_bound(pki, model_files, tmp_path):
    """A watched dump keeps its job running; the same token's next job is
    refused while it runs, another token's is not."""
    (tmp_path / "dump").mkdir()
    model, inputs = model_files
    with plain_services(tmp_path, LAYERDIFF_TOKEN_FILE=pki["tokens"], LAYERDIFF_MAX_JOBS_PER_CLIENT=1) \
            as (analyzer, collector):
        args = ["run", model, "--inputs", inputs, "--analyzer", analyzer.address, "--collector", collector.address,
                "--dump", tmp_path / "dump", "--watch", "--no-progress"]
        first, started = _started(args, tmp_path / "1", ALICE)
        try:
            assert started, "the first job did not start"
            second = cli(*args, "--out", tmp_path / "2", env=_env(LAYERDIFF_TOKEN=ALICE))
            assert second.returncode == 2 and "LAYERDIFF_MAX_JOBS_PER_CLIENT=1" in second.stderr, second.stderr
            other, started = _started(args, tmp_path / "3", BOB)
            _interrupted(other)
            assert started, "another token's job was refused"
        finally:
            _interrupted(first)
        # a job cancelled with Ctrl-C no longer counts: the same token runs again at once
        again, started = _started(args, tmp_path / "4", ALICE)
        _interrupted(again)
        assert started, "a cancelled job still counted against its token's bound"


def test_the_artifact_quota_of_a_store(pki, model_files, tmp_path):
    from layerdiff.common.artifacts import ArtifactStore
    from layerdiff.common.errors import LimitError
    from layerdiff.v1 import layerdiff_pb2 as pb

    os.environ["LAYERDIFF_ARTIFACT_QUOTA_BYTES"] = "1000"
    try:
        store = ArtifactStore(tmp_path / "store")
    finally:
        del os.environ["LAYERDIFF_ARTIFACT_QUOTA_BYTES"]
    store.receive(iter([pb.ArtifactChunk(name="a", total_size=600, data=bytes(600))]))
    with pytest.raises(LimitError, match="LAYERDIFF_ARTIFACT_QUOTA_BYTES"):
        store.receive(iter([pb.ArtifactChunk(name="b", total_size=600, data=bytes(600))]))
    assert not [p for p in (tmp_path / "store").iterdir() if p.name.startswith(".upload-")]


def test_health_over_the_standard_service_and_the_probe_command(secured, pki, tmp_path):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    pk = {k: pki[k].read_bytes() for k in ("ca", "user_cert", "user_key")}
    creds = grpc.ssl_channel_credentials(pk["ca"], pk["user_key"], pk["user_cert"])
    with grpc.secure_channel(secured["analyzer"].address, creds) as ch:     # no token: probes carry none
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    for service in ("analyzer", "collector"):
        res = cli("health", secured[service].address, env=user(pki))
        assert res.returncode == 0 and "SERVING" in res.stdout, (service, res.stdout, res.stderr)
    from ports import free_port

    nobody = cli("health", f"127.0.0.1:{free_port()}", "--timeout", "2", env=_env())
    assert nobody.returncode == 3 and nobody.stdout.count("\n") == 1, nobody.stdout
    # a Flight endpoint cannot carry grpc.health.v1: the collector serves it on its health port
    port = free_port()
    collector = ServiceProcess("collector", tmp_path / "collector", env=_env(LAYERDIFF_HEALTH_PORT=port))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        res = cli("health", f"127.0.0.1:{port}", env=_env())
        assert res.returncode == 0 and "SERVING" in res.stdout, res.stdout
    finally:
        collector.stop()


def test_serving_the_network_without_tls_or_tokens_is_refused(tmp_path, pki):
    res = cli("analyzer", "serve", "--host", "0.0.0.0", "--port", "0", "--workdir", tmp_path / "a", env=_env(),
              timeout=60)
    assert res.returncode == 2 and "LAYERDIFF_INSECURE" in res.stderr and "TLS" in res.stderr, res.stderr
    res = cli("collector", "serve", "--host", "0.0.0.0", "--port", "0", "--workdir", tmp_path / "c",
              env=_env(LAYERDIFF_TLS_CERT=pki["cert"], LAYERDIFF_TLS_KEY=pki["key"]), timeout=60)
    assert res.returncode == 2 and "tokens" in res.stderr, res.stderr


def test_tokens_are_compared_by_digest():
    from layerdiff.common.errors import Unauthenticated
    from layerdiff.common.security import Tokens

    tokens = Tokens.parse(f"{ALICE}\nadmin:{ADMIN}\n", "test")
    assert tokens.identify(ALICE).admin is False and tokens.identify(ADMIN).admin is True
    assert ALICE not in repr(tokens)
    for bad in ("", None, ALICE[:-1], ALICE + "x"):
        with pytest.raises(Unauthenticated):
            tokens.identify(bad)
    with pytest.raises(Exception, match="at least 16"):
        Tokens.parse("short\n", "test")


def test_the_tensor_endpoint_serves_workers_with_the_token_only(pki, monkeypatch):
    """A worker reads large tensors from the analyzer's endpoint over TLS
    with its token; without it, the read fails naming the token."""
    from layerdiff.analyzer.execute import store
    from layerdiff.common.security import ClientSecurity, ServerSecurity

    server = ServerSecurity.from_env(token=SERVICE, cert=str(pki["cert"]), key=str(pki["key"]))
    endpoint = store.TensorEndpoint("127.0.0.1", "127.0.0.1", 0, server)
    try:
        ref = endpoint.put("layerdiff:job:x:t", np.arange(1000, dtype=np.float32))
        for security, ok in ((ClientSecurity(token=SERVICE, ca=pki["ca"].read_bytes()), True),
                             (ClientSecurity(token=None, ca=pki["ca"].read_bytes()), False)):
            monkeypatch.setattr(store, "_security", security)
            store._clients.clear()
            if ok:
                got = store.fetch_flight(ref, ref["nbytes"]).view(np.float32)
                assert np.array_equal(got, np.arange(1000, dtype=np.float32))
            else:
                with pytest.raises(store.PayloadError) as e:
                    store.fetch_flight(ref, ref["nbytes"])
                assert "token" in e.value.cause, e.value.cause
    finally:
        store._clients.clear()
        endpoint.shutdown()
