"""The tensor stream on a real gRPC server: chunking, re-joining, validation."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layerdiff.collector.dumps.directory import write_dump
from layerdiff.collector.service import CollectorClient, CollectorServer
from layerdiff.common.schema import TENSOR_SCHEMA, NodeRecord, TensorAssembler
from layerdiff.v1 import layerdiff_pb2 as pb


def _capture(address, path, chunk=0):
    client = CollectorClient(address)
    asm = TensorAssembler()
    out, messages = [], 0
    for msg in client.capture(pb.CaptureRequest(job_id="t", dump=pb.DumpSource(path=str(path)),
                                                max_chunk_bytes=chunk), timeout=120):
        messages += 1
        assert msg.data.nbytes <= 2 * 1024 * 1024 + 64 * 1024   # bounded messages
        out.extend(asm.feed(msg.data))
    out.extend(asm.finish())
    client.close()
    return out, messages


def test_tensor_over_64_mib_crosses_bit_exact(tmp_path):
    rng = np.random.default_rng(3)
    big = rng.standard_normal(17 * 1024 * 1024 + 123).astype(np.float32)   # 68 MiB + 492 bytes
    big[::1001] = np.nan  # NaN payloads must survive too
    small = [rng.standard_normal((2, 3)).astype(np.float16) for _ in range(50)]
    recs = [NodeRecord("big/tensor", "Conv", 0, big)] + [NodeRecord(f"s{i}", "Relu", i + 1, a)
                                                         for i, a in enumerate(small)]
    recs.append(NodeRecord("scalar", "Constant", 99, np.array(2.5, np.float64)))
    recs.append(NodeRecord("empty", "Slice", 100, np.zeros((0, 4), np.int64)))
    dump = write_dump(tmp_path / "dump", recs)
    with CollectorServer() as server:
        got, messages = _capture(server.address, dump)
    assert [r.name for r in got] == [r.name for r in recs]
    assert got[0].array.tobytes() == big.tobytes()      # bit-exact, NaN payloads included
    assert got[-2].array.shape == () and got[-2].array.dtype == np.float64
    assert got[-1].array.shape == (0, 4)
    for r, a in zip(got[1:51], small):
        assert r.array.dtype == np.float16 and np.array_equal(r.array, a)
    assert messages >= 68 // 2        # split into ~2 MiB messages
    assert messages < 68 // 2 + 5     # small tensors share a batch


def test_upload_health_and_refusals_over_flight(tmp_path):
    with CollectorServer() as server:
        client = CollectorClient(server.address)
        assert client.health().status == "SERVING"
        data = np.random.default_rng(0).bytes(5 * 1024 * 1024 + 7)
        art = client.upload(data, "model.onnx")
        assert (server.flight.store.path(art)).read_bytes() == data
        with pytest.raises(Exception) as ei:
            list(client.capture(pb.CaptureRequest(job_id="t", dump=pb.DumpSource(path=str(tmp_path / "nope")))))
        assert "does not exist on the collector host" in str(ei.value) and "dump_path" in str(ei.value)
        with pytest.raises(Exception) as ei:
            list(client.capture(pb.CaptureRequest(job_id="t", live=pb.LiveSource(model_artifact=art,
                                                                                 inputs_artifact=art))))
        assert "'model.onnx'" in str(ei.value) and "not an .npz or .npy file" in str(ei.value)
        assert client.health().status == "SERVING"
        client.close()


def _batch(**over):
    row = dict(name="n", op_type="Conv", order=0, dtype="float32", shape=[2, 2], total_bytes=16, offset=0,
               data=b"\0" * 16, status="ok", message="", node="n")
    row.update(over)
    return pa.RecordBatch.from_pylist([row], schema=TENSOR_SCHEMA)


@pytest.mark.parametrize("over, needle", [
    (dict(dtype="object"), "dtype 'object' is not allowed"),
    (dict(shape=[2, -2]), "negative dimension"),
    (dict(total_bytes=12), "is 16 bytes, total_bytes says 12"),
    (dict(shape=[10**6, 10**6], total_bytes=4 * 10**12), "exceeds the tensor limit"),
    (dict(shape=[0, 10**10, 10**10], total_bytes=0), "exceeds the tensor limit"),   # empty, yet unaddressable
    (dict(offset=8), "does not continue the tensor"),
    (dict(data=b"\0" * 20), "chunks exceed total_bytes"),
])
def test_lying_rows_become_node_errors(over, needle):
    asm = TensorAssembler()
    out = asm.feed(_batch(**over))
    assert len(out) == 1 and out[0].status == "error" and needle in out[0].message
    assert "'n'" in out[0].message
    # the next node still arrives
    good = asm.feed(_batch(name="m"))
    assert good[0].status == "ok" and good[0].array.shape == (2, 2)


def test_cut_stream_reports_the_incomplete_tensor():
    asm = TensorAssembler()
    asm.feed(_batch(data=b"\0" * 8))
    out = asm.finish()
    assert out[0].status == "error" and "8 of 16 bytes" in out[0].message


# ------------------------------------------------------------ Arrow columns

_VALUES = {
    "float64": st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)),
    "int64": st.one_of(st.none(), st.integers(-2**63, 2**63 - 1)),
    "int32": st.one_of(st.none(), st.integers(-2**31, 2**31 - 1)),
    "bool": st.one_of(st.none(), st.booleans()),
    "string": st.one_of(st.none(), st.text(max_size=8)),
    "list<int64>": st.one_of(st.none(), st.lists(st.integers(-2**63, 2**63 - 1), max_size=4)),
    "list<string>": st.one_of(st.none(), st.lists(st.text(max_size=4), max_size=3)),
}
_TYPES = {"float64": pa.float64(), "int64": pa.int64(), "int32": pa.int32(), "bool": pa.bool_(), "string": pa.string(),
          "list<int64>": pa.list_(pa.int64()), "list<string>": pa.list_(pa.string())}


@settings(max_examples=60, deadline=None)
@given(data=st.data(), kind=st.sampled_from(sorted(_TYPES)))
def test_columns_built_from_buffers_are_what_pyarrow_builds(data, kind):
    """schema.column (no pandas probe) gives pa.array's array: values,
    nulls, NaN kept a value, nested lists."""
    from layerdiff.common.schema import column

    values = data.draw(st.lists(_VALUES[kind], max_size=12))
    mine, ref = column(values, _TYPES[kind]), pa.array(values, _TYPES[kind])
    mine.validate(full=True)
    assert mine.type == ref.type and len(mine) == len(ref) and mine.null_count == ref.null_count
    assert mine.equals(ref) or all(a == b or (a != a and b != b) for a, b in zip(mine.to_pylist(), ref.to_pylist()))


@pytest.mark.parametrize("values", [["conv1", None, "", "p2o.Add.10"] * 3, ["a", "é", None, "名前", "b"],
                                    ["x", 3, None], [None, None], []])
def test_string_columns_ascii_or_not_are_what_pyarrow_builds(values):
    """ASCII names (a byte a character) take one join; any other text, or
    a value that is not a string, is encoded value by value: the same array."""
    from layerdiff.common.schema import column

    mine = column(values, pa.string())
    mine.validate(full=True)
    assert mine.equals(pa.array([v if v is None else str(v) for v in values], pa.string()))


def test_sending_tensors_and_writing_report_tables_never_import_pandas(tmp_path):
    """pa.array imports pandas where it is installed (a third of a second
    and tens of MB in every process): batches on the wire, heartbeats and a
    report's tables are built without it."""
    import subprocess
    import sys

    script = f"""
import sys
import numpy as np
from layerdiff.common.schema import TENSOR_SCHEMA, NodeRecord, RecordEncoder, empty_batch, REPORT_TABLES
from layerdiff.common.perfschema import PerfEncoder, PerfRecord
enc = RecordEncoder(1 << 16)
batches = enc.add(NodeRecord(name="a", array=np.arange(40000, dtype=np.float32))) + [enc.flush()]
empty_batch(TENSOR_SCHEMA)
perf = PerfEncoder()
perf.add(PerfRecord(name="a", op_type="Conv", counters={{"c": 1}}, extra={{"x": "y"}}))
perf.flush()
import pyarrow.parquet as pq
from layerdiff.analyzer.report.tables import _table
name, schema = REPORT_TABLES["alignment"]
pq.write_table(_table([{{"reference_tensor": "r", "device_tensor": None, "method": "name", "confidence": 1.0,
                         "note": ""}}], schema), {str(tmp_path)!r} + "/" + name)
print("pandas" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
