"""The INT8 build calibrated in memory is onnxruntime's quantize_static
build, byte for byte, on a transformer and on the packaged OCR models; where
it cannot be (a calibrated tensor holding NaN), quantize_static itself runs."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_impact import FEEDS, encoder

from layerdiff.collector.live import int8
from layerdiff.common.errors import LayerdiffError


def _ocr(name: str, size: tuple[int, ...]) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    from layerdiff.client.demo import packaged_model

    model = onnx.load(str(packaged_model().parent / f"{name}.onnx"))
    x = model.graph.input[0]
    shape = [d.dim_value if d.dim_value > 0 else size[k] for k, d in enumerate(x.type.tensor_type.shape.dim)]
    return model, {x.name: np.random.default_rng(0).standard_normal(shape).astype(np.float32)}


@pytest.mark.parametrize("which, size", [("encoder", ()), ("ch_PP-OCRv4_det_infer", (1, 3, 64, 64)),
                                         ("ch_ppocr_mobile_v2.0_cls_infer", (1, 3, 48, 192))])
def test_the_build_in_memory_is_quantize_statics_byte_for_byte(which, size):
    model, feeds = (encoder(), FEEDS) if which == "encoder" else _ocr(which, size)
    before = model.SerializeToString()
    fast = int8._calibrated_in_memory(model, feeds)
    assert fast is not None, "the build in memory took this model"
    assert model.SerializeToString() == before, "the caller's model is left as it was"
    slow = int8._quantize_static(model, feeds)
    assert sum(n.op_type == "QuantizeLinear" for n in fast.graph.node) > 10
    assert fast.SerializeToString() == slow.SerializeToString()
    assert int8.to_int8_qdq(model, feeds).SerializeToString() == slow.SerializeToString()


def test_a_tensor_holding_nan_is_named_in_one_line():
    """Log of a negative input is NaN, which no INT8 range holds
    (quantize_static fails on it with an assertion): the error names the
    tensor."""
    w = numpy_helper.from_array(np.random.default_rng(1).standard_normal((8, 4)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Log", ["x"], ["l"], name="log"), helper.make_node("MatMul", ["l", "w"], ["y"], name="mm")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], initializer=[w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"x": np.array([[-1.0] + [2.0] * 7, [1.0] * 8], np.float32)}
    with pytest.raises(LayerdiffError) as e:
        int8.to_int8_qdq(model, feeds)
    assert "'l'" in str(e.value) and "NaN" in str(e.value) and "\n" not in str(e.value)
    feeds["x"] = np.abs(feeds["x"])     # the same model on inputs it can take: built
    assert any(n.op_type == "QuantizeLinear" for n in int8.to_int8_qdq(model, feeds).graph.node)
