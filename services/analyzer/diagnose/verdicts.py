"""Why a node's error is what it is: a verdict for every node whose error
needed a look, with its evidence, from the error model
(layerdiff.analyzer.diagnose.errormodel).

- **computation error**: the node adds more error than its precision
  explains by the stated factor, over the whole tensor or a block of it (a
  broken kernel, a wrong weight, a layout mix-up, an overflow, an INT8 step
  that destroys what it carries);
- **accumulated precision error**: its error is what it read plus what its
  own arithmetic explains;
- **no verdict**: more error than its own arithmetic explains, and nothing
  to tell its own part from what it read (what it read was not compared,
  and it could not be re-run).

The error a node adds is measured against its *isolated* re-run: the
reference node (or the group a fused device kernel, or tensors the device
did not send, make it part of) computed alone in FP32 on the device's own
inputs, or a PyTorch operator replayed from its recorded arguments. Without
one (two dumps, no model) it is what its error grew by beyond what it read
could pass on, per op kind. The seed's allclose (errors/total past
atol/rtol) is reported beside, never the judgement.

NaN and Inf get their own reasoning: NaN on both sides is a model or input
problem (named where the reference first has it). On the device only, NaN
from finite inputs is an *invalid operation* (sqrt or log of a negative,
0/0, a negative epsilon); Inf is an *overflow*, and where the device computes
in FP16 it is named at the first node whose reference leaves the FP16 range
(|x| > 65504). FP16 range is never mentioned for a device that does not
compute in FP16.

A computation error is not yet the answer: its effect on the model's
outputs is measured (layerdiff.analyzer.diagnose.impact), and the first
*harmful* one heads the report; the ones the outputs absorb are listed as
benign. Rounding the precision explains is never the headline:
"accumulated precision error" heads it only when the outputs leave their
tolerance (``outputs_out_of_tolerance``), and the exit status says what the
headline says (``exit_of``).

Beside this module: the isolated re-run (``isolation``, ``replay``), what a
node's own tensors show (``evidence``) and what a job gathers for the
verdicts while tensors stream in (``examiner``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from layerdiff.analyzer.diagnose import errormodel as EM
from layerdiff.analyzer.diagnose.evidence import fmt
from layerdiff.analyzer.diagnose.evidence import uneven_axis as uneven_axis  # re-exported: read as verdicts.uneven_axis

if TYPE_CHECKING:
    from layerdiff.analyzer.diagnose.impact import Impact

COMPUTATION = "computation error"
ACCUMULATED = "accumulated precision error"
# what the node read was not compared (not dumped, skipped, excluded) and it
# could not be re-run alone: nothing tells its own error from an inherited one
UNDECIDED = "no verdict"
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


@dataclass
class Finding:
    verdict: str = ""
    cause: str = ""
    evidence: list[str] = field(default_factory=list)
    impact: Impact | None = None      # of a computation error on the model's outputs
    hand_over: list = field(default_factory=list)   # cause quantization: the nodes its INT8 output feeds
    local: bool = False              # decided by a block of the tensor (a tile, a group of channels)

    @property
    def benign(self) -> bool:
        """A computation error whose effect the outputs are shown to absorb."""
        return self.verdict == COMPUTATION and self.impact is not None and self.impact.harmful is False


def decide(rows: list, producer_rows: dict[str, list], quantized: bool = False,
           weight_issues: dict[str, list[str]] | None = None,
           unknown_reads: set[str] | None = None, order_unknown: str = "") -> dict[int, Finding]:
    """Findings for the node outputs whose error needed a look (by id(row)):
    past the seed's tolerance, or more than their own arithmetic explains
    (``row.looked``; rows without the error model's figures: failing ones).

    The verdict is the error model's: a node is a computation error when the
    error it adds itself (against its isolated re-run, or what its error
    grew by beyond what it read) exceeds what its precision explains by the
    stated factor (errormodel.FACTOR), over the whole tensor or a block of
    it; otherwise its error is precision loss (accumulated). The seed's
    allclose decides nothing here. ``producer_rows`` maps a node to the rows
    of the tensors it reads; ``weight_issues``: node -> the weights the
    device model holds wrongly (weights.issues); ``unknown_reads``: nodes
    whose inputs no side holds (the first node of a golden dump compared
    without a model), presumed equal; ``order_unknown``: why the golden
    dump has no execution order, where it has none: a node whose reads no
    dump records then has no verdict (nothing says what it read)."""
    weight_issues = weight_issues or {}
    unknown_reads = unknown_reads or set()
    out: dict[int, Finding] = {}
    for row in rows:
        if row.is_input or row.is_constant or not (row.looked or (row.budget is None and row.failed)):
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
        budget = row.budget
        allowed = EM.allowed(budget)
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
        elif quantized and _quant_break(row):
            # the INT8 hand-over itself: a step coarser than the values it carries
            f.verdict, f.cause = COMPUTATION, "quantization"
            scale = _core_rms(row)
            f.evidence.append(f"its output reaches the next node in INT8 on a grid of {row.quant_levels} levels "
                              f"{fmt(row.quant_step)} apart (read from the device values), coarser than the values "
                              f"it carries (RMS {fmt(scale)}"
                              + (f", {row.masked} mask-like values left out" if row.masked else "")
                              + f"): the quantization scale destroys them (relative RMS error {fmt(row.rel_err)}); "
                              f"a scale for their own range (about ±{fmt(4 * scale)}: a step of about "
                              f"{fmt(_fitting_step(row))}) keeps them; the node reading it gets the wrong input")
        elif row.inherited and weight_issues.get(row.site.node) and not quantized and row.rel_err > allowed:
            # what it read explains the size of its error, but its weights are
            # known to differ: it computes something else (impact says if it matters)
            f.verdict = COMPUTATION
            f.evidence.append(f"{row.inherited}; but it computes with other weights than the reference")
        elif row.inherited:
            f.verdict = ACCUMULATED
            f.evidence.append(row.inherited)
        elif _within_own(row, allowed):
            f.verdict = ACCUMULATED
            f.evidence.append(f"relative RMS error {fmt(row.rel_err)}{_masked_words(row)}, within what its own "
                              f"arithmetic explains even from exact inputs ({_explains(budget)}; {EM.FACTOR:g}x "
                              "allowed)")
        elif row.isolated is not None and row.own_rel is not None:
            _judge_own(row, f, quantized)
            if row.unit_note:
                f.evidence.append(row.unit_note)
        elif row.isolated is not None:
            # re-run alone but not comparable element by element (a layout the
            # device changed): the isolated metrics speak
            iso = _core(row)
            gross = (not math.isnan(iso.cosine) and iso.cosine < (0.99 if quantized else 0.999))
            f.verdict = COMPUTATION if gross else ACCUMULATED
            f.evidence.append(f"re-run alone on its device inputs: cosine {fmt(iso.cosine)}, mean relative error "
                              f"{fmt(iso.mean_rel_err)}{_core_words(row)}")
        elif order_unknown and not activations:
            f.verdict = UNDECIDED
            f.evidence.append(f"what it read is unknown: the reference dump has no execution order "
                              f"({order_unknown}) and no dump records its inputs (give the model with --model, "
                              "or dump with dump_mode all)")
        elif row.site.node in unknown_reads and not activations:
            if row.rel_err > allowed:
                f.verdict = COMPUTATION
                f.evidence.append(f"relative RMS error {fmt(row.rel_err)} on its output, from inputs that neither "
                                  f"dump holds (presumed equal on both sides); {_explains(budget)}: "
                                  f"{_times(row.rel_err, budget)}")
            else:
                f.verdict = ACCUMULATED
                f.evidence.append(f"relative RMS error {fmt(row.rel_err)}, within what {_explains(budget)}, from "
                                  "inputs that neither dump holds (presumed equal)")
            if row.isolation_note:
                f.evidence.append(f"no isolated re-run: {row.isolation_note}")
        elif unseen := _unseen_reads(row, activations):
            f.verdict = UNDECIDED
            f.evidence.append(f"what it read was not compared ({unseen}: not dumped, skipped or excluded), so "
                              "nothing tells an error of its own from an inherited one")
            if row.isolation_note:
                f.evidence.append(f"no isolated re-run: {row.isolation_note}")
        else:
            _judge_growth(row, f, activations)
            if row.isolation_note:
                f.evidence.append(f"no isolated re-run: {row.isolation_note}")
        if row.layout and f.verdict == COMPUTATION:
            f.cause = f.cause or "layout"
            f.evidence.append(row.layout)
        if f.verdict == COMPUTATION and weight_issues.get(row.site.node):
            issues = weight_issues[row.site.node]
            # a differing attribute (epsilon, axis) is a parameter, a differing tensor a weight
            params = all("(attribute)" in text for text in issues)
            f.cause = f.cause or ("parameter" if params else "weight")
            f.evidence.append(f"the device model's {'parameters' if params else 'weights'} differ from the "
                              "reference's: " + "; ".join(issues))
        if row.clipped and f.verdict == COMPUTATION:
            f.cause = f.cause or "quantization"
            f.evidence.append(row.clipped)
        if row.weight_range and f.verdict == COMPUTATION:
            f.cause = f.cause or "range"
            f.evidence.append(f"its weights do not fit what it computes in: {row.weight_range}")
        if row.uneven and f.verdict == COMPUTATION:
            f.evidence.append(row.uneven)
        if bad_weights and f.verdict == COMPUTATION:
            f.cause = f.cause or "weight"
            f.evidence.append("its weights differ on the device: " + ", ".join(
                f"{r.site.tensor} ({r.outcome.metrics.errors}/{r.outcome.metrics.total} outside tolerance"
                + (f", {r.outcome.metrics.fp16_overflow} beyond the FP16 range" if r.outcome.metrics.fp16_overflow
                   else "") + ")" for r in bad_weights))
        if f.verdict == COMPUTATION and not f.cause and quantized and not f.local and (rounded_weights or (
                row.isolated is not None and _core(row).sqnr_db >= QUANT_LOSS_SQNR_DB)):
            # its weights are the reference's up to rounding, and its own
            # error is quantization noise, only more than the answer tolerates
            f.cause = "quantization"
            if rounded_weights:
                f.evidence.append("its weights are the reference's rounded to INT8 (" + ", ".join(
                    f"{r.site.tensor}: SQNR {fmt(r.outcome.metrics.sqnr_db)} dB" for r in rounded_weights)
                    + "), and that rounding alone changes its output beyond tolerance: quantize them per channel "
                      "or run this node in INT16")
            else:
                f.evidence.append(f"its own error is quantization noise (SQNR {fmt(_core(row).sqnr_db)} dB re-run "
                                  f"alone, >= {QUANT_LOSS_SQNR_DB:g}), more than the answer tolerates: run it in "
                                  "INT16")
        if f.verdict == COMPUTATION and not f.cause:
            f.cause = "range" if fp16 and m.fp16_overflow else "kernel"
        if fp16 and m.fp16_overflow and "range" not in f.cause and f.cause != "overflow":
            f.evidence.append(f"{m.fp16_overflow} reference values lie beyond the FP16 range (65504) the device "
                              "computes in")
        if row.overflow:
            f.evidence.append(f"the device flagged this node: {row.overflow}")
        if f.verdict == ACCUMULATED and not row.failed and not row.overflow:
            continue        # rounding within tolerance: nothing to say of this node
        out[id(row)] = f
    return out


def _core_rms(row) -> float:
    """The reference's RMS of a tensor, mask-like values left out."""
    if row.masked and row.rel_err > 0:
        return row.abs_err / row.rel_err
    return row.outcome.metrics.ref_rms


def _quant_break(row) -> bool:
    return EM.quant_break(row.quant_step, _core_rms(row), row.rel_err)


def _fitting_step(row) -> float:
    """The step an 8-bit grid over the values' own range would have: about
    8 RMS (a Gaussian's ±4 sigma) over 255 levels."""
    return 8.0 * _core_rms(row) / 255.0


def _masked_words(row) -> str:
    return (f" ({row.masked} mask-like reference values, which a device saturates, left out)" if row.masked
            else "")


def _within_own(row, allowed: float) -> bool:
    """The whole error, not just the node's own, is within its budget."""
    return row.rel_err <= allowed and (row.block is None
                                       or row.block.rel <= EM.allowed(row.budget, row.block, locally=True)) \
        and not any(EM.local_own(b, row.budget) for b in row.blocks)


def _explains(budget) -> str:
    """'bf16 over K=3072 explains 4e-3' (the budget's words and figure)."""
    if budget is None:
        return f"no precision model applies (the floor is {fmt(EM.FLOOR)})"
    return budget.explains()


def _times(observed: float, budget) -> str:
    ref = budget.rel if budget is not None and budget.rel > 0 else 0.0
    if ref <= 0.0:
        return f"{fmt(observed)} where its arithmetic adds nothing"
    return f"{observed / ref:.3g}x"


def _judge_own(row, f: Finding, quantized: bool) -> None:
    """The verdict from the error the node adds itself (its device output
    against its isolated re-run), against its budget; INT8 products against
    the rounding their steps give."""
    budget = row.budget
    own = row.own_rel if row.isolated_core is None else _core_rel(row)
    allowed = EM.allowed(budget)
    bound = row.int8_bound if quantized else None
    rounding = quantized and row.quant_step and _core(row).max_abs_diff <= row.quant_step
    if quantized and (bound is not None or rounding or _core(row).sqnr_db >= INT8_SQNR_DB):
        # INT8 steps are the precision here, read from the data
        if bound is not None and _core(row).rmse <= INT8_BOUND_FACTOR * bound[0]:
            f.verdict = ACCUMULATED
            f.evidence.append(f"re-run alone on its device inputs, its own error (RMSE {fmt(_core(row).rmse)}) is "
                              f"within {INT8_BOUND_FACTOR:g} times {bound[1]} (the bound used); precision, not a "
                              "kernel bug")
            return
        if rounding:
            f.verdict = ACCUMULATED
            f.evidence.append(f"re-run alone on its device inputs, its own error (largest difference "
                              f"{fmt(_core(row).max_abs_diff)}) stays within one INT8 step of its output, "
                              f"{fmt(row.quant_step)} (read from the device values: {row.quant_levels} levels); "
                              "precision, not a kernel bug")
            return
        if _core(row).sqnr_db >= INT8_SQNR_DB:
            f.verdict = ACCUMULATED
            f.evidence.append(f"re-run alone on its device inputs, its own error has an SQNR of "
                              f"{fmt(_core(row).sqnr_db)} dB, within what INT8 rounding gives (>= {INT8_SQNR_DB:g} "
                              "dB); precision, not a kernel bug")
            return
    if own > allowed:
        f.verdict = COMPUTATION
        f.evidence.append(f"relative RMS error {fmt(own)} added here (its device output against the node re-run "
                          f"alone on its device inputs{_core_words(row)}); {_explains(budget)}: {_times(own, budget)}")
        return
    blk = row.own_block
    if blk is not None and row.isolated_core is None and (blk.rel > EM.allowed(budget, blk, locally=True)
                                                         or EM.local_own(blk, budget)):
        f.verdict = COMPUTATION
        f.local = True          # a part of its output off, the rest right: no rounding does that
        f.evidence.append(f"in {blk.where} ({blk.share:.0%} of the tensor) it adds a relative RMS error of "
                          f"{fmt(blk.rel)} (against the node re-run alone on its device inputs), "
                          f"{fmt(own)} over the whole{_contrast_words(blk)}; {_explains(budget)}: "
                          f"{_times(blk.rel, budget)}")
        return
    f.verdict = ACCUMULATED
    f.evidence.append(f"re-run alone on its device inputs it adds a relative RMS error of {fmt(own)}, within what "
                      f"its precision explains ({_explains(budget)}; {EM.FACTOR:g}x allowed): it computes "
                      f"correctly; the rest of its error ({fmt(row.rel_err)}) came in through what it read")


def _core_rel(row) -> float:
    """The relative RMS error of the isolated comparison without the
    mask-like values (rmse over the reference's RMS)."""
    core = row.isolated_core
    return core.rmse / core.ref_rms if core.ref_rms > 0 else (0.0 if core.rmse == 0 else math.inf)


def _judge_growth(row, f: Finding, activations: list) -> None:
    """No re-run alone (a golden dump without a model): the error the node
    adds is what its error grew by beyond what it read could pass on (per
    op kind, errormodel.DUMP_GROWTH times it), over the whole tensor or its
    worst block against the worst block of what it read."""
    budget = row.budget
    allowed = EM.allowed(budget)
    kind = EM.op_kind(row.site.op_type)
    grow = EM.DUMP_GROWTH.get(kind, EM.DUMP_GROWTH_DEFAULT)
    grow_block = EM.DUMP_BLOCK_GROWTH.get(kind, EM.DUMP_BLOCK_GROWTH_DEFAULT)
    rel_in = max((r.rel_err for r in activations), default=0.0)
    spread = sum(r.abs_err for r in activations)
    out_rms = row.outcome.metrics.ref_rms if not row.masked else 0.0
    carried = max(rel_in, spread / out_rms if out_rms > 0 and math.isfinite(out_rms) else rel_in)
    block_in = max(((r.block.rel if r.block is not None else EM.UNCUT_BLOCK * r.rel_err)
                    * EM.scale_ratio(r.outcome.metrics.ref_rms if not r.masked else 0.0, out_rms)
                    for r in activations), default=0.0)
    # a row normalization passes on what it read over each row's spread
    normed = [r.norm_read for r in activations if r.norm_read is not None]
    if normed:
        rel_in = max(rel_in, max(n[0] for n in normed))
        carried = max(carried, rel_in)
        block_in = max(block_in, max(n[1] for n in normed))
    if row.rel_err > grow * carried + allowed:
        f.verdict = COMPUTATION
        f.evidence.append(f"relative RMS error {fmt(row.rel_err)} here against {fmt(rel_in)} in what it read, more "
                          f"than a {row.site.op_type or 'node'} passes on ({grow:g}x) and its own rounding adds "
                          f"({_explains(budget)}): {fmt(row.rel_err - grow * carried)} of its own")
        return
    blk = row.block
    if blk is not None and blk.rel > grow_block * max(block_in, carried) + EM.allowed(budget, blk, locally=True):
        f.verdict = COMPUTATION
        f.local = True
        f.evidence.append(f"in {blk.where} ({blk.share:.0%} of the tensor) its relative RMS error is {fmt(blk.rel)}, "
                          f"against at most {fmt(max(block_in, carried))} in any part of what it read, more than a "
                          f"{row.site.op_type or 'node'} passes on ({grow_block:g}x); {_explains(budget)}")
        return
    for blk in row.blocks:
        if EM.local_own(blk, budget):
            f.verdict = COMPUTATION
            f.local = True
            f.evidence.append(f"in {blk.where} ({blk.share:.0%} of the tensor) its relative RMS error is "
                              f"{fmt(blk.rel)}{_contrast_words(blk)}; each of its output channels sums over every "
                              f"channel it read, and what it read carries at most {fmt(max(block_in, carried))} in "
                              f"any part: nothing it read singles these out; {_explains(budget)}: "
                              f"{_times(blk.rel, budget)}")
            return
    f.verdict = ACCUMULATED
    f.evidence.append(f"relative RMS error {fmt(row.rel_err)} here against {fmt(rel_in)} in what it read: no "
                      f"more than what it read and its own rounding ({_explains(budget)}) explain")


def _contrast_words(blk) -> str:
    """', 12x the rest of the tensor's (4.1e-3): ...' for a block that
    stands out of its tensor."""
    if blk.contrast <= EM.LOCAL_CONTRAST:
        return ""
    times = "infinitely many times" if math.isinf(blk.contrast) else f"{blk.contrast:.3g}x"
    return (f", {times} the rest of the tensor's ({fmt(blk.rest)}): rounding spreads over a product's channels "
            f"(no window of a clean run's passes {EM.LOCAL_CONTRAST:g}x the rest)")


def _core(row):
    """The isolated metrics to judge by: without the mask-like values where
    the reference has some (they dominate cosine and RMS), else all."""
    return row.isolated_core if row.isolated_core is not None else row.isolated


def _core_words(row) -> str:
    return f"; {row.core_note}" if row.isolated_core is not None and row.core_note else ""


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


@dataclass
class Spent:
    """The model's outputs past their tolerance, and where most of their
    error comes from: the node that adds the most to it."""
    outputs: list
    most: Any = None              # the row whose own error is the largest part of what the outputs carry
    added: float = 0.0


def outputs_out_of_tolerance(rows: list, node_inputs: dict[str, list[str]],
                             outputs: set[str] | frozenset = frozenset()) -> Spent | None:
    """The model's outputs past the seed's atol/rtol, and the node that adds
    the most relative error on the way (its own error where it was re-run
    alone, else what its error grew by beyond what it read); None when the
    outputs are within tolerance. The outputs are ``outputs`` (the graph's,
    or those a PyTorch capture marks) where any of them was compared, else
    the tensors no node reads (the last one of a dump that records no
    reads)."""
    outs = [r for r in rows if not r.is_input and not r.is_constant]
    if not outs:
        return None
    finals = [r for r in outs if r.site.tensor in outputs]
    if not finals:
        read = {t for ins in node_inputs.values() for t in ins if t}
        finals = [r for r in outs if r.site.tensor not in read] if read else [outs[-1]]
    failing = [r for r in finals if r.failed]
    if not failing:
        return None
    most, added = None, 0.0
    for r in outs:
        if r.own_rel is None and EM.op_kind(r.site.op_type) == "exact":
            continue        # a ReLU or a reshape adds nothing: what its error grew by is its scale's change
        own = r.own_rel if r.own_rel is not None else max(0.0, r.rel_err - (r.read_rel or 0.0))
        if own > added:
            most, added = r, own
    return Spent(failing, most, added)


def exit_of(first_comp, diagnosis: dict, benign: list, undecided: list, spent: Spent | None,
            first_fail, order_unknown: str = "") -> tuple[str, str]:
    """(status, reason) of the answer, as the headline says it: "fail" (exit
    1) exactly when the headline names something to fix, "no_answer" (3)
    where failing nodes could not be judged, else "pass" (0)."""
    if first_comp is not None:
        return "fail", f"computation error at {first_comp.site.node}"
    if diagnosis.get("nan") and diagnosis["nan"]["where"] in ("both", "reference"):
        return "fail", f"NaN in the reference at {diagnosis['nan']['node']}"
    if undecided:
        why = f": the reference dump has no execution order ({order_unknown}) and no dump records what they " \
              "read; give the model (--model) to judge them" if order_unknown else ""
        return "no_answer", f"{len(undecided)} node{'s' if len(undecided) > 1 else ''} with more error than their " \
                            f"precision explains could not be judged{why}"
    if benign:
        return "fail", f"computation error at {benign[0].site.node}, which the outputs absorb"
    if spent is not None:
        return "fail", "the outputs leave their tolerance through accumulated precision loss"
    if first_fail is not None:
        return "pass", "every compared node is within what its precision explains"
    return "pass", "every compared node is within tolerance"


def _place(site, order: ExecutionOrder | None = None) -> str:
    """"Conv, execution #2"; a dump without op types gives only the order,
    a dump without an order only the op type."""
    if order is not None and order.unknown:
        return site.op_type or "op type unknown"
    where = f"execution #{site.order}" + (f" by {order.source}" if order is not None and order.source else "")
    return f"{site.op_type}, {where}" if site.op_type else where


@dataclass(frozen=True)
class ExecutionOrder:
    """What the sites' execution order was read from (a golden dump's
    manifest, its files' modification times...; '' for a model's), and
    why there is none ('' where there is one)."""
    source: str = ""
    unknown: str = ""


LISTED_AT_MOST = 5


def _unordered(comps: list, order: ExecutionOrder) -> str:
    """Computation errors where no execution order says which comes first."""
    names = ", ".join(f"{r.site.node} ({_place(r.site, order)})" for r in comps[:LISTED_AT_MOST])
    more = f" and {len(comps) - LISTED_AT_MOST} more" if len(comps) > LISTED_AT_MOST else ""
    return (f"Computation error{'s' if len(comps) > 1 else ''} at {names}{more}; the reference dump has no execution "
            f"order ({order.unknown}), so none is called first")


def answer_row(first_comp, diagnosis: dict, benign: list | None = None, undecided: list | None = None,
               spent: Spent | None = None, rows: list | None = None) -> tuple[str, Any]:
    """(what the answer is, the row of the node it names) as ``headline``
    words it: the first computation error that changes the outputs; else
    NaN the reference computes; a node that could not be judged; a
    computation error the outputs absorb; the node adding most to outputs
    that leave their tolerance by rounding; else (``pass``) no node."""
    if first_comp is not None:
        return COMPUTATION, first_comp
    nan = diagnosis.get("nan")
    if nan and nan["where"] in ("both", "reference"):
        row = next((r for r in rows or [] if r.site.node == nan["node"] and not r.is_input), None)
        return "nan in the reference", row
    if undecided:
        return UNDECIDED, undecided[0]
    if benign:
        return "computation error the outputs absorb", benign[0]
    if spent is not None:
        return ACCUMULATED, spent.most if spent.most is not None else spent.outputs[0]
    return "pass", None


def headline(first_comp, first_fail, diagnosis: dict, benign: list | None = None,
             undecided: list | None = None, spent: Spent | None = None,
             order: ExecutionOrder | None = None, comps: list | None = None) -> str:
    """The sentence the job answers with: the first computation error that
    changes the outputs (``first_comp``); computation errors the outputs
    absorb (``benign``) are named after it, never as the answer. Failing
    nodes that could not be judged (``undecided``) forbid saying that no
    node computes wrongly on its own. Rounding that each node's precision
    explains is never the headline: "accumulated precision error" is, only
    when the outputs leave their tolerance (``spent``). ``order``: where the
    execution order came from; without one, every computation error that
    changes the outputs (``comps``) is listed and none is called first."""
    benign = benign or []
    undecided = undecided or []
    order = order or ExecutionOrder()
    absorbed = (f"{len(benign)} computation error{'s' if len(benign) > 1 else ''} the outputs absorb (first at "
                f"{benign[0].site.node})") if benign else ""
    if order.unknown:
        absorbed = absorbed.replace("(first at ", "(one at ")
    if first_comp is not None and order.unknown:
        return _unordered(comps or [first_comp], order) + (f"; besides, {absorbed}" if absorbed else "")
    if first_comp is not None:
        text = f"Computation error at {first_comp.site.node} ({_place(first_comp.site, order)})"
        if first_comp.finding.cause:
            text += f", cause: {first_comp.finding.cause}"
        if first_comp.finding.hand_over:
            text += f" (its INT8 hand-over to {', '.join(first_comp.finding.hand_over)})"
        return text + (f"; besides, {absorbed}" if absorbed else "")
    if diagnosis.get("nan") and diagnosis["nan"]["where"] in ("both", "reference"):
        return diagnosis["nan"]["text"]
    if undecided:
        u = undecided[0]
        more = f" and {len(undecided) - 1} more node{'s' if len(undecided) > 2 else ''}" \
            if len(undecided) > 1 else ""
        unseen = "the reference dump has no execution order and no dump records what they read" \
            if order.unknown else "what they read was not compared or is in neither dump"
        return (f"No verdict: {u.site.node} ({_place(u.site, order)}){more} could not be "
                f"judged ({unseen}); no other node is shown to compute "
                "wrongly on its own" + (f"; besides, {absorbed}" if absorbed else ""))
    if absorbed:
        rest = (f"; the outputs' error builds up from {first_fail.site.node} on" if first_fail is not None
                and first_fail.site.node != benign[0].site.node else "")
        return f"No node's own error changes the outputs: {absorbed}{rest}"
    if spent is not None:
        out = spent.outputs[0]
        where = ""
        if spent.most is not None:
            where = (f"; most of it is added at {spent.most.site.node} ({_place(spent.most.site, order)}: "
                     f"relative RMS error {fmt(spent.added)} of its own, within what "
                     f"{spent.most.precision or 'its precision'} explains)")
        return (f"Accumulated precision error: the outputs leave their tolerance ({out.site.tensor}: "
                f"{out.outcome.metrics.errors}/{out.outcome.metrics.total} past atol/rtol, relative RMS error "
                f"{fmt(out.rel_err)}) while every node stays within what its precision explains{where}")
    if first_fail is not None:
        return ("Every compared node is within what its precision explains (the seed's atol/rtol flags "
                f"{first_fail.site.node} and others: rounding, listed as such)")
    return "Every compared node is within tolerance"
