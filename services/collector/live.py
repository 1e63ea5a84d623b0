"""Live capture: run an ONNX model on an onnxruntime execution provider with
every node output exposed, in the requested precision, and yield each node's
device-side tensor in execution order.

Precisions: ``fp32`` runs the model as given; ``fp16`` converts weights and
activations to float16 (inputs and outputs kept float32); ``int8`` inserts
static QDQ quantization calibrated on the given inputs, and reports for each
quantized tensor the value its consumers see (after quantize/dequantize).
With a device model (an optimized, quantized or vendor-converted export of the
same network) that file is run as it is, and every tensor it has is sent:
nodes it fused away simply never appear.
"""
from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np
import onnx
import onnxruntime as ort

from layerdiff.collector.devices import resolve_provider
from layerdiff.errors import LayerdiffError
from layerdiff.onnxgraph import (check_inputs, estimate_output_bytes, expose_only, load_model, plan_segments,
                                 tensor_sites)
from layerdiff.schema import NodeRecord

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "fp16", "int8")


def to_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    from onnxruntime.transformers.float16 import convert_float_to_float16

    return convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=False)


class _Calibration:
    """One-shot calibration reader over the given feeds."""

    def __init__(self, feeds: dict[str, np.ndarray]) -> None:
        self._items = [feeds]

    def get_next(self):
        return self._items.pop() if self._items else None


def to_int8_qdq(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> onnx.ModelProto:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(_Calibration, CalibrationDataReader):
        pass

    with tempfile.TemporaryDirectory(prefix="layerdiff-int8-") as tmp:
        src, dst = Path(tmp, "model.onnx"), Path(tmp, "model.int8.onnx")
        onnx.save_model(model, str(src))
        logging.getLogger().setLevel(logging.ERROR)  # the quantizer warns about pre-processing
        quantize_static(str(src), str(dst), Reader(feeds), quant_format=QuantFormat.QDQ,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
        return onnx.load_model(str(dst))


def dequantized_views(model: onnx.ModelProto) -> dict[str, str]:
    """tensor -> the DequantizeLinear output that carries its quantized value."""
    q_of: dict[str, str] = {}
    for n in model.graph.node:
        if n.op_type == "QuantizeLinear" and n.input:
            q_of[n.output[0]] = n.input[0]
    out: dict[str, str] = {}
    for n in model.graph.node:
        if n.op_type == "DequantizeLinear" and n.input and n.input[0] in q_of:
            out.setdefault(q_of[n.input[0]], n.output[0])
    return out


class LiveRunner:
    """Builds the device model and runs it once, yielding NodeRecords."""

    def __init__(self, model_bytes: bytes, feeds: dict[str, np.ndarray], *, precision: str = "fp32",
                 device: str = "cpu", device_model_bytes: bytes | None = None,
                 model_name: str = "model.onnx", device_model_name: str = "device.onnx") -> None:
        precision = (precision or "fp32").lower()
        if precision not in PRECISIONS:
            raise LayerdiffError(f"unknown precision {precision!r} (one of {', '.join(PRECISIONS)})",
                                 field="precision")
        self.providers = resolve_provider(device)
        self.precision = precision
        ref = load_model(model_bytes, model_name)
        self.feeds = check_inputs(ref, feeds, "inputs")
        if device_model_bytes:
            self.model = load_model(device_model_bytes, device_model_name)
            self.feeds = check_inputs(self.model, feeds, "inputs")
            self.original: set[str] | None = None     # send everything the device model has
            self.view: dict[str, str] = dequantized_views(self.model)
        else:
            self.original = {s.tensor for s in tensor_sites(ref)}
            if precision == "fp16":
                self.model = to_fp16(ref)
            elif precision == "int8":
                self.model = to_int8_qdq(ref, self.feeds)
            else:
                self.model = ref
            self.view = dequantized_views(self.model)

    def _session(self, outputs: list[str]) -> ort.InferenceSession:
        model = onnx.ModelProto()
        model.CopyFrom(self.model)
        expose_only(model, outputs)
        so = ort.SessionOptions()
        so.log_severity_level = 3
        # Without the arena every output returns to the system as soon as it
        # has been sent, instead of the whole run staying resident.
        so.enable_cpu_mem_arena = False
        try:
            return ort.InferenceSession(model.SerializeToString(), so, providers=self.providers)
        except Exception as e:
            raise LayerdiffError(f"onnxruntime cannot load the device model: {e}", field="device_model") from e

    def records(self) -> Iterator[NodeRecord]:
        """Every node output in execution order, computed segment by segment
        (see layerdiff.onnxgraph.plan_segments) so that only about one segment
        is resident at a time."""
        sites = tensor_sites(self.model)
        if self.original is not None:
            sites = [s for s in sites if s.tensor in self.original]
        source = {s.tensor: self.view.get(s.tensor, s.tensor) for s in sites}
        names = list(dict.fromkeys(source[s.tensor] for s in sites))
        segments = plan_segments(names, estimate_output_bytes(self.model, self.feeds))
        segment_of = {n: i for i, seg in enumerate(segments) for n in seg}
        values: dict[str, np.ndarray] = {}
        computed = 0
        for s in sites:
            src = source[s.tensor]
            while computed <= segment_of[src]:
                sess = self._session(segments[computed])
                try:
                    out = sess.run(None, self.feeds)
                except Exception as e:
                    raise LayerdiffError(f"device run failed: {e}", field="inputs") from e
                values.update(zip(segments[computed], out))
                del sess, out
                computed += 1
            arr = values.pop(src, None)
            if arr is None:
                yield NodeRecord.error(s.tensor, "the device run produced no value", s.op_type, s.order, s.node)
                continue
            yield NodeRecord(name=s.tensor, op_type=s.op_type, order=s.order, array=np.asarray(arr), node=s.node)
