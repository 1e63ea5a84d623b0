"""Why a node fails: a verdict for every failing node, with its evidence.

- **computation error**: the node itself computes wrongly on the device (a
  broken kernel, a wrong weight, a layout mix-up, an overflow).
- **accumulated precision error**: the node computes faithfully; the error
  came in through its inputs (reduced precision compounding along the graph).

The strongest evidence is the *isolated* error: the reference node re-run
alone (FP32 CPU, reference weights) on the device's own inputs for it (from an
``input``/``all`` dump, or the device outputs of its producers). If the
device output agrees with that, the node did its job and inherited the error;
if not, the node's own computation is wrong. Without the device inputs the
vendor's rules decide: mean relative error jumping from < 0.1 on its inputs
to > 1 on its output; Pearson falling from > 0.9 to < 0.1; an error
concentrated on part of an axis; every input within tolerance while the
output is not.

NaN and Inf get their own reasoning: NaN on both sides is a model or input
problem (named where the reference first has it). On the device only, NaN
from finite inputs is an *invalid operation* (sqrt or log of a negative,
0/0, a negative epsilon); Inf is an *overflow*, and where the device computes
in FP16 it is named at the first node whose reference leaves the FP16 range
(|x| > 65504). FP16 range is never mentioned for a device that does not
compute in FP16.

A computation error is not yet the answer: its effect on the model's
outputs is measured (layerdiff.analyzer.diagnose.impact), and the first *harmful*
one heads the report; the ones the outputs absorb are listed as benign.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnxruntime as ort

from layerdiff.analyzer.compare import metrics as M

COMPUTATION = "computation error"
ACCUMULATED = "accumulated precision error"
# what the node read was not compared (not dumped, skipped, excluded) and it
# could not be re-run alone: nothing tells its own error from an inherited one
UNDECIDED = "no verdict"
FP16_MAX = 65504.0
# Advice for fixed-point builds (the vendor's rules of thumb).
QUANT_RANGE_LIMIT = 30.0
QUANT_RMSE_LIMIT = 0.5
# Quantized builds: an error with an SQNR of 30 dB or more is what INT8
# rounding gives (8 bits: ~6 dB a bit, less the headroom calibration leaves);
# a gross error still at 10 dB or more is quantization noise too coarse for
# the answer; below that, something computes wrongly.
INT8_SQNR_DB = 30.0
QUANT_LOSS_SQNR_DB = 10.0
# a weight whose INT8 copy keeps an SQNR of 15 dB or more is the reference's
# weight rounded (per-tensor INT8 of a weight with outliers gives ~18 dB);
# a wrong weight (scaled, another tensor) is far below
WEIGHT_ROUNDING_SQNR_DB = 15.0
# a quantized Conv/Gemm/MatMul whose own error's RMSE is within this many
# times the RMSE its INT8 rounding is expected to give (NodeExaminer._int8_bound)
INT8_BOUND_FACTOR = 2.0
QUANT_OPS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul", "QLinearConv", "ConvInteger"})


# --------------------------------------------------------------- isolation

class DeviceValues:
    """Device tensors kept for the isolated re-run of failing nodes: a node
    output until every node that reads it has been examined, a node input
    until its node has. Each kept value holds its receive buffer (a
    ``BufferLease``) and releases it when forgotten. Bounded: past
    ``cap_bytes`` nothing more is kept and the nodes concerned fall back to
    the vendor's rules."""

    def __init__(self, node_inputs: dict[str, list[str]], cap_bytes: int = 1 << 30) -> None:
        self.node_inputs = node_inputs
        self.readers: dict[str, int] = {}
        for ins in node_inputs.values():
            for t in set(ins):
                if t:
                    self.readers[t] = self.readers.get(t, 0) + 1
        self.cap = cap_bytes
        self.used = 0
        self.outputs: dict[str, tuple[np.ndarray, object]] = {}
        self.inputs: dict[tuple[str, int], tuple[np.ndarray, object]] = {}

    def _take(self, arr: np.ndarray, lease) -> tuple[np.ndarray, object] | None:
        if self.used + arr.nbytes > self.cap:
            return None
        self.used += arr.nbytes
        return arr, (lease.retain() if lease is not None else None)

    def _drop(self, held: tuple[np.ndarray, object] | None) -> None:
        if held is None:
            return
        self.used -= held[0].nbytes
        if held[1] is not None:
            held[1].release()

    def keep_output(self, tensor: str, arr: np.ndarray, lease=None) -> bool:
        """True when kept (the value then holds its own reference to the buffer)."""
        if self.readers.get(tensor, 0) <= 0 or tensor in self.outputs:
            return False
        held = self._take(arr, lease)
        if held is None:
            return False
        self.outputs[tensor] = held
        return True

    def keep_input(self, node: str, slot: int, arr: np.ndarray, lease=None) -> bool:
        if (node, slot) in self.inputs:
            return False
        held = self._take(arr, lease)
        if held is None:
            return False
        self.inputs[(node, slot)] = held
        return True

    def inputs_of(self, node: str) -> dict[int, np.ndarray]:
        """slot -> device value, for every slot whose value is known."""
        out = {}
        for k, t in enumerate(self.node_inputs.get(node, [])):
            if (node, k) in self.inputs:
                out[k] = self.inputs[(node, k)][0]
            elif t in self.outputs:
                out[k] = self.outputs[t][0]
        return out

    def node_done(self, node: str) -> None:
        """The node has been examined: forget what only it needed."""
        for k, t in enumerate(self.node_inputs.get(node, [])):
            self._drop(self.inputs.pop((node, k), None))
        for t in set(self.node_inputs.get(node, [])):
            if not t or t not in self.readers:
                continue
            self.readers[t] -= 1
            if self.readers[t] <= 0:
                self._drop(self.outputs.pop(t, None))

    def release(self) -> None:
        for held in list(self.outputs.values()) + list(self.inputs.values()):
            self._drop(held)
        self.outputs.clear()
        self.inputs.clear()
        self.used = 0


class IsolationUnavailable(Exception):
    pass


def run_isolated(model: onnx.ModelProto, node_index: int, device_inputs: dict[int, np.ndarray],
                 feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Outputs of reference node ``node_index`` computed alone in FP32 on the
    CPU, reading the device's values for its activations and the reference's
    own weights (so a wrong device weight shows as the node's own error)."""
    node = model.graph.node[node_index]
    values: dict[str, np.ndarray] = {}
    for k, t in enumerate(node.input):
        if t and t not in values and k in device_inputs:
            values[t] = device_inputs[k]
    outs = run_group_isolated(model, [node_index], values, feeds)
    return [outs[o] for o in node.output if o in outs]


def run_group_isolated(model: onnx.ModelProto, node_indices: list[int], device_values: dict[str, np.ndarray],
                       feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The reference nodes ``node_indices`` (in execution order) computed
    alone in FP32 on the CPU, as one unit: what they read from outside the
    unit comes from the device (``device_values`` by tensor name) or the
    model inputs, their weights are the reference's. A fused device node
    (Conv+BN+Relu as one kernel) is re-run as the group it stands for.
    Returns every output of the unit's nodes by name."""
    nodes = [model.graph.node[i] for i in node_indices]
    for node in nodes:
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            raise IsolationUnavailable("the node holds subgraphs")
    inits = {i.name: i for i in model.graph.initializer}
    # Weights held by Constant nodes are weights too: the reference's own
    # Constant node goes into the isolated graph.
    constant_nodes = {n.output[0]: n for n in model.graph.node if n.op_type == "Constant" and n.output}
    produced = {o for n in nodes for o in n.output if o}
    graph_inputs, values, used_inits, used_consts = [], {}, {}, []
    for node in nodes:
        for k, t in enumerate(node.input):
            if not t or t in produced or t in values or t in used_inits:
                continue
            if t in inits:
                used_inits[t] = inits[t]
                continue
            if t in constant_nodes:
                if constant_nodes[t] not in used_consts:
                    used_consts.append(constant_nodes[t])
                continue
            v = feeds.get(t) if t in feeds else device_values.get(t)
            if v is None:
                where = f"input {k} ({t!r})" if len(nodes) == 1 else f"{t!r}, read by {node.name or node.op_type}"
                raise IsolationUnavailable(f"the device value of {where} is not available")
            v = np.asarray(v)
            if v.dtype == np.float16:      # the reference computes in FP32
                v = v.astype(np.float32)
            values[t] = v
            graph_inputs.append(onnx.helper.make_tensor_value_info(
                t, onnx.helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape)))
    out_names = [o for n in nodes for o in n.output if o]
    outputs = [onnx.ValueInfoProto(name=o) for o in out_names]
    graph = onnx.helper.make_graph(used_consts + nodes, "isolated", graph_inputs, outputs,
                                   initializer=list(used_inits.values()))
    m = onnx.helper.make_model(graph, opset_imports=list(model.opset_import))
    m.ir_version = model.ir_version
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 4
    try:
        sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        return dict(zip(out_names, (np.asarray(v) for v in sess.run(None, values))))
    except Exception as e:  # an op that needs more context than its unit
        raise IsolationUnavailable(f"the node cannot run alone ({type(e).__name__})") from None


# --------------------------------------------------------------- tensor evidence

def _finite_pairs(ref: np.ndarray, dev: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both tensors in float64 with every pair that is not finite on both
    sides set to zero on both: the evidence below is about the values the
    two sides share (non-finite values have their own reasoning), and
    float64 keeps sums of FP16-range values from overflowing."""
    r = ref.astype(np.float64)
    d = dev.astype(np.float64)
    bad = ~(np.isfinite(r) & np.isfinite(d))
    if bad.any():
        r[bad] = 0.0
        d[bad] = 0.0
    return r, d


def _rel_mean_err(r: np.ndarray, d: np.ndarray) -> float:
    """Mean |d - r| over the reference's RMS, of a pair from _finite_pairs."""
    scale = float(np.sqrt(np.mean(r * r))) or 1.0
    return float(np.mean(np.abs(d - r))) / scale


# the share of the reference's RMS a half of an axis must be off by, on
# average, for uneven_axis to name it (layout_match asks as much of the whole)
UNEVEN_MIN_REL = 0.05


def _may_be_uneven(m) -> bool:
    """Whether uneven_axis or layout_match can find anything, from the
    node's metrics alone (they cost passes over the tensors, on the thread
    that receives the stream). With every value finite the metrics' mean
    |d - r| and RMS are exactly theirs; a half at least a third of the axis
    off by UNEVEN_MIN_REL puts the whole at UNEVEN_MIN_REL / 3 at least."""
    if m.ref_nan + m.ref_inf + m.dev_nan + m.dev_inf:
        return True
    scale = m.ref_rms if m.ref_rms > 0 else 1.0
    return not m.mean_abs_diff / scale < UNEVEN_MIN_REL / 3


def uneven_axis(ref: np.ndarray, dev: np.ndarray, names: str = "") -> str:
    """A sentence when the error sits on one part of an axis (the vendor's
    example: only the second half of H is wrong), else ''."""
    if ref.shape != dev.shape or ref.ndim == 0 or ref.size < 8:
        return ""
    r, d = _finite_pairs(ref, dev)
    err = np.abs(d - r)
    scale = float(np.sqrt(np.mean(r * r))) or 1.0
    labels = names if len(names) == ref.ndim else ""
    best = ""
    best_ratio = 0.0
    for ax, size in enumerate(ref.shape):
        if size < 2:
            continue
        half = size // 2
        a = float(np.take(err, range(half), axis=ax).mean()) / scale
        b = float(np.take(err, range(half, size), axis=ax).mean()) / scale
        hi, lo = max(a, b), min(a, b)
        if hi < UNEVEN_MIN_REL:
            continue
        ratio = hi / max(lo, 1e-12)
        if ratio >= 10 and ratio > best_ratio:
            where = "second" if b > a else "first"
            name = f" ({labels[ax]})" if labels else ""
            best = (f"error concentrated in the {where} half of axis {ax}{name}: mean |d-r|/rms "
                    f"{hi:.3g} there against {lo:.3g} in the other half")
            best_ratio = ratio
    return best


def layout_match(ref: np.ndarray, dev: np.ndarray) -> str:
    """A sentence when the device tensor is the reference in another layout
    (two axes swapped, or NHWC data read as NCHW), else ''."""
    if ref.shape != dev.shape or ref.ndim < 2 or ref.size < 4:
        return ""
    r, d = _finite_pairs(ref, dev)
    if _rel_mean_err(r, d) < UNEVEN_MIN_REL:
        return ""
    candidates = []
    for i in range(ref.ndim):
        for j in range(i + 1, ref.ndim):
            if ref.shape[i] == ref.shape[j] and ref.shape[i] > 1:
                candidates.append((f"axes {i} and {j} swapped", np.swapaxes(r, i, j)))
    if ref.ndim == 4:
        n, c, h, w = ref.shape
        candidates.append(("NHWC data read as NCHW", r.transpose(0, 2, 3, 1).reshape(ref.shape)))
        candidates.append(("NCHW data read as NHWC", r.reshape(n, h, w, c).transpose(0, 3, 1, 2)
                           .reshape(ref.shape) if c and h and w else r))
    for label, cand in candidates:
        if _rel_mean_err(cand, d) < 0.01:
            return f"layout: the device output is the expected output with {label}"
    return ""


# --------------------------------------------------------------- verdicts

@dataclass
class Finding:
    verdict: str = ""
    cause: str = ""
    evidence: list[str] = field(default_factory=list)
    impact: object = None      # impact.Impact of a computation error on the model's outputs
    hand_over: list = field(default_factory=list)   # cause quantization: the nodes its INT8 output feeds

    @property
    def benign(self) -> bool:
        """A computation error whose effect the outputs are shown to absorb."""
        return self.verdict == COMPUTATION and self.impact is not None and self.impact.harmful is False


def _f(v) -> str:
    return "nan" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3g}"


def _mean_rel(m: M.NodeMetrics) -> float:
    # no finite pair to compare: nothing says the error jumped or not
    return m.mean_rel_err if m.finite_pairs and math.isfinite(m.mean_rel_err) else 0.0


def decide(rows: list, producer_rows: dict[str, list], quantized: bool = False,
           weight_issues: dict[str, list[str]] | None = None,
           unknown_reads: set[str] | None = None) -> dict[int, Finding]:
    """Findings for the failing output rows (by id(row)); ``producer_rows``
    maps a node to the rows of the tensors it reads (its input rows where
    the dump had them, else its producers' output rows). A quantized build
    loses more in each layer by design, so its bar for "gross" is lower.
    ``weight_issues``: node -> the weights the device model holds wrongly
    (weights.issues), which make a computation error's cause "weight".
    ``unknown_reads``: nodes whose inputs no side holds (the first node of a
    golden dump compared without a model): presumed equal, so only a gross
    error of its own is one."""
    weight_issues = weight_issues or {}
    unknown_reads = unknown_reads or set()
    cos_floor = 0.99 if quantized else 0.999
    out: dict[int, Finding] = {}
    for row in rows:
        if row.is_input or not row.failed or row.is_constant:
            continue
        m = row.outcome.metrics
        f = Finding()
        ins = producer_rows.get(row.site.node, [])
        # what it read: activations, and weights (initializers, Constant nodes)
        weights = [r for r in ins if r.site.tensor in row.constants_read or (not r.is_input and r.is_constant)]
        activations = [r for r in ins if r not in weights]
        in_metrics = [r.outcome.metrics for r in activations]
        # in a quantized build a weight that differs by INT8-like noise is the
        # reference's weight rounded, not a wrong one
        rounded_weights = [r for r in weights if r.failed and quantized
                           and r.outcome.metrics.sqnr_db >= WEIGHT_ROUNDING_SQNR_DB]
        bad_weights = [r for r in weights if r.failed and r not in rounded_weights]
        dev_bad = m.dev_nan + m.dev_inf
        ref_bad = m.ref_nan + m.ref_inf
        inputs_bad = any(x.dev_nan + x.dev_inf > 0 for x in in_metrics)
        fp16 = row.device_dtype == "float16"      # FP16 range talk only where the device computes in FP16
        if dev_bad and not ref_bad and not inputs_bad:
            f.verdict = COMPUTATION
            read = _inputs_read(row, activations)
            if m.dev_inf:
                f.cause = "overflow"
                f.evidence.append(f"{m.dev_inf} Inf" + (f" and {m.dev_nan} NaN" if m.dev_nan else "")
                                  + f" values appear on the device here from {read}, while the reference is finite")
                if fp16 and m.fp16_overflow:
                    f.evidence.append(f"{m.fp16_overflow} reference values here lie beyond the FP16 range (65504) "
                                      "the device computes in")
            else:
                f.cause = "invalid operation"
                f.evidence.append(f"{m.dev_nan} NaN values appear on the device here from {read}, while the "
                                  "reference is finite: an invalid operation (the square root or logarithm of a "
                                  "negative number, 0/0, Inf - Inf, a negative epsilon), not an overflow")
        elif row.inherited and weight_issues.get(row.site.node):
            # what it read explains the size of its error, but its weights are
            # known to differ: it computes something else (impact says if it matters)
            f.verdict = COMPUTATION
            f.evidence.append(f"{row.inherited}; but it computes with other weights than the reference")
        elif row.inherited:
            f.verdict = ACCUMULATED
            f.evidence.append(row.inherited)
        elif row.isolated is not None and quantized and row.quant_step and \
                row.quant_step / 2 > _core(row).ref_rms > 0:
            # the INT8 hand-over itself: a step coarser than the values it carries
            core = _core(row)
            f.verdict, f.cause = COMPUTATION, "quantization"
            f.evidence.append(f"its output reaches the next node in INT8 on a grid of {row.quant_levels} levels "
                              f"{_f(row.quant_step)} apart (read from the device values), coarser than the values "
                              f"it carries (RMS {_f(core.ref_rms)}{_core_words(row)}): the quantization scale "
                              f"destroys them (re-run alone: cosine {_f(core.cosine)}, largest difference "
                              f"{_f(core.max_abs_diff)}); the node reading it gets the wrong input")
        elif row.isolated is not None:
            iso = _core(row)
            own = iso.errors / iso.total if iso.total else 0.0
            full = m.errors / m.total if m.total else 0.0
            # A wrong computation changes the result grossly: the cosine
            # drops, or some elements are off by the size of the values
            # themselves. Rounding in the node's own reduced precision (FP16,
            # a quantized layer) does neither: that is precision loss. Mask-
            # like values (-3.4e38) are left out: they would hide the rest.
            scale = iso.ref_rms if row.isolated_core is not None else m.ref_rms
            gross = (not math.isnan(iso.cosine) and iso.cosine < cos_floor) or (
                own >= 0.01 and own > 0.5 * full and iso.max_abs_diff > 0.5 * (scale if scale > 0 else 1.0))
            rounding = quantized and row.quant_step and iso.max_abs_diff <= row.quant_step
            int8_noise = quantized and not math.isnan(iso.sqnr_db) and iso.sqnr_db >= INT8_SQNR_DB
            bound = row.int8_bound if quantized else None
            if gross and bound is not None and not rounding and iso.rmse <= INT8_BOUND_FACTOR * bound[0]:
                f.verdict = ACCUMULATED
                f.evidence.append(f"re-run alone on its device inputs, its own error (RMSE {_f(iso.rmse)}) is within "
                                  f"{INT8_BOUND_FACTOR:g} times {bound[1]} (the bound used); precision, not a "
                                  "kernel bug")
            elif gross and int8_noise and not rounding:
                f.verdict = ACCUMULATED
                f.evidence.append(f"re-run alone on its device inputs, its own error has an SQNR of "
                                  f"{_f(iso.sqnr_db)} dB (cosine {_f(iso.cosine)}), within what INT8 rounding gives "
                                  f"(>= {INT8_SQNR_DB:g} dB, the bound used); precision, not a kernel bug")
            elif gross and rounding:
                f.verdict = ACCUMULATED
                f.evidence.append(f"re-run alone on its device inputs, its own error (largest difference "
                                  f"{_f(iso.max_abs_diff)}, cosine {_f(iso.cosine)}) stays within the INT8 rounding "
                                  f"of its output: one quantization step, {_f(row.quant_step)} (the bound used, read "
                                  f"from the device values: {row.quant_levels} levels); precision, not a kernel bug")
            elif not gross:
                f.verdict = ACCUMULATED
                if own > 0.5 * full:
                    f.evidence.append(f"re-run alone on its device inputs, {iso.errors} of its {m.errors} errors "
                                      f"remain, all small (cosine {_f(iso.cosine)}, largest difference "
                                      f"{_f(iso.max_abs_diff)}): the node's own reduced-precision arithmetic adds "
                                      "to the loss, it computes correctly")
                else:
                    f.evidence.append(f"re-run alone on its device inputs, the reference agrees with the device "
                                      f"({iso.errors}/{iso.total} outside tolerance, cosine {_f(iso.cosine)}): "
                                      f"most of the error ({m.errors}/{m.total}) came in through its inputs")
            else:
                f.verdict = COMPUTATION
                f.evidence.append(f"re-run alone on its device inputs, the reference still disagrees with the "
                                  f"device: {iso.errors}/{iso.total} outside tolerance, cosine {_f(iso.cosine)}, "
                                  f"mean relative error {_f(iso.mean_rel_err)}{_core_words(row)}")
        elif row.site.node in unknown_reads and not activations:
            rel, pearson = _mean_rel(m), m.pearson
            if rel > 1 or (not math.isnan(pearson) and pearson < 0.1):
                f.verdict = COMPUTATION
                f.evidence.append(f"mean relative error {_f(rel)}, Pearson correlation {_f(pearson)} on its output, "
                                  "from inputs that neither dump holds, presumed equal on both sides")
            else:
                f.verdict = UNDECIDED
                f.evidence.append(f"what it read is in neither dump (the run's inputs), and its error is not gross "
                                  f"(mean relative error {_f(rel)}, Pearson correlation {_f(pearson)}): nothing "
                                  "tells an error of its own from rounding; a model re-runs it alone")
            if row.isolation_note:
                f.evidence.append(f"no isolated re-run: {row.isolation_note}")
        elif unseen := _unseen_reads(row, activations):
            f.verdict = UNDECIDED
            f.evidence.append(f"what it read was not compared ({unseen}: not dumped, skipped or excluded), so "
                              "nothing tells an error of its own from an inherited one")
            if row.isolation_note:
                f.evidence.append(f"no isolated re-run: {row.isolation_note}")
        else:
            in_rel = max((_mean_rel(x) for x in in_metrics), default=0.0)
            in_pearson = min((x.pearson for x in in_metrics if not math.isnan(x.pearson)), default=1.0)
            if in_metrics and in_rel < 0.1 and _mean_rel(m) > 1:
                f.verdict = COMPUTATION
                f.evidence.append(f"mean relative error jumps from {_f(in_rel)} on its inputs to "
                                  f"{_f(_mean_rel(m))} on its output")
            elif in_metrics and in_pearson > 0.9 and not math.isnan(m.pearson) and m.pearson < 0.1:
                f.verdict = COMPUTATION
                f.evidence.append(f"Pearson correlation falls from {_f(in_pearson)} on its inputs to "
                                  f"{_f(m.pearson)} on its output")
            elif row.uneven:
                f.verdict = COMPUTATION
            elif all(not r.failed for r in activations) and not bad_weights:
                f.verdict = COMPUTATION
                f.evidence.append("every input it read is within tolerance, its output is not")
            else:
                f.verdict = ACCUMULATED
                f.evidence.append(f"its inputs already differ (mean relative error up to {_f(in_rel)}); no "
                                  "sharp change at this node")
            if row.isolation_note:
                f.evidence.append(f"no isolated re-run: {row.isolation_note}")
        if row.layout:
            f.cause = f.cause or "layout"
            f.evidence.append(row.layout)
        if f.verdict == COMPUTATION and weight_issues.get(row.site.node):
            issues = weight_issues[row.site.node]
            # a differing attribute (epsilon, axis) is a parameter, a differing tensor a weight
            params = all("(attribute)" in text for text in issues)
            f.cause = f.cause or ("parameter" if params else "weight")
            f.evidence.append(f"the device model's {'parameters' if params else 'weights'} differ from the "
                              "reference's: " + "; ".join(issues))
        if row.uneven:
            f.evidence.append(row.uneven)
        if bad_weights and f.verdict == COMPUTATION:
            f.cause = f.cause or "weight"
            f.evidence.append("its weights differ on the device: " + ", ".join(
                f"{r.site.tensor} ({r.outcome.metrics.errors}/{r.outcome.metrics.total} outside tolerance"
                + (f", {r.outcome.metrics.fp16_overflow} beyond the FP16 range" if r.outcome.metrics.fp16_overflow
                   else "") + ")" for r in bad_weights))
        if f.verdict == COMPUTATION and not f.cause and quantized and (rounded_weights or (
                row.isolated is not None and _core(row).sqnr_db >= QUANT_LOSS_SQNR_DB)):
            # its weights are the reference's up to rounding, and its own
            # error is quantization noise, only more than the answer tolerates
            f.cause = "quantization"
            if rounded_weights:
                f.evidence.append("its weights are the reference's rounded to INT8 (" + ", ".join(
                    f"{r.site.tensor}: SQNR {_f(r.outcome.metrics.sqnr_db)} dB" for r in rounded_weights)
                    + "), and that rounding alone changes its output beyond tolerance: quantize them per channel "
                      "or run this node in INT16")
            else:
                f.evidence.append(f"its own error is quantization noise (SQNR {_f(_core(row).sqnr_db)} dB re-run "
                                  f"alone, >= {QUANT_LOSS_SQNR_DB:g}), more than the answer tolerates: run it in "
                                  "INT16")
        if f.verdict == COMPUTATION and not f.cause:
            f.cause = "range" if fp16 and m.fp16_overflow else "kernel"
        if fp16 and m.fp16_overflow and "range" not in f.cause and f.cause != "overflow":
            f.evidence.append(f"{m.fp16_overflow} reference values lie beyond the FP16 range (65504) the device "
                              "computes in")
        if row.overflow:
            f.evidence.append(f"the device flagged an overflow here: {row.overflow}")
        out[id(row)] = f
    return out


def _core(row):
    """The isolated metrics to judge by: without the mask-like values where
    the reference has some (they dominate cosine and RMS), else all."""
    return row.isolated_core if row.isolated_core is not None else row.isolated


def _core_words(row) -> str:
    return f"; {row.core_note}" if row.isolated_core is not None and row.core_note else ""


def core_mask(ref: np.ndarray) -> tuple[np.ndarray | None, float]:
    """The elements that are not mask-like sentinels (|x| above 1000 times
    the median magnitude: the -3.4e38 or -1e4 of an additive attention mask),
    and the threshold; (None, nan) where there are none."""
    a = np.abs(np.asarray(ref, np.float64)).ravel()
    finite = a[np.isfinite(a)]
    if not finite.size:
        return None, math.nan
    med = float(np.median(finite))
    if med <= 0:
        return None, math.nan
    thr = 1e3 * med
    keep = np.isfinite(a) & (a <= thr)
    if keep.all() or not keep.any():
        return None, math.nan
    return keep, thr


def quant_grid(dev: np.ndarray, max_levels: int = 256) -> tuple[float, int] | None:
    """(step, levels) where the device values lie on a grid of at most
    ``max_levels`` values (a dequantized INT8 tensor); None otherwise."""
    a = np.asarray(dev).ravel()
    if a.size > 1 << 22:
        a = a[:: a.size // (1 << 22) + 1]
    a = a[np.isfinite(a)]
    if a.size < 2:
        return None
    u = np.unique(a)
    if len(u) > max_levels or len(u) < 2:
        return None
    steps = np.diff(u.astype(np.float64))
    step = float(steps.min())
    # every gap a whole number of steps: one scale, not just few values
    if step <= 0 or not np.allclose(steps / step, np.round(steps / step), atol=1e-3):
        return None
    return step, int(len(u))


def _unseen_reads(row, activations: list) -> str:
    """The tensors the node reads from other nodes that have no comparison
    ('' when every one has): named where they can be, else counted."""
    reads = [t for t in row.reads if t not in row.constants_read]
    if len(activations) >= len(reads):
        return ""
    seen = {r.site.tensor for r in activations if not r.is_input}
    names = [t for t in reads if t not in seen]
    if len(names) == len(reads) - len(activations):
        return ", ".join(repr(t) for t in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"{len(reads) - len(activations)} of its inputs"


def _inputs_read(row, activations: list) -> str:
    """What the node read, as far as the data show it: a claim of finite
    inputs only for the inputs that were compared."""
    reads = [t for t in row.reads if t not in row.constants_read]
    if not reads:
        return "its weights alone"
    if len(activations) >= len(reads):
        return "inputs that were all finite"
    if not activations:
        return f"inputs the device did not send ({len(reads)}), so nothing shows whether they were finite"
    return (f"inputs of which the {len(activations)} compared were finite ({len(reads) - len(activations)} not "
            "sent by the device)")


def nan_and_overflow(rows: list) -> dict:
    """The NaN and overflow reasoning over the rows in execution order."""
    nan = overflow = None
    for r in rows:
        if r.is_input:
            continue
        m = r.outcome.metrics
        if nan is None and m.ref_nan:
            where = "both" if m.dev_nan else "reference"
            nan = {"node": r.site.node, "where": where,
                   "text": f"NaN first appears at {r.site.node} in the reference"
                           + (" and on the device" if m.dev_nan else "")
                           + ": the model or its input is at fault (an invalid parameter, an Inf weight, or an "
                             "input outside the domain of an op such as Log or Sqrt), not the device"}
        if nan is None and (m.dev_nan or m.dev_inf) and not (m.ref_nan or m.ref_inf):
            nan = {"node": r.site.node, "where": "device",
                   "text": f"NaN/Inf first appears at {r.site.node} on the device only, while the reference is "
                           "finite"}
    first_bad_device = next((r for r in rows if not r.is_input and
                             (r.outcome.metrics.dev_nan or r.outcome.metrics.dev_inf) and
                             not (r.outcome.metrics.ref_nan or r.outcome.metrics.ref_inf)), None)
    if first_bad_device is not None and not first_bad_device.outcome.metrics.dev_inf and not any(
            r.outcome.metrics.dev_inf for r in rows if not r.is_input
            and r.site.order <= first_bad_device.site.order):
        overflow = None    # NaN from finite values: an invalid operation, said in "nan"
        if nan is not None and nan["where"] == "device" and nan["node"] == first_bad_device.site.node:
            nan["text"] = (f"NaN first appears at {first_bad_device.site.node} on the device only, from finite values: "
                           "an invalid operation (the square root or logarithm of a negative number, 0/0, a "
                           "negative epsilon), not an overflow")
    elif first_bad_device is not None:
        fp16 = any(r.device_dtype == "float16" for r in rows)      # the device computes in FP16
        beyond = next((r for r in rows if fp16 and not r.is_input and not r.is_constant
                       and r.outcome.metrics.fp16_overflow and r.site.order <= first_bad_device.site.order), None)
        culprit = beyond or first_bad_device
        overflow = {"node": culprit.site.node,
                    "text": (f"FP16 overflow: {culprit.site.node} is the first node whose reference exceeds 65504 "
                             f"({culprit.outcome.metrics.fp16_overflow} values); the device shows Inf/NaN from "
                             f"{first_bad_device.site.node} on") if beyond else
                            (f"Inf/NaN on the device only, from {first_bad_device.site.node} on; no reference value "
                             "exceeds 65504 before it (a division by a tiny number, or an intermediate value "
                             "inside the kernel)") if fp16 else
                            (f"Inf/NaN on the device only, from {first_bad_device.site.node} on, while the reference "
                             "is finite (the device computes in "
                             f"{first_bad_device.device_dtype or 'its own precision'}: a value beyond that range, or "
                             "a division by a tiny number)")}
    return {"nan": nan, "overflow": overflow}


def quantization_advice(sites: list, node_inputs: dict[str, list[str]], rows: list,
                        input_ranges: dict[str, tuple[float, float]], quantized: bool) -> list[dict]:
    """For fixed-point builds: for every quantized op of the reference graph,
    the range of its input (reference values, or a tensor_min_max file) and
    the RMSE of its *own* error (re-run alone on its device inputs; what it
    inherited does not count), with the vendor's advice (range > 30 or RMSE
    > 0.5: run that op's input in INT16). Ops the device fused away are
    listed too; their RMSE is then unknown."""
    if not quantized:
        return []
    rmse_of = {r.site.node: _own_rmse(r) for r in rows if not r.is_input and r.site.output_index == 0}
    # the quantization error of its output as onnxruntime's qdq_loss_debug
    # gives it: 10 log10(|ref|^2 / |ref - device|^2)
    sqnr_of = {r.site.node: r.outcome.metrics.sqnr_db for r in rows if not r.is_input and r.site.output_index == 0}
    out, seen = [], set()
    for site in sites:
        if site.op_type not in QUANT_OPS or site.node in seen:
            continue
        seen.add(site.node)
        first = next(iter(node_inputs.get(site.node, [])), "")
        lo, hi = input_ranges.get(first, (math.nan, math.nan))
        rng = hi - lo
        rmse = rmse_of.get(site.node, math.nan)
        reasons = []
        if rng > QUANT_RANGE_LIMIT:
            reasons.append(f"input range {rng:.3g} > {QUANT_RANGE_LIMIT:g}")
        if rmse > QUANT_RMSE_LIMIT:
            reasons.append(f"RMSE {rmse:.3g} > {QUANT_RMSE_LIMIT:g}")
        out.append({"node": site.node, "input": first, "min": _num(lo), "max": _num(hi), "range": _num(rng),
                    "rmse": _num(rmse), "sqnr_db": _num(sqnr_of.get(site.node, math.nan)),
                    "advice": ("run this node's input in INT16 (" + "; ".join(reasons) + ")") if reasons else ""})
    return out


def _own_rmse(row) -> float:
    """The RMSE of the node's own error: its isolated re-run where there is
    one; nothing where its error is plainly inherited; else (it passes) its
    output's."""
    if row.isolated is not None:
        return _core(row).rmse
    if row.inherited:
        return math.nan
    return row.outcome.metrics.rmse


def _num(v: float):
    return None if v is None or not math.isfinite(v) else float(v)


def _place(site) -> str:
    """"Conv, execution #2"; a dump without op types gives only the order."""
    return f"{site.op_type}, execution #{site.order}" if site.op_type else f"execution #{site.order}"


def headline(first_comp, first_fail, diagnosis: dict, benign: list | None = None,
             undecided: list | None = None) -> str:
    """The sentence the job answers with: the first computation error that
    changes the outputs (``first_comp``); computation errors the outputs
    absorb (``benign``) are named after it, never as the answer. Failing
    nodes that could not be judged (``undecided``) forbid saying that no
    node computes wrongly on its own."""
    benign = benign or []
    undecided = undecided or []
    absorbed = (f"{len(benign)} computation error{'s' if len(benign) > 1 else ''} the outputs absorb (first at "
                f"{benign[0].site.node})") if benign else ""
    if first_comp is not None:
        text = f"Computation error at {first_comp.site.node} ({_place(first_comp.site)})"
        if first_comp.finding.cause:
            text += f", cause: {first_comp.finding.cause}"
        if first_comp.finding.hand_over:
            text += f" (its INT8 hand-over to {', '.join(first_comp.finding.hand_over)})"
        return text + (f"; besides, {absorbed}" if absorbed else "")
    if diagnosis.get("nan") and diagnosis["nan"]["where"] in ("both", "reference"):
        return diagnosis["nan"]["text"]
    if undecided:
        u = undecided[0]
        more = f" and {len(undecided) - 1} more failing node{'s' if len(undecided) > 2 else ''}" \
            if len(undecided) > 1 else ""
        return (f"No verdict: {u.site.node} ({_place(u.site)}){more} could not be "
                "judged (what they read was not compared or is in neither dump); no other node is shown to compute "
                "wrongly on its own" + (f"; besides, {absorbed}" if absorbed else ""))
    if absorbed:
        rest = (f"; the outputs' error builds up from {first_fail.site.node} on" if first_fail is not None
                and first_fail.site.node != benign[0].site.node else "")
        return f"No node's own error changes the outputs: {absorbed}{rest}"
    if first_fail is not None:
        return (f"Accumulated precision error: no node computes wrongly on its own; the error builds up from "
                f"{first_fail.site.node} on")
    return "Every compared node is within tolerance"


# --------------------------------------------------------------- during a job

@dataclass
class _Waiting:
    """A failing node output whose examination waits for what it reads."""
    row: object
    ref: np.ndarray
    dev: np.ndarray
    lease: object
    tol: object
    force_compare: bool
    missing: set


class NodeExaminer:
    """What a job gathers while nodes stream in: device values for isolated
    re-runs, and for each failing node its isolated error, layout and axis
    evidence; input ranges of quantized ops.

    A failing node is examined once everything it reads has been settled
    (compared, or known not to come), whatever order the device stream and
    the executor deliver tensors in: a node that arrives before its
    producers waits for them, holding its tensors, and the end of the
    stream settles everything. The reports then do not depend on the order,
    as long as the waiting nodes fit in ``wait_cap_bytes``; past it the
    longest-waiting node is examined with what has arrived."""

    def __init__(self, reference, feeds: dict[str, np.ndarray], quantized: bool,
                 cap_bytes: int = 1 << 30, given_ranges: dict[str, tuple[float, float]] | None = None,
                 dump_mode: str = "output", wait_cap_bytes: int = 512 << 20,
                 groups: dict[str, list[str]] | None = None, injected=None) -> None:
        """``groups``: reference tensor -> the reference nodes a fused device
        node computes as one kernel (graph alignment); such a tensor's node
        is examined, and re-run alone, as that group. ``injected``
        (impact.InjectedValues): keeps the device value of every examined
        node whose error is not plainly inherited, for the impact re-runs."""
        self.reference = reference
        self.injected = injected
        self._constant_nodes: dict | None = None
        self.groups = dict(groups or {})
        self.feeds = feeds
        self.quantized = quantized
        self.values = DeviceValues(reference.node_inputs, cap_bytes)
        self.outputs_left: dict[str, int] = {}
        self._op: dict[str, str] = {}
        self._index: dict[str, int] = {}     # node -> its index in execution order
        for s in reference.sites:
            self.outputs_left[s.node] = self.outputs_left.get(s.node, 0) + 1
            self._op.setdefault(s.node, s.op_type)
            self._index.setdefault(s.node, s.order)
        self._computed = {s.tensor for s in reference.sites}
        self._with_inputs = dump_mode == "all"
        self.quant_inputs = {ins[0] for node, ins in reference.node_inputs.items()
                             if ins and self._op.get(node) in QUANT_OPS} if quantized else set()
        # ranges a calibrator recorded win over the reference's own values
        self.input_ranges: dict[str, tuple[float, float]] = dict(given_ranges or {})
        self.metrics_of: dict = {}     # tensor, or (node, input index), -> metrics
        self._settled: set = set()     # tensors and (node, input index) compared or known not to come
        self._waiting: dict[int, _Waiting] = {}    # in the order they started waiting
        self._waiting_bytes = 0
        self.wait_cap = wait_cap_bytes
        for t in self.quant_inputs & set(feeds):
            self.note_range(t, feeds[t])

    def note_range(self, tensor: str, ref: np.ndarray) -> None:
        if tensor in self.quant_inputs and tensor not in self.input_ranges and ref.size:
            r = ref.astype(np.float64, copy=False)
            finite = r[np.isfinite(r)]
            if finite.size:
                self.input_ranges[tensor] = (float(finite.min()), float(finite.max()))

    def keep_output(self, tensor: str, arr: np.ndarray, lease=None) -> bool:
        return self.values.keep_output(tensor, arr, lease)

    def keep_input(self, node: str, slot: int, arr: np.ndarray, lease=None) -> bool:
        return self.values.keep_input(node, slot, arr, lease)

    # ------------------------------------------------------------ settling

    def unit(self, site) -> list[str]:
        """The reference nodes examined together for a tensor: the fused
        group that computes it on the device, else its own node."""
        return self.groups.get(site.tensor) or [site.node]

    def _external_reads(self, nodes: list[str]) -> list[tuple[str, int, str]]:
        """(node, input index, tensor) of the computed tensors the unit reads
        from outside itself."""
        produced = {s.tensor for s in self.reference.sites if s.node in nodes} if len(nodes) > 1 else set()
        out = []
        for node in nodes:
            consts = self.reference.constants_read(node)
            for k, t in enumerate(self.reference.node_inputs.get(node, [])):
                if not t or t in consts or t in self.feeds or t not in self._computed or t in produced:
                    continue
                out.append((node, k, t))
        return out

    def _reads(self, nodes: list[str]) -> set:
        """What the unit's examination looks at: the computed tensors it
        reads, and with dump_mode all the device's own records of its inputs."""
        keys: set = set()
        for node, k, t in self._external_reads(nodes):
            keys.add(t)
            if self._with_inputs:
                keys.add((node, k))
        return keys

    def settle(self, key) -> None:
        """A tensor (or a node's input k) is settled: compared, or its record
        refused or skipped. The nodes waiting for it are examined once it
        was the last thing they lacked."""
        if key in self._settled:
            return
        self._settled.add(key)
        ready = []
        for wid, w in self._waiting.items():
            w.missing.discard(key)
            if not w.missing:
                ready.append(wid)
        for wid in ready:
            self._run_waiting(wid)

    def row_done(self, row, ref: np.ndarray, dev: np.ndarray, lease, tol, force_compare: bool) -> None:
        """A comparison is finished: note its metrics, examine the node if it
        fails (now, or once what it reads is settled), and settle it for the
        nodes that read it."""
        key = (row.site.node, row.site.output_index) if row.is_input else row.site.tensor
        self.metrics_of[key] = row.outcome.metrics
        if not row.is_input:
            if row.failed and not row.is_constant:
                missing = self._reads(self.unit(row.site)) - self._settled
                if missing:
                    self._wait(_Waiting(row, ref, dev, lease.retain() if lease is not None else None, tol,
                                        force_compare, missing))
                else:
                    self.examine(row, ref, dev, tol, force_compare)
                    self._unit_done(row.site)
            else:
                self._unit_done(row.site)
        self.settle(key)

    def _wait(self, w: _Waiting) -> None:
        self._waiting[id(w)] = w
        self._waiting_bytes += w.ref.nbytes + w.dev.nbytes
        while self._waiting_bytes > self.wait_cap and self._waiting:
            self._run_waiting(next(iter(self._waiting)))

    def _run_waiting(self, wid: int) -> None:
        w = self._waiting.pop(wid)
        self._waiting_bytes -= w.ref.nbytes + w.dev.nbytes
        try:
            self.examine(w.row, w.ref, w.dev, w.tol, w.force_compare)
        finally:
            if w.lease is not None:
                w.lease.release()
        self._unit_done(w.row.site)

    def finish(self) -> None:
        """The stream has ended: whatever a waiting node still lacks will not
        come; examine it with what there is, then forget every kept value."""
        try:
            while self._waiting:
                self._run_waiting(next(iter(self._waiting)))
        finally:
            self.abandon()

    def abandon(self) -> None:
        """The job stops early: forget everything without examining it."""
        for w in self._waiting.values():
            if w.lease is not None:
                w.lease.release()
        self._waiting.clear()
        self._waiting_bytes = 0
        self.values.release()

    def _unit_done(self, site) -> None:
        """The tensor's row is finished: its node's output, and for a fused
        group the nodes inside it (whose outputs never come)."""
        for node in self.unit(site)[:-1]:
            self.values.node_done(node)
        self._output_done(site.node)

    def _output_done(self, node: str) -> None:
        """One output row of the node is finished; once all are, what it
        read is forgotten."""
        left = self.outputs_left.get(node, 1) - 1
        self.outputs_left[node] = left
        if left <= 0:
            self.values.node_done(node)

    def inherited(self, row) -> str:
        """A sentence when the node's error is plainly what it read (no
        larger than its inputs' errors), so it needs no closer look; ''
        when it does (its error grew, or what it read is unknown)."""
        m = row.outcome.metrics
        read = []
        for node, k, t in self._external_reads(self.unit(row.site)):
            x = self.metrics_of.get((node, k)) or self.metrics_of.get(t)
            if x is None:
                return ""
            read.append(x)
        if not read or m.dev_nan + m.dev_inf > max(x.dev_nan + x.dev_inf for x in read):
            return ""
        worst_cos = min((x.cosine for x in read if not math.isnan(x.cosine)), default=1.0)
        worst_ratio = max(x.errors / x.total if x.total else 0.0 for x in read)
        ratio = m.errors / m.total if m.total else 0.0
        cos = 1.0 if math.isnan(m.cosine) else m.cosine
        if 1 - cos > 2 * (1 - worst_cos) + 1e-6 or ratio > 2 * worst_ratio + 1e-3:
            return ""
        # a scale error leaves the cosine alone: the relative distance shows it
        worst_dist = max((x.rel_euclidean for x in read if math.isfinite(x.rel_euclidean)), default=0.0)
        if math.isfinite(m.rel_euclidean) and m.rel_euclidean > 2 * worst_dist + 0.05:
            return ""
        return (f"its error is no larger than what it read (cosine {_f(cos)} against {_f(worst_cos)}, "
                f"{ratio:.3g} of elements outside tolerance against {worst_ratio:.3g})")

    def _weight(self, tensor: str) -> np.ndarray | None:
        """A weight of the reference: an initializer or a Constant node's value."""
        w = self.reference.constant(tensor) if hasattr(self.reference, "constant") else None
        if w is not None or getattr(self.reference, "model", None) is None:   # a golden dump has no model
            return w
        if self._constant_nodes is None:
            self._constant_nodes = {n.output[0]: n for n in self.reference.model.graph.node
                                    if n.op_type == "Constant" and n.output and n.attribute}
        n = self._constant_nodes.get(tensor)
        if n is None or n.attribute[0].name != "value":
            return None
        from onnx import numpy_helper

        return numpy_helper.to_array(n.attribute[0].t)

    def _int8_bound(self, site) -> tuple[float, str] | None:
        """The RMSE a Conv/Gemm/MatMul's own INT8 rounding is expected to give:
        sqrt(K) * sqrt((s_w^2/12) rms_x^2 + (s_x^2/12) rms_w^2), with K the
        reduction length (from the weight's shape), s_w = max|w|/127 the
        weight step of symmetric INT8 (per channel is finer), s_x the input's
        step over its calibrated range (255 steps), rms_x and rms_w the
        reference's. None where something of it is unknown."""
        if site.op_type not in ("Conv", "ConvTranspose", "Gemm", "MatMul"):
            return None
        ins = self.reference.node_inputs.get(site.node, [])
        if len(ins) < 2 or ins[0] not in self.input_ranges:
            return None
        w = self._weight(ins[1])
        if w is None or w.ndim < 2 or not w.size:
            return None
        w = w.astype(np.float64)
        if site.op_type.startswith("Conv"):
            k = int(np.prod(w.shape[1:]))
        elif site.op_type == "Gemm" and any(a.name == "transB" and a.i for a in
                                            self.reference.model.graph.node[site.order].attribute):
            k = w.shape[1]
        else:
            k = w.shape[0]
        lo, hi = self.input_ranges[ins[0]]
        s_x, s_w = (hi - lo) / 255.0, float(np.max(np.abs(w))) / 127.0
        xm = self.metrics_of.get(ins[0])
        rms_x = xm.ref_rms if xm is not None and math.isfinite(xm.ref_rms) else (hi - lo) / (2 * math.sqrt(3))
        rms_w = float(np.sqrt(np.mean(w * w)))
        e = math.sqrt(k) * math.sqrt((s_w ** 2 / 12) * rms_x ** 2 + (s_x ** 2 / 12) * rms_w ** 2)
        if not math.isfinite(e) or e <= 0:
            return None
        return e, (f"the RMSE INT8 rounding gives over its reduction of {k} (weight step {_f(s_w)}, input step "
                   f"{_f(s_x)}): {_f(e)}")

    def examine(self, row, ref: np.ndarray, dev: np.ndarray, tol, force_compare: bool) -> None:
        """Fill the row's evidence (a failing output row). A node whose error
        is plainly inherited is not re-run: the closer look costs a pass over
        its tensors and a session of its own."""
        with np.errstate(all="ignore"):
            self._examine(row, ref, dev, tol, force_compare)

    def _examine(self, row, ref: np.ndarray, dev: np.ndarray, tol, force_compare: bool) -> None:
        from layerdiff.analyzer.compare.node import SkipNode, compare_node, reconcile

        site = row.site
        row.inherited = self.inherited(row)
        if row.inherited:
            return
        try:
            dev_aligned, _ = reconcile(ref, dev, force_compare)
        except SkipNode:
            return
        if self.injected is not None and dev_aligned.shape == ref.shape:
            self.injected.keep(site.tensor, dev_aligned)
        axes = getattr(self.reference, "layout", "NCHW")   # TensorFlow references are NHWC
        if _may_be_uneven(row.outcome.metrics):
            row.uneven = uneven_axis(ref, dev_aligned, axes if ref.ndim == 4 else "")
            row.layout = layout_match(ref, dev_aligned)
        try:
            # A reference that is not ONNX (TensorFlow) re-runs its own op.
            isolate = getattr(self.reference, "run_isolated", None)
            group = self.groups.get(site.tensor)
            if group and not isolate:
                device = {t: self.values.outputs[t][0] for _, _, t in self._external_reads(group)
                          if t in self.values.outputs}
                iso = run_group_isolated(self.reference.model, [self._index[n] for n in group], device,
                                         self.feeds)[site.tensor]
            else:
                outs = isolate(site, self.values.inputs_of(site.node), self.feeds) if isolate else \
                    run_isolated(self.reference.model, site.order, self.values.inputs_of(site.node), self.feeds)
                iso = outs[site.output_index]
            row.isolated = compare_node(iso, dev, tol, 0, force_compare).metrics
            keep, thr = core_mask(ref)
            if keep is not None and iso.shape == dev_aligned.shape:
                row.isolated_core = compare_node(np.asarray(iso).reshape(-1)[keep],
                                                 np.asarray(dev_aligned).reshape(-1)[keep], tol, 0).metrics
                row.core_note = (f"{int((~keep).sum())} mask-like values (|x| > {thr:.3g}) left out, "
                                 f"{int(keep.sum())} compared")
            if self.quantized:
                grid = quant_grid(dev_aligned)
                if grid is not None:
                    row.quant_step, row.quant_levels = grid
                row.int8_bound = self._int8_bound(site)
            if not row.layout:
                row.layout = layout_match(iso, dev_aligned) if iso.shape == dev_aligned.shape else ""
        except (IsolationUnavailable, SkipNode, IndexError, KeyError) as e:
            row.isolation_note = str(e) or type(e).__name__
