"""Live capture: run an ONNX model on an onnxruntime execution provider with
every node output exposed, in the requested precision, and yield each node's
device-side tensor in execution order.

Precisions: ``fp32`` runs the model as given; ``fp16`` converts weights and
activations to float16 (inputs and outputs kept float32); ``int8`` inserts
static QDQ quantization calibrated on the given inputs, and reports for each
quantized tensor the value its consumers see (after quantize/dequantize);
``bf16``, ``tf32`` and ``fp8_e4m3fn``/``fp8_e5m2`` round as those devices
do, in an emulated FP32 build (layerdiff.collector.live.emulate).
With a device model (an optimized, quantized or vendor-converted export of the
same network) that file is run as it is, and every tensor it has is sent:
nodes it fused away simply never appear.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np

from layerdiff.collector.live.devices import resolve_provider
from layerdiff.collector.live.emulate import EMULATED, emulated
from layerdiff.collector.live.int8 import to_int8_qdq
from layerdiff.common.errors import LayerdiffError
from layerdiff.common.onnxgraph import (
    SharedMaking,
    TensorSite,
    WeightSplit,
    check_inputs,
    estimate_output_bytes,
    expose_only,
    graph_inputs,
    lean_session,
    load_model,
    plan_segments,
    tensor_sites,
)
from layerdiff.common.precision import NAMES
from layerdiff.common.precision import parse as parse_precision
from layerdiff.common.schema import ALLOWED_DTYPES, ROLE_INPUT, NodeRecord, check_dump_mode

if TYPE_CHECKING:
    import onnx
    import onnxruntime as ort
else:
    from layerdiff.common.lazy import onnx, ort

log = logging.getLogger(__name__)

PRECISIONS = NAMES


def to_fp16(model: onnx.ModelProto | WeightSplit, key: str = "") -> onnx.ModelProto:
    """The FP16 build of a model, as onnxruntime's converter makes it
    (inputs and outputs kept in their types), the same bytes seconds sooner
    on a transformer: the shape inference the converter would run is run on
    the graph without its weights' data, and the converter casts each weight
    with ``fp16_weight`` (a few passes) instead of its own dozen. ``key``
    (the model file's sha256) shares one build between those who ask for it
    at the same time (the embedded analyzer and collector): read it, never
    change it. ``model`` may be its ``WeightSplit`` (weights copied out once)."""
    return _BUILDS.get(key, lambda: _to_fp16(WeightSplit.of(model)))


# FP16 builds under way, shared by those who ask at the same time
_BUILDS = SharedMaking()


def _to_fp16(split: WeightSplit) -> onnx.ModelProto:
    from onnxruntime.transformers import float16

    light, held = split.parts()
    shaped = onnx.shape_inference.infer_shapes(light)
    for init in shaped.graph.initializer:
        if init.name in held:
            init.raw_data = held[init.name]
    # The converter's one numeric step, swapped for the few-pass cast of the
    # same result (tests compare the builds byte for byte); one build at a time.
    with _CAST_LOCK:
        slow, float16.convert_np_to_float16 = float16.convert_np_to_float16, fp16_weight
        try:
            return float16.convert_float_to_float16(shaped, keep_io_types=True, disable_shape_infer=True)
        finally:
            float16.convert_np_to_float16 = slow


_CAST_LOCK = threading.Lock()


def fp16_weight(w: np.ndarray, min_positive_val: float = 5.96e-08, max_finite_val: float = 65504.0) -> np.ndarray:
    """A float weight in FP16 as onnxruntime's converter stores it: a
    magnitude below ``min_positive_val`` becomes it, a finite one above
    ``max_finite_val`` becomes that; sign, zeros, Inf and NaN are kept."""
    w = np.asarray(w)
    with np.errstate(over="ignore", invalid="ignore"):
        h = w.astype(np.float16)
        if not w.size:
            return h
        # Usual weights need neither fix: no value flushed to zero (as many
        # non-zeros after the cast as before; counted on the bits, the sign
        # shifted out, as numpy's FP16 arithmetic is slow) and all within
        # FP16's range (a NaN fails the range test).
        flushed = np.count_nonzero(h.view(np.uint16) << 1) != np.count_nonzero(w)
        in_range = -max_finite_val <= w.min() and w.max() <= max_finite_val
        if flushed:
            tiny = (h == 0) & (w != 0)
            h[tiny] = np.copysign(np.asarray(min_positive_val, w.dtype), w[tiny]).astype(np.float16)
        if not in_range and not np.isfinite(h).all():     # overflowed to Inf (rare: the mask only then)
            huge = np.isinf(h) & np.isfinite(w)
            h[huge] = np.copysign(np.asarray(max_finite_val, w.dtype), w[huge]).astype(np.float16)
    return h


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

    def __init__(self, model_bytes: bytes | onnx.ModelProto, feeds: dict[str, np.ndarray], *, precision: str = "fp32",
                 device: str = "cpu", device_model_bytes: bytes | onnx.ModelProto | None = None,
                 model_name: str = "model.onnx", device_model_name: str = "device.onnx", model_key: str = "") -> None:
        """``model_key``: the model file's sha256, where known (see to_fp16)."""
        chosen = parse_precision(precision)
        precision = chosen.name if chosen is not None else "fp32"
        self.providers = resolve_provider(device)
        self.precision = precision
        ref = model_bytes if isinstance(model_bytes, onnx.ModelProto) else load_model(model_bytes, model_name)
        self.feeds = check_inputs(ref, feeds, "inputs")
        if device_model_bytes is not None and (isinstance(device_model_bytes, onnx.ModelProto) or device_model_bytes):
            # a parsed device model may be shared (onnxgraph.PARSED): read here, never changed
            self.model = device_model_bytes if isinstance(device_model_bytes, onnx.ModelProto) else \
                load_model(device_model_bytes, device_model_name)
            self.feeds = check_inputs(self.model, _by_position(ref, self.model, self.feeds), "inputs")
            self.original: set[str] | None = None     # send everything the device model has
            self.view: dict[str, str] = dequantized_views(self.model)
        else:
            self.original_sites = {s.tensor: s for s in tensor_sites(ref)}
            self.original = set(self.original_sites)
            if precision == "fp16":
                self.model = to_fp16(ref, model_key)
            elif precision == "int8":
                self.model = to_int8_qdq(ref, self.feeds)
            elif precision in EMULATED:
                self.model, rounded = emulated(ref, precision)
            else:
                self.model = ref
            self.view = dequantized_views(self.model)
            if precision in EMULATED:
                self.view.update(rounded)
            self._node_index = {n.name: i for i, n in enumerate(self.model.graph.node) if n.name}
        # The weights, taken out once for every session (each segment's, the
        # profiler's); the model keeps the graph only: one copy of them is held.
        self.weights = WeightSplit(self.model)
        self.model = self.weights.let_go()

    def _session(self, outputs: list[str]) -> ort.InferenceSession:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        # Without the arena every output returns to the system as soon as it
        # has been sent, instead of the whole run staying resident.
        so.enable_cpu_mem_arena = False
        # One run per session: packing the weights for repeated MatMuls
        # would cost more than it saves.
        so.add_session_config_entry("session.disable_prepacking", "1")
        try:
            return lean_session(self.weights, so, self.providers, edit=lambda m: expose_only(m, outputs))
        except Exception as e:
            raise LayerdiffError(f"onnxruntime cannot load the device model: {e}", field="device_model") from e

    def _as_original(self, site: TensorSite) -> TensorSite:
        """A converted model can hand an original tensor to a node of its own
        (FP16 conversion casts graph outputs back to FP32): attribute it to
        the original node, which the converted graph still holds."""
        orig = self.original_sites[site.tensor]
        if orig.node == site.node:
            return site
        index = self._node_index.get(orig.node)
        if index is None:
            return site
        return TensorSite(site.tensor, orig.node, orig.op_type, index, orig.output_index)

    def records(self, dump_mode: str = "output", nodes: set[str] | None = None) -> Iterator[NodeRecord]:
        """Every node's outputs (``dump_mode`` "output"), inputs ("input") or
        both ("all", inputs first), in execution order, for every node or the
        ``nodes`` named; computed segment by segment (see
        layerdiff.common.onnxgraph.plan_segments) so that only about one segment is
        resident at a time. A float output holding Inf/NaN that none of its
        inputs held is marked as an overflow, as the device's status register
        would flag it."""
        graph = self.model.graph
        sites = tensor_sites(self.model)
        if self.original is not None:
            sites = [self._as_original(s) for s in sites if s.tensor in self.original]
        if nodes is not None:
            sites = [s for s in sites if s.node in nodes or s.tensor in nodes]
        consts = {i.name: i for i in graph.initializer}
        producer = {t: i for i, n in enumerate(graph.node) for t in n.output}
        sizes = estimate_output_bytes(self.model, self.feeds)

        def fixed(t: str) -> np.ndarray | None:
            if t in consts:
                return self.weights.array(consts[t])
            return np.asarray(self.feeds[t]) if t in self.feeds else None

        def run_segment(names: list[str]) -> dict[str, np.ndarray]:
            sess = self._session(names)
            try:
                return dict(zip(names, (np.asarray(v) for v in sess.run(None, self.feeds))))
            except Exception as e:
                raise LayerdiffError(f"device run failed: {e}", field="inputs") from e

        records = node_records(sites, {s.node: list(graph.node[s.order].input) for s in sites}, dump_mode,
                               fixed=fixed, computed=producer.__contains__,
                               source=lambda t: self.view.get(t, t), order_key=lambda t: producer.get(t, -1),
                               plan=lambda names: plan_segments(names, sizes), run_segment=run_segment)
        stored = {"bf16": "bfloat16", "fp8_e4m3fn": "bfloat16", "fp8_e5m2": "bfloat16"}.get(self.precision, "")
        if not stored or self.original is None:
            return records
        return self._stored_as(records, stored)

    def _stored_as(self, records: Iterator[NodeRecord], dtype: str) -> Iterator[NodeRecord]:
        """An emulated build's float outputs are the values a device stores
        in ``dtype``: said so, as a dump of that device would."""
        rounded = set(self.view.values())
        for rec in records:
            if rec.array is not None and rec.array.dtype == np.float32 and self.view.get(rec.name, "") in rounded:
                rec.source_dtype = dtype
            yield rec


def node_records(sites: list[TensorSite], reads: dict[str, list[str]], dump_mode: str, *,
                 fixed: Callable[[str], np.ndarray | None], computed: Callable[[str], bool],
                 source: Callable[[str], str], order_key: Callable[[str], int],
                 plan: Callable[[list[str]], list[list[str]]],
                 run_segment: Callable[[list[str]], dict[str, np.ndarray]],
                 weight: Callable[[str], np.ndarray | None] = lambda t: None,
                 no_value: str = "the device run produced no value") -> Iterator[NodeRecord]:
    """The records of a device run, whatever runs it (onnxruntime, TensorFlow).

    ``sites``: the node outputs to consider, in execution order; ``reads``:
    node -> the tensors it reads; ``fixed(t)``: a value known without running
    (model inputs, embedded weights); ``computed(t)``: t is obtained by a
    run; ``source(t)``: the tensor that carries output t's device value;
    ``plan``/``run_segment``: the runs, one segment of tensors at a time;
    ``weight(t)``: a weight's value, only to tell whether it is finite.
    Each value is kept until its last use, so about one segment is resident.
    """
    dump_mode = check_dump_mode(dump_mode)
    want_in, want_out = dump_mode in ("input", "all"), dump_mode in ("output", "all")
    # Tensors to compute, each with its number of uses: what is sent as an
    # output, and what the sent nodes read.
    uses: dict[str, int] = {}
    if want_out:
        for s in sites:
            uses[source(s.tensor)] = uses.get(source(s.tensor), 0) + 1
    if want_in:
        for node in dict.fromkeys(s.node for s in sites):
            for t in reads.get(node, []):
                if t and computed(t):
                    uses[t] = uses.get(t, 0) + 1
    names = sorted(uses, key=order_key)
    segments = plan(names) if names else []
    segment_of = {n: i for i, seg in enumerate(segments) for n in seg}
    values: dict[str, np.ndarray] = {}
    finite: dict[str, bool] = {}
    done = 0

    def ensure(t: str) -> None:
        nonlocal done
        while t in segment_of and done <= segment_of[t]:
            got = run_segment(segments[done])
            for n, v in got.items():
                finite[n] = _all_finite(v)
            values.update(got)
            done += 1

    def take(t: str) -> np.ndarray | None:
        """The value of t for one use; forgotten after its last use."""
        v = fixed(t)
        if v is not None:
            return v
        ensure(t)
        left = uses.get(t, 0) - 1
        uses[t] = left
        return values.pop(t, None) if left <= 0 else values.get(t)

    def known_finite(t: str) -> bool:
        """False when t held Inf/NaN, or when its value was never seen
        (a node is named as the origin only when it provably is)."""
        if t not in finite:
            v = fixed(t)
            v = weight(t) if v is None else v
            if v is not None:
                finite[t] = _all_finite(np.asarray(v))
        return finite.get(t, False)

    done_inputs: set[str] = set()
    for s in sites:
        if want_in and s.node not in done_inputs:
            done_inputs.add(s.node)
            for k, t in enumerate(reads.get(s.node, [])):
                if not t:
                    continue
                arr = take(t)
                if arr is None:
                    yield NodeRecord.error(s.node, f"the device run produced no value for input {k} ({t!r})",
                                           s.op_type, s.order, s.node, role=ROLE_INPUT, slot=k)
                elif _not_numeric(arr):
                    yield NodeRecord.error(s.node, _not_numeric(arr), s.op_type, s.order, s.node, role=ROLE_INPUT,
                                           slot=k)
                else:
                    yield NodeRecord(name=s.node, op_type=s.op_type, order=s.order, array=np.asarray(arr),
                                     node=s.node, role=ROLE_INPUT, slot=k)
        if not want_out:
            continue
        src = source(s.tensor)
        arr = take(src)
        if arr is None:
            yield NodeRecord.error(s.tensor, no_value, s.op_type, s.order, s.node, slot=s.output_index)
            continue
        arr = np.asarray(arr)
        if _not_numeric(arr):
            yield NodeRecord.error(s.tensor, _not_numeric(arr), s.op_type, s.order, s.node, slot=s.output_index)
            continue
        rec = NodeRecord(name=s.tensor, op_type=s.op_type, order=s.order, array=arr, node=s.node,
                         slot=s.output_index)
        # A float output holding Inf/NaN that none of its inputs held is
        # flagged, as the device's status register would: Inf as an
        # overflow, NaN alone as an invalid operation (what it is).
        if not finite.get(src, True) and all(known_finite(t) for t in reads.get(s.node, []) if t):
            inf = int(np.count_nonzero(np.isinf(arr)))
            nan = int(np.count_nonzero(np.isnan(arr)))
            if inf:
                rec.overflow = (f"floating-point overflow: {inf} of {arr.size} values are Inf"
                                + (f" (and {nan} NaN)" if nan else "") + " while every input of the node is finite")
            else:
                rec.overflow = (f"invalid operation: {nan} of {arr.size} values are NaN while every input of the "
                                "node is finite")
        yield rec


def _all_finite(arr: np.ndarray) -> bool:
    if arr.dtype.kind != "f" or arr.size == 0:
        return True
    # The sum is NaN/Inf exactly when an element is, or when finite
    # values overflow it; only then is the exact elementwise test paid.
    with np.errstate(all="ignore"):
        if np.isfinite(arr.sum(dtype=np.float64)):
            return True
    return bool(np.isfinite(arr).all())


def _by_position(ref: onnx.ModelProto, device: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict:
    """The reference's feeds under the device model's input names: a
    converter that renamed the graph inputs keeps their order, so they are
    bound by position (and then checked for dtype and shape)."""
    ref_names = [d.name for d in graph_inputs(ref)]
    dev_names = [d.name for d in graph_inputs(device)]
    if set(dev_names) == set(feeds) or len(dev_names) != len(ref_names) or set(ref_names) != set(feeds):
        return feeds
    return {dev: feeds[r] for r, dev in zip(ref_names, dev_names)}


def _not_numeric(arr) -> str:
    """Why a value the run produced cannot be compared ('' when it can): a
    string or other object tensor has no numbers to compare."""
    dt = np.asarray(arr).dtype
    if dt.hasobject or dt.name not in ALLOWED_DTYPES:
        return f"holds {dt.name if not dt.hasobject else 'string (object)'} values, not numbers: not compared"
    return ""
