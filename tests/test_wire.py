"""The tensor stream on a real gRPC server: chunking, re-joining, validation."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from layerdiff.collector.dumpdir import write_dump
from layerdiff.collector.service import CollectorClient, CollectorServer
from layerdiff.errors import LayerdiffError
from layerdiff.net import channel
from layerdiff.schema import (TENSOR_SCHEMA, NodeRecord, TensorAssembler, encode_records, frame, unframe)
from layerdiff.v1 import layerdiff_pb2 as pb


def _capture(address, path, chunk=0):
    client = CollectorClient(channel(address))
    asm = TensorAssembler()
    out, messages = [], 0
    for msg in client.capture(pb.CaptureRequest(job_id="t", dump=pb.DumpSource(path=str(path)),
                                                max_chunk_bytes=chunk), timeout=120):
        messages += 1
        assert len(msg) <= 8 * 1024 * 1024 + 4096
        out.extend(asm.feed(unframe(msg)))
    out.extend(asm.finish())
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


def test_generated_stubs_read_the_hand_framed_messages():
    msg = next(encode_records([NodeRecord("a", array=np.arange(6, dtype=np.int32).reshape(2, 3))]))
    batch = pa.ipc.read_record_batch(pa.py_buffer(pb.TensorBatch.FromString(msg).arrow_ipc), TENSOR_SCHEMA)
    assert batch.column("name").to_pylist() == ["a"] and batch.column("shape").to_pylist() == [[2, 3]]


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
    (dict(offset=8), "does not continue the tensor"),
    (dict(data=b"\0" * 20), "chunks exceed total_bytes"),
])
def test_lying_rows_become_node_errors(over, needle):
    asm = TensorAssembler()
    out = asm.feed(unframe(frame(_batch(**over).serialize())))
    assert len(out) == 1 and out[0].status == "error" and needle in out[0].message
    assert "'n'" in out[0].message
    # the next node still arrives
    good = asm.feed(unframe(frame(_batch(name="m").serialize())))
    assert good[0].status == "ok" and good[0].array.shape == (2, 2)


def test_cut_stream_reports_the_incomplete_tensor():
    asm = TensorAssembler()
    asm.feed(unframe(frame(_batch(data=b"\0" * 8).serialize())))
    out = asm.finish()
    assert out[0].status == "error" and "8 of 16 bytes" in out[0].message


@pytest.mark.parametrize("msg", [b"", b"\x12\x00", b"\x0a\x05abc", b"\x0a\x03abc"])
def test_malformed_frames_are_refused(msg):
    with pytest.raises(LayerdiffError):
        unframe(msg)
