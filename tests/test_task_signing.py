"""Signed task messages and Redis with a password or TLS, with real parts
only: a redis-server of the test's own, real Celery worker processes started
as users start them (``layerdiff worker``), real analyzer and collector
processes for a whole job.

- A job through an analyzer whose tasks are signed is compared by a signed
  worker, and every task message on the broker carries the signed content
  type.
- A message injected straight into the broker's queue, as a party with Redis
  access would (the signature stripped, made with another secret, or the
  signed data altered), is logged by the worker as one line and never run:
  the task never asks the store for its job, no result appears, the message
  is not delivered again, and the worker goes on with signed tasks.
- A worker without a secret refuses a broker that is not on loopback, in one
  line naming LAYERDIFF_TASK_SECRET_FILE.
- Redis with --requirepass (and an ACL user): without the password a clear
  error with the password masked, with it the broker, the result backend and
  the tensor store work; the password appears in no worker log line.
- Redis over TLS (certificates made with openssl here): rediss:// works for
  the broker, the result backend and the tensor store; a plain redis://
  client against the TLS port, or a rediss:// one that does not trust the
  certificate, fails with a clear error.
"""
from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
import redis
from conftest import ServiceProcess, wait_for
from test_distributed import RedisServer, _pings, monitored

from layerdiff.analyzer.execute.celery_app import QUEUE, SIGNED_CONTENT_TYPE, TASK, make_app, send_compare, sign
from layerdiff.analyzer.execute.store import TensorStore, tensor_endpoint
from layerdiff.client.api import run
from layerdiff.common.errors import UnavailableError

SECRET = "test-secret-" + "5f0c6a1e9b7d43a8a2e1c0ffee42d00d"
OTHER = "other-secret-" + "0123456789abcdef0123456789abcdef"
REJECTED = "rejected a task message, not run"


class OwnRedis(RedisServer):
    """A redis-server of the test's own on loopback, with ``password``
    (requirepass) and/or TLS only (``tls``: the cert, key and CA files)."""

    def __init__(self, workdir, password: str | None = None, tls: dict | None = None) -> None:
        self.password = password
        self.tls = tls
        super().__init__(workdir)
        self.url = self.url_for(f":{password}@" if password else "")
        self.plain_url = self.url_for("")     # no credentials

    def url_for(self, auth: str, scheme: str | None = None) -> str:
        scheme = scheme or ("rediss" if self.tls else "redis")
        query = f"?ssl_cert_reqs=required&ssl_ca_certs={self.tls['ca']}" if self.tls and scheme == "rediss" else ""
        return f"{scheme}://{auth}{self.host}:{self.port}/0{query}"

    def start(self) -> None:
        args = ["redis-server", "--bind", self.host, "--protected-mode", "no", "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir)]
        if self.tls:
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", self.tls["cert"],
                     "--tls-key-file", self.tls["key"], "--tls-ca-cert-file", self.tls["ca"],
                     "--tls-auth-clients", "no"]
        else:
            args += ["--port", str(self.port)]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        extra = {"ssl": True, "ssl_ca_certs": self.tls["ca"]} if self.tls else {}
        r = redis.Redis(host=self.host, port=self.port, password=self.password, socket_timeout=2, **extra)
        try:
            assert wait_for(lambda: _pings(r), 10), "redis-server did not start"
        finally:
            r.close()

    def client(self) -> redis.Redis:
        extra = {"ssl": True, "ssl_ca_certs": self.tls["ca"]} if self.tls else {}
        return redis.Redis(host=self.host, port=self.port, password=self.password, socket_timeout=5, **extra)


class Worker:
    """``layerdiff worker`` in its own process group, its output in a log file."""

    def __init__(self, url: str, env: dict, log_path) -> None:
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "layerdiff.client.cli", "worker", "--broker", url,
                                      "--max-cores", "1"], env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
            except ProcessLookupError:
                pass
        try:     # pool processes that outlived their parent
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.log.close()


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERDIFF_TASK_SECRET")}
    env.update(LAYERDIFF_VISIBILITY_TIMEOUT_S="5", LAYERDIFF_TASK_TIMEOUT_S="10", LAYERDIFF_JOB_DEADLINE_S="120")
    env.update(extra)
    return env


def _secret_file(d) -> str:
    path = d / "task-secret"
    path.write_text(SECRET + "\nthe first line only counts\n")
    path.chmod(0o600)
    return str(path)


def _ready(app, n: int = 1) -> bool:
    try:
        return len(app.control.ping(timeout=1.0)) >= n
    except Exception:
        return False


def _close(app) -> None:
    try:
        app.backend.client.connection_pool.disconnect()
    except Exception:
        pass
    app.close()


def _running(job: str) -> dict:
    """``job`` registered on this process's tensor endpoint, as an analyzer
    registers its jobs: the ticket fields a task of it carries."""
    nonce = uuid.uuid4().hex
    endpoint = tensor_endpoint()
    endpoint.open_job(job, nonce)
    return {"nonce": nonce, "at": endpoint.address, "ttl_s": 600}


def _compare_once(app, store: TensorStore, job: str) -> dict:
    """A job's worth of work in one task, as the fan-out sends it: tensors in
    the store, references in the (signed) message with its ticket, the
    result back through the result backend."""
    store.open_job(job)
    a = np.arange(4, dtype=np.float32)
    item = {"id": 1, "atol": 0.005, "rtol": 0.2, "diff_cnt": 4, "force_compare": False,
            "ref": store.put(job, "1:r", a), "dev": store.put(job, "1:d", a + 1)}
    try:
        res = send_compare(app, job, [item], **_running(job)).get(timeout=30)
    finally:
        store.drop_job(job)
        tensor_endpoint().close_job(job)
    assert res[0]["id"] == 1 and "error" not in res[0], res
    return res[0]


@contextlib.contextmanager
def _worker_and_app(broker_url: str, env: dict, log, app_url: str | None = None):
    """A worker on ``broker_url`` and an app signing with SECRET (on
    ``app_url``, default the same), once the worker answers; both stopped
    at the end."""
    worker = Worker(broker_url, env, log)
    app = None
    try:
        app = make_app(app_url or broker_url, secret=SECRET)
        assert wait_for(lambda: _ready(app), 60), f"the worker did not come up: {worker.text()[-2000:]}"
        yield worker, app
    finally:
        if app is not None:
            _close(app)
        worker.stop()


@pytest.fixture(scope="module")
def signed(tmp_path_factory):
    """Redis on loopback and one worker with the secret in a file; the test
    process signs with the same secret."""
    base = tmp_path_factory.mktemp("signed")
    rs = OwnRedis(base)
    try:
        with _worker_and_app(rs.url, _env(LAYERDIFF_TASK_SECRET_FILE=_secret_file(base)), base / "worker.log") \
                as (worker, app):
            yield {"redis": rs, "worker": worker, "app": app, "base": base}
    finally:
        rs.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def scratch(tmp_path):
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_a_job_through_the_analyzer_is_signed_and_compared(signed, cnn_files, scratch):
    rs, base = signed["redis"], signed["base"]
    env = _env(LAYERDIFF_BROKER_URL=rs.url, LAYERDIFF_TASK_SECRET_FILE=_secret_file(base))
    procs = []
    with monitored(rs.url) as seen:
        try:
            collector = ServiceProcess("collector", scratch / "collector", env=env)
            procs.append(collector)
            analyzer = ServiceProcess("analyzer", scratch / "analyzer", env=env)
            procs.append(analyzer)
            model, inputs, device = cnn_files
            res = run(model, inputs, device_model=device, out=scratch / "out", analyzer=analyzer.address,
                      collector=collector.address, diff_cnt=7, progress=False, timeout=120)
        finally:
            for p in procs:
                p.stop()
    assert res.summary["first_failing_node"]["node"] == "conv2"
    pushes = [c for c in seen if c.upper().startswith("LPUSH")]
    tasks = [p for p in pushes if p.split(None, 2)[1].strip('"') == QUEUE]
    assert tasks, "no task was published"
    assert all(SIGNED_CONTENT_TYPE in p for p in tasks), tasks[0][:400]
    assert REJECTED not in signed["worker"].text()


def _captured(app, r, job: str, items: list | None = None, **ticket) -> dict:
    """A real signed message as it lies on the broker: sent to a queue no
    worker reads, taken back off it."""
    send_compare(app, job, items or [], queue="layerdiff-capture", **(ticket or _running(job)))
    raw = r.lpop("layerdiff-capture")
    assert raw is not None
    return json.loads(raw)


def _forged(msg: dict, variant: str) -> tuple[dict, str]:
    """The captured message made into an attacker's: a new task id, the
    signature stripped, made with another secret, or the signed data changed."""
    body = base64.b64decode(msg["body"]).decode()
    assert msg["content-type"] == SIGNED_CONTENT_TYPE and body.startswith('{"hmac-sha256":"')
    data = body[body.index('"data":') + len('"data":'):-1]
    task, task_id = TASK, str(uuid.uuid4())
    if variant == "unsigned":
        ctype, new = "application/json", data                     # what a plain JSON Celery client sends
    elif variant == "other secret":
        ctype, new = SIGNED_CONTENT_TYPE, sign(json.loads(data), OTHER.encode())
    elif variant == "altered":   # the signature kept, the data changed (one more item for the job)
        args, kwargs, embed = json.loads(data)
        args[1].append({"id": 99})
        ctype, new = SIGNED_CONTENT_TYPE, body.replace(data, json.dumps([args, kwargs, embed]))
    elif variant in ("raw data", "raw text"):   # kombu hands these over undecoded: Celery failed to unpack them
        ctype, new = {"raw data": "application/data", "raw text": "application/text"}[variant], body
    elif variant == "other task":   # the signed body kept, run as one of Celery's built-in tasks
        ctype, new, task = SIGNED_CONTENT_TYPE, body, "celery.accumulate"
    elif variant == "malformed":    # signed with the right secret, but not [args, kwargs, embed]
        ctype, new = SIGNED_CONTENT_TYPE, sign({"args": "not celery's"}, SECRET.encode())
    elif variant == "huge":   # a body past what a task holds
        ctype, new = SIGNED_CONTENT_TYPE, sign([["x" * (2 << 20), []], {}, {}], SECRET.encode())
    elif variant in ("expired", "dated ahead"):   # signed right, but out of its time
        args, kwargs, embed = json.loads(data)
        kwargs["ticket"]["expires"] = time.time() + (-60 if variant == "expired" else 30 * 24 * 3600)
        kwargs["ticket"]["id"] = task_id
        ctype, new = SIGNED_CONTENT_TYPE, sign([args, kwargs, embed], SECRET.encode())
    else:   # "id swap": the signed body kept, sent under a new task id
        ctype, new = SIGNED_CONTENT_TYPE, body
    forged = dict(msg, body=base64.b64encode(new.encode()).decode())
    forged["content-type"] = ctype
    forged["headers"] = dict(msg["headers"], id=task_id, root_id=task_id, task=task)
    forged["properties"] = dict(msg["properties"], correlation_id=task_id, delivery_tag=str(uuid.uuid4()),
                                delivery_info={"exchange": "", "routing_key": QUEUE})
    return forged, task_id


@pytest.mark.parametrize("variant", ["unsigned", "other secret", "altered", "raw data", "raw text", "other task",
                                     "malformed", "huge", "expired", "dated ahead", "id swap"])
def test_an_injected_message_is_rejected_and_the_worker_goes_on(signed, variant):
    app, worker = signed["app"], signed["worker"]
    r = signed["redis"].client()
    job = f"attack-{uuid.uuid4().hex[:8]}"
    store = TensorStore(signed["redis"].url)
    try:
        with monitored(signed["redis"].url) as seen:
            store.open_job(job)      # a live job: a task that ran would compare and answer
            forged, task_id = _forged(_captured(app, r, job), variant)
            before = worker.text().count(REJECTED)
            r.lpush(QUEUE, json.dumps(forged))
            assert wait_for(lambda: worker.text().count(REJECTED) > before, 30), worker.text()[-2000:]
            # the worker goes on: a signed task after the forged one is run
            assert _compare_once(app, store, f"after-{job}")["metrics"]["errors"] == 4
            assert wait_for(lambda: r.hlen("unacked") == 0 and r.llen(QUEUE) == 0, 15), "the message is still held"
    finally:
        store.drop_job(job)
        store.close()
        r.close()
        tensor_endpoint().close_job(job)
    # never run: no tensor of the job was read, and no result written
    assert [c for c in seen if f"layerdiff:job:after-{job}" in c and "GET" in c.upper()]   # the run one did
    assert not [c for c in seen if f"layerdiff:job:{job}:" in c and "GET" in c.upper()]
    with signed["redis"].client() as c:
        assert c.get(f"celery-task-meta-{task_id}") is None
    lines = [ln for ln in worker.text().splitlines() if task_id in ln]
    assert len(lines) == 1 and REJECTED in lines[0], lines
    want = {"unsigned": "content type 'application/json' not accepted", "other secret": "bad signature",
            "altered": "bad signature", "raw data": "content type 'application/data' not accepted",
            "raw text": "content type 'application/text' not accepted",
            "other task": "not a layerdiff task ('celery.accumulate')", "malformed": "malformed body",
            "huge": "over the 1048576 a task holds", "expired": "expired", "dated ahead": "dated ahead",
            "id swap": "its ticket is another task's"}[variant]
    assert want in lines[0]
    assert "Traceback" not in worker.text() and worker.proc.poll() is None


def test_a_task_taken_again_or_of_a_job_no_longer_running_is_not_run(signed):
    """A captured signed task, replayed: once it ran, this worker refuses it
    (its id was taken); its job ended on the analyzer, a fresh copy on
    another worker answers that the job is not running there, whatever
    anyone wrote into Redis."""
    app, worker = signed["app"], signed["worker"]
    r = signed["redis"].client()
    job = f"replay-{uuid.uuid4().hex[:8]}"
    store = TensorStore(signed["redis"].url)
    try:
        store.open_job(job)
        ticket = _running(job)
        msg = _captured(app, r, job, **ticket)
        task_id = msg["headers"]["id"]
        r.lpush(QUEUE, json.dumps(msg))
        assert wait_for(lambda: r.get(f"celery-task-meta-{task_id}") is not None, 30)   # it ran: a result
        before = worker.text().count(REJECTED)
        r.delete(f"celery-task-meta-{task_id}")
        r.lpush(QUEUE, json.dumps(msg))                                                  # the replay
        assert wait_for(lambda: worker.text().count(REJECTED) > before, 30), worker.text()[-2000:]
        line = [ln for ln in worker.text().splitlines() if task_id in ln and REJECTED in ln]
        assert len(line) == 1 and "a replay" in line[0]
        assert r.get(f"celery-task-meta-{task_id}") is None
        # the job ends on the analyzer; its key in Redis is made again by whoever can write there
        tensor_endpoint().close_job(job)
        store.open_job(job)
        item = {"id": 7, "atol": 0.005, "rtol": 0.2, "diff_cnt": 4, "force_compare": False,
                "ref": {"key": f"layerdiff:job:{job}:7:r", "dtype": "float32", "shape": [1], "nbytes": 4, "parts": 1},
                "dev": {"key": f"layerdiff:job:{job}:7:d", "dtype": "float32", "shape": [1], "nbytes": 4, "parts": 1}}
        fresh = _captured(app, r, job, [item], **ticket)   # the same job and nonce, a new id: an attacker's copy
        res = app.AsyncResult(fresh["headers"]["id"])
        r.lpush(QUEUE, json.dumps(fresh))
        got = res.get(timeout=30)
        assert len(got) == 1 and got[0]["kind"] == "job", got
        assert f"job {job} is not running on the analyzer at {ticket['at']}" in got[0]["error"]
    finally:
        store.drop_job(job)
        store.close()
        r.close()
        tensor_endpoint().close_job(job)
    assert "Traceback" not in worker.text() and worker.proc.poll() is None


def test_an_unsigned_worker_refuses_a_broker_off_loopback(scratch):
    password = "pw-" + uuid.uuid4().hex
    out = subprocess.run([sys.executable, "-m", "layerdiff.client.cli", "worker", "--broker",
                          f"redis://:{password}@192.0.2.10:6379/0", "--max-cores", "1"],
                         env=_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("layerdiff: error:"), out.stderr
    assert "LAYERDIFF_TASK_SECRET_FILE" in lines[0] and "redis://:***@192.0.2.10:6379/0" in lines[0]
    assert password not in out.stderr + out.stdout
    # a secret file that cannot be read is named, in one line too
    out = subprocess.run([sys.executable, "-m", "layerdiff.client.cli", "worker", "--broker",
                          "redis://192.0.2.10:6379/0"], env=_env(LAYERDIFF_TASK_SECRET_FILE=str(scratch / "none")),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and str(scratch / "none") in out.stderr and len(out.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("url,loopback", [
    ("redis://192.0.2.1:6379/0#@127.0.0.1", False),     # the clients ignore the fragment: 192.0.2.1
    ("redis://user@192.0.2.1#x@localhost", False),
    ("redis://u:p@h@127.0.0.1/0", True),                # userinfo up to the last @ (a password holding one)
    ("redis://:pw@localhost:6379/0", True),
    ("rediss://[::1]:6380/0", True),
    ("redis://[::ffff:192.0.2.1]:6379", False),
    ("redis://nowhere.localhost:6379", False),          # a name is resolved: *.localhost is not taken on trust
    ("redis://localhost.example.invalid:6379", False),
    ("unix:///tmp/redis.sock", True),
    ("redis://", False),
])
def test_the_loopback_check_reads_the_url_as_the_clients_do(url, loopback):
    from kombu.utils.url import parse_url as kombu_url
    from redis.connection import parse_url as redis_url

    from layerdiff.analyzer.execute.celery_app import is_loopback

    assert is_loopback(url) is loopback
    if url.startswith("redis://192.0.2.1"):   # where the clients would connect, whatever the text after '#'
        assert kombu_url(url)["hostname"] == redis_url(url)["host"] == "192.0.2.1"


def test_an_unsigned_worker_refuses_a_broker_hidden_behind_a_fragment(scratch):
    out = subprocess.run([sys.executable, "-m", "layerdiff.client.cli", "worker", "--broker",
                          "redis://192.0.2.10:6379/0#@127.0.0.1", "--max-cores", "1"],
                         env=_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "without a task secret" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_redis_with_a_password_and_an_acl_user(scratch):
    password, user_pw = "pw-" + uuid.uuid4().hex, "upw-" + uuid.uuid4().hex
    rs = OwnRedis(scratch, password=password)
    try:
        admin = rs.client()
        admin.execute_command("ACL", "SETUSER", "ldjobs", "on", f">{user_pw}", "~*", "&*", "+@all")
        admin.close()
        # without the password, or with a wrong one: a clear error, no password in it
        for url in (rs.plain_url, rs.url_for(":wrong-" + password + "@"), rs.url_for(f"ldjobs:{password}@")):
            with TensorStore(url) as store, pytest.raises(UnavailableError) as ei:
                store.ping()
            msg = str(ei.value)
            assert "refuses connections" in msg and "credentials in the URL are missing or wrong" in msg, msg
            assert password not in msg and "\n" not in msg
            assert ("***@" in msg) == (url != rs.plain_url), msg
        # with it: broker, result backend and tensor store, for the worker (password) and the analyzer (ACL user)
        user_url = rs.url_for(f"ldjobs:{user_pw}@")
        with _worker_and_app(rs.url, _env(LAYERDIFF_TASK_SECRET=SECRET), scratch / "worker.log", user_url) \
                as (worker, app):
            with TensorStore(user_url) as store:
                store.ping()
                assert _compare_once(app, store, "withpassword")["metrics"]["errors"] == 4
                assert user_pw not in store.url and "ldjobs:***@" in store.url
            log = worker.text()
        assert password not in log and user_pw not in log and "Traceback" not in log
    finally:
        rs.stop()


def _certificates(d) -> dict:
    """A CA and a server certificate for 127.0.0.1 signed by it, and a second
    CA that signed nothing here."""
    def ssl_cmd(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    ssl_cmd("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
            "-subj", "/CN=layerdiff test CA")
    ssl_cmd("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "other.key", "-out", "other.crt", "-days",
            "2", "-subj", "/CN=another CA")
    ssl_cmd("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj",
            "/CN=localhost")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n"
                               "extendedKeyUsage=serverAuth\n")
    ssl_cmd("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out",
            "server.crt", "-days", "2", "-extfile", "ext.cnf")
    return {"cert": str(d / "server.crt"), "key": str(d / "server.key"), "ca": str(d / "ca.crt"),
            "other_ca": str(d / "other.crt")}


def test_redis_over_tls(scratch):
    certs = scratch / "certs"
    certs.mkdir()
    tls = _certificates(certs)
    rs = OwnRedis(scratch, tls=tls)
    try:
        # a plain client on the TLS port, or one that does not trust the certificate: clear errors
        with TensorStore(rs.url_for("", scheme="redis")) as store, pytest.raises(UnavailableError) as ei:
            store.ping()
        assert "if that port speaks TLS, use a rediss:// URL" in str(ei.value), str(ei.value)
        untrusting = f"rediss://127.0.0.1:{rs.port}/0?ssl_ca_certs={tls['other_ca']}"
        with TensorStore(untrusting) as store, pytest.raises(UnavailableError) as ei:
            store.ping()
        assert "CERTIFICATE_VERIFY_FAILED" in str(ei.value) and "ssl_ca_certs" in str(ei.value), str(ei.value)
        # rediss://: broker and result backend (the worker, the app), tensor store (both sides)
        with _worker_and_app(rs.url, _env(LAYERDIFF_TASK_SECRET=SECRET), scratch / "worker.log") as (worker, app):
            with TensorStore(rs.url) as store:
                store.ping()
                assert _compare_once(app, store, "overtls")["metrics"]["errors"] == 4
            assert "Traceback" not in worker.text()
    finally:
        rs.stop()


def test_the_ids_a_worker_took_are_kept_until_they_expire_and_bounded():
    from layerdiff.analyzer.execute.celery_app import SeenTasks

    seen = SeenTasks(most=8)
    assert seen.add("a", expires=100.0, now=0.0) and not seen.add("a", expires=100.0, now=50.0)   # a replay
    assert seen.add("a", expires=300.0, now=150.0)        # its ticket expired: the id may come again (a new ticket)
    for i in range(50):
        assert seen.add(f"t{i}", expires=1000.0 + i, now=200.0)
    assert len(seen._until) <= 8 and not seen.add("t49", expires=2000.0, now=300.0)   # the latest kept
