"""What a job gathers about failing nodes while tensors stream in: device
values for isolated re-runs, and for each failing node, once what it reads
is settled, its isolated error, layout and axis evidence; the input ranges
of quantized ops (layerdiff.analyzer.diagnose.verdicts decides from them)."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from layerdiff.analyzer.compare.squares import pair_square_sums
from layerdiff.analyzer.diagnose import errormodel as EM
from layerdiff.analyzer.diagnose.evidence import (
    core_mask,
    fmt,
    layout_match,
    may_be_uneven,
    median,
    quant_grid,
    uneven_axis,
)
from layerdiff.analyzer.diagnose.isolation import DeviceValues, IsolationUnavailable, run_group_isolated, run_isolated
from layerdiff.analyzer.diagnose.verdicts import QUANT_OPS

if TYPE_CHECKING:
    from layerdiff.analyzer.compare import metrics as M
    from layerdiff.analyzer.report.files import Row
    from layerdiff.common.schema import BufferLease


@dataclass
class _Waiting:
    """A failing node output whose examination waits for what it reads."""
    row: Row
    ref: np.ndarray
    dev: np.ndarray
    lease: BufferLease | None
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
                 groups: dict[str, list[str]] | None = None, injected=None,
                 policy: EM.ErrorPolicy | None = None) -> None:
        """``groups``: reference tensor -> the reference nodes a fused device
        node computes as one kernel (graph alignment); such a tensor's node
        is examined, and re-run alone, as that group. ``injected``
        (impact.InjectedValues): keeps the device value of every examined
        node whose error is not plainly inherited, for the impact re-runs.
        ``policy``: the device's precision as the job knows it (the error
        model's budgets)."""
        self.reference = reference
        self.policy = policy or EM.ErrorPolicy(quantized=quantized, layout=getattr(reference, "layout", "NCHW"))
        self.blocks_of: dict = {}      # tensor, or (node, input index), -> the worst block of its error
        self.norms_of: dict = {}       # (node, 0) of a row normalization -> the error it read, in its units
        self.errors_of: dict = {}      # the same -> (relative RMS error, RMS error), mask-like values left out
        self._k: dict[str, int | None] = {}
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

    def keep_output(self, tensor: str, arr: np.ndarray, lease: BufferLease | None = None) -> bool:
        return self.values.keep_output(tensor, arr, lease)

    def keep_input(self, node: str, slot: int, arr: np.ndarray, lease: BufferLease | None = None) -> bool:
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

    def row_done(self, row, ref: np.ndarray, dev: np.ndarray, lease, tol, force_compare: bool,
                 stats: ErrorStats | None = None) -> None:
        """A comparison is finished: note its metrics, examine the node if it
        fails (now, or once what it reads is settled), and settle it for the
        nodes that read it. ``stats``: its error model figures, where they
        were made beside the comparison."""
        key = (row.site.node, row.site.output_index) if row.is_input else row.site.tensor
        self.metrics_of[key] = row.outcome.metrics
        if not row.is_constant:
            self.policy.seen(row.device_dtype)
        self._error_stats(row, ref, dev, force_compare, stats)
        self.blocks_of[key] = row.block
        if row.norm_read is not None:
            self.norms_of[key] = row.norm_read
        self.errors_of[key] = (row.rel_err, row.abs_err, row.outcome.metrics.ref_rms if not row.masked else 0.0)
        if not row.is_input and not row.is_constant:
            self.judge_budget(row)
        if not row.is_input:
            if self.worth_a_look(row):
                row.looked = True
                missing = self._reads(self.unit(row.site)) - self._settled
                if missing:
                    self._wait(_Waiting(row, ref, dev, lease.retain() if lease is not None else None, tol,
                                        force_compare, missing))
                else:
                    self.examine(row, ref, dev, tol, force_compare, lease)
                    self._unit_done(row.site)
            else:
                self._unit_done(row.site)
        self.settle(key)

    def stats_for(self, site, is_input: bool) -> Callable[..., ErrorStats]:
        """The error model's figures of a compared tensor (a node's output,
        or with ``is_input`` what it read), as a function of the two tensors
        alone (and, where it was made first, their comparison's metrics):
        made beside the comparison, on another thread."""
        return partial(error_stats, layout=self.policy.layout,
                       norm_by=EM.row_norm(site.op_type) if is_input and site.output_index == 0 else "",
                       grid=self.policy.quantized and not site.is_constant)

    def _error_stats(self, row, ref: np.ndarray, dev: np.ndarray, force_compare: bool,
                     stats: ErrorStats | None = None) -> None:
        """The error model's view of a compared tensor (``stats``: made
        already, beside its comparison) on the row."""
        if stats is None:
            stats = self.stats_for(row.site, row.is_input)(ref, dev, force_compare, row.outcome.metrics)
        stats.apply(row)
        if row.quant_step and self.injected is not None and not row.is_input and stats.device is not None \
                and stats.device.shape == ref.shape:
            rms = row.abs_err / row.rel_err if row.masked and row.rel_err else row.outcome.metrics.ref_rms
            if EM.quant_break(row.quant_step, rms, row.rel_err):
                self.injected.keep(row.site.tensor, stats.device)      # a break: its impact is measured

    def judge_budget(self, row, final: bool = False) -> None:
        """The precision the node computed in and the error its own
        arithmetic explains (ρ, the magnitudes, where its re-run gave them).
        While the stream is under way the budget is the strict one (from
        the node's own type and the job's precision: what is examined does
        not depend on the order tensors arrive in); ``final``: at the end,
        with every type the device stored in known, for the verdicts."""
        site = row.site
        prec, why = self.policy.precision_of(site.node, site.op_type, row.device_dtype, strict=not final)
        row.precision, row.precision_from = prec.name, why
        rho = row.budget.rho if row.budget is not None and row.budget.rho != 1.0 else None
        # K too only at the end: the shapes it is read from may not have arrived
        scale = row.outcome.metrics.ref_rms if not row.masked else (row.abs_err / row.rel_err if row.rel_err else 0.0)
        row.budget = EM.budget(site.op_type, prec, self.reduction_length(site) if final else None, rho,
                               step=row.quant_step, scale=scale)

    def worth_a_look(self, row) -> bool:
        """Whether the node's error needs a closer look: past the seed's
        tolerance, or more than its own arithmetic explains anywhere."""
        if row.is_constant or row.is_input:
            return False
        m = row.outcome.metrics
        if row.failed or m.dev_nan + m.dev_inf:
            return True
        allowed = EM.allowed(row.budget)
        return row.rel_err > allowed or (row.block is not None and row.block.rel > allowed) \
            or any(EM.local_own(b, row.budget, k_unknown=True) for b in row.blocks)

    def reduction_length(self, site) -> int | None:
        """K of the reference node (its reduction length), from the model's
        graph and the shapes compared; None where nothing says."""
        if site.node in self._k:
            return self._k[site.node]
        k = None
        model = getattr(self.reference, "model", None)
        nodes = model.graph.node if model is not None else ()
        if 0 <= site.order < len(nodes) and nodes[site.order].name in (site.node, ""):
            node = nodes[site.order]
            shapes: dict[str, tuple] = {}
            weights: dict[str, tuple] = {}
            for t in node.input:
                if not t:
                    continue
                m = self.metrics_of.get(t)
                if m is not None:
                    shapes[t] = tuple(m.shape)
                elif t in self.feeds:
                    shapes[t] = tuple(np.shape(self.feeds[t]))
                else:
                    w = self._weight(t)
                    if w is not None:
                        weights[t] = tuple(w.shape)
                        if w.dtype.kind == "i" and w.ndim <= 1:     # Reduce*'s axes given as an input
                            weights["__axes__" + t] = tuple(int(a) for a in np.ravel(w))
            k = EM.onnx_reduction_length(node, shapes, weights)
        elif hasattr(self.reference, "about"):
            # a dump: what it recorded of the call (a PyTorch module's configuration, an operator's arguments)
            about = self.reference.about(site.node)
            shapes_in = [tuple(m.shape) for m in (self.metrics_of.get((site.node, i)) for i in range(8))
                         if m is not None]
            attrs = dict(about.get("attrs") or {})
            attrs["class"] = site.op_type
            args = about.get("args")
            if isinstance(args, list) and args and isinstance(args[0], list):
                attrs["positional"] = args[0]
            k = EM.torch_reduction_length(site.op_type, shapes_in, attrs)
        if k is not None:       # shapes not yet seen may still come
            self._k[site.node] = k
        return k

    def _wait(self, w: _Waiting) -> None:
        self._waiting[id(w)] = w
        self._waiting_bytes += w.ref.nbytes + w.dev.nbytes
        while self._waiting_bytes > self.wait_cap and self._waiting:
            self._run_waiting(next(iter(self._waiting)))

    def _run_waiting(self, wid: int) -> None:
        w = self._waiting.pop(wid)
        self._waiting_bytes -= w.ref.nbytes + w.dev.nbytes
        try:
            self.examine(w.row, w.ref, w.dev, w.tol, w.force_compare, w.lease)
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

    def read_errors(self, row) -> tuple[float, float, float] | None:
        """What the node read, as the error model needs it: the largest
        relative RMS error, the summed RMS errors over the output's RMS
        (what an element-wise op can pass on in absolute terms), and the
        largest relative error of a block; None where some of it was not
        compared."""
        rel, abs_sum, block = 0.0, 0.0, 0.0
        seen = False
        out_rms = row.outcome.metrics.ref_rms if not row.masked else 0.0
        for node, k, t in self._external_reads(self.unit(row.site)):
            key = (node, k) if (node, k) in self.errors_of else t
            x = self.errors_of.get(key)
            if x is None:
                return None
            seen = True
            n = self.norms_of.get(key)
            if n is not None:       # a row normalization: what it read, in its output's units
                rel, block = max(rel, n[0]), max(block, n[1])
            if math.isfinite(x[0]):
                rel = max(rel, x[0])
            if math.isfinite(x[1]):
                abs_sum += x[1]
            b = self.blocks_of.get(key)
            block = max(block, (b.rel if b is not None else EM.UNCUT_BLOCK * x[0]) * EM.scale_ratio(x[2], out_rms))
        if not seen:
            return None
        spread = abs_sum / out_rms if out_rms > 0 and math.isfinite(out_rms) else rel
        return rel, spread, block

    def inherited(self, row) -> str:
        """A sentence when the node's error is no more than what it read and
        its own rounding explain, so it needs no closer look; '' when it
        does (its error grew, or what it read is unknown)."""
        m = row.outcome.metrics
        read = self.read_errors(row)
        if read is None:
            return ""
        rel_in, spread, block_in = read
        row.read_rel = rel_in
        reads = [self.metrics_of.get((n, k)) or self.metrics_of.get(t)
                 for n, k, t in self._external_reads(self.unit(row.site))]
        if m.dev_nan + m.dev_inf > max((x.dev_nan + x.dev_inf for x in reads if x is not None), default=0):
            return ""
        if rel_in > EM.READ_TOO_FAR:
            return ""
        allowed = EM.allowed(row.budget)
        carried = max(rel_in, spread)
        if row.rel_err > EM.GROWTH * carried + allowed:
            return ""
        if row.block is not None and row.block.rel > EM.GROWTH * max(block_in, carried) + allowed:
            return ""
        if any(EM.local_own(b, row.budget, k_unknown=True) for b in row.blocks):
            return ""
        return inherited_words(row)

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
        return e, (f"the RMSE INT8 rounding gives over its reduction of {k} (weight step {fmt(s_w)}, input step "
                   f"{fmt(s_x)}): {fmt(e)}")

    def examine(self, row, ref: np.ndarray, dev: np.ndarray, tol, force_compare: bool,
                lease: BufferLease | None = None) -> None:
        """Fill the row's evidence (a failing output row). A node whose error
        is plainly inherited is not re-run: the closer look costs a pass over
        its tensors and a session of its own. ``lease``: the receive buffer
        ``dev`` lies in, where it does."""
        with np.errstate(all="ignore"):
            self._examine(row, ref, dev, tol, force_compare, lease)

    def _examine(self, row, ref: np.ndarray, dev: np.ndarray, tol, force_compare: bool,
                 lease: BufferLease | None) -> None:
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
            self.injected.keep(site.tensor, dev_aligned, lease if np.may_share_memory(dev_aligned, dev) else None)
        axes = getattr(self.reference, "layout", "NCHW")   # TensorFlow references are NHWC
        if may_be_uneven(row.outcome.metrics):
            row.uneven = uneven_axis(ref, dev_aligned, axes if ref.ndim == 4 else "")
            row.layout = layout_match(ref, dev_aligned, row.outcome.metrics)
        try:
            # A reference that is not ONNX (TensorFlow) re-runs its own op.
            isolate = getattr(self.reference, "run_isolated", None)
            onnx_model = getattr(self.reference, "model", None)
            if onnx_model is not None and not hasattr(onnx_model, "graph"):
                onnx_model = None
            group = self.groups.get(site.tensor)
            if onnx_model is not None:
                unit = group or [site.node]
                grown = self._reach_back(unit)
                if grown is not None:
                    row.unit_note = ("re-run together with " + ", ".join(n for n in grown if n not in unit)
                                     + ", whose outputs the device did not send")
                    group = grown
                    isolate = None      # the group runs on the model's graph
            if group and not isolate and onnx_model is not None:
                device = {t: self.values.outputs[t][0] for _, _, t in self._external_reads(group)
                          if t in self.values.outputs}
                device.update({t: self.values.inputs[(n, k)][0] for n, k, t in self._external_reads(group)
                               if (n, k) in self.values.inputs})
                iso = run_group_isolated(getattr(self.reference, "split", onnx_model),
                                         [self._index[n] for n in group], device, self.feeds)[site.tensor]
            else:
                outs = isolate(site, self.values.inputs_of(site.node), self.feeds) if isolate else \
                    run_isolated(getattr(self.reference, "split", self.reference.model), site.order,
                                 self.values.inputs_of(site.node), self.feeds)
                iso = outs[site.output_index]
            row.isolated = compare_node(iso, dev, tol, 0, force_compare).metrics
            row.weight_range = self.weights_beyond_range(row)
            if row.quant_step and iso.shape == dev_aligned.shape:
                # what it computed from what it read, clipped at its grid's ends
                row.clipped = _clipped(iso, dev_aligned, row.quant_step, "its re-run on its device inputs") \
                    or row.clipped
            if iso.shape == dev_aligned.shape and iso.dtype.kind == "f":
                # the error the node adds itself, never made whole (a tensor's
                # worth of memory per examined node, at the analyzer's peak)
                row.own_rel = _own_rel(row.isolated, iso, dev_aligned)
                row.own_block = EM.worst_blocks(None, iso, axes if iso.ndim == 4 else "", dev=dev_aligned)[0]
                self._magnitudes(row, iso)
            # the exact mask-like values, where the error model's sample of
            # the reference saw some (a full median is a sort of the tensor)
            keep, thr = core_mask(ref) if row.masked else (None, math.nan)
            if keep is not None and iso.shape == dev_aligned.shape:
                row.isolated_core = compare_node(np.asarray(iso).reshape(-1)[keep],
                                                 np.asarray(dev_aligned).reshape(-1)[keep], tol, 0).metrics
                row.core_note = (f"{int((~keep).sum())} mask-like values (|x| > {thr:.3g}) left out, "
                                 f"{int(keep.sum())} compared")
            if self.quantized:
                row.int8_bound = self._int8_bound(site)
            if not row.layout:
                row.layout = layout_match(iso, dev_aligned, row.isolated) if iso.shape == dev_aligned.shape else ""
        except (IsolationUnavailable, SkipNode, IndexError, KeyError) as e:
            row.isolation_note = str(e) or type(e).__name__

    def weights_beyond_range(self, row) -> str:
        """The node's weights that its precision cannot hold (beyond the
        largest value of what it stores in): a device must clamp them."""
        prec = self.policy.precision_of(row.site.node, row.site.op_type, row.device_dtype)[0]
        out = []
        for t in self.reference.node_inputs.get(row.site.node, []):
            if not t or t not in self.reference.constants_read(row.site.node):
                continue
            w = self._weight(t)
            if w is None or w.dtype.kind != "f" or not w.size:
                continue
            top = float(np.max(np.abs(np.where(np.isfinite(w), w, 0))))
            if top > prec.max_finite:
                out.append(f"{t} holds values up to {top:.3g}, beyond the {prec.max_finite:g} {prec.name} can hold")
        return "; ".join(out)

    def _reach_back(self, nodes: list[str], most: int = 8) -> list[str] | None:
        """The unit grown backwards through what it reads that the device did
        not send (fused or not dumped): the producers of those tensors join
        it, in execution order, until every tensor it reads from outside has
        a device value, or is a model input or a weight. None when nothing
        is missing, when it would take more than ``most`` nodes, or when a
        missing tensor has no producer."""
        if getattr(self.reference, "model", None) is None:
            return None
        producer = {s.tensor: s.node for s in self.reference.sites}
        unit = list(nodes)
        while True:
            missing = [t for n, k, t in self._external_reads(unit)
                       if t not in self.values.outputs and (n, k) not in self.values.inputs]
            if not missing:
                return None if unit == list(nodes) else sorted(unit, key=lambda n: self._index.get(n, -1))
            for t in missing:
                p = producer.get(t)
                if p is None:
                    return None
                if p not in unit:
                    unit.append(p)
            if len(unit) > most:
                return None

    def _magnitudes(self, row, iso: np.ndarray) -> None:
        """A product's budget with its magnitudes: ρ from the device input it
        read, the reference's weight and its re-run output (cancellation
        between its products makes rounding count for more)."""
        site = row.site
        if EM.op_kind(site.op_type) != "product" or row.budget is None:
            return
        model = getattr(self.reference, "model", None)
        if model is None or not 0 <= site.order < len(model.graph.node):
            return
        node = model.graph.node[site.order]
        x = self.values.inputs_of(site.node).get(0)
        w = self._weight(node.input[1]) if len(node.input) > 1 else None
        if x is None or w is None:
            return
        bias = self._weight(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        attrs = {a.name: onnx_attr(a) for a in node.attribute}
        rho = EM.product_rho(site.op_type, x, w, iso, attrs, bias)
        if rho is not None:
            prec = self.policy.precision_of(site.node, site.op_type, row.device_dtype)[0]
            row.budget = EM.budget(site.op_type, prec, row.budget.k, rho)


def onnx_attr(a):
    from onnx import helper

    return helper.get_attribute_value(a)


def inherited_words(row) -> str:
    """Why a node's error is what it read (its budget as it stands)."""
    own = row.budget.explains() if row.budget is not None else "its precision"
    masked = f" ({row.masked} mask-like reference values left out)" if row.masked else ""
    return (f"relative RMS error {fmt(row.rel_err)} here{masked} against {fmt(row.read_rel or 0.0)} in what it "
            f"read: no more than what it read and its own rounding ({own}) explain")


@dataclass
class ErrorStats:
    """The error model's figures of one compared tensor (see error_stats),
    put on its row by ``apply``."""
    block: EM.Block | None = None
    axis_block: EM.Block | None = None
    masked: int = 0
    err_rel: float | None = None
    err_rms: float | None = None
    norm_read: tuple[float, float] | None = None
    quant_step: float = 0.0
    quant_levels: int = 0
    clipped: str = ""
    device: np.ndarray | None = None     # the device tensor in the reference's layout, where on a grid

    def apply(self, row) -> None:
        row.block, row.axis_block = self.block, self.axis_block
        if self.masked:
            row.masked, row.err_rel, row.err_rms = self.masked, self.err_rel, self.err_rms
        if self.norm_read is not None:
            row.norm_read = self.norm_read
        if self.quant_step:
            row.quant_step, row.quant_levels, row.clipped = self.quant_step, self.quant_levels, self.clipped


# values taken for the median magnitude error_stats tells mask values by
MEDIAN_SAMPLE = 4096


def error_stats(ref: np.ndarray, dev: np.ndarray, force_compare: bool, metrics: M.NodeMetrics | None = None, *,
                layout: str = "NCHW", norm_by: str = "", grid: bool = False) -> ErrorStats:
    """The error model's view of a compared tensor: the part of it with
    the largest relative error (a group of channels, a tile), and where
    the reference holds mask-like values (|x| above 1000 times the
    median magnitude: -3.4e38 or -1e4 of an additive attention mask),
    or sentinels beyond 1e30 (finfo.min), its relative and RMS errors
    without them: a mask clamped or saturated says nothing of how the
    rest was computed. ``norm_by``: the normalization the node applies to
    what it reads (EM.normalized_read); ``grid``: look for the INT8 grid
    the device values lie on. A function of the two tensors alone;
    ``metrics``, their comparison where it was made first, spares a look
    for mask values when it says there can be none."""
    from layerdiff.analyzer.compare.node import SkipNode, reconcile

    out = ErrorStats()
    if ref.dtype.kind != "f" or ref.size < 16:
        return out
    try:
        d, _ = reconcile(ref, dev, force_compare)
    except SkipNode:
        return out
    wide = np.float64 if ref.dtype == np.float64 else np.float32
    with np.errstate(all="ignore"):
        # the error made whole only where more than its block sums is read
        err = np.subtract(d, ref, dtype=wide) if norm_by else None
        # a strided sample of a few thousand values: its median is as good a
        # scale for telling mask values (1000x it) as a larger one, and the
        # gather touches a cache line per value
        step = max(1, ref.size // MEDIAN_SAMPLE)
        # a strided view where the tensor is contiguous (flat's iterator
        # holds the interpreter for every value it steps over)
        sample = np.abs(ref.reshape(-1)[::step] if ref.flags.c_contiguous else ref.flat[::step])
        sample = sample[np.isfinite(sample)]
        med = median(sample) if sample.size else 0.0
        unmasked, first = _without_masks(ref, d, layout, med, metrics) if err is None else (False, None)
        if unmasked:
            top = 0.0       # nothing to mask
        else:
            # the largest finite magnitude: two passes and no copy where
            # every value is finite, the usual case
            hi, lo = float(np.max(ref)), float(np.min(ref))
            top = max(hi, -lo) if math.isfinite(hi) and math.isfinite(lo) else \
                float(np.max(np.where(np.isfinite(ref), np.abs(ref), 0)))
        r = ref
        # sentinels: the -3.4e38 (finfo.min) of a mask, whatever the median
        # (a mask tensor is zeros and sentinels); a device saturates them
        limit = 1e30
        if (med > 0 and top > 1e3 * med) or top >= limit:
            mag = np.abs(ref)
            keep = np.isfinite(mag) & (mag < limit)
            if med > 0:
                keep &= mag <= 1e3 * med
            err = np.where(keep, err if err is not None else np.subtract(d, ref, dtype=wide), 0)
            r = np.where(keep, ref, 0)
            n = int(np.count_nonzero(keep))
            out.masked = int(ref.size - n)
            out.err_rel = EM.rel_rms(err, r)
            out.err_rms = float(np.sqrt(np.sum(np.square(err, dtype=np.float64)) / max(n, 1)))
    if ref.size >= 64:
        out.block, out.axis_block = EM.worst_blocks(err, r, layout if ref.ndim == 4 else "",
                                                    dev=d if err is None else None,
                                                    first_sums=first)
    if norm_by:
        assert err is not None      # made above for a read the node normalizes
        out.norm_read = EM.normalized_read(err, r, norm_by)
    if grid:
        found = quant_grid(d)        # an INT8 hand-over: the step its values lie on
        if found is not None:
            out.quant_step, out.quant_levels = found
            out.clipped = _clipped(ref, d, out.quant_step)
            out.device = d
    return out


def _without_masks(ref: np.ndarray, dev: np.ndarray, layout: str, med: float,
                   metrics: M.NodeMetrics | None) -> tuple[bool, tuple | None]:
    """Whether the reference holds no mask value (none beyond 1000 times
    the median magnitude ``med``, none reaching 1e30), told without a look
    at every value for the largest where the comparison ``metrics`` shows
    them all finite and within FP16's range (the usual case): a sum of
    squares is at least each of its squares, and the error model's first
    sums (worst_blocks' first cut) hold two sets of them, the smaller of
    whose largest bounds max |x|^2. (True, those sums or None where none
    were needed), or (False, None) where it cannot be told so."""
    if metrics is None or metrics.ref_nan or metrics.ref_inf or metrics.fp16_overflow:
        return False, None
    if not med > 0:
        return True, None       # no value reaches 1e30, the only mark of a mask then
    if ref.size < 64:       # no sums made for a tensor too small to cut
        return False, None
    got = pair_square_sums(ref, dev, *EM.first_cut(ref.shape, layout if ref.ndim == 4 else ""))
    if got is None:         # types it does not take: the error is made whole
        return False, None
    bound = min(float(got[0][1].max()), float(got[1][1].max()))
    # the squares were taken in float32 (a relative 2**-24 each): a margin well past it
    return (True, got) if bound <= (1e3 * med) ** 2 * (1 - 1e-5) else (False, None)


def _own_rel(m: M.NodeMetrics, iso: np.ndarray, dev: np.ndarray) -> float:
    """||dev - iso|| / ||iso|| over the finite pairs (EM.rel_rms): the
    re-run's comparison ``m`` holds it where every value is finite
    (rel_euclidean, undefined where both are zero: rel_rms's 0 then);
    else from the error made whole."""
    if not (m.ref_nan + m.ref_inf + m.dev_nan + m.dev_inf):
        return 0.0 if math.isnan(m.rel_euclidean) else m.rel_euclidean
    with np.errstate(all="ignore"):
        return EM.rel_rms(np.subtract(dev, iso, dtype=np.float32), iso)


def _clipped(ref: np.ndarray, dev: np.ndarray, step: float, what: str = "the reference") -> str:
    """Where an INT8 hand-over saturates: device values at the grid's ends
    whose reference (or the node re-run on its device inputs) lies more
    than a step beyond them (a range calibrated too narrow clips its
    outliers). A sentence, or ''."""
    with np.errstate(all="ignore"):
        d = np.asarray(dev, np.float64).ravel()
        r = np.asarray(ref, np.float64).ravel()
        ok = np.isfinite(d) & np.isfinite(r)
        if not ok.any():
            return ""
        lo, hi = float(d[ok].min()), float(d[ok].max())
        over = ok & (d >= hi) & (r > hi + step)
        under = ok & (d <= lo) & (r < lo - step)
        n = int(over.sum() + under.sum())
        if not n:
            return ""
        reach = float(np.max(np.abs(r[over | under])))
    return (f"{n} values beyond its INT8 range [{lo:.3g}, {hi:.3g}] are clipped to its ends ({what} reaches "
            f"{reach:.3g}): the range was calibrated too narrow")
