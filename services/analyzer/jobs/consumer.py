"""The consumer of one job's device stream.

Each record from the collector is matched to its reference tensor, its
comparison goes to the executor (local pool or Celery workers), and
comparisons are finished in the order they were submitted, at most
``max_in_flight`` at a time (flow control: the stream waits while the
executor is busy). A finished comparison becomes a report row; a failing
node is examined (``NodeExaminer``) once what it reads is settled.

A device tensor is compared in the reference's layout: the one its shape
tells, or where the shape does not (C == H == W) the dump's dominant one
(``layout.LayoutVote``, fed by every tensor; such a tensor waits for the vote,
bounded by ``LAYOUT_WAIT_BYTES``), and the examination sees it that way too.
A device output that no name settles, in a dump without a graph, is paired
by its values (``valuematch.ValueMatcher``) when the stream ends, so that
names always come first.

Every record arrives holding its receive buffer (``record.lease``); the
consumer releases that hold when it has handled the record, and each reader
that goes on reading the array afterwards (a pending comparison, a device
value kept for an isolated re-run, a node waiting for its examination)
holds its own. The report does not depend on the order the stream arrives
in, nor on the executor or its core count.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from layerdiff.analyzer.align import layout as L
from layerdiff.analyzer.align.values import ValueMatcher
from layerdiff.analyzer.compare.node import SkipNode
from layerdiff.analyzer.diagnose.examiner import NodeExaminer, inherited_words
from layerdiff.analyzer.jobs.budget import DEFAULT_BUDGET, MemoryBudget
from layerdiff.analyzer.report.details import DetailFiles
from layerdiff.analyzer.report.drawer import PlotDrawer
from layerdiff.analyzer.report.files import JobReport, Row
from layerdiff.common.onnxgraph import TensorSite
from layerdiff.common.schema import ROLE_INPUT, STATUS_OK, BufferLease, NodeRecord, dtype_name, original_op

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    site: TensorSite
    rec: NodeRecord
    ref: np.ndarray
    tol: object
    lease: BufferLease | None    # this comparison's own hold on the device buffer
    dev: np.ndarray | None = None   # the device tensor in the reference's layout (a view of rec.array)
    note: str = ""       # how the layout was undone, for the row
    stats: Future | None = None     # its error model figures, made beside the comparison

    @property
    def key(self):
        return (self.site.node, self.rec.slot) if self.rec.role == ROLE_INPUT else self.site.tensor


@dataclass
class _LayoutWait:
    """A comparison held until the dump shows its layout (the shape alone
    does not tell it), with its own hold on the device buffer."""
    site: TensorSite
    rec: NodeRecord
    ref: np.ndarray
    keep: Callable        # keeps the aligned device value for the examination
    lease: BufferLease | None


def _array(rec: NodeRecord) -> np.ndarray:
    """The tensor of a record whose status is OK: the assembler hands a
    record on with its array complete, or as an error."""
    assert rec.array is not None
    return rec.array


# Comparisons held for the layout vote at most (device and reference bytes);
# past it the oldest is compared with what the vote says then.
LAYOUT_WAIT_BYTES = 256 << 20


class StreamConsumer:
    """Takes the records of one job's stream (``take``) and, at the end
    (``finish``), leaves every comparison, skip and examination in ``report``.

    ``references``: called once, when the first reference value is needed
    (the first segment is computed while the collector starts producing).
    ``progress(done, node, passed)``: after each node output is finished.
    """

    def __init__(self, prepared, executor, references: Callable[[], object], report: JobReport,
                 report_dir: Path, progress: Callable[[int, str, bool], None] | None = None,
                 dump_mode: str = "output", injected=None, budget: MemoryBudget = DEFAULT_BUDGET,
                 details: DetailFiles | None = None) -> None:
        """``injected``: where the examiner keeps the device values of nodes
        with an error of their own (layerdiff.analyzer.diagnose.impact); ``budget``:
        what the examiner may keep; ``details``: where each failing row's
        worst elements are written as soon as it is recorded."""
        self.p = prepared
        self.executor = executor
        self._references = references
        self.refs = None
        self.rep = report
        self.report_dir = report_dir
        self.details = details
        self.progress = progress or (lambda done, node, passed: None)
        self.examiner = NodeExaminer(prepared.reference, prepared.feeds, prepared.quantized,
                                     given_ranges=prepared.given_ranges, dump_mode=dump_mode,
                                     groups=prepared.aligner.groups, injected=injected,
                                     cap_bytes=budget.producers, wait_cap_bytes=budget.waiting,
                                     policy=prepared.policy())
        self.limit = getattr(executor, "max_in_flight", 2 * max(1, executor.max_cores))
        # the error model's figures of each pair, not made on the thread that
        # takes the stream: right after the comparison on its core where the
        # executor compares here (LocalPool.submit_with), else on a thread
        # of their own while remote workers compare
        self._stats = ThreadPoolExecutor(max_workers=1, thread_name_prefix="error-stats")
        self.pending: dict[Future, _Pending] = {}
        self.seen: set[str] = set()
        self.seen_inputs: set[tuple] = set()
        self.read_as_input: set[str] = set()
        self.done = 0
        self._plot_names: set[str] = set()
        self._drawer: PlotDrawer | None = None     # made at the first failing node to draw
        self._plots_drawn = 0
        # the dump's dominant layout, for shapes that do not tell theirs
        self.layout = L.LayoutVote()
        self._layout_wait: list[_LayoutWait] = []
        self._layout_wait_bytes = 0
        # value pairing of device tensors no name settles (dumps without a graph)
        self.values: ValueMatcher | None = None
        self._site_of = {s.tensor: s for s in prepared.reference.sites}

    # ------------------------------------------------------------------ intake

    def take(self, rec: NodeRecord) -> None:
        """Handle one record; its own hold on the buffer ends here."""
        try:
            self._take(rec)
        finally:
            if rec.lease is not None:
                rec.lease.release()

    def _reference(self):
        if self.refs is None:
            self.refs = self._references()
        return self.refs

    def _take(self, rec: NodeRecord) -> None:
        rep = self.rep
        rep.device_names.append(rec.name if rec.role != ROLE_INPUT else f"{rec.name} (input {rec.slot})")
        if rec.status != STATUS_OK:
            rep.device_errors.append((rec.name, rec.message))
        if rec.overflow:
            rep.note_overflow(rec.node or rec.name, rec.overflow)
        if rec.role == ROLE_INPUT:
            self._take_input(rec)
            return
        decision = self.p.aligner.match(rec.name, rec.node, rec.slot, original=original_op(rec.attributes))
        site = decision.site
        if site is None and rec.status == STATUS_OK and rec.array is not None and self._by_value():
            self._take_by_value(rec)
            return
        attributed = self.p.aligner.attributed.get(rec.name)
        if site is None and attributed is not None and rec.status == STATUS_OK:
            rep.attributed.append((rec.name, *attributed))   # an INT8 view, a weight copy: not compared
            return
        if site is None:
            rep.invalid_out.append((rec.name, rec.message if rec.status != STATUS_OK
                                    else "not found in the reference model"))
            rep.log_splice_failure(rec)
            return
        self._take_site(rec, site, decision.skip_reason, decision.perm, "the axes the graphs say the device moved",
                        decision.blocked)

    def _take_site(self, rec: NodeRecord, site: TensorSite, skip_reason: str, perm: tuple | None = None,
                   perm_why: str = "", blocked: bool = False) -> None:
        """A device output paired with its reference tensor (by name, graph
        or value; ``perm``: the layout the graphs or the values chose)."""
        rep = self.rep
        if site.tensor in self.seen:
            rep.skipped.append((rec.name, f"duplicate device tensor for {site.tensor!r}"))
            return
        self.seen.add(site.tensor)
        if rec.status != STATUS_OK:
            self._refuse(site.tensor, site.tensor, f"device tensor unusable: {rec.message}", rec)
            return
        if skip_reason:
            rep.user_skipped.add(site.tensor)
            self._refuse(site.tensor, site.tensor, skip_reason)
            return
        ref = self._reference().pop(site.tensor)
        if ref is None:
            missing = getattr(self.p.reference, "missing_reason", None)   # a golden dump's unreadable record
            self._refuse(site.tensor, site.tensor, (missing(site.tensor) if missing else "")
                         or "the reference run produced no value")
            return
        self.examiner.note_range(site.tensor, ref)
        if blocked:      # onnxruntime's NCHWc blocks, which the graphs name: in NCHW, as a copy of its own
            dev, note = L.unblock_nchwc(rec.array, ref)
            if dev is None:
                self._refuse(site.tensor, site.tensor, f"held in a blocked NCHWc layout: {note}", rec)
                return
            rec.array = dev
            self._aligned(site, rec, ref, lambda dev: self.examiner.keep_output(site.tensor, dev, None),
                          undone=note)
            return
        self._aligned(site, rec, ref, lambda dev: self.examiner.keep_output(site.tensor, dev, rec.lease), perm,
                      perm_why)

    # ---------------------------------------------------------- by value

    def _by_value(self) -> bool:
        """Value pairing is the last resort of a dump without a graph."""
        return not self.p.aligner.has_graph

    def _value_matcher(self) -> ValueMatcher:
        if self.values is None:
            refs = self._reference()
            # fingerprinted one segment at a time, then let go
            segments = refs.replay
            # reference tensors map_node_dict (or a graph) decides are no candidates
            # a golden dump's values are files, each read alone
            catalog = self.p.reference if hasattr(self.p.reference, "shape_of") else None
            self.values = ValueMatcher(self.p.reference.sites, segments, layout=self.layout,
                                       exclude=self.p.aligner.claimed, catalog=catalog)
        return self.values

    def _take_by_value(self, rec: NodeRecord) -> None:
        """Held by the matcher until the stream ends (names come first; the
        oldest is decided earlier when the held ones pass its cap)."""
        self._value_verdicts(self._value_matcher().offer(rec.name, _array(rec), self.seen, keep=rec,
                                                         lease=rec.lease))

    def _value_verdicts(self, decided) -> None:
        for i, (rec, v, lease) in enumerate(decided):
            try:
                self._value_verdict(rec, v)
            except BaseException:
                for _, _, held in decided[i + 1:]:
                    if held is not None:
                        held.release()
                raise
            finally:
                if lease is not None:
                    lease.release()

    def _value_verdict(self, rec: NodeRecord, v) -> None:
        if v.kind == "match":
            site = self._site_of[v.tensor]
            self.rep.value_pairs.append({"reference_tensor": v.tensor, "device_tensor": rec.name,
                                         "method": "value", "confidence": v.confidence, "note": v.note})
            self._take_site(rec, site, self.p.aligner.skip_reason_for(site), v.perm,
                            "the layout the values fit: the shape fits several")
        elif v.kind == "unmatched":
            self.rep.invalid_out.append((rec.name, f"not found in the reference model; {v.note}"))
            self.rep.log_splice_failure(rec)

    def _settle_values(self) -> None:
        """The stream has ended: the device tensors held undecided are
        decided against the reference tensors nobody claimed."""
        if self.values is not None:
            self._value_verdicts(self.values.settle(self.seen))

    # ------------------------------------------------------------- layout

    def _aligned(self, site: TensorSite, rec: NodeRecord, ref: np.ndarray, keep: Callable,
                 perm: tuple | None = None, perm_why: str = "", undone: str = "") -> None:
        """Compare the device tensor in the reference's layout: the one its
        shape tells, the dump's dominant one where it does not (held until
        the vote decides), or ``perm`` (chosen by the graphs or the values,
        where it fits the shapes)."""
        dev = _array(rec)
        ndim = dev.ndim
        was = self.layout.decided(ndim)
        self.layout.note(ref.shape, dev.shape)
        p, note, undecided = L.resolve(ref.shape, dev.shape, self.layout)
        if perm is not None and L.fits(tuple(perm), dev.shape, ref.shape):
            if tuple(perm) != p:
                p = tuple(perm)
                note = L.note_for(p, ref.shape) + (f" ({perm_why})" if p != L.identity(ndim) else "")
            undecided = False
        if undone:      # what was undone before (NCHWc blocks)
            note = f"{undone}; {note}" if note else undone
        if undecided:
            lease = rec.lease.retain() if rec.lease is not None else None
            self._layout_wait.append(_LayoutWait(site, rec, ref, keep, lease))
            self._layout_wait_bytes += ref.nbytes + dev.nbytes
            while self._layout_wait_bytes > LAYOUT_WAIT_BYTES and self._layout_wait:
                self._release_wait(self._layout_wait.pop(0), early=True)
            return
        self._dispatch(site, rec, ref, keep, p, note)
        if was is None and self.layout.decided(ndim) is not None and self._layout_wait:
            self._flush_layout()

    def _dispatch(self, site: TensorSite, rec: NodeRecord, ref: np.ndarray, keep: Callable, p, note: str) -> None:
        dev = _array(rec)
        if p is not None and p != L.identity(dev.ndim):
            dev = dev.reshape(ref.shape) if L.keeps_order(p, ref.shape) else dev.transpose(p)
        keep(dev)
        self._submit(site, rec, ref, dev, note)

    def _release_wait(self, w: _LayoutWait, early: bool = False) -> None:
        dev = _array(w.rec)
        self._layout_wait_bytes -= w.ref.nbytes + dev.nbytes
        try:
            p, note, _ = L.resolve(w.ref.shape, dev.shape, self.layout)
            if early:
                note += (f"; compared before the dump showed its layout (the tensors held for it reached "
                         f"{LAYOUT_WAIT_BYTES >> 20} MiB)")
            self._dispatch(w.site, w.rec, w.ref, w.keep, p, note)
        finally:
            if w.lease is not None:
                w.lease.release()

    def _flush_layout(self, final: bool = False) -> None:
        """Compare the held tensors whose rank the vote has decided (all of
        them once the stream has ended)."""
        if final:
            self.layout.close()
        held, self._layout_wait = self._layout_wait, []
        for i, w in enumerate(held):
            if final or self.layout.decided(_array(w.rec).ndim) is not None:
                try:
                    self._release_wait(w)
                except BaseException:
                    self._layout_wait = [x for x in held[i + 1:]] + self._layout_wait
                    raise
            else:
                self._layout_wait.append(w)

    def _take_input(self, rec: NodeRecord) -> None:
        """Input k of a node against the reference tensor that node reads."""
        rep = self.rep
        node = rec.node or rec.name
        decision = self.p.aligner.match(node, tensor=False)
        if decision.site is None:
            rep.invalid_out.append((f"{node} (input {rec.slot})", rec.message if rec.status != STATUS_OK
                                    else "not a node of the reference model"))
            return
        owner = decision.site
        ins = self.p.reference.node_inputs.get(owner.node, [])
        shown = f"{owner.node} (input {rec.slot})"
        if owner.node in getattr(self.p.reference, "presumed", {}):
            rep.skipped.append((shown, "the reference dump holds no inputs of this node"))
            return
        if rec.slot >= len(ins) or not ins[rec.slot]:
            rep.invalid_out.append((shown, f"the reference node has {len(ins)} inputs"))
            return
        key = (owner.node, rec.slot)
        site = TensorSite(ins[rec.slot], owner.node, owner.op_type, owner.order, rec.slot)
        if key in self.seen_inputs:
            rep.skipped.append((shown, "duplicate device input"))
            return
        self.seen_inputs.add(key)
        if rec.status != STATUS_OK:
            self._refuse(key, shown, f"device tensor unusable: {rec.message}", rec, counts=False)
            return
        if decision.skip_reason:
            self._refuse(key, shown, decision.skip_reason, counts=False)
            return
        ref = self._reference().value_of(site.tensor)
        if ref is None:
            self._refuse(key, shown, f"the reference value of {site.tensor!r} was already released: give the "
                                     "job dump_mode input or all", counts=False)
            return
        self.read_as_input.add(site.tensor)
        self._aligned(site, rec, ref, lambda dev: self.examiner.keep_input(owner.node, rec.slot, dev, rec.lease))

    def _refuse(self, key, shown: str, reason: str, rec: NodeRecord | None = None, counts: bool = True) -> None:
        """Not compared, for a reason of the data: a skip, and settled for
        the nodes that read it."""
        self.rep.skipped.append((shown, reason))
        if rec is not None:
            self.rep.log_splice_failure(rec)
        self.examiner.settle(key)
        if counts:
            self.done += 1

    # ------------------------------------------------------------ comparisons

    def _submit(self, site: TensorSite, rec: NodeRecord, ref: np.ndarray, dev: np.ndarray | None = None,
                note: str = "") -> None:
        """``dev``: the device tensor already in the reference's layout (a
        view; the executor then finds equal shapes), ``note`` says how."""
        self._drain(self.limit - 1)
        dev = rec.array if dev is None else dev
        tol = self.p.tolerances.for_node(site.node, site.tensor)
        lease = rec.lease.retain() if rec.lease is not None else None
        try:
            figures = self.examiner.stats_for(site, rec.role == ROLE_INPUT)
            if dev is None:
                fut, stats = self.executor.submit(ref, dev, tol, self.p.diff_cnt, self.p.force_compare), None
            elif hasattr(self.executor, "submit_with"):    # compared here: the figures next, on the same core
                fut, stats = self.executor.submit_with(ref, dev, tol, self.p.diff_cnt, self.p.force_compare, figures)
            else:
                fut = self.executor.submit(ref, dev, tol, self.p.diff_cnt, self.p.force_compare)
                stats = self._stats.submit(figures, ref, dev, self.p.force_compare)
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        self.pending[fut] = _Pending(site, rec, ref, tol, lease, dev, note, stats)

    def finish_done(self) -> None:
        """Record the comparisons already finished at the head (the stream
        is quiet: their rows and progress need not wait for more records)."""
        self._drain(len(self.pending))

    def _drain(self, keep: int) -> None:
        """Finish comparisons in the order they were submitted until at most
        ``keep`` are pending, and any already done at the head."""
        while self.pending:
            head = next(iter(self.pending))
            if len(self.pending) <= keep and not head.done():
                return
            while not head.done():
                # not wait([head]) alone: a future cancelled in its executor's
                # queue (Cancel) is done but never wakes a waiter
                wait([head], timeout=0.5)
            self._finished(head)

    def _finished(self, fut: Future) -> None:
        item = self.pending.pop(fut)
        try:
            self._record(item, fut)
        finally:
            if item.lease is not None:
                item.lease.release()

    def _record(self, item: _Pending, fut: Future) -> None:
        site, rec, p = item.site, item.rec, self.p
        dev = _array(rec) if item.dev is None else item.dev
        try:
            outcome = fut.result()
            if item.note and not outcome.note:
                outcome.note = item.note
        except SkipNode as e:
            shown = f"{site.node} (input {rec.slot})" if rec.role == ROLE_INPUT else site.tensor
            self.rep.skipped.append((shown, str(e)))
            self.examiner.settle(item.key)
            passed = True
        else:
            row = Row(site, rec.name, outcome, role=rec.role, overflow=rec.overflow,
                      device_dtype=rec.source_dtype or dtype_name(dev.dtype),
                      constants_read=p.reference.constants_read(site.node),
                      reads=tuple(t for t in p.reference.node_inputs.get(site.node, [])
                                  if t and t not in p.feeds))   # model inputs are exact on both sides
            if row.failed and p.show_graph:
                if p.max_plots is None or self._plots_drawn < p.max_plots:
                    self._draw(row, item.ref, dev, item.tol, item.lease)
                else:
                    self.rep.plots_left += 1
            self.examiner.row_done(row, item.ref, dev, item.lease, item.tol, p.force_compare,
                                   item.stats.result() if item.stats is not None else None)
            self.rep.rows.append(row)
            if self.details is not None:
                self.details.add(row)
            passed = not row.failed
        if rec.role == ROLE_INPUT:
            return   # progress counts node outputs
        self.done += 1
        self.progress(self.done, site.tensor, passed)

    def _draw(self, row: Row, ref, dev, tol, lease: BufferLease | None) -> None:
        """The node's plots, drawn beside the comparisons (report.drawer);
        the device buffer they read is retained until they are drawn."""
        from layerdiff.analyzer.compare.node import reconcile
        from layerdiff.analyzer.report.plots import node_plots
        from layerdiff.common.names import safe_filename

        p = self.p
        if self._drawer is None:
            self._drawer = PlotDrawer()
        # the file and its title name the same thing: the node (its tensor where it has several, or an input)
        name = row.label if row.is_input or row.site.output_index else row.site.node
        stem = safe_filename(name, self._plot_names)

        def draw() -> dict:
            aligned, _ = reconcile(ref, dev, True)
            return node_plots(self.report_dir, stem, ref, aligned, max_bins=p.max_bins, min_bins=p.min_bins,
                              atol=tol.atol, rtol=tol.rtol, title=name)

        self._plots_drawn += 1
        held = lease.retain() if lease is not None else None
        self._drawer.submit(row.label, draw, held.release if held is not None else None)

    def _drawn(self) -> None:
        """Every plot submitted, drawn, in the report (or why not)."""
        if self._drawer is None:
            return
        for label, got in self._drawer.results():
            if isinstance(got, Exception):    # a plot is an extra: the comparison stands without it
                log.warning("no plots for %s: %s", label, got)
                self.rep.skipped.append((label, f"plots not drawn: {got}"))
            else:
                self.rep.plots[label] = got
        self._drawer = None

    # ------------------------------------------------------------------- end

    def finish(self) -> None:
        """The stream has ended: finish every comparison and examination,
        and account for the reference tensors the device never sent."""
        self._reference()   # surfaces reference errors even for an empty stream
        self._settle_values()
        self._flush_layout(final=True)
        self._drain(0)
        self._stats.shutdown(wait=True)
        self._drawn()
        self.examiner.finish()
        rep = self.rep
        for row in rep.rows:        # budgets with every type the device stored in known
            if not row.is_input and not row.is_constant:
                self.examiner.judge_budget(row, final=True)
                if row.inherited:
                    row.inherited = inherited_words(row)
        rep.input_ranges = self.examiner.input_ranges
        rep.quantized = self.examiner.quantized
        rep.range_skips = list(self.p.range_skips)
        fused = self.p.aligner.fused   # reference tensor -> the device node computing it inside
        for s in self.p.reference.sites:
            if s.tensor in self.seen or s.tensor in self.read_as_input:
                continue
            reason = self.p.aligner.skip_reason_for(s)
            if reason:
                rep.user_skipped.add(s.tensor)
                rep.skipped.append((s.tensor, reason))
            elif s.tensor in fused:
                rep.fused.append((s, fused[s.tensor]))
            elif s.tensor in self.p.aligner.folded:
                rep.folded.append((s, self.p.aligner.folded[s.tensor]))
            else:
                rep.not_dumped.append(s)

    def abandon(self) -> None:
        """The job stops early (cancelled, failed): let go of every buffer
        (once nothing reads it)."""
        self._stats.shutdown(wait=True, cancel_futures=True)
        if self._drawer is not None:
            self._drawer.abandon()
            self._drawer = None
        if self.values is not None:
            self.values.release()
        for w in self._layout_wait:
            if w.lease is not None:
                w.lease.release()
        self._layout_wait.clear()
        self._layout_wait_bytes = 0
        for item in self.pending.values():
            if item.lease is not None:
                item.lease.release()
        self.pending.clear()
        self.examiner.abandon()
