"""What the analyzer's memory budget and the small-model fast path change
nothing a user reads: a reference cut into segments of its own nodes (and
spilled to disk) gives the reports one whole run gives, and a job whose
files are handed to the embedded services in memory gives the reports of
one whose files cross the wire."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from test_impact import FEEDS, encoder, scaled
from test_stream_order import reports

from layerdiff.analyzer.service import AnalyzerServer
from layerdiff.client.api import run
from layerdiff.collector.live.onnxrt import to_fp16
from layerdiff.collector.service import CollectorServer


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    base = tmp_path_factory.mktemp("budget")
    onnx.save_model(encoder(layers=3), str(base / "model.onnx"))
    # its FP16 build with a kernel bug in layer 2: the report then has verdicts, diagnoses and impact runs
    onnx.save_model(to_fp16(scaled(encoder(layers=3), "l2.v.w", 1.8)), str(base / "device.onnx"))
    np.savez(base / "inputs.npz", **FEEDS)
    return base


def _summary_memory(out) -> dict:
    return json.loads((out / "summary.json").read_text())["memory"]


def _reports(out) -> dict:
    got = reports(out)
    summary = json.loads(got["summary.json"])
    summary.pop("memory")
    got["summary.json"] = json.dumps(summary, indent=1, sort_keys=True).encode()
    return got


@pytest.mark.parametrize("mode", ["output", "all"])
def test_a_budget_below_the_activations_gives_the_same_report(files, tmp_path, monkeypatch, mode):
    """The FP16 build of a 3-layer encoder with a kernel bug (the report has
    verdicts, diagnoses and impact runs): within a budget of a few tensors
    the reference is a chain of small segments, some values wait on disk,
    and every report file is the same."""
    whole = run(files / "model.onnx", files / "inputs.npz", device_model=files / "device.onnx", dump_mode=mode,
                out=tmp_path / "whole", progress=False)
    assert whole.exit_status == 1 and whole.summary["counts"]["compared"] > 60
    assert whole.summary["diagnosis"]["impact"]["runs"] >= 1
    assert _summary_memory(tmp_path / "whole")["reference_segments"] == 1
    monkeypatch.setenv("LAYERDIFF_MEMORY_BUDGET", "24K")
    cut = run(files / "model.onnx", files / "inputs.npz", device_model=files / "device.onnx", dump_mode=mode,
              out=tmp_path / "cut", progress=False)
    memory = _summary_memory(tmp_path / "cut")
    assert memory["budget_bytes"] == 24 * 1024 and memory["chained"] and memory["reference_segments"] > 10
    assert _reports(tmp_path / "cut") == _reports(tmp_path / "whole")
    assert cut.exit_status == whole.exit_status


def test_values_spill_when_the_device_sends_its_last_tensor_first(files, tmp_path, monkeypatch):
    """A dump listed in reverse asks for the reference's last segment first:
    what waits for its device counterpart goes to disk past the budget, and
    the report is the in-order one."""
    from layerdiff.collector.dumps.directory import write_dump
    from layerdiff.collector.live.onnxrt import LiveRunner

    records = list(LiveRunner((files / "model.onnx").read_bytes(), FEEDS, precision="fp16").records())
    forward = write_dump(tmp_path / "forward", records)
    backward = write_dump(tmp_path / "backward", list(reversed(records)))
    monkeypatch.setenv("LAYERDIFF_MEMORY_BUDGET", "24K")
    run(files / "model.onnx", files / "inputs.npz", dump=str(forward), out=tmp_path / "in-order", progress=False)
    run(files / "model.onnx", files / "inputs.npz", dump=str(backward), out=tmp_path / "reversed",
        progress=False)
    assert _summary_memory(tmp_path / "reversed")["spilled_bytes"] > 24 * 1024
    assert _reports(tmp_path / "reversed") == _reports(tmp_path / "in-order")


def test_a_tiny_model_gives_the_same_report_with_and_without_the_fast_path(files, tmp_path):
    """Embedded (files handed over in memory, the collector given a link)
    against services reached over loopback (files uploaded, then, for the
    second job, found on the collector already)."""
    fast = run(files / "model.onnx", files / "inputs.npz", device_model=files / "device.onnx",
               out=tmp_path / "fast", progress=False)
    with CollectorServer() as collector, AnalyzerServer() as analyzer:
        held = []
        for k in (1, 2):
            slow = run(files / "model.onnx", files / "inputs.npz", device_model=files / "device.onnx",
                       out=tmp_path / f"wire{k}", analyzer=analyzer.address, collector=collector.address,
                       progress=False)
            assert _reports(tmp_path / f"wire{k}") == _reports(tmp_path / "fast")
            held.append({p.name: p.stat().st_ino for p in collector.flight.store.root.iterdir()})
        # the models and the inputs, sent to the collector for the first job only (an upload writes anew)
        assert len(held[0]) == 3 and held[1] == held[0]
    assert slow.exit_status == fast.exit_status == 1


def test_a_malformed_budget_fails_the_submit_naming_it(files, tmp_path, monkeypatch):
    from layerdiff.common.errors import LayerdiffError

    monkeypatch.setenv("LAYERDIFF_MEMORY_BUDGET", "lots")
    with pytest.raises(LayerdiffError, match="LAYERDIFF_MEMORY_BUDGET.*'lots'"):
        run(files / "model.onnx", files / "inputs.npz", out=tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


_CHURN = r"""
import ctypes, resource, sys, threading
import numpy as np
if sys.argv[1] == "padded":
    from layerdiff.common.memory import release_freed_tensors_to_system
    assert release_freed_tensors_to_system()
else:       # the fixed threshold alone, as before the heaps were padded
    from layerdiff.common.memory import MMAP_THRESHOLD_BYTES
    ctypes.CDLL("libc.so.6").mallopt(-3, MMAP_THRESHOLD_BYTES)
def work():     # a comparison's small arrays, made and freed over and over on a worker thread
    rng = np.random.default_rng(0)
    for _ in range(300):
        keep = [np.ones(int(n)) for n in rng.integers(1000, 30000, 20)]
        del keep
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for t in [threading.Thread(target=work) for _ in range(2)]:
    t.start(); t.join()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_small_arrays_freed_and_made_again_do_not_fault_their_pages_again():
    """The analyzer's heaps keep their padding: 1.4 GB of small arrays
    made and freed on two threads touch new pages once, not every time (a
    third of a two-dump comparison's system time went into those faults)."""
    faults = {how: int(subprocess.run([sys.executable, "-c", _CHURN, how], capture_output=True, text=True,
                                      check=True, timeout=120).stdout)
              for how in ("padded", "unpadded")}
    assert faults["unpadded"] > 100_000, faults      # the churn this guards against
    assert faults["padded"] < 20_000, faults         # at most the padding of the two threads' heaps
