"""Watch mode: nodes stream while the runtime is still writing the dump;
half-written files are never sent."""
from __future__ import annotations

import json
import threading
import time

import numpy as np

from layerdiff.client.api import run
from layerdiff.collector.dumps.watch import watch_records
from layerdiff.collector.live.onnxrt import LiveRunner


def _slow_writer(root, records, done_manifest=True, leave_last_cut=False):
    """Write each node file in two halves with a pause between them, as a
    runtime flushing a large tensor does; the manifest comes last."""
    def write():
        for i, r in enumerate(records):
            import io

            buf = io.BytesIO()
            np.save(buf, r.array, allow_pickle=False)
            data = buf.getvalue()
            path = root / f"{r.name}.npy"
            with open(path, "wb") as f:
                f.write(data[:len(data) // 2])
                f.flush()
                time.sleep(0.5)               # longer than a poll: the size looks stable meanwhile
                if leave_last_cut and i == len(records) - 1:
                    break
                f.write(data[len(data) // 2:])
        if done_manifest:
            nodes = [{"name": r.name, "file": f"{r.name}.npy"} for r in records]
            (root / "manifest.json").write_text(json.dumps({"nodes": nodes}))

    t = threading.Thread(target=write, daemon=True)
    t.start()
    return t


def test_watch_streams_a_dump_being_written(services, cnn_files, tmp_path):
    collector, analyzer = services
    model, inputs, device = cnn_files
    feeds = dict(np.load(inputs))
    records = list(LiveRunner(model.read_bytes(), feeds, device_model_bytes=device.read_bytes()).records())
    dump = tmp_path / "dump"
    dump.mkdir()
    writer = _slow_writer(dump, records)
    started = time.monotonic()
    res = run(model, inputs, dump=str(dump), watch=True, out=tmp_path / "out", analyzer=analyzer.address,
              collector=collector.address, progress=False)
    writer.join()
    assert res.summary["counts"]["compared"] == 9 and res.first_failing_node == "conv2"
    assert time.monotonic() - started < 30        # ended with the manifest, not by idling
    assert (tmp_path / "out" / "compare_skip.log").read_text() == ""


def test_a_file_left_half_written_is_reported_when_the_watch_ends(tmp_path, cnn_files):
    model, inputs, device = cnn_files
    feeds = dict(np.load(inputs))
    records = list(LiveRunner(model.read_bytes(), feeds).records())[:3]
    writer = _slow_writer(tmp_path, records, done_manifest=False, leave_last_cut=True)
    got = list(watch_records(str(tmp_path), poll_s=0.1, idle_s=1.5))
    writer.join()
    ok = {r.name: r for r in got if r.status == "ok"}
    assert set(ok) == {records[0].name, records[1].name}
    for r in records[:2]:
        assert ok[r.name].array.tobytes() == r.array.tobytes()
    bad = [r for r in got if r.status != "ok"]
    assert len(bad) == 1 and bad[0].name == records[2].name
    assert "truncated" in bad[0].message and "when the watch ended" in bad[0].message
