"""Tiled dumps: slices spliced back along the concat axis, from grouping
info or the default rule, raw or hex; broken slices skipped with a reason in
check_skip.log / concate_skip.log while every other node is compared."""
from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import small_cnn
from hypothesis import given, settings
from hypothesis import strategies as st

from layerdiff.client.api import run
from layerdiff.collector.dumps.directory import DumpDirectory
from layerdiff.collector.dumps.tiled import concat_axis, read_hex, write_tiled_dump
from layerdiff.collector.live.onnxrt import LiveRunner
from layerdiff.common.errors import LayerdiffError
from layerdiff.common.schema import NodeRecord


@pytest.fixture(scope="module")
def live_records():
    feeds = {"input": np.random.default_rng(4).standard_normal((1, 3, 16, 16)).astype(np.float32)}
    return list(LiveRunner(small_cnn().SerializeToString(), feeds, precision="fp16").records())


@pytest.mark.parametrize("axis", [0, 1, 2, 3])
@pytest.mark.parametrize("hex_text", [False, True])
def test_splice_along_every_axis(tmp_path, axis, hex_text):
    arr = np.random.default_rng(axis).standard_normal((2, 3, 4, 5)).astype(np.float32)
    dump = write_tiled_dump(tmp_path, [NodeRecord("t", "Conv", 0, arr)], tiles=2, axis=axis, hex_text=hex_text)
    [rec] = DumpDirectory(str(dump)).records()
    assert rec.status == "ok" and rec.array.tobytes() == arr.tobytes()


@pytest.mark.parametrize("default, axis", [(0, 0), (-1, 1), (2, 2)])
def test_without_grouping_info_the_default_concat_dim_applies(tmp_path, default, axis):
    arr = np.arange(1 * 4 * 6 * 2, dtype=np.int16).reshape(1, 4, 6, 2)
    dump = write_tiled_dump(tmp_path, [NodeRecord("t", "Conv", 0, arr)], tiles=2, axis=axis, grouping=False)
    [rec] = DumpDirectory(str(dump), default_concat_dim=default).records()
    assert rec.status == "ok" and np.array_equal(rec.array, arr)
    assert concat_axis((1, 1, 5, 2), -1) == 2


def test_broken_slices_go_to_the_right_log_and_the_rest_is_compared(live_records, tmp_path, cnn_files, services):
    collector, analyzer = services
    model, inputs, _ = cnn_files
    feeds = dict(np.load(inputs))
    recs = list(LiveRunner(model.read_bytes(), feeds, precision="fp16").records())
    dump = write_tiled_dump(tmp_path / "dump", recs, tiles=2, hex_text=True)
    manifest = json.loads((dump / "manifest.json").read_text())
    by = {n["name"]: n for n in manifest["nodes"]}
    first = dump / by["conv1_out"]["slices"][0]["file"]
    first.write_text(first.read_text().replace("0", "g", 1))                 # foreign character
    (dump / by["relu1_out"]["slices"][1]["file"]).unlink()                   # a slice missing
    assert by["conv2_out"]["slices"][1]["shape"] == [1, 8, 8, 16]
    by["conv2_out"]["slices"][1]["shape"] = [1, 16, 8, 8]                   # same size, does not concatenate
    by["relu2_out"]["concat_dim"] = 7                                        # an axis that does not exist
    (dump / "manifest.json").write_text(json.dumps(manifest))
    out = tmp_path / "out"
    res = run(model, inputs, dump=str(dump), out=out, analyzer=analyzer.address, collector=collector.address,
              progress=False)
    check = (out / "check_skip.log").read_text()
    concat = (out / "concate_skip.log").read_text()
    assert "conv1_out: " in check and "foreign character 'g'" in check
    assert "relu1_out: " in check and "is missing" in check
    assert "conv2_out: " in concat and "does not concatenate" in concat
    assert "relu2_out: " in concat and "concat axis 7" in concat
    compared = [n["tensor"] for n in res.summary["nodes"]]
    assert compared == ["add_out", "conv3_out", "pool_out", "flat_out", "logits"]
    assert all(n["max_abs_diff"] < 0.05 for n in res.summary["nodes"])   # FP16 rounding only: spliced right


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200), st.integers(0, 64))
def test_hex_reader_never_crashes(blob, nbytes):
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "x.hex"
        p.write_bytes(blob)
        try:
            assert len(read_hex(p, nbytes)) == nbytes
        except LayerdiffError:
            pass
