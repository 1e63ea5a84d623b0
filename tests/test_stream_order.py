"""The device stream may arrive in any order: a dump's manifest in another
order, a dump without a manifest (file-name order), a watched directory
filled in any order. For every order, executor (local pool, Celery) and
core count the reports are the same, byte for byte: a self-dump of a real
model passes everywhere, a planted bug gives one report."""
from __future__ import annotations

import html
import json
import os
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import ServiceProcess, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import numpy_helper
from test_distributed import RedisServer, start_worker
from test_distributed import _workers_ready as workers_ready

from layerdiff.client.api import run
from layerdiff.client.demo import packaged_model
from layerdiff.collector.dumps.directory import write_dump
from layerdiff.collector.live.onnxrt import LiveRunner

PLANTED = "p2o.Conv.31"


def _planted_bug(model: onnx.ModelProto) -> onnx.ModelProto:
    """The detector with one convolution's weights off by 30 %, as a broken
    kernel or a badly converted weight would leave it."""
    bad = onnx.ModelProto()
    bad.CopyFrom(model)
    conv = next(n for n in bad.graph.node if n.name == PLANTED)
    const = next(n for n in bad.graph.node if n.op_type == "Constant" and n.output[0] == conv.input[1])
    attr = const.attribute[0]
    w = numpy_helper.to_array(attr.t)
    attr.t.CopyFrom(numpy_helper.from_array((w * 1.3).astype(w.dtype), attr.t.name))
    return bad


@pytest.fixture(scope="module")
def detector(tmp_path_factory):
    """PP-OCRv4 det (672 node outputs) at 64x64: its own FP32 dump, and the
    dump of a build with a planted bug, both in execution order."""
    base = tmp_path_factory.mktemp("detector")
    model = onnx.load(str(packaged_model()))
    onnx.save_model(model, str(base / "det.onnx"))
    x = np.random.default_rng(0).standard_normal((1, 3, 64, 64)).astype(np.float32)
    np.savez(base / "inputs.npz", x=x)
    model_bytes = (base / "det.onnx").read_bytes()
    own = list(LiveRunner(model_bytes, {"x": x}).records())
    bug = list(LiveRunner(model_bytes, {"x": x}, device_model_bytes=_planted_bug(model).SerializeToString())
               .records())
    return {"model": base / "det.onnx", "inputs": base / "inputs.npz", "own": write_dump(base / "own", own),
            "bug": write_dump(base / "bug", bug), "base": base}


def permuted(dump: Path, order: list[int], dest: Path) -> Path:
    """A copy of ``dump`` whose manifest lists the tensors in ``order``."""
    shutil.copytree(dump, dest)
    manifest = json.loads((dump / "manifest.json").read_text())
    manifest["nodes"] = [manifest["nodes"][i] for i in order]
    (dest / "manifest.json").write_text(json.dumps(manifest))
    return dest


def reports(out: Path) -> dict[str, bytes]:
    """Every report file, with what names the run itself (job id, times,
    dump path, cores) taken out of summary.json; the page carries the job id
    and a script nonce, so its verdict is checked instead."""
    files = {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    summary = json.loads(files.pop("summary.json"))
    for k in ("job_id", "started_at", "elapsed_s", "dump_path", "collector"):
        summary.pop(k, None)
    summary["parameters"].pop("max_cores", None)
    page = html.unescape(files.pop("report.html").decode())
    assert summary["diagnosis"]["headline"] in page
    files["summary.json"] = json.dumps(summary, indent=1, sort_keys=True).encode()
    return files


def _run(services, case, dump: Path, out: Path, **kw):
    collector, analyzer = services
    return run(case["model"], case["inputs"], dump=str(dump), out=out, analyzer=analyzer.address,
               collector=collector.address, progress=False, **kw)


@pytest.fixture(scope="module")
def baseline(services, detector):
    out = detector["base"] / "baseline"
    res = _run(services, detector, detector["bug"], out)
    assert res.summary["first_computation_error"]["node"] == PLANTED and res.exit_status == 1
    return reports(out)


N_TENSORS = 672


@pytest.fixture(scope="module")
def pooled(services, tmp_path_factory):
    """The same collector with an analyzer whose local pool compares every
    tensor on its own threads (by default the detector's tensors at 64x64
    are all small enough to be compared on the stream's thread)."""
    analyzer = ServiceProcess("analyzer", tmp_path_factory.mktemp("pooled"),
                              env={**os.environ, "LAYERDIFF_INLINE_ELEMENTS": "1"})
    try:
        yield services[0], analyzer
    finally:
        analyzer.stop()


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(order=st.permutations(range(N_TENSORS)), cores=st.integers(1, 4), on_threads=st.booleans())
def test_any_stream_order_gives_the_same_reports_on_the_local_pool(services, pooled, detector, baseline, order,
                                                                   cores, on_threads):
    where = pooled if on_threads else services
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        own = _run(where, detector, permuted(detector["own"], order, tmp / "own"), tmp / "own-out",
                   max_cores=cores)
        c = own.summary["counts"]
        assert (c["compared"], c["failed"], c["failed_constants"]) == (N_TENSORS, 0, 0), own.summary["diagnosis"]
        assert own.exit_status == 0
        _run(where, detector, permuted(detector["bug"], order, tmp / "bug"), tmp / "bug-out", max_cores=cores)
        assert reports(tmp / "bug-out") == baseline


def test_reversed_and_interleaved_orders(services, pooled, detector, baseline, tmp_path):
    """The orders that hid the defect least: everything backwards, and
    consumers before their producers two by two; on the stream's thread
    and on the pool's."""
    n = N_TENSORS
    pairs = [j for i in range(0, n - 1, 2) for j in (i + 1, i)] + ([n - 1] if n % 2 else [])
    for name, order in (("reversed", list(range(n))[::-1]), ("pairs", pairs)):
        for where, cores in ((services, 1), (pooled, 3)):
            out = tmp_path / f"{name}-{cores}"
            _run(where, detector, permuted(detector["bug"], order, tmp_path / f"dump-{name}-{cores}"), out,
                 max_cores=cores)
            assert reports(out) == baseline, (name, cores)


def test_dump_without_manifest_in_file_name_order(services, cnn_files, tmp_path):
    """Files named after their tensors, read in file-name order (not the
    execution order): the same reports as the manifest's order."""
    model, inputs, device = cnn_files
    feeds = dict(np.load(inputs))
    records = [r for r in LiveRunner(model.read_bytes(), feeds, device_model_bytes=device.read_bytes()).records()]
    ordered = write_dump(tmp_path / "ordered", records)
    loose = tmp_path / "loose"
    loose.mkdir()
    for r in records:
        np.save(loose / f"{r.name}.npy", r.array)
    collector, analyzer = services
    outs = []
    for dump in (ordered, loose):
        out = tmp_path / f"out-{dump.name}"
        run(model, inputs, dump=str(dump), out=out, analyzer=analyzer.address, collector=collector.address,
            progress=False)
        outs.append(reports(out))
    # without a manifest the device names no op types and no order: only
    # the names column can differ, never a metric or a verdict
    a, b = outs
    assert json.loads(a["summary.json"])["nodes"] == json.loads(b["summary.json"])["nodes"]
    assert json.loads(b["summary.json"])["first_failing_node"]["node"] == "conv2"


def test_watched_directory_filled_in_random_order(services, detector, baseline, tmp_path):
    """The runtime writes node files (``{tensor}.npy``) in any order while
    the job reads them, and the manifest last."""
    src = detector["bug"]
    dest = tmp_path / "watched"
    dest.mkdir()
    nodes = json.loads((src / "manifest.json").read_text())["nodes"]
    random.Random(7).shuffle(nodes)

    def writer():
        for k, n in enumerate(nodes):
            tmp = dest / f".{n['name']}.part"
            tmp.write_bytes((src / n["file"]).read_bytes())
            os.replace(tmp, dest / f"{n['name']}.npy")
            if k % 100 == 0:
                time.sleep(0.05)
        listed = [dict(n, file=f"{n['name']}.npy") for n in nodes]
        (dest / "manifest.json").write_text(json.dumps({"nodes": listed}))

    t = threading.Thread(target=writer)
    t.start()
    try:
        _run(services, detector, dest, tmp_path / "out", watch=True)
    finally:
        t.join()
    assert reports(tmp_path / "out") == baseline


# ------------------------------------------------------------------ Celery

@pytest.fixture(scope="module")
def celery_analyzer(tmp_path_factory):
    base = tmp_path_factory.mktemp("order-celery")
    rs = RedisServer(base)
    env = dict(os.environ, LAYERDIFF_JOB_DEADLINE_S="240")
    workers = [start_worker(rs.url, env) for _ in range(2)]
    procs = []
    try:
        assert wait_for(lambda: workers_ready(rs.url, 2), 60), "workers did not come up"
        analyzer = ServiceProcess("analyzer", base / "analyzer", env=dict(env, LAYERDIFF_BROKER_URL=rs.url))
        procs.append(analyzer)
        yield analyzer
    finally:
        for p in procs:
            p.stop()
        for w in workers:
            w.terminate()
            try:
                w.wait(timeout=10)
            except Exception:
                w.kill()
        rs.stop()


def test_celery_workers_in_any_order_give_the_local_reports(services, celery_analyzer, detector, baseline,
                                                            tmp_path):
    collector, _ = services
    for seed in (1, 2):
        order = list(range(N_TENSORS))
        random.Random(seed).shuffle(order)
        out = tmp_path / f"out-{seed}"
        _run((collector, celery_analyzer), detector, permuted(detector["bug"], order, tmp_path / f"dump-{seed}"),
             out, max_cores=seed + 1)
        assert reports(out) == baseline, seed
