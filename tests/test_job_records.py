"""The analyzer remembers its jobs across restarts, keeps finished jobs and
uploads within its retention limits, and fails a job (not itself) on a full
disk. Real analyzer and collector processes; the analyzer is killed with
SIGKILL and started again on the same work directory."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import ServiceProcess, small_cnn, wait_for

from layerdiff.analyzer.jobs.records import RESTARTED_MESSAGE, JobRecords, Retention
from layerdiff.client.analyzer_client import AnalyzerClient
from layerdiff.client.api import run
from layerdiff.common.artifacts import upload
from layerdiff.v1 import layerdiff_pb2 as pb

TERMINAL = (pb.DONE, pb.FAILED, pb.CANCELLED)


def _env(**settings) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERDIFF_")}   # never a broker here
    env.update({k: str(v) for k, v in settings.items()})
    return env


@pytest.fixture(scope="module")
def collector(tmp_path_factory):
    c = ServiceProcess("collector", tmp_path_factory.mktemp("records") / "collector")
    try:
        yield c
    finally:
        c.stop()


def _kill_and_restart(an: ServiceProcess, workdir: Path, env: dict) -> ServiceProcess:
    an.proc.kill()
    an.proc.wait(timeout=30)
    an.stop()
    return ServiceProcess("analyzer", workdir, env=env)


def _refused(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as ei:
        call()
    return ei.value.code(), ei.value.details()


def _spec(client: AnalyzerClient, collector: str, model: bytes, inputs: bytes, **kw) -> pb.JobSpec:
    return pb.JobSpec(model_artifact=client.upload(model, "model.onnx"),
                      inputs_artifact=client.upload(inputs, "inputs.npz"), collector=collector,
                      model_name="model.onnx", **kw)


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_a_finished_job_is_watchable_and_fetchable_after_the_analyzer_is_killed(collector, cnn_files, tmp_path):
    model, inputs, device = cnn_files
    workdir, env = tmp_path / "analyzer", _env()
    an = ServiceProcess("analyzer", workdir, env=env)
    try:
        before = run(model, inputs, device_model=device, out=tmp_path / "before", analyzer=an.address,
                     collector=collector.address, progress=False)
        assert before.outcome == "fail" and before.first_failing_node == "conv2"
        an = _kill_and_restart(an, workdir, env)
        client = AnalyzerClient(an.address)
        try:
            events = list(client.watch(before.job_id, timeout=30))
            client.fetch(before.job_id, tmp_path / "after")
        finally:
            client.close()
        assert len(events) == 1
        end = events[0]
        assert (end.state, end.outcome, end.exit_status, end.first_failing_node) == (pb.DONE, "fail", 1, "conv2")
        assert end.nodes_done == end.nodes_total > 0
        assert (tmp_path / "after" / "summary.json").read_bytes() == (tmp_path / "before" / "summary.json").read_bytes()
        assert sorted(p.name for p in (tmp_path / "after").iterdir()) == \
            sorted(p.name for p in (tmp_path / "before").iterdir())
    finally:
        an.stop()


def test_a_job_running_when_the_analyzer_is_killed_reads_failed_after_restart(collector, cnn_files, tmp_path):
    from layerdiff.client.demo import det_input, packaged_model

    model, inputs, _ = cnn_files
    workdir, env = tmp_path / "analyzer", _env()
    jobs = workdir / "state" / "jobs"
    an = ServiceProcess("analyzer", workdir, env=env)
    client = None
    try:
        earlier = run(model, inputs, out=tmp_path / "earlier", analyzer=an.address, collector=collector.address,
                      progress=False)
        det_inputs = tmp_path / "det.npz"
        np.savez(det_inputs, x=det_input(640, 640))
        client = AnalyzerClient(an.address)
        job_id = client.submit(_spec(client, collector.address, packaged_model().read_bytes(),
                                     det_inputs.read_bytes(), precision="fp16"))
        caught = None
        for ev in client.watch(job_id, timeout=120):
            assert ev.state not in TERMINAL, ev
            if ev.state == pb.COMPARING and ev.nodes_done > 0:
                caught = ev
                an.proc.kill()
                break
        client.close()
        client = None
        assert caught is not None
        an = _kill_and_restart(an, workdir, env)
        client = AnalyzerClient(an.address)
        events = list(client.watch(job_id, timeout=30))
        assert len(events) == 1
        assert events[0].state == pb.FAILED and events[0].exit_status == 3
        assert events[0].message == RESTARTED_MESSAGE
        assert not (jobs / job_id).exists() or not any((jobs / job_id).rglob("*"))   # no partial reports
        code, details = _refused(lambda: client.fetch(job_id, tmp_path / "none"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "FAILED" in details and "analyzer restarted" in details
        client.fetch(earlier.job_id, tmp_path / "again")
        assert (tmp_path / "again" / "summary.json").read_bytes() == \
            (tmp_path / "earlier" / "summary.json").read_bytes()
    finally:
        if client is not None:
            client.close()
        an.stop()


def test_retention_by_age_and_size_never_takes_a_running_jobs_upload(collector, cnn_files, tmp_path):
    model, inputs, _ = cnn_files
    workdir = tmp_path / "analyzer"
    jobs, arts = workdir / "state" / "jobs", workdir / "state" / "artifacts"
    an = ServiceProcess("analyzer", workdir, env=_env())
    client = None
    try:
        client = AnalyzerClient(an.address)
        stale_upload = client.upload(os.urandom(100_000), "stale.bin")
        client.close()
        client = None
        j1, j2, j3 = (run(model, inputs, out=tmp_path / f"out{i}", analyzer=an.address, collector=collector.address,
                          progress=False).job_id for i in range(3))
        an.stop()

        # j2 finished, and the stale upload was made, 8 days ago; the size
        # limit holds the newest job and the uploads it used, not j1 too.
        record = json.loads((jobs / f"{j2}.json").read_text())
        record["created_at"] -= 8 * 86400
        record["finished_at"] -= 8 * 86400
        (jobs / f"{j2}.json").write_text(json.dumps(record))
        old = time.time() - 8 * 86400
        os.utime(arts / stale_upload, (old, old))
        used = sum(p.stat().st_size for p in arts.iterdir() if p.name != stale_upload)
        budget = _du(jobs / j3) + 1024 + used + 8192
        assert _du(jobs / j1) > 8192
        an = ServiceProcess("analyzer", workdir, env=_env(LAYERDIFF_RETAIN_DAYS=7, LAYERDIFF_RETAIN_BYTES=budget,
                                                          LAYERDIFF_RETAIN_GRACE_S=0))
        client = AnalyzerClient(an.address)
        for job_id, why in ((j2, "older than 7 days"), (j1, "LAYERDIFF_RETAIN_BYTES")):
            code, details = _refused(lambda job_id=job_id: list(client.watch(job_id, timeout=10)))
            assert code == grpc.StatusCode.NOT_FOUND and job_id in details and why in details, details
            assert not (jobs / job_id).exists() and not (jobs / f"{job_id}.json").exists()
        assert not (arts / stale_upload).exists()
        client.fetch(j3, tmp_path / "j3")
        assert (tmp_path / "j3" / "summary.json").is_file()

        # A job that cannot reach its collector stays running for a while:
        # its model, far over the size limit, stays while later jobs end.
        big_model = small_cnn(seed=7, width=64).SerializeToString()
        assert len(big_model) > budget
        with socket.socket() as nobody:
            nobody.bind(("127.0.0.1", 0))
            spec = _spec(client, f"127.0.0.1:{nobody.getsockname()[1]}", big_model, inputs.read_bytes())
            stuck = client.submit(spec)
            j4 = run(model, inputs, out=tmp_path / "out4", analyzer=an.address, collector=collector.address,
                     progress=False).job_id
            code, details = _refused(lambda: list(client.watch(j3, timeout=10)))   # j4's end made room
            assert code == grpc.StatusCode.NOT_FOUND and "LAYERDIFF_RETAIN_BYTES" in details
            assert (arts / spec.model_artifact).is_file() and (arts / spec.inputs_artifact).is_file()
            seen = []
            with pytest.raises(grpc.RpcError):   # still running: the watch runs into its deadline
                for ev in client.watch(stuck, timeout=1.0):
                    seen.append(ev.state)
            assert seen and not set(seen) & set(TERMINAL)
        client.fetch(j4, tmp_path / "j4")
        assert (tmp_path / "j4" / "summary.json").is_file()
    finally:
        if client is not None:
            client.close()
        an.stop()


def test_a_full_disk_fails_the_job_not_the_analyzer(collector, cnn_files, tmp_path):
    model, inputs, _ = cnn_files
    workdir = tmp_path / "analyzer"
    state = workdir / "state"   # the analyzer's work dir; its log stays outside
    state.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(state)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"mounting a small tmpfs is not permitted here: {mounted.stderr.strip()}")
    an = client = None
    try:
        an = ServiceProcess("analyzer", workdir, env=_env())
        client = AnalyzerClient(an.address)
        spec = _spec(client, collector.address, model.read_bytes(), inputs.read_bytes())
        filler = state / "filler"
        st = os.statvfs(state)
        with open(filler, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize - 16384)

        code, details = _refused(lambda: upload(client.stub, os.urandom(256 * 1024), "more.bin", timeout=30))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "disk full" in details and "\n" not in details
        assert not list((state / "artifacts").glob(".upload-*"))

        events = list(client.watch(client.submit(spec), timeout=60))
        end = events[-1]
        assert end.state == pb.FAILED and end.exit_status == 3, end
        assert "disk full" in end.message and str(state) in end.message and "\n" not in end.message
        assert an.alive()

        # Not a byte left: the job's record cannot be written either, and the job still ends so.
        with open(filler, "r+b") as f:
            os.posix_fallocate(f.fileno(), 0, filler.stat().st_size + os.statvfs(state).f_bavail * st.f_frsize)
        assert os.statvfs(state).f_bavail == 0
        end = list(client.watch(client.submit(spec), timeout=60))[-1]
        assert end.state == pb.FAILED and "disk full" in end.message and end.exit_status == 3, end
        assert an.alive()

        filler.unlink()
        job_id = client.submit(spec)
        events = list(client.watch(job_id, timeout=60))
        assert events[-1].state == pb.DONE and events[-1].outcome == "pass"
        client.fetch(job_id, tmp_path / "out")
        assert json.loads((tmp_path / "out" / "summary.json").read_text())["outcome"]["status"] == "pass"
    finally:
        if client is not None:
            client.close()
        if an is not None:
            an.stop()
        if subprocess.run(["umount", str(state)]).returncode:
            subprocess.run(["umount", "-l", str(state)])


def test_job_records_alone(tmp_path):
    """Interrupted jobs are failed on load, orphans removed, and the count
    cap keeps the newest; records are plain JSON beside the reports."""
    jobs = tmp_path / "jobs"
    records = JobRecords(jobs, Retention(days=7, max_bytes=0, max_jobs=2, grace_s=0))
    now = time.time()
    for i, state in enumerate(("DONE", "DONE", "CANCELLED", "COMPARING")):
        job_id = f"{i:016x}"
        (jobs / job_id).mkdir(parents=True)
        (jobs / job_id / "summary.json").write_text("{}")
        records.save({"id": job_id, "state": state, "created_at": now - 100 + i, "finished_at": now - 50 + i,
                      "event": {"nodes_total": 9}})
    (jobs / "00000000000000ff").mkdir()   # reports without a record

    again = JobRecords(jobs, records.retention)
    loaded, interrupted = again.load(now=now)
    assert interrupted == [f"{3:016x}"] and not (jobs / f"{3:016x}").exists()
    assert not (jobs / "00000000000000ff").exists()
    failed = json.loads((jobs / f"{3:016x}.json").read_text())
    assert failed["state"] == "FAILED" and failed["event"]["exit_status"] == 3
    assert failed["event"]["message"] == RESTARTED_MESSAGE and failed["event"]["nodes_total"] == 9
    assert [r["id"] for r in loaded] == [f"{i:016x}" for i in range(4)]

    deleted = again.enforce(now=now)
    assert deleted == [f"{0:016x}", f"{1:016x}"]
    assert sorted(p.name for p in jobs.iterdir()) == sorted([f"{2:016x}", f"{2:016x}.json", f"{3:016x}.json"])
    assert "LAYERDIFF_RETAIN_JOBS" in again.why_forgotten(f"{0:016x}")


def test_an_interrupted_jobs_broker_keys_are_dropped_and_a_dead_broker_holds_nothing_up(tmp_path):
    import redis
    from test_distributed import RedisServer

    workdir = tmp_path / "analyzer"
    records = JobRecords(workdir / "state" / "jobs")
    server = RedisServer(tmp_path)
    an = None
    try:
        job_id, other = "a1" * 8, "b2" * 8
        records.save({"id": job_id, "state": "COMPARING", "created_at": time.time(), "event": {"nodes_total": 9}})
        r = redis.Redis.from_url(server.url, socket_timeout=5)
        mine = [f"layerdiff:job:{job_id}", f"layerdiff:job:{job_id}:t:0"]
        for key in mine + [f"layerdiff:job:{other}"]:
            r.set(key, b"1")
        an = ServiceProcess("analyzer", workdir, env=_env(LAYERDIFF_BROKER_URL=server.url))
        assert wait_for(lambda: not r.exists(*mine), 10)
        assert r.exists(f"layerdiff:job:{other}")
        client = AnalyzerClient(an.address)
        try:
            events = list(client.watch(job_id, timeout=10))
        finally:
            client.close()
        assert [(e.state, e.message, e.exit_status, e.nodes_total) for e in events] == \
            [(pb.FAILED, RESTARTED_MESSAGE, 3, 9)]
        an.stop()
        server.stop()

        # The broker gone: the analyzer starts at once and says, in one line, what it could not delete.
        records.save({"id": other, "state": "QUEUED", "created_at": time.time(), "event": {}})
        started = time.monotonic()
        an = ServiceProcess("analyzer", workdir, env=_env(LAYERDIFF_BROKER_URL=server.url))
        assert time.monotonic() - started < 15
        log = workdir / "service.log"
        assert wait_for(lambda: "broker keys of 1 interrupted job(s) were not deleted" in log.read_text(), 15)
        assert "Traceback" not in log.read_text()
    finally:
        if an is not None:
            an.stop()
        server.stop()


def test_retention_settings_come_from_the_environment():
    from layerdiff.common.errors import LayerdiffError

    assert Retention.from_env({}) == Retention(days=7, max_bytes=10 * 1024 ** 3, max_jobs=10000, grace_s=300)
    r = Retention.from_env({"LAYERDIFF_RETAIN_DAYS": "0.5", "LAYERDIFF_RETAIN_BYTES": "512M",
                            "LAYERDIFF_RETAIN_JOBS": "0"})
    assert (r.days, r.max_bytes, r.max_jobs) == (0.5, 512 * 1024 ** 2, 0)
    with pytest.raises(LayerdiffError, match="LAYERDIFF_RETAIN_BYTES.*'lots'"):
        Retention.from_env({"LAYERDIFF_RETAIN_BYTES": "lots"})


def test_a_file_handed_over_in_this_process_is_taken_as_it_lies(tmp_path):
    """The embedded services take the user's model file itself (a hard link)
    instead of writing a copy of a 90 MB model: the user's file keeps its
    times whatever the store does, a file changed after it was read is
    copied instead, and a file changed while a job reads it is refused."""
    import hashlib

    from layerdiff.client.api import read_upload
    from layerdiff.common.artifacts import ArtifactStore
    from layerdiff.common.errors import LayerdiffError
    from layerdiff.common.localfile import FileStamp

    user = tmp_path / "model.onnx"
    user.write_bytes(os.urandom(4096))
    os.utime(user, ns=(1_000_000_000, 1_000_000_000))
    data, name, origin = read_upload(user, "model")
    analyzer, collector = ArtifactStore(tmp_path / "a"), ArtifactStore(tmp_path / "c")
    ref = analyzer.put(data, name, origin)
    assert ref.id == hashlib.sha256(data).hexdigest() and ref.size == 4096 and ref.name == "model.onnx"
    assert analyzer.path(ref.id).stat().st_ino == user.stat().st_ino, "taken as it lies, not copied"
    collector.link_from(analyzer, ref.id)
    analyzer.hold([ref.id])
    collector.hold([ref.id])
    assert user.stat().st_mtime_ns == 1_000_000_000, "the user's file keeps its times"
    assert analyzer.read(ref.id) == data and collector.read(ref.id) == data
    analyzer.release([ref.id])
    assert [a for a, _, _ in analyzer.entries()] == [ref.id]
    assert analyzer.discard(ref.id) and user.read_bytes() == data, "the store lets go of its link only"
    # changed in place while a job holds it: refused, in one line naming the file
    with user.open("r+b") as f:
        f.write(b"\0" * 16)
    with pytest.raises(LayerdiffError, match="model.onnx.*changed on disk"):
        collector.read(ref.id)
    # changed between its read and its hand-over: copied from the bytes read
    data, name, origin = read_upload(user, "model")
    assert origin is not None
    user.write_bytes(os.urandom(4096))
    again = analyzer.put(data, name, origin)
    assert analyzer.read(again.id) == data and analyzer.path(again.id).stat().st_ino != user.stat().st_ino
    assert FileStamp.of(user) != origin.stamp


def test_files_read_ahead_are_handed_over_once_and_only_as_they_are(tmp_path):
    """The command line reads the model files beside its imports: the reader
    gets those bytes (and their sha256) once; a file changed since is read
    again, a missing one gets the usual one-line error."""
    import hashlib

    from layerdiff.client import prefetch
    from layerdiff.client.api import read_upload
    from layerdiff.common.errors import LayerdiffError
    from layerdiff.common.localfile import FileStamp

    model, other = tmp_path / "m.onnx", tmp_path / "d.onnx"
    model.write_bytes(b"a" * 1000)
    other.write_bytes(b"b" * 1000)
    prefetch.start([model, other, tmp_path, tmp_path / "missing.onnx", None])
    data, name, origin = read_upload(model, "model")
    assert data == b"a" * 1000 and name == "m.onnx" and origin is not None
    assert origin.sha256 == hashlib.sha256(data).hexdigest()
    assert prefetch.take(model) is None, "handed over once"
    assert prefetch._reads[other.resolve()].done.wait(30)     # its read ahead is over
    other.write_bytes(b"c" * 1001)          # changed after it was read ahead: read again
    data, _, origin = read_upload(other, "device_model")
    assert data == b"c" * 1001 and origin is not None and origin.sha256 == ""
    assert origin.stamp == FileStamp.of(other)
    with pytest.raises(LayerdiffError, match="missing.onnx.*cannot be read"):
        read_upload(tmp_path / "missing.onnx", "model")
