"""The INT8 build of a model: onnxruntime's static QDQ quantization
(``quantize_static``: QUInt8 activations, QInt8 weights, per tensor,
min/max calibration), calibrated on the job's own inputs.

``quantize_static`` calibrates through files: it saves the model, reloads
it with shape inference, saves a copy with a ReduceMin and a ReduceMax
added after every tensor it calibrates, builds a session of that copy and
runs it, then quantizes and saves the result for the caller to load: on a
90 MB transformer 2.9 s, most of a small model's job. With one sample, the
range it calibrates for a tensor is that tensor's minimum and maximum in
an FP32 run of the model (a session without graph optimizations, as its
calibration session is). So here the same shape inference runs in memory,
one FP32 run gives those minima and maxima, and onnxruntime's own
quantizer is handed them: the same build (the tests hold it equal to
``quantize_static``'s, node for node and byte for byte), without the
round trips. Where anything here does not go as planned,
``quantize_static`` itself runs; a calibrated tensor holding NaN or Inf,
on which ``quantize_static`` fails ("scale issue"), is named in a one-line
error.
"""
from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from layerdiff.common.errors import LayerdiffError
from layerdiff.common.onnxgraph import WeightSplit, lean_session

if TYPE_CHECKING:
    import onnx
else:
    from layerdiff.common.lazy import onnx

log = logging.getLogger(__name__)


class _Calibration:
    """One-shot calibration reader over the given feeds."""

    def __init__(self, feeds: dict[str, np.ndarray]) -> None:
        self._items = [feeds]

    def get_next(self):
        return self._items.pop() if self._items else None


def to_int8_qdq(model: onnx.ModelProto | WeightSplit, feeds: dict[str, np.ndarray]) -> onnx.ModelProto:
    """The INT8 QDQ build of ``model`` (or of its ``WeightSplit``) calibrated
    on ``feeds``; ``model`` is read, never changed."""
    logging.getLogger().setLevel(logging.ERROR)  # the quantizer warns about pre-processing
    try:
        built = _calibrated_in_memory(model, feeds)
    except LayerdiffError:
        raise
    except Exception as e:      # onnxruntime's own way below says what is wrong, if anything is
        log.debug("INT8 build in memory did not go through (%s: %s): quantize_static", type(e).__name__, e)
        built = None
    return built if built is not None else _quantize_static(WeightSplit.of(model).model, feeds)


def _options():
    from onnxruntime.quantization import QuantFormat, QuantType

    return dict(quant_format=QuantFormat.QDQ, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)


def _quantize_static(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> onnx.ModelProto:
    from onnxruntime.quantization import CalibrationDataReader, quantize_static

    class Reader(_Calibration, CalibrationDataReader):
        pass

    with tempfile.TemporaryDirectory(prefix="layerdiff-int8-") as tmp:
        src, dst = Path(tmp, "model.onnx"), Path(tmp, "model.int8.onnx")
        onnx.save_model(model, str(src))
        quantize_static(str(src), str(dst), Reader(feeds), **_options())
        return onnx.load_model(str(dst))


def _op_types() -> list[str]:
    """What ``quantize_static`` quantizes (and calibrates) by default."""
    from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

    return list(set(QLinearOpsRegistry) | set(QDQRegistry))


def _calibrated_tensors(model: onnx.ModelProto, op_types: list[str]) -> list[str]:
    """The tensors the min/max calibrator would calibrate, chosen by its own
    rule (float inputs and outputs of nodes of those types, weights left
    out), in a stable order."""
    from types import SimpleNamespace

    from onnxruntime.quantization.calibrate import CalibraterBase

    chosen, _ = CalibraterBase.select_tensors_to_calibrate(SimpleNamespace(op_types_to_calibrate=op_types), model)
    return sorted(chosen)


def _calibrated_in_memory(model: onnx.ModelProto | WeightSplit, feeds: dict[str, np.ndarray]) -> onnx.ModelProto | None:
    from onnxruntime.quantization.calibrate import CalibrationMethod, TensorsData
    from onnxruntime.quantization.qdq_quantizer import QDQQuantizer
    from onnxruntime.quantization.quant_utils import add_infer_metadata, model_has_infer_metadata
    from onnxruntime.quantization.quantize import check_static_quant_arguments, update_opset_version

    opts = _options()
    split = WeightSplit.of(model)
    light, held = split.parts()
    # shape inference on the graph without its weights' data (the same
    # result: data propagation reads the small integer initializers only)
    inferred = onnx.shape_inference.infer_shapes(light)
    for init in inferred.graph.initializer:
        if init.name in held:
            init.raw_data = held[init.name]
    add_infer_metadata(inferred)
    if not model_has_infer_metadata(inferred):
        return None
    updated = update_opset_version(inferred, opts["weight_type"], opts["activation_type"])
    if updated is not inferred:     # an opset the quantizer raises first: calibrated as raised, as it does
        inferred = updated
        split = WeightSplit(updated)
    op_types = _op_types()
    tensors = _calibrated_tensors(inferred, op_types)
    ranges: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    if tensors:
        values = _fp32_values(split, feeds, tensors)
        for t in tensors:
            v = values[t]
            if v.dtype != np.float32:
                return None
            if not np.isfinite(v).all():
                # quantize_static fails on it too ("scale issue"): no INT8 range holds NaN or Inf
                bad = "NaN" if np.isnan(v).any() else "Inf"
                raise LayerdiffError(f"holds {bad} in the FP32 run on these inputs, which no INT8 range can "
                                     "hold: the model cannot be built in INT8 for them", node=t, field="precision")
            # an empty tensor (a Resize's unused roi) gets the reductions' identities, as
            # the calibrator's ReduceMin and ReduceMax give it
            lo, hi = (v.min(), v.max()) if v.size else (np.inf, -np.inf)
            ranges[t] = (np.array([lo], np.float32), np.array([hi], np.float32))
    check_static_quant_arguments(opts["quant_format"], opts["activation_type"], opts["weight_type"])
    quantizer = QDQQuantizer(inferred, False, False, opts["weight_type"], opts["activation_type"],
                             TensorsData(CalibrationMethod.MinMax, ranges), [], [], op_types, {})
    quantizer.quantize_model()
    quantizer.model.topological_sort()      # as its save does before writing
    return quantizer.model.model


def _fp32_values(split: WeightSplit, feeds: dict[str, np.ndarray], tensors: list[str]) -> dict[str, np.ndarray]:
    """The tensors' values in one FP32 run without graph optimizations (as
    the calibrator's session runs)."""
    import onnxruntime as ort

    def expose(m: onnx.ModelProto) -> None:
        del m.graph.output[:]
        m.graph.output.extend(onnx.ValueInfoProto(name=t) for t in tensors)

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    sess = lean_session(split, so, ["CPUExecutionProvider"], edit=expose)
    return dict(zip(tensors, sess.run(tensors, feeds)))
