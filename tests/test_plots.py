"""Analysis plots and ``layerdiff histogram``: real PNGs of the documented
size, bins validation, NaN/Inf in the data, and histograms of a real dump
written from a live run of the small CNN."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from conftest import small_cnn

from layerdiff.analyzer.report import plots
from layerdiff.client.cli import main
from layerdiff.client.histogram import parse_min_max, write_histograms
from layerdiff.collector.dumps.directory import write_dump
from layerdiff.collector.live.onnxrt import LiveRunner
from layerdiff.common.errors import LayerdiffError, NotFoundError


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def check_pngs(out: Path, names: dict) -> None:
    assert set(names) == {"diff", "diff_hist", "hist"}
    for f in names.values():
        p = out / f
        assert p.stat().st_size > 5_000, f"{f} looks empty"
        assert png_size(p) == (plots.PLOT_WIDTH_PX, plots.PLOT_HEIGHT_PX) == (800, 600)


def test_node_plots_write_three_pngs_of_the_documented_size(tmp_path):
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((1, 4, 32, 32)).astype(np.float32)
    dev = ref.copy()
    dev[0, 2] += 0.8  # one channel broken
    names = plots.node_plots(tmp_path, "conv2", ref, dev)
    assert names == {"diff": "conv2_diff.png", "diff_hist": "conv2_diff_hist.png", "hist": "conv2_hist.png"}
    check_pngs(tmp_path, names)


def test_node_plots_survive_nan_inf_and_hostile_titles(tmp_path):
    ref = np.linspace(-3, 3, 4096, dtype=np.float32)
    dev = ref * 1.5
    dev[:100] = np.nan
    dev[100:110] = np.inf
    ref[200:205] = -np.inf
    names = plots.node_plots(tmp_path, "n", ref, dev, title="a $unbalanced {\\bf} <b>\n\x1b[31m", max_bins=16)
    check_pngs(tmp_path, names)
    # all values non-finite on one side, constant on the other, and an empty tensor
    names = plots.node_plots(tmp_path, "allnan", np.ones(50, np.float32), np.full(50, np.nan, np.float32))
    check_pngs(tmp_path, names)
    names = plots.node_plots(tmp_path, "empty", np.zeros((0, 3), np.float32), np.zeros((0, 3), np.float32))
    check_pngs(tmp_path, names)
    # identical tensors: nothing fails, every element shown
    names = plots.node_plots(tmp_path, "same", np.arange(10.0), np.arange(10.0))
    check_pngs(tmp_path, names)


def test_large_tensor_is_plotted_in_bounded_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(plots, "CHUNK", 1000)
    monkeypatch.setattr(plots, "MAX_POINTS", 500)
    rng = np.random.default_rng(3)
    ref = rng.standard_normal(20_000).astype(np.float16)
    dev = (ref.astype(np.float32) + rng.standard_normal(20_000).astype(np.float32)).astype(np.float16)
    a = plots.node_plots(tmp_path / "a", "x", ref, dev, max_bins=64, min_bins=8)
    b = plots.node_plots(tmp_path / "b", "x", ref, dev, max_bins=64, min_bins=8)
    check_pngs(tmp_path / "a", a)
    for k in a:  # deterministic: the same input draws the same picture
        assert (tmp_path / "a" / a[k]).read_bytes() == (tmp_path / "b" / b[k]).read_bytes()


@pytest.mark.parametrize("kw,field", [
    ({"max_bins": 0}, "max_bins"), ({"max_bins": plots.BINS_LIMIT + 1}, "max_bins"), ({"max_bins": 2.5}, "max_bins"),
    ({"max_bins": True}, "max_bins"), ({"min_bins": 0}, "min_bins"), ({"max_bins": 10, "min_bins": 11}, "min_bins"),
    ({"min_bins": "3"}, "min_bins"),
])
def test_bins_are_validated(tmp_path, kw, field):
    with pytest.raises(LayerdiffError) as e:
        plots.node_plots(tmp_path, "n", np.zeros(4), np.zeros(4), **kw)
    assert e.value.field == field
    assert field in str(e.value)
    assert not list(tmp_path.iterdir())


def test_bin_count_stays_in_bounds():
    assert plots.bin_count(0) == 1
    assert plots.bin_count(100) == 10
    assert plots.bin_count(10**8) == 128
    assert plots.bin_count(100, max_bins=8) == 8
    assert plots.bin_count(4, min_bins=16, max_bins=32) == 16


def test_bad_plot_inputs_name_the_field(tmp_path):
    with pytest.raises(LayerdiffError, match="stem"):
        plots.node_plots(tmp_path, "../escape", np.zeros(3), np.zeros(3))
    with pytest.raises(LayerdiffError) as e:
        plots.node_plots(tmp_path, "n", np.zeros(3), np.zeros(4), title="conv9")
    assert e.value.node == "conv9" and e.value.field == "shape"
    with pytest.raises(LayerdiffError, match="dtype"):
        plots.node_plots(tmp_path, "n", np.array(["a"]), np.array(["b"]))


def test_error_chart(tmp_path):
    out = plots.error_chart(tmp_path / "chart.png", [0, 1, 2, 3, 4], [0.0, 1e-3, None, "inf", 2.0],
                            [1.0, 0.999, None, 0.4, 0.2], ["a", "b", "c", "d$", "e"], 3)
    assert png_size(out) == (800, 600)
    with pytest.raises(LayerdiffError, match="first_index"):
        plots.error_chart(tmp_path / "c.png", [0], [0.1], [1.0], ["a"], 5)


# ---------------------------------------------------------------- histogram

@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    """A real npy dump of every node output of the small CNN."""
    feeds = {"input": np.random.default_rng(1).standard_normal((1, 3, 16, 16)).astype(np.float32)}
    records = list(LiveRunner(small_cnn().SerializeToString(), feeds).records())
    root = write_dump(tmp_path_factory.mktemp("dump"), records, "npy")
    return root, {r.name: r.array for r in records}


RANGES = """\
# per-layer ranges from calibration
conv1_out -2.5 3.5
relu1_out: 0, 40.5
add_out min: -1 max: 45
this line is not a range
conv2_out nan 4
relu2_out 5 1
conv1_out 0 1
conv3_out [-10, 10]
not_in_the_dump 0 1
"""


def test_histogram_cli_with_a_range_file(dump, tmp_path, capsys):
    root, arrays = dump
    mm = tmp_path / "tensor_min_max.txt"
    mm.write_text(RANGES, encoding="utf-8")
    out = tmp_path / "Histograms"
    assert main(["histogram", str(root), "--min-max", str(mm), "--out", str(out), "--max-bins", "64",
                 "--no-progress"]) == 0
    said = capsys.readouterr().out
    assert f"wrote {len(arrays)} histograms into {out}" in said
    assert "skipped 0 tensors and 4 range-file lines" in said
    assert "relu1_out, add_out" in said  # ranges above 30: the INT16 hint
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == sorted(f"{n}.png" for n in arrays)
    for p in out.glob("*.png"):
        assert png_size(p) == (800, 600) and p.stat().st_size > 5_000
    index = {t["tensor"]: t for t in json.loads((out / "histograms.json").read_text())["tensors"]}
    assert index["relu1_out"]["min"] == 0 and index["relu1_out"]["max"] == 40.5
    assert index["relu1_out"]["source"] == "range file"
    assert index["conv3_out"]["min"] == -10
    # lines that did not parse leave the tensor's own range
    assert index["relu2_out"]["source"] == "tensor"
    assert index["relu2_out"]["min"] == pytest.approx(float(arrays["relu2_out"].min()))
    assert index["relu2_out"]["max"] == pytest.approx(float(arrays["relu2_out"].max()))
    assert json.loads((out / "histograms.json").read_text())["unmatched_ranges"] == ["not_in_the_dump"]
    log = (out / "histogram_skip.log").read_text()
    for line_no, why in ((5, "not 'name min max'"), (6, "not finite"), (7, "above max"), (8, "listed again")):
        assert f"{mm}:{line_no}: " in log and why in log


def test_histogram_without_range_file_never_deletes_user_files(dump, tmp_path, monkeypatch, capsys):
    root, arrays = dump
    monkeypatch.chdir(tmp_path)
    existing = tmp_path / "Histograms"
    existing.mkdir()
    (existing / "mine.txt").write_text("keep me")
    assert main(["histogram", str(root), "--no-progress", "--min-bins", "4"]) == 0
    said = capsys.readouterr().out
    assert "left as it is" in said and "Histograms_2" in said
    assert (existing / "mine.txt").read_text() == "keep me"
    assert list(existing.iterdir()) == [existing / "mine.txt"]
    pngs = list((tmp_path / "Histograms_2").glob("*.png"))
    assert len(pngs) == len(arrays)
    index = json.loads((tmp_path / "Histograms_2" / "histograms.json").read_text())
    assert all(t["source"] == "tensor" for t in index["tensors"])


def test_histogram_of_other_formats_hostile_names_and_bad_tensors(tmp_path):
    from layerdiff.common.schema import NodeRecord

    recs = [NodeRecord(name="/evil/dir\\<x> y", op_type="Relu", order=0, array=np.arange(12, dtype=np.float32)),
            NodeRecord(name="nan only", op_type="Relu", order=1, array=np.full(4, np.nan, np.float32)),
            NodeRecord(name="ints", op_type="Cast", order=2, array=np.arange(6, dtype=np.int8).reshape(2, 3)),
            NodeRecord(name="half", op_type="Conv", order=3,
                       array=np.array([1, np.inf, -2, np.nan, 3], dtype=np.float16))]
    root = write_dump(tmp_path / "d", recs, "bin")
    res = write_histograms(root, tmp_path / "H")
    out = Path(res["out"])
    files = {p.name for p in out.iterdir()}
    assert all((out / f).resolve().parent == out.resolve() for f in files)
    written = {w["tensor"]: w for w in res["written"]}
    assert set(written) == {"/evil/dir\\<x> y", "ints", "half"}
    assert written["half"]["min"] == -2 and written["half"]["max"] == 3
    assert res["skipped"] == [("nan only", "no finite values")]
    assert not (tmp_path / "evil").exists()


def test_range_file_errors_name_the_file(tmp_path):
    with pytest.raises(NotFoundError) as e:
        parse_min_max(tmp_path / "absent.txt")
    assert e.value.field == "min_max" and "absent.txt" in str(e.value)
    binary = tmp_path / "b.txt"
    binary.write_bytes(b"conv 0 1\n\x00\x01")
    with pytest.raises(LayerdiffError, match="not a text file"):
        parse_min_max(binary)
    with pytest.raises(LayerdiffError, match="is a directory"):
        parse_min_max(tmp_path)


def test_histogram_cli_reports_bad_bins_and_missing_dump(tmp_path, capsys):
    assert main(["histogram", str(tmp_path), "--max-bins", "0"]) == 2
    assert "max_bins" in capsys.readouterr().err
    assert main(["histogram", str(tmp_path / "nope"), "--no-progress"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "Histograms").exists()


def test_range_lines_in_every_layout():
    from layerdiff.analyzer.diagnose.minmax import parse_min_max as parse_text

    ranges, skipped = parse_text("conv1_input  -3.2  41.7\nrelu2: 0.0, 6.0\nfc1000#185,-1,1e1\n"
                                 "pool 5 min: -1 max: +2.5\n'quoted name' [0, .5]\n# a comment\n\n"
                                 "a12 3\nx inf 1\nx 1 2\nx 3 4\n", shown="mm.txt")
    assert ranges == {"conv1_input": (-3.2, 41.7), "relu2": (0.0, 6.0), "fc1000#185": (-1.0, 10.0),
                      "pool 5": (-1.0, 2.5), "quoted name": (0.0, 0.5), "x": (1.0, 2.0)}
    assert [w for w, _ in skipped] == ["mm.txt:8", "mm.txt:9", "mm.txt:11"]


def test_plots_are_drawn_beside_the_job_and_hold_at_most_two_nodes():
    """The drawing thread takes the nodes in order; the third node waits
    until the first is drawn (no more than two nodes' tensors held); a
    drawing that fails says why without stopping the others; every receive
    buffer a drawing held is let go once, drawn, failed or dropped."""
    import threading
    import time

    from layerdiff.analyzer.report.drawer import PlotDrawer

    gate, started = threading.Event(), threading.Event()
    released: list[str] = []
    drawer = PlotDrawer(ahead=2)

    def slow() -> dict:
        started.set()
        gate.wait(10)
        return {"hist": "a.png"}

    def broken() -> dict:
        raise ValueError("no finite values")

    drawer.submit("a", slow, lambda: released.append("a"))
    drawer.submit("b", broken, lambda: released.append("b"))
    third = threading.Thread(target=drawer.submit, args=("c", lambda: {"hist": "c.png"},
                                                          lambda: released.append("c")))
    third.start()
    time.sleep(0.3)
    assert third.is_alive() and released == []      # waits for a free place
    gate.set()
    third.join(10)
    got = dict(drawer.results())
    assert got["a"] == {"hist": "a.png"} and got["c"] == {"hist": "c.png"}
    assert isinstance(got["b"], ValueError) and "no finite values" in str(got["b"])
    assert sorted(released) == ["a", "b", "c"]

    # a job that stops early: what waits is dropped and its buffer let go
    gate.clear()
    started.clear()
    released.clear()
    drawer = PlotDrawer(ahead=2)
    drawer.submit("a", slow, lambda: released.append("a"))
    drawer.submit("b", slow, lambda: released.append("b"))
    assert started.wait(10)
    drawer.abandon()
    assert released == ["b"]     # "a" is being drawn: it lets go when done
    gate.set()
    for _ in range(100):
        if len(released) == 2:
            break
        time.sleep(0.05)
    assert sorted(released) == ["a", "b"]
