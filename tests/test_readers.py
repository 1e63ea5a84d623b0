"""Dump formats: each written from a real model run and read back bit-exact
through the collector; hostile or broken files are skipped with a reason;
every parser survives random and mutated bytes."""
from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import small_cnn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layerdiff.analyzer.align.names import normalize
from layerdiff.collector.dumps.convert import convert
from layerdiff.collector.dumps.directory import (
    ORDER_KEYS,
    ORDER_SEQUENCE,
    ORDER_TIMES,
    ORDER_UNKNOWN,
    DumpDirectory,
    write_dump,
)
from layerdiff.collector.dumps.readers import read_npy, read_npz, read_raw, read_tensor_proto
from layerdiff.collector.live.onnxrt import LiveRunner
from layerdiff.collector.service import CollectorClient, CollectorServer
from layerdiff.common.errors import LayerdiffError
from layerdiff.common.schema import TensorAssembler
from layerdiff.v1 import layerdiff_pb2 as pb


@pytest.fixture(scope="module")
def live_records():
    feeds = {"input": np.random.default_rng(2).standard_normal((1, 3, 16, 16)).astype(np.float32)}
    return list(LiveRunner(small_cnn().SerializeToString(), feeds, precision="fp16").records())


@pytest.fixture(scope="module")
def live_records_all():
    """Inputs (weights included) and outputs of every node of an FP16 run."""
    feeds = {"input": np.random.default_rng(2).standard_normal((1, 3, 16, 16)).astype(np.float32)}
    return list(LiveRunner(small_cnn().SerializeToString(), feeds, precision="fp16").records("all"))


def _capture(address, path, fmt=""):
    client = CollectorClient(address)
    asm, out = TensorAssembler(), []
    for chunk in client.capture(pb.CaptureRequest(job_id="t", dump=pb.DumpSource(path=str(path), format=fmt))):
        out.extend(asm.feed(chunk.data))
    client.close()
    return out + asm.finish()


@pytest.mark.parametrize("fmt", ["npy", "npz", "onnx", "bin", "h5", "ascend"])
def test_every_format_round_trips_bit_exact_through_the_collector(live_records_all, tmp_path, fmt):
    dump = write_dump(tmp_path / fmt, live_records_all, fmt=fmt)
    with CollectorServer() as server:
        got = _capture(server.address, dump)
    # node names as the aligner sees them: HDF5 group names cannot hold '/'
    placed = [(normalize(r.node), r.role, r.slot) for r in live_records_all]
    assert [(normalize(r.node), r.role, r.slot) for r in got] == placed
    assert {r.role for r in got} == {"input", "output"}
    for r, want in zip(got, live_records_all):
        assert r.status == "ok", r.message
        assert r.array.dtype == want.array.dtype and r.array.shape == want.array.shape
        assert r.array.tobytes() == want.array.tobytes(), r.name
    # outputs keep the names the aligner matches: the tensor, or the node for
    # formats that name operators (HDF5 groups, vendor file names)
    for r, want in zip(got, live_records_all):
        if r.role == "output":
            assert normalize(r.name) in {normalize(n) for n in (want.name, want.node, f"{want.node}:{want.slot}")}


def test_npz_dumps_keep_tensors_named_like_savez_arguments(tmp_path):
    """Node names are the user's: ``file`` and ``allow_pickle`` are written
    and read back like any other (numpy's savez takes them as its own
    arguments: one failed the write, the other vanished)."""
    from layerdiff.common.schema import NodeRecord

    arrays = {"file": np.arange(6, dtype=np.float32).reshape(2, 3), "allow_pickle": np.ones(4, np.float16),
              "conv/out": np.full(3, 7, np.int64)}
    dump = write_dump(tmp_path / "d", [NodeRecord(name=n, node=n, op_type="Relu", order=i, array=a)
                                       for i, (n, a) in enumerate(arrays.items())], "npz")
    got = {r.name: r.array for r in DumpDirectory(str(dump)).records()}
    assert set(got) == set(arrays)
    for n, a in arrays.items():
        assert got[n].dtype == a.dtype and np.array_equal(got[n], a)


def test_manifest_that_lies_and_hostile_entries_are_skipped(live_records, tmp_path):
    dump = write_dump(tmp_path / "bin", live_records, fmt="bin")
    manifest = json.loads((dump / "manifest.json").read_text())
    nodes = manifest["nodes"]
    nodes[0]["offset"] = 10**9                               # past the end
    nodes[1]["shape"] = [10**6, 10**6]                       # 10^12 elements
    nodes[2]["dtype"] = "object"
    nodes[3]["name"] = "a/../../b"
    nodes[4]["file"] = "../outside.bin"
    nodes[5]["shape"] = [2, -3]
    (dump / "manifest.json").write_text(json.dumps(manifest))
    recs = list(DumpDirectory(str(dump)).records())
    errors = {r.name: r.message for r in recs if r.status != "ok"}
    assert "run past the end of the file" in errors[nodes[0]["name"]]
    assert "over the limit" in errors[nodes[1]["name"]]
    assert "not a plain numeric type" in errors[nodes[2]["name"]]
    assert "'..' path segment" in errors["a/../../b"]
    assert "outside the dump directory" in errors[nodes[4]["name"]]
    assert "invalid dimension" in errors[nodes[5]["name"]]
    assert [r.name for r in recs if r.status == "ok"] == [n["name"] for n in nodes[6:]]


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_npy_headers_read_as_numpy_reads_them(tmp_path, version):
    """numpy's own header layout is read without its parser; any other
    layout still goes through it; either way the array is np.load's."""
    import io

    arrays = [np.float32(3.0), np.arange(5, dtype=np.int64), np.zeros((1, 3, 4, 2), np.float16),
              np.asfortranarray(np.arange(12.0).reshape(3, 4)), np.array([True, False]),
              np.zeros((2, 0, 3), np.uint8), np.arange(6, dtype=">f8").reshape(2, 3)]
    for i, a in enumerate(arrays):
        buf = io.BytesIO()
        np.lib.format.write_array(buf, np.asarray(a), version=version)
        (tmp_path / f"{i}.npy").write_bytes(buf.getvalue())
        got, want = read_npy(tmp_path / f"{i}.npy"), np.load(tmp_path / f"{i}.npy")
        assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want), a
        assert got.flags.f_contiguous == want.flags.f_contiguous
    def header(text: bytes) -> bytes:
        text += b" " * (-(10 + len(text) + 1) % 64) + b"\n"
        return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text
    (tmp_path / "reordered.npy").write_bytes(header(b"{'shape': (2,), 'fortran_order': False, 'descr': '<f4'}")
                                            + np.arange(2, dtype=np.float32).tobytes())
    assert np.array_equal(read_npy(tmp_path / "reordered.npy"), [0.0, 1.0])
    (tmp_path / "nodtype.npy").write_bytes(header(b"{'descr': '<q9', 'fortran_order': False, 'shape': (2,), }")
                                          + bytes(16))
    with pytest.raises(LayerdiffError, match="corrupt .npy header"):
        read_npy(tmp_path / "nodtype.npy")


def test_links_out_of_the_dump_are_refused_and_links_inside_followed(tmp_path):
    from layerdiff.collector.dumps.manifest import resolve_inside

    dump, outside = tmp_path / "dump", tmp_path / "secret"
    (dump / "sub").mkdir(parents=True)
    outside.mkdir()
    np.save(outside / "x.npy", np.arange(3.0))
    np.save(dump / "sub" / "y.npy", np.arange(4.0))
    (dump / "out.npy").symlink_to(outside / "x.npy")                 # a file linked out
    (dump / "away").symlink_to(outside)                              # a directory linked out
    (dump / "a\\b.npy").symlink_to(outside / "x.npy")              # a backslash is part of the name
    (dump / "in.npy").symlink_to(dump / "sub" / "y.npy")             # a link that stays inside
    (dump / "dangling.npy").symlink_to(outside / "gone.npy")         # a link out to nothing
    for rel in ("out.npy", "away/x.npy", "a\\b.npy", "./away/x.npy", "sub//../away/x.npy"):
        with pytest.raises(LayerdiffError, match="outside the dump directory"):
            resolve_inside(dump, rel, "n")
    assert resolve_inside(dump, "in.npy", "n") == (dump / "sub" / "y.npy").resolve()
    assert resolve_inside(dump, "sub/y.npy", "n") == (dump / "sub" / "y.npy").resolve()
    assert resolve_inside(dump, "missing.npy", "n").name == "missing.npy"
    (dump / "manifest.json").write_text(json.dumps({"nodes": [
        {"name": "leak", "file": "out.npy"}, {"name": "deep", "file": "away/x.npy"},
        {"name": "ok", "file": "in.npy"}, {"name": "dangling", "file": "dangling.npy"}]}))
    recs = {r.name: r for r in DumpDirectory(str(dump)).records()}
    assert "outside the dump directory" in recs["leak"].message
    assert "outside the dump directory" in recs["dangling"].message      # not "missing": it points out
    assert "outside the dump directory" in recs["deep"].message
    assert recs["ok"].status == "ok" and np.array_equal(recs["ok"].array, np.arange(4.0))


def test_broken_onnx_and_npz_files(tmp_path, live_records):
    from onnx import numpy_helper

    t = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4), "x")
    t.raw_data = t.raw_data[:-4]
    (tmp_path / "cut.pb").write_bytes(t.SerializeToString())
    with pytest.raises(LayerdiffError, match="raw_data holds 44 bytes, dims \\[3, 4\\] need 48"):
        read_tensor_proto(tmp_path / "cut.pb")
    (tmp_path / "junk.pb").write_bytes(b"\xff" * 50)
    with pytest.raises(LayerdiffError, match="not an ONNX TensorProto"):
        read_tensor_proto(tmp_path / "junk.pb")
    np.savez(tmp_path / "a.npz", good=np.arange(5), bad=np.arange(1000.0))
    data = bytearray((tmp_path / "a.npz").read_bytes())
    # make the second member unreadable without touching the first
    at = data.find(b"bad.npy")
    data[at + 60:at + 90] = b"\x00" * 30
    (tmp_path / "b.npz").write_bytes(bytes(data))
    members = dict(read_npz(tmp_path / "b.npz"))
    assert np.array_equal(members["good"], np.arange(5))
    assert isinstance(members["bad"], LayerdiffError)


def test_convert_writes_npy_txt_and_sidecars(live_records, tmp_path):
    dump = write_dump(tmp_path / "d", live_records, fmt="onnx")
    res = convert(dump, tmp_path / "out", txt=True)
    assert res["converted"] == len(live_records) and res["skipped"] == 0
    side = json.loads((tmp_path / "out" / "conv1_out.json").read_text())
    assert side["shape"] == [1, 8, 16, 16] and side["dtype"] == "float16" and side["op_type"] == "Conv"
    arr = np.load(tmp_path / "out" / "conv1_out.npy", allow_pickle=False)
    assert arr.tobytes() == live_records[0].array.tobytes()
    txt = np.loadtxt(tmp_path / "out" / "conv1_out.txt", dtype=np.float32)
    assert np.array_equal(txt.astype(np.float16), live_records[0].array.reshape(-1))
    again = list(DumpDirectory(str(tmp_path / "out")).records())   # the output is itself a dump
    assert [r.name for r in again] == [r.name for r in live_records]


def _convert_cli(dump, out):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "layerdiff.client.cli", "convert", str(dump), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)


def test_convert_names_every_file_it_cannot_read_and_fails_on_nothing_readable(live_records, tmp_path):
    """No silent skip: a file named as the runtime names its dumps but
    holding random bytes, and a file no reader takes, are each named with
    why in convert_skip.log (the terminal says where); a dump with nothing
    readable exits 2 with the reason on one line."""
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "Conv.conv1.3.1.1700000000000000").write_bytes(np.random.default_rng(0).bytes(300))
    r = _convert_cli(junk, tmp_path / "o1")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and "no readable tensor: 1 skipped" in r.stderr, r.stderr
    log = (tmp_path / "o1" / "convert_skip.log").read_text()
    assert "Conv.conv1.3.1.1700000000000000" in log, log
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("hello")
    r = _convert_cli(empty, tmp_path / "o2")
    assert r.returncode == 2 and "notes.txt: not a dump file" in r.stderr, r.stderr
    # readable tensors beside one unreadable and one foreign file: converted, both named
    dump = write_dump(tmp_path / "d", live_records, fmt="npy")
    (dump / "broken.npy").write_bytes(b"\x93NUMPY garbage")
    (dump / "readme.md").write_text("x")
    r = _convert_cli(dump, tmp_path / "o3")
    assert r.returncode == 0, r.stderr
    log = (tmp_path / "o3" / "convert_skip.log").read_text()
    assert "readme.md: not a dump file" in log and "broken" in log, log
    assert f"converted {len(live_records)} tensors, skipped 2" in r.stdout, r.stdout


def test_a_dump_without_a_manifest_is_read_in_the_order_it_was_written(tmp_path):
    """A user's script writes one .npy per tensor in execution order, named
    after the tensors (which sort otherwise): the modification times give
    the order. Copied with equal times, a sequence number every name
    carries does; with neither, the names, and the reader says so."""
    import os

    order = ["_embed_output_0", "_layer_2_Div_output_0", "_layer_10_Add_output_0", "_pool_Div_output_0"]
    d = tmp_path / "user"
    d.mkdir()
    for i, name in enumerate(order):
        np.save(d / f"{name}.npy", np.full(3, i, np.float32))
        os.utime(d / f"{name}.npy", ns=(1_700_000_000_000_000_000 + i * 1000,) * 2)
    reader = DumpDirectory(str(d))
    assert [r.name for r in reader.records()] == order and reader.order_from == ORDER_TIMES
    for p in d.iterdir():
        os.utime(p, ns=(1_700_000_000_000_000_000,) * 2)           # copied: every time equal
    reader = DumpDirectory(str(d))
    assert reader.order_from == ORDER_UNKNOWN and not reader.order_known
    assert [r.name for r in reader.records()] == sorted(order)
    s = tmp_path / "seq"
    s.mkdir()
    for i, name in enumerate(order):
        np.save(s / f"{i * 5}_{name}.npy", np.full(3, i, np.float32))
        os.utime(s / f"{i * 5}_{name}.npy", ns=(1_700_000_000_000_000_000,) * 2)
    reader = DumpDirectory(str(s))
    assert reader.order_from == ORDER_SEQUENCE
    assert [r.name for r in reader.records()] == order      # the number is the order, not the name
    for i, name in enumerate(order):          # trailing numbers order, and stay: they may be the name's own
        (s / f"{i * 5}_{name}.npy").rename(s / f"{name}.{i * 5}.npy")
    assert [r.name for r in DumpDirectory(str(s)).records()] == [f"{n}.{i * 5}" for i, n in enumerate(order)]


@pytest.mark.parametrize("fmt", ["h5", "npz", "npy"])
def test_a_single_file_is_a_dump(live_records, tmp_path, fmt):
    """An .h5 or .npz archive, or one .npy tensor, is read wherever a dump
    directory is; a missing path says 'file or directory'."""
    if fmt == "npy":
        path = tmp_path / "one.npy"
        np.save(path, live_records[0].array)
        names = ["one"]
    else:
        dump = write_dump(tmp_path / "d", live_records, fmt=fmt)
        path = next(p for p in dump.iterdir() if p.suffix == f".{fmt}")
        names = [r.name for r in DumpDirectory(str(dump)).records()]      # as its directory reads
        assert len(names) == len(live_records)
    got = [r for r in DumpDirectory(str(path)).records()]
    assert [r.name for r in got] == names and all(r.array is not None for r in got)
    res = convert(path, tmp_path / "out")
    assert res["converted"] == len(names) and res["skipped"] == 0
    with pytest.raises(LayerdiffError, match="dump file or directory"):
        DumpDirectory(str(tmp_path / "nothing.h5"))
    (tmp_path / "x.csv").write_text("1,2")
    with pytest.raises(LayerdiffError, match="not one layerdiff reads as a dump"):
        DumpDirectory(str(tmp_path / "x.csv"))


def test_an_hdf5_file_says_whether_it_holds_an_order(tmp_path):
    """A single HDF5 dump's calls are in execution order where each carries
    an ``order`` attribute or a distinct numeric seqid, or the file keeps
    its groups in the order they were written; a script that wrote
    ``/op/0/output/0`` groups without track_order holds none (h5py lists
    them by name), and says why."""
    import h5py

    def write(name, seqids, track):
        with h5py.File(tmp_path / name, "w", track_order=track) as f:
            for op, seq in zip(("relu", "conv", "add"), seqids):
                f[f"{op}/{seq}/output/0"] = np.ones(2, np.float32)
        return DumpDirectory(str(tmp_path / name))

    assert write("tracked.h5", (0, 0, 0), True).order_known
    assert write("seqids.h5", (3, 1, 2), False).order_known
    flat = write("flat.h5", (0, 0, 0), False)
    assert not flat.order_known and flat.order_from == ORDER_KEYS
    assert "no order attributes or distinct seqids" in flat.order_unknown
    with h5py.File(tmp_path / "attrs.h5", "w") as f:
        for i, op in enumerate(("relu", "conv")):
            f[f"{op}/0/output/0"] = np.ones(2, np.float32)
            f[f"{op}/0"].attrs["order"] = i
    assert DumpDirectory(str(tmp_path / "attrs.h5")).order_known


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _valid_npy(tmp_path) -> bytes:
    np.save(tmp_path / "v.npy", np.arange(6, dtype=np.float32).reshape(2, 3))
    return (tmp_path / "v.npy").read_bytes()


@SETTINGS
@given(data=st.data())
def test_parsers_never_crash_on_random_or_mutated_bytes(tmp_path, data):
    from onnx import numpy_helper

    seeds = {
        "npy": _valid_npy(tmp_path),
        "onnx": numpy_helper.from_array(np.arange(6, dtype=np.float32), "t").SerializeToString(),
    }
    np.savez(tmp_path / "v.npz", a=np.arange(4))
    seeds["npz"] = (tmp_path / "v.npz").read_bytes()
    kind = data.draw(st.sampled_from(["npy", "onnx", "npz", "bin"]))
    base = seeds.get(kind, b"\x00" * 64)
    if data.draw(st.booleans()):
        blob = data.draw(st.binary(max_size=300))
    else:
        blob = bytearray(base)
        for _ in range(data.draw(st.integers(1, 8))):
            if not blob:
                break
            pos = data.draw(st.integers(0, len(blob) - 1))
            op = data.draw(st.sampled_from(["flip", "cut", "dup"]))
            if op == "flip":
                blob[pos] = data.draw(st.integers(0, 255))
            elif op == "cut":
                blob = blob[:pos]
            else:
                blob = blob[:pos] + blob[pos:pos + 16] * 3 + blob[pos:]
        blob = bytes(blob)
    path = tmp_path / f"fuzz.{kind}"
    path.write_bytes(blob)
    try:
        if kind == "npy":
            read_npy(path, max_bytes=1 << 20)
        elif kind == "onnx":
            read_tensor_proto(path, max_bytes=1 << 20)
        elif kind == "npz":
            for _, value in read_npz(path, max_bytes=1 << 20):
                assert isinstance(value, (np.ndarray, LayerdiffError))
        else:
            shape = data.draw(st.lists(st.integers(-2, 1 << 40), max_size=4))
            read_raw(path, data.draw(st.sampled_from(["float32", "int8", "object", "float16"])), shape,
                     data.draw(st.integers(-5, 400)), max_bytes=1 << 20)
    except LayerdiffError:
        pass


def test_hdf5_layout_calls_and_bad_datasets(tmp_path):
    import h5py

    with h5py.File(tmp_path / "d.h5", "w", track_order=True) as f:
        f["conv1/0/output/0"] = np.arange(6, dtype=np.float16).reshape(2, 3)
        f["conv1/0/output/1"] = np.ones(2, np.float32)
        f["conv1/0/input/0"] = np.zeros(3, np.float32)          # inputs are not outputs
        f["conv1/7/output/0"] = np.full(2, 7.0, np.float32)      # a second call of the op
        f.create_dataset("huge/0/output/0", shape=(10**6, 10**6), dtype=np.float32)   # declared, never written
        f["text/0/output/0"] = np.array([b"abc"])
        f["flat"] = np.zeros(2)
    recs = {r.name: r for r in DumpDirectory(str(tmp_path)).records()}
    assert np.array_equal(recs["conv1"].array, np.arange(6, dtype=np.float16).reshape(2, 3))
    assert recs["conv1:1"].array.dtype == np.float32
    assert np.array_equal(recs["conv1@1"].array, np.full(2, 7.0, np.float32))   # its second call
    assert "over the limit" in recs["huge"].message
    assert "not a plain numeric type" in recs["text"].message
    assert "not an /op/seqid group" in recs["flat"].message
    (tmp_path / "junk.h5").write_bytes(b"not hdf5 at all")
    junk = [r for r in DumpDirectory(str(tmp_path)).records() if "junk" in r.message]
    assert junk and "is not an HDF5 file" in junk[0].message


def test_empty_shape_with_unaddressable_dimensions_is_refused(tmp_path):
    """[0, 1.5e9, 1.5e9] holds no element, but no allocator can shape it:
    a clean refusal, not a crash (found by the fuzzer above)."""
    path = tmp_path / "empty.bin"
    path.write_bytes(b"")
    with pytest.raises(LayerdiffError, match="over the limit"):
        read_raw(path, "float32", [0, 1_518_494_220, 1_518_506_280], 0, max_bytes=1 << 20)
    assert read_raw(path, "float32", [0, 4, 4], 0).shape == (0, 4, 4)


def test_dump_names_what_it_cannot_write(tmp_path):
    """A live run's string tensor has no numbers: `layerdiff dump` writes
    the rest, names it with why in dump_skip.log (the terminal says where),
    and exits 2 when nothing at all could be written; never a traceback."""
    import subprocess
    import sys

    import onnx
    from onnx import TensorProto, helper

    def model(path, with_relu: bool):
        nodes = [helper.make_node("Cast", ["x"], ["s"], to=TensorProto.STRING, name="tostr")]
        outs = [helper.make_tensor_value_info("s", TensorProto.STRING, [2, 3])]
        if with_relu:
            nodes.append(helper.make_node("Relu", ["x"], ["y"], name="relu"))
            outs.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3]))
        g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])], outs)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        onnx.save(m, str(path))

    np.savez(tmp_path / "in.npz", x=np.ones((2, 3), np.float32))
    for with_relu, want in ((True, 0), (False, 2)):
        d = tmp_path / f"run{int(with_relu)}"
        d.mkdir()
        model(d / "m.onnx", with_relu)
        (d / "acl.json").write_text(json.dumps({"dump": {"dump_path": str(d / "out"), "dump_list": [],
                                                         "dump_mode": "output"}}))
        r = subprocess.run([sys.executable, "-m", "layerdiff.client.cli", "dump", str(d / "m.onnx"), "--inputs",
                            str(tmp_path / "in.npz"), "--config", str(d / "acl.json"), "--format", "npy"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == want and "Traceback" not in r.stderr, r.stderr
        log = (d / "out" / "dump_skip.log").read_text()
        assert log.startswith("s: holds string (object) values"), log
        assert str(d / "out" / "dump_skip.log") in (r.stdout if want == 0 else r.stderr)


def test_npy_files_that_are_no_npy_files_are_named_in_one_line(tmp_path):
    """Read from one mapping of the file: an empty or short file, another
    format, a directory where a file was expected and a missing file each
    give one line naming the file (and a dump's missing file says the
    manifest names it)."""
    (tmp_path / "empty.npy").write_bytes(b"")
    (tmp_path / "short.npy").write_bytes(b"\x93NUM")
    (tmp_path / "text.npy").write_bytes(b"name,value\nrelu,1\n")
    (tmp_path / "dir.npy").mkdir()
    want = {"empty.npy": "not a .npy file (0 bytes", "short.npy": "not a .npy file (4 bytes",
            "text.npy": "magic string is not correct", "dir.npy": "not a regular file",
            "gone.npy": "No such file or directory"}
    for name, words in want.items():
        with pytest.raises(LayerdiffError) as e:
            read_npy(tmp_path / name, name=name)
        assert words in str(e.value) and name in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "manifest.json").write_text(json.dumps({"nodes": [{"name": "a", "file": "gone.npy"},
                                                                   {"name": "b", "file": "dir.npy"}]}))
    recs = {r.name: r.message for r in DumpDirectory(str(tmp_path)).records()}
    assert "manifest names a missing file 'gone.npy'" in recs["a"] and "not a regular file" in recs["b"]


@pytest.mark.parametrize("elements", [10, 16_000, 17_000, 300_000])
def test_small_npy_files_read_and_large_ones_mapped_give_the_same_read_only_arrays(tmp_path, elements):
    """A file up to SMALL_READ_BYTES is read whole, a larger one mapped
    (either side of the bound): the same values and dtype, read-only, the
    array still known as that file's (a golden dump kept where it lies), and
    a truncated one refused either way."""
    from layerdiff.collector.dumps.readers import SMALL_READ_BYTES, npy_file_of

    v = np.random.default_rng(elements).standard_normal(elements).astype(np.float32)
    p = tmp_path / "t.npy"
    np.save(p, v)
    got = read_npy(p)
    assert got.dtype == v.dtype and np.array_equal(got, v)
    assert not got.flags.writeable
    with pytest.raises(ValueError):
        got[0] = 1.0
    assert npy_file_of(got) == p and npy_file_of(got[1:]) is None
    assert (p.stat().st_size <= SMALL_READ_BYTES) == (elements <= 16_000)
    data = p.read_bytes()
    p.write_bytes(data[:-4])
    with pytest.raises(LayerdiffError, match="truncated"):
        read_npy(p)
