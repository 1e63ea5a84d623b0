"""The failing tensors' detail files, written while the job compares
(report.details): the same bytes under the same names as when written at
the end, nothing provisional left behind however the job ends, and a job
of two dumps whose stream does not follow the execution order; the
summary's documents made by the report's process (report.writer) as the
job makes them itself, and its failures."""
from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pyarrow.parquet as pq
import pytest

from layerdiff.analyzer.compare.node import compare_node
from layerdiff.analyzer.compare.tolerances import Tolerance
from layerdiff.analyzer.report.details import DetailFiles, write_detail
from layerdiff.analyzer.report.documents import write_documents
from layerdiff.analyzer.report.files import Row
from layerdiff.client.api import compare
from layerdiff.collector.dumps.directory import write_dump
from layerdiff.common.onnxgraph import TensorSite
from layerdiff.common.schema import NodeRecord

TOL = Tolerance(0.005, 0.2)


def _row(tensor: str, scale: float, order: int = 0, seed: int = 0) -> Row:
    ref = np.random.default_rng(seed).standard_normal(300).astype(np.float32)
    return Row(TensorSite(tensor, tensor, "Conv", order, 0), tensor, compare_node(ref, ref * scale, TOL, 128))


def _listing(d) -> list[str]:
    return sorted(os.listdir(d))


def test_files_written_while_comparing_are_those_written_at_the_end(tmp_path):
    rows = [_row("a", 1.0), _row("b", 1.5, 1, 1), _row("c/d", 2.0, 2, 2), _row("e", 3.0, 3, 3)]
    assert [r.failed for r in rows] == [False, True, True, True]
    names = {"b": "b.csv", "c/d": "c_d.csv", "e": "e.csv"}
    early = DetailFiles(tmp_path / "early")
    for r in rows[:3]:          # "e" is recorded some other way: placed without being added
        early.add(r)
    early.place(rows, names)
    early.finish()
    early.close()
    late = tmp_path / "late"
    late.mkdir()
    at_end = DetailFiles(late)
    at_end.place(rows, names)
    at_end.finish()
    assert _listing(tmp_path / "early") == _listing(late) == ["b.csv", "c_d.csv", "e.csv"]
    for name in names.values():
        assert (tmp_path / "early" / name).read_bytes() == (late / name).read_bytes()
    with open(late / "c_d.csv", newline="", encoding="utf-8") as f:
        got = list(csv.DictReader(f))
    assert list(got[0]) == ["index", "std_value", "npu_value", "abs_diff", "relative_diff"]
    assert len(got) == len(rows[2].outcome.worst) and int(got[0]["index"]) == rows[2].outcome.worst[0][0]


def test_a_tensor_recorded_twice_keeps_its_last_file_only(tmp_path):
    """x twice, with other tensors before and after it: each keeps its
    own file (a provisional name is never given twice)."""
    first, other, again, later = _row("x", 1.5), _row("y", 2.0, 1, 1), _row("x", 4.0, seed=9), _row("z", 3.0, 2, 2)
    files = DetailFiles(tmp_path)
    for r in (first, other, again, later):
        files.add(r)
    rows = [again, other, later]
    files.place(rows, {"x": "x.csv", "y": "y.csv", "z": "z.csv"})
    files.finish()
    assert _listing(tmp_path) == ["x.csv", "y.csv", "z.csv"]
    for r in rows:
        want = tmp_path / "want.csv"
        write_detail(want, r.outcome.worst)
        assert (tmp_path / f"{r.label}.csv").read_bytes() == want.read_bytes(), r.label
        want.unlink()


@pytest.mark.parametrize("rows", [1, 40])      # still in hand, and handed to the writer
def test_a_job_that_ends_before_its_reports_leaves_nothing_provisional(tmp_path, rows):
    files = DetailFiles(tmp_path)
    for i in range(rows):
        files.add(_row(f"n{i}", 2.0, i, i))
    files.close()
    assert _listing(tmp_path) == []
    files.add(_row("late", 2.0))     # a row after the end is not written
    assert _listing(tmp_path) == []


def test_a_report_directory_that_cannot_be_written_fails_at_placing(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    files = DetailFiles(tmp_path / "file" / "report")
    files.add(_row("b", 1.5))
    with pytest.raises(OSError):
        files.place([_row("b", 1.5)], {"b": "b.csv"})
    files.close()


def test_two_dumps_in_another_order_than_execution_name_clashing_files_alike(tmp_path):
    """Names that clash once made safe ('a/b' and 'a_b') take their file
    names in execution order, whatever order the device dump lists them
    in; every failing tensor has its file, no provisional one is left."""
    rng = np.random.default_rng(3)
    names = ["a/b", "a_b"] + [f"t{i}" for i in range(40)]
    gold = {n: rng.standard_normal(64).astype(np.float32) for n in names}
    write_dump(tmp_path / "gold", [NodeRecord(name=n, array=v, order=i) for i, (n, v) in enumerate(gold.items())])
    # the device dump lists them backwards, each failing
    write_dump(tmp_path / "dev", [NodeRecord(name=n, array=gold[n] * 3, order=len(names) - i)
                                  for i, n in enumerate(reversed(names))])
    res = compare(tmp_path / "gold", tmp_path / "dev", out=tmp_path / "out", progress=False)
    files = res.summary["detail_files"]
    assert len(files) == len(names)
    assert files["a/b"] == "a_b.csv" and files["a_b"].startswith("a_b_") and files["a_b"].endswith(".csv")
    on_disk = [n for n in _listing(tmp_path / "out") if n.endswith(".csv")]
    assert set(files.values()) <= set(on_disk)
    assert not [n for n in _listing(tmp_path / "out") if n.startswith(".")]
    for tensor in ("a/b", "a_b"):
        with open(tmp_path / "out" / files[tensor], newline="", encoding="utf-8") as f:
            worst = list(csv.DictReader(f))
        i = int(worst[0]["index"])
        assert float(worst[0]["std_value"]) == pytest.approx(float(gold[tensor][i]), rel=1e-5)


def test_a_file_the_writer_cannot_place_fails_the_reports(tmp_path):
    """The files are made by a process of their own: a failure there (a
    directory where a file's name goes) is the OSError finishing raises,
    naming the file; the files after it are not placed, and closing after
    it leaves no provisional file behind."""
    out = tmp_path / "report"
    files = DetailFiles(out)
    rows = [_row(f"n{i}", 2.0, i, i) for i in range(20)]      # a batch handed to the writer
    for r in rows:
        files.add(r)
    (out / "n3.csv" / "inside").mkdir(parents=True)
    files.place(rows, {r.label: f"{r.label}.csv" for r in rows})
    with pytest.raises(OSError) as failed:
        files.finish()
    assert failed.value.errno and failed.value.filename and "n3.csv" in str(failed.value), failed.value
    files.close()
    assert _listing(out) == ["n0.csv", "n1.csv", "n2.csv", "n3.csv"]


def _failing_job(tmp_path) -> dict:
    """A real job's summary (two dumps, every tensor failing)."""
    rng = np.random.default_rng(5)
    gold = {f"t{i}": rng.standard_normal(64).astype(np.float32) for i in range(20)}
    write_dump(tmp_path / "gold", [NodeRecord(name=n, array=v, order=i) for i, (n, v) in enumerate(gold.items())])
    write_dump(tmp_path / "dev", [NodeRecord(name=n, array=v * 3, order=i) for i, (n, v) in enumerate(gold.items())])
    return compare(tmp_path / "gold", tmp_path / "dev", out=tmp_path / "job", progress=False).summary


def _unnonced(page: bytes) -> bytes:
    """report.html without its per-page nonce."""
    return re.sub(rb'nonce(-|=")[A-Za-z0-9_-]+', b"nonce", page)


def _through_the_process(out, summary: dict, rows: list) -> bool:
    files = DetailFiles(out)
    for r in rows:
        files.add(r)
    files.place(rows, {r.label: f"{r.label}.csv" for r in rows if r.failed})
    handed = files.hand_over(summary)
    files.finish()
    files.close()
    return handed


def test_the_documents_the_process_makes_are_those_made_here(tmp_path):
    """summary.json, the explorer's files and report.html, made by the
    report's process from the summary handed to it, are the bytes made in
    the job's own process (the page but for its nonce)."""
    summary = _failing_job(tmp_path)
    rows = [_row(f"n{i}", 2.0, i, i) for i in range(20)]       # a batch: the process is started
    assert _through_the_process(tmp_path / "there", summary, rows)
    (tmp_path / "here").mkdir()
    write_documents(tmp_path / "here", summary)
    made = ["model_explorer_cosine.json", "model_explorer_rel_err.json", "report.html", "summary.json"]
    assert sorted(n for n in _listing(tmp_path / "here")) == made
    assert [n for n in _listing(tmp_path / "there") if not n.endswith(".csv")] == made
    for name in made:
        here, there = (tmp_path / "here" / name).read_bytes(), (tmp_path / "there" / name).read_bytes()
        assert _unnonced(here) == _unnonced(there), name
    assert json.loads((tmp_path / "there" / "summary.json").read_text(encoding="utf-8")) == summary
    assert b"nonce" in (tmp_path / "there" / "report.html").read_bytes()


@pytest.mark.parametrize("blocked,named", [("summary.json", "summary.json"), (".report.html.tmp", "report.html")])
def test_a_document_the_process_cannot_write_fails_the_reports(tmp_path, blocked, named):
    """A directory where summary.json, or the page (made beside it by a
    child of the report's process), goes: finishing raises the OSError
    naming it, and the detail files placed before it stay (and summary.json,
    where the page failed)."""
    summary = _failing_job(tmp_path)
    out = tmp_path / "report"
    (out / blocked).mkdir(parents=True)
    rows = [_row(f"n{i}", 2.0, i, i) for i in range(20)]
    with pytest.raises(OSError) as failed:
        _through_the_process(out, summary, rows)
    assert failed.value.errno and named in str(failed.value.filename), failed.value
    assert [n for n in _listing(out) if n.endswith(".csv")] == sorted(f"n{i}.csv" for i in range(20))
    assert [n for n in _listing(out) if n.startswith(".")] == ([blocked] if blocked.startswith(".") else [])
    if named == "report.html":
        assert json.loads((out / "summary.json").read_text(encoding="utf-8")) == summary


def test_a_summary_the_process_cannot_make_documents_of_is_left_to_the_job(tmp_path):
    """A numpy number in the summary (marshal carries it as its bytes):
    the process makes no documents of it, and says so without failing."""
    rows = [_row(f"n{i}", 2.0, i, i) for i in range(20)]
    files = DetailFiles(tmp_path)
    for r in rows:
        files.add(r)
    files.place(rows, {r.label: f"{r.label}.csv" for r in rows})
    assert files.hand_over({"nodes": [{"cosine": np.float64(0.5)}]})
    assert files.finish() == {"documents"}
    files.close()
    assert _listing(tmp_path) == sorted(f"n{i}.csv" for i in range(20))


_TWO_DUMP_JOB = """
import numpy as np
from layerdiff.client.api import compare
from layerdiff.collector.dumps.directory import write_dump
from layerdiff.common.schema import NodeRecord

def two_dump_job(tmp_path, out):
    # every tensor failing, NaN among the device's values
    rng = np.random.default_rng(7)
    gold = {f"t{i}": rng.standard_normal((2, 3, 8)).astype(np.float32) for i in range(24)}
    dev = {n: v * 3 for n, v in gold.items()}
    dev["t5"][0, 1, 2] = np.nan
    if not (tmp_path / "gold").exists():
        write_dump(tmp_path / "gold", [NodeRecord(name=n, array=v, order=i) for i, (n, v) in enumerate(gold.items())])
        write_dump(tmp_path / "dev", [NodeRecord(name=n, array=v, order=i) for i, (n, v) in enumerate(dev.items())])
    return compare(tmp_path / "gold", tmp_path / "dev", out=out, progress=False)
"""


def test_the_tables_the_process_makes_are_those_made_here(tmp_path, monkeypatch):
    """The Parquet tables made by the report's process from their parts are
    the files the job's own process makes where it has no such process,
    byte for byte; and the job's process never loads pyarrow for them."""
    from layerdiff.analyzer.report import writer

    script = _TWO_DUMP_JOB + f"""
import sys
from pathlib import Path
two_dump_job(Path({str(tmp_path)!r}), Path({str(tmp_path / "there")!r}))
print("pyarrow" in sys.modules)
"""
    there = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert there.stdout.split() == ["False"], (there.stdout, there.stderr)
    monkeypatch.setattr(writer, "_BOOTABLE", False)     # no process to be had: the job makes every file
    here: dict = {}
    exec(_TWO_DUMP_JOB, here)
    here["two_dump_job"](tmp_path, tmp_path / "here")
    for name in ("nodes.parquet", "elements.parquet", "alignment.parquet"):
        assert (tmp_path / "here" / name).read_bytes() == (tmp_path / "there" / name).read_bytes(), name
    elements = pq.read_table(tmp_path / "there" / "elements.parquet").to_pydict()
    assert len(set(elements["tensor"])) == 24 and any(v != v for v in elements["npu_value"])     # the NaN too


def _parts(cosine) -> dict:
    """The tables' parts of one compared tensor, its ``cosine`` replaced."""
    from layerdiff.analyzer.report.table_parts import table_parts

    parts = table_parts([_row("a", 2.0)], {}, [], None)
    parts["nodes"]["cosine"] = [cosine]
    return parts


def test_tables_the_process_cannot_make_are_left_to_the_job(tmp_path):
    """A numpy number among the tables' parts (marshal carries it as its
    bytes): the process makes no table of them and says so, without failing."""
    files = DetailFiles(tmp_path, tables=True)
    files.start()
    assert files.hand_tables(_parts(np.float64(0.5)))
    assert files.finish() == {"tables"}
    files.close()
    assert _listing(tmp_path) == []
    files = DetailFiles(tmp_path / "fine", tables=True)
    files.start()
    assert files.hand_tables(_parts(0.5))
    assert files.finish() == frozenset()
    files.close()
    assert pq.read_table(tmp_path / "fine" / "nodes.parquet").column("cosine").to_pylist() == [0.5]


def test_a_table_the_process_cannot_write_fails_the_reports(tmp_path):
    """A directory where nodes.parquet goes: finishing raises the OSError
    naming it."""
    (tmp_path / "nodes.parquet").mkdir()
    files = DetailFiles(tmp_path, tables=True)
    files.start()
    assert files.hand_tables(_parts(0.5))
    with pytest.raises(OSError) as failed:
        files.finish()
    files.close()
    assert failed.value.errno and "nodes.parquet" in str(failed.value.filename), failed.value


def test_tables_the_process_refuses_are_made_by_the_job(tmp_path, monkeypatch):
    """Parts the report's process cannot take (numpy numbers among them):
    the job's process makes the tables itself, the same values."""
    from layerdiff.analyzer.report import details
    from layerdiff.analyzer.report import files as report_files
    from layerdiff.analyzer.report.table_parts import table_parts

    def numpy_cosines(*args):
        parts = table_parts(*args)
        parts["nodes"]["cosine"] = [np.float64(c) for c in parts["nodes"]["cosine"]]
        return parts

    monkeypatch.setattr(report_files, "table_parts", numpy_cosines)
    monkeypatch.setattr(details, "tables_there", lambda: True)     # as where pyarrow is not loaded
    job: dict = {}
    exec(_TWO_DUMP_JOB, job)
    r = job["two_dump_job"](tmp_path, tmp_path / "out")
    cosines = pq.read_table(tmp_path / "out" / "nodes.parquet").column("cosine").to_pylist()
    assert cosines == [n["cosine"] for n in r.summary["nodes"]] and len(cosines) == 24


def test_a_process_started_ahead_of_its_job_writes_the_job_s_files(tmp_path):
    """A command that will run its job in its own process starts the
    report's process before its imports: the job's DetailFiles take it
    (told the directory first) and the files are those of one started
    for the job."""
    from layerdiff.analyzer.report.writer import ReportProcess

    ReportProcess.prestart()
    assert ReportProcess._spare is not None
    spare, tables = ReportProcess._spare
    assert spare.poll() is None and not tables
    rows = [_row(f"n{i}", 2.0, i, i) for i in range(20)]
    ahead = _through_the_process(tmp_path / "ahead", _failing_job(tmp_path), rows)
    assert ReportProcess._spare is None and spare.returncode == 0      # taken, and ended with its job
    fresh = _through_the_process(tmp_path / "fresh", _failing_job(tmp_path / "again"), rows)
    assert ahead and fresh
    listed = [n for n in _listing(tmp_path / "ahead")]
    assert listed == [n for n in _listing(tmp_path / "fresh")] and "summary.json" in listed
    for name in listed:
        if name.endswith(".csv"):
            assert (tmp_path / "ahead" / name).read_bytes() == (tmp_path / "fresh" / name).read_bytes(), name


def test_a_process_started_ahead_and_never_taken_ends_with_the_command(tmp_path):
    """The command fails before its job exists (a precision it does not
    know): the report's process it started ahead ends with it, leaving
    nothing running."""
    (tmp_path / "gold").mkdir()
    cli = subprocess.Popen([sys.executable, "-m", "layerdiff.client.cli", "compare", str(tmp_path / "gold"),
                            str(tmp_path / "gold"), "--out", str(tmp_path / "out"), "--no-progress",
                            "--node-precision", "conv=fp13"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    out, err = cli.communicate(timeout=120)
    assert cli.returncode == 2 and "fp13" in err and "job" not in err and "Traceback" not in err, err
    for _ in range(100):        # the group the command led: empty once the process read its input's end
        try:
            os.killpg(cli.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("a process of the command's group outlived it")
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())
