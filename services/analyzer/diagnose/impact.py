"""What a node's own error does to the model's outputs.

A node can compute wrongly on the device and still not matter: an FP16
converter clamps an attention mask of -3.4e38 to -1e4, and every Softmax
downstream gives the same zeros. Such a node is a computation error, but not
the one to fix. For each node with an error of its own, the rest of the
reference graph is run in FP32 with that node's device value put in place of
the reference's (everything else the reference's own), and the model's
outputs are compared with the reference outputs under the job's
tolerances:

- **harmful**: some output leaves the tolerance, or turns away from the
  reference (cosine below ``OUTPUT_COSINE_FLOOR``: outputs of small values,
  such as a probability map near 0, stay within an absolute tolerance while
  their pattern changes): this error breaks the answer;
- **benign**: every output stays within both: the error is absorbed downstream.

The re-runs are budgeted (``MAX_RUNS`` nodes, ``BUDGET_S`` seconds); a node
past the budget is reported as not measured, never guessed.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from layerdiff.analyzer.compare import metrics as M
from layerdiff.analyzer.reference.onnxrt import reference_session
from layerdiff.common.onnxgraph import WeightSplit

if TYPE_CHECKING:
    import onnx
    import onnxruntime as ort
else:
    from layerdiff.common.lazy import onnx, ort

if TYPE_CHECKING:
    from layerdiff.common.schema import BufferLease

MAX_RUNS = 24
BUDGET_S = 120.0
KEEP_BYTES = 512 << 20
OUTPUT_COSINE_FLOOR = 0.99
_SUFFIX = "::layerdiff-reference"


@dataclass
class Impact:
    harmful: bool | None              # None: not measured (``note`` says why)
    worst_output: str = ""
    cosine: float = math.nan          # the worst output's cosine with the device value injected
    failing_outputs: int = 0
    note: str = ""
    why: str = ""                     # benign: what the data say about why it is absorbed

    def as_dict(self) -> dict:
        return {"harmful": self.harmful, "worst_output": self.worst_output,
                "cosine": None if math.isnan(self.cosine) else self.cosine,
                "failing_outputs": self.failing_outputs, "note": self.note, "why": self.why}

    def sentence(self) -> str:
        if self.harmful is None:
            return f"impact on the outputs not measured: {self.note}"
        cos = f"cosine {self.cosine:.6g}" if not math.isnan(self.cosine) else "no finite values"
        if self.harmful:
            return (f"harmful: with only this node's device value put into the FP32 reference, "
                    f"{self.failing_outputs} model output(s) leave the tolerance or turn away from the reference "
                    f"({self.worst_output}: {cos})")
        return (f"benign: with this node's device value put into the FP32 reference, every model output stays "
                f"within tolerance ({self.worst_output}: {cos}); its error is absorbed downstream"
                + (f" ({self.why})" if self.why else ""))


@dataclass
class InjectedValues:
    """Device values (in the reference's layout) of the nodes that may have
    an error of their own, kept for the impact re-runs; bounded in bytes.
    A value that lies in its receive buffer keeps that buffer (its
    ``BufferLease``, retained) instead of a copy."""
    cap_bytes: int = KEEP_BYTES
    values: dict[str, np.ndarray] = field(default_factory=dict)
    used: int = 0
    dropped: set = field(default_factory=set)
    leases: list = field(default_factory=list)

    def keep(self, tensor: str, value: np.ndarray, lease: BufferLease | None = None) -> None:
        """``lease``: the receive buffer ``value`` lies in (then not copied)."""
        if tensor in self.values:
            return
        if self.used + value.nbytes > self.cap_bytes:
            self.dropped.add(tensor)
            return
        if lease is not None:
            self.leases.append(lease.retain())
            self.values[tensor] = value
        else:
            self.values[tensor] = np.array(value, copy=True)
        self.used += value.nbytes

    def release(self) -> None:
        self.values.clear()
        self.used = 0
        for lease in self.leases:
            lease.release()
        self.leases.clear()


class ImpactRunner:
    """Re-runs the reference model with one tensor replaced by its device
    value; owns the baseline outputs and the budget."""

    def __init__(self, model: onnx.ModelProto | WeightSplit, feeds: dict[str, np.ndarray], values: InjectedValues,
                 tol, max_runs: int = MAX_RUNS, budget_s: float = BUDGET_S,
                 baseline: dict[str, np.ndarray] | None = None) -> None:
        """``model``: the reference model, or its ``WeightSplit`` (its weights
        copied out once); ``baseline``: the model's outputs as the reference
        computed them, where it kept them (else one more run computes them)."""
        self.split = WeightSplit.of(model)
        self.model = self.split.model
        self.feeds = feeds
        self.values = values
        self.tol = tol
        self.max_runs = max_runs
        self.budget_s = budget_s
        self.runs = 0
        self.spent = 0.0
        self.outputs = [o.name for o in self.model.graph.output]
        self._baseline = baseline if baseline is not None and all(o in baseline for o in self.outputs) else None
        self._switched: _Switched | None = None

    def _session(self, edit=None) -> ort.InferenceSession:
        # a device value the reference does not take fails the run: said in the report
        return reference_session(self.split, edit=edit, quiet=True)

    def baseline(self) -> dict[str, np.ndarray]:
        if self._baseline is None:
            sess = self._session()
            self._baseline = dict(zip(self.outputs, sess.run(self.outputs, self.feeds)))
        return self._baseline

    def measure(self, tensor: str) -> Impact:
        """The impact of the device value kept for ``tensor``."""
        value = self.values.values.get(tensor)
        if value is None:
            why = "its device value was not kept (memory bound)" if tensor in self.values.dropped else \
                "its device value is not at hand"
            return Impact(None, note=why)
        if self.runs >= self.max_runs:
            return Impact(None, note=f"past the budget of {self.max_runs} re-runs")
        if self.spent >= self.budget_s:
            return Impact(None, note=f"past the budget of {self.budget_s:g} s of re-runs")
        t0 = time.perf_counter()
        try:
            base = self.baseline()
            if tensor in base:      # a model output: what the device gives is what the user gets
                got = dict(base)
                got[tensor] = value
            else:
                got = self.outputs_with(tensor, value)
        except Exception as e:      # an op that does not take the device's value (dtype, shape)
            return Impact(None, note=f"the reference does not run with it ({type(e).__name__})")
        finally:
            self.runs += 1
            self.spent += time.perf_counter() - t0
        return self._judge(base, got)

    def prepare(self, tensors: list[str]) -> None:
        """The tensors about to be measured, in order: where two or more
        need a re-run, one session serves them all (``_Switched``), instead
        of a session of the whole model built for each (most of a re-run's
        time on a transformer)."""
        outputs = set(self.outputs)
        wanted = [t for t in tensors if t in self.values.values and t not in outputs][:self.max_runs]
        if len(wanted) < 2:
            return
        t0 = time.perf_counter()
        try:
            self._switched = _Switched(self.split, {t: _as_fed(self.values.values[t]) for t in wanted}, self.outputs)
        except Exception:   # a value the graph does not take: each is re-run on its own (and said so there)
            self._switched = None
        finally:
            self.spent += time.perf_counter() - t0

    def outputs_with(self, tensor: str, value: np.ndarray) -> dict[str, np.ndarray]:
        """The model's outputs computed in FP32 with ``tensor`` replaced by
        ``value``: the producer's output renamed and ``tensor`` made a graph
        input, on the session's own copy of the graph (the weights are not
        copied)."""
        v = _as_fed(value)
        if self._switched is not None and self._switched.takes(tensor, v):
            return self._switched.run(tensor, v, self.feeds)

        def injected(m: onnx.ModelProto) -> None:
            for node in m.graph.node:
                for k, o in enumerate(node.output):
                    if o == tensor:
                        node.output[k] = tensor + _SUFFIX
            m.graph.input.append(onnx.helper.make_tensor_value_info(
                tensor, onnx.helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape)))

        sess = self._session(injected)
        return dict(zip(self.outputs, sess.run(self.outputs, {**self.feeds, tensor: v})))

    def summary(self) -> dict:
        """How many re-runs were made within which budget (summary.json
        diagnosis.impact; no timing, so that reports are reproducible)."""
        return {"runs": self.runs, "max_runs": self.max_runs, "budget_s": self.budget_s,
                "output_cosine_floor": OUTPUT_COSINE_FLOOR}

    def _judge(self, base: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> Impact:
        worst, worst_cos, failing = "", math.inf, 0
        for name in self.outputs:
            r, d = np.asarray(base[name]), np.asarray(got[name])
            if r.shape != d.shape:
                d = d.reshape(r.shape) if d.size == r.size else d
            if r.shape != d.shape:
                failing += 1
                worst, worst_cos = name, math.nan
                continue
            if r.dtype.kind not in "fc":
                bad = int(np.count_nonzero(r != d))
                cos = 1.0 if not bad else 0.0
            else:
                with np.errstate(all="ignore"):
                    m = M.compare(r.astype(np.float32, copy=False), d.astype(np.float32, copy=False),
                                  self.tol.atol, self.tol.rtol)
                bad, cos = m.errors, m.cosine
            if bad or (not math.isnan(cos) and cos < OUTPUT_COSINE_FLOOR):
                failing += 1
            key = -1.0 if math.isnan(cos) else cos
            if not worst or key < (-1.0 if math.isnan(worst_cos) else worst_cos):
                worst, worst_cos = name, cos
        return Impact(failing > 0, worst, float(worst_cos), failing)


def _as_fed(value: np.ndarray) -> np.ndarray:
    """A device value as the FP32 reference takes it."""
    v = np.asarray(value)
    return v.astype(np.float32) if v.dtype == np.float16 else v


class _Switched:
    """One session of the reference in which any of several tensors can be
    replaced by its device value: each becomes ``Where(use, device value,
    its own value)``, ``use`` a boolean fed per run, so that a run puts in
    one and computes the rest as the reference does (the same kernels, the
    same values as a graph with that tensor made an input)."""

    def __init__(self, split: WeightSplit, values: dict[str, np.ndarray], outputs: list[str]) -> None:
        self.values = values
        self.outputs = outputs

        def switched(m: onnx.ModelProto) -> None:
            # each switch placed right after the node whose output it chooses from
            # (onnxruntime wants the nodes in an order they can run in)
            nodes: list[onnx.NodeProto] = []
            for node in m.graph.node:
                n = onnx.NodeProto()
                n.CopyFrom(node)
                nodes.append(n)
                for k, t in enumerate(n.output):
                    if t in values:
                        n.output[k] = t + _SUFFIX
                        nodes.append(onnx.helper.make_node("Where", [t + _USE, t + _DEVICE, t + _SUFFIX], [t],
                                                           name=t + _USE))
            if sum(n.op_type == "Where" and n.name.endswith(_USE) for n in nodes) != len(values):
                raise ValueError("not every tensor is a node's output")    # a graph input: re-run on its own
            del m.graph.node[:]
            m.graph.node.extend(nodes)
            for t, v in values.items():
                m.graph.input.append(onnx.helper.make_tensor_value_info(
                    t + _DEVICE, onnx.helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape)))
                m.graph.input.append(onnx.helper.make_tensor_value_info(t + _USE, onnx.TensorProto.BOOL, []))

        self.session = reference_session(split, edit=switched, quiet=True)
        self._off = {t + _USE: np.array(False) for t in values}
        self._fed = {t + _DEVICE: v for t, v in values.items()}

    def takes(self, tensor: str, value: np.ndarray) -> bool:
        held = self.values.get(tensor)
        return held is not None and held.shape == value.shape and held.dtype == value.dtype

    def run(self, tensor: str, value: np.ndarray, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        use = dict(self._off)
        use[tensor + _USE] = np.array(True)
        fed = {**self._fed, tensor + _DEVICE: value}
        return dict(zip(self.outputs, self.session.run(self.outputs, {**feeds, **fed, **use})))


_DEVICE = "::layerdiff-device"
_USE = "::layerdiff-use"
