"""Bad input gets a gRPC status naming the file / node / field, and the
services stay up."""
from __future__ import annotations

import io

import grpc
import numpy as np
import pytest

from layerdiff.client.analyzer_client import AnalyzerClient
from layerdiff.collector.service import CollectorClient
from layerdiff.common.net import channel
from layerdiff.v1 import layerdiff_pb2 as pb
from layerdiff.v1 import layerdiff_pb2_grpc as pbg


def _npz(**arrays) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


@pytest.fixture
def client(services):
    c = AnalyzerClient(services[1].address)
    yield c
    c.close()


def _submit(client, services, model: bytes, inputs: bytes, **kw):
    spec = pb.JobSpec(model_artifact=client.upload(model, kw.pop("model_name", "model.onnx")),
                      inputs_artifact=client.upload(inputs, "inputs.npz"), collector=services[0].address, **kw)
    return client.submit(spec)


def _status(fn):
    with pytest.raises(grpc.RpcError) as ei:
        fn()
    return ei.value.code(), ei.value.details()


GOOD = np.zeros((1, 3, 16, 16), np.float32)


def test_not_onnx(client, services, cnn_files):
    code, msg = _status(lambda: _submit(client, services, b"this is a text file\n", _npz(input=GOOD),
                                        model_name="notes.txt"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "notes.txt" in msg and "not an ONNX model" in msg


@pytest.mark.parametrize("inputs, needle", [
    (dict(image=GOOD), "'image' is not an input of the model"),
    (dict(), "model input 'input' is missing"),
    (dict(input=GOOD.astype(np.float64)), "dtype float64, the model expects float32"),
    (dict(input=np.zeros((1, 3, 8, 8), np.float32)), "shape (1, 3, 8, 8), the model expects (1, 3, 16, 16)"),
    (dict(input=np.zeros((3, 16, 16), np.float32)), "expects rank 4"),
])
def test_wrong_inputs(client, services, cnn_files, inputs, needle):
    model = cnn_files[0].read_bytes()
    code, msg = _status(lambda: _submit(client, services, model, _npz(**inputs)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in msg and "inputs.npz" in msg


def test_pickled_inputs_are_refused(client, services, cnn_files):
    buf = io.BytesIO()
    np.savez(buf, input=np.array([object()], dtype=object))
    code, msg = _status(lambda: _submit(client, services, cnn_files[0].read_bytes(), buf.getvalue()))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "unpickling" in msg


def test_unknown_node_in_map_node_dict(client, services, cnn_files):
    opts = pb.CompareOptions(map_node_dict={"conv9": "npu_conv9"})
    code, msg = _status(lambda: _submit(client, services, cnn_files[0].read_bytes(), _npz(input=GOOD),
                                        options=opts))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "'conv9'" in msg and "map_node_dict" in msg


def test_bad_op_config(client, services, cnn_files):
    opts = pb.CompareOptions(op_config_csv="op_name,atol,rtol\nconv1,abc,NA\n")
    code, msg = _status(lambda: _submit(client, services, cnn_files[0].read_bytes(), _npz(input=GOOD),
                                        options=opts))
    assert "op_config.csv" in msg and "'abc'" in msg and "conv1" in msg


def test_missing_dump_directory_fails_the_job_clearly(client, services, cnn_files):
    job = _submit(client, services, cnn_files[0].read_bytes(), _npz(input=GOOD), dump_path="/nonexistent/dump")
    events = list(client.watch(job, timeout=60))
    assert events[-1].state == pb.FAILED
    assert "/nonexistent/dump" in events[-1].message and "dump_path" in events[-1].message


def test_truncated_upload_is_refused_and_servers_stay_up(services):
    stub = pbg.AnalyzerStub(channel(services[1].address))

    def chunks():
        yield pb.ArtifactChunk(name="model.onnx", total_size=1000, data=b"x" * 10)

    code, msg = _status(lambda: stub.PutArtifact(chunks(), timeout=10))
    assert "model.onnx" in msg and "truncated" in msg
    assert stub.Health(pb.HealthRequest(), timeout=10).status == "SERVING"
    assert CollectorClient(services[0].address).health().status == "SERVING"


def test_unknown_precision_and_device(client, services, cnn_files):
    model = cnn_files[0].read_bytes()
    code, msg = _status(lambda: _submit(client, services, model, _npz(input=GOOD), precision="int3"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "'precision'" in msg and "int3" in msg
    job = _submit(client, services, model, _npz(input=GOOD), device="warp-drive")
    ev = list(client.watch(job, timeout=60))[-1]
    assert ev.state == pb.FAILED and "warp-drive" in ev.message and "available" in ev.message


def test_an_input_size_written_as_minus_one_takes_any_size():
    """Some exporters write a dynamic size as -1: any size fits there; the
    rank and the fixed sizes are still checked, with the input named."""
    from onnx import TensorProto, helper

    from layerdiff.common.errors import LayerdiffError
    from layerdiff.common.onnxgraph import check_inputs

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8])
    x.type.tensor_type.shape.dim[2].dim_value = -1
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    assert m.graph.input[0].type.tensor_type.shape.dim[2].dim_value == -1
    for n in (1, 8, 77):
        assert check_inputs(m, {"x": np.zeros((1, 3, n), np.float32)}, "in.npz")["x"].shape == (1, 3, n)
    with pytest.raises(LayerdiffError, match="'x' has shape \\(1, 4, 8\\)"):
        check_inputs(m, {"x": np.zeros((1, 4, 8), np.float32)}, "in.npz")
    with pytest.raises(LayerdiffError, match="rank 3"):
        check_inputs(m, {"x": np.zeros((3, 8), np.float32)}, "in.npz")
