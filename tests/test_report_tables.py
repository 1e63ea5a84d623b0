"""A report's tables in Parquet: the same content as its CSV and JSON files,
typed (NaN apart from null), read back in one call by any later version,
and two reports compared as a regression gate (``layerdiff diff``)."""
from __future__ import annotations

import csv
import json
import math
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import small_cnn

from layerdiff import read_report
from layerdiff.analyzer.reference.onnxrt import OnnxReference
from layerdiff.client.api import compare
from layerdiff.collector.dumps.directory import write_dump
from layerdiff.common.errors import LayerdiffError
from layerdiff.common.schema import NODES_SCHEMA, REPORT_SCHEMA_VERSION, TABLE_KEY, VERSION_KEY, NodeRecord


def _dump(path, model, feeds, extra=()):
    values = OnnxReference(model.SerializeToString()).run(feeds)
    write_dump(path, [NodeRecord(name=k, array=v) for k, v in values.items()] + list(extra))
    return path


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """A golden dump against itself (clean), against a build with a planted
    bug in conv2 (buggy), and a dump of another model: three reports."""
    tmp = tmp_path_factory.mktemp("tables")
    feeds = {"input": np.random.default_rng(5).standard_normal((1, 3, 16, 16)).astype(np.float32)}
    zeros = [NodeRecord(name="all_zero", array=np.zeros((4, 4), np.float32))]    # cosine undefined
    gold = _dump(tmp / "gold", small_cnn(), feeds, zeros)
    bug = _dump(tmp / "bug", small_cnn(bug_in="conv2", bug_scale=1.5), feeds, zeros)
    out = {}
    for name, dev in (("clean", gold), ("buggy", bug)):
        out[name] = compare(str(gold), str(dev), out=tmp / name, progress=False).out
    other = tmp / "other"
    other.mkdir()
    write_dump(other / "g", [NodeRecord(name="unrelated", array=np.ones(3, np.float32))])
    out["other"] = compare(str(other / "g"), str(other / "g"), out=tmp / "other-report", progress=False).out
    return out


def _csv(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _same_number(cell: str, value) -> bool:
    """A CSV cell (six significant digits, 'nan', '' for none) against a
    typed value."""
    if value is None:
        return cell == ""
    if isinstance(value, float) and math.isnan(value):
        return cell == "nan"
    return cell == f"{value:.6g}"


def test_nodes_parquet_holds_what_the_csv_and_the_summary_hold(reports):
    out = reports["buggy"]
    table = pq.read_table(out / "nodes.parquet")
    assert table.schema.equals(NODES_SCHEMA, check_metadata=False)
    assert table.schema.metadata[TABLE_KEY] == b"nodes"
    assert table.schema.metadata[VERSION_KEY] == str(REPORT_SCHEMA_VERSION).encode()
    rows = table.to_pylist()
    csv_rows = _csv(out / "cpu_vs_npu.csv")
    summary = json.loads((out / "summary.json").read_text())
    assert len(rows) == len(csv_rows) == len(summary["nodes"]) > 9
    for row, cells, node in zip(rows, csv_rows, summary["nodes"]):
        assert (row["index"], row["node"], row["tensor"], row["op_type"]) == \
            (int(cells["index"]), cells["node"], cells["tensor"], cells["op_type"])
        assert ("pass" if row["passed"] else "fail") == cells["result"]
        assert cells["errors/total"] == f"{row['errors']}/{row['total']}"
        for col, csv_col in (("cosine", "cosine"), ("max_abs_diff", "max_abs_diff"), ("rmse", "rmse"),
                             ("sqnr_db", "sqnr_db"), ("max_rel_err", "max_abs_total"), ("ref_rms", "rms"),
                             ("explained_rel_err", "explained_rel_err"), ("own_rel_err", "own_rel_err")):
            assert _same_number(cells[csv_col], row[col]), (row["tensor"], col, cells[csv_col], row[col])
        assert (row["verdict"] or "") == cells["verdict"] and (row["cause"] or "") == cells["cause"]
        assert " | ".join(row["evidence"]) == cells["evidence"]
        # summary.json: null for NaN and for what was not made, the strings "inf"/"-inf"
        for col in ("cosine", "pearson", "kl_div", "mse", "sqnr_db"):
            want = node[col]
            got = row[col]
            assert (want is None and (got is None or math.isnan(got))) or \
                (isinstance(want, str) and got == float(want)) or want == got, (row["tensor"], col, want, got)
        assert (row["node"], row["order"], row["passed"], row["constant"]) == \
            (node["node"], node["order"], node["passed"], node["constant"])
        assert (row["verdict"], row["evidence"]) == (node["verdict"], node["evidence"])
    by = {r["tensor"]: r for r in rows}
    bug = by["conv2_out"]
    assert bug["verdict"] == "computation error" and not bug["passed"]
    assert bug["rel_err"] > bug["allowed_rel_err"] > 0 and bug["precision"]
    # NaN is an undefined metric, null a figure not made
    zero = by["all_zero"]
    assert math.isnan(zero["cosine"]) and zero["verdict"] is None and zero["isolated_cosine"] is None
    assert table.column("cosine").null_count == 0


def test_elements_and_alignment_tables_match_their_csv_files(reports):
    out = reports["buggy"]
    elements = read_report(out, "elements").to_pylist()
    assert elements, "a failing node's worst elements"
    files = sorted({e["detail_file"] for e in elements})
    for name in files:
        mine = [e for e in elements if e["detail_file"] == name]
        assert [e["rank"] for e in mine] == list(range(len(mine)))
        cells = _csv(out / name)
        assert len(cells) == len(mine)
        for e, c in zip(mine, cells):
            assert int(c["index"]) == e["flat_index"]
            assert all(_same_number(c[k], e[k]) for k in ("std_value", "npu_value", "abs_diff", "relative_diff"))
        shape = next(r["shape"] for r in read_report(out).to_pylist() if r["tensor"] == mine[0]["tensor"])
        assert all(list(np.unravel_index(e["flat_index"], shape)) == e["index"] for e in mine)
    aligned = read_report(out, "alignment").to_pylist()
    cells = _csv(out / "alignment.csv")
    assert [(a["reference_tensor"] or "", a["device_tensor"] or "", a["method"]) for a in aligned] == \
        [(c["reference_tensor"], c["device_tensor"], c["method"]) for c in cells]
    assert all(_same_number(c["confidence"], a["confidence"]) if a["confidence"] is not None else c["confidence"] == ""
               for a, c in zip(aligned, cells))


def test_a_report_reads_into_a_typed_dataframe_in_one_line(reports):
    df = read_report(reports["buggy"], pandas=True)
    assert str(df["errors"].dtype) == "int64[pyarrow]" and str(df["cosine"].dtype) == "double[pyarrow]"
    assert str(df["passed"].dtype) == "bool[pyarrow]"
    zero = df[df["tensor"] == "all_zero"].iloc[0]
    assert math.isnan(zero["cosine"]) and zero["isolated_cosine"] is pd_na()
    assert df.loc[df["tensor"] == "conv2_out", "verdict"].iloc[0] == "computation error"


def pd_na():
    import pandas as pd

    return pd.NA


def test_reports_of_another_schema_version_or_table_read_as_they_should(reports, tmp_path):
    table = pq.read_table(reports["clean"] / "nodes.parquet")
    # an older report, written before some columns existed: they come back as nulls
    older = table.drop_columns(["own_rel_err", "alignment_method"])
    pq.write_table(older.replace_schema_metadata({TABLE_KEY: b"nodes", VERSION_KEY: b"1"}), tmp_path / "nodes.parquet")
    back = read_report(tmp_path)
    assert back.schema.equals(NODES_SCHEMA, check_metadata=False)
    assert back.column("own_rel_err").null_count == back.num_rows
    assert back.column("tensor").to_pylist() == table.column("tensor").to_pylist()
    # a later version's extra column is kept
    newer = table.append_column("tomorrow", pa.array([1] * table.num_rows))
    pq.write_table(newer.replace_schema_metadata({TABLE_KEY: b"nodes", VERSION_KEY: b"99"}), tmp_path / "nodes.parquet")
    assert "tomorrow" in read_report(tmp_path).column_names
    # not a report's table, no version, not Parquet, no file: one clear error each
    pq.write_table(table.replace_schema_metadata({TABLE_KEY: b"elements", VERSION_KEY: b"1"}),
                   tmp_path / "nodes.parquet")
    with pytest.raises(LayerdiffError, match="holds 'elements', not the report's 'nodes' table"):
        read_report(tmp_path)
    pq.write_table(table.replace_schema_metadata({TABLE_KEY: b"nodes"}), tmp_path / "nodes.parquet")
    with pytest.raises(LayerdiffError, match="no schema version"):
        read_report(tmp_path)
    (tmp_path / "nodes.parquet").write_text("not parquet")
    with pytest.raises(LayerdiffError, match="not a readable Parquet file"):
        read_report(tmp_path)
    with pytest.raises(LayerdiffError, match="no table 'rows'"):
        read_report(reports["clean"], "rows")


def _diff(*args):
    proc = subprocess.run([sys.executable, "-m", "layerdiff.client.cli", "diff", *map(str, args)],
                          capture_output=True, text=True, timeout=120)
    assert "Traceback" not in proc.stderr and "Warning" not in proc.stderr
    return proc


def test_diff_gates_on_what_got_worse(reports, tmp_path):
    clean, buggy = reports["clean"], reports["buggy"]
    worse = _diff(clean, buggy, "--json", tmp_path / "d.json")
    assert worse.returncode == 1, worse.stdout + worse.stderr
    lines = worse.stdout.splitlines()
    flagged = [ln.split()[1].rstrip(":") for ln in lines if ln.strip().startswith("WORSE")]
    assert lines[0].startswith(f"10 tensors in both reports: {len(flagged)} worse, 0 better")
    assert "verdict no finding -> computation error (kernel)" in lines[1]
    assert "conv2_out" in flagged and "conv1_out" not in flagged and "relu1_out" not in flagged
    doc = json.loads((tmp_path / "d.json").read_text())
    assert {c["tensor"] for c in doc["changes"] if c["worse"]} == set(flagged)
    assert {c["what"] for c in doc["changes"] if c["tensor"] == "conv2_out"} == {"verdict", "relative error"}
    # the fix: everything better, nothing worse
    fixed = _diff(buggy, clean)
    assert fixed.returncode == 0 and "0 worse" in fixed.stdout and "better" in fixed.stdout
    assert _diff(clean, clean).returncode == 0
    # a larger factor lets a grown error through, not a changed verdict
    assert _diff(clean, buggy, "--error-factor", "1e9").returncode == 1
    bad = _diff(clean, buggy, "--error-factor", "0.5")
    assert bad.returncode == 2 and "--error-factor" in bad.stderr


def test_diff_says_when_it_cannot_answer(reports, tmp_path):
    other = _diff(reports["clean"], reports["other"])
    assert other.returncode == 3 and "share no tensor" in other.stdout
    missing = _diff(reports["clean"], tmp_path / "nowhere")
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "no such report directory" in missing.stderr
    old = tmp_path / "old"
    old.mkdir()
    (old / "cpu_vs_npu.csv").write_text("op_name\n")
    before_tables = _diff(old, reports["clean"])
    assert before_tables.returncode == 2 and "before reports held tables" in before_tables.stderr


def test_a_value_a_tensor_is_repeated_for_each_of_its_elements():
    """The elements table's per-tensor columns (node, tensor, role, input
    index, detail file) are one value a tensor repeated over its rows:
    non-ASCII names, nulls, tensors with no rows and integer columns."""
    import pyarrow as pa

    from layerdiff.analyzer.report.tables import _repeated

    times = np.array([2, 0, 3, 1])
    names = _repeated(["a", "skipped", "é/conv", None], times, pa.string())
    assert names.to_pylist() == ["a", "a", "é/conv", "é/conv", "é/conv", None] and names.null_count == 1
    slots = _repeated([None, 7, 0, None], times, pa.int32())
    assert slots.type == pa.int32() and slots.to_pylist() == [None, None, 0, 0, 0, None]
    assert _repeated(["x"], np.array([0]), pa.string()).to_pylist() == []


@pytest.mark.parametrize("table", ["nodes", "elements", "alignment"])
def test_tables_are_written_as_pyarrow_parquet_writes_them(reports, tmp_path, monkeypatch, table):
    """The report's writer skips pyarrow.parquet's module (its file systems
    are not needed for a local path): a table's file is the one
    pyarrow.parquet.write_table makes of it, byte for byte; and where
    pyarrow's own writer is not to be had, pyarrow.parquet writes it."""
    from layerdiff.analyzer.report import tables

    path = reports["buggy"] / f"{table}.parquet"
    read = pq.read_table(path)
    assert read.num_rows > 0
    pq.write_table(read, tmp_path / "by_pq.parquet", compression="zstd", memory_pool=pa.system_memory_pool())
    tables.write_parquet(read, tmp_path / "here.parquet")
    made = (tmp_path / "by_pq.parquet").read_bytes()
    assert (tmp_path / "here.parquet").read_bytes() == made
    monkeypatch.setattr(tables, "_Writer", None)
    tables.write_parquet(read, tmp_path / "fallback.parquet")
    assert (tmp_path / "fallback.parquet").read_bytes() == made
    assert pq.read_table(tmp_path / "here.parquet").num_rows == read.num_rows
